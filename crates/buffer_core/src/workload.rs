//! The criterion bench's fixed workload (`benches/admission.rs`), with tests that it does what the bench
//! says. Compiled with the `workload` feature only (which `cargo test` and `cargo bench` turn on), so it
//! never ships in the Python extension.
//!
//! One round puts `ROUND` groups through a buffer: admit each (`try_admit`), complete each with its
//! versions (a quarter of them three versions old), then one `take_batch(BATCH_SIZE)` at actor version
//! `VERSION`. With `max_actor_accept_staleness = 2` that drops the stale quarter and hands out the
//! rest. A cycle is one group through the buffer.

use crate::buffer::GroupBuffer;
use crate::clock::Clock;
use crate::error::{BufferError, Result};
use crate::heap::GroupVersions;
use crate::limits::Limits;

/// Groups admitted, completed and taken per round.
pub const ROUND: usize = 64;
/// Groups handed out per round: the three quarters of a round that are within the staleness cap.
pub const BATCH_SIZE: usize = 3 * ROUND / 4;
/// The actor version of every `take_batch`, and the latest and finish version of every group.
pub const VERSION: i64 = 1_000;
/// The staleness cap the workload is meant for: drops exactly the quarter three versions old.
pub const STALENESS_CAP: i64 = 2;

/// What rounds of the workload did to a buffer. Over rounds that all succeeded, `admitted ==
/// completed`, and `handed_out + dropped` equals `completed` plus the change in the buffer's
/// finished-group count, taken with the opposite sign.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkloadCounts {
    pub num_rounds: u64,
    pub admitted: u64,
    pub completed: u64,
    pub handed_out: u64,
    pub dropped: u64,
}

impl WorkloadCounts {
    fn add(&mut self, other: WorkloadCounts) {
        self.num_rounds += other.num_rounds;
        self.admitted += other.admitted;
        self.completed += other.completed;
        self.handed_out += other.handed_out;
        self.dropped += other.dropped;
    }
}

/// A buffer holding `in_flight` generating groups and `in_flight` finished ones (at `VERSION`), with
/// room for `num_threads` threads to run rounds at once and the staleness cap `STALENESS_CAP`.
pub fn prefilled(in_flight: usize, num_threads: usize) -> GroupBuffer {
    // All 2 * in_flight are admitted before half of them finish.
    let capacity = (2 * in_flight + num_threads.max(1) * ROUND) as i64;
    let limits = Limits::new(capacity, 2 * capacity, i64::MAX, Some(STALENESS_CAP))
        .expect("the prefill's limits are within range");
    let buffer = GroupBuffer::new(limits);
    let finished: Vec<u64> = (0..in_flight)
        .map(|prompt_index| {
            buffer
                .try_admit(prompt_index as u64)
                .expect("room for the prefill")
        })
        .collect();
    for prompt_index in 0..in_flight {
        buffer
            .try_admit(prompt_index as u64)
            .expect("room for the prefill");
    }
    let newest = GroupVersions {
        earliest_version: VERSION,
        latest_version: VERSION,
        finish_version: VERSION,
    };
    for group_id in finished {
        buffer
            .complete(group_id, newest)
            .expect("a group just admitted completes");
    }
    buffer
}

/// One round (see the module docs). `group_ids` is scratch space reused between rounds; it is left
/// empty. An admission refused by a limit is an `InvalidArgument` error: the buffer has no room for
/// the round (the groups admitted before it stay in flight).
pub fn run_round<C: Clock>(
    buffer: &GroupBuffer<C>,
    group_ids: &mut Vec<u64>,
) -> Result<WorkloadCounts> {
    group_ids.clear();
    for prompt_index in 0..ROUND as u64 {
        let group_id = buffer.try_admit(prompt_index).ok_or_else(|| {
            BufferError::invalid(
                "num_threads",
                format!(
                    "the admission workload needs room for {ROUND} more groups per thread, but a \
                     limit refused admission"
                ),
            )
        })?;
        group_ids.push(group_id);
    }
    for (offset, &group_id) in group_ids.iter().enumerate() {
        let versions = GroupVersions {
            earliest_version: VERSION - offset as i64 % 4,
            latest_version: VERSION,
            finish_version: VERSION,
        };
        buffer.complete(group_id, versions)?;
    }
    group_ids.clear();
    let batch = buffer.take_batch(BATCH_SIZE, VERSION)?;
    Ok(WorkloadCounts {
        num_rounds: 1,
        admitted: ROUND as u64,
        completed: ROUND as u64,
        handed_out: batch.groups.len() as u64,
        dropped: batch.dropped.len() as u64,
    })
}

