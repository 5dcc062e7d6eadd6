//! Lock-free admission: both counters in one atomic word, so both limits are checked together.
//!
//! The word holds `inflight` in its low 32 bits and `buffered` in its high 32 bits. A new group is
//! admitted by one compare-and-swap that checks both limits against the same snapshot of the word, so
//! no interleaving of admitters can push either count past its limit: a CAS based on a stale snapshot
//! fails and the admitter re-checks against the fresh value.
//!
//! Only admission raises `inflight` or `inflight + buffered`. Completion moves one group from
//! in-flight to buffered (the sum stays, `inflight` falls) and the releases lower the counts, so none of
//! them can break a limit; they are single wait-free read-modify-writes.
//!
//! Every operation uses `Ordering::Relaxed`. That is sound because the word protects no other memory:
//! the limits are a property of this one location, and all read-modify-writes of one location are
//! totally ordered (its modification order) whatever the ordering argument, so each CAS compares
//! against the latest value. The per-group records live behind the buffer's mutex, which orders them;
//! the releases happen while that mutex is held, so a thread that re-checks the word under the mutex
//! (the condition-variable wait in `GroupBuffer::wait_admit`) sees every release that happened before
//! its lock (coherence of a location with the happens-before edge of the mutex).

use crate::sync::{AtomicU64, Ordering};

const INFLIGHT_MASK: u64 = 0xFFFF_FFFF;
const BUFFERED_SHIFT: u32 = 32;

/// The two admission counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Groups admitted and still generating.
    pub inflight: u32,
    /// Groups finished and waiting in the heap for the actor.
    pub buffered: u32,
}

impl Counts {
    fn pack(self) -> u64 {
        u64::from(self.inflight) | (u64::from(self.buffered) << BUFFERED_SHIFT)
    }

    fn unpack(word: u64) -> Self {
        // Both casts keep exactly 32 bits by construction of the mask and the shift.
        Self {
            inflight: (word & INFLIGHT_MASK) as u32,
            buffered: (word >> BUFFERED_SHIFT) as u32,
        }
    }

    /// Groups counted against `max_buffered_groups`: in flight now means buffered later.
    pub fn total(self) -> u64 {
        u64::from(self.inflight) + u64::from(self.buffered)
    }
}

/// The limit that keeps a new prompt out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// `inflight == max_inflight_groups`; reported even when the buffer is full too.
    InflightLimit,
    /// `inflight + buffered == max_buffered_groups` with room in flight.
    BufferFull,
}

/// The packed admission counters with their two limits.
#[derive(Debug)]
pub struct Admission {
    word: AtomicU64,
    max_inflight_groups: u32,
    max_buffered_groups: u32,
}

impl Admission {
    /// Counters starting at `counts`; the caller guarantees the counts respect the limits.
    pub fn new(max_inflight_groups: u32, max_buffered_groups: u32, counts: Counts) -> Self {
        Self {
            word: AtomicU64::new(counts.pack()),
            max_inflight_groups,
            max_buffered_groups,
        }
    }

    /// The counts at some instant between the call and its return.
    pub fn counts(&self) -> Counts {
        Counts::unpack(self.word.load(Ordering::Relaxed))
    }

    /// Which limit, if any, keeps a new prompt out at `counts`. The in-flight limit wins a tie.
    pub fn blocked_by(&self, counts: Counts) -> Option<Blocked> {
        if counts.inflight >= self.max_inflight_groups {
            Some(Blocked::InflightLimit)
        } else if counts.total() >= u64::from(self.max_buffered_groups) {
            Some(Blocked::BufferFull)
        } else {
            None
        }
    }

