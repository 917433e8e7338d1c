//! Per-device driver state: the primary context and a small pool of copy streams.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use crate::error::{PhysicalError, Result};

/// Streams per copy direction. One: a direction saturates PCIe with one copy engine, and
/// transfers in one direction then complete in the order they reached the stream.
const STREAMS_PER_DIRECTION: usize = 1;

pub(crate) fn cuda_err(op: &'static str, e: impl std::fmt::Debug) -> PhysicalError {
    PhysicalError::Cuda {
        op,
        message: format!("{e:?}"),
    }
}

/// Which way a copy goes; each direction has its own streams so offload and onboard overlap
/// (separate copy engines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host to device (onboard, G2 → G1).
    HostToDevice,
    /// Device to host (offload, G1 → G2).
    DeviceToHost,
    /// Device to device.
    DeviceToDevice,
}

/// One GPU: its retained primary context and copy streams. Lives for the process.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    ctx: usize,
    streams: [Vec<usize>; 3],
    next: AtomicUsize,
}

// SAFETY: the context and stream handles are plain driver handles, valid from any thread once
// the context is made current there (`bind`, before every call).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the only mutable state is an atomic counter.
unsafe impl Sync for CudaDevice {}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();

impl CudaDevice {
    /// The device `ordinal`, initialised on first use. Fails (never panics) without a driver.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        if !super::cuda_available() {
            return Err(PhysicalError::NotSupported("no CUDA driver".into()));
        }
        let mut map = DEVICES.get_or_init(Default::default).lock();
        if let Some(d) = map.get(&ordinal) {
            return Ok(Arc::clone(d));
        }
        result::init().map_err(|e| cuda_err("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(PhysicalError::NotSupported(format!(
                "CUDA device {ordinal} requested, {count} present"
            )));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: dev is valid; the primary context stays retained for the process.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        let mut streams: [Vec<usize>; 3] = Default::default();
        for dir in &mut streams {
            for _ in 0..STREAMS_PER_DIRECTION {
                let s = result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(|e| cuda_err("cuStreamCreate", e))?;
                dir.push(s as usize);
            }
        }
        let d = Arc::new(CudaDevice {
            ordinal,
            ctx: ctx as usize,
            streams,
            next: AtomicUsize::new(0),
        });
        map.insert(ordinal, Arc::clone(&d));
        Ok(d)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The primary context handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx as sys::CUcontext
    }

    /// Makes the primary context current on this thread (cheap, thread-local).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context stays retained for the process.
        unsafe { result::ctx::set_current(self.context()) }
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// A copy stream for `dir` (round-robin over the pool).
    pub fn stream(&self, dir: Direction) -> sys::CUstream {
        let pool = &self.streams[dir as usize];
        pool[self.next.fetch_add(1, Ordering::Relaxed) % pool.len()] as sys::CUstream
    }

    /// Device name, for reports.
    pub fn name(&self) -> Result<String> {
        let dev =
            result::device::get(self.ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        result::device::get_name(dev).map_err(|e| cuda_err("cuDeviceGetName", e))
    }
}
