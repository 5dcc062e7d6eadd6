//! proptest: random sequences of operations against a direct, obviously-correct model of the contract.
//! After every operation the buffer and the model must agree on the result, the counters, every
//! record and the step totals, and no limit may be exceeded.
#![cfg(not(loom))]

use std::collections::BTreeMap;

use buffer_core::{
    BufferError, FinishedGroup, GroupBuffer, GroupVersions, Limits, ManualClock, StepStats,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Admit {
        prompt_index: u64,
    },
    /// Complete the `pick`-th group in flight; versions relative to the current actor version.
    Complete {
        pick: usize,
        age: i64,
        span: i64,
    },
    /// Complete a group again that is no longer in flight (a retried call): a no-op.
    Retry {
        pick: u64,
    },
    /// Complete with versions that go backwards or an id that was never admitted.
    CompleteInvalid {
        pick: usize,
        kind: u8,
    },
    Abandon {
        pick: usize,
    },
    AdmitMany {
        prompt_indices: Vec<u64>,
    },
    /// Complete the first `count` groups in flight, `age` versions old; `duplicate` lists one twice.
    CompleteMany {
        count: usize,
        age: i64,
        duplicate: bool,
    },
    Take {
        num_groups: usize,
        behind: i64,
    },
    BumpVersion,
    EndStep,
    Restore,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..1000).prop_map(|prompt_index| Op::Admit { prompt_index }),
        4 => (0usize..16, 0i64..4, 0i64..3).prop_map(|(pick, age, span)| Op::Complete { pick, age, span }),
        1 => (0usize..16, 0u8..4).prop_map(|(pick, kind)| Op::CompleteInvalid { pick, kind }),
        1 => (0u64..64).prop_map(|pick| Op::Retry { pick }),
        1 => (0usize..16).prop_map(|pick| Op::Abandon { pick }),
        2 => prop::collection::vec(0u64..1000, 0..6).prop_map(|prompt_indices| Op::AdmitMany { prompt_indices }),
        2 => (1usize..4, 0i64..3, prop::bool::weighted(0.2))
            .prop_map(|(count, age, duplicate)| Op::CompleteMany { count, age, duplicate }),
        2 => (0usize..5, prop_oneof![4 => Just(0i64), 1 => Just(1i64)])
            .prop_map(|(num_groups, behind)| Op::Take { num_groups, behind }),
        2 => Just(Op::BumpVersion),
        1 => Just(Op::EndStep),
        1 => Just(Op::Restore),
    ]
}

/// The contract, written as directly as possible.
#[derive(Debug, Default)]
struct Model {
    next_group_id: u64,
    inflight: BTreeMap<u64, u64>,
    finished: Vec<FinishedGroup>,
    last_actor_version: Option<i64>,
    max_finish_version: Option<i64>,
    step: StepStats,
}

impl Model {
    fn admit(&mut self, limits: &Limits, prompt_index: u64) -> Option<u64> {
        let inflight = self.inflight.len() as u64;
        let total = inflight + self.finished.len() as u64;
        if inflight >= u64::from(limits.max_inflight_groups)
            || total >= u64::from(limits.max_buffered_groups)
        {
            return None;
        }
        let group_id = self.next_group_id;
        self.next_group_id += 1;
        self.inflight.insert(group_id, prompt_index);
        Some(group_id)
    }

    /// `Ok(true)`: buffered; `Ok(false)`: admitted before but no longer in flight, nothing changes.
    fn complete(&mut self, group_id: u64, versions: GroupVersions) -> Result<bool, ()> {
        let Some(&prompt_index) = self.inflight.get(&group_id) else {
            return if group_id < self.next_group_id {
                Ok(false)
            } else {
                Err(())
            };
        };
        let ordered = 0 <= versions.earliest_version
            && versions.earliest_version <= versions.latest_version
            && versions.latest_version <= versions.finish_version
            && versions.finish_version >= self.last_actor_version.unwrap_or(0);
        if !ordered {
            return Err(());
        }
        self.inflight.remove(&group_id);
        self.finished.push(FinishedGroup {
            group_id,
            prompt_index,
            versions,
        });
        self.max_finish_version = self.max_finish_version.max(Some(versions.finish_version));
        Ok(true)
    }

