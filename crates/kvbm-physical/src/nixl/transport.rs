//! [`NixlAgent`]: blocks of host layouts moved to and from another agent's layouts with NIXL's
//! UCX backend (one-sided writes and reads, no copy through a socket).
//!
//! # How a move is addressed
//!
//! Each side registers its layouts' memory with its own agent ([`NixlAgent::register`]) and
//! tells the other what it registered: the agent's metadata ([`NixlAgent::metadata`], loaded by
//! the peer with [`NixlAgent::load_remote`]) and, per layout, a [`RemoteLayout`] (its geometry
//! and allocation addresses). The initiator computes both sides' regions of every block pair
//! (the same region walk as every other copy, `layout::region_pairs`) and posts one transfer
//! request for them all; [`NixlTransfer::wait`] polls it to completion.
//!
//! # Checks before a byte moves
//!
//! A remote layout must have the local layout's block geometry and every block id must be in
//! range on its side; the local layout must be host memory this agent registered. A refused
//! move posts nothing. Who may read or write a registered layout is the data plane's decision
//! (its authentication runs before a peer is given a [`RemoteLayout`]): registration exposes
//! the memory to agents that hold its metadata, so a caller registers only what it serves.
//!
//! # Lifetimes
//!
//! The agent keeps every registered layout (an `Arc`) until it is dropped, and deregisters the
//! memory before releasing it; a transfer keeps its agent's state alive until it completed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, OptArgs, XferDescList, XferOp};

use crate::error::{PhysicalError, Result};
use crate::layout::{BlockLayout, LayoutConfig, LayoutKind, region_pairs};
use crate::physical::{Backing, PhysicalLayout};
use crate::transfer::BlockId;

fn nixl_err(op: &'static str, e: impl std::fmt::Debug) -> PhysicalError {
    PhysicalError::Io {
        op,
        path: None,
        source: Arc::new(std::io::Error::other(format!("NIXL: {e:?}"))),
    }
}

/// A span of host memory, as NIXL registers it.
#[derive(Debug)]
struct HostSpan {
    addr: usize,
    len: usize,
}

impl MemoryRegion for HostSpan {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for HostSpan {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// What a peer needs to address a layout it does not hold: its geometry and arrangement, and
/// the address of each of its allocations in its owner's address space. It crosses the wire,
/// so it is validated again where it is used ([`layout`](Self::layout)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteLayout {
    /// The per-block geometry.
    pub config: LayoutConfig,
    /// The arrangement.
    pub kind: LayoutKind,
    /// Each allocation's first byte, in the owner's address space.
    pub bases: Vec<u64>,
}

impl RemoteLayout {
    fn of(layout: &BlockLayout, bases: Vec<u64>) -> Self {
        RemoteLayout {
            config: *layout.config(),
            kind: layout.kind(),
            bases,
        }
    }

    /// The validated layout, checked against the allocations it names.
    ///
    /// # Errors
    /// The builder's refusal of the geometry; as many bases as the kind has allocations.
    pub fn layout(&self) -> Result<BlockLayout> {
        let l = BlockLayout::builder()
            .config(self.config)
            .kind(self.kind)
            .build()?;
        if self.bases.len() != l.num_allocations() {
            return Err(PhysicalError::InvalidArgument(format!(
                "NIXL: the remote layout names {} allocations, its kind has {}",
                self.bases.len(),
                l.num_allocations()
            )));
        }
        Ok(l)
    }
}

/// The regions `(addr, len)` of `block` of a remote `layout` at `bases`, every layer, in
/// serialized order.
fn remote_block_addrs(layout: &BlockLayout, bases: &[u64], block: BlockId) -> Vec<(usize, usize)> {
    let layers = 0..layout.config().num_layers;
    layout
        .block_regions(block, layers)
        .map(|r| (bases[r.allocation] as usize + r.offset, r.len))
        .collect()
}

/// A NIXL agent with the UCX backend (see the [module docs](self)).
pub struct NixlAgent {
    agent: Agent,
    backend_args: OptArgs,
    /// Registered layouts with their registrations (dropped first: deregistered before the
    /// memory can go).
    registered: Vec<(Vec<nixl_sys::RegistrationHandle>, Arc<PhysicalLayout>)>,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.agent.name())
            .field("layouts", &self.registered.len())
            .finish()
    }
}

