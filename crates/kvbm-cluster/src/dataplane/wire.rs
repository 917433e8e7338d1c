//! The data plane's wire format: request and response heads, and the per-block frame header
//! (`kvbm_physical`'s [`BlockHeader`], bound to the serving instance). See the
//! [module docs](super) for the layout.

use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_offload::{BlockFailure, BlockFailureKind};
use kvbm_physical::checksum::{BlockHeader, HEADER_LEN, checksum_slices};
use kvbm_physical::identity::BlockIdentity;
use kvbm_physical::{PhysicalError, PhysicalLayout, StorageKind};

use kvbm_engine::InstanceId;

pub(crate) const REQUEST_MAGIC: u64 = u64::from_le_bytes(*b"KVBMPUL1");
pub(crate) const RESPONSE_MAGIC: u64 = u64::from_le_bytes(*b"KVBMRSP1");
/// The unauthenticated protocol (security off).
pub(crate) const VERSION: u32 = 1;
/// The authenticated protocol (security on): a handshake in which the client proves its key
/// before the server does any work of its own, then tagged heads and frames. Version 2 (the
/// server signed before the client proved anything) is refused as an unknown version.
pub(crate) const VERSION_AUTH: u32 = 3;
/// Bytes of one tag ([`crate::security::SessionKeys::tag_send`]).
pub(crate) const TAG_LEN: usize = 16;
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
    /// The server authenticates its clients (security on) and this one did not offer the
    /// authenticated protocol (security off), or its handshake was refused.
    AuthRequired = 4,
    /// The client offered the authenticated protocol (security on) to a server that does not
    /// speak it (security off).
    AuthUnavailable = 5,
    /// The client proved it is a member, but the server already serves as many connections
    /// as it allows (`transport.max_connections`), or as many of this member's
    /// (`transport.max_connections_per_peer`). Nothing was read; try again later.
    Busy = 6,
}

impl Status {
    pub(crate) fn describe(code: u32) -> &'static str {
        match code {
            0 => "ok",
            1 => "bad request (magic or version)",
            2 => "too many blocks in one request",
            3 => "block geometry differs from the served layout",
            4 => {
                "the server requires an authenticated member of its namespace (security on): \
                  this client is not one, or its security is off"
            }
            5 => {
                "the client's security is on but the server's data plane is not authenticated \
                  (security off)"
            }
            6 => {
                "the server serves as many connections as it allows, in all or from this member \
                  (transport.max_connections, transport.max_connections_per_peer)"
            }
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

#[cfg(test)]
pub(crate) fn encode_request(head: RequestHead, hashes: &[SequenceHash]) -> Vec<u8> {
    encode_request_version(head, hashes, VERSION)
}

/// The request head of `version` followed by the hashes.
pub(crate) fn encode_request_version(
    head: RequestHead,
    hashes: &[SequenceHash],
    version: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQUEST_HEAD_LEN + hashes.len() * HASH_LEN);
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&head.count.to_le_bytes());
    out.extend_from_slice(&head.geometry.to_le_bytes());
    out.extend_from_slice(&head.block_bytes.to_le_bytes());
    for h in hashes {
        out.extend_from_slice(&h.as_u128().to_le_bytes());
    }
    out
}

#[cfg(test)]
/// Decodes a version-1 request head; `Err` names the status to answer with.
pub(crate) fn decode_request(b: &[u8; REQUEST_HEAD_LEN]) -> Result<RequestHead, Status> {
    decode_request_version(b, VERSION)
}