    /// `(handed out, dropped, ready)`: stale groups are dropped whether or not the batch is ready.
    fn take(
        &mut self,
        limits: &Limits,
        num_groups: usize,
        actor_version: i64,
    ) -> Result<(Vec<u64>, Vec<u64>, usize), ()> {
        if num_groups == 0
            || num_groups > limits.max_buffered_groups as usize
            || actor_version < 0
            || self
                .last_actor_version
                .is_some_and(|last| actor_version < last)
            || self
                .max_finish_version
                .is_some_and(|max| actor_version < max)
        {
            return Err(());
        }
        let mut oldest_first = self.finished.clone();
        oldest_first.sort_by_key(|group| (group.versions.earliest_version, group.group_id));
        let (stale, fresh): (Vec<FinishedGroup>, Vec<FinishedGroup>) =
            oldest_first.into_iter().partition(|group| {
                limits.max_actor_accept_staleness.is_some_and(|cap| {
                    (actor_version - group.versions.earliest_version) as u64 > cap
                })
            });
        if self.step.dropped_groups + stale.len() as u64 > limits.max_dropped_groups_per_step {
            return Err(());
        }
        self.step.dropped_groups += stale.len() as u64;
        self.last_actor_version = Some(actor_version);
        let num_ready = fresh.len();
        let taken = if num_ready >= num_groups {
            &fresh[..num_groups]
        } else {
            &[]
        };
        for group in taken {
            let v = group.versions;
            let staleness = (actor_version - v.earliest_version) as u64;
            self.step.num_groups += 1;
            self.step.staleness_sum += staleness;
            self.step.staleness_max = self.step.staleness_max.max(staleness);
            *self.step.staleness_counts.entry(staleness).or_default() += 1;
            self.step.version_span_sum += (v.latest_version - v.earliest_version) as u64;
            self.step.queue_steps_sum += (actor_version - v.latest_version) as u64;
        }
        self.finished = fresh[taken.len()..].to_vec();
        Ok((
            taken.iter().map(|group| group.group_id).collect(),
            stale.iter().map(|group| group.group_id).collect(),
            num_ready,
        ))
    }
}

fn limits() -> impl Strategy<Value = Limits> {
    (1i64..5, 1i64..8, 0i64..4, prop::option::of(0i64..3)).prop_map(
        |(inflight, buffered, dropped, cap)| Limits::new(inflight, buffered, dropped, cap).unwrap(),
    )
}

