//! Every error the buffer reports. Each one leaves the buffer exactly as it was before the call.

use std::fmt;

/// A refused operation, with a message written for the person running the job.
///
/// The Python extension maps each variant to one exception class of `asyncrl_core.errors`
/// (see `python_class`), so this enum is the single source of what can go wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BufferError {
    /// A limit or argument is out of range (limits below one, a batch of zero groups, a negative
    /// prompt index or timeout).
    InvalidArgument(String),
    /// The group id was never handed out by this buffer.
    UnknownGroup { group_id: u64, next_group_id: u64 },
    /// The group was admitted but is no longer in flight: it finished, was abandoned, dropped or
    /// handed out already.
    GroupNotInflight { group_id: u64 },
    /// A version is negative or the versions of a group or of the actor go backwards.
    Version(String),
    /// `take_batch` asked for more groups than are buffered once stale groups are dropped.
    BatchTooLarge {
        requested: usize,
        available: usize,
        stale: usize,
    },
    /// Dropping the stale groups would exceed `rollout_buffer.max_dropped_groups_per_step`.
    DropLimitExceeded {
        dropped_this_step: u64,
        would_drop: u64,
        max_dropped_groups_per_step: u64,
    },
    /// Snapshot bytes that do not decode to a valid buffer state.
    CorruptState(String),
}

impl BufferError {
    /// The name of the Python exception class (in `asyncrl_core.errors`) this error becomes.
    pub fn python_class(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "InvalidArgumentError",
            Self::UnknownGroup { .. } | Self::GroupNotInflight { .. } => "InvalidGroupError",
            Self::Version(_) => "VersionError",
            Self::BatchTooLarge { .. } => "BatchTooLargeError",
            Self::DropLimitExceeded { .. } => "DropLimitExceededError",
            Self::CorruptState(_) => "CorruptStateError",
        }
    }
}

impl fmt::Display for BufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidArgument(message) | Self::Version(message) => f.write_str(message),
            Self::UnknownGroup {
                group_id,
                next_group_id,
            } => write!(
                f,
                "group {group_id} was never admitted by this buffer (ids so far are below {next_group_id})"
            ),
            Self::GroupNotInflight { group_id } => write!(
                f,
                "group {group_id} is not in flight: it already finished, was abandoned, or was dropped \
                 or handed out"
            ),
            Self::BatchTooLarge {
                requested,
                available,
                stale,
            } => {
                write!(
                    f,
                    "take_batch asked for {requested} groups but only {available} are buffered"
                )?;
                if *stale > 0 {
                    write!(
                        f,
                        " after dropping {stale} stale groups (nothing was dropped)"
                    )?;
                }
                Ok(())
            }
            Self::DropLimitExceeded {
                dropped_this_step,
                would_drop,
                max_dropped_groups_per_step,
            } => write!(
                f,
                "dropping {would_drop} stale groups would make {} drops this step, more than \
                 rollout_buffer.max_dropped_groups_per_step={max_dropped_groups_per_step}: the rollout \
                 falls too far behind the actor; raise agentloop.max_actor_accept_staleness, lower \
                 rollout_buffer.max_buffered_groups, or raise rollout_buffer.max_dropped_groups_per_step",
                dropped_this_step + would_drop
            ),
            Self::CorruptState(message) => write!(f, "corrupt buffer state: {message}"),
        }
    }
}

impl std::error::Error for BufferError {}

pub type Result<T> = std::result::Result<T, BufferError>;
