//! The CUDA provider, through cudarc's driver API (its `result` layer; `sys` only for the calls
//! `result` lacks, each marked) in dynamic-loading mode.
//!
//! cudarc's loader panics when libcuda or a symbol is missing, so `Cuda::load` first checks that
//! the library can be opened (`is_culib_present`) and every call runs inside `guard`, which turns
//! a panic into an error. A failed call becomes an error naming it, with ("cuda", CUresult) as
//! its vendor status. Nothing here links against CUDA.
//!
//! Contexts: the primary context of each device is retained once and made current on the calling
//! thread before each call that needs it (NIXL calls the data path from arbitrary threads).

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use once_cell::sync::OnceCell;

use super::cuda_batch as batch;
use super::cuda_lanes::CopyLanes;
use super::cuda_scatter::{self as scatter, Scatter};
use crate::error::{panic_message, Error, ErrorKind, Result};
use crate::gpu::provider::{
    CopyPiece, CopyTicket, DeviceRange, DmabufExport, GpuProvider, PackedCopy,
};

/// Runs a driver call, turning a loader panic (missing symbol) into an error.
fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = panic_message(&*p).unwrap_or_default();
        Error::backend(format!(
            "CUDA {what}: the driver library lacks this entry point ({msg})"
        ))
    })
}

/// The CUDA error name (e.g. CUDA_ERROR_INVALID_VALUE) of a failed call (cuGetErrorName).
fn error_name(e: DriverError) -> String {
    match guard("cuGetErrorName", || {
        e.error_name()
            .map(|name| name.to_string_lossy().into_owned())
    }) {
        Ok(Ok(name)) => name,
        _ => format!("CUresult {}", e.0 as i32),
    }
}

/// The crate error for a failed driver call. The `DriverError` is not kept as the source: its
/// Display calls into the driver (cuGetErrorString) outside `guard`.
fn driver_error(what: &str, e: DriverError) -> Error {
    Error::backend(format!("{what} failed: {}", error_name(e))).with_vendor("cuda", e.0 as i64)
}

/// Runs a call of cudarc's `result` layer and maps a failure to an error naming the call.
fn call<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, DriverError>) -> Result<T> {
    guard(what, f)?.map_err(|e| driver_error(what, e))
}

/// As `call`, for the `sys` functions `result` lacks.
fn check(what: &str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    call(what, || f().result())
}

/// The host range of a staging copy as bytes, for `result`'s slice-typed copies.
///
/// # Safety
/// `addr..addr+len` is mapped, initialized memory (the staging pool's anonymous mapping) that
/// nothing else writes while the copy is queued.
unsafe fn host_bytes<'a>(addr: u64, len: u64) -> &'a mut [u8] {
    // SAFETY: forwarded contract; a u8 slice has no alignment or validity demands beyond that.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) }
}

struct Device {
    ctx: sys::CUcontext,
    /// The copy streams: device -> host, and host -> device by lane.
    lanes: CopyLanes,
    /// Recorded on the legacy default stream at each post; our streams wait on it.
    app_done: sys::CUevent,
    /// Copy-completion events of finished tickets, reused: creating and destroying one per
    /// copy costs two driver calls on the hot path of every staged piece.
    spare_events: Mutex<Vec<sys::CUevent>>,
    /// The scatter kernel for packed staging buffers, loaded on first use (None: it failed to
    /// load, logged once; packed copies take the batched copy).
    scatter: OnceCell<Option<Scatter>>,
    /// VRAM mirrors of pinned host ranges (by range start) for `PackedCopy::DmaKernel`.
    mirrors: Mutex<HashMap<u64, sys::CUdeviceptr>>,
}

/// The loaded CUDA driver.
pub struct Cuda {
    devices: Mutex<HashMap<i32, Arc<Device>>>,
    /// Host ranges pinned through `pin_host` (start, length): where a packed copy's buffer lies.
    pinned: Mutex<Vec<(u64, u64)>>,
    count: i32,
    driver_version: i32,
}

// SAFETY: CUDA contexts and streams are usable from any thread once made current; the map is
// behind a Mutex.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}
// SAFETY: contexts and streams are process-wide driver handles.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

static CUDA: OnceCell<std::result::Result<Arc<Cuda>, Error>> = OnceCell::new();

