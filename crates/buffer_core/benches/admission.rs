//! The admission cycle, Rust side only: `cargo bench -p buffer_core --bench admission`.
//!
//! One round puts `ROUND` groups through the buffer: admit each, complete each with versions (a
//! quarter of them three versions old), then one `take_batch(3 * ROUND / 4)` at the current actor
//! version with `max_actor_accept_staleness = 2`, which drops the stale quarter and hands out the
//! rest. A cycle is one group through the buffer: the round's cost divided by `ROUND`. The same
//! workload runs from Python in `benchmarks/micro/admission.py`.
//!
//! Measured with `in_flight` groups already generating and as many finished groups in the heap, for
//! `in_flight` in 0, 1e3, 1e5 and 1e6, single-threaded and from 8 threads sharing one buffer.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use buffer_core::{GroupBuffer, GroupVersions, Limits};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const ROUND: usize = 64;
const VERSION: i64 = 1_000;
const THREADS: usize = 8;

/// A buffer holding `in_flight` generating groups and `in_flight` finished ones.
fn prefilled(in_flight: usize) -> GroupBuffer {
    // All 2 * in_flight are admitted before half of them finish.
    let capacity = (2 * in_flight + THREADS * ROUND) as i64;
    let limits = Limits::new(capacity, 2 * capacity, i64::MAX, Some(2)).unwrap();
    let buffer = GroupBuffer::new(limits);
    let finished: Vec<u64> = (0..in_flight)
        .map(|prompt| buffer.try_admit(prompt as u64).unwrap())
        .collect();
    for _ in 0..in_flight {
        buffer.try_admit(0).unwrap();
    }
    let newest = GroupVersions {
        earliest_version: VERSION,
        latest_version: VERSION,
        finish_version: VERSION,
    };
    for group_id in finished {
        buffer.complete(group_id, newest).unwrap();
    }
    buffer
}

fn round(buffer: &GroupBuffer, ids: &mut VecDeque<u64>) {
    for prompt in 0..ROUND as u64 {
        ids.push_back(buffer.try_admit(prompt).unwrap());
    }
    for offset in 0..ROUND as i64 {
        let group_id = ids.pop_front().unwrap();
        let versions = GroupVersions {
            earliest_version: VERSION - offset % 4,
            latest_version: VERSION,
            finish_version: VERSION,
        };
        buffer.complete(group_id, versions).unwrap();
    }
    black_box(buffer.take_batch(3 * ROUND / 4, VERSION).unwrap());
}

fn single_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_cycle");
    group.throughput(Throughput::Elements(ROUND as u64));
    for in_flight in [0usize, 1_000, 100_000, 1_000_000] {
        let buffer = prefilled(in_flight);
        let mut ids = VecDeque::with_capacity(ROUND);
        group.bench_function(BenchmarkId::new("1_thread", in_flight), |b| {
            b.iter(|| round(&buffer, &mut ids))
        });
    }
    group.finish();
}

fn eight_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_cycle");
    // Throughput per iteration: each of the 8 threads runs one round.
    group.throughput(Throughput::Elements((THREADS * ROUND) as u64));
    let buffer = prefilled(1_000);
    group.bench_function(BenchmarkId::new("8_threads", 1_000), |b| {
        b.iter_custom(|iterations| {
            let barrier = Barrier::new(THREADS + 1);
            std::thread::scope(|scope| {
                for _ in 0..THREADS {
                    scope.spawn(|| {
                        let mut ids = VecDeque::with_capacity(ROUND);
                        barrier.wait();
                        for _ in 0..iterations {
                            round(&buffer, &mut ids);
                        }
                    });
                }
                barrier.wait();
                let start = Instant::now();
                // The scope joins every thread before it returns.
                start
            })
            .elapsed()
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = single_thread, eight_threads
}
criterion_main!(benches);
