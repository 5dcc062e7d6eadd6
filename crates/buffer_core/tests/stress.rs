//! Many OS threads against small limits: the limits hold at every instant, and no group is lost or
//! handed out twice. Complements the loom models, which explore every interleaving of 2-3 threads.
#![cfg(not(loom))]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use buffer_core::{Admission, Counts, GroupBuffer, GroupVersions, Limits};

const THREADS: usize = 12;

/// Raise `high_water` to at least `counts` (inflight in one atomic, inflight + buffered in the other).
fn record(high_water: &(AtomicU32, AtomicU32), counts: Counts) {
    high_water.0.fetch_max(counts.inflight, Ordering::Relaxed);
    high_water
        .1
        .fetch_max(counts.inflight + counts.buffered, Ordering::Relaxed);
}

const MAX_INFLIGHT: u32 = 3;
const MAX_BUFFERED: u32 = 5;

/// One contended run; returns the high-water marks of `inflight` and `inflight + buffered`.
fn contended_admission_run() -> (u32, u32) {
    let admission = Admission::new(MAX_INFLIGHT, MAX_BUFFERED, Counts::default());
    // Every value a successful CAS or a finish installs is recorded (only those can raise a count),
    // plus a sample of the word after each admission.
    let high_water = (AtomicU32::new(0), AtomicU32::new(0));
    let buffered_now = Mutex::new(0u32);
    let admitted = AtomicU32::new(0);
    thread::scope(|scope| {
        for thread_index in 0..THREADS {
            let (admission, high_water, buffered_now, admitted) =
                (&admission, &high_water, &buffered_now, &admitted);
            scope.spawn(move || {
                // Each thread holds the groups it admitted until a limit refuses it, so the counters
                // keep running into both limits.
                let mut holding = Vec::new();
                for iteration in 0..20_000usize {
                    match admission.try_acquire() {
                        Ok(counts) => {
                            // The counts the CAS installed, and a sample of the word itself.
                            record(high_water, counts);
                            record(high_water, admission.counts());
                            admitted.fetch_add(1, Ordering::Relaxed);
                            holding.push(iteration);
                        }
                        Err(_) => {
                            if let Some(held) = holding.pop() {
                                if (held + thread_index) % 7 == 0 {
                                    record(high_water, admission.release_inflight());
                                } else {
                                    let mut buffered = buffered_now.lock().unwrap();
                                    record(high_water, admission.finish_one());
                                    *buffered += 1;
                                }
                            }
                        }
                    }
                    // The trainer role: release what is buffered, as take_batch does under its lock.
                    if thread_index % 4 == 0 && iteration % 3 == 0 {
                        let mut buffered = buffered_now.lock().unwrap();
                        if *buffered > 0 {
                            admission.release_buffered(*buffered);
                            *buffered = 0;
                        }
                    }
                }
                for _ in holding.drain(..) {
                    record(high_water, admission.release_inflight());
                }
            });
        }
    });
    assert!(
        admitted.load(Ordering::Relaxed) > 1000,
        "the test must exercise admission"
    );
    let end = admission.counts();
    assert_eq!(end.inflight, 0);
    assert_eq!(end.buffered, *buffered_now.lock().unwrap());
    (
        high_water.0.load(Ordering::Relaxed),
        high_water.1.load(Ordering::Relaxed),
    )
}

#[test]
fn packed_counters_never_exceed_either_limit_under_contention() {
    // Never exceeded in any run; reached (so the run exercised the limits) in at least one. On a loaded
    // machine one run may not bring the threads together often enough to reach both.
    let mut reached = (0, 0);
    for _ in 0..20 {
        let (inflight, total) = contended_admission_run();
        assert!(
            inflight <= MAX_INFLIGHT && total <= MAX_BUFFERED,
            "{inflight}, {total}"
        );
        reached = (reached.0.max(inflight), reached.1.max(total));
        if reached == (MAX_INFLIGHT, MAX_BUFFERED) {
            return;
        }
    }
    panic!("the limits were never reached: high water {reached:?}");
}

#[test]
fn group_buffer_keeps_its_limits_and_every_group_with_many_threads() {
    let limits = Limits::new(3, 5, 0, None).unwrap();
    let buffer = Arc::new(GroupBuffer::new(limits));
    let done = AtomicBool::new(false);
    let trained = Mutex::new(Vec::<u64>::new());
    let abandoned = Mutex::new(Vec::<u64>::new());
    let admitted = Mutex::new(Vec::<u64>::new());
    let samples = AtomicU32::new(0);
    thread::scope(|scope| {
        // A sampler: reads the packed word as often as it can while everybody else works.
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let counts = buffer.counts();
                assert!(counts.inflight <= 3, "{counts:?}");
                assert!(counts.total() <= 5, "{counts:?}");
                samples.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Two trainers: take whatever batch of 1-2 is available.
        let trainers: Vec<_> = (0..2)
            .map(|trainer| {
                let (buffer, done, trained) = (&buffer, &done, &trained);
                scope.spawn(move || {
                    while !done.load(Ordering::Relaxed) {
                        // Trainer 0 polls; trainer 1 waits for completions.
                        let batch = if trainer == 0 {
                            buffer.take_batch(1, 0)
                        } else {
                            buffer.wait_batch(2, 0, Duration::from_millis(5))
                        };
                        let batch = batch.unwrap_or_else(|error| panic!("{error}"));
                        if batch.is_ready() {
                            trained
                                .lock()
                                .unwrap()
                                .extend(batch.groups.iter().map(|group| group.group_id));
                        } else {
                            thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        // Nine agent loops: admit (waiting), then finish or, now and then, abandon.
        let loops: Vec<_> = (0..THREADS - 3)
            .map(|agent| {
                let (buffer, abandoned, admitted) = (&buffer, &abandoned, &admitted);
                scope.spawn(move || {
                    for iteration in 0..2_000u64 {
                        let prompt_index = agent as u64 * 1_000_000 + iteration;
                        let Some(group_id) =
                            buffer.wait_admit(prompt_index, Duration::from_secs(30))
                        else {
                            panic!("no capacity within 30 s: a wake-up was lost");
                        };
                        admitted.lock().unwrap().push(group_id);
                        if iteration % 11 == 0 {
                            assert_eq!(buffer.abandon(group_id), Ok(prompt_index));
                            abandoned.lock().unwrap().push(group_id);
                        } else {
                            let versions = GroupVersions {
                                earliest_version: 0,
                                latest_version: 0,
                                finish_version: 0,
                            };
                            buffer.complete(group_id, versions).unwrap();
                        }
                    }
                })
            })
            .collect();
        for agent in loops {
            agent.join().unwrap();
        }
        // Drain what the trainers have not taken yet.
        while buffer.counts().buffered > 0 {
            thread::yield_now();
        }
        done.store(true, Ordering::Relaxed);
        for trainer in trainers {
            trainer.join().unwrap();
        }
    });
    let admitted = admitted.into_inner().unwrap();
    let trained = trained.into_inner().unwrap();
    let abandoned = abandoned.into_inner().unwrap();
    let unique: HashSet<u64> = trained.iter().chain(&abandoned).copied().collect();
    assert_eq!(
        unique.len(),
        trained.len() + abandoned.len(),
        "a group left twice"
    );
    assert_eq!(
        unique,
        admitted.iter().copied().collect(),
        "a group was lost"
    );
    assert_eq!(admitted.len(), (THREADS - 3) * 2_000);
    assert!(samples.load(Ordering::Relaxed) > 0);
    assert_eq!(buffer.counts(), Counts::default());
}