    /// Admit one group if both limits allow it: `Ok` with the counts this admission installed, or
    /// the limit that blocks. Lock-free: the loop retries only when another thread changed the word.
    pub fn try_acquire(&self) -> Result<Counts, Blocked> {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let current = Counts::unpack(word);
            if let Some(blocked) = self.blocked_by(current) {
                return Err(blocked);
            }
            // No overflow: inflight < max_inflight_groups <= u32::MAX, so inflight + 1 fits 32 bits.
            let next = Counts {
                inflight: current.inflight + 1,
                buffered: current.buffered,
            };
            // The CAS succeeds only if nobody changed the word since `word` was read, so the limits were
            // checked against the very value being replaced. Relaxed suffices (see the module docs).
            match self.word.compare_exchange_weak(
                word,
                next.pack(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(next),
                Err(actual) => word = actual,
            }
        }
    }

    /// Move one in-flight group to buffered; returns the new counts. The caller guarantees that the
    /// group was admitted and not yet released (it holds the group's record under the buffer's mutex).
    pub fn finish_one(&self) -> Counts {
        // Adding 2^32 - 1 adds one to the high half and subtracts one from the low half in a single
        // wait-free step: the low half is at least one (the group is in flight), so no borrow crosses
        // into the high half, and the high half cannot overflow because buffered + inflight stays at
        // most max_buffered_groups <= u32::MAX.
        const FINISH: u64 = (1 << BUFFERED_SHIFT) - 1;
        let previous = Counts::unpack(self.word.fetch_add(FINISH, Ordering::Relaxed));
        debug_assert!(
            previous.inflight >= 1,
            "finish_one without an in-flight group"
        );
        Counts {
            inflight: previous.inflight - 1,
            buffered: previous.buffered + 1,
        }
    }

    /// Release one in-flight group (abandoned); returns the new counts. Same precondition as
    /// `finish_one`.
    pub fn release_inflight(&self) -> Counts {
        // inflight >= 1, so subtracting one never borrows from the buffered half.
        let previous = Counts::unpack(self.word.fetch_sub(1, Ordering::Relaxed));
        debug_assert!(
            previous.inflight >= 1,
            "release_inflight without an in-flight group"
        );
        Counts {
            inflight: previous.inflight - 1,
            buffered: previous.buffered,
        }
    }

    /// Release `num_groups` buffered groups (handed out or dropped); returns the new counts. The
    /// caller guarantees that at least `num_groups` are buffered (it just popped them off the heap).
    pub fn release_buffered(&self, num_groups: u32) -> Counts {
        let previous = Counts::unpack(
            self.word
                .fetch_sub(u64::from(num_groups) << BUFFERED_SHIFT, Ordering::Relaxed),
        );
        debug_assert!(
            previous.buffered >= num_groups,
            "released more than buffered"
        );
        Counts {
            inflight: previous.inflight,
            buffered: previous.buffered - num_groups,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips() {
        let counts = Counts {
            inflight: u32::MAX,
            buffered: 7,
        };
        assert_eq!(Counts::unpack(counts.pack()), counts);
    }

    #[test]
    fn inflight_limit_wins_a_tie() {
        let admission = Admission::new(2, 2, Counts::default());
        assert!(admission.try_acquire().is_ok());
        assert!(admission.try_acquire().is_ok());
        assert_eq!(admission.try_acquire(), Err(Blocked::InflightLimit));
        admission.finish_one();
        assert_eq!(admission.try_acquire(), Err(Blocked::BufferFull));
        admission.release_buffered(1);
        assert_eq!(
            admission.try_acquire(),
            Ok(Counts {
                inflight: 2,
                buffered: 0
            })
        );
    }

    #[test]
    fn finish_moves_exactly_one_group_at_the_largest_counts() {
        let admission = Admission::new(
            u32::MAX,
            u32::MAX,
            Counts {
                inflight: 1,
                buffered: u32::MAX - 1,
            },
        );
        assert_eq!(
            admission.finish_one(),
            Counts {
                inflight: 0,
                buffered: u32::MAX
            }
        );
        assert_eq!(admission.try_acquire(), Err(Blocked::BufferFull));
    }
}
