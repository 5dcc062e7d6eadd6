//! One test per rule of the buffer contract (ARCHITECTURE.md section 3), with a hand-driven clock.
#![cfg(not(loom))]

use std::sync::Arc;
use std::time::Duration;

use buffer_core::{
    BufferError, Completion, Counts, GroupBuffer, GroupVersions, Limits, ManualClock, StepStats,
};

const SECOND_NS: u64 = 1_000_000_000;

fn limits(inflight: i64, buffered: i64, max_dropped: i64, cap: Option<i64>) -> Limits {
    Limits::new(inflight, buffered, max_dropped, cap).expect("valid limits")
}

fn buffer(limits: Limits) -> (GroupBuffer<Arc<ManualClock>>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0));
    (GroupBuffer::with_clock(limits, Arc::clone(&clock)), clock)
}

fn versions(earliest_version: i64, latest_version: i64, finish_version: i64) -> GroupVersions {
    GroupVersions {
        earliest_version,
        latest_version,
        finish_version,
    }
}

fn admit(buffer: &GroupBuffer<Arc<ManualClock>>, prompt_index: u64) -> u64 {
    buffer.try_admit(prompt_index).expect("admission allowed")
}

#[test]
fn limits_below_one_or_negative_are_rejected_by_name() {
    for (inflight, buffered, dropped, cap, key) in [
        (0, 4, 1, None, "rollout_buffer.max_inflight_groups"),
        (-1, 4, 1, None, "rollout_buffer.max_inflight_groups"),
        (2, 0, 1, None, "rollout_buffer.max_buffered_groups"),
        (2, 1 << 40, 1, None, "rollout_buffer.max_buffered_groups"),
        (2, 4, -1, None, "rollout_buffer.max_dropped_groups_per_step"),
        (2, 4, 1, Some(-1), "agentloop.max_actor_accept_staleness"),
    ] {
        let error = Limits::new(inflight, buffered, dropped, cap).unwrap_err();
        assert!(matches!(error, BufferError::InvalidArgument { .. }));
        assert!(error.to_string().contains(key), "{error}");
    }
    // A buffer limit below the in-flight limit is valid: the in-flight limit then never binds.
    let (buffer, _) = buffer(limits(4, 2, 0, None));
    admit(&buffer, 0);
    admit(&buffer, 1);
    assert_eq!(buffer.try_admit(2), None);
    assert_eq!(buffer.counts().inflight, 2);
}

#[test]
fn admission_stops_at_the_inflight_limit_and_at_the_buffer_limit() {
    let (buffer, _) = buffer(limits(2, 3, 0, None));
    let first = admit(&buffer, 10);
    let second = admit(&buffer, 11);
    assert_eq!((first, second), (0, 1));
    assert_eq!(buffer.try_admit(12), None, "in-flight limit");
    buffer.complete(first, versions(0, 0, 0)).unwrap();
    let third = admit(&buffer, 12);
    assert_eq!(
        buffer.counts(),
        Counts {
            inflight: 2,
            buffered: 1
        }
    );
    buffer.complete(second, versions(0, 0, 0)).unwrap();
    assert_eq!(
        buffer.try_admit(13),
        None,
        "buffer limit: 1 in flight + 2 buffered"
    );
    buffer.take_batch(1, 0).unwrap();
    assert_eq!(buffer.try_admit(13), Some(3));
    assert_eq!(buffer.inflight_groups(), vec![(third, 12), (3, 13)]);
}

#[test]
fn finished_groups_leave_oldest_first_by_earliest_version_then_admission_order() {
    let (buffer, _) = buffer(limits(8, 8, 0, None));
    let ids: Vec<u64> = (0..5).map(|prompt| admit(&buffer, prompt)).collect();
    for (&group_id, earliest) in ids.iter().zip([2, 1, 2, 0, 1]) {
        buffer.complete(group_id, versions(earliest, 2, 3)).unwrap();
    }
    let batch = buffer.take_batch(5, 3).unwrap();
    let order: Vec<u64> = batch.groups.iter().map(|group| group.group_id).collect();
    assert_eq!(order, [3, 1, 4, 0, 2]);
    assert!(batch.dropped.is_empty());
}

