//! `GroupBuffer`: admission, the finished-group heap and the staleness ledger behind one API.
//!
//! Concurrency: the admission decision is the lock-free CAS of `Admission`; everything else (the
//! per-group records, the heap, the ledger) sits behind one mutex. Capacity only ever frees while that
//! mutex is held, and every freeing notifies the condition variable, so a waiter that re-checks the
//! counters under the mutex before it sleeps cannot miss a wake-up.
//!
//! Versions: every version is 0 or more. A group's versions satisfy
//! `earliest_version <= latest_version <= finish_version` (tokens cannot come from weights newer than
//! the actor's), and `finish_version` is at least the `actor_version` of the last `take_batch` (the
//! actor never goes back to a version older than one it already trained on). `take_batch`'s
//! `actor_version` never decreases and is at least every `finish_version` seen, so the staleness,
//! version span and queue steps of a handed-out group are never negative. Anything else is a
//! `BufferError::Version` that changes nothing.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::admission::{Admission, Counts};
use crate::clock::{Clock, MonotonicClock};
use crate::error::{BufferError, Result};
use crate::heap::{FinishedGroup, FinishedHeap, GroupVersions};
use crate::inflight::Inflight;
use crate::ledger::{Ledger, StepStats};
use crate::limits::Limits;
use crate::state::{self, BufferState};
use crate::sync::{Condvar, Mutex, MutexGuard};

/// What `take_batch` did: the batch, if it was ready, and the stale groups it dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOff {
    /// The `num_groups` oldest groups for the actor, oldest first; empty when fewer were ready.
    pub groups: Vec<FinishedGroup>,
    /// The groups dropped by the staleness cap, oldest first; their prompts go back to the
    /// dataloader. Dropped whether or not the batch was ready.
    pub dropped: Vec<FinishedGroup>,
    /// Groups buffered after the drops and before the hand-out: fewer than `num_groups` exactly when
    /// the batch was not ready.
    pub num_ready: usize,
}

impl HandOff {
    /// Whether the batch was handed out.
    pub fn is_ready(&self) -> bool {
        !self.groups.is_empty()
    }
}

/// A finished group as its producer reports it (the general form of `GroupBuffer::complete`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub group_id: u64,
    /// The prompt the group was generated for; when given, it must be the prompt it was admitted
    /// for.
    pub prompt_index: Option<u64>,
    /// `(earliest_version, latest_version)` of the group's model tokens, or `None` when the model
    /// sampled none (the group is then attributed to its finish version).
    pub token_versions: Option<(i64, i64)>,
    /// The actor version current when the group finished, or `None` to let the buffer stamp it: the
    /// `actor_version` of the last `take_batch` (0 before the first), or the group's latest version
    /// when that is newer.
    pub finish_version: Option<i64>,
}

impl Completion {
    /// A completion with all three versions given and no prompt cross-check.
    pub fn with_versions(group_id: u64, versions: GroupVersions) -> Self {
        Self {
            group_id,
            prompt_index: None,
            token_versions: Some((versions.earliest_version, versions.latest_version)),
            finish_version: Some(versions.finish_version),
        }
    }
}

/// Hashes a group id to itself (plus a copy of its low bits on top). Ids are sequential integers
/// chosen by the buffer, not by an adversary, so SipHash's flooding resistance buys nothing; and since
/// hashbrown takes the bucket from the low bits, ids admitted together land in neighbouring buckets,
/// which keeps a table of a million groups in flight cache-friendly. The top seven bits are the
/// table's tag, so they repeat the id's low bits to tell neighbours apart.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed (below); this is the generic fallback.
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id ^ (id << 57);
    }
}

/// A map keyed by group id, hashed by `IdHasher` (the Python extension keeps payloads in one).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) type IdMap<V = u64> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;
type IdSet = HashSet<u64, BuildHasherDefault<IdHasher>>;

/// The state behind the mutex.
struct Records {
    next_group_id: u64,
    /// prompt index of each group in flight, by group id.
    inflight: Inflight,
    finished: FinishedHeap,
    ledger: Ledger,
    last_actor_version: Option<i64>,
    max_finish_version: Option<i64>,
    /// Threads asleep in `wait_admit` or `wait_batch`. A notification is a system call, so releases skip it when
    /// nobody waits.
    num_waiters: usize,
}

