//! The groups in flight: the prompt index of each, by group id.
//!
//! Group ids are handed out in order, and groups mostly finish in about the order they were admitted,
//! so the records live in a window indexed by `group_id - base`: admission appends, completion clears a
//! slot, and the window's cleared front is trimmed. Recent groups sit next to each other, so a cycle
//! touches a few hot cache lines however many groups are in flight. A group that stays in flight much
//! longer than the others (a straggler) would keep the window from trimming; once the window holds
//! more than twice as many slots as live groups (plus `slack`), its front is moved to a hash map of
//! stragglers, so memory stays proportional to the groups in flight.
//!
//! A hash map keyed by the id alone (the earlier design) puts consecutive ids in consecutive buckets;
//! once the ids wrap around the table, new ones land on the buckets of long-lived groups admitted
//! earlier and probe past them one by one: with a million groups in flight that made a cycle up to ten
//! times dearer.

use std::collections::{HashMap, VecDeque};

/// Window slots allowed beyond twice the live ones before stragglers move out.
const SLACK: usize = 4096;

#[derive(Debug, Clone)]
pub(crate) struct Inflight {
    /// Group id of `window[0]`.
    base: u64,
    window: VecDeque<Option<u64>>,
    live_in_window: usize,
    stragglers: HashMap<u64, u64>,
    slack: usize,
}

impl Default for Inflight {
    fn default() -> Self {
        Self::with_slack(SLACK)
    }
}

impl Inflight {
    fn with_slack(slack: usize) -> Self {
        Self {
            base: 0,
            window: VecDeque::new(),
            live_in_window: 0,
            stragglers: HashMap::new(),
            slack,
        }
    }

    /// The window index of `group_id`, if it falls inside the window.
    fn index(&self, group_id: u64) -> Option<usize> {
        let offset = usize::try_from(group_id.checked_sub(self.base)?).ok()?;
        (offset < self.window.len()).then_some(offset)
    }

    pub(crate) fn get(&self, group_id: u64) -> Option<u64> {
        match self.index(group_id) {
            Some(index) => self.window[index],
            None => self.stragglers.get(&group_id).copied(),
        }
    }

    /// Record `group_id` (not in flight yet) as in flight for `prompt_index`.
    pub(crate) fn insert(&mut self, group_id: u64, prompt_index: u64) {
        if self.window.is_empty() {
            self.base = group_id;
        }
        if group_id < self.base {
            self.stragglers.insert(group_id, prompt_index);
            return;
        }
        // Admission appends (ids are handed out in order); a restored state may leave gaps.
        let offset = group_id - self.base;
        while (self.window.len() as u64) <= offset {
            self.window.push_back(None);
        }
        let slot = &mut self.window[offset as usize];
        if slot.replace(prompt_index).is_none() {
            self.live_in_window += 1;
        }
        self.compact();
    }

    /// Remove `group_id` if it is in flight; its prompt index.
    pub(crate) fn remove(&mut self, group_id: u64) -> Option<u64> {
        let Some(index) = self.index(group_id) else {
            return self.stragglers.remove(&group_id);
        };
        let prompt_index = self.window[index].take()?;
        self.live_in_window -= 1;
        while self.window.front() == Some(&None) {
            self.window.pop_front();
            self.base += 1;
        }
        Some(prompt_index)
    }

    /// `(group_id, prompt_index)` of every group in flight, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let window = self.window.iter().enumerate().filter_map(|(offset, slot)| {
            slot.map(|prompt_index| (self.base + offset as u64, prompt_index))
        });
        self.stragglers
            .iter()
            .map(|(&group_id, &prompt_index)| (group_id, prompt_index))
            .chain(window)
    }

    /// Move the window's front to the stragglers while the window is mostly cleared slots.
    fn compact(&mut self) {
        while self.window.len() > 2 * self.live_in_window + self.slack {
            if let Some(Some(prompt_index)) = self.window.pop_front() {
                self.stragglers.insert(self.base, prompt_index);
                self.live_in_window -= 1;
            }
            self.base += 1;
        }
        while self.window.front() == Some(&None) {
            self.window.pop_front();
            self.base += 1;
        }
    }
}

impl FromIterator<(u64, u64)> for Inflight {
    fn from_iter<I: IntoIterator<Item = (u64, u64)>>(records: I) -> Self {
        let mut records: Vec<(u64, u64)> = records.into_iter().collect();
        records.sort_unstable();
        let mut inflight = Self::default();
        for (group_id, prompt_index) in records {
            inflight.insert(group_id, prompt_index);
        }
        inflight
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a plain map: admissions in id order, removals of any id, with a tiny slack so the
        /// stragglers path runs constantly.
        #[test]
        fn agrees_with_a_map(ops in prop::collection::vec((any::<bool>(), 0u64..64), 1..400), slack in 0usize..4) {
            let mut inflight = Inflight::with_slack(slack);
            let mut model = BTreeMap::new();
            let mut next_group_id = 0u64;
            for (admit, pick) in ops {
                if admit {
                    inflight.insert(next_group_id, pick);
                    model.insert(next_group_id, pick);
                    next_group_id += 1;
                } else {
                    let group_id = next_group_id.saturating_sub(1 + pick % 8);
                    prop_assert_eq!(inflight.remove(group_id), model.remove(&group_id));
                }
                let mut records: Vec<(u64, u64)> = inflight.iter().collect();
                records.sort_unstable();
                prop_assert_eq!(records, model.iter().map(|(&id, &p)| (id, p)).collect::<Vec<_>>());
                // The window only grows on admission, which compacts it.
                if admit {
                    prop_assert!(inflight.window.len() <= 2 * inflight.live_in_window + slack);
                }
                for group_id in next_group_id.saturating_sub(24)..next_group_id {
                    prop_assert_eq!(inflight.get(group_id), model.get(&group_id).copied());
                }
            }
        }
    }

    #[test]
    fn a_restored_set_with_gaps_round_trips() {
        let records = [(9, 1), (2, 5), (40, 7)];
        let inflight: Inflight = records.iter().copied().collect();
        let mut back: Vec<(u64, u64)> = inflight.iter().collect();
        back.sort_unstable();
        assert_eq!(back, [(2, 5), (9, 1), (40, 7)]);
        assert_eq!(inflight.get(9), Some(1));
        assert_eq!(inflight.get(10), None);
    }
}
