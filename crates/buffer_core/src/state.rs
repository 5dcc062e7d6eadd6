//! The whole buffer state as plain data, and its byte format for checkpoints.
//!
//! Format:
//!
//! ```text
//! magic   8 bytes  b"ARLBUFST"
//! format  u32      FORMAT_VERSION, little-endian
//! payload          `BufferState` in postcard's format (serde; varint integers, length-prefixed lists)
//! crc32   u32      CRC-32 (IEEE) of every byte before it, little-endian
//! ```
//!
//! The codec is serde's derives with postcard (compact, no schema in the bytes, so the format version
//! says which `BufferState` layout the payload has) and `crc32fast`. Decoding checks the magic, the
//! format version and the checksum before it reads a field, lets postcard read with its bounds checks
//! (serde never preallocates more than a small cap from a length it reads), and validates the result as
//! a buffer state, so any damaged or foreign input is a `BufferError::CorruptState`, never a panic.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{BufferError, Result};
use crate::heap::{FinishedGroup, GroupVersions};
use crate::ledger::StepStats;
use crate::limits::Limits;

const MAGIC: &[u8; 8] = b"ARLBUFST";
/// 2: postcard payload (1 was a hand-written fixed-width layout).
const FORMAT_VERSION: u32 = 2;
const HEADER_LEN: usize = 8 + 4;
const CRC_LEN: usize = 4;

/// Everything a buffer knows, detached from its atomics and locks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferState {
    pub limits: Limits,
    /// The id the next admitted group gets; every id below it was handed out once.
    pub next_group_id: u64,
    /// The `actor_version` of the last `take_batch`, if any.
    pub last_actor_version: Option<i64>,
    /// The largest `finish_version` of any completed group, if any.
    pub max_finish_version: Option<i64>,
    /// `(group_id, prompt_index)` of each group in flight, by group id.
    pub inflight: Vec<(u64, u64)>,
    /// The finished groups waiting for the actor, oldest first.
    pub finished: Vec<FinishedGroup>,
    /// The running step's totals; `wall_ns` is the step's wall time when the state was taken.
    pub step: StepStats,
}

impl BufferState {
    /// Check that the state is one a buffer can be in; `CorruptState` names the first broken rule.
    pub fn validate(&self) -> Result<()> {
        let corrupt = |message: String| Err(BufferError::CorruptState(message));
        let limits = &self.limits;
        if limits.max_inflight_groups == 0 || limits.max_buffered_groups == 0 {
            return corrupt("a count limit is zero".into());
        }
        if self.inflight.len() > limits.max_inflight_groups as usize {
            return corrupt(format!(
                "{} groups in flight exceed max_inflight_groups={}",
                self.inflight.len(),
                limits.max_inflight_groups
            ));
        }
        if self.inflight.len() + self.finished.len() > limits.max_buffered_groups as usize {
            return corrupt(format!(
                "{} groups in flight or buffered exceed max_buffered_groups={}",
                self.inflight.len() + self.finished.len(),
                limits.max_buffered_groups
            ));
        }
        let mut seen = HashSet::with_capacity(self.inflight.len() + self.finished.len());
        let ids = self
            .inflight
            .iter()
            .map(|&(group_id, _)| group_id)
            .chain(self.finished.iter().map(|group| group.group_id));
        for group_id in ids {
            if group_id >= self.next_group_id {
                return corrupt(format!(
                    "group {group_id} is not below next_group_id={}",
                    self.next_group_id
                ));
            }
            if !seen.insert(group_id) {
                return corrupt(format!("group {group_id} appears twice"));
            }
        }
        for group in &self.finished {
            let GroupVersions {
                earliest_version,
                latest_version,
                finish_version,
            } = group.versions;
            let ordered = 0 <= earliest_version
                && earliest_version <= latest_version
                && latest_version <= finish_version
                && self
                    .max_finish_version
                    .is_some_and(|max| finish_version <= max);
            if !ordered {
                return corrupt(format!(
                    "group {} has versions out of order ({earliest_version}, {latest_version}, \
                     {finish_version})",
                    group.group_id
                ));
            }
        }
        let step = &self.step;
        let counted: u64 = step.staleness_counts.values().sum();
        let weighted: u128 = step
            .staleness_counts
            .iter()
            .map(|(&staleness, &count)| u128::from(staleness) * u128::from(count))
            .sum();
        let max = step
            .staleness_counts
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0);
        if counted != step.num_groups
            || weighted != u128::from(step.staleness_sum)
            || max != step.staleness_max
            || step.staleness_counts.values().any(|&count| count == 0)
        {
            return corrupt("the step's staleness totals disagree with its histogram".into());
        }
        Ok(())
    }
}

/// Serialise `state` to bytes (see the module docs for the format). Writing into memory does not
/// fail for these types; postcard's error is still passed on rather than unwrapped.
pub fn encode(state: &BufferState) -> Result<Vec<u8>> {
    let mut header = Vec::with_capacity(64 + 12 * state.inflight.len() + 24 * state.finished.len());
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    let mut bytes = postcard::to_extend(state, header).map_err(|error| {
        BufferError::CorruptState(format!("the state could not be written: {error}"))
    })?;
    let checksum = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    Ok(bytes)
}

/// Parse and validate bytes written by `encode`.
pub fn decode(bytes: &[u8]) -> Result<BufferState> {
    let corrupt = |message: String| BufferError::CorruptState(message);
    if bytes.len() < HEADER_LEN + CRC_LEN {
        return Err(corrupt("too short to be a buffer snapshot".into()));
    }
    let (magic, rest) = bytes.split_at(MAGIC.len());
    if magic != MAGIC {
        return Err(corrupt("not a buffer snapshot (wrong magic bytes)".into()));
    }
    let (format, _) = rest.split_at(4);
    let format_version = u32::from_le_bytes([format[0], format[1], format[2], format[3]]);
    if format_version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "snapshot format {format_version} is not supported (this build reads format {FORMAT_VERSION})"
        )));
    }
    let (body, checksum) = bytes.split_at(bytes.len() - CRC_LEN);
    let checksum = u32::from_le_bytes([checksum[0], checksum[1], checksum[2], checksum[3]]);
    if checksum != crc32fast::hash(body) {
        return Err(corrupt("checksum mismatch (truncated or damaged)".into()));
    }
    let (state, trailing) = postcard::take_from_bytes::<BufferState>(&body[HEADER_LEN..])
        .map_err(|error| corrupt(format!("the state does not decode: {error}")))?;
    if !trailing.is_empty() {
        return Err(corrupt("trailing bytes after the state".into()));
    }
    state.validate()?;
    Ok(state)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_is_the_standard_crc32() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn another_format_version_is_refused_by_name() {
        let state = BufferState {
            limits: Limits::new(1, 1, 0, None).unwrap(),
            next_group_id: 0,
            last_actor_version: None,
            max_finish_version: None,
            inflight: Vec::new(),
            finished: Vec::new(),
            step: StepStats::default(),
        };
        let mut bytes = encode(&state).unwrap();
        assert_eq!(decode(&bytes), Ok(state));
        bytes[8] = 1;
        let body = bytes.len() - CRC_LEN;
        let checksum = crc32fast::hash(&bytes[..body]).to_le_bytes();
        bytes[body..].copy_from_slice(&checksum);
        let error = decode(&bytes).unwrap_err();
        assert!(
            error.to_string().contains("format 1 is not supported"),
            "{error}"
        );
    }
}