#[test]
fn take_batch_drops_groups_past_the_staleness_cap_and_frees_their_capacity() {
    let (buffer, _) = buffer(limits(4, 4, 10, Some(1)));
    let ids: Vec<u64> = (0..4).map(|prompt| admit(&buffer, 100 + prompt)).collect();
    for (&group_id, earliest) in ids.iter().zip([0, 1, 2, 3]) {
        buffer
            .complete(group_id, versions(earliest, earliest, 3))
            .unwrap();
    }
    assert_eq!(buffer.try_admit(9), None);
    // At actor version 3, staleness is 3, 2, 1, 0: the first two exceed the cap of 1.
    let batch = buffer.take_batch(1, 3).unwrap();
    let dropped: Vec<(u64, u64)> = batch
        .dropped
        .iter()
        .map(|group| (group.group_id, group.prompt_index))
        .collect();
    assert_eq!(dropped, [(0, 100), (1, 101)]);
    assert_eq!(batch.groups[0].group_id, 2);
    assert_eq!(
        buffer.counts(),
        Counts {
            inflight: 0,
            buffered: 1
        }
    );
    assert_eq!(buffer.end_step().dropped_groups, 2);
}

#[test]
fn stale_groups_are_dropped_even_when_fewer_than_requested_remain() {
    let (buffer, _) = buffer(limits(4, 4, 10, Some(0)));
    let stale = admit(&buffer, 0);
    let fresh = admit(&buffer, 1);
    buffer.complete(stale, versions(0, 0, 1)).unwrap();
    buffer.complete(fresh, versions(1, 1, 1)).unwrap();
    let hand_off = buffer.take_batch(2, 1).unwrap();
    assert!(!hand_off.is_ready());
    assert!(hand_off.groups.is_empty());
    assert_eq!(hand_off.num_ready, 1);
    let dropped: Vec<(u64, u64)> = hand_off
        .dropped
        .iter()
        .map(|group| (group.group_id, group.prompt_index))
        .collect();
    assert_eq!(dropped, [(stale, 0)]);
    // The drop freed its capacity: only the fresh group is left.
    assert_eq!(
        buffer.counts(),
        Counts {
            inflight: 0,
            buffered: 1
        }
    );
    assert_eq!(buffer.end_step().dropped_groups, 1);
    for num_groups in [0, 5] {
        assert!(matches!(
            buffer.take_batch(num_groups, 1),
            Err(BufferError::InvalidArgument {
                argument: "num_groups",
                ..
            })
        ));
    }
}

#[test]
fn a_zero_cap_in_async_mode_never_deadlocks() {
    // Groups keep finishing one version behind the actor: with cap 0 each is stale at the next
    // hand-off. The buffer must keep freeing capacity instead of filling up with stale groups.
    let (buffer, _) = buffer(limits(2, 2, i64::MAX, Some(0)));
    let mut prompt = 0;
    for actor_version in 1..20 {
        while let Some(group_id) = buffer.try_admit(prompt) {
            buffer
                .complete(
                    group_id,
                    versions(actor_version - 1, actor_version - 1, actor_version - 1),
                )
                .unwrap();
            prompt += 1;
        }
        let hand_off = buffer.take_batch(1, actor_version).unwrap();
        assert!(!hand_off.is_ready());
        assert_eq!(hand_off.dropped.len(), 2);
        assert_eq!(buffer.counts(), Counts::default());
    }
}

