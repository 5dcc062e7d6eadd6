//! The only pyo3 file: exposes the buffer core as `asyncrl_core._buffer_core`.
//!
//! Python code uses the facade `asyncrl_core.buffer`; this module converts arguments, releases the
//! GIL around the blocking wait, and turns each `BufferError` into its exception class from
//! `asyncrl_core.errors` (one conversion, `From<BufferError> for PyErr`).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffer::{Completion, GroupBuffer, HandOff, IdMap};
use crate::error::BufferError;
use crate::ledger::StepStats;
use crate::limits::Limits;

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

#[pymethods]
impl StepStats {
    /// The step's metrics under their names in `asyncrl_core.metrics`: the admission waits as shares
    /// of the step's wall time, drops, and, when the step handed out groups, the staleness mean, max
    /// and per-value shares, the version span mean and the queue steps mean.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let names = py.import("asyncrl_core.metrics")?;
        let metrics = PyDict::new(py);
        let put = |constant: &str, value: f64| -> PyResult<()> {
            metrics.set_item(names.getattr(constant)?, value)
        };
        put("DROPPED_GROUPS", self.dropped_groups as f64)?;
        put(
            "ADMISSION_WAIT_INFLIGHT_LIMIT",
            self.share_of_step(self.admission_wait_inflight_limit_ns),
        )?;
        put(
            "ADMISSION_WAIT_BUFFER_FULL",
            self.share_of_step(self.admission_wait_buffer_full_ns),
        )?;
        if let Some(mean) = self.per_group(self.staleness_sum) {
            put("DATA_STALENESS_MEAN", mean)?;
            put("DATA_STALENESS_MAX", self.staleness_max as f64)?;
            let ratio_name = names.getattr("data_staleness_ratio")?;
            for (&staleness, &count) in &self.staleness_counts {
                let share = self.per_group(count).unwrap_or(0.0);
                metrics.set_item(ratio_name.call1((staleness,))?, share)?;
            }
            put(
                "VERSION_SPAN_MEAN",
                self.per_group(self.version_span_sum).unwrap_or(0.0),
            )?;
            put(
                "QUEUE_STEPS_MEAN",
                self.per_group(self.queue_steps_sum).unwrap_or(0.0),
            )?;
        }
        Ok(metrics)
    }
}

/// The buffer core with the Python object (payload) of each buffered group. Frozen and internally
/// synchronised, so any number of Python threads may call it at once without a Python-level lock.
#[pyclass(frozen, name = "GroupBuffer", module = "asyncrl_core._buffer_core")]
struct PyGroupBuffer {
    inner: GroupBuffer,
    /// The payload of each buffered group, by group id.
    ///
    /// A completion holds this lock from before the core accepts its group until the payload is in, and
    /// a hand-off takes it after the core handed the groups out, so a hand-off always finds the payload
    /// of every group it got, and a retried completion (refused by the core) never touches the payload of
    /// the completion it repeats. Lock order: this lock, then the core's. The lock is only ever held with
    /// the GIL and released before anything that can run Python code (error conversion, a payload's
    /// last reference going away), so no thread can wait for the GIL while holding it.
    payloads: Mutex<Payloads>,
}

/// Keyed like the core's records, so payloads of groups admitted together sit together.
type Payloads = IdMap<Py<PyAny>>;

/// A hand-off as the facade reads it: the handed-out payloads (oldest first), `(group_id,
/// prompt_index)` of each dropped group, and the number of groups ready.
type HandOffRows = (Vec<Py<PyAny>>, Vec<(u64, u64)>, usize);
type BufferedRow = (u64, u64, i64, i64, i64);

/// A completion as the facade passes it: `(group_id, prompt_index, (earliest_version, latest_version)
/// or None, finish_version or None, payload)`.
type CompletionRow = (i64, i64, Option<(i64, i64)>, Option<i64>, Py<PyAny>);

impl PyGroupBuffer {
    fn with_core(inner: GroupBuffer) -> Self {
        Self {
            inner,
            payloads: Mutex::new(Payloads::default()),
        }
    }

