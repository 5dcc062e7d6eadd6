//! The only pyo3 file: exposes the buffer core as `asyncrl_core._buffer_core`.
//!
//! Python code uses the facade `asyncrl_core.buffer`; this module converts arguments, releases the
//! GIL around the blocking wait, and turns each `BufferError` into its exception class from
//! `asyncrl_core.errors` (one conversion, `From<BufferError> for PyErr`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffer::{Completion, GroupBuffer, HandOff};
use crate::error::BufferError;
use crate::ledger::StepStats;
use crate::limits::Limits;
use crate::workload::{self, WorkloadCounts};

/// How long `wait_admit` sleeps without the GIL before it checks for Ctrl-C.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

impl From<BufferError> for PyErr {
    fn from(error: BufferError) -> Self {
        Python::attach(|py| {
            let exception = py
                .import("asyncrl_core.errors")
                .and_then(|module| module.getattr(error.python_class()))
                .and_then(|class| {
                    let fields = error_fields(py, &error)?;
                    class.call((error.to_string(),), Some(&fields))
                });
            match exception {
                Ok(exception) => PyErr::from_value(exception),
                // Only if asyncrl_core itself is broken; keep the message rather than lose it.
                Err(import_error) => PyRuntimeError::new_err(format!(
                    "{error} (and asyncrl_core.errors.{} could not be built: {import_error})",
                    error.python_class()
                )),
            }
        })
    }
}

/// The typed fields of the exception `error` becomes, as keyword arguments of its class.
fn error_fields<'py>(py: Python<'py>, error: &BufferError) -> PyResult<Bound<'py, PyDict>> {
    let fields = PyDict::new(py);
    match error {
        BufferError::InvalidArgument { argument, .. } => fields.set_item("argument", argument)?,
        BufferError::UnknownGroup { group_id, .. }
        | BufferError::GroupNotInflight { group_id }
        | BufferError::PromptMismatch { group_id, .. } => fields.set_item("group_id", group_id)?,
        BufferError::Version { group_id, .. } => fields.set_item("group_id", group_id)?,
        BufferError::DropLimitExceeded {
            dropped_this_step,
            would_drop,
            max_dropped_groups_per_step,
        } => {
            fields.set_item("dropped_this_step", dropped_this_step)?;
            fields.set_item("would_drop", would_drop)?;
            fields.set_item("max_dropped_groups_per_step", max_dropped_groups_per_step)?;
        }
        BufferError::CorruptState(_) => {}
    }
    Ok(fields)
}

fn non_negative(name: &'static str, value: i64) -> Result<u64, BufferError> {
    u64::try_from(value)
        .map_err(|_| BufferError::invalid(name, format!("{name} must be 0 or more, got {value}")))
}

fn timeout(timeout_s: f64) -> Result<Duration, BufferError> {
    Duration::try_from_secs_f64(timeout_s).map_err(|_| {
        BufferError::invalid(
            "timeout_s",
            format!("timeout_s must be a finite number of seconds, 0 or more, got {timeout_s}"),
        )
    })
}

fn batch_size(num_groups: i64) -> Result<usize, BufferError> {
    usize::try_from(num_groups).map_err(|_| {
        BufferError::invalid(
            "num_groups",
            format!("num_groups must be 1 or more, got {num_groups}"),
        )
    })
}

/// A completion as the facade passes it: `(group_id, prompt_index, (earliest_version,
/// latest_version) or None, finish_version or None)`.
type CompletionArgs = (i64, i64, Option<(i64, i64)>, Option<i64>);

fn completion(
    (group_id, prompt_index, token_versions, finish_version): CompletionArgs,
) -> Result<Completion, BufferError> {
    Ok(Completion {
        group_id: non_negative("group_id", group_id)?,
        prompt_index: Some(non_negative("prompt_index", prompt_index)?),
        token_versions,
        finish_version,
    })
}

/// The totals of one step, as `GroupBuffer.end_step` returns them.
#[pyclass(frozen, get_all, module = "asyncrl_core._buffer_core")]
struct StepTotals {
    num_groups: u64,
    staleness_sum: u64,
    staleness_max: u64,
    staleness_counts: BTreeMap<u64, u64>,
    version_span_sum: u64,
    queue_steps_sum: u64,
    dropped_groups: u64,
    admission_wait_inflight_limit_s: f64,
    admission_wait_buffer_full_s: f64,
    wall_s: f64,
}

impl From<StepStats> for StepTotals {
    fn from(stats: StepStats) -> Self {
        let seconds = |ns: u64| ns as f64 * 1e-9;
        Self {
            num_groups: stats.num_groups,
            staleness_sum: stats.staleness_sum,
            staleness_max: stats.staleness_max,
            staleness_counts: stats.staleness_counts,
            version_span_sum: stats.version_span_sum,
            queue_steps_sum: stats.queue_steps_sum,
            dropped_groups: stats.dropped_groups,
            admission_wait_inflight_limit_s: seconds(stats.wait_inflight_limit_ns),
            admission_wait_buffer_full_s: seconds(stats.wait_buffer_full_ns),
            wall_s: seconds(stats.wall_ns),
        }
    }
}

