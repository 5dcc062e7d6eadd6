//! The whole buffer state as plain data, and its byte format for checkpoints.
//!
//! Format (all integers little-endian):
//!
//! ```text
//! magic   8 bytes  b"ARLBUFST"
//! format  u32      FORMAT_VERSION
//! length  u64      payload length in bytes
//! payload          the fields of `BufferState`, in declaration order (see `encode_payload`)
//! crc32   u32      CRC-32 (IEEE) of every byte before it
//! ```
//!
//! Decoding checks the magic, the format version, the length and the checksum before it reads a field,
//! then reads with bounds checks and validates the result as a buffer state, so any damaged or
//! foreign input is a `BufferError::CorruptState` and never a panic or a huge allocation.

use std::collections::{BTreeMap, HashSet};

use crate::error::{BufferError, Result};
use crate::heap::{FinishedGroup, GroupVersions};
use crate::ledger::StepStats;
use crate::limits::Limits;

const MAGIC: &[u8; 8] = b"ARLBUFST";
const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 8;
const CRC_LEN: usize = 4;

/// Everything a buffer knows, detached from its atomics and locks.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Serialise `state` to bytes (see the module docs for the format).
pub fn encode(state: &BufferState) -> Vec<u8> {
    let mut payload =
        Vec::with_capacity(128 + 16 * state.inflight.len() + 40 * state.finished.len());
    encode_payload(state, &mut payload);
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len() + CRC_LEN);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    let checksum = crc32(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    bytes
}

/// Parse and validate bytes written by `encode`.
pub fn decode(bytes: &[u8]) -> Result<BufferState> {
    let corrupt = |message: &str| BufferError::CorruptState(message.to_owned());
    if bytes.len() < HEADER_LEN + CRC_LEN {
        return Err(corrupt("too short to be a buffer snapshot"));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt("not a buffer snapshot (wrong magic bytes)"));
    }
    let mut header = Reader::new(&bytes[8..HEADER_LEN]);
    let format_version = header.u32()?;
    if format_version != FORMAT_VERSION {
        return Err(BufferError::CorruptState(format!(
            "snapshot format {format_version} is not supported (this build reads format {FORMAT_VERSION})"
        )));
    }
    let payload_len = header.u64()?;
    let expected_len = u64::try_from(bytes.len() - HEADER_LEN - CRC_LEN).unwrap_or(u64::MAX);
    if payload_len != expected_len {
        return Err(BufferError::CorruptState(format!(
            "the payload should be {payload_len} bytes but {expected_len} are present (truncated or padded)"
        )));
    }
    let (body, checksum_bytes) = bytes.split_at(bytes.len() - CRC_LEN);
    let mut checksum = Reader::new(checksum_bytes);
    if checksum.u32()? != crc32(body) {
        return Err(corrupt("checksum mismatch"));
    }
    let mut reader = Reader::new(&body[HEADER_LEN..]);
    let state = decode_payload(&mut reader)?;
    if !reader.is_empty() {
        return Err(corrupt("trailing bytes after the state"));
    }
    state.validate()?;
    Ok(state)
}

fn encode_payload(state: &BufferState, out: &mut Vec<u8>) {
    let limits = &state.limits;
    put_u32(out, limits.max_inflight_groups);
    put_u32(out, limits.max_buffered_groups);
    put_u64(out, limits.max_dropped_groups_per_step);
    put_option_u64(out, limits.max_actor_accept_staleness);
    put_u64(out, state.next_group_id);
    put_option_u64(out, state.last_actor_version.map(|v| v as u64));
    put_option_u64(out, state.max_finish_version.map(|v| v as u64));
    put_u64(out, state.inflight.len() as u64);
    for &(group_id, prompt_index) in &state.inflight {
        put_u64(out, group_id);
        put_u64(out, prompt_index);
    }
    put_u64(out, state.finished.len() as u64);
    for group in &state.finished {
        put_u64(out, group.group_id);
        put_u64(out, group.prompt_index);
        put_u64(out, group.versions.earliest_version as u64);
        put_u64(out, group.versions.latest_version as u64);
        put_u64(out, group.versions.finish_version as u64);
    }
    let step = &state.step;
    put_u64(out, step.num_groups);
    put_u64(out, step.staleness_sum);
    put_u64(out, step.staleness_max);
    put_u64(out, step.staleness_counts.len() as u64);
    for (&staleness, &count) in &step.staleness_counts {
        put_u64(out, staleness);
        put_u64(out, count);
    }
    put_u64(out, step.version_span_sum);
    put_u64(out, step.queue_steps_sum);
    put_u64(out, step.dropped_groups);
    put_u64(out, step.admission_wait_inflight_limit_ns);
    put_u64(out, step.admission_wait_buffer_full_ns);
    put_u64(out, step.wall_ns);
}

