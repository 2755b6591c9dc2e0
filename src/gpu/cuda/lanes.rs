//! A device's copy streams: one device -> host stream, and `KERNEL_LANES` host -> device ones,
//! so that the scatter kernels of a request's staging buffers (`staging_kernel_streams`) may
//! overlap on the device instead of waiting for each other on one stream. DMA copies (dma-kernel's
//! too) keep lane 0: on the H100, 2 MiB host -> device DMAs on two or four streams run 11-16 %
//! slower than on one (bench/results/2026-12-05-copy-streams-gpu.md). Scatter kernels on four
//! make 32 KiB scattered READs 1.03-1.06x faster per request than on one, on H100 and H200
//! (bench/results/2026-12-05-evening-read-probe-gpu.md).
//!
//! Lane 0 is the DMA stream and exists from the start; the other lanes are created on first use.
//! Every stream is ordered after the application's work each time `fence` runs, and a stream
//! created later waits for the latest fence: creation and fence take one lock, so no stream can
//! miss a fence that a copy queued on it must follow.

use std::sync::Mutex;

use cudarc::driver::result::{self, stream::StreamKind, DriverError};
use cudarc::driver::sys;
use once_cell::sync::OnceCell;

/// Host -> device streams. More lanes than this share them (lane modulo `KERNEL_LANES`).
pub const KERNEL_LANES: usize = 4;

pub struct CopyLanes {
    pub to_host: sys::CUstream,
    /// Host -> device lane 0: every DMA copy, and the kernels of lane 0.
    pub dma_to_device: sys::CUstream,
    /// Lanes 1.. of the kernels.
    more: [OnceCell<sys::CUstream>; KERNEL_LANES - 1],
    /// Held while a stream is created and while `fence` orders the existing ones.
    fence_lock: Mutex<()>,
}

// SAFETY: CUDA streams are process-wide driver handles, usable from any thread with their
// context current.
unsafe impl Send for CopyLanes {}
// SAFETY: as above; the cells and the lock do the synchronization.
unsafe impl Sync for CopyLanes {}

fn create() -> Result<sys::CUstream, DriverError> {
    // Non-blocking: never serialize with the application's legacy default stream.
    result::stream::create(StreamKind::NonBlocking)
}

impl CopyLanes {
    /// The device -> host stream and the DMA stream, created with the device's context current.
    pub fn new() -> Result<CopyLanes, DriverError> {
        Ok(CopyLanes {
            to_host: create()?,
            dma_to_device: create()?,
            more: Default::default(),
            fence_lock: Mutex::new(()),
        })
    }

    /// The host -> device stream of a scatter kernel's `lane` (lane 0: the DMA stream), created
    /// on first use after the latest fence (`app_done`, recorded by `fence`). The device's
    /// context must be current.
    pub fn to_device(
        &self,
        lane: usize,
        app_done: sys::CUevent,
    ) -> Result<sys::CUstream, DriverError> {
        let Some(cell) = (lane % KERNEL_LANES).checked_sub(1).map(|i| &self.more[i]) else {
            return Ok(self.dma_to_device);
        };
        if let Some(&s) = cell.get() {
            return Ok(s);
        }
        let _held = self.fence_lock.lock().unwrap_or_else(|p| p.into_inner());
        cell.get_or_try_init(|| {
            let s = create()?;
            // SAFETY: both belong to the current context; an event never recorded is complete.
            unsafe {
                result::stream::wait_event(
                    s,
                    app_done,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }?;
            Ok(s)
        })
        .copied()
    }

    /// Records `app_done` on `after` and makes every existing stream wait for it.
    ///
    /// # Safety
    /// The event and `after` belong to the current context.
    pub unsafe fn fence(
        &self,
        app_done: sys::CUevent,
        after: sys::CUstream,
    ) -> Result<(), (&'static str, DriverError)> {
        let _held = self.fence_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: forwarded contract.
        unsafe { result::event::record(app_done, after) }
            .map_err(|e| ("cuEventRecord(default stream)", e))?;
        for s in [&self.to_host, &self.dma_to_device]
            .into_iter()
            .chain(self.more.iter().filter_map(|c| c.get()))
        {
            // SAFETY: as above; the wait captures the record just made.
            unsafe {
                result::stream::wait_event(
                    *s,
                    app_done,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| ("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }
}
