//! The buffer's configuration, validated once.

use serde::{Deserialize, Serialize};

use crate::error::{BufferError, Result};

/// The limits of one buffer, named as the configuration keys that set them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// `rollout_buffer.max_inflight_groups`: groups being generated at once (engine load).
    pub max_inflight_groups: u32,
    /// `rollout_buffer.max_buffered_groups`: groups in flight plus finished and waiting (data age).
    pub max_buffered_groups: u32,
    /// `rollout_buffer.max_dropped_groups_per_step`: stale drops allowed in one step; 0 means none.
    pub max_dropped_groups_per_step: u64,
    /// `agentloop.max_actor_accept_staleness`: the hard staleness cap, or `None` for no cap.
    pub max_actor_accept_staleness: Option<u64>,
}

impl Limits {
    /// Validate the limits as they come from the configuration (signed, as Python and YAML give them).
    ///
    /// `max_buffered_groups < max_inflight_groups` is accepted: the in-flight limit then never binds,
    /// because in-flight groups count against the buffer limit too. The configuration layer warns
    /// about it; the buffer stays correct either way.
    pub fn new(
        max_inflight_groups: i64,
        max_buffered_groups: i64,
        max_dropped_groups_per_step: i64,
        max_actor_accept_staleness: Option<i64>,
    ) -> Result<Self> {
        Ok(Self {
            max_inflight_groups: count_limit(
                "rollout_buffer.max_inflight_groups",
                max_inflight_groups,
            )?,
            max_buffered_groups: count_limit(
                "rollout_buffer.max_buffered_groups",
                max_buffered_groups,
            )?,
            max_dropped_groups_per_step: u64::try_from(max_dropped_groups_per_step).map_err(
                |_| {
                    BufferError::invalid(
                        "rollout_buffer.max_dropped_groups_per_step",
                        format!(
                            "rollout_buffer.max_dropped_groups_per_step must be 0 or more, got \
                             {max_dropped_groups_per_step}"
                        ),
                    )
                },
            )?,
            max_actor_accept_staleness: max_actor_accept_staleness
                .map(|cap| {
                    u64::try_from(cap).map_err(|_| {
                        BufferError::invalid(
                            "agentloop.max_actor_accept_staleness",
                            format!(
                                "agentloop.max_actor_accept_staleness must be 0 or more (or unset), \
                                 got {cap}"
                            ),
                        )
                    })
                })
                .transpose()?,
        })
    }
}

/// The counters are 32-bit halves of one atomic word, so a count limit is in `1..=u32::MAX`.
fn count_limit(key: &'static str, value: i64) -> Result<u32> {
    match u32::try_from(value) {
        Ok(limit) if limit >= 1 => Ok(limit),
        _ => Err(BufferError::invalid(
            key,
            format!("{key} must be between 1 and {}, got {value}", u32::MAX),
        )),
    }
}
