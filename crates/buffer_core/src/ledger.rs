//! The per-step ledger: staleness of the groups handed to the actor, drops, and admission wait time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::admission::Blocked;
use crate::heap::FinishedGroup;

/// What happened in one step (between two `end_step` calls), as totals.
///
/// The metrics are ratios of these totals: `rollout/data_staleness/mean = staleness_sum / num_groups`,
/// `rollout/buffer/admission_wait_inflight_limit = admission_wait_inflight_limit_ns / wall_ns`, and so on.
/// This one declaration crosses into Python as `asyncrl_core._buffer_core.StepStats`, with these names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(
    feature = "python",
    pyo3::pyclass(frozen, get_all, module = "asyncrl_core._buffer_core")
)]
pub struct StepStats {
    /// Groups handed to the actor.
    pub num_groups: u64,
    /// Sum of `actor_version - earliest_version` over the groups handed out.
    pub staleness_sum: u64,
    /// Largest `actor_version - earliest_version` of the step; 0 when no group was handed out.
    pub staleness_max: u64,
    /// Number of groups handed out with each staleness.
    pub staleness_counts: BTreeMap<u64, u64>,
    /// Sum of `latest_version - earliest_version`: versions that passed while a group generated.
    pub version_span_sum: u64,
    /// Sum of `actor_version - latest_version`: versions a group waited in the buffer.
    pub queue_steps_sum: u64,
    /// Groups dropped by the staleness cap.
    pub dropped_groups: u64,
    /// Nanoseconds during which admission was refused because of the in-flight limit.
    pub admission_wait_inflight_limit_ns: u64,
    /// Nanoseconds during which admission was refused because the buffer was full.
    pub admission_wait_buffer_full_ns: u64,
    /// Nanoseconds from the start of the step to its end.
    pub wall_ns: u64,
}

impl StepStats {
    /// Record one group handed to the actor at `actor_version`. The buffer has already checked
    /// `earliest <= latest <= finish <= actor_version`, so the differences are non-negative.
    pub(crate) fn record_trained(&mut self, group: &FinishedGroup, actor_version: i64) {
        let versions = group.versions;
        let staleness = version_gap(actor_version, versions.earliest_version);
        self.num_groups += 1;
        self.staleness_sum += staleness;
        self.staleness_max = self.staleness_max.max(staleness);
        *self.staleness_counts.entry(staleness).or_insert(0) += 1;
        self.version_span_sum += version_gap(versions.latest_version, versions.earliest_version);
        self.queue_steps_sum += version_gap(actor_version, versions.latest_version);
    }
}

impl StepStats {
    /// `part_ns` as a share of the step's wall time; 0 for a step of no duration.
    pub fn share_of_step(&self, part_ns: u64) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            part_ns as f64 / self.wall_ns as f64
        }
    }

    /// `sum` per group handed out, or `None` when the step handed out none.
    pub fn per_group(&self, sum: u64) -> Option<f64> {
        (self.num_groups > 0).then(|| sum as f64 / self.num_groups as f64)
    }
}

/// `newer - older` for versions the buffer has ordered already (0 if they were not).
fn version_gap(newer: i64, older: i64) -> u64 {
    u64::try_from(newer.saturating_sub(older)).unwrap_or(0)
}

/// The running step: its totals, when it started, and the admission wait in progress.
///
/// Wait accounting: admission is *blocked* from the moment an admission is refused until capacity
/// frees up (a group finishes, is abandoned, dropped or handed out and a new prompt would fit) or an
/// admission succeeds. While blocked, time is charged to the limit that blocks at that moment; when a
/// capacity change leaves the buffer blocked by the other limit, the charge switches to that limit.
/// Nobody asking for admission means nobody waits, so no time is charged.
#[derive(Debug, Clone)]
pub(crate) struct Ledger {
    step: StepStats,
    /// Wall time of the step carried over from a snapshot (0 for a fresh buffer).
    carried_wall_ns: u64,
    step_started_ns: u64,
    blocked_since: Option<(Blocked, u64)>,
}

impl Ledger {
    /// A step starting at `now_ns` whose totals so far are `carried` (its `wall_ns` included).
    pub(crate) fn new(now_ns: u64, carried: StepStats) -> Self {
        Self {
            carried_wall_ns: carried.wall_ns,
            step: StepStats {
                wall_ns: 0,
                ..carried
            },
            step_started_ns: now_ns,
            blocked_since: None,
        }
    }

    pub(crate) fn step(&self) -> &StepStats {
        &self.step
    }

    pub(crate) fn step_mut(&mut self) -> &mut StepStats {
        &mut self.step
    }

    /// Whether an admission wait is in progress (only then do the events below need the time).
    pub(crate) fn is_waiting(&self) -> bool {
        self.blocked_since.is_some()
    }

    /// An admission was refused by `blocked` at `now_ns`.
    pub(crate) fn refused(&mut self, blocked: Blocked, now_ns: u64) {
        match self.blocked_since {
            Some((current, _)) if current == blocked => {}
            _ => self.switch(Some(blocked), now_ns),
        }
    }

    /// An admission succeeded at `now_ns`: whoever was waiting got in.
    pub(crate) fn admitted(&mut self, now_ns: u64) {
        self.switch(None, now_ns);
    }

    /// Capacity changed at `now_ns`; `blocked` is what now keeps a new prompt out, if anything.
    /// Only a wait already in progress continues: a change alone starts no wait.
    pub(crate) fn capacity_changed(&mut self, blocked: Option<Blocked>, now_ns: u64) {
        if self.blocked_since.is_some() {
            self.switch(blocked, now_ns);
        }
    }

    /// Close the step at `now_ns`: return its totals and start the next one. A wait in progress is
    /// split at `now_ns` between the two steps.
    pub(crate) fn end_step(&mut self, now_ns: u64) -> StepStats {
        let stats = self.totals_at(now_ns);
        self.step = StepStats::default();
        self.carried_wall_ns = 0;
        self.step_started_ns = now_ns;
        if let Some((blocked, _)) = self.blocked_since {
            self.blocked_since = Some((blocked, now_ns));
        }
        stats
    }

    /// The step's totals as if it ended at `now_ns`, changing nothing.
    pub(crate) fn totals_at(&self, now_ns: u64) -> StepStats {
        let mut stats = self.step.clone();
        if let Some((blocked, since_ns)) = self.blocked_since {
            charge(&mut stats, blocked, now_ns.saturating_sub(since_ns));
        }
        stats.wall_ns = self.carried_wall_ns + now_ns.saturating_sub(self.step_started_ns);
        stats
    }

    fn switch(&mut self, blocked: Option<Blocked>, now_ns: u64) {
        if let Some((previous, since_ns)) = self.blocked_since {
            charge(&mut self.step, previous, now_ns.saturating_sub(since_ns));
        }
        self.blocked_since = blocked.map(|blocked| (blocked, now_ns));
    }
}

fn charge(stats: &mut StepStats, blocked: Blocked, duration_ns: u64) {
    match blocked {
        Blocked::InflightLimit => stats.admission_wait_inflight_limit_ns += duration_ns,
        Blocked::BufferFull => stats.admission_wait_buffer_full_ns += duration_ns,
    }
}
