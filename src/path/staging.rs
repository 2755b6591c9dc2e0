//! The staging path: pinned host buffers, registered as io_uring fixed buffers, through which
//! VRAM moves when it cannot be addressed by storage I/O directly, and the device copies that
//! fill and drain them.
//!
//! READ: storage -> buffer (io_uring) then buffer -> GPU (async copy). WRITE: GPU -> buffer
//! (async copy) then buffer -> storage (io_uring). With several buffers the copy of one piece
//! overlaps the storage I/O of others. The pool is created on first VRAM use.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::{CopyTicket, GpuProvider};
use crate::mem::VramRegion;
use crate::uring::IoOp;

/// One pinned buffer.
pub struct StagingBuf {
    pub addr: u64,
    pub buf_index: Option<u16>,
}

/// Pinned, fixed-buffer-registered host memory cut into equal buffers.
pub struct StagingPool {
    pub provider: Arc<dyn GpuProvider>,
    pub buffer_size: u64,
    pub bufs: Vec<StagingBuf>,
    free: Vec<usize>,
    base: u64,
    total: u64,
}

// SAFETY: the pool owns its mapping; raw addresses are plain numbers here.
unsafe impl Send for StagingPool {}

impl StagingPool {
    /// Maps and pins `count` buffers of `buffer_size` bytes. `register` registers one buffer as a
    /// fixed buffer and returns its slot (None: the buffer is used unregistered).
    pub fn new(
        provider: Arc<dyn GpuProvider>,
        buffer_size: u64,
        count: u32,
        mut register: impl FnMut(u64, u64) -> Option<u16>,
    ) -> Result<StagingPool> {
        let total = buffer_size * count as u64;
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::os(format!("staging pool: mmap of {total} bytes"), &std::io::Error::last_os_error()));
        }
        let base = base as u64;
        // SAFETY: the mapping stays until Drop, which unpins first.
        if let Err(e) = unsafe { provider.pin_host(base, total) } {
            // SAFETY: unmapping what we just mapped.
            unsafe { libc::munmap(base as *mut libc::c_void, total as usize) };
            return Err(Error::new(e.kind, format!("staging pool: pinning {total} bytes failed: {}", e.message)));
        }
        let bufs: Vec<StagingBuf> = (0..count as u64)
            .map(|i| {
                let addr = base + i * buffer_size;
                StagingBuf { addr, buf_index: register(addr, buffer_size) }
            })
            .collect();
        tracing::debug!(count, buffer_size, fixed = bufs.iter().all(|b| b.buf_index.is_some()), "staging pool ready");
        Ok(StagingPool { provider, buffer_size, free: (0..count as usize).rev().collect(), bufs, base, total })
    }

    pub fn take(&mut self) -> Option<usize> {
        self.free.pop()
    }

    pub fn put(&mut self, buf: usize) {
        debug_assert!(!self.free.contains(&buf));
        self.free.push(buf);
    }
}

/// The staging side of one op on GPU memory: its buffer for the op's whole life (copy, storage
/// I/O, and the copy back), so the pool size bounds the VRAM bytes in flight.
#[derive(Debug, Clone, Copy)]
pub struct Stage {
    pub buf: usize,
    /// The op as planned, on device memory.
    pub device_op: IoOp,
}

/// A device copy that ended (or failed to run).
pub struct CopyDone {
    /// The caller's token (its request).
    pub owner: usize,
    pub stage: Stage,
    pub result: Result<()>,
    /// Device -> host copy of a WRITE: the storage write follows.
    pub then_write: bool,
}

struct PendingCopy {
    owner: usize,
    stage: Stage,
    ticket: Box<dyn CopyTicket>,
    then_write: bool,
}

/// The pool and the device copies in flight on it. Copies are polled, never waited for, on
/// the data path.
pub struct Staging {
    pool: StagingPool,
    copies: Vec<PendingCopy>,
}

impl Staging {
    pub fn new(pool: StagingPool) -> Staging {
        Staging { pool, copies: Vec::new() }
    }

    /// A buffer for `device_op`, or None while all are busy.
    pub fn take(&mut self, device_op: IoOp) -> Option<Stage> {
        self.pool.take().map(|buf| Stage { buf, device_op })
    }

    /// Gives the op's buffer back.
    pub fn put(&mut self, stage: Stage) {
        self.pool.put(stage.buf);
    }

    /// The storage I/O of a staged op: the same file range on its host buffer.
    pub fn host_op(&self, stage: &Stage) -> IoOp {
        let host = &self.pool.bufs[stage.buf];
        stage.device_op.on_host(host.addr, host.buf_index)
    }

    /// Starts the device -> buffer copy of a WRITE (the storage write follows in `poll`).
    pub fn start_to_host(&mut self, owner: usize, stage: Stage) -> Result<()> {
        let d = stage.device_op;
        let host = self.pool.bufs[stage.buf].addr;
        // SAFETY: the staging buffer is ours until `put`; the device range is registered VRAM
        // kept alive by the request's plan.
        let ticket = unsafe { self.pool.provider.copy_to_host(d.device.unwrap_or(0), host, d.addr, d.len as u64) }?;
        self.copies.push(PendingCopy { owner, stage, ticket, then_write: true });
        Ok(())
    }

    /// Starts the buffer -> device copy of a READ whose storage I/O landed in the buffer.
    pub fn start_to_device(&mut self, owner: usize, stage: Stage) -> Result<()> {
        let d = stage.device_op;
        let host = self.pool.bufs[stage.buf].addr;
        // SAFETY: as in start_to_host.
        let ticket = unsafe { self.pool.provider.copy_to_device(d.device.unwrap_or(0), d.addr, host, d.len as u64) }?;
        self.copies.push(PendingCopy { owner, stage, ticket, then_write: false });
        Ok(())
    }

    /// Moves the copies that ended into `out`; returns how many did.
    pub fn poll(&mut self, out: &mut Vec<CopyDone>) -> usize {
        let mut done = 0;
        let mut i = 0;
        while i < self.copies.len() {
            let finished = self.copies[i].ticket.is_done();
            if let Ok(false) = finished {
                i += 1;
                continue;
            }
            let c = self.copies.swap_remove(i);
            done += 1;
            out.push(CopyDone { owner: c.owner, stage: c.stage, result: finished.map(drop), then_write: c.then_write });
        }
        done
    }

    /// Whether device copies are in flight.
    pub fn copying(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Blocks until the oldest copy ended (when nothing else can make progress).
    pub fn wait_oldest(&self) {
        if let Some(c) = self.copies.first() {
            if let Err(e) = c.ticket.wait() {
                tracing::error!("waiting for a device copy: {e}");
            }
        }
    }

    /// Blocks until every copy ended (teardown: the buffers may be unmapped afterwards).
    pub fn wait_all(&mut self) {
        for c in self.copies.drain(..) {
            if let Err(e) = c.ticket.wait() {
                tracing::error!("waiting for a device copy at teardown: {e}");
            }
        }
    }
}

/// Where a staged piece starting at `addr` must end: VRAM moves by address, but pieces stop at
/// the registration's slab ends. Returns (memory address, device, end).
pub fn address(vram: &VramRegion, addr: u64) -> Option<(u64, i32, u64)> {
    let (_, slab_end) = vram.dmabuf.slab_at(addr)?;
    Some((addr, vram.device, slab_end))
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        self.provider.unpin_host(self.base);
        // SAFETY: the mapping was created in new(); the ring drained every op using it.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.total as usize) };
    }
}
