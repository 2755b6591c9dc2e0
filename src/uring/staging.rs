//! The staging pool: pinned host buffers, registered as io_uring fixed buffers, through which
//! VRAM moves when it cannot be addressed by storage I/O directly.
//!
//! READ: storage -> buffer (io_uring) then buffer -> GPU (async copy). WRITE: GPU -> buffer
//! (async copy) then buffer -> storage (io_uring). With several buffers the copy of one piece
//! overlaps the storage I/O of others. The pool is created on first VRAM use.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::GpuProvider;

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

impl Drop for StagingPool {
    fn drop(&mut self) {
        self.provider.unpin_host(self.base);
        // SAFETY: the mapping was created in new(); the ring drained every op using it.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.total as usize) };
    }
}