#[test]
fn a_waiting_hand_off_is_woken_by_a_completion() {
    let (buffer, _) = buffer(limits(2, 4, 0, None));
    let group_id = admit(&buffer, 3);
    let hand_off = std::thread::scope(|scope| {
        let trainer = scope.spawn(|| buffer.wait_batch(1, 0, Duration::from_secs(600)));
        buffer.complete(group_id, versions(0, 0, 0)).unwrap();
        trainer.join().unwrap().unwrap()
    });
    assert_eq!(hand_off.groups.len(), 1);
    assert_eq!(hand_off.groups[0].prompt_index, 3);
    // Nothing ready and a timeout of zero: returns at once, not ready.
    let empty = buffer.wait_batch(1, 0, Duration::ZERO).unwrap();
    assert!(!empty.is_ready());
    assert_eq!(empty.num_ready, 0);
}

#[test]
fn the_drop_guard_names_its_setting_and_changes_nothing() {
    let (buffer, _) = buffer(limits(4, 4, 1, Some(0)));
    for prompt in 0..3 {
        let group_id = admit(&buffer, prompt);
        buffer.complete(group_id, versions(0, 0, 0)).unwrap();
    }
    let before = buffer.state();
    let error = buffer.take_batch(1, 2).unwrap_err();
    assert!(matches!(error, BufferError::DropLimitExceeded { .. }));
    assert!(error
        .to_string()
        .contains("rollout_buffer.max_dropped_groups_per_step"));
    assert_eq!(buffer.state(), before);
}

#[test]
fn completing_twice_is_a_no_op_and_an_unknown_group_an_error() {
    let (buffer, _) = buffer(limits(2, 4, 0, None));
    let group_id = admit(&buffer, 7);
    assert_eq!(buffer.complete(group_id, versions(0, 0, 0)), Ok(true));
    let before = buffer.state();
    // A retried completion, even with other versions, changes nothing: the first one stands.
    assert_eq!(buffer.complete(group_id, versions(0, 0, 0)), Ok(false));
    assert_eq!(buffer.complete(group_id, versions(2, 1, 0)), Ok(false));
    assert_eq!(
        buffer.complete(5, versions(0, 0, 0)),
        Err(BufferError::UnknownGroup {
            group_id: 5,
            next_group_id: 1
        })
    );
    assert_eq!(
        buffer.abandon(group_id),
        Err(BufferError::GroupNotInflight { group_id })
    );
    assert_eq!(buffer.state(), before);
    // Still a no-op once the group was handed out.
    buffer.take_batch(1, 0).unwrap();
    let after = buffer.state();
    assert_eq!(buffer.complete(group_id, versions(0, 0, 0)), Ok(false));
    assert_eq!(buffer.state(), after);
}

#[test]
fn a_completion_must_name_the_admitted_prompt() {
    let (buffer, _) = buffer(limits(2, 4, 0, None));
    let group_id = admit(&buffer, 7);
    let before = buffer.state();
    let completion = Completion {
        group_id,
        prompt_index: Some(8),
        token_versions: Some((0, 0)),
        finish_version: None,
    };
    assert_eq!(
        buffer.complete_group(completion),
        Err(BufferError::PromptMismatch {
            group_id,
            admitted_prompt_index: 7,
            prompt_index: 8
        })
    );
    assert_eq!(buffer.state(), before);
}

#[test]
fn the_buffer_stamps_a_missing_finish_version() {
    let (buffer, _) = buffer(limits(4, 4, 0, None));
    let ids: Vec<u64> = (0..4).map(|prompt| admit(&buffer, prompt)).collect();
    let completion = |group_id: u64, token_versions| Completion {
        group_id,
        prompt_index: Some(group_id),
        token_versions,
        finish_version: None,
    };
    // Before any hand-off the floor is 0; the group's latest version wins when newer.
    assert_eq!(
        buffer.complete_group(completion(ids[0], Some((1, 2)))),
        Ok(Some(versions(1, 2, 2)))
    );
    buffer.take_batch(1, 3).unwrap();
    // After a hand-off at 3, the floor is 3; a group without model tokens sits at the floor.
    assert_eq!(
        buffer.complete_group(completion(ids[1], Some((1, 2)))),
        Ok(Some(versions(1, 2, 3)))
    );
    assert_eq!(
        buffer.complete_group(completion(ids[2], None)),
        Ok(Some(versions(3, 3, 3)))
    );
    // A finish version given explicitly below the floor names the remedy.
    let error = buffer
        .complete_group(Completion {
            finish_version: Some(2),
            ..completion(ids[3], Some((1, 2)))
        })
        .unwrap_err();
    assert!(matches!(
        error,
        BufferError::Version {
            group_id: Some(3),
            ..
        }
    ));
    assert!(
        error.to_string().contains("leave finish_version unset"),
        "{error}"
    );
}