/// The buffer core. Frozen and internally synchronised, so any number of Python threads may call it
/// at once without a Python-level lock.
#[pyclass(frozen, name = "GroupBuffer", module = "asyncrl_core._buffer_core")]
struct PyGroupBuffer {
    inner: GroupBuffer,
}

/// A hand-off as the facade reads it: the handed-out group ids, `(group_id, prompt_index)` of each
/// dropped group, and the number of groups ready.
type HandOffIds = (Vec<u64>, Vec<(u64, u64)>, usize);

fn hand_off_ids(hand_off: HandOff) -> HandOffIds {
    (
        hand_off.groups.iter().map(|group| group.group_id).collect(),
        hand_off
            .dropped
            .iter()
            .map(|group| (group.group_id, group.prompt_index))
            .collect(),
        hand_off.num_ready,
    )
}
type BufferedRow = (u64, u64, i64, i64, i64);

#[pymethods]
impl PyGroupBuffer {
    #[new]
    #[pyo3(signature = (*, max_inflight_groups, max_buffered_groups, max_dropped_groups_per_step, max_actor_accept_staleness=None))]
    fn new(
        max_inflight_groups: i64,
        max_buffered_groups: i64,
        max_dropped_groups_per_step: i64,
        max_actor_accept_staleness: Option<i64>,
    ) -> PyResult<Self> {
        let limits = Limits::new(
            max_inflight_groups,
            max_buffered_groups,
            max_dropped_groups_per_step,
            max_actor_accept_staleness,
        )?;
        Ok(Self {
            inner: GroupBuffer::new(limits),
        })
    }

    #[staticmethod]
    fn from_state_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: GroupBuffer::from_bytes(data)?,
        })
    }

    fn state_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    #[getter]
    fn max_inflight_groups(&self) -> u32 {
        self.inner.limits().max_inflight_groups
    }

    #[getter]
    fn max_buffered_groups(&self) -> u32 {
        self.inner.limits().max_buffered_groups
    }

    #[getter]
    fn max_dropped_groups_per_step(&self) -> u64 {
        self.inner.limits().max_dropped_groups_per_step
    }

    #[getter]
    fn max_actor_accept_staleness(&self) -> Option<u64> {
        self.inner.limits().max_actor_accept_staleness
    }

    #[getter]
    fn num_inflight(&self) -> u32 {
        self.inner.counts().inflight
    }

    #[getter]
    fn num_buffered(&self) -> u32 {
        self.inner.counts().buffered
    }

    fn try_admit(&self, prompt_index: i64) -> PyResult<Option<u64>> {
        let prompt_index = non_negative("prompt_index", prompt_index)?;
        Ok(self.inner.try_admit(prompt_index))
    }

    fn try_admit_many(&self, prompt_indices: Vec<i64>) -> PyResult<Vec<u64>> {
        let prompt_indices = prompt_indices
            .into_iter()
            .map(|prompt_index| non_negative("prompt_index", prompt_index))
            .collect::<Result<Vec<u64>, BufferError>>()?;
        Ok(self.inner.try_admit_many(&prompt_indices))
    }

    fn wait_admit(
        &self,
        py: Python<'_>,
        prompt_index: i64,
        timeout_s: f64,
    ) -> PyResult<Option<u64>> {
        let prompt_index = non_negative("prompt_index", prompt_index)?;
        let inner = &self.inner;
        // Without the GIL: other Python threads complete groups and take batches meanwhile.
        wait_in_slices(py, timeout(timeout_s)?, |slice| {
            Ok(py.detach(|| inner.wait_admit(prompt_index, slice)))
        })
    }

    fn complete(
        &self,
        group_id: i64,
        prompt_index: i64,
        token_versions: Option<(i64, i64)>,
        finish_version: Option<i64>,
    ) -> PyResult<Option<i64>> {
        let completion = completion((group_id, prompt_index, token_versions, finish_version))?;
        let versions = self.inner.complete_group(completion)?;
        Ok(versions.map(|versions| versions.finish_version))
    }

    fn complete_many(&self, groups: Vec<CompletionArgs>) -> PyResult<Vec<Option<i64>>> {
        let completions = groups
            .into_iter()
            .map(completion)
            .collect::<Result<Vec<_>, BufferError>>()?;
        let accepted = self.inner.complete_groups(&completions)?;
        Ok(accepted
            .into_iter()
            .map(|versions| versions.map(|versions| versions.finish_version))
            .collect())
    }

    fn abandon(&self, group_id: i64) -> PyResult<u64> {
        let group_id = non_negative("group_id", group_id)?;
        Ok(self.inner.abandon(group_id)?)
    }

    #[pyo3(signature = (num_groups, actor_version, timeout_s=0.0))]
    fn take_batch(
        &self,
        py: Python<'_>,
        num_groups: i64,
        actor_version: i64,
        timeout_s: f64,
    ) -> PyResult<HandOffIds> {
        let num_groups = batch_size(num_groups)?;
        let timeout = timeout(timeout_s)?;
        let inner = &self.inner;
        if timeout.is_zero() {
            return Ok(hand_off_ids(inner.take_batch(num_groups, actor_version)?));
        }
        let mut last = None;
        let hand_off = wait_in_slices(py, timeout, |slice| {
            let hand_off = py.detach(|| inner.wait_batch(num_groups, actor_version, slice))?;
            if hand_off.is_ready() || !hand_off.dropped.is_empty() {
                return Ok(Some(hand_off));
            }
            last = Some(hand_off);
            Ok(None)
        })?;
        Ok(hand_off_ids(hand_off.or(last).unwrap_or(HandOff {
            groups: Vec::new(),
            dropped: Vec::new(),
            num_ready: 0,
        })))
    }

    fn end_step(&self) -> StepTotals {
        self.inner.end_step().into()
    }

    fn inflight_groups(&self) -> Vec<(u64, u64)> {
        self.inner.inflight_groups()
    }

    fn buffered_groups(&self) -> Vec<BufferedRow> {
        self.inner
            .buffered_groups()
            .into_iter()
            .map(|group| {
                (
                    group.group_id,
                    group.prompt_index,
                    group.versions.earliest_version,
                    group.versions.latest_version,
                    group.versions.finish_version,
                )
            })
            .collect()
    }
}