fn decode_payload(reader: &mut Reader<'_>) -> Result<BufferState> {
    let limits = Limits {
        max_inflight_groups: reader.u32()?,
        max_buffered_groups: reader.u32()?,
        max_dropped_groups_per_step: reader.u64()?,
        max_actor_accept_staleness: reader.option_u64()?,
    };
    let next_group_id = reader.u64()?;
    let last_actor_version = reader.option_u64()?.map(|v| v as i64);
    let max_finish_version = reader.option_u64()?.map(|v| v as i64);
    let num_inflight = reader.length(16)?;
    let mut inflight = Vec::with_capacity(num_inflight);
    for _ in 0..num_inflight {
        inflight.push((reader.u64()?, reader.u64()?));
    }
    let num_finished = reader.length(40)?;
    let mut finished = Vec::with_capacity(num_finished);
    for _ in 0..num_finished {
        finished.push(FinishedGroup {
            group_id: reader.u64()?,
            prompt_index: reader.u64()?,
            versions: GroupVersions {
                earliest_version: reader.u64()? as i64,
                latest_version: reader.u64()? as i64,
                finish_version: reader.u64()? as i64,
            },
        });
    }
    let num_groups = reader.u64()?;
    let staleness_sum = reader.u64()?;
    let staleness_max = reader.u64()?;
    let num_counts = reader.length(16)?;
    let mut staleness_counts = BTreeMap::new();
    for _ in 0..num_counts {
        let staleness = reader.u64()?;
        if staleness_counts.insert(staleness, reader.u64()?).is_some() {
            return Err(BufferError::CorruptState(format!(
                "staleness {staleness} appears twice in the histogram"
            )));
        }
    }
    let step = StepStats {
        num_groups,
        staleness_sum,
        staleness_max,
        staleness_counts,
        version_span_sum: reader.u64()?,
        queue_steps_sum: reader.u64()?,
        dropped_groups: reader.u64()?,
        admission_wait_inflight_limit_ns: reader.u64()?,
        admission_wait_buffer_full_ns: reader.u64()?,
        wall_ns: reader.u64()?,
    };
    Ok(BufferState {
        limits,
        next_group_id,
        last_actor_version,
        max_finish_version,
        inflight,
        finished,
        step,
    })
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_option_u64(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        Some(value) => {
            out.push(1);
            put_u64(out, value);
        }
        None => out.push(0),
    }
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        let Some((head, rest)) = self.bytes.split_first_chunk::<N>() else {
            return Err(BufferError::CorruptState("the state is truncated".into()));
        };
        self.bytes = rest;
        Ok(*head)
    }

    fn u32(&mut self) -> Result<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn option_u64(&mut self) -> Result<Option<u64>> {
        match self.take::<1>()? {
            [0] => Ok(None),
            [1] => self.u64().map(Some),
            [tag] => Err(BufferError::CorruptState(format!(
                "invalid option tag {tag}"
            ))),
        }
    }

    /// A count of entries of `entry_len` bytes each, checked against the bytes left so a corrupt
    /// count cannot trigger a huge allocation.
    fn length(&mut self, entry_len: usize) -> Result<usize> {
        let count = self.u64()?;
        match usize::try_from(count) {
            Ok(count) if count <= self.bytes.len() / entry_len => Ok(count),
            _ => Err(BufferError::CorruptState(format!(
                "a count of {count} entries exceeds the bytes left"
            ))),
        }
    }
}

/// CRC-32 with the IEEE polynomial (as zlib and PNG use), table-driven.
fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut index = 0;
        while index < 256 {
            let mut crc = index as u32;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            table[index] = crc;
            index += 1;
        }
        table
    };
    let mut crc = u32::MAX;
    for &byte in bytes {
        crc = TABLE[((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }
}
