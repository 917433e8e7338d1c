//! io_uring engine: vectored reads/writes, up to the queue depth in flight, submitted and reaped
//! in batches.
//!
//! Every request prepared in one round is submitted by one `io_uring_enter`: the kernel then
//! issues them under one block plug, one doorbell to the device, instead of one per request (on
//! a virtualized disk each doorbell is a VM exit, which dominated small-block I/O).
//!
//! Rings are pooled (`Mutex<Vec<IoUring>>`, held only to take or return a ring, never across
//! I/O), so concurrent transfers on one file each drive their own ring.

use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, types};
use parking_lot::Mutex;

use super::{IoDir, IoEngine, IoRequest};

/// io_uring-backed engine.
pub struct UringEngine {
    queue_depth: u32,
    rings: Mutex<Vec<IoUring>>,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("queue_depth", &self.queue_depth)
            .field("pooled_rings", &self.rings.lock().len())
            .finish()
    }
}

impl UringEngine {
    /// Creates an engine, building one ring to prove io_uring works here.
    pub fn new(queue_depth: u32) -> std::io::Result<Self> {
        let queue_depth = queue_depth.clamp(1, 4096);
        let ring = IoUring::new(queue_depth.next_power_of_two())?;
        Ok(UringEngine {
            queue_depth,
            rings: Mutex::new(vec![ring]),
        })
    }

    fn take_ring(&self) -> std::io::Result<IoUring> {
        if let Some(r) = self.rings.lock().pop() {
            return Ok(r);
        }
        IoUring::new(self.queue_depth.next_power_of_two())
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }
    fn queue_depth(&self) -> usize {
        self.queue_depth as usize
    }
    unsafe fn run(
        &self,
        fd: RawFd,
        n: usize,
        prepare: &mut dyn FnMut(usize) -> IoRequest,
        complete: &mut dyn FnMut(usize, std::io::Result<usize>),
    ) -> std::io::Result<()> {
        let mut ring = self.take_ring()?;
        let result = drive(
            &mut ring,
            self.queue_depth as usize,
            fd,
            n,
            prepare,
            complete,
        );
        if result.is_ok() {
            self.rings.lock().push(ring);
        }
        result
    }
}

fn push(
    ring: &mut IoUring,
    fd: RawFd,
    index: usize,
    req: &IoRequest,
    pending: &mut usize,
) -> std::io::Result<()> {
    let sqe = match req.dir {
        IoDir::Read => {
            opcode::Readv::new(types::Fd(fd), req.iovecs.as_ptr(), req.iovecs.len() as u32)
                .offset(req.offset)
                .build()
        }
        IoDir::Write => {
            opcode::Writev::new(types::Fd(fd), req.iovecs.as_ptr(), req.iovecs.len() as u32)
                .offset(req.offset)
                .build()
        }
    }
    .user_data(index as u64);
    // SAFETY: the caller keeps `req` (its iovecs and their memory) alive until reaped.
    unsafe {
        ring.submission()
            .push(&sqe)
            .map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
    }
    *pending += 1;
    // Submitted with the rest of its round by the caller (`drive`).
    Ok(())
}

fn drive(
    ring: &mut IoUring,
    qd: usize,
    fd: RawFd,
    n: usize,
    prepare: &mut dyn FnMut(usize) -> IoRequest,
    complete: &mut dyn FnMut(usize, std::io::Result<usize>),
) -> std::io::Result<()> {
    let mut inflight: Vec<Option<IoRequest>> = (0..n).map(|_| None).collect();
    let mut next = 0usize;
    let mut pending = 0usize;
    let mut done = 0usize;
    let mut reaped: Vec<(usize, i32)> = Vec::with_capacity(qd);
    let mut fill = |ring: &mut IoUring,
                    next: &mut usize,
                    pending: &mut usize,
                    inflight: &mut Vec<Option<IoRequest>>|
     -> std::io::Result<()> {
        while *next < n && *pending < qd {
            let req = prepare(*next);
            inflight[*next] = Some(req);
            push(
                ring,
                fd,
                *next,
                inflight[*next].as_ref().expect("just set"),
                pending,
            )?;
            *next += 1;
        }
        Ok(())
    };
    let outcome = (|| {
        while done < n {
            fill(ring, &mut next, &mut pending, &mut inflight)?;
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            reaped.clear();
            reaped.extend(
                ring.completion()
                    .map(|cqe| (cqe.user_data() as usize, cqe.result())),
            );
            pending -= reaped.len();
            // Refill (and submit) before the (possibly expensive) completion callbacks, so the
            // device stays busy while we verify.
            let before = next;
            fill(ring, &mut next, &mut pending, &mut inflight)?;
            if next > before {
                ring.submit()?;
            }
            for &(i, res) in &reaped {
                let r = if res < 0 {
                    Err(std::io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res as usize)
                };
                complete(i, r);
                inflight[i] = None;
                done += 1;
            }
        }
        Ok(())
    })();
    if outcome.is_err() {
        // Requests may still be in flight: wait for them before their memory can be reused.
        // A request pushed but never submitted counts too; submit_and_wait submits it.
        while pending > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => pending -= ring.completion().count().min(pending),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => {
                    // Cannot wait: leak the requests rather than free memory the kernel uses.
                    std::mem::forget(inflight);
                    break;
                }
            }
        }
    }
    outcome
}