impl Cuda {
    /// Loads libcuda and initializes the driver, once per process.
    pub fn load() -> Result<Arc<Cuda>> {
        CUDA.get_or_init(|| {
            // SAFETY: is_culib_present only tries to dlopen candidate names.
            let present = guard("load", || unsafe { sys::is_culib_present() }).unwrap_or(false);
            if !present {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    "libcuda.so.1 could not be loaded (no NVIDIA driver on this machine?)",
                ));
            }
            call("cuInit", result::init)?;
            let count = call("cuDeviceGetCount", result::device::get_count)?;
            let mut driver_version = 0;
            // sys: `result` has no cuDriverGetVersion.
            // SAFETY: writes one int into a local.
            check("cuDriverGetVersion", || unsafe {
                sys::cuDriverGetVersion(&mut driver_version)
            })?;
            Ok(Arc::new(Cuda {
                devices: Mutex::new(HashMap::new()),
                pinned: Mutex::new(Vec::new()),
                count,
                driver_version,
            }))
        })
        .clone()
    }

    /// The device's primary context and streams, created on first use and made current.
    fn device(&self, ordinal: i32) -> Result<Arc<Device>> {
        if ordinal < 0 || ordinal >= self.count {
            return Err(Error::invalid(format!(
                "CUDA device {ordinal} does not exist ({} devices visible)",
                self.count
            )));
        }
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = devices.get(&ordinal) {
            let d = Arc::clone(d);
            drop(devices);
            // SAFETY: ctx is a retained primary context.
            call("cuCtxSetCurrent", || unsafe {
                result::ctx::set_current(d.ctx)
            })?;
            return Ok(d);
        }
        let dev = call("cuDeviceGet", || result::device::get(ordinal))?;
        // SAFETY: dev came from cuDeviceGet; the primary context is retained for the process
        // lifetime.
        let ctx = call("cuDevicePrimaryCtxRetain", || unsafe {
            result::primary_ctx::retain(dev)
        })?;
        // SAFETY: ctx was just retained.
        call("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(ctx)
        })?;
        // Created with the context current.
        let lanes = call("cuStreamCreate", CopyLanes::new)?;
        let app_done = call("cuEventCreate", || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        })?;
        let (spare_events, scatter, mirrors) = (
            Mutex::new(Vec::new()),
            OnceCell::new(),
            Mutex::new(HashMap::new()),
        );
        let d = Arc::new(Device {
            ctx,
            lanes,
            app_done,
            spare_events,
            scatter,
            mirrors,
        });
        devices.insert(ordinal, Arc::clone(&d));
        Ok(d)
    }

    fn attribute(&self, ordinal: i32, attr: sys::CUdevice_attribute) -> Result<i32> {
        let dev = call("cuDeviceGet", || result::device::get(ordinal))?;
        // SAFETY: dev came from cuDeviceGet.
        call("cuDeviceGetAttribute", || unsafe {
            result::device::get_attribute(dev, attr)
        })
    }

    /// Whether the device can export DMA-BUFs (open kernel module, CUDA 11.7+).
    pub fn dmabuf_supported(&self, ordinal: i32) -> Result<bool> {
        Ok(self.attribute(
            ordinal,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        )? != 0)
    }

    pub fn device_name(&self, ordinal: i32) -> Result<String> {
        let dev = call("cuDeviceGet", || result::device::get(ordinal))?;
        // cudarc reads the name from a 128-byte buffer, as this provider did.
        call("cuDeviceGetName", || result::device::get_name(dev))
    }

    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }
}

struct EventTicket {
    event: sys::CUevent,
    device: Arc<Device>,
}

/// Spare events kept per device; more are destroyed (a request rarely has more copies in flight).
const SPARE_EVENTS_MAX: usize = 256;

// SAFETY: a CUDA event may be queried from any thread with its context current.
unsafe impl Send for EventTicket {}

impl CopyTicket for EventTicket {
    fn is_done(&self) -> Result<bool> {
        // SAFETY: ctx is a retained primary context; event is alive until drop.
        call("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(self.device.ctx)
        })?;
        // SAFETY: as above.
        match guard("cuEventQuery", || unsafe {
            result::event::query(self.event)
        })? {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(Error::backend(format!(
                "asynchronous device copy failed: {}",
                error_name(e)
            ))
            .with_vendor("cuda", e.0 as i64)),
        }
    }

    fn wait(&self) -> Result<()> {
        // SAFETY: as in is_done.
        call("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(self.device.ctx)
        })?;
        // SAFETY: as above.
        call("cuEventSynchronize", || unsafe {
            result::event::synchronize(self.event)
        })
    }
}