    fn lock_payloads(&self) -> MutexGuard<'_, Payloads> {
        // Nothing panics while holding it (map operations on integer keys), so a poisoned lock still
        // guards a consistent map.
        self.payloads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Trade a hand-off's groups for their payloads. The dropped groups' payloads are returned apart,
    /// to be released after the lock.
    fn claim(&self, hand_off: HandOff) -> PyResult<(HandOffRows, Vec<Py<PyAny>>)> {
        let mut payloads = self.lock_payloads();
        let mut missing = None;
        let mut groups = Vec::with_capacity(hand_off.groups.len());
        for group in &hand_off.groups {
            match payloads.remove(&group.group_id) {
                Some(payload) => groups.push(payload),
                None => missing = Some(group.group_id),
            }
        }
        let released: Vec<Py<PyAny>> = hand_off
            .dropped
            .iter()
            .filter_map(|group| payloads.remove(&group.group_id))
            .collect();
        drop(payloads);
        if let Some(group_id) = missing {
            return Err(PyRuntimeError::new_err(format!(
                "the buffer handed out group {group_id} without its payload (a bug in asyncrl)"
            )));
        }
        let dropped = hand_off
            .dropped
            .iter()
            .map(|group| (group.group_id, group.prompt_index))
            .collect();
        Ok(((groups, dropped, hand_off.num_ready), released))
    }
}

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
        Ok(Self::with_core(GroupBuffer::new(limits)))
    }

    #[staticmethod]
    fn restore(data: &[u8], payloads: HashMap<u64, Py<PyAny>>) -> PyResult<Self> {
        let inner = GroupBuffer::from_bytes(data)?;
        let buffered: HashSet<u64> = inner
            .buffered_groups()
            .iter()
            .map(|group| group.group_id)
            .collect();
        let given: HashSet<u64> = payloads.keys().copied().collect();
        if buffered != given {
            let mut missing: Vec<u64> = buffered.difference(&given).copied().collect();
            let mut extra: Vec<u64> = given.difference(&buffered).copied().collect();
            missing.sort_unstable();
            extra.sort_unstable();
            return Err(BufferError::CorruptState(format!(
                "the payloads do not match the buffered groups: missing {missing:?}, not buffered \
                 {extra:?}"
            ))
            .into());
        }
        let buffer = Self::with_core(inner);
        buffer.lock_payloads().extend(payloads);
        Ok(buffer)
    }

    /// The state's bytes and the payload of every group buffered in that state, at one instant.
    fn snapshot<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyBytes>, HashMap<u64, Py<PyAny>>)> {
        let payloads = self.lock_payloads();
        // No completion is between the core's acceptance and its payload while we hold the lock; a
        // hand-off may be between the core and its claim, so its payloads are still here and left out.
        let state = self.inner.state();
        let buffered: HashMap<u64, Py<PyAny>> = state
            .finished
            .iter()
            .filter_map(|group| {
                let payload = payloads.get(&group.group_id)?;
                Some((group.group_id, payload.clone_ref(py)))
            })
            .collect();
        drop(payloads);
        Ok((PyBytes::new(py, &crate::state::encode(&state)?), buffered))
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
        payload: Py<PyAny>,
    ) -> PyResult<Option<i64>> {
        let completion = completion((group_id, prompt_index, token_versions, finish_version))?;
        let mut payloads = self.lock_payloads();
        let accepted = self.inner.complete_group(completion);
        if let Ok(Some(_)) = accepted {
            payloads.insert(completion.group_id, payload);
        }
        drop(payloads);
        Ok(accepted?.map(|versions| versions.finish_version))
    }

    fn complete_many(&self, groups: Vec<CompletionRow>) -> PyResult<Vec<Option<i64>>> {
        let mut completions = Vec::with_capacity(groups.len());
        let mut new_payloads = Vec::with_capacity(groups.len());
        for (group_id, prompt_index, token_versions, finish_version, payload) in groups {
            completions.push(completion((
                group_id,
                prompt_index,
                token_versions,
                finish_version,
            ))?);
            new_payloads.push(payload);
        }
        let mut payloads = self.lock_payloads();
        let accepted = self.inner.complete_groups(&completions);
        if let Ok(accepted) = &accepted {
            for ((completion, versions), payload) in
                completions.iter().zip(accepted).zip(new_payloads)
            {
                if versions.is_some() {
                    payloads.insert(completion.group_id, payload);
                }
            }
        }
        drop(payloads);
        Ok(accepted?
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
    ) -> PyResult<HandOffRows> {
        let num_groups = batch_size(num_groups)?;
        let timeout = timeout(timeout_s)?;
        let inner = &self.inner;
        let hand_off = if timeout.is_zero() {
            inner.take_batch(num_groups, actor_version)?
        } else {
            let mut last = None;
            let hand_off = wait_in_slices(py, timeout, |slice| {
                let hand_off = py.detach(|| inner.wait_batch(num_groups, actor_version, slice))?;
                if hand_off.is_ready() || !hand_off.dropped.is_empty() {
                    return Ok(Some(hand_off));
                }
                last = Some(hand_off);
                Ok(None)
            })?;
            hand_off.or(last).unwrap_or(HandOff {
                groups: Vec::new(),
                dropped: Vec::new(),
                num_ready: 0,
            })
        };
        // The dropped groups' payloads are released here, after the lock.
        let (rows, _released) = self.claim(hand_off)?;
        Ok(rows)
    }

    fn end_step(&self) -> StepStats {
        self.inner.end_step()
    }

    fn inflight_groups(&self) -> Vec<(u64, u64)> {
        self.inner.inflight_groups()
    }

    /// The payloads of the buffered groups, oldest first.
    fn buffered_payloads(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        let payloads = self.lock_payloads();
        self.inner
            .buffered_groups()
            .iter()
            .filter_map(|group| Some(payloads.get(&group.group_id)?.clone_ref(py)))
            .collect()
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

#[pymodule]
fn _buffer_core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyGroupBuffer>()?;
    module.add_class::<StepStats>()?;
    Ok(())
}
