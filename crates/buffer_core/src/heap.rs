//! The finished groups, oldest first: by earliest weight version, then by admission order.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// The actor weight versions of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupVersions {
    /// The oldest version that sampled any token of the group.
    pub earliest_version: i64,
    /// The newest version that sampled any token of the group.
    pub latest_version: i64,
    /// The actor version current when the group finished.
    pub finish_version: i64,
}

/// A finished group as the buffer keeps it: ids and versions; the payload stays with the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FinishedGroup {
    pub group_id: u64,
    pub prompt_index: u64,
    pub versions: GroupVersions,
}

impl FinishedGroup {
    fn age_key(&self) -> (i64, u64) {
        (self.versions.earliest_version, self.group_id)
    }
}

/// Heap order: the oldest group (smallest earliest version, then smallest id) is the greatest, so
/// `BinaryHeap` (a max-heap) pops it first. Group ids are unique, so the order is total and the pop
/// order never depends on the heap's internal layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Oldest(FinishedGroup);

impl Ord for Oldest {
    fn cmp(&self, other: &Self) -> Ordering {
        Reverse(self.0.age_key()).cmp(&Reverse(other.0.age_key()))
    }
}

impl PartialOrd for Oldest {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The finished groups waiting for the actor. Push and pop are O(log n).
#[derive(Debug, Clone, Default)]
pub struct FinishedHeap {
    heap: BinaryHeap<Oldest>,
}

impl FinishedHeap {
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    pub fn push(&mut self, group: FinishedGroup) {
        self.heap.push(Oldest(group));
    }

    /// The oldest group, without removing it.
    pub fn peek(&self) -> Option<&FinishedGroup> {
        self.heap.peek().map(|oldest| &oldest.0)
    }

    /// Remove and return the oldest group.
    pub fn pop(&mut self) -> Option<FinishedGroup> {
        self.heap.pop().map(|oldest| oldest.0)
    }

    /// Every group, oldest first (O(n log n); for snapshots and inspection, not the hot path).
    pub fn sorted(&self) -> Vec<FinishedGroup> {
        let mut groups: Vec<FinishedGroup> = self.heap.iter().map(|oldest| oldest.0).collect();
        groups.sort_unstable_by_key(FinishedGroup::age_key);
        groups
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