#[test]
fn abandon_frees_the_slot_and_returns_the_prompt() {
    let (buffer, _) = buffer(limits(1, 4, 0, None));
    let group_id = admit(&buffer, 42);
    assert_eq!(buffer.try_admit(43), None);
    assert_eq!(buffer.abandon(group_id), Ok(42));
    assert_eq!(buffer.try_admit(43), Some(1));
    // A late completion of the abandoned group is ignored.
    assert_eq!(buffer.complete(group_id, versions(0, 0, 0)), Ok(false));
}

#[test]
fn versions_that_go_backwards_are_errors_that_change_nothing() {
    let (buffer, _) = buffer(limits(4, 4, 0, None));
    let first = admit(&buffer, 0);
    let second = admit(&buffer, 1);
    let before = buffer.state();
    for bad in [versions(-1, 0, 0), versions(2, 1, 3), versions(1, 3, 2)] {
        assert!(matches!(
            buffer.complete(first, bad),
            Err(BufferError::Version { .. })
        ));
    }
    assert_eq!(buffer.state(), before);
    buffer.complete(first, versions(1, 2, 5)).unwrap();
    // The actor cannot be older than a version a group saw as current.
    assert!(matches!(
        buffer.take_batch(1, 4),
        Err(BufferError::Version { .. })
    ));
    buffer.take_batch(1, 6).unwrap();
    // Nor go back, nor can a group finish before a version already handed out.
    assert!(matches!(
        buffer.complete(second, versions(5, 5, 5)),
        Err(BufferError::Version { .. })
    ));
    buffer.complete(second, versions(5, 5, 6)).unwrap();
    assert!(matches!(
        buffer.take_batch(1, 5),
        Err(BufferError::Version { .. })
    ));
    assert!(matches!(
        buffer.take_batch(1, -1),
        Err(BufferError::Version { .. })
    ));
}

#[test]
fn step_statistics_follow_the_definitions() {
    let (buffer, clock) = buffer(limits(8, 8, 0, None));
    // (earliest, latest) per group; all finish at 4 and are taken at actor version 5.
    let spans = [(1, 3), (3, 4), (4, 4), (3, 3)];
    for (prompt, &(earliest, latest)) in spans.iter().enumerate() {
        let group_id = admit(&buffer, prompt as u64);
        buffer
            .complete(group_id, versions(earliest, latest, 4))
            .unwrap();
    }
    buffer.take_batch(4, 5).unwrap();
    clock.advance_ns(3 * SECOND_NS);
    let stats = buffer.end_step();
    assert_eq!(stats.num_groups, 4);
    assert_eq!(stats.staleness_sum, 4 + 2 + 1 + 2);
    assert_eq!(stats.staleness_max, 4);
    assert_eq!(
        stats.staleness_counts.into_iter().collect::<Vec<_>>(),
        [(1, 1), (2, 2), (4, 1)]
    );
    assert_eq!(stats.version_span_sum, 2 + 1);
    assert_eq!(stats.queue_steps_sum, 2 + 1 + 1 + 2);
    assert_eq!(stats.wall_ns, 3 * SECOND_NS);
    // end_step resets the totals.
    assert_eq!(
        buffer.end_step(),
        StepStats {
            wall_ns: 0,
            ..StepStats::default()
        }
    );
}