impl Records {
    fn not_inflight(&self, group_id: u64) -> BufferError {
        if group_id >= self.next_group_id {
            BufferError::UnknownGroup {
                group_id,
                next_group_id: self.next_group_id,
            }
        } else {
            BufferError::GroupNotInflight { group_id }
        }
    }
}

/// The buffer between the rollout and the actor (ARCHITECTURE.md section 3). `Sync`: share it by
/// reference or `Arc` between the admitting, completing and training threads.
pub struct GroupBuffer<C: Clock = MonotonicClock> {
    limits: Limits,
    admission: Admission,
    records: Mutex<Records>,
    /// Notified after every change that may let a new prompt in or make a batch ready (every
    /// completion, abandon, drop and hand-out).
    capacity_changed: Condvar,
    clock: C,
}

impl GroupBuffer<MonotonicClock> {
    /// An empty buffer with the monotonic clock.
    pub fn new(limits: Limits) -> Self {
        Self::with_clock(limits, MonotonicClock::new())
    }

    /// Restore a buffer from `to_bytes` output, with the monotonic clock.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::from_state(state::decode(bytes)?, MonotonicClock::new())
    }
}

impl<C: Clock> GroupBuffer<C> {
    /// An empty buffer that reads time from `clock`; its first step starts now.
    pub fn with_clock(limits: Limits, clock: C) -> Self {
        let now_ns = clock.now_ns();
        Self {
            limits,
            admission: Admission::new(
                limits.max_inflight_groups,
                limits.max_buffered_groups,
                Counts::default(),
            ),
            records: Mutex::new(Records {
                next_group_id: 0,
                inflight: Inflight::default(),
                finished: FinishedHeap::default(),
                ledger: Ledger::new(now_ns, StepStats::default()),
                last_actor_version: None,
                max_finish_version: None,
                num_waiters: 0,
            }),
            capacity_changed: Condvar::new(),
            clock,
        }
    }

