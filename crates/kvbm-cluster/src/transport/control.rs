//! Leader↔worker control messages: versioned requests and replies, their typed errors, the
//! [`WorkerControl`] seam (in-process or NATS), and [`ControlledWorkers`], which runs an
//! operation on every rank through it.
//!
//! # Protocol
//!
//! Every message is an [`Envelope`] `{ version, body }` encoded with serde (JSON on NATS).
//! Nothing in a message is block data: only block ids, hashes, tiers, per-block outcomes and
//! 64-bit digests.
//!
//! Versions:
//!
//! | version | what changed |
//! |---|---|
//! | 1 | per-block failures are bare text |
//! | 2 | each failure carries its kind ([`WireFailure`]), so a leader tells a corrupt copy from an I/O error |
//! | 3 | a request may name its rank and that rank's incarnation ([`Envelope::to`], a [`RankTarget`]): a worker refuses one meant for another rank or an earlier incarnation of itself (it restarted), so work sent before a restart never runs on the new, empty rank |
//! | 4 ([`PROTOCOL_VERSION`]) | the rank plane's requests: [`ControlRequest::Lend`], [`ControlRequest::EndLease`], [`ControlRequest::PullSlices`] (a version-3 worker refuses them as undecodable) |
//!
//! Requests are otherwise the same in all four. A worker serves a request of any version from
//! [`OLDEST_PROTOCOL_VERSION`] to [`PROTOCOL_VERSION`] and answers in the request's version
//! ([`ControlResponse::for_version`]: a version-1 leader gets its failures as text); it
//! answers a request of any other version with [`ControlResponse::Refused`], saying which
//! versions it speaks. A leader reads replies of every version it speaks (a version-1
//! worker's failures decode as kind `transfer`, their text kept) and fails the call with
//! [`ControlError::Version`] for any other.
//!
//! # Failure
//!
//! A call either returns the worker's reply or a [`ControlError`] naming the worker: timed out
//! (each request has its own deadline), nobody serving the subject, undecodable, wrong
//! version, refused, or a transport failure. [`ControlledWorkers`] waits for **every** rank
//! to settle (reply or error) before it reports, so when it returns no rank can still be
//! writing a destination slot on behalf of this request, except a rank that timed out: a
//! timed-out worker is treated as gone (the leader releases the slots; a worker that is
//! merely slow may still write them, which is why the timeout must exceed the longest
//! transfer, see `transport.request_timeout_ms`).
//!
//! # Safety at the seam
//!
//! `Transfer`, `Fill` and `Digest` read or write a worker's slots, which its leader's block
//! managers own; nothing in a request can prove them free. So the one function that executes
//! requests, [`serve`], is `unsafe`, and so are the ways in process to reach it:
//! [`WorkerControl::call_unchecked`] and [`ControlledWorkers::transfer`] (whose caller, the
//! leader's mover through [`ParallelWorkers::execute`], reserved the slots). The safe
//! [`WorkerControl::call`] of an [`InProcessControl`] answers only `Describe` and refuses the
//! rest, naming the unsafe way. A remote worker's server calls `serve` at the trust boundary:
//! the request came sealed from its own leader (see `transport::nats`).
//!
//! # Locks
//!
//! None: the types here are immutable after construction.

use std::sync::Arc;

use futures::future::{BoxFuture, join_all};
use kvbm_logical::{BlockDigest, BlockId, SequenceHash, TierId};
use kvbm_physical::PhysicalLayout;
use serde::{Deserialize, Serialize};

use kvbm_offload::{BlockFailure, BlockFailureKind};

use super::{InstanceId, PeerInfo, WorkerAddress};
use crate::dataplane::lease::LentBlock;
use crate::dataplane::rank::RankPlane;
pub use kvbm_engine::error::ControlError;
use kvbm_engine::mover::BlockOutcome;
use kvbm_engine::worker::{ParallelWorkers, PhysicalWorker, Reserved, TransferRequest};

/// Version of the control protocol this build writes (see the [module docs](self)).
pub const PROTOCOL_VERSION: u32 = 4;

/// The oldest version this build still reads and answers.
pub const OLDEST_PROTOCOL_VERSION: u32 = 1;

/// Whether this build reads and answers messages of `version`.
pub fn speaks(version: u32) -> bool {
    (OLDEST_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version)
}