impl NixlAgent {
    /// An agent named `name` with the UCX backend.
    ///
    /// # Errors
    /// [`PhysicalError::NotSupported`] when NIXL's library cannot be loaded
    /// ([`nixl_available`](super::nixl_available)); NIXL's error when the agent or the UCX
    /// backend cannot be created.
    pub fn new(name: &str) -> Result<Self> {
        if !super::nixl_available() {
            return Err(PhysicalError::NotSupported(format!(
                "NIXL: {} cannot be loaded (install NIXL, e.g. the nixl-cu12 wheel, and put its \
                 libraries on LD_LIBRARY_PATH)",
                super::NIXL_LIBRARY
            )));
        }
        let agent = Agent::new(name).map_err(|e| nixl_err("nixl agent", e))?;
        let (_, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| nixl_err("nixl UCX plugin (is NIXL_PLUGIN_DIR set?)", e))?;
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(|e| nixl_err("nixl UCX backend", e))?;
        let mut backend_args = OptArgs::new().map_err(|e| nixl_err("nixl options", e))?;
        backend_args
            .add_backend(&backend)
            .map_err(|e| nixl_err("nixl options", e))?;
        Ok(NixlAgent {
            agent,
            backend_args,
            registered: Vec::new(),
        })
    }

    /// This agent's name (what a peer's [`load_remote`](Self::load_remote) returns).
    pub fn name(&self) -> String {
        self.agent.name()
    }

    /// Registers `layout`'s memory with this agent (host memory only) and returns what a peer
    /// needs to address it. The layout is kept until the agent is dropped.
    ///
    /// # Errors
    /// [`PhysicalError::NotSupported`] for a layout that is not host memory; NIXL's error.
    pub fn register(&mut self, layout: Arc<PhysicalLayout>) -> Result<RemoteLayout> {
        let Backing::Host(allocs) = layout.backing() else {
            return Err(PhysicalError::NotSupported(format!(
                "NIXL moves host memory here; the layout is {:?}",
                layout.storage_kind()
            )));
        };
        let mut handles = Vec::with_capacity(allocs.len());
        for a in allocs {
            let span = HostSpan {
                addr: a.as_ptr() as usize,
                len: a.len(),
            };
            handles.push(
                self.agent
                    .register_memory(&span, Some(&self.backend_args))
                    .map_err(|e| nixl_err("nixl register", e))?,
            );
        }
        let remote = RemoteLayout::of(
            layout.layout(),
            allocs.iter().map(|a| a.as_ptr() as u64).collect(),
        );
        self.registered.push((handles, layout));
        Ok(remote)
    }

    /// This agent's metadata (its registrations, its backend's address), for a peer's
    /// [`load_remote`](Self::load_remote).
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.agent
            .get_local_md()
            .map_err(|e| nixl_err("nixl metadata", e))
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String> {
        self.agent
            .load_remote_md(metadata)
            .map_err(|e| nixl_err("nixl load remote metadata", e))
    }

    /// The registered local layout that is `layout` (by identity).
    fn registered(&self, layout: &Arc<PhysicalLayout>) -> Result<()> {
        if self.registered.iter().any(|(_, l)| Arc::ptr_eq(l, layout)) {
            Ok(())
        } else {
            Err(PhysicalError::InvalidArgument(
                "NIXL: the local layout is not registered with this agent".into(),
            ))
        }
    }