/// `rounds_per_thread` rounds on each of `num_threads` threads sharing `buffer` (the calling thread
/// alone when `num_threads` is 1); returns the summed counts.
///
/// Before anything changes, checks that the buffer has room for `num_threads` rounds at once
/// (`InvalidArgument` otherwise). An error from a round (a version older than the buffer's last
/// `take_batch`, the per-step drop limit) stops that thread; the first one is returned, and the rounds
/// completed before it stay done.
pub fn run_rounds<C: Clock + Sync>(
    buffer: &GroupBuffer<C>,
    rounds_per_thread: u64,
    num_threads: usize,
) -> Result<WorkloadCounts> {
    if num_threads == 0 {
        return Err(BufferError::invalid(
            "num_threads",
            "the admission workload needs at least one thread, got 0",
        ));
    }
    let limits = buffer.limits();
    let counts = buffer.counts();
    let needed = (num_threads * ROUND) as u64;
    // max_buffered_groups bounds groups in flight plus finished ones.
    let inflight_room = u64::from(limits.max_inflight_groups.saturating_sub(counts.inflight));
    let buffered_room = u64::from(limits.max_buffered_groups)
        .saturating_sub(u64::from(counts.inflight) + u64::from(counts.buffered));
    if inflight_room < needed || buffered_room < needed {
        return Err(BufferError::invalid(
            "num_threads",
            format!(
                "the admission workload on {num_threads} threads needs room for {needed} more \
                 groups; the buffer's limits leave room for {inflight_room} more in flight and \
                 {buffered_room} more in flight or buffered"
            ),
        ));
    }
    let run = || -> Result<WorkloadCounts> {
        let mut total = WorkloadCounts::default();
        let mut group_ids = Vec::with_capacity(ROUND);
        for _ in 0..rounds_per_thread {
            total.add(run_round(buffer, &mut group_ids)?);
        }
        Ok(total)
    };
    if num_threads == 1 {
        return run();
    }
    let results: Vec<Result<WorkloadCounts>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..num_threads).map(|_| scope.spawn(run)).collect();
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let mut total = WorkloadCounts::default();
    for result in results {
        total.add(result?);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Handed-out and dropped groups account for every completed group plus the change in the heap.
    fn assert_consistent(buffer: &GroupBuffer, buffered_before: u32, counts: WorkloadCounts) {
        assert_eq!(counts.admitted, counts.num_rounds * ROUND as u64);
        assert_eq!(counts.completed, counts.admitted);
        let buffered_after = buffer.counts().buffered;
        assert_eq!(
            counts.handed_out + counts.dropped + u64::from(buffered_after),
            counts.completed + u64::from(buffered_before)
        );
    }

    #[test]
    fn single_thread_rounds_hand_out_three_quarters_and_drop_the_stale_quarter() {
        let buffer = prefilled(100, 1);
        let counts = run_rounds(&buffer, 10, 1).unwrap();
        assert_eq!(counts.num_rounds, 10);
        assert_eq!(counts.handed_out, 10 * BATCH_SIZE as u64);
        assert_eq!(counts.dropped, 10 * (ROUND - BATCH_SIZE) as u64);
        assert_eq!(buffer.counts().inflight, 100);
        assert_eq!(buffer.counts().buffered, 100);
        assert_consistent(&buffer, 100, counts);
    }

    #[test]
    fn threads_sharing_one_buffer_leave_it_consistent() {
        let buffer = prefilled(0, 4);
        let counts = run_rounds(&buffer, 50, 4).unwrap();
        assert_eq!(counts.num_rounds, 200);
        // Every round takes exactly BATCH_SIZE; which groups are stale when a take runs varies.
        assert_eq!(counts.handed_out, 200 * BATCH_SIZE as u64);
        assert_eq!(buffer.counts().inflight, 0);
        assert_consistent(&buffer, 0, counts);
    }

    #[test]
    fn no_room_is_refused_before_anything_changes() {
        let buffer = prefilled(0, 1);
        let error = run_rounds(&buffer, 1, 2).unwrap_err();
        assert!(
            matches!(error, BufferError::InvalidArgument { .. }),
            "{error}"
        );
        assert_eq!(buffer.counts().inflight, 0);
        assert!(matches!(
            run_rounds(&buffer, 1, 0),
            Err(BufferError::InvalidArgument { .. })
        ));
    }
}