/// A message with the protocol version it was written in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope<T> {
    /// The sender's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// Version 3, requests: the rank the request is for and the incarnation the leader knows
    /// (from its heartbeats, the `nats` feature's `transport::membership::Membership`). Absent:
    /// any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<RankTarget>,
    /// The message.
    pub body: T,
}

/// A rank and one incarnation of it (its worker process's epoch, new at each start).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankTarget {
    /// The rank.
    pub address: WorkerAddress,
    /// Its incarnation.
    pub epoch: u64,
}

impl<T> Envelope<T> {
    /// `body` in this build's version.
    pub fn new(body: T) -> Self {
        Self::in_version(PROTOCOL_VERSION, body)
    }

    /// `body` marked as written in `version` (the caller made it readable there, e.g. with
    /// [`ControlResponse::for_version`]).
    pub fn in_version(version: u32, body: T) -> Self {
        Self {
            version,
            to: None,
            body,
        }
    }

    /// `body` for incarnation `to` of a rank, in this build's version.
    pub fn addressed(body: T, to: RankTarget) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            to: Some(to),
            body,
        }
    }
}

/// One block's failure as it crosses the wire.
///
/// Version 2 sends `{"kind": "checksum_mismatch", "message": …}` (the kind is
/// [`BlockFailureKind::as_str`]); version 1 sent the message alone. Both decode.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WireFailure {
    /// Version 2: the kind's name and the message.
    Typed {
        /// [`BlockFailureKind::as_str`].
        kind: String,
        /// What happened.
        message: String,
    },
    /// Version 1: the message only.
    Text(String),
}

impl From<BlockFailure> for WireFailure {
    fn from(f: BlockFailure) -> Self {
        WireFailure::Typed {
            kind: f.kind.as_str().to_owned(),
            message: f.message,
        }
    }
}

impl WireFailure {
    /// The failure this message describes. Text from a version-1 peer, and a kind this build
    /// does not know (a newer peer's), read as [`BlockFailureKind::Transfer`] with the text
    /// kept: nothing is known about the copy, so it is not dropped.
    pub fn into_failure(self) -> BlockFailure {
        match self {
            WireFailure::Typed { kind, message } => match BlockFailureKind::from_name(&kind) {
                Some(k) => BlockFailure::new(k, message),
                None => BlockFailure::new(
                    BlockFailureKind::Transfer,
                    format!("{message} (failure kind `{kind}` unknown to this build)"),
                ),
            },
            WireFailure::Text(message) => BlockFailure::new(BlockFailureKind::Transfer, message),
        }
    }

    /// This failure as a version-1 peer reads it (its text).
    fn into_text(self) -> Self {
        match self {
            WireFailure::Typed { kind, message } => WireFailure::Text(format!("{kind}: {message}")),
            text => text,
        }
    }
}

/// What a leader asks a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Who are you: answered with [`ControlResponse::Described`].
    Describe,
    /// Run one transfer on this rank: answered with [`ControlResponse::Transferred`].
    Transfer(TransferRequest),
    /// 64-bit digests (xxh3) of blocks of a memory tier, for verification: answered with
    /// [`ControlResponse::Digests`]. The caller must not run transfers into these blocks
    /// meanwhile.
    Digest {
        /// A tier whose layout is host memory.
        tier: TierId,
        /// Blocks to digest.
        blocks: Vec<BlockId>,
    },
    /// Fill every block of a host-memory tier with [`fill_pattern`] of `seed` (tests and
    /// warm-up): answered with [`ControlResponse::Done`]. Nothing may be transferring meanwhile.
    Fill {
        /// A tier whose layout is host memory.
        tier: TierId,
        /// Pattern seed.
        seed: u8,
    },
    /// Version 4: serve `blocks` (G2 slots the leader holds) on the rank plane to workers of
    /// `lessee` for `ttl_ms`: answered with [`ControlResponse::Lent`] (see
    /// [`crate::dataplane::rank`]).
    Lend {
        /// The lease's id.
        lease: u128,
        /// The puller instance.
        lessee: InstanceId,
        /// How long it may be served.
        ttl_ms: u64,
        /// The lent slots.
        blocks: Vec<LentBlock>,
    },
    /// Version 4: stop serving `lease` (answered [`ControlResponse::Done`] once no read of it
    /// is in flight).
    EndLease {
        /// The lease's id.
        lease: u128,
    },
    /// Version 4: pull this rank's slice of `hashes` from the same rank of `holder`, serving
    /// its lease at `from`, into G2 slots `slots` (reserved by the leader), each frame's digest
    /// checked against `digests`: answered with [`ControlResponse::Transferred`].
    PullSlices {
        /// The holder rank's rank-plane address (`host:port`).
        from: String,
        /// The holder instance.
        holder: InstanceId,
        /// The blocks.
        hashes: Vec<SequenceHash>,
        /// Their identities, as the holder's leader lent them.
        digests: Vec<Option<BlockDigest>>,
        /// The destination slots, one per block.
        slots: Vec<BlockId>,
    },
}

