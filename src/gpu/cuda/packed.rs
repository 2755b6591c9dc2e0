//! A packed staging buffer's host -> device copy through the scatter kernel: the buffer's pinned
//! range, read by the device through its mapping (`PackedCopy::Kernel`) or through a VRAM mirror
//! filled by one DMA (`PackedCopy::DmaKernel`), then one launch per buffer.

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::scatter::{self, Scatter};
use super::{call, error_name, guard, host_bytes, Cuda, Device};
use crate::error::Result;
use crate::gpu::provider::{CopyPiece, CopyTicket, PackedCopy};

impl Cuda {
    /// The pinned range (start, length) that holds `[lo, hi)`.
    fn pinned_range(&self, lo: u64, hi: u64) -> Option<(u64, u64)> {
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .find(|&(a, n)| lo >= a && hi <= a + n)
    }

    /// The host -> device copies of a packed buffer through the scatter kernel; None when the
    /// pieces must take the batched copy (no kernel, unaligned pieces, a buffer not pinned here).
    ///
    /// # Safety
    /// As `copy_batch`; `d`'s context is current.
    pub(super) unsafe fn scatter_copy(
        &self,
        d: &Arc<Device>,
        pieces: &[CopyPiece],
        how: PackedCopy,
        stream: sys::CUstream,
    ) -> Result<Option<Box<dyn CopyTicket>>> {
        let kernel = d.scatter.get_or_init(|| {
            Scatter::load()
                .inspect(|_| {
                    tracing::info!(
                        "packed staging copies to the GPU use the scatter kernel ({how:?}: one \
                         launch per staging buffer)"
                    )
                })
                .map_err(|e| scatter::not_used(&format!("it did not load: {e}")))
                .ok()
        });
        let Some(kernel) = kernel else {
            return Ok(None);
        };
        let lo = pieces.iter().map(|p| p.host).min().unwrap_or(0);
        let hi = pieces.iter().map(|p| p.host + p.len).max().unwrap_or(0);
        let Some((base, len)) = self.pinned_range(lo, hi) else {
            scatter::not_used("a staging buffer outside the ranges this provider pinned");
            return Ok(None);
        };
        if lo % 16 != 0
            || !pieces
                .iter()
                .all(|p| scatter::fits(p.dev, p.host - lo, p.len))
        {
            return Ok(None);
        }
        let table: Vec<scatter::Piece> = pieces
            .iter()
            .map(|p| scatter::Piece {
                dst: p.dev,
                src_offset: (p.host - lo) as u32,
                len: p.len as u32,
            })
            .collect();
        let src = match how {
            PackedCopy::Kernel => {
                match guard("cuPointerGetAttribute", || scatter::mapped_address(lo))? {
                    Ok(mapped) => mapped,
                    Err(e) => {
                        scatter::not_used(&format!(
                            "the staging buffer is not mapped for the device: \
                             cuPointerGetAttribute failed: {}",
                            error_name(e)
                        ));
                        return Ok(None);
                    }
                }
            }
            PackedCopy::DmaKernel => {
                let mirror = {
                    let mut mirrors = d.mirrors.lock().unwrap_or_else(|p| p.into_inner());
                    match mirrors.get(&base) {
                        Some(&m) => m,
                        None => {
                            // SAFETY: a plain device allocation, freed in unpin_host.
                            let m = call("cuMemAlloc(staging mirror)", || unsafe {
                                result::malloc_sync(len as usize)
                            })?;
                            mirrors.insert(base, m);
                            m
                        }
                    }
                } + (lo - base);
                // SAFETY: the caller keeps the host range valid until the ticket completes; the
                // mirror range is this buffer's own (buffers do not overlap).
                call("cuMemcpyHtoDAsync(staging mirror)", || unsafe {
                    result::memcpy_htod_async(mirror, host_bytes(lo, hi - lo), stream)
                })?;
                mirror
            }
            PackedCopy::Auto | PackedCopy::Batch => return Ok(None),
        };
        // SAFETY: every piece fits; the source (mapped buffer or its mirror, filled earlier on
        // the same stream) and the destinations stay valid until the ticket completes.
        if let Err(e) = call("cuLaunchKernel(iud_scatter)", || unsafe {
            kernel.launch(stream, src, &table)
        }) {
            // A refused launch copied nothing: this buffer and every later one take the batched
            // copy (a fault while the kernel runs is reported by the ticket instead).
            scatter::disable(&e.message);
            return Ok(None);
        }
        self.record(d, stream).map(Some)
    }
}
