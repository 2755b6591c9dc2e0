//! The staging pool: pinned host memory, mapped on huge pages where the kernel offers them,
//! registered as io_uring fixed buffers where it can be, and cut into equal buffers handed out
//! and taken back by index.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::GpuProvider;
use crate::mem::huge_pages;

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
        // Huge pages where the kernel offers them: the workers copy through these addresses.
        let base = huge_pages::map_populated(total)
            .map_err(|e| Error::os(format!("staging pool: mmap of {total} bytes"), &e))?;
        // SAFETY: the mapping stays until Drop, which unpins first.
        if let Err(e) = unsafe { provider.pin_host(base, total) } {
            // SAFETY: unmapping what we just mapped.
            unsafe { libc::munmap(base as *mut libc::c_void, total as usize) };
            return Err(Error::new(
                e.kind,
                format!("staging pool: pinning {total} bytes failed: {}", e.message),
            ));
        }
        let bufs: Vec<StagingBuf> = (0..count as u64)
            .map(|i| {
                let addr = base + i * buffer_size;
                StagingBuf {
                    addr,
                    buf_index: register(addr, buffer_size),
                }
            })
            .collect();
        // Debug only: reading smaps walks every mapping of the process (a GPU process has many),
        // and tracing evaluates the fields only when the line is enabled.
        tracing::debug!(
            count,
            buffer_size,
            fixed = bufs.iter().all(|b| b.buf_index.is_some()),
            huge_page_bytes = ?huge_pages::huge_backed(base, total).map(|(bytes, _)| bytes),
            "staging pool ready"
        );
        Ok(StagingPool {
            provider,
            buffer_size,
            free: (0..count as usize).rev().collect(),
            bufs,
            base,
            total,
        })
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
