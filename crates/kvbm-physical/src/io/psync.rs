//! `preadv`/`pwritev` engine: one request at a time, the portable fallback.

use std::os::fd::RawFd;

use super::{IoDir, IoEngine, IoRequest};

/// Synchronous positioned I/O.
#[derive(Debug, Default, Clone, Copy)]
pub struct PsyncEngine;

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }
    fn queue_depth(&self) -> usize {
        1
    }
    unsafe fn run(
        &self,
        fd: RawFd,
        n: usize,
        prepare: &mut dyn FnMut(usize) -> IoRequest,
        complete: &mut dyn FnMut(usize, std::io::Result<usize>),
    ) -> std::io::Result<()> {
        for i in 0..n {
            let req = prepare(i);
            let res = loop {
                // SAFETY: the iovecs are valid for the request's lifetime (engine contract).
                let r = unsafe {
                    match req.dir {
                        IoDir::Read => libc::preadv(
                            fd,
                            req.iovecs.as_ptr(),
                            req.iovecs.len() as libc::c_int,
                            req.offset as libc::off_t,
                        ),
                        IoDir::Write => libc::pwritev(
                            fd,
                            req.iovecs.as_ptr(),
                            req.iovecs.len() as libc::c_int,
                            req.offset as libc::off_t,
                        ),
                    }
                };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    break Err(e);
                }
                break Ok(r as usize);
            };
            complete(i, res);
            drop(req);
        }
        Ok(())
    }
}