    /// A buffer in exactly the state `state` describes; the running step continues from the wall
    /// time and totals it recorded (time between snapshot and restore is not counted).
    pub fn from_state(state: BufferState, clock: C) -> Result<Self> {
        state.validate()?;
        // validate() bounded both lengths by u32 limits, so the casts are exact.
        let counts = Counts {
            inflight: state.inflight.len() as u32,
            buffered: state.finished.len() as u32,
        };
        let mut finished = FinishedHeap::default();
        for group in state.finished {
            finished.push(group);
        }
        let now_ns = clock.now_ns();
        Ok(Self {
            limits: state.limits,
            admission: Admission::new(
                state.limits.max_inflight_groups,
                state.limits.max_buffered_groups,
                counts,
            ),
            records: Mutex::new(Records {
                next_group_id: state.next_group_id,
                inflight: state.inflight.into_iter().collect(),
                finished,
                ledger: Ledger::new(now_ns, state.step),
                last_actor_version: state.last_actor_version,
                max_finish_version: state.max_finish_version,
                num_waiters: 0,
            }),
            capacity_changed: Condvar::new(),
            clock,
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The admission counters at some instant during the call.
    pub fn counts(&self) -> Counts {
        self.admission.counts()
    }

    /// Admit a prompt if both limits allow it: `Some(group_id)`, or `None` when a limit blocks (the
    /// refusal starts the wait accounting). Never blocks on a full buffer.
    pub fn try_admit(&self, prompt_index: u64) -> Option<u64> {
        // Fast path: the lock-free CAS decides; the lock is taken only to record the new group.
        if self.admission.try_acquire().is_ok() {
            let mut records = self.lock();
            return Some(self.record_admission(&mut records, prompt_index));
        }
        let mut records = self.lock();
        // Capacity may have freed between the failed CAS and the lock; decide again under the lock
        // so a refusal is only recorded while a limit really blocks.
        match self.admission.try_acquire() {
            Ok(_) => Some(self.record_admission(&mut records, prompt_index)),
            Err(blocked) => {
                records.ledger.refused(blocked, self.clock.now_ns());
                None
            }
        }
    }

    /// Admit as many of `prompt_indices` as both limits allow, in order: the group ids of the admitted
    /// prefix (shorter than `prompt_indices` when a limit blocks, which starts the wait accounting).
    /// One lock for the whole batch: the way to fill freed capacity at once.
    pub fn try_admit_many(&self, prompt_indices: &[u64]) -> Vec<u64> {
        let mut group_ids = Vec::with_capacity(prompt_indices.len());
        let mut records = self.lock();
        for &prompt_index in prompt_indices {
            // The CAS runs under the lock here, which costs nothing extra: the lock only orders the
            // records, and admitters outside it still race correctly on the word.
            match self.admission.try_acquire() {
                Ok(_) => group_ids.push(self.record_admission(&mut records, prompt_index)),
                Err(blocked) => {
                    records.ledger.refused(blocked, self.clock.now_ns());
                    break;
                }
            }
        }
        group_ids
    }

    /// Admit a prompt, waiting up to `timeout` for capacity: `Some(group_id)`, or `None` on timeout.
    /// Wakes on every capacity change and re-checks both limits.
    pub fn wait_admit(&self, prompt_index: u64, timeout: Duration) -> Option<u64> {
        if self.admission.try_acquire().is_ok() {
            let mut records = self.lock();
            return Some(self.record_admission(&mut records, prompt_index));
        }
        // A timeout too long to represent waits without a deadline.
        let deadline = Instant::now().checked_add(timeout);
        let mut records = self.lock();
        loop {
            // Under the lock: every release happens under it too, so between this check and the wait
            // below (which releases the lock atomically) no capacity can free unnoticed.
            match self.admission.try_acquire() {
                Ok(_) => return Some(self.record_admission(&mut records, prompt_index)),
                Err(blocked) => records.ledger.refused(blocked, self.clock.now_ns()),
            }
            let remaining = match deadline {
                Some(deadline) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    if remaining.is_zero() {
                        return None;
                    }
                    Some(remaining)
                }
                None => None,
            };
            // Counted under the lock, so a release (also under the lock) that happens after the check
            // above sees this waiter and notifies it.
            records.num_waiters += 1;
            records = self.sleep(records, remaining);
            records.num_waiters -= 1;
        }
    }

    /// Move an in-flight group to the finished heap with the weight versions that generated it.
    ///
    /// `Ok(true)` when the group was accepted; `Ok(false)` when it was admitted but is no longer in
    /// flight (a retried completion, or a group abandoned meanwhile): nothing changes, the first
    /// completion stands. An id that was never admitted, or versions that go backwards, are errors
    /// that change nothing.
    pub fn complete(&self, group_id: u64, versions: GroupVersions) -> Result<bool> {
        self.complete_group(Completion::with_versions(group_id, versions))
            .map(|accepted| accepted.is_some())
    }

    /// `complete` in its general form: the prompt index is cross-checked and the finish version may
    /// be left to the buffer (see `Completion`). Returns the versions the group was buffered with, or
    /// `None` when it is no longer in flight (nothing changes).
    pub fn complete_group(&self, completion: Completion) -> Result<Option<GroupVersions>> {
        let mut records = self.lock();
        let Some(versions) = resolve_completion(&records, &completion)? else {
            return Ok(None);
        };
        self.finish_validated(&mut records, completion.group_id, versions);
        self.release_done(records);
        Ok(Some(versions))
    }

    /// `complete` for several groups under one lock: `true` for each group accepted, `false` for each
    /// one no longer in flight (listed twice, the second is `false`). On any error (an unknown id, a
    /// prompt mismatch, versions that go backwards) the error names the group and nothing changes.
    pub fn complete_many(&self, groups: &[(u64, GroupVersions)]) -> Result<Vec<bool>> {
        let completions: Vec<Completion> = groups
            .iter()
            .map(|&(group_id, versions)| Completion::with_versions(group_id, versions))
            .collect();
        Ok(self
            .complete_groups(&completions)?
            .iter()
            .map(Option::is_some)
            .collect())
    }

    /// `complete_group` for several groups under one lock, all or nothing on errors; one entry per
    /// completion, `None` for the groups no longer in flight.
    pub fn complete_groups(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<Option<GroupVersions>>> {
        let mut seen = IdSet::with_capacity_and_hasher(completions.len(), Default::default());
        let mut records = self.lock();
        let mut accepted = Vec::with_capacity(completions.len());
        for completion in completions {
            let versions = resolve_completion(&records, completion)?;
            // A group listed twice is finished by its first entry; the second is a retry.
            let first = seen.insert(completion.group_id);
            accepted.push(versions.filter(|_| first));
        }
        for (completion, versions) in completions.iter().zip(&accepted) {
            if let Some(versions) = *versions {
                self.finish_validated(&mut records, completion.group_id, versions);
            }
        }
        self.release_done(records);
        Ok(accepted)
    }

    /// Give up on an in-flight group (its generation failed); frees its slot and returns its prompt
    /// index so the dataloader can issue it again.
    pub fn abandon(&self, group_id: u64) -> Result<u64> {
        let mut records = self.lock();
        let Some(prompt_index) = records.inflight.remove(group_id) else {
            return Err(records.not_inflight(group_id));
        };
        self.admission.release_inflight();
        self.release_done(records);
        Ok(prompt_index)
    }

    /// The hand-off to the actor, which trains at `actor_version`; never blocks on missing groups.
    ///
    /// First, when `max_actor_accept_staleness` is set, every buffered group with
    /// `actor_version - earliest_version > max_actor_accept_staleness` is dropped, whether or not
    /// `num_groups` fresh groups remain: each drop frees capacity at once and is returned in
    /// `HandOff::dropped` so its prompt goes back to the dataloader. Then, if at least `num_groups`
    /// groups are buffered, the `num_groups` oldest are handed out; otherwise none is, and
    /// `HandOff::num_ready` says how many are.
    ///
    /// Errors, each changing nothing: `num_groups` of 0 or above `max_buffered_groups` (it could never
    /// be ready), versions going backwards, or more drops this step than
    /// `max_dropped_groups_per_step` (the drop guard).
    pub fn take_batch(&self, num_groups: usize, actor_version: i64) -> Result<HandOff> {
        self.check_batch_size(num_groups)?;
        let mut records = self.lock();
        let hand_off = self.take_locked(&mut records, num_groups, actor_version)?;
        self.release_done(records);
        Ok(hand_off)
    }

    /// `take_batch`, waiting up to `timeout` for `num_groups` groups to be ready.
    ///
    /// Returns once the batch is handed out, once the timeout passes (not ready), or as soon as a
    /// call dropped stale groups without handing out a batch, so that their prompts reach the caller
    /// at once. Wakes on every completion. An error after drops of this call were committed is
    /// reported by the next call instead (the drops are returned first, so nothing is lost).
    pub fn wait_batch(
        &self,
        num_groups: usize,
        actor_version: i64,
        timeout: Duration,
    ) -> Result<HandOff> {
        self.check_batch_size(num_groups)?;
        // A timeout too long to represent waits without a deadline.
        let deadline = Instant::now().checked_add(timeout);
        let mut records = self.lock();
        loop {
            let hand_off = self.take_locked(&mut records, num_groups, actor_version)?;
            if hand_off.is_ready() || !hand_off.dropped.is_empty() {
                self.release_done(records);
                return Ok(hand_off);
            }
            let remaining = match deadline {
                Some(deadline) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    if remaining.is_zero() {
                        drop(records);
                        return Ok(hand_off);
                    }
                    Some(remaining)
                }
                None => None,
            };
            // Nothing was released above (no drop, no hand-out), so there is nobody to wake. Counted
            // under the lock, so a completion (also under the lock) after the check above sees this
            // waiter and notifies it.
            records.num_waiters += 1;
            records = self.sleep(records, remaining);
            records.num_waiters -= 1;
        }
    }

    /// Close the running step: its totals (staleness, drops, admission waits, wall time) are returned
    /// and the next step starts now with zero totals.
    pub fn end_step(&self) -> StepStats {
        let now_ns = self.clock.now_ns();
        self.lock().ledger.end_step(now_ns)
    }

    /// The whole state, consistent at one instant (groups admitted concurrently appear once their
    /// admission has been recorded).
    pub fn state(&self) -> BufferState {
        let records = self.lock();
        let mut inflight: Vec<(u64, u64)> = records.inflight.iter().collect();
        inflight.sort_unstable();
        BufferState {
            limits: self.limits,
            next_group_id: records.next_group_id,
            last_actor_version: records.last_actor_version,
            max_finish_version: records.max_finish_version,
            inflight,
            finished: records.finished.sorted(),
            step: records.ledger.totals_at(self.clock.now_ns()),
        }
    }

    /// The state as checkpoint bytes (`from_bytes` restores it).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        state::encode(&self.state())
    }

    /// `(group_id, prompt_index)` of every group in flight, by group id.
    pub fn inflight_groups(&self) -> Vec<(u64, u64)> {
        self.state().inflight
    }

    /// The finished groups waiting for the actor, oldest first.
    pub fn buffered_groups(&self) -> Vec<FinishedGroup> {
        self.lock().finished.sorted()
    }

    fn check_batch_size(&self, num_groups: usize) -> Result<()> {
        let max = self.limits.max_buffered_groups as usize;
        if num_groups == 0 || num_groups > max {
            return Err(BufferError::invalid(
                "num_groups",
                format!(
                    "a batch needs between 1 and rollout_buffer.max_buffered_groups={max} groups \
                     (more could never be ready), got {num_groups}"
                ),
            ));
        }
        Ok(())
    }

    /// One hand-off attempt under the lock (see `take_batch`); the caller ends with `release_done`.
    fn take_locked(
        &self,
        records: &mut Records,
        num_groups: usize,
        actor_version: i64,
    ) -> Result<HandOff> {
        check_actor_version(records, actor_version)?;
        // actor_version >= every finish_version >= every earliest_version >= 0 (checked above and on
        // completion), so the difference below is non-negative and fits u64.
        let stale = match self.limits.max_actor_accept_staleness {
            Some(cap) => records
                .finished
                .count_older_than(actor_version.saturating_sub_unsigned(cap)),
            None => 0,
        };
        let dropped_this_step = records.ledger.step().dropped_groups;
        let would_drop = stale as u64;
        if dropped_this_step + would_drop > self.limits.max_dropped_groups_per_step {
            return Err(BufferError::DropLimitExceeded {
                dropped_this_step,
                would_drop,
                max_dropped_groups_per_step: self.limits.max_dropped_groups_per_step,
            });
        }
        records.last_actor_version = Some(actor_version);
        let dropped: Vec<FinishedGroup> =
            (0..stale).filter_map(|_| records.finished.pop()).collect();
        records.ledger.step_mut().dropped_groups += dropped.len() as u64;
        let num_ready = records.finished.len();
        let mut groups = Vec::new();
        if num_ready >= num_groups {
            groups.reserve_exact(num_groups);
            groups.extend((0..num_groups).filter_map(|_| records.finished.pop()));
            let step = records.ledger.step_mut();
            for group in &groups {
                step.record_trained(group, actor_version);
            }
        }
        // Both came off the heap, whose length equals the buffered count under the lock, and the
        // buffered count is at most max_buffered_groups <= u32::MAX.
        let released = (groups.len() + dropped.len()) as u32;
        if released > 0 {
            self.admission.release_buffered(released);
        }
        Ok(HandOff {
            groups,
            dropped,
            num_ready,
        })
    }

    /// Sleep on the condition variable until notified or `timeout` passes (`None`: no timeout).
    fn sleep<'a>(
        &self,
        records: MutexGuard<'a, Records>,
        timeout: Option<Duration>,
    ) -> MutexGuard<'a, Records> {
        match timeout {
            Some(timeout) => {
                self.capacity_changed
                    .wait_timeout(records, timeout)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => self
                .capacity_changed
                .wait(records)
                .unwrap_or_else(PoisonError::into_inner),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // No code panics while holding this lock (no unwrap, no indexing, no arithmetic that can
        // overflow), so a poisoned lock still guards consistent records and is safe to recover.
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record_admission(&self, records: &mut Records, prompt_index: u64) -> u64 {
        let group_id = records.next_group_id;
        records.next_group_id += 1;
        records.inflight.insert(group_id, prompt_index);
        if records.ledger.is_waiting() {
            records.ledger.admitted(self.clock.now_ns());
        }
        group_id
    }

    /// Move a group checked to be in flight, with checked versions, to the finished heap.
    fn finish_validated(&self, records: &mut Records, group_id: u64, versions: GroupVersions) {
        let Some(prompt_index) = records.inflight.remove(group_id) else {
            return;
        };
        // The record was present, so this group's admission CAS happened and it is counted in flight.
        self.admission.finish_one();
        records.finished.push(FinishedGroup {
            group_id,
            prompt_index,
            versions,
        });
        records.max_finish_version = Some(
            records
                .max_finish_version
                .map_or(versions.finish_version, |max| {
                    max.max(versions.finish_version)
                }),
        );
    }

    /// After a release under the lock: update the wait accounting, unlock, wake the waiters.
    fn release_done(&self, mut records: MutexGuard<'_, Records>) {
        // Reading the clock costs more than the rest of a cycle; only a wait in progress needs it.
        if records.ledger.is_waiting() {
            let blocked = self.admission.blocked_by(self.admission.counts());
            records
                .ledger
                .capacity_changed(blocked, self.clock.now_ns());
        }
        let anyone_waiting = records.num_waiters > 0;
        drop(records);
        // After unlocking, so woken waiters do not queue on the lock we hold. No wake-up is lost: a
        // waiter checks the counters and registers in `num_waiters` under the lock before it sleeps,
        // and this release happened (and read `num_waiters`) under the lock. A notification is a
        // system call, so it is skipped when nobody waits.
        if anyone_waiting {
            self.capacity_changed.notify_all();
        }
    }
}

/// Check a completion against the records: `Ok(None)` when the group is no longer in flight (a
/// retry), else the versions to buffer it with.
fn resolve_completion(records: &Records, completion: &Completion) -> Result<Option<GroupVersions>> {
    let group_id = completion.group_id;
    let Some(admitted_prompt_index) = records.inflight.get(group_id) else {
        if group_id >= records.next_group_id {
            return Err(records.not_inflight(group_id));
        }
        return Ok(None);
    };
    if let Some(prompt_index) = completion
        .prompt_index
        .filter(|&prompt_index| prompt_index != admitted_prompt_index)
    {
        return Err(BufferError::PromptMismatch {
            group_id,
            admitted_prompt_index,
            prompt_index,
        });
    }
    let floor = records.last_actor_version.unwrap_or(0);
    let version_error = |problem: String| BufferError::Version {
        group_id: Some(group_id),
        message: format!("group {group_id}: {problem}"),
    };
    let (earliest_version, latest_version) = match completion.token_versions {
        Some((earliest_version, latest_version)) => {
            if earliest_version < 0 {
                return Err(version_error(format!(
                    "earliest_version {earliest_version} is negative: versions start at 0, and \
                     tokens that no model sampled (NO_VERSION) must not be counted"
                )));
            }
            if latest_version < earliest_version {
                return Err(version_error(format!(
                    "latest_version {latest_version} is older than earliest_version \
                     {earliest_version}"
                )));
            }
            (earliest_version, latest_version)
        }
        None => {
            let version = completion.finish_version.unwrap_or(floor);
            (version, version)
        }
    };
    let finish_version = match completion.finish_version {
        None => latest_version.max(floor),
        Some(finish_version) if finish_version < latest_version => {
            return Err(version_error(format!(
                "finish_version {finish_version} is older than latest_version {latest_version}: no \
                 token can come from weights newer than the actor's (leave finish_version unset \
                 for the buffer to stamp it)"
            )));
        }
        Some(finish_version) if finish_version < floor => {
            return Err(version_error(format!(
                "finish_version {finish_version} is older than actor version {floor}, which a batch \
                 was already handed out at (leave finish_version unset for the buffer to stamp it)"
            )));
        }
        Some(finish_version) => finish_version,
    };
    if earliest_version < 0 {
        return Err(version_error(format!(
            "finish_version {finish_version} is negative: versions start at 0"
        )));
    }
    Ok(Some(GroupVersions {
        earliest_version,
        latest_version,
        finish_version,
    }))
}

fn check_actor_version(records: &Records, actor_version: i64) -> Result<()> {
    let problem = if actor_version < 0 {
        format!("actor_version {actor_version} is negative")
    } else if let Some(last) = records
        .last_actor_version
        .filter(|&last| actor_version < last)
    {
        format!(
            "actor_version {actor_version} is older than {last}, the version of the previous batch"
        )
    } else if let Some(max) = records
        .max_finish_version
        .filter(|&max| actor_version < max)
    {
        format!("actor_version {actor_version} is older than {max}, a group's finish_version")
    } else {
        return Ok(());
    };
    Err(BufferError::Version {
        group_id: None,
        message: problem,
    })
}
