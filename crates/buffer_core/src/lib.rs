//! asyncrl's buffer core: the admission counters, the oldest-first heap of finished groups and the
//! staleness ledger (ARCHITECTURE.md section 3). The logic lives in plain Rust modules; the pyo3 glue
//! is in `python.rs` alone and compiled only with the `python` feature.

pub mod admission;
pub mod buffer;
pub mod clock;
pub mod error;
pub mod heap;
mod inflight;
pub mod ledger;
pub mod limits;
pub mod state;
mod sync;
#[cfg(feature = "workload")]
pub mod workload;

#[cfg(feature = "python")]
mod python;

pub use admission::{Admission, Blocked, Counts};
pub use buffer::{Completion, GroupBuffer, HandOff};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use error::BufferError;
pub use heap::{FinishedGroup, GroupVersions};
pub use ledger::StepStats;
pub use limits::Limits;
pub use state::BufferState;
#[cfg(feature = "workload")]
pub use workload::WorkloadCounts;