fn check_agrees(buffer: &GroupBuffer<ManualClock>, model: &Model, limits: &Limits) {
    let state = buffer.state();
    let counts = buffer.counts();
    assert!(counts.inflight <= limits.max_inflight_groups);
    assert!(counts.total() <= u64::from(limits.max_buffered_groups));
    assert_eq!(counts.inflight as usize, model.inflight.len());
    assert_eq!(counts.buffered as usize, model.finished.len());
    assert_eq!(state.next_group_id, model.next_group_id);
    assert_eq!(
        state.inflight,
        model
            .inflight
            .iter()
            .map(|(&id, &prompt)| (id, prompt))
            .collect::<Vec<_>>()
    );
    let mut finished = model.finished.clone();
    finished.sort_by_key(|group| (group.versions.earliest_version, group.group_id));
    assert_eq!(state.finished, finished);
    assert_eq!(state.last_actor_version, model.last_actor_version);
    assert_eq!(state.step, model.step);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn buffer_matches_the_model(limits in limits(), ops in prop::collection::vec(op(), 1..120)) {
        let mut buffer = GroupBuffer::with_clock(limits, ManualClock::new(0));
        let mut model = Model::default();
        let mut version = 0i64;
        for op in ops {
            match op {
                Op::Admit { prompt_index } => {
                    prop_assert_eq!(buffer.try_admit(prompt_index), model.admit(&limits, prompt_index));
                }
                Op::Complete { pick, age, span } => {
                    let Some(&group_id) = model.inflight.keys().nth(pick % model.inflight.len().max(1)) else {
                        continue;
                    };
                    let earliest_version = (version - age).max(0);
                    let versions = GroupVersions {
                        earliest_version,
                        latest_version: (earliest_version + span).min(version),
                        finish_version: version,
                    };
                    prop_assert_eq!(buffer.complete(group_id, versions).ok(), model.complete(group_id, versions).ok());
                }
                Op::Retry { pick } => {
                    if model.next_group_id == 0 {
                        continue;
                    }
                    let group_id = pick % model.next_group_id;
                    if model.inflight.contains_key(&group_id) {
                        continue;
                    }
                    let versions = GroupVersions { earliest_version: 0, latest_version: 0, finish_version: version };
                    let before = buffer.state();
                    prop_assert_eq!(buffer.complete(group_id, versions), Ok(false));
                    prop_assert_eq!(model.complete(group_id, versions), Ok(false));
                    prop_assert_eq!(buffer.state(), before);
                }
                Op::CompleteInvalid { pick, kind } => {
                    let group_id = model.inflight.keys().nth(pick % model.inflight.len().max(1)).copied();
                    let (group_id, versions) = match (kind, group_id) {
                        (0, Some(id)) => (id, GroupVersions { earliest_version: 1, latest_version: 0, finish_version: version.max(1) }),
                        (1, Some(id)) => (id, GroupVersions { earliest_version: 0, latest_version: version + 1, finish_version: version }),
                        (2, Some(id)) => (id, GroupVersions { earliest_version: -1, latest_version: 0, finish_version: version }),
                        _ => (model.next_group_id + pick as u64, GroupVersions { earliest_version: 0, latest_version: 0, finish_version: version }),
                    };
                    let before = buffer.state();
                    let result = buffer.complete(group_id, versions);
                    let typed = matches!(result, Err(BufferError::Version { .. } | BufferError::UnknownGroup { .. }));
                    prop_assert!(typed, "{:?}", result);
                    prop_assert_eq!(model.complete(group_id, versions), Err(()));
                    prop_assert_eq!(buffer.state(), before);
                }
                Op::Abandon { pick } => {
                    let Some(&group_id) = model.inflight.keys().nth(pick % model.inflight.len().max(1)) else {
                        prop_assert!(buffer.abandon(model.next_group_id).is_err());
                        continue;
                    };
                    let prompt_index = model.inflight.remove(&group_id);
                    prop_assert_eq!(buffer.abandon(group_id).ok(), prompt_index);
                }
                Op::AdmitMany { prompt_indices } => {
                    let expected: Vec<u64> = prompt_indices
                        .iter()
                        .map_while(|&prompt_index| model.admit(&limits, prompt_index))
                        .collect();
                    prop_assert_eq!(buffer.try_admit_many(&prompt_indices), expected);
                }
                Op::CompleteMany { count, age, duplicate } => {
                    let earliest_version = (version - age).max(0);
                    let versions = GroupVersions { earliest_version, latest_version: version, finish_version: version };
                    let mut groups: Vec<(u64, GroupVersions)> =
                        model.inflight.keys().take(count).map(|&id| (id, versions)).collect();
                    if groups.is_empty() {
                        continue;
                    }
                    if duplicate {
                        groups.push(groups[0]);
                    }
                    // The model has no batch call: a valid batch is the same as one call per group
                    // (a group listed twice is a retry the second time).
                    let expected: Result<Vec<bool>, ()> =
                        groups.iter().map(|&(id, v)| model.complete(id, v)).collect();
                    prop_assert_eq!(buffer.complete_many(&groups).ok(), expected.ok());
                }
                Op::Take { num_groups, behind } => {
                    let actor_version = version - behind;
                    let before = buffer.state();
                    let expected = model.take(&limits, num_groups, actor_version);
                    match buffer.take_batch(num_groups, actor_version) {
                        Ok(batch) => {
                            let taken: Vec<u64> = batch.groups.iter().map(|g| g.group_id).collect();
                            let dropped: Vec<u64> = batch.dropped.iter().map(|g| g.group_id).collect();
                            prop_assert_eq!(Ok((taken, dropped, batch.num_ready)), expected);
                        }
                        Err(_) => {
                            prop_assert_eq!(expected, Err(()));
                            prop_assert_eq!(buffer.state(), before);
                        }
                    }
                }
                Op::BumpVersion => version += 1,
                Op::EndStep => {
                    prop_assert_eq!(buffer.end_step(), std::mem::take(&mut model.step));
                }
                Op::Restore => {
                    let bytes = buffer.to_bytes().unwrap();
                    let restored = GroupBuffer::from_state(buffer_core::state::decode(&bytes).unwrap(), ManualClock::new(0)).unwrap();
                    prop_assert_eq!(restored.state(), buffer.state());
                    buffer = restored;
                }
            }
            check_agrees(&buffer, &model, &limits);
        }
    }

    #[test]
    fn any_damage_to_snapshot_bytes_is_a_corrupt_state_error(position in any::<prop::sample::Index>(), bit in 0u8..8) {
        let limits = Limits::new(3, 6, 2, Some(1)).unwrap();
        let buffer = GroupBuffer::with_clock(limits, ManualClock::new(0));
        for prompt_index in 0..3 {
            let group_id = buffer.try_admit(prompt_index).unwrap();
            if prompt_index < 2 {
                let versions = GroupVersions { earliest_version: 0, latest_version: 1, finish_version: 1 };
                buffer.complete(group_id, versions).unwrap();
            }
        }
        let mut bytes = buffer.to_bytes().unwrap();
        let position = position.index(bytes.len());
        bytes[position] ^= 1 << bit;
        prop_assert!(matches!(GroupBuffer::from_bytes(&bytes), Err(BufferError::CorruptState(_))));
    }
}