impl ControlRequest {
    /// The request's name (for errors and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            ControlRequest::Describe => "Describe",
            ControlRequest::Transfer(_) => "Transfer",
            ControlRequest::Digest { .. } => "Digest",
            ControlRequest::Fill { .. } => "Fill",
            ControlRequest::Lend { .. } => "Lend",
            ControlRequest::EndLease { .. } => "EndLease",
            ControlRequest::PullSlices { .. } => "PullSlices",
        }
    }
}

/// What a worker answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlResponse {
    /// Its description.
    Described(PeerInfo),
    /// One outcome per block of the transfer, in request order.
    Transferred(Vec<Result<(), WireFailure>>),
    /// One digest per requested block.
    Digests(Vec<u64>),
    /// Version 4: the lease is served at this rank-plane address (`host:port`).
    Lent {
        /// Where pullers dial.
        data_plane: String,
    },
    /// Done.
    Done,
    /// The worker could not act on the request (wrong version, undecodable, a tier it lacks…).
    Refused(String),
}

impl ControlResponse {
    /// One outcome per block, as a worker sends them.
    pub fn transferred(outcomes: Vec<BlockOutcome>) -> Self {
        ControlResponse::Transferred(
            outcomes
                .into_iter()
                .map(|o| o.map_err(WireFailure::from))
                .collect(),
        )
    }

    /// This reply as a peer speaking `version` reads it: for version 1, failures become text.
    pub fn for_version(self, version: u32) -> Self {
        match self {
            ControlResponse::Transferred(v) if version < 2 => ControlResponse::Transferred(
                v.into_iter()
                    .map(|o| o.map_err(WireFailure::into_text))
                    .collect(),
            ),
            other => other,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ControlResponse::Described(_) => "Described",
            ControlResponse::Transferred(_) => "Transferred",
            ControlResponse::Digests(_) => "Digests",
            ControlResponse::Lent { .. } => "Lent",
            ControlResponse::Done => "Done",
            ControlResponse::Refused(_) => "Refused",
        }
    }
}

/// The seam between a leader and one worker.
pub trait WorkerControl: Send + Sync {
    /// The worker.
    fn address(&self) -> WorkerAddress;
    /// Sends `request` and waits for the reply (or the request's deadline). A worker in this
    /// process answers only requests that touch no slot ([`ControlRequest::Describe`]) here
    /// and refuses the others: they go through [`call_unchecked`](Self::call_unchecked).
    fn call(&self, request: ControlRequest)
    -> BoxFuture<'_, Result<ControlResponse, ControlError>>;

    /// [`call`](Self::call) for any request, slot-touching ones included. The default (a
    /// worker in another process, which checks the request came from its own leader) is
    /// `call`.
    ///
    /// # Safety
    /// For a worker in this process, the caller guarantees what [`serve`] requires: the slots
    /// a `Transfer` names are reserved for it until the call returns, and nothing else writes
    /// (for `Fill`, reads or writes) the layouts a `Fill` or `Digest` names meanwhile.
    unsafe fn call_unchecked(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        self.call(request)
    }
}

/// Fills every block of a host `layout` with a pattern of the block index and `seed` (byte
/// `k` of block `b`'s serialized bytes is `k*31 ^ b*131 ^ seed`, wrapping).
///
/// Returns `false`, writing nothing, when `layout` is not host memory (a device address is
/// not this process's to write).
///
/// # Safety
/// The caller guarantees nothing reads or writes the layout meanwhile ([`serve`] does this
/// for [`ControlRequest::Fill`], under its own contract).
pub unsafe fn fill_pattern(layout: &PhysicalLayout, seed: u8) -> bool {
    if layout.storage_kind() != kvbm_physical::StorageKind::Host {
        return false;
    }
    let c = *layout.layout().config();
    for b in 0..c.num_blocks {
        let mut k = 0usize;
        for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
            // SAFETY: host memory owned by `layout` (alive for this call); the caller
            // guarantees no transfer uses it meanwhile.
            let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            for x in s.iter_mut() {
                *x = (k as u8).wrapping_mul(31) ^ (b as u8).wrapping_mul(131) ^ seed;
                k += 1;
            }
        }
    }
    true
}

