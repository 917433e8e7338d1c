//! The data plane's wire format: request and response heads, and the per-block frame header
//! (`kvbm_physical`'s [`BlockHeader`], bound to the serving instance). See the
//! [module docs](super) for the layout.

use kvbm_logical::SequenceHash;
use kvbm_offload::{BlockFailure, BlockFailureKind};
use kvbm_physical::checksum::{BlockHeader, HEADER_LEN, checksum_slices};
use kvbm_physical::{PhysicalError, PhysicalLayout, StorageKind};

use crate::address::InstanceId;

pub(crate) const REQUEST_MAGIC: u64 = u64::from_le_bytes(*b"KVBMPUL1");
pub(crate) const RESPONSE_MAGIC: u64 = u64::from_le_bytes(*b"KVBMRSP1");
pub(crate) const VERSION: u32 = 1;
/// Request head: magic, version, count, geometry digest, block bytes.
pub(crate) const REQUEST_HEAD_LEN: usize = 32;
/// Response head: magic, version, status, count, reserved.
pub(crate) const RESPONSE_HEAD_LEN: usize = 24;
/// Bytes per requested hash.
pub(crate) const HASH_LEN: usize = 16;
/// Frame header length (the G3/G4 block header).
pub(crate) const FRAME_HEADER_LEN: usize = HEADER_LEN;

/// Response status codes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Status {
    /// Frames follow.
    Ok = 0,
    /// Magic or version wrong.
    BadRequest = 1,
    /// More blocks than the server accepts.
    TooMany = 2,
    /// The client's geometry or block size differs from the served layout's.
    Geometry = 3,
}

impl Status {
    pub(crate) fn describe(code: u32) -> &'static str {
        match code {
            0 => "ok",
            1 => "bad request (magic or version)",
            2 => "too many blocks in one request",
            3 => "block geometry differs from the served layout",
            _ => "unknown status",
        }
    }
}

/// The binding a frame from `instance` carries: xxh3-128 over a tagged encoding of the
/// instance id. A frame relayed from another instance, or a server answering for an instance
/// it is not, is refused as an identity mismatch.
pub fn binding(instance: InstanceId) -> u128 {
    checksum_slices([&b"kvbm-dataplane-v1"[..], &instance.0.to_le_bytes()])
}

/// What a request head says.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub count: u32,
    pub geometry: u64,
    pub block_bytes: u64,
}

pub(crate) fn encode_request(head: RequestHead, hashes: &[SequenceHash]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQUEST_HEAD_LEN + hashes.len() * HASH_LEN);
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&head.count.to_le_bytes());
    out.extend_from_slice(&head.geometry.to_le_bytes());
    out.extend_from_slice(&head.block_bytes.to_le_bytes());
    for h in hashes {
        out.extend_from_slice(&h.as_u128().to_le_bytes());
    }
    out
}

/// Decodes a request head; `Err` names the status to answer with.
pub(crate) fn decode_request(b: &[u8; REQUEST_HEAD_LEN]) -> Result<RequestHead, Status> {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    if u64_at(0) != REQUEST_MAGIC || u32_at(8) != VERSION {
        return Err(Status::BadRequest);
    }
    Ok(RequestHead {
        count: u32_at(12),
        geometry: u64_at(16),
        block_bytes: u64_at(24),
    })
}

pub(crate) fn decode_hashes(b: &[u8]) -> Vec<SequenceHash> {
    b.chunks_exact(HASH_LEN)
        .map(|c| SequenceHash::from_u128(u128::from_le_bytes(c.try_into().expect("16 bytes"))))
        .collect()
}

pub(crate) fn encode_response(status: Status, count: u32) -> [u8; RESPONSE_HEAD_LEN] {
    let mut out = [0u8; RESPONSE_HEAD_LEN];
    out[0..8].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(status as u32).to_le_bytes());
    out[16..20].copy_from_slice(&count.to_le_bytes());
    out
}

/// Decodes a response head into `(status, count)`, or says what is wrong with it.
pub(crate) fn decode_response(b: &[u8; RESPONSE_HEAD_LEN]) -> Result<(u32, u32), BlockFailure> {
    let magic = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    let bad = |m: String| BlockFailure::new(BlockFailureKind::Transfer, m);
    if magic != RESPONSE_MAGIC {
        return Err(bad(format!("bad response magic {magic:#018x}")));
    }
    if version != VERSION {
        return Err(bad(format!("unknown response version {version}")));
    }
    Ok((
        u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
    ))
}

/// The frame header of a block served by `instance`: checksum over its `regions`.
///
/// # Safety
/// Every region must be readable host memory for the duration of the call.
pub(crate) unsafe fn frame_header(
    hash: SequenceHash,
    instance: InstanceId,
    geometry: u64,
    regions: &[(usize, usize)],
) -> [u8; FRAME_HEADER_LEN] {
    let len: usize = regions.iter().map(|r| r.1).sum();
    // SAFETY: the caller guarantees the regions are readable.
    let checksum = checksum_slices(
        regions
            .iter()
            .map(|&(p, l)| unsafe { std::slice::from_raw_parts(p as *const u8, l) }),
    );
    BlockHeader {
        len: len as u64,
        slot: geometry,
        checksum,
        identity: kvbm_offload::block_identity(hash),
        binding: binding(instance),
    }
    .to_bytes()
}

/// What a frame header says about the block the client expects.
pub(crate) enum Frame {
    /// The server does not hold the block (all-zero header); no payload follows.
    Absent,
    /// A payload of the expected length follows; verify it against this header.
    Payload(BlockHeader),
}

/// Checks a frame header against what the client asked for, before any payload byte is read.
pub(crate) fn check_frame(
    bytes: &[u8; FRAME_HEADER_LEN],
    hash: SequenceHash,
    instance: InstanceId,
    geometry: u64,
    block_bytes: usize,
) -> Result<Frame, PhysicalError> {
    let location = || format!("{instance} block {:032x}", hash.as_u128());
    let header = match BlockHeader::decode(bytes, &location) {
        Ok(h) => h,
        Err(PhysicalError::NotFound { .. }) => return Ok(Frame::Absent),
        Err(e) => return Err(e),
    };
    header.expect_bound(
        block_bytes,
        geometry,
        ("serving instance", binding(instance)),
        &kvbm_offload::block_identity(hash),
        &location,
    )?;
    Ok(Frame::Payload(header))
}

/// Checks `layout` can be served or pulled into: host memory.
pub(crate) fn check_host(layout: &PhysicalLayout) -> crate::Result<()> {
    if layout.storage_kind() != StorageKind::Host {
        return Err(crate::EngineError::config(
            "dataplane.layout",
            format!(
                "the data plane moves host (G2) memory, not {:?}",
                layout.storage_kind()
            ),
        ));
    }
    Ok(())
}
