//! [`PhysicalLayout`]: a [`BlockLayout`] bound to the storage that holds it.
//!
//! Its own module, above `layout` (pure geometry, which `storage`, `identity` and `fingerprint`
//! read) and `storage`, so the crate's modules form no cycle.

use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{PhysicalError, Result};
use crate::layout::{BlockLayout, LayoutKind};
#[cfg(feature = "object")]
use crate::storage::ObjectStorage;
use crate::storage::{
    DeviceMemory, DiskConfig, DiskStorage, HostStandInDevice, HostStorage, PinPolicy, StorageKind,
};

static STAND_IN_LOGGED: AtomicBool = AtomicBool::new(false);

/// Allocates `len` bytes on device `ordinal`: real GPU memory when feature `cuda` is on and a
/// driver is present, the host stand-in otherwise (logged once). Here, above both `storage`
/// (which defines what device memory is) and `cuda` (which provides it), so neither depends on
/// the other.
fn allocate_device(len: usize, ordinal: usize) -> Result<Arc<dyn DeviceMemory>> {
    if crate::cuda::cuda_available() {
        #[cfg(feature = "cuda")]
        return Ok(Arc::new(crate::cuda::CudaDeviceMemory::new(len, ordinal)?));
    }
    if !STAND_IN_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            ordinal,
            "no CUDA driver (or feature `cuda` off): device memory is a host stand-in"
        );
    }
    Ok(Arc::new(HostStandInDevice::new(len)?))
}

/// The storage behind a layout.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Backing {
    /// Host memory, one allocation per [`BlockLayout::num_allocations`].
    Host(Vec<Arc<HostStorage>>),
    /// Device memory (or its stand-in), one allocation per layout allocation.
    Device(Vec<Arc<dyn DeviceMemory>>),
    /// A disk file with one slot per block.
    Disk(Arc<DiskStorage>),
    /// An object store; blocks are addressed by [`crate::ObjectKey`]s given per transfer.
    #[cfg(feature = "object")]
    Object(Arc<ObjectStorage>),
}

/// A layout plus its storage: what a [`crate::TransferManager`] registers.
#[derive(Debug, Clone)]
pub struct PhysicalLayout {
    layout: BlockLayout,
    backing: Backing,
}

