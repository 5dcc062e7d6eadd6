//! Time for the wait accounting: a monotonic clock in production, a hand-driven one in tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A monotonic source of nanoseconds. Only differences between readings are meaningful.
pub trait Clock: Send + Sync {
    /// Nanoseconds since an arbitrary, fixed origin; never decreases.
    fn now_ns(&self) -> u64;
}

/// `std::time::Instant`, counted from the moment the clock was made.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        // u64 nanoseconds last 584 years, so the saturation never happens in practice.
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to, so tests can assert exact wait accounting.
#[derive(Debug, Default)]
pub struct ManualClock {
    // std's atomic even under loom: the clock is test scaffolding, not part of the modelled protocol.
    now_ns: AtomicU64,
}

impl ManualClock {
    pub fn new(start_ns: u64) -> Self {
        Self {
            now_ns: AtomicU64::new(start_ns),
        }
    }

    /// Move the clock forward by `delta_ns` nanoseconds.
    pub fn advance_ns(&self, delta_ns: u64) {
        // Relaxed: the reading carries no other data; tests sequence their calls themselves.
        self.now_ns.fetch_add(delta_ns, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now_ns.load(Ordering::Relaxed)
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
}