/// Call `attempt` with slices of at most `SIGNAL_CHECK_INTERVAL` until it returns `Some` or `timeout`
/// passes (then `None`), checking for signals (Ctrl-C) between slices. A timeout too long to
/// represent waits without a deadline, still interruptible.
fn wait_in_slices<T>(
    py: Python<'_>,
    timeout: Duration,
    mut attempt: impl FnMut(Duration) -> PyResult<Option<T>>,
) -> PyResult<Option<T>> {
    let deadline = Instant::now().checked_add(timeout);
    loop {
        let slice = match deadline {
            Some(deadline) => deadline
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_CHECK_INTERVAL),
            None => SIGNAL_CHECK_INTERVAL,
        };
        if let Some(value) = attempt(slice)? {
            return Ok(Some(value));
        }
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// What `run_admission_workload` did, as `workload::WorkloadCounts` counts it.
#[pyclass(
    frozen,
    get_all,
    name = "WorkloadCounts",
    module = "asyncrl_core._buffer_core"
)]
struct PyWorkloadCounts {
    num_rounds: u64,
    admitted: u64,
    completed: u64,
    handed_out: u64,
    dropped: u64,
}

impl From<WorkloadCounts> for PyWorkloadCounts {
    fn from(counts: WorkloadCounts) -> Self {
        Self {
            num_rounds: counts.num_rounds,
            admitted: counts.admitted,
            completed: counts.completed,
            handed_out: counts.handed_out,
            dropped: counts.dropped,
        }
    }
}

/// The admission benchmark's rounds (`workload::run_rounds`) driven from Rust, without the GIL, so
/// the benchmark can time the core beside its call-by-call Python loop on the same buffer.
#[pyfunction]
fn run_admission_workload(
    py: Python<'_>,
    buffer: &Bound<'_, PyGroupBuffer>,
    rounds_per_thread: i64,
    num_threads: i64,
) -> PyResult<PyWorkloadCounts> {
    let rounds_per_thread = non_negative("rounds_per_thread", rounds_per_thread)?;
    let num_threads = usize::try_from(num_threads).map_err(|_| {
        BufferError::invalid(
            "num_threads",
            format!("num_threads must be 1 or more, got {num_threads}"),
        )
    })?;
    let inner = &buffer.get().inner;
    let counts = py.detach(|| workload::run_rounds(inner, rounds_per_thread, num_threads))?;
    Ok(counts.into())
}

#[pymodule]
fn _buffer_core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyGroupBuffer>()?;
    module.add_class::<StepTotals>()?;
    module.add_class::<PyWorkloadCounts>()?;
    module.add_function(wrap_pyfunction!(run_admission_workload, module)?)?;
    module.add("WORKLOAD_ROUND", workload::ROUND)?;
    module.add("WORKLOAD_BATCH_SIZE", workload::BATCH_SIZE)?;
    module.add("WORKLOAD_VERSION", workload::VERSION)?;
    Ok(())
}