/// Decodes a request head of `version`; `Err` names the status to answer with (a version-1
/// server that receives an authenticated client's hello answers [`Status::AuthUnavailable`]).
pub(crate) fn decode_request_version(
    b: &[u8; REQUEST_HEAD_LEN],
    version: u32,
) -> Result<RequestHead, Status> {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    if u64_at(0) == CLIENT_HELLO_MAGIC {
        return Err(Status::AuthUnavailable);
    }
    if u64_at(0) != REQUEST_MAGIC || u32_at(8) != version {
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
    encode_response_version(status, count, VERSION)
}

/// A response head of `version`.
pub(crate) fn encode_response_version(
    status: Status,
    count: u32,
    version: u32,
) -> [u8; RESPONSE_HEAD_LEN] {
    let mut out = [0u8; RESPONSE_HEAD_LEN];
    out[0..8].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
    out[8..12].copy_from_slice(&version.to_le_bytes());
    out[12..16].copy_from_slice(&(status as u32).to_le_bytes());
    out[16..20].copy_from_slice(&count.to_le_bytes());
    out
}

/// Decodes a version-1 response head into `(status, count)`, or says what is wrong with it.
pub(crate) fn decode_response(b: &[u8; RESPONSE_HEAD_LEN]) -> Result<(u32, u32), BlockFailure> {
    decode_response_version(b, VERSION)
}

/// Decodes a response head of `version` into `(status, count)`. A refusal answered in
/// version 1 ([`Status::AuthRequired`], [`Status::AuthUnavailable`]: the two ends disagree on
/// the protocol) is decoded whatever `version` is, so the mismatch is named.
pub(crate) fn decode_response_version(
    b: &[u8; RESPONSE_HEAD_LEN],
    expected: u32,
) -> Result<(u32, u32), BlockFailure> {
    let magic = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    let bad = |m: String| BlockFailure::new(BlockFailureKind::Transfer, m);
    if magic != RESPONSE_MAGIC {
        return Err(bad(format!("bad response magic {magic:#018x}")));
    }
    let status = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
    let mismatch =
        status == Status::AuthRequired as u32 || status == Status::AuthUnavailable as u32;
    if version != expected && !(version == VERSION && mismatch) {
        return Err(bad(format!("unknown response version {version}")));
    }
    Ok((
        u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
    ))
}

#[cfg(test)]
/// The frame header of a block served by `instance` whose bytes are `payload`.
pub(crate) fn frame_header(
    hash: SequenceHash,
    instance: InstanceId,
    geometry: u64,
    payload: &[u8],
) -> [u8; FRAME_HEADER_LEN] {
    let checksum = payload_checksum(&[payload]);
    let regions = [(payload.as_ptr() as usize, payload.len())];
    frame_header_with(hash, None, instance, geometry, &regions, checksum)
}

/// The payload checksum of a block given as its bytes in order (what a frame header carries).
pub(crate) fn payload_checksum(slices: &[&[u8]]) -> u128 {
    checksum_slices(slices.iter().copied())
}

/// The payload's BLAKE3 digest, over its bytes in order: what a payload tag covers (the
/// session's keyed tag over this digest, so a server serving one block to many peers hashes
/// its bytes once per registration, and a changed payload needs a BLAKE3 second preimage).
pub(crate) fn payload_digest<'a>(slices: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("kvbm-dataplane-v3 payload");
    for s in slices {
        h.update(s);
    }
    *h.finalize().as_bytes()
}

/// The frame header of a block whose payload (`regions`, only their lengths are read) has
/// `checksum`, bound to the serving `instance` and its `geometry`.
pub(crate) fn frame_header_with(
    hash: SequenceHash,
    digest: Option<BlockDigest>,
    instance: InstanceId,
    geometry: u64,
    regions: &[(usize, usize)],
    checksum: u128,
) -> [u8; FRAME_HEADER_LEN] {
    let len: usize = regions.iter().map(|r| r.1).sum();
    BlockHeader {
        len: len as u64,
        slot: geometry,
        checksum,
        identity: kvbm_offload::identity_of(hash, digest),
        binding: binding(instance),
    }
    .to_bytes()
}

/// What a frame header says about the block the client expects.
pub(crate) enum Frame {
    /// The server does not hold the block (all-zero header); no payload follows.
    Absent,
    /// A payload of the expected length follows; verify it against this header. The digest
    /// the server recorded for the block, if any (register the pulled block with it).
    Payload(BlockHeader, Option<BlockDigest>),
}