impl PhysicalLayout {
    /// Allocates host memory for `layout` (page-aligned, pinned per `pin`).
    pub fn allocate_host(layout: BlockLayout, pin: PinPolicy) -> Result<Self> {
        let allocs = (0..layout.num_allocations())
            .map(|_| HostStorage::new(layout.allocation_bytes(), pin).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(PhysicalLayout {
            layout,
            backing: Backing::Host(allocs),
        })
    }

    /// Allocates device memory on `ordinal` (host stand-in without a GPU).
    pub fn allocate_device(layout: BlockLayout, ordinal: usize) -> Result<Self> {
        Self::device_with(layout, |len| allocate_device(len, ordinal))
    }

    /// `layout` over device memory, one allocation of `allocate(bytes)` per layout allocation.
    fn device_with(
        layout: BlockLayout,
        allocate: impl Fn(usize) -> Result<Arc<dyn DeviceMemory>>,
    ) -> Result<Self> {
        let allocs = (0..layout.num_allocations())
            .map(|_| allocate(layout.allocation_bytes()))
            .collect::<Result<Vec<_>>>()?;
        Ok(PhysicalLayout {
            layout,
            backing: Backing::Device(allocs),
        })
    }

    /// Allocates real GPU memory on `ordinal` for `layout`, never a stand-in: what a deployment
    /// that configured G1 on a device gets, or a clear refusal.
    ///
    /// # Errors
    /// [`PhysicalError::NotSupported`] naming why there is no GPU (a build without feature
    /// `cuda`, or no loadable driver); the driver's error when the device or the allocation
    /// fails.
    pub fn allocate_gpu(layout: BlockLayout, ordinal: usize) -> Result<Self> {
        if !crate::cuda::cuda_available() {
            return Err(PhysicalError::NotSupported(format!(
                "G1 on CUDA device {ordinal}: {}",
                if cfg!(feature = "cuda") {
                    "no CUDA driver (libcuda) could be loaded on this machine"
                } else {
                    "this build has no `cuda` feature (build kvbm with `--features cuda`)"
                }
            )));
        }
        #[cfg(feature = "cuda")]
        {
            Self::device_with(layout, |len| {
                Ok(Arc::new(crate::cuda::CudaDeviceMemory::new(len, ordinal)?))
            })
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("{layout:?}: cuda_available() is false without feature `cuda`")
    }

    /// Creates the disk file for `layout` (one slot per block).
    pub fn create_disk(layout: BlockLayout, config: &DiskConfig) -> Result<Self> {
        let disk = DiskStorage::create(
            config,
            layout.config().num_blocks,
            layout.config().block_bytes(),
        )?;
        Ok(PhysicalLayout {
            layout,
            backing: Backing::Disk(Arc::new(disk)),
        })
    }

    /// Binds `layout`'s geometry to an object tier.
    #[cfg(feature = "object")]
    pub fn object(layout: BlockLayout, storage: Arc<ObjectStorage>) -> Self {
        storage.bind_geometry(layout.config());
        PhysicalLayout {
            layout,
            backing: Backing::Object(storage),
        }
    }

    /// Binds `layout` to existing storage, checking that it fits.
    pub fn from_backing(layout: BlockLayout, backing: Backing) -> Result<Self> {
        let need = layout.allocation_bytes();
        let check = |sizes: Vec<usize>| -> Result<()> {
            if sizes.len() != layout.num_allocations() {
                return Err(PhysicalError::InvalidLayout(format!(
                    "{} allocations given, layout needs {}",
                    sizes.len(),
                    layout.num_allocations()
                )));
            }
            if let Some(s) = sizes.iter().find(|s| **s < need) {
                return Err(PhysicalError::InvalidLayout(format!(
                    "allocation of {s} bytes, layout needs {need}"
                )));
            }
            Ok(())
        };
        match &backing {
            Backing::Host(a) => check(a.iter().map(|h| h.len()).collect())?,
            Backing::Device(a) => check(a.iter().map(|d| d.size_bytes()).collect())?,
            Backing::Disk(d) => {
                if d.num_slots() < layout.config().num_blocks
                    || d.payload_bytes() != layout.config().block_bytes()
                {
                    return Err(PhysicalError::InvalidLayout(
                        "disk file does not match the layout".into(),
                    ));
                }
            }
            #[cfg(feature = "object")]
            Backing::Object(o) => o.bind_geometry(layout.config()),
        }
        Ok(PhysicalLayout { layout, backing })
    }

    /// The layout.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// The storage.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }
    /// The storage kind.
    pub fn storage_kind(&self) -> StorageKind {
        match &self.backing {
            Backing::Host(_) => StorageKind::Host,
            Backing::Device(_) => StorageKind::Device,
            Backing::Disk(_) => StorageKind::Disk,
            #[cfg(feature = "object")]
            Backing::Object(_) => StorageKind::Object,
        }
    }
    /// Whether a block's regions are directly addressable (host or device memory).
    pub fn is_memory(&self) -> bool {
        matches!(self.backing, Backing::Host(_) | Backing::Device(_))
    }

    /// The one span `(addr, len)` of host or device memory that holds all of `block` in a fully
    /// contiguous layout, found without allocating (a caller that walks many blocks, e.g. to
    /// checksum them); `None` for another layout kind, disk or objects
    /// ([`block_addrs`](Self::block_addrs) answers those).
    pub fn block_span(&self, block: usize) -> Option<(usize, usize)> {
        if self.layout.kind() != LayoutKind::FullyContiguous {
            return None;
        }
        let base = match &self.backing {
            Backing::Host(a) => a.first()?.as_ptr() as usize,
            Backing::Device(a) => a.first()?.device_addr() as usize,
            _ => return None,
        };
        let c = self.layout.config();
        Some((base + block * c.block_bytes(), c.block_bytes()))
    }

    /// Copies block `src` of this host layout into block `dst` of `to`, another host layout
    /// of the same bytes per block cut into other regions, region by region (the transfer
    /// strategies' `region_pairs`): for a caller moving bytes between layouts no one transfer
    /// manager holds (kvbm-cluster's fleet tier: vLLM's region and an instance's G2). Returns
    /// the bytes copied.
    ///
    /// # Errors
    /// [`PhysicalError::InvalidArgument`] when either side is not host memory, a block id is
    /// out of range, or the blocks' sizes differ.
    ///
    /// # Safety
    /// Nothing else writes block `src` of this layout, or reads or writes block `dst` of `to`,
    /// meanwhile.
    pub unsafe fn copy_host_block(
        &self,
        src: usize,
        to: &PhysicalLayout,
        dst: usize,
    ) -> Result<usize> {
        let (sc, dc) = (self.layout.config(), to.layout.config());
        if !matches!(self.backing, Backing::Host(_)) || !matches!(to.backing, Backing::Host(_)) {
            return Err(PhysicalError::InvalidArgument(
                "copy_host_block copies between host-memory layouts".into(),
            ));
        }
        if src >= sc.num_blocks || dst >= dc.num_blocks {
            return Err(PhysicalError::InvalidArgument(format!(
                "block {src} of {} or {dst} of {} is out of range",
                sc.num_blocks, dc.num_blocks
            )));
        }
        if sc.block_bytes() != dc.block_bytes() {
            return Err(PhysicalError::InvalidArgument(format!(
                "blocks of {} bytes cannot be copied into blocks of {}",
                sc.block_bytes(),
                dc.block_bytes()
            )));
        }
        let sr = self.block_addrs(src, 0..sc.num_layers);
        let dr = to.block_addrs(dst, 0..dc.num_layers);
        let mut copied = 0;
        for (s, d, len) in crate::layout::region_pairs(&sr, &dr) {
            // SAFETY: both ranges lie in their layouts' live host memory (`block_addrs` of
            // in-range blocks); the caller excludes other writers and readers.
            unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len) };
            copied += len;
        }
        Ok(copied)
    }

    /// Absolute addresses `(addr, len)` of `block`'s regions for `layers`, in serialized order,
    /// with adjacent regions merged. Host addresses for host memory, device addresses for
    /// device memory; empty for disk and objects.
    pub fn block_addrs(&self, block: usize, layers: std::ops::Range<usize>) -> Vec<(usize, usize)> {
        let bases: Vec<usize> = match &self.backing {
            Backing::Host(a) => a.iter().map(|h| h.as_ptr() as usize).collect(),
            Backing::Device(a) => a.iter().map(|d| d.device_addr() as usize).collect(),
            _ => return Vec::new(),
        };
        let mut out: Vec<(usize, usize)> = Vec::new();
        if self.layout.kind() == LayoutKind::FullyContiguous {
            let c = self.layout.config();
            let start = bases[0] + block * c.block_bytes() + layers.start * c.layer_bytes();
            return vec![(start, layers.len() * c.layer_bytes())];
        }
        for r in self.layout.block_regions(block, layers) {
            let addr = bases[r.allocation] + r.offset;
            match out.last_mut() {
                Some(last) if last.0 + last.1 == addr => last.1 += r.len,
                _ => out.push((addr, r.len)),
            }
        }
        out
    }
}