#[test]
fn wait_time_is_charged_to_the_limit_that_blocks() {
    // In-flight limit 2, buffer limit 3.
    let (buffer, clock) = buffer(limits(2, 3, 0, None));
    let first = admit(&buffer, 0);
    let second = admit(&buffer, 1);
    clock.advance_ns(SECOND_NS);
    // Refused at t=1 by the in-flight limit (the buffer is not full: 2 of 3).
    assert_eq!(buffer.try_admit(2), None);
    clock.advance_ns(2 * SECOND_NS);
    // t=3: a group finishes; 1 in flight + 1 buffered leaves room, the wait ends.
    buffer.complete(first, versions(0, 0, 0)).unwrap();
    clock.advance_ns(SECOND_NS);
    let third = admit(&buffer, 2);
    // t=4: 2 in flight + 1 buffered: both limits block; the in-flight limit is charged.
    assert_eq!(buffer.try_admit(3), None);
    clock.advance_ns(SECOND_NS);
    // t=5: one finishes: 1 in flight + 2 buffered, now only the full buffer blocks.
    buffer.complete(second, versions(0, 0, 0)).unwrap();
    clock.advance_ns(3 * SECOND_NS);
    // t=8: a batch is handed out, freeing room.
    buffer.take_batch(1, 0).unwrap();
    clock.advance_ns(2 * SECOND_NS);
    let stats = buffer.end_step();
    assert_eq!(
        stats.admission_wait_inflight_limit_ns,
        2 * SECOND_NS + SECOND_NS
    );
    assert_eq!(stats.admission_wait_buffer_full_ns, 3 * SECOND_NS);
    assert_eq!(stats.wall_ns, 10 * SECOND_NS);
    buffer.complete(third, versions(0, 0, 0)).unwrap();
}

#[test]
fn a_wait_in_progress_is_split_between_steps() {
    let (buffer, clock) = buffer(limits(1, 1, 0, None));
    admit(&buffer, 0);
    assert_eq!(buffer.try_admit(1), None);
    clock.advance_ns(4 * SECOND_NS);
    let first = buffer.end_step();
    assert_eq!(first.admission_wait_inflight_limit_ns, 4 * SECOND_NS);
    clock.advance_ns(SECOND_NS);
    let second = buffer.end_step();
    assert_eq!(second.admission_wait_inflight_limit_ns, SECOND_NS);
    assert_eq!(second.wall_ns, SECOND_NS);
}

#[test]
fn wait_admit_wakes_when_capacity_frees_and_times_out_otherwise() {
    let buffer = Arc::new(GroupBuffer::new(limits(1, 2, 0, None)));
    let first = buffer.try_admit(0).unwrap();
    assert_eq!(buffer.wait_admit(1, Duration::from_millis(20)), None);
    let waiter = {
        let buffer = Arc::clone(&buffer);
        std::thread::spawn(move || buffer.wait_admit(1, Duration::from_secs(60)))
    };
    std::thread::sleep(Duration::from_millis(20));
    buffer.complete(first, versions(0, 0, 0)).unwrap();
    assert_eq!(waiter.join().unwrap(), Some(1));
    let stats = buffer.end_step();
    assert!(stats.admission_wait_inflight_limit_ns > 0);
    assert_eq!(stats.admission_wait_buffer_full_ns, 0);
}

