//! The admission cycle, Rust side only: `cargo bench -p buffer_core --bench admission`.
//!
//! One round puts `ROUND` groups through the buffer: admit each, complete each with versions (a
//! quarter of them three versions old), then one `take_batch(3 * ROUND / 4)` at the current actor
//! version with `max_actor_accept_staleness = 2`, which drops the stale quarter and hands out the
//! rest. A cycle is one group through the buffer: the round's cost divided by `ROUND`. The round is
//! `buffer_core::workload::run_round` (the `workload` feature, which this bench requires).
//!
//! Measured with `in_flight` groups already generating and as many finished groups in the heap, for
//! `in_flight` in 0, 1e3, 1e5 and 1e6, single-threaded and from 8 threads sharing one buffer. Each
//! case is timed twice: `wall` (elapsed time) and `cpu` (CPU time of the thread, or of the process
//! for the 8-thread case), which stays meaningful when other processes compete for the cores.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use buffer_core::workload::{prefilled, run_round, ROUND};
use buffer_core::GroupBuffer;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// CPU time consumed so far by the calling thread or by the whole process.
fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec that outlives the call; clock_gettime only writes
    // it. Both clock ids are supported on every Linux.
    let status = unsafe { libc::clock_gettime(clock, &mut now) };
    assert_eq!(status, 0, "clock_gettime failed");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}
const THREADS: usize = 8;

/// One round of the shared workload; a refusal or error is a bug in the benchmark's setup.
fn round(buffer: &GroupBuffer, group_ids: &mut Vec<u64>) {
    black_box(run_round(buffer, group_ids).expect("the prefilled buffer has room for a round"));
}

fn single_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_cycle");
    group.throughput(Throughput::Elements(ROUND as u64));
    for in_flight in [0usize, 1_000, 100_000, 1_000_000] {
        let buffer = prefilled(in_flight, THREADS);
        let mut ids = Vec::with_capacity(ROUND);
        group.bench_function(BenchmarkId::new("1_thread_wall", in_flight), |b| {
            b.iter(|| round(&buffer, &mut ids))
        });
        group.bench_function(BenchmarkId::new("1_thread_cpu", in_flight), |b| {
            b.iter_custom(|iterations| {
                let start = cpu_time(libc::CLOCK_THREAD_CPUTIME_ID);
                for _ in 0..iterations {
                    round(&buffer, &mut ids);
                }
                cpu_time(libc::CLOCK_THREAD_CPUTIME_ID) - start
            })
        });
    }
    group.finish();
}

/// Eight threads each run `iterations` rounds on one buffer; returns (wall, process CPU) time.
fn eight_thread_rounds(buffer: &GroupBuffer, iterations: u64) -> (Duration, Duration) {
    let barrier = Barrier::new(THREADS + 1);
    let (start, start_cpu) = std::thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| {
                let mut ids = Vec::with_capacity(ROUND);
                barrier.wait();
                for _ in 0..iterations {
                    round(buffer, &mut ids);
                }
            });
        }
        let start_cpu = cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID);
        barrier.wait();
        (Instant::now(), start_cpu)
        // The scope joins every thread before it returns.
    });
    (
        start.elapsed(),
        cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID) - start_cpu,
    )
}

fn eight_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_cycle");
    // Per iteration, each of the 8 threads runs one round.
    group.throughput(Throughput::Elements((THREADS * ROUND) as u64));
    let buffer = prefilled(1_000, THREADS);
    group.bench_function(BenchmarkId::new("8_threads_wall", 1_000), |b| {
        b.iter_custom(|iterations| eight_thread_rounds(&buffer, iterations).0)
    });
    group.bench_function(BenchmarkId::new("8_threads_cpu", 1_000), |b| {
        b.iter_custom(|iterations| eight_thread_rounds(&buffer, iterations).1)
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
