//! asyncrl's buffer core: the admission counters, the oldest-first heap of finished groups and the
//! staleness ledger (ARCHITECTURE.md section 3). The logic lives in plain Rust modules; the pyo3 glue
//! is in `python.rs` alone and compiled only with the `python` feature.

#[cfg(feature = "python")]
mod python;