/// The xxh3-64 digest of block `b`'s serialized bytes in a host `layout` (`None` for a block
/// out of range, or a layout that is not host memory).
///
/// # Safety
/// The caller guarantees nothing writes block `b` meanwhile.
pub unsafe fn block_digest(layout: &PhysicalLayout, b: usize) -> Option<u64> {
    let c = *layout.layout().config();
    if b >= c.num_blocks || layout.storage_kind() != kvbm_physical::StorageKind::Host {
        return None;
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
        // SAFETY: host memory owned by `layout`; the caller of `Digest` guarantees no transfer
        // writes these blocks meanwhile.
        h.update(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    Some(h.digest())
}

fn host_layout(
    worker: &PhysicalWorker,
    tier: TierId,
) -> Result<Arc<PhysicalLayout>, ControlResponse> {
    let handle = worker.layout(tier).ok_or_else(|| {
        ControlResponse::Refused(format!("rank {}: no {tier} layout", worker.rank()))
    })?;
    let layout = worker
        .transfer_manager()
        .layout(handle)
        .map_err(|e| ControlResponse::Refused(format!("rank {}: {e}", worker.rank())))?;
    if layout.storage_kind() != kvbm_physical::StorageKind::Host {
        return Err(ControlResponse::Refused(format!(
            "rank {}: the {tier} layout is not host memory",
            worker.rank()
        )));
    }
    Ok(layout)
}

/// Answers `request` on `worker` (what a worker does for in-process and NATS calls alike),
/// the rank plane's requests on `plane` (refused without one).
/// Slot ids and layouts are checked (out of range or not host memory: refused), but nothing
/// here can prove a slot free (see the [module docs](self)).
///
/// # Safety
/// The slots a `Transfer` names are reserved for it by the worker's leader until this returns
/// (its movers' contract, [`ParallelWorkers::execute`]), and so are the destination slots of
/// a `PullSlices`; the slots a `Lend` names are held by the leader until every rank answered
/// the lease's `EndLease`; nothing else writes the layout a `Digest` reads, nor reads or
/// writes the one a `Fill` writes, meanwhile. A worker serving
/// the network upholds this by obeying only its own leader (the trust boundary).
pub async unsafe fn serve(
    worker: &PhysicalWorker,
    address: WorkerAddress,
    plane: Option<&RankPlane>,
    request: ControlRequest,
) -> ControlResponse {
    let no_plane = || {
        ControlResponse::Refused(format!(
            "rank {}: no rank plane (kvbm-engine-worker --data-plane)",
            worker.rank()
        ))
    };
    match request {
        ControlRequest::Describe => {
            let tiers: Vec<TierId> = TierId::ALL
                .iter()
                .copied()
                .filter(|t| worker.layout(*t).is_some())
                .collect();
            let geometry = tiers
                .first()
                .and_then(|t| worker.layout(*t))
                .and_then(|h| worker.transfer_manager().layout(h).ok())
                .map(|l| {
                    (
                        l.layout().config().num_blocks,
                        l.layout().config().block_bytes(),
                    )
                })
                .unwrap_or((0, 0));
            ControlResponse::Described(PeerInfo {
                worker: address,
                tiers,
                num_blocks: geometry.0,
                block_bytes: geometry.1,
                data_plane: plane.map(|p| p.advertised().to_owned()),
            })
        }
        ControlRequest::Transfer(t) => {
            // SAFETY: the slots are reserved for this request (this function's contract); slot
            // ids out of range are refused by the transfer manager.
            let out = unsafe { worker.execute(&t) }.await;
            ControlResponse::transferred(out)
        }
        ControlRequest::Digest { tier, blocks } => match host_layout(worker, tier) {
            Err(r) => r,
            Ok(layout) => {
                let mut out = Vec::with_capacity(blocks.len());
                for b in blocks {
                    // SAFETY: nothing writes the layout meanwhile (this function's contract).
                    match unsafe { block_digest(&layout, b) } {
                        Some(d) => out.push(d),
                        None => {
                            return ControlResponse::Refused(format!(
                                "rank {}: block {b} is out of range of the {tier} layout",
                                worker.rank()
                            ));
                        }
                    }
                }
                ControlResponse::Digests(out)
            }
        },
        ControlRequest::Fill { tier, seed } => match host_layout(worker, tier) {
            Err(r) => r,
            Ok(layout) => {
                // SAFETY: nothing else uses the layout meanwhile (this function's contract).
                if unsafe { fill_pattern(&layout, seed) } {
                    ControlResponse::Done
                } else {
                    ControlResponse::Refused(format!(
                        "rank {}: the {tier} layout is not host memory",
                        worker.rank()
                    ))
                }
            }
        },
        ControlRequest::Lend {
            lease,
            lessee,
            ttl_ms,
            blocks,
        } => match plane {
            None => no_plane(),
            Some(p) => match p.lend(
                lease,
                lessee,
                std::time::Duration::from_millis(ttl_ms),
                &blocks,
            ) {
                Ok(()) => ControlResponse::Lent {
                    data_plane: p.advertised().to_owned(),
                },
                Err(m) => ControlResponse::Refused(format!("rank {}: {m}", worker.rank())),
            },
        },
        ControlRequest::EndLease { lease } => match plane {
            None => no_plane(),
            Some(p) => {
                p.end(lease).await;
                ControlResponse::Done
            }
        },
        ControlRequest::PullSlices {
            from,
            holder,
            hashes,
            digests,
            slots,
        } => match (plane, from.parse::<std::net::SocketAddr>()) {
            (None, _) => no_plane(),
            (Some(_), Err(e)) => ControlResponse::Refused(format!(
                "rank {}: {from:?} is not a host:port address ({e})",
                worker.rank()
            )),
            (Some(p), Ok(addr)) => {
                // SAFETY: the slots are reserved for this request by the leader (this
                // function's contract, as for a transfer into them).
                let out = unsafe { p.pull(addr, holder, &hashes, &digests, &slots) }.await;
                ControlResponse::transferred(out)
            }
        },
    }
}

/// A worker in the leader's own process, called directly.
#[derive(Clone, Debug)]
pub struct InProcessControl {
    address: WorkerAddress,
    worker: Arc<PhysicalWorker>,
}

impl InProcessControl {
    /// `worker` as rank `worker.rank()` of `instance`.
    pub fn new(instance: super::InstanceId, worker: Arc<PhysicalWorker>) -> Self {
        Self {
            address: WorkerAddress::new(instance, worker.rank() as u32),
            worker,
        }
    }
}

impl WorkerControl for InProcessControl {
    fn address(&self) -> WorkerAddress {
        self.address
    }

    /// Answers `Describe`; refuses a request that reads or writes slots, which in process goes
    /// through the unsafe [`call_unchecked`](WorkerControl::call_unchecked).
    fn call(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        if !matches!(request, ControlRequest::Describe) {
            let message = format!(
                "{} reads or writes this process's slots: in process it goes through \
                 WorkerControl::call_unchecked or ControlledWorkers::transfer (unsafe: the caller \
                 reserves the slots)",
                request.kind()
            );
            let worker = self.address;
            return Box::pin(async move { Err(ControlError::Refused { worker, message }) });
        }
        // SAFETY: a `Describe` reads no slot.
        unsafe { self.call_unchecked(request) }
    }

    unsafe fn call_unchecked(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        Box::pin(async move {
            // SAFETY: forwarded from the caller (`call_unchecked`'s contract is `serve`'s).
            match unsafe { serve(&self.worker, self.address, None, request) }.await {
                ControlResponse::Refused(message) => Err(ControlError::Refused {
                    worker: self.address,
                    message,
                }),
                r => Ok(r),
            }
        })
    }
}

/// Every operation on every rank through [`WorkerControl`]: see the [module docs](self).
#[derive(Clone)]
pub struct ControlledWorkers {
    ranks: Vec<Arc<dyn WorkerControl>>,
}

impl std::fmt::Debug for ControlledWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.ranks.iter().map(|r| r.address()))
            .finish()
    }
}

