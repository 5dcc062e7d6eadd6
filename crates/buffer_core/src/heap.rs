//! The finished groups, oldest first: by earliest weight version, then by admission order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The actor weight versions of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupVersions {
    /// The oldest version that sampled any token of the group.
    pub earliest_version: i64,
    /// The newest version that sampled any token of the group.
    pub latest_version: i64,
    /// The actor version current when the group finished.
    pub finish_version: i64,
}

/// A finished group as the buffer keeps it: ids and versions; the payload stays with the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FinishedGroup {
    pub group_id: u64,
    pub prompt_index: u64,
    pub versions: GroupVersions,
}

/// The finished groups waiting for the actor, ordered oldest first by (earliest version, group id).
///
/// A B-tree rather than a binary heap: both are O(log n), but here new groups enter at the newest end
/// of one of a few versions and leave from the oldest end, so a B-tree's operations keep walking the
/// same few root-to-leaf paths, which stay in cache. A binary heap's pop sifts an element down a
/// fresh path every time: at a million buffered groups, that is a cache miss per level.
#[derive(Debug, Clone, Default)]
pub struct FinishedHeap {
    groups: BTreeMap<(i64, u64), (u64, i64, i64)>,
}

impl FinishedHeap {
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn push(&mut self, group: FinishedGroup) {
        let versions = group.versions;
        self.groups.insert(
            (versions.earliest_version, group.group_id),
            (
                group.prompt_index,
                versions.latest_version,
                versions.finish_version,
            ),
        );
    }

    /// The oldest group, without removing it.
    pub fn peek(&self) -> Option<FinishedGroup> {
        self.groups
            .first_key_value()
            .map(|(&key, &value)| unpack(key, value))
    }

    /// How many groups have an earliest version below `version` (they are the oldest ones).
    pub fn count_older_than(&self, version: i64) -> usize {
        self.groups.range(..(version, 0)).count()
    }

    /// Remove and return the oldest group.
    pub fn pop(&mut self) -> Option<FinishedGroup> {
        self.groups
            .pop_first()
            .map(|(key, value)| unpack(key, value))
    }

    /// Every group, oldest first.
    pub fn sorted(&self) -> Vec<FinishedGroup> {
        self.groups
            .iter()
            .map(|(&key, &value)| unpack(key, value))
            .collect()
    }
}

fn unpack(
    (earliest_version, group_id): (i64, u64),
    (prompt_index, latest_version, finish_version): (u64, i64, i64),
) -> FinishedGroup {
    FinishedGroup {
        group_id,
        prompt_index,
        versions: GroupVersions {
            earliest_version,
            latest_version,
            finish_version,
        },
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn group(group_id: u64, earliest_version: i64) -> FinishedGroup {
        FinishedGroup {
            group_id,
            prompt_index: group_id * 10,
            versions: GroupVersions {
                earliest_version,
                latest_version: earliest_version,
                finish_version: earliest_version,
            },
        }
    }

    #[test]
    fn pops_by_earliest_version_then_admission_order() {
        let mut heap = FinishedHeap::default();
        for (group_id, earliest_version) in [(4, 1), (1, 2), (3, 1), (2, 0), (0, 2)] {
            heap.push(group(group_id, earliest_version));
        }
        let order: Vec<u64> = std::iter::from_fn(|| heap.pop().map(|g| g.group_id)).collect();
        assert_eq!(order, [2, 3, 4, 0, 1]);
    }
}
