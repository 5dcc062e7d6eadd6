//! loom models of the admission protocol: every interleaving of the threads below is explored.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p buffer_core --release --test loom
//! ```
//!
//! loom's state space grows exponentially with threads and operations (the relaxed loads alone can
//! read any older value of the word), so the models are small: two threads explored exhaustively, and
//! three threads explored with at most `PREEMPTION_BOUND` preemptions per execution (loom's
//! recommended bound; the 3-thread models take over ten minutes unbounded). `tests/stress.rs` runs 12
//! OS threads against small limits.
#![cfg(loom)]

use std::time::Duration;

use buffer_core::{Admission, Clock, Counts, GroupBuffer, GroupVersions, Limits};
use loom::model::Builder;
use loom::sync::Arc;
use loom::thread;

const PREEMPTION_BOUND: usize = 3;

/// Explore every interleaving of `model`, or every one with at most `preemption_bound` preemptions.
fn explore(preemption_bound: Option<usize>, model: impl Fn() + Sync + Send + 'static) {
    let mut builder = Builder::new();
    builder.preemption_bound = preemption_bound;
    builder.check(model);
}

/// Time stands still in the models: the wait accounting is not what they check.
struct FrozenClock;

impl Clock for FrozenClock {
    fn now_ns(&self) -> u64 {
        0
    }
}

const VERSIONS: GroupVersions = GroupVersions {
    earliest_version: 0,
    latest_version: 0,
    finish_version: 0,
};

fn within(counts: Counts, max_inflight: u32, max_buffered: u32) -> bool {
    counts.inflight <= max_inflight && counts.total() <= u64::from(max_buffered)
}

/// `num_threads` threads each admit once, then finish (the last one abandons instead), against an
/// in-flight limit of 1 and a buffer limit of 2.
fn packed_admission_model(num_threads: usize) {
    let admission = Arc::new(Admission::new(1, 2, Counts::default()));
    let threads: Vec<_> = (0..num_threads)
        .map(|thread_index| {
            let admission = Arc::clone(&admission);
            thread::spawn(move || {
                let Ok(counts) = admission.try_acquire() else {
                    return 0;
                };
                // Both the counts the CAS installed and the word as it is now, whatever the other
                // thread did meanwhile, respect the limits.
                assert!(within(counts, 1, 2), "{counts:?}");
                assert!(within(admission.counts(), 1, 2));
                let abandons = thread_index + 1 == num_threads;
                let counts = if abandons {
                    admission.release_inflight()
                } else {
                    admission.finish_one()
                };
                assert!(within(counts, 1, 2), "{counts:?}");
                assert!(within(admission.counts(), 1, 2));
                u32::from(!abandons)
            })
        })
        .collect();
    let finished: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(
        admission.counts(),
        Counts {
            inflight: 0,
            buffered: finished
        }
    );
}

#[test]
fn packed_admission_never_exceeds_either_limit_two_threads_exhaustive() {
    explore(None, || packed_admission_model(2));
}

#[test]
fn packed_admission_never_exceeds_either_limit_three_threads() {
    explore(Some(PREEMPTION_BOUND), || packed_admission_model(3));
}

/// `num_agents` agent threads each admit and complete one group while a trainer takes a batch of one,
/// against an in-flight limit of 1 and a buffer limit of 2.
fn admit_complete_take_model(num_agents: u64) {
    {
        let limits = Limits::new(1, 2, 0, None).unwrap();
        let buffer = Arc::new(GroupBuffer::with_clock(limits, FrozenClock));
        let agents: Vec<_> = (0..num_agents)
            .map(|prompt_index| {
                let buffer = Arc::clone(&buffer);
                thread::spawn(move || {
                    let group_id = buffer.try_admit(prompt_index)?;
                    assert!(within(buffer.counts(), 1, 2));
                    buffer.complete(group_id, VERSIONS).unwrap();
                    assert!(within(buffer.counts(), 1, 2));
                    Some(group_id)
                })
            })
            .collect();
        let trainer = {
            let buffer = Arc::clone(&buffer);
            thread::spawn(move || {
                let batch = buffer.take_batch(1, 0).unwrap();
                batch
                    .groups
                    .iter()
                    .map(|group| group.group_id)
                    .collect::<Vec<u64>>()
            })
        };
        let admitted: Vec<u64> = agents
            .into_iter()
            .filter_map(|agent| agent.join().unwrap())
            .collect();
        let trained = trainer.join().unwrap();
        let buffered: Vec<u64> = buffer
            .buffered_groups()
            .iter()
            .map(|group| group.group_id)
            .collect();
        // Every admitted group is either trained or still buffered, exactly once.
        let mut accounted: Vec<u64> = trained.iter().chain(&buffered).copied().collect();
        accounted.sort_unstable();
        let mut admitted = admitted;
        admitted.sort_unstable();
        assert_eq!(accounted, admitted);
        assert!(!admitted.is_empty(), "the first admission always fits");
        assert_eq!(
            buffer.counts(),
            Counts {
                inflight: 0,
                buffered: buffered.len() as u32
            }
        );
    }
}

#[test]
fn admit_complete_and_take_keep_the_limits_and_every_group_two_threads_exhaustive() {
    explore(None, || admit_complete_take_model(1));
}

#[test]
fn admit_complete_and_take_keep_the_limits_and_every_group_three_threads() {
    explore(Some(PREEMPTION_BOUND), || admit_complete_take_model(2));
}

#[test]
fn a_waiting_admission_is_woken_by_every_kind_of_release() {
    // Limits of one: the waiter can only get in once the first group has left the buffer entirely,
    // after a completion and a hand-out (or an abandon), each of which must wake it.
    for abandon in [false, true] {
        explore(None, move || {
            let limits = Limits::new(1, 1, 0, None).unwrap();
            let buffer = Arc::new(GroupBuffer::with_clock(limits, FrozenClock));
            let first = buffer.try_admit(0).unwrap();
            let waiter = {
                let buffer = Arc::clone(&buffer);
                // loom's condition variable never times out, so a lost wake-up is a deadlock, which
                // loom reports.
                thread::spawn(move || buffer.wait_admit(1, Duration::from_secs(3600)))
            };
            if abandon {
                assert_eq!(buffer.abandon(first), Ok(0));
            } else {
                buffer.complete(first, VERSIONS).unwrap();
                buffer.take_batch(1, 0).unwrap();
            }
            assert_eq!(waiter.join().unwrap(), Some(1));
            assert_eq!(
                buffer.counts(),
                Counts {
                    inflight: 1,
                    buffered: 0
                }
            );
        });
    }
}

#[test]
fn a_waiting_hand_off_is_woken_by_a_completion() {
    explore(None, || {
        let limits = Limits::new(1, 2, 0, None).unwrap();
        let buffer = Arc::new(GroupBuffer::with_clock(limits, FrozenClock));
        let group_id = buffer.try_admit(5).unwrap();
        let trainer = {
            let buffer = Arc::clone(&buffer);
            // loom's condition variable never times out, so a lost wake-up is a deadlock, which loom
            // reports.
            thread::spawn(move || buffer.wait_batch(1, 0, Duration::from_secs(3600)))
        };
        assert!(buffer.complete(group_id, VERSIONS).unwrap());
        let hand_off = trainer.join().unwrap().unwrap();
        assert_eq!(hand_off.groups.len(), 1);
        assert_eq!(hand_off.groups[0].prompt_index, 5);
        assert_eq!(buffer.counts(), Counts::default());
    });
}
