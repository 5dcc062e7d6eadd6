//! Every error the buffer reports. Each one leaves the buffer exactly as it was before the call.

use std::fmt;

/// A refused operation, with a message written for the person running the job.
///
/// The Python extension maps each variant to one exception class of `asyncrl_core.errors`
/// (see `python_class`), so this enum is the single source of what can go wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BufferError {
    /// A limit or argument is out of range (limits below one, a batch of zero groups, a negative
    /// prompt index or timeout). `argument` is the argument's or configuration key's name.
    InvalidArgument {
        argument: &'static str,
        message: String,
    },
    /// The group id was never handed out by this buffer.
    UnknownGroup { group_id: u64, next_group_id: u64 },
    /// The group was admitted but is no longer in flight (it finished or was abandoned), so it cannot
    /// be abandoned. (Completing it again is not an error: see `GroupBuffer::complete`.)
    GroupNotInflight { group_id: u64 },
    /// The group was admitted for another prompt than the one its completion names.
    PromptMismatch {
        group_id: u64,
        admitted_prompt_index: u64,
        prompt_index: u64,
    },
    /// A version is negative or the versions of a group or of the actor go backwards. `group_id` is
    /// the group whose versions are wrong, or `None` for the actor's version.
    Version {
        group_id: Option<u64>,
        message: String,
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
            Self::InvalidArgument { .. } => "InvalidArgumentError",
            Self::UnknownGroup { .. }
            | Self::GroupNotInflight { .. }
            | Self::PromptMismatch { .. } => "InvalidGroupError",
            Self::Version { .. } => "VersionError",
            Self::DropLimitExceeded { .. } => "DropLimitExceededError",
            Self::CorruptState(_) => "CorruptStateError",
        }
    }
}

impl fmt::Display for BufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidArgument { message, .. } | Self::Version { message, .. } => {
                f.write_str(message)
            }
            Self::UnknownGroup {
                group_id,
                next_group_id,
            } => write!(
                f,
                "group {group_id} was never admitted by this buffer (ids so far are below {next_group_id})"
            ),
            Self::GroupNotInflight { group_id } => write!(
                f,
                "group {group_id} is not in flight: it already finished or was abandoned"
            ),
            Self::PromptMismatch {
                group_id,
                admitted_prompt_index,
                prompt_index,
            } => write!(
                f,
                "group {group_id} was admitted for prompt {admitted_prompt_index}, but its completion \
                 names prompt {prompt_index}"
            ),
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

impl BufferError {
    /// An `InvalidArgument` error about `argument`.
    pub fn invalid(argument: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            argument,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, BufferError>;