/// The digest a frame's identity names for `hash`: `Ok(None)` for the hash's own identity
/// (a block without a digest), `Ok(Some)` for a 256-bit digest that `hash` was derived from
/// (its first 8 bytes are the hash's chain value, [`kvbm_logical`]'s BLAKE3 scheme), `Err` for
/// anything else.
pub(crate) fn digest_of(
    identity: &BlockIdentity,
    hash: SequenceHash,
) -> Option<Option<BlockDigest>> {
    if *identity == kvbm_offload::block_identity(hash) {
        return Some(None);
    }
    let d = BlockDigest(*identity.as_bytes());
    let current = u64::from_be_bytes(d.0[..8].try_into().expect("8 bytes"));
    (current == hash.current()).then_some(Some(d))
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
    // The identity is the block's digest when the server recorded one: it must be one the
    // requested hash was derived from; anything else is checked (and refused) as the hash's.
    let digest = digest_of(&header.identity, hash).flatten();
    header.expect_bound(
        block_bytes,
        geometry,
        ("serving instance", binding(instance)),
        &kvbm_offload::identity_of(hash, digest),
        &location,
    )?;
    Ok(Frame::Payload(header, digest))
}

/// Checks `layout` can be served or pulled into: host memory.
pub(crate) fn check_host(layout: &PhysicalLayout) -> kvbm_engine::Result<()> {
    if layout.storage_kind() != StorageKind::Host {
        return Err(kvbm_engine::EngineError::config(
            "dataplane.layout",
            format!(
                "the data plane moves host (G2) memory, not {:?}",
                layout.storage_kind()
            ),
        ));
    }
    Ok(())
}

// ---- The authenticated protocol's handshake (version 3) ----

/// An authenticated client's first bytes: its hello.
pub(crate) const CLIENT_HELLO_MAGIC: u64 = u64::from_le_bytes(*b"KVBMHLC3");
/// The server's answer to a client hello: a fresh challenge the client must sign before the
/// server does any work of its own.
pub(crate) const CHALLENGE_MAGIC: u64 = u64::from_le_bytes(*b"KVBMCHL3");
/// A challenge: its magic and 32 random bytes.
pub(crate) const CHALLENGE_LEN: usize = 40;
/// The server's hello.
pub(crate) const SERVER_HELLO_MAGIC: u64 = u64::from_le_bytes(*b"KVBMHLS3");
/// Hello head: magic, version, flags (u16), certificate length (u16).
pub(crate) const HELLO_HEAD_LEN: usize = 16;
/// Longest certificate a hello may carry (a certificate with the longest namespace is 190).
pub(crate) const MAX_CERT_LEN: usize = 256;
/// An Ed25519 signature.
pub(crate) const SIG_LEN: usize = 64;
/// Hello flag: the sender wants every payload tagged too (`security.dataplane_payload_mac`).
pub(crate) const FLAG_PAYLOAD_MAC: u16 = 1;
/// Every flag this version knows.
const KNOWN_FLAGS: u16 = FLAG_PAYLOAD_MAC;

/// One side's hello: its certificate, its ephemeral X25519 public key, a fresh nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub flags: u16,
    pub cert: Vec<u8>,
    pub ephemeral: [u8; 32],
    pub nonce: [u8; 32],
}

/// Why a hello does not decode.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum HelloError {
    /// Not the expected magic.
    Magic(u64),
    /// Not version 3.
    Version(u32),
    /// Flags this version does not know.
    Flags(u16),
    /// A certificate length over [`MAX_CERT_LEN`] (or zero).
    CertLen(usize),
    /// A body of the wrong length.
    BodyLen(usize),
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::Magic(m) => write!(f, "bad hello magic {m:#018x}"),
            HelloError::Version(v) => write!(f, "unknown hello version {v}"),
            HelloError::Flags(x) => write!(f, "unknown hello flags {x:#06x}"),
            HelloError::CertLen(n) => write!(f, "hello certificate of {n} bytes"),
            HelloError::BodyLen(n) => write!(f, "hello body of {n} bytes"),
        }
    }
}

