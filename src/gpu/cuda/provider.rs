//! `GpuProvider` for CUDA: VRAM validation, DMA-BUF export, host pinning and the staging path's
//! asynchronous copies (per piece, batched, or through the scatter kernel), each on the device's
//! own streams and ordered after the application's work.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::scatter;
use super::{batch, call, check, driver_error, guard, host_bytes, Cuda, Device};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::provider::{
    CopyPiece, CopyTicket, DeviceRange, DmabufExport, GpuProvider, PackedCopy,
};

impl GpuProvider for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> i32 {
        self.count
    }

    fn check_device_range(&self, device: i32, addr: u64, len: u64) -> Result<DeviceRange> {
        self.device(device)?;
        let mut ordinal: i32 = -1;
        // sys: `result` has no cuPointerGetAttribute.
        // SAFETY: writes one int; addr is only inspected, not dereferenced.
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", || unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })
        .map_err(|e| Error {
            kind: ErrorKind::InvalidParam,
            message: format!("VRAM registration 0x{addr:x}+{len}: not CUDA device memory ({e})"),
            ..e
        })?;
        if ordinal != device {
            return Err(Error::invalid(format!(
                "VRAM registration 0x{addr:x}+{len}: the memory is on CUDA device {ordinal}, but \
                 devId says {device}"
            )));
        }
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // sys: `result` has no cuMemGetAddressRange.
        // SAFETY: writes into base/size.
        check("cuMemGetAddressRange", || unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr)
        })?;
        let end = base + size as u64;
        if addr + len > end {
            return Err(Error::invalid(format!(
                "VRAM registration 0x{addr:x}+{len} runs past the end of its CUDA allocation \
                 [0x{base:x}, 0x{end:x})"
            )));
        }
        Ok(DeviceRange {
            alloc_start: base,
            alloc_end: end,
        })
    }

    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport> {
        self.device(device)?;
        let mut fd: i32 = -1;
        let what = format!("cuMemGetHandleForAddressRange(0x{addr:x}+{len}, DMA_BUF_FD)");
        // sys: `result` has no cuMemGetHandleForAddressRange (DMA-BUF export).
        // SAFETY: writes one int (the fd); the range is only described, not accessed.
        check(&what, || unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast::<c_void>(),
                addr,
                len as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        // SAFETY: the driver returned a new fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) }.into())
    }

    unsafe fn pin_host(&self, addr: u64, len: u64) -> Result<()> {
        if self.count == 0 {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "no CUDA device to pin host memory for",
            ));
        }
        self.device(0)?;
        // sys: `result` has no cuMemHostRegister / cuMemHostUnregister.
        // SAFETY: the caller keeps the memory mapped until unpin_host.
        // DEVICEMAP: the scatter kernel may read the buffers over the bus (PackedCopy::Kernel).
        let mapped = check("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(
                addr as *mut c_void,
                len as usize,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        });
        if mapped.is_err() {
            // SAFETY: as above.
            check("cuMemHostRegister", || unsafe {
                sys::cuMemHostRegister_v2(
                    addr as *mut c_void,
                    len as usize,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            })?;
        }
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((addr, len));
        Ok(())
    }

    fn unpin_host(&self, addr: u64) {
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|&(a, _)| a != addr);
        let devices: Vec<Arc<Device>> = self
            .devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for d in devices {
            if let Some(mirror) = d
                .mirrors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&addr)
            {
                // SAFETY: the mirror was allocated in d's context for this range; its copies
                // ended before the staging pool let go of the range.
                let _ = call("cuMemFree", || unsafe {
                    result::ctx::set_current(d.ctx)?;
                    result::free_sync(mirror)
                });
            }
        }
        if self.device(0).is_ok() {
            // SAFETY: addr was registered by pin_host.
            let _ = check("cuMemHostUnregister", || unsafe {
                sys::cuMemHostUnregister(addr as *mut c_void)
            });
        }
    }

    unsafe fn copy_to_host(
        &self,
        device: i32,
        host: u64,
        dev: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        let stream = d.lanes.to_host;
        // SAFETY: the caller keeps both ranges valid until the ticket completes; the host range
        // is the staging pool's (host_bytes).
        call("cuMemcpyDtoHAsync", || unsafe {
            result::memcpy_dtoh_async(host_bytes(host, len), dev, stream)
        })?;
        self.record(&d, stream)
    }

    unsafe fn copy_batch(
        &self,
        device: i32,
        pieces: &[CopyPiece],
        to_host: bool,
        how: PackedCopy,
        lane: usize,
    ) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        let how = scatter::resolve(how, pieces);
        if !to_host
            && matches!(how, PackedCopy::Kernel | PackedCopy::DmaKernel)
            && pieces.len() > 1
            && scatter::enabled()
        {
            // dma-kernel's DMA keeps the DMA stream, lane 0 (lanes.rs); its kernel follows it.
            let lane = if how == PackedCopy::DmaKernel {
                0
            } else {
                lane
            };
            let stream = call("cuStreamCreate", || d.lanes.to_device(lane, d.app_done))?;
            // SAFETY: forwarded from the caller.
            if let Some(ticket) = unsafe { self.scatter_copy(&d, pieces, how, stream) }? {
                return Ok(ticket);
            }
        }
        // DMA copies: one stream per direction (see lanes.rs).
        let stream = if to_host {
            d.lanes.to_host
        } else {
            d.lanes.dma_to_device
        };
        // SAFETY: the caller keeps every range valid until the ticket completes.
        if !unsafe { batch::copy(device, pieces, to_host, stream) } {
            for p in pieces {
                // One copy per piece on the same stream, one event for all.
                if to_host {
                    // SAFETY: as above (host ranges in the staging pool, see host_bytes).
                    call("cuMemcpyDtoHAsync", || unsafe {
                        result::memcpy_dtoh_async(host_bytes(p.host, p.len), p.dev, stream)
                    })?;
                } else {
                    // SAFETY: as above.
                    call("cuMemcpyHtoDAsync", || unsafe {
                        result::memcpy_htod_async(p.dev, host_bytes(p.host, p.len), stream)
                    })?;
                }
            }
        }
        self.record(&d, stream)
    }

    unsafe fn copy_to_device(
        &self,
        device: i32,
        dev: u64,
        host: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        let stream = d.lanes.dma_to_device;
        // SAFETY: the caller keeps both ranges valid until the ticket completes; the host range
        // is the staging pool's (host_bytes).
        call("cuMemcpyHtoDAsync", || unsafe {
            result::memcpy_htod_async(dev, host_bytes(host, len), stream)
        })?;
        self.record(&d, stream)
    }

    fn fence_app_work(&self, device: i32, host_wait: bool) -> Result<()> {
        let d = self.device(device)?;
        // CU_STREAM_LEGACY: the implicit default stream that applications (PyTorch's default
        // stream among them) queue their kernels on.
        let legacy = 0x1 as sys::CUstream;
        if host_wait {
            // SAFETY: the event belongs to the device's context, current after device().
            call("cuEventRecord(default stream)", || unsafe {
                result::event::record(d.app_done, legacy)
            })?;
            // SAFETY: as above.
            return call("cuEventSynchronize", || unsafe {
                result::event::synchronize(d.app_done)
            });
        }
        // SAFETY: as above, for the event and every copy stream. A stream's wait may capture a
        // later record than this one, which also follows the application's earlier work.
        guard("cuStreamWaitEvent", || unsafe {
            d.lanes.fence(d.app_done, legacy)
        })?
        .map_err(|(what, e)| driver_error(what, e))
    }

    fn make_current(&self, device: i32) -> Result<()> {
        self.device(device).map(drop)
    }

    fn describe(&self) -> String {
        let names: Vec<String> = (0..self.count)
            .map(|i| self.device_name(i).unwrap_or_else(|e| e.message))
            .collect();
        format!(
            "CUDA driver {}.{}, {} device(s): {}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.count,
            names.join(", ")
        )
    }
}