impl ControlledWorkers {
    /// Over `ranks`, which must be ranks `0..n` of one instance, in order.
    ///
    /// # Errors
    /// [`EngineError::Config`](kvbm_engine::EngineError::Config) (key `workers`) otherwise.
    pub fn new(ranks: Vec<Arc<dyn WorkerControl>>) -> kvbm_engine::Result<Self> {
        let Some(first) = ranks.first() else {
            return Err(kvbm_engine::EngineError::config(
                "workers",
                "at least one rank",
            ));
        };
        let instance = first.address().instance;
        for (i, r) in ranks.iter().enumerate() {
            let a = r.address();
            if a.rank as usize != i || a.instance != instance {
                return Err(kvbm_engine::EngineError::config(
                    "workers",
                    format!("worker {i} is {a}; expected rank {i} of {instance}"),
                ));
            }
        }
        Ok(Self { ranks })
    }

    /// The ranks.
    pub fn ranks(&self) -> &[Arc<dyn WorkerControl>] {
        &self.ranks
    }

    /// Sends `request` to every rank; one result per rank, in rank order, once all settled.
    pub async fn call_all(
        &self,
        request: &ControlRequest,
    ) -> Vec<Result<ControlResponse, ControlError>> {
        join_all(self.ranks.iter().map(|r| r.call(request.clone()))).await
    }

