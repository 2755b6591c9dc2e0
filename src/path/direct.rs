//! The direct path: host memory addressed by pointer (in a fixed-buffer slot when registered),
//! moved by the ring, or by the threads that post and poll: buffered writes, and small reads
//! whose data is already in the page cache.
//!
//! Page-cache writes are memory copies. io_uring runs them inline only on file systems that
//! support non-blocking buffered writes; elsewhere (ext4 among them) every write is punted to an
//! io-wq worker, and writes to one file are serialized there, so each I/O pays a thread hand-off.
//! libaio, by contrast, copies in the caller. So each postXfer/checkXfer call writes up to
//! `inline_write_max` bytes of its request with pwrite(2) itself (a request that small completes
//! before postXfer returns), while the ring keeps a few of the request's writes in flight.

use std::io;

use super::route::{Path, Route};
use crate::error::{Error, Result};
use crate::mem::{DramRegion, FileRegion, Registration};
use crate::uring::IoOp;

/// Host memory by pointer: every DRAM registration can take it.
pub struct Direct;

impl Path for Direct {
    fn check(&self, mem: &Registration, _file: &FileRegion) -> Result<()> {
        match mem {
            Registration::Dram(_) => Ok(()),
            other => Err(Error::invalid(format!(
                "{} is not host memory",
                other.kind().name()
            ))),
        }
    }

    fn bind(&self, mem: &Registration, file: &FileRegion) -> Result<Route> {
        self.check(mem, file).map(|()| Route::Host)
    }
}

/// The piece of host memory at `addr`: its address, its fixed-buffer slot when the memory is
/// registered with the ring, and where the piece must end (the slot's end).
pub fn address(dram: &DramRegion, addr: u64) -> (u64, Option<u16>, Option<u64>) {
    match dram.fixed_slot(addr) {
        Some((slot, slot_end)) => (addr, Some(slot), Some(slot_end)),
        None => (addr, None, None),
    }
}

/// Writes every op completely, resuming short writes; stops at the first error.
pub fn write_all(ops: &[IoOp]) -> Result<()> {
    for op in ops {
        let mut op = *op;
        loop {
            // SAFETY: op.addr..op.addr+op.len lies inside registered memory that NIXL's
            // contract keeps mapped while the request exists; pwrite only reads it.
            let n = unsafe {
                libc::pwrite(
                    op.io_fd,
                    op.addr as *const libc::c_void,
                    op.len as usize,
                    op.file_offset as libc::off_t,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                    Some(errno) => return Err(op.failed(true, errno)),
                    None => return Err(op.failed(true, libc::EIO)),
                }
            }
            let n = n as u32;
            if n == op.len {
                break;
            }
            if n == 0 {
                return Err(op.made_no_progress(true));
            }
            op = op.remainder(n);
        }
    }
    Ok(())
}

/// Reads ops in order with preadv2(RWF_NOWAIT) while each is served completely from the page
/// cache; returns how many were. The first op that would block, comes back short or fails stops
/// it: that op and the rest go through the ring, which also reports errors (EOF included) with
/// their full context.
pub fn read_cached_prefix(ops: &[IoOp]) -> usize {
    for (i, op) in ops.iter().enumerate() {
        let iov = libc::iovec {
            iov_base: op.addr as *mut libc::c_void,
            iov_len: op.len as usize,
        };
        // SAFETY: op.addr..op.addr+op.len lies inside registered memory that NIXL's contract
        // keeps mapped while the request exists, and no other op of the request targets it now.
        let n = unsafe {
            libc::preadv2(
                op.io_fd,
                &iov,
                1,
                op.file_offset as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        if n != op.len as isize {
            return i;
        }
    }
    ops.len()
}