impl Hello {
    /// The hello's bytes behind `magic`: head, certificate, ephemeral key, nonce.
    pub(crate) fn encode(&self, magic: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_HEAD_LEN + self.cert.len() + 64);
        out.extend_from_slice(&magic.to_le_bytes());
        out.extend_from_slice(&VERSION_AUTH.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&(self.cert.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.cert);
        out.extend_from_slice(&self.ephemeral);
        out.extend_from_slice(&self.nonce);
        out
    }

    /// Decodes a hello head: `(flags, length of the body that follows)`. The body's length is
    /// bounded ([`MAX_CERT_LEN`] + 64) before anything is read or allocated for it.
    pub(crate) fn decode_head(
        b: &[u8; HELLO_HEAD_LEN],
        magic: u64,
    ) -> Result<(u16, usize), HelloError> {
        let m = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        if m != magic {
            return Err(HelloError::Magic(m));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if version != VERSION_AUTH {
            return Err(HelloError::Version(version));
        }
        let flags = u16::from_le_bytes(b[12..14].try_into().expect("2 bytes"));
        if flags & !KNOWN_FLAGS != 0 {
            return Err(HelloError::Flags(flags));
        }
        let cert_len = u16::from_le_bytes(b[14..16].try_into().expect("2 bytes")) as usize;
        if cert_len == 0 || cert_len > MAX_CERT_LEN {
            return Err(HelloError::CertLen(cert_len));
        }
        Ok((flags, cert_len + 64))
    }

    /// The hello from its head's flags and its body (exactly the length
    /// [`decode_head`](Self::decode_head) gave).
    pub(crate) fn decode_body(flags: u16, body: &[u8]) -> Result<Self, HelloError> {
        if body.len() < 64 + 1 || body.len() > MAX_CERT_LEN + 64 {
            return Err(HelloError::BodyLen(body.len()));
        }
        let (cert, rest) = body.split_at(body.len() - 64);
        Ok(Self {
            flags,
            cert: cert.to_vec(),
            ephemeral: rest[..32].try_into().expect("32 bytes"),
            nonce: rest[32..].try_into().expect("32 bytes"),
        })
    }
}

/// A challenge's bytes.
pub(crate) fn encode_challenge(nonce: &[u8; 32]) -> [u8; CHALLENGE_LEN] {
    let mut out = [0u8; CHALLENGE_LEN];
    out[..8].copy_from_slice(&CHALLENGE_MAGIC.to_le_bytes());
    out[8..].copy_from_slice(nonce);
    out
}

/// What the client signs to prove its key: its label, its hello as sent (its certificate and
/// ephemeral key) and the server's challenge (fresh, so a proof seen once is worth nothing on
/// another connection).
pub(crate) fn client_proof(client_hello: &[u8], challenge: &[u8; CHALLENGE_LEN]) -> Vec<u8> {
    let mut m = b"kvbm-dataplane-v3 client proof".to_vec();
    m.extend_from_slice(&(client_hello.len() as u32).to_le_bytes());
    m.extend_from_slice(client_hello);
    m.extend_from_slice(challenge);
    m
}

/// The transcript the server signs and both sides derive their session keys from: a domain
/// tag, the client's hello, the challenge, the client's proof and the server's hello, as sent.
pub(crate) fn transcript(
    client_hello: &[u8],
    challenge: &[u8; CHALLENGE_LEN],
    proof: &[u8; SIG_LEN],
    server_hello: &[u8],
) -> Vec<u8> {
    let mut t =
        Vec::with_capacity(32 + client_hello.len() + CHALLENGE_LEN + SIG_LEN + server_hello.len());
    t.extend_from_slice(b"kvbm-dataplane-v3-handshake");
    t.extend_from_slice(&(client_hello.len() as u32).to_le_bytes());
    t.extend_from_slice(client_hello);
    t.extend_from_slice(challenge);
    t.extend_from_slice(proof);
    t.extend_from_slice(&(server_hello.len() as u32).to_le_bytes());
    t.extend_from_slice(server_hello);
    t
}

/// What the server signs: its label and the transcript.
pub(crate) fn server_signed(transcript: &[u8]) -> Vec<u8> {
    let mut m = b"kvbm-dataplane-v3 server".to_vec();
    m.extend_from_slice(transcript);
    m
}