impl Drop for EventTicket {
    fn drop(&mut self) {
        // Re-recording a spare event replaces its previous capture, so even an event whose copy
        // is still pending (a failing request) is safe to reuse.
        let mut spare = self
            .device
            .spare_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_EVENTS_MAX {
            spare.push(self.event);
            return;
        }
        drop(spare);
        // SAFETY: the event was created by us and is destroyed once; a pending event may be
        // destroyed (the driver releases it when it completes).
        let _ = guard("cuEventDestroy", || unsafe {
            let _ = result::ctx::set_current(self.device.ctx);
            result::event::destroy(self.event)
        });
    }
}

impl Cuda {
    fn record(&self, d: &Arc<Device>, stream: sys::CUstream) -> Result<Box<dyn CopyTicket>> {
        let spare = d
            .spare_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let event = match spare {
            Some(e) => e,
            // Created with the device's context current.
            None => call("cuEventCreate", || {
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            })?,
        };
        let ticket = EventTicket {
            event,
            device: Arc::clone(d),
        };
        // SAFETY: event and stream belong to the current context.
        call("cuEventRecord", || unsafe {
            result::event::record(event, stream)
        })?;
        Ok(Box::new(ticket))
    }
}

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
    unsafe fn scatter_copy(
        &self,
        d: &Arc<Device>,
        pieces: &[CopyPiece],
        how: PackedCopy,
        stream: sys::CUstream,
    ) -> Result<Option<Box<dyn CopyTicket>>> {
        let kernel = d.scatter.get_or_init(|| {
            Scatter::load()
                .inspect(|_| tracing::info!("packed staging copies to the GPU use the scatter kernel ({how:?}: one launch per staging buffer)"))
                .map_err(|e| scatter::not_used(&format!("it did not load: {e}"))).ok()
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
                        scatter::not_used(&format!("the staging buffer is not mapped for the device: cuPointerGetAttribute failed: {}", error_name(e)));
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
                "VRAM registration 0x{addr:x}+{len}: the memory is on CUDA device {ordinal}, but devId says {device}"
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
                "VRAM registration 0x{addr:x}+{len} runs past the end of its CUDA allocation [0x{base:x}, 0x{end:x})"
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
        // sys: `result` has no cuMemGetHandleForAddressRange (DMA-BUF export).
        // SAFETY: writes one int (the fd); the range is only described, not accessed.
        check(
            &format!("cuMemGetHandleForAddressRange(0x{addr:x}+{len}, DMA_BUF_FD)"),
            || unsafe {
                sys::cuMemGetHandleForAddressRange(
                    (&mut fd as *mut i32).cast::<c_void>(),
                    addr,
                    len as usize,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            },
        )?;
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
            // dma-kernel's DMA keeps the DMA stream, lane 0 (gpu/cuda_lanes.rs); its kernel follows it.
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
        // DMA copies: one stream per direction (see gpu/cuda_lanes.rs).
        let stream = if to_host {
            d.lanes.to_host
        } else {
            d.lanes.dma_to_device
        };
        // SAFETY: the caller keeps every range valid until the ticket completes.
        if !unsafe { batch::copy(device, pieces, to_host, stream) } {
            for p in pieces {
                // SAFETY: as above (host ranges in the staging pool, see host_bytes); one copy per
                // piece on the same stream, one event for all.
                if to_host {
                    call("cuMemcpyDtoHAsync", || unsafe {
                        result::memcpy_dtoh_async(host_bytes(p.host, p.len), p.dev, stream)
                    })?;
                } else {
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

/// Allocates `bytes` on `device`, exports it as DMA-BUFs in slabs of at most `max_slab` bytes,
/// closes them and frees the memory. Returns the number of slabs. Used by the doctor.
pub fn export_probe(cuda: &Cuda, device: i32, bytes: u64, max_slab: u64) -> Result<usize> {
    cuda.device(device)?;
    // SAFETY: a device allocation, only exported below, never read.
    let ptr = call("cuMemAlloc", || unsafe {
        result::malloc_sync(bytes as usize)
    })?;
    let result = (|| {
        let (mut start, mut slabs) = (ptr, 0);
        while start < ptr + bytes {
            let len = (ptr + bytes - start).min(max_slab.max(1));
            drop(cuda.export_dmabuf(device, start, len)?);
            start += len;
            slabs += 1;
        }
        Ok(slabs)
    })();
    // SAFETY: frees the allocation made above, once.
    let _ = call("cuMemFree", || unsafe { result::free_sync(ptr) });
    result
}

/// Device memory that another API allocated and CUDA imported (`cuImportExternalMemory` plus
/// `cuExternalMemoryGetMappedBuffer`): the CUDA address of the whole imported object. Dropping it
/// frees the mapping and destroys the external-memory handle; the exporting API's allocation
/// stays the exporter's to free (after this).
pub struct ImportedMemory {
    ext: sys::CUexternalMemory,
    ptr: sys::CUdeviceptr,
    size: u64,
    ctx: sys::CUcontext,
}

// SAFETY: the handles are process-wide driver objects; drop makes their context current first.
unsafe impl Send for ImportedMemory {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for ImportedMemory {}

impl ImportedMemory {
    /// The CUDA device address of the imported object's first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        // SAFETY: both handles were created by import_opaque_fd and are released once, the
        // mapping before the external memory (CUDA's order: "cuMemFree ... then
        // cuDestroyExternalMemory").
        let _ = guard("free imported memory", || unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::memory_free(self.ptr);
            result::external_memory::destroy_external_memory(self.ext)
        });
    }
}

impl Cuda {
    /// The device's UUID (what Vulkan reports as `VkPhysicalDeviceIDProperties::deviceUUID`).
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16]> {
        let dev = call("cuDeviceGet", || result::device::get(ordinal))?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // sys: `result::device::get_uuid` calls only cuDeviceGetUuid under cuda-12080; _v2 is the
        // form that matches Vulkan/NVML on MIG too, so it is tried first.
        // SAFETY: writes 16 bytes into uuid.
        let uuid = check("cuDeviceGetUuid_v2", || unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })
        .map(|()| uuid)
        .or_else(|_| call("cuDeviceGetUuid", || result::device::get_uuid(dev)))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Imports an opaque POSIX fd exported by another API (Vulkan `VK_KHR_external_memory_fd`,
    /// OPAQUE_FD) of `size` bytes on device `ordinal` and maps the whole object. The fd is
    /// consumed: "Ownership of the file descriptor is transferred to the CUDA driver when the
    /// handle is imported successfully"; on failure it is closed here.
    pub fn import_opaque_fd(
        &self,
        ordinal: i32,
        fd: OwnedFd,
        size: u64,
        dedicated: bool,
    ) -> Result<ImportedMemory> {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let d = self.device(ordinal)?;
        // Built field by field: the handle-type enum has no zero value, so a zeroed descriptor
        // would be invalid (Rust aborts on it). The union holds an int or pointers: zero is valid.
        // SAFETY: every member of the union is an integer or a raw pointer.
        let mut handle: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st__bindgen_ty_1 =
            unsafe { std::mem::zeroed() };
        handle.fd = fd.as_raw_fd();
        let desc = sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC {
            type_: sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
            handle,
            size,
            flags: if dedicated {
                sys::CUDA_EXTERNAL_MEMORY_DEDICATED
            } else {
                0
            },
            reserved: [0; 16],
        };
        let mut ext: sys::CUexternalMemory = std::ptr::null_mut();
        // sys: `result::external_memory::import_external_memory_opaque_fd` always passes flags 0,
        // and a dedicated Vulkan allocation needs CUDA_EXTERNAL_MEMORY_DEDICATED.
        // SAFETY: desc is fully initialized; ext receives the handle.
        check("cuImportExternalMemory(OPAQUE_FD)", || unsafe {
            sys::cuImportExternalMemory(&mut ext, &desc)
        })?;
        // The driver owns the fd now.
        let _ = fd.into_raw_fd();
        // The whole object: offset 0, `size` bytes, flags 0.
        // SAFETY: ext was just imported.
        let ptr = match call("cuExternalMemoryGetMappedBuffer", || unsafe {
            result::external_memory::get_mapped_buffer(ext, 0, size)
        }) {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: releases the handle imported above, once; nothing is mapped on it.
                let _ = guard("cuDestroyExternalMemory", || unsafe {
                    result::external_memory::destroy_external_memory(ext)
                });
                return Err(e);
            }
        };
        Ok(ImportedMemory {
            ext,
            ptr,
            size,
            ctx: d.ctx,
        })
    }
}