    /// Every rank's description.
    ///
    /// # Errors
    /// The first rank's [`ControlError`], in rank order.
    pub async fn describe_all(&self) -> Result<Vec<PeerInfo>, ControlError> {
        let mut out = Vec::new();
        for (r, reply) in self
            .ranks
            .iter()
            .zip(self.call_all(&ControlRequest::Describe).await)
        {
            match reply? {
                ControlResponse::Described(p) => out.push(p),
                other => {
                    return Err(ControlError::Unexpected {
                        worker: r.address(),
                        expected: "Described",
                        got: other.kind(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Runs `request` on every rank and waits for all of them. Per block `Ok` only if every
    /// rank moved it.
    ///
    /// # Errors
    /// When a rank could not be driven at all (its call failed): the first such rank's
    /// [`ControlError`], after every rank settled; no block of the request counts as moved.
    ///
    pub async fn transfer(
        &self,
        reserved: &Reserved<'_>,
    ) -> Result<Vec<BlockOutcome>, ControlError> {
        let request = reserved.request();
        let n = request.blocks.len();
        let replies = join_all(self.ranks.iter().map(|r| {
            // SAFETY: `reserved` proves the slots reserved for this request on every rank (see
            // `Reserved`), held by the caller until every rank replied or timed out.
            unsafe { r.call_unchecked(ControlRequest::Transfer(request.clone())) }
        }))
        .await;
        let mut merged: Vec<BlockOutcome> = vec![Ok(()); n];
        let mut first_error = None;
        for (r, reply) in self.ranks.iter().zip(replies) {
            let outcome: Vec<BlockOutcome> = match reply {
                Ok(ControlResponse::Transferred(v)) if v.len() == n => v
                    .into_iter()
                    .map(|o| o.map_err(WireFailure::into_failure))
                    .collect(),
                Ok(ControlResponse::Transferred(v)) => {
                    let m = format!("{}: {} outcomes for {n} blocks", r.address(), v.len());
                    vec![Err(BlockFailure::new(BlockFailureKind::Transfer, m)); n]
                }
                Ok(other) => {
                    if first_error.is_none() {
                        first_error = Some(ControlError::Unexpected {
                            worker: r.address(),
                            expected: "Transferred",
                            got: other.kind(),
                        });
                    }
                    continue;
                }
                Err(e) => {
                    if first_error.is_none() {
                        first_error = Some(e);
                    }
                    continue;
                }
            };
            for (m, o) in merged.iter_mut().zip(outcome) {
                if m.is_ok() {
                    *m = o;
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(merged),
        }
    }
}

impl ParallelWorkers for ControlledWorkers {
    fn world_size(&self) -> usize {
        self.ranks.len()
    }

    fn execute<'a>(&'a self, reserved: Reserved<'a>) -> BoxFuture<'a, Vec<BlockOutcome>> {
        Box::pin(async move {
            match self.transfer(&reserved).await {
                Ok(v) => v,
                Err(e) => {
                    let f = BlockFailure::new(e.failure_kind(), e.to_string());
                    vec![Err(f); reserved.request().blocks.len()]
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