    /// Writes blocks `local_ids` of `local` into blocks `remote_ids` of the peer `peer`'s
    /// `remote` layout (`op = Write`), or reads them from there into `local` (`op = Read`).
    ///
    /// # Errors
    /// Argument errors (nothing posted): lists of different lengths, a block out of range on
    /// either side, geometries that differ, an unregistered local layout; NIXL's error when the
    /// request cannot be created or posted.
    ///
    /// # Safety
    /// For a read, nothing else reads or writes the local destination blocks until the
    /// transfer completed; for a write, nothing writes the local source blocks meanwhile. The
    /// peer promises the same of its blocks (the data plane's lease).
    pub unsafe fn transfer(
        &self,
        op: NixlOp,
        local: &Arc<PhysicalLayout>,
        local_ids: &[BlockId],
        peer: &str,
        remote: &RemoteLayout,
        remote_ids: &[BlockId],
    ) -> Result<NixlTransfer<'_>> {
        self.registered(local)?;
        let rl = remote.layout()?;
        let (lc, rc) = (local.layout().config(), rl.config());
        if !lc.same_block_geometry(rc) {
            return Err(PhysicalError::IncompatibleLayouts(format!(
                "NIXL: local blocks {lc:?} and remote blocks {rc:?} differ"
            )));
        }
        if local_ids.len() != remote_ids.len() {
            return Err(PhysicalError::InvalidArgument(format!(
                "NIXL: {} local blocks for {} remote blocks",
                local_ids.len(),
                remote_ids.len()
            )));
        }
        for (ids, n) in [(local_ids, lc.num_blocks), (remote_ids, rc.num_blocks)] {
            if let Some(&block_id) = ids.iter().find(|&&b| b >= n) {
                return Err(PhysicalError::BlockOutOfRange {
                    block_id,
                    num_blocks: n,
                });
            }
        }
        let mut mine =
            XferDescList::new(MemType::Dram).map_err(|e| nixl_err("nixl descriptors", e))?;
        let mut theirs =
            XferDescList::new(MemType::Dram).map_err(|e| nixl_err("nixl descriptors", e))?;
        let mut bytes = 0u64;
        let layers = 0..lc.num_layers;
        for (&l, &r) in local_ids.iter().zip(remote_ids) {
            let lr = local.block_addrs(l, layers.clone());
            let rr = remote_block_addrs(&rl, &remote.bases, r);
            for (la, ra, len) in region_pairs(&lr, &rr) {
                mine.add_desc(la, len, 0);
                theirs.add_desc(ra, len, 0);
                bytes += len as u64;
            }
        }
        let xop = match op {
            NixlOp::Write => XferOp::Write,
            NixlOp::Read => XferOp::Read,
        };
        let req = self
            .agent
            .create_xfer_req(xop, &mine, &theirs, peer, Some(&self.backend_args))
            .map_err(|e| nixl_err("nixl create transfer", e))?;
        let in_progress = self
            .agent
            .post_xfer_req(&req, Some(&self.backend_args))
            .map_err(|e| nixl_err("nixl post transfer", e))?;
        Ok(NixlTransfer {
            agent: self,
            req,
            done: !in_progress,
            bytes,
        })
    }
}

/// Which way a [`NixlAgent::transfer`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NixlOp {
    /// Local blocks into the peer's.
    Write,
    /// The peer's blocks into local ones.
    Read,
}

/// A posted NIXL transfer.
pub struct NixlTransfer<'a> {
    agent: &'a NixlAgent,
    req: nixl_sys::XferRequest,
    done: bool,
    bytes: u64,
}

impl std::fmt::Debug for NixlTransfer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransfer")
            .field("done", &self.done)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl NixlTransfer<'_> {
    /// Bytes the transfer moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether it completed (polls once).
    pub fn poll(&mut self) -> Result<bool> {
        if !self.done {
            self.done = self
                .agent
                .agent
                .get_xfer_status(&self.req)
                .map_err(|e| nixl_err("nixl transfer status", e))?
                .is_success();
        }
        Ok(self.done)
    }

    /// Polls until it completed, failed, or `timeout` passed (an error naming it).
    pub fn wait(mut self, timeout: Duration) -> Result<u64> {
        let start = Instant::now();
        while !self.poll()? {
            if start.elapsed() > timeout {
                return Err(PhysicalError::Aborted(format!(
                    "NIXL transfer of {} bytes not done after {timeout:?}",
                    self.bytes
                )));
            }
            std::thread::yield_now();
        }
        Ok(self.bytes)
    }
}

#[cfg(test)]
mod tests;