#[test]
fn state_round_trips_exactly_and_the_restored_buffer_continues() {
    let (buffer, clock) = buffer(limits(3, 5, 4, Some(2)));
    let ids: Vec<u64> = (0..3).map(|prompt| admit(&buffer, 50 + prompt)).collect();
    buffer.complete(ids[0], versions(0, 1, 1)).unwrap();
    buffer.complete(ids[1], versions(1, 1, 2)).unwrap();
    assert_eq!(buffer.try_admit(60), Some(3));
    assert_eq!(buffer.try_admit(61), Some(4));
    buffer.take_batch(1, 2).unwrap();
    clock.advance_ns(7);
    let state = buffer.state();
    let bytes = buffer.to_bytes().unwrap();
    let restored = GroupBuffer::from_state(
        buffer_core::state::decode(&bytes).unwrap(),
        ManualClock::new(0),
    )
    .unwrap();
    assert_eq!(restored.state(), state);
    assert_eq!(restored.counts(), buffer.counts());
    assert_eq!(restored.to_bytes().unwrap(), bytes);
    // The restored buffer keeps its counters, its next id and its version watermarks.
    assert_eq!(restored.try_admit(62), None);
    assert_eq!(restored.abandon(4), Ok(61));
    assert_eq!(restored.try_admit(62), Some(5));
    assert!(matches!(
        restored.take_batch(1, 1),
        Err(BufferError::Version { .. })
    ));
}

#[test]
fn corrupt_bytes_are_a_typed_error() {
    let (buffer, _) = buffer(limits(3, 5, 4, Some(2)));
    let group_id = admit(&buffer, 1);
    buffer.complete(group_id, versions(0, 0, 0)).unwrap();
    admit(&buffer, 2);
    let bytes = buffer.to_bytes().unwrap();
    let mut cases: Vec<Vec<u8>> = vec![
        Vec::new(),
        bytes[..bytes.len() - 1].to_vec(),
        [bytes.as_slice(), &[0]].concat(),
        b"not a snapshot at all, just some text".to_vec(),
    ];
    for position in [0, 9, 20, bytes.len() / 2, bytes.len() - 1] {
        let mut flipped = bytes.clone();
        flipped[position] ^= 0x10;
        cases.push(flipped);
    }
    for case in cases {
        assert!(matches!(
            GroupBuffer::from_bytes(&case),
            Err(BufferError::CorruptState(_))
        ));
    }
}

#[test]
fn an_impossible_state_with_a_valid_checksum_is_rejected() {
    let (buffer, _) = buffer(limits(2, 4, 0, None));
    let group_id = admit(&buffer, 1);
    let mut state = buffer.state();
    state.inflight.push((group_id, 9));
    let bytes = buffer_core::state::encode(&state).unwrap();
    let error = GroupBuffer::from_bytes(&bytes).err().unwrap();
    assert!(error.to_string().contains("appears twice"), "{error}");
}

#[test]
fn batch_admission_admits_the_prefix_that_fits_and_batch_completion_is_all_or_nothing() {
    let (buffer, clock) = buffer(limits(3, 4, 0, None));
    assert_eq!(buffer.try_admit_many(&[7, 8, 9, 10]), [0, 1, 2]);
    clock.advance_ns(SECOND_NS);
    let before = buffer.state();
    for bad in [
        vec![(0, versions(0, 0, 0)), (5, versions(0, 0, 0))],
        vec![(0, versions(0, 0, 0)), (1, versions(1, 0, 1))],
    ] {
        assert!(buffer.complete_many(&bad).is_err());
        assert_eq!(buffer.state(), before);
    }
    // Listed twice: the second entry is a retry.
    assert_eq!(
        buffer
            .complete_many(&[
                (2, versions(0, 0, 0)),
                (0, versions(1, 1, 1)),
                (2, versions(0, 0, 0))
            ])
            .unwrap(),
        [true, true, false]
    );
    assert_eq!(
        buffer.counts(),
        Counts {
            inflight: 1,
            buffered: 2
        }
    );
    // The refusal of prompt 10 started a wait (in-flight limit) that the completion ended.
    assert_eq!(
        buffer.end_step().admission_wait_inflight_limit_ns,
        SECOND_NS
    );
    let batch = buffer.take_batch(2, 1).unwrap();
    let order: Vec<u64> = batch.groups.iter().map(|group| group.group_id).collect();
    assert_eq!(order, [2, 0]);
}
