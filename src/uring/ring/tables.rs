//! The ring's fixed-buffer and fixed-file tables: slots handed to registrations (buffers,
//! DMA-BUFs, files shared by open-file identity), retired through a leaf lock from anywhere (a
//! `Drop` included), and unregistered the next time the core lock is taken or released
//! (`CoreGuard`, in `mod.rs`).

use std::io;

use io_uring::IoUring;

use super::{FileKey, FileSlot, Retired, Ring, RingCore, HOLDER, MAX_FIXED_BUFFER};
use crate::error::describe_os_error;
use crate::uring::dmabuf_uapi;
use crate::uring::slots::SlotPool;

/// Registered-buffer table size: the kernel's IORING_MAX_REG_BUFFERS.
const BUFFER_TABLE_SLOTS: u32 = 1 << 14;
/// Upper bound of the registered-file table (also limited by RLIMIT_NOFILE).
const FILE_TABLE_SLOTS: u32 = 4096;

impl Ring {
    /// The sparse buffer and file tables of a new ring. A table the kernel refuses is absent (I/O
    /// then uses plain buffers or fds), logged once.
    pub(super) fn sparse_tables(
        uring: &IoUring,
        fixed_files: bool,
    ) -> (Option<SlotPool>, Option<SlotPool>) {
        let buffer_slots = match uring
            .submitter()
            .register_buffers_sparse(BUFFER_TABLE_SLOTS)
        {
            Ok(()) => Some(SlotPool::new(BUFFER_TABLE_SLOTS)),
            Err(e) => {
                tracing::info!(
                    "io_uring fixed buffers unavailable ({}); DRAM uses plain READ/WRITE",
                    describe_os_error(&e)
                );
                None
            }
        };
        let file_slots = if fixed_files {
            let nofile = nofile_limit().min(FILE_TABLE_SLOTS as u64) as u32;
            match uring.submitter().register_files_sparse(nofile) {
                Ok(()) => Some(SlotPool::new(nofile)),
                Err(e) => {
                    tracing::info!(
                        "io_uring fixed files unavailable ({}); I/O passes raw fds",
                        describe_os_error(&e)
                    );
                    None
                }
            }
        } else {
            None
        };
        (buffer_slots, file_slots)
    }

    /// Queues a slot for unregistration and, unless this thread is inside the ring's lock
    /// already (then the guard does it when released), unregisters it right away: a
    /// deregistered buffer must not stay pinned, nor a file open, until some later call.
    fn retire(&self, r: Retired) {
        self.failure
            .lock_or_recover(&self.retired, "ring retired slots")
            .push(r);
        if HOLDER.with(|h| h.get()) != self as *const Ring as usize {
            drop(self.lock_for_teardown());
        }
    }

    /// Registers `len` bytes at `addr` (at most 1 GiB) as a fixed buffer.
    ///
    /// # Safety
    /// The memory must stay mapped until [`Ring::release_buffer`] for the returned slot; the
    /// kernel pins it and may read or write it for any op that names the slot.
    pub unsafe fn register_buffer(&self, addr: u64, len: u64) -> io::Result<u16> {
        debug_assert!(len <= MAX_FIXED_BUFFER);
        let mut core = self.lock().map_err(io::Error::other)?;
        let core = &mut *core;
        let pool = core
            .buffer_slots
            .as_mut()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool
            .take()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        };
        // SAFETY: the caller keeps the memory mapped until the slot is released.
        match unsafe {
            core.uring
                .submitter()
                .register_buffers_update(slot, &[iov], None)
        } {
            Ok(()) => Ok(slot as u16),
            Err(e) => {
                pool.put(slot);
                Err(e)
            }
        }
    }

    /// Gives a fixed-buffer slot back (deferred until the next time the ring is locked).
    pub fn release_buffer(&self, slot: u16) {
        self.retire(Retired::Buffer(slot));
    }

    /// A registered-file slot for `key`, shared by every registration of the same open file.
    /// None when the table is absent or full (I/O then passes the raw fd).
    /// `io_fd` is the registration's own fd for the file (the table takes its own reference).
    pub fn acquire_file(&self, key: FileKey, io_fd: i32) -> Option<u32> {
        // A poisoned lock has failed the engine; the raw fd serves until the next call fails.
        let mut core = self.lock().ok()?;
        let core = &mut *core;
        if let Some(f) = core.files.get_mut(&key) {
            f.refs += 1;
            return Some(f.slot);
        }
        let pool = core.file_slots.as_mut()?;
        let slot = pool.take()?;
        match core.uring.submitter().register_files_update(slot, &[io_fd]) {
            Ok(_) => {
                core.files.insert(key, FileSlot { slot, refs: 1 });
                Some(slot)
            }
            Err(e) => {
                pool.put(slot);
                tracing::debug!(
                    fd = key.fd,
                    "fixed-file registration failed ({}); using the raw fd",
                    describe_os_error(&e)
                );
                None
            }
        }
    }

    /// Drops one reference to the file slot of `key` (deferred like buffers).
    pub fn release_file(&self, key: FileKey) {
        self.retire(Retired::File(key));
    }

    /// Registers a DMA-BUF in a free fixed-buffer slot, bound to `target_fd`.
    pub fn register_dmabuf(&self, dmabuf_fd: i32, target_fd: i32) -> io::Result<u16> {
        use std::os::fd::AsRawFd;
        let mut core = self.lock().map_err(io::Error::other)?;
        let core = &mut *core;
        // v3 accepts DMA-BUFs on IOPOLL rings, later versions are reported to refuse them
        // (docs/kernel-dmabuf-series.md): never rely on it. This ring is never IOPOLL; the check
        // keeps it that way if the setup flags ever change.
        if core.uring.params().is_setup_iopoll() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        let pool = core
            .buffer_slots
            .as_mut()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool
            .take()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        match dmabuf_uapi::register_dmabuf(core.uring.as_raw_fd(), slot, dmabuf_fd, target_fd) {
            Ok(()) => Ok(slot as u16),
            Err(e) => {
                pool.put(slot);
                Err(e)
            }
        }
    }
}

impl RingCore {
    pub(super) fn unregister(&mut self, r: Retired) {
        match r {
            Retired::Buffer(slot) => {
                let empty = libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                };
                // SAFETY: an empty iovec clears the slot; no memory is handed to the kernel.
                let res = unsafe {
                    self.uring
                        .submitter()
                        .register_buffers_update(slot as u32, &[empty], None)
                };
                match res {
                    Ok(()) => {
                        if let Some(pool) = self.buffer_slots.as_mut() {
                            pool.put(slot as u32)
                        }
                    }
                    Err(e) => tracing::error!(
                        slot,
                        "unregistering fixed buffer slot failed ({}); slot leaked",
                        describe_os_error(&e)
                    ),
                }
            }
            Retired::File(key) => {
                let Some(f) = self.files.get_mut(&key) else {
                    return;
                };
                f.refs -= 1;
                if f.refs > 0 {
                    return;
                }
                let slot = f.slot;
                self.files.remove(&key);
                match self.uring.submitter().register_files_update(slot, &[-1]) {
                    Ok(_) => {
                        if let Some(pool) = self.file_slots.as_mut() {
                            pool.put(slot)
                        }
                    }
                    Err(e) => tracing::error!(
                        slot,
                        "unregistering fixed file slot failed ({}); slot leaked",
                        describe_os_error(&e)
                    ),
                }
            }
        }
    }
}

fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}
