//! The CUDA provider, through cudarc's driver API bindings in dynamic-loading mode.
//!
//! cudarc's loader panics when libcuda or a symbol is missing, so `Cuda::load` first checks that
//! the library can be opened (`is_culib_present`) and every call runs inside `guard`, which turns
//! a panic into an error. Nothing here links against CUDA.
//!
//! Contexts: the primary context of each device is retained once and made current on the calling
//! thread before each call that needs it (NIXL calls the data path from arbitrary threads).

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use once_cell::sync::OnceCell;

use crate::gpu::provider::{CopyPiece, CopyTicket, DeviceRange, DmabufExport, GpuProvider};
use crate::error::{Error, ErrorKind, Result};
use super::cuda_batch as batch;

/// Runs a driver call, turning a loader panic (missing symbol) into an error.
fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Error::backend(format!("CUDA {what}: the driver library lacks this entry point ({msg})"))
    })
}

/// The CUDA error name (e.g. CUDA_ERROR_INVALID_VALUE) of a result code.
fn error_name(code: sys::CUresult) -> String {
    let mut ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let ok = guard("cuGetErrorName", || unsafe { sys::cuGetErrorName(code, &mut ptr) });
    if matches!(ok, Ok(sys::CUresult::CUDA_SUCCESS)) && !ptr.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
    } else {
        format!("CUresult {}", code as i32)
    }
}

/// Calls a driver function and maps a failure to an error naming the call and the CUDA error.
fn check(what: &str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    match guard(what, f)? {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(Error::backend(format!("{what} failed: {}", error_name(code)))),
    }
}

struct Device {
    ctx: sys::CUcontext,
    to_host: sys::CUstream,
    to_device: sys::CUstream,
    /// Recorded on the legacy default stream at each post; our streams wait on it.
    app_done: sys::CUevent,
    /// Copy-completion events of finished tickets, reused: creating and destroying one per
    /// copy costs two driver calls on the hot path of every staged piece.
    spare_events: Mutex<Vec<sys::CUevent>>,
}

/// The loaded CUDA driver.
pub struct Cuda {
    devices: Mutex<HashMap<i32, Arc<Device>>>,
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
                return Err(Error::new(ErrorKind::NotSupported, "libcuda.so.1 could not be loaded (no NVIDIA driver on this machine?)"));
            }
            // SAFETY: plain driver calls writing into locals.
            check("cuInit", || unsafe { sys::cuInit(0) })?;
            let mut count = 0;
            // SAFETY: as above.
            check("cuDeviceGetCount", || unsafe { sys::cuDeviceGetCount(&mut count) })?;
            let mut driver_version = 0;
            // SAFETY: as above.
            check("cuDriverGetVersion", || unsafe { sys::cuDriverGetVersion(&mut driver_version) })?;
            Ok(Arc::new(Cuda { devices: Mutex::new(HashMap::new()), count, driver_version }))
        })
        .clone()
    }

    /// The device's primary context and streams, created on first use and made current.
    fn device(&self, ordinal: i32) -> Result<Arc<Device>> {
        if ordinal < 0 || ordinal >= self.count {
            return Err(Error::invalid(format!("CUDA device {ordinal} does not exist ({} devices visible)", self.count)));
        }
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = devices.get(&ordinal) {
            let d = Arc::clone(d);
            drop(devices);
            // SAFETY: ctx is a retained primary context.
            check("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(d.ctx) })?;
            return Ok(d);
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes into dev.
        check("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes into ctx; the primary context is retained for the process lifetime.
        check("cuDevicePrimaryCtxRetain", || unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        // SAFETY: ctx was just retained.
        check("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(ctx) })?;
        let mut to_host: sys::CUstream = std::ptr::null_mut();
        let mut to_device: sys::CUstream = std::ptr::null_mut();
        // Non-blocking streams: never serialize with the application's legacy default stream.
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: write into the stream handles, with the context current.
        check("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut to_host, flags) })?;
        // SAFETY: as above.
        check("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut to_device, flags) })?;
        let mut app_done: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes into the event handle, with the context current.
        check("cuEventCreate", || unsafe { sys::cuEventCreate(&mut app_done, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
        let d = Arc::new(Device { ctx, to_host, to_device, app_done, spare_events: Mutex::new(Vec::new()) });
        devices.insert(ordinal, Arc::clone(&d));
        Ok(d)
    }

    fn attribute(&self, ordinal: i32, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes into dev.
        check("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut v = 0;
        // SAFETY: writes into v.
        check("cuDeviceGetAttribute", || unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
        Ok(v)
    }

    /// Whether the device can export DMA-BUFs (open kernel module, CUDA 11.7+).
    pub fn dmabuf_supported(&self, ordinal: i32) -> Result<bool> {
        Ok(self.attribute(ordinal, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0)
    }

    pub fn device_name(&self, ordinal: i32) -> Result<String> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes into dev.
        check("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: writes at most 128 bytes including the NUL.
        check("cuDeviceGetName", || unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), 128, dev) })?;
        // SAFETY: NUL-terminated by the driver.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
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
        check("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(self.device.ctx) })?;
        // SAFETY: as above.
        match guard("cuEventQuery", || unsafe { sys::cuEventQuery(self.event) })? {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(Error::backend(format!("asynchronous device copy failed: {}", error_name(code)))),
        }
    }

    fn wait(&self) -> Result<()> {
        // SAFETY: as in is_done.
        check("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(self.device.ctx) })?;
        // SAFETY: as above.
        check("cuEventSynchronize", || unsafe { sys::cuEventSynchronize(self.event) })
    }
}

impl Drop for EventTicket {
    fn drop(&mut self) {
        // Re-recording a spare event replaces its previous capture, so even an event whose copy
        // is still pending (a failing request) is safe to reuse.
        let mut spare = self.device.spare_events.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_EVENTS_MAX {
            spare.push(self.event);
            return;
        }
        drop(spare);
        // SAFETY: the event was created by us and is destroyed once; a pending event may be
        // destroyed (the driver releases it when it completes).
        let _ = guard("cuEventDestroy", || unsafe {
            sys::cuCtxSetCurrent(self.device.ctx);
            sys::cuEventDestroy_v2(self.event)
        });
    }
}

impl Cuda {
    fn record(&self, d: &Arc<Device>, stream: sys::CUstream) -> Result<Box<dyn CopyTicket>> {
        let spare = d.spare_events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let event = match spare {
            Some(e) => e,
            None => {
                let mut event: sys::CUevent = std::ptr::null_mut();
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: writes into event with the device's context current.
                check("cuEventCreate", || unsafe { sys::cuEventCreate(&mut event, flags) })?;
                event
            }
        };
        let ticket = EventTicket { event, device: Arc::clone(d) };
        // SAFETY: event and stream belong to the current context.
        check("cuEventRecord", || unsafe { sys::cuEventRecord(event, stream) })?;
        Ok(Box::new(ticket))
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
        // SAFETY: writes one int; addr is only inspected, not dereferenced.
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", || unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })
        .map_err(|e| Error::invalid(format!("VRAM registration 0x{addr:x}+{len}: not CUDA device memory ({e})")))?;
        if ordinal != device {
            return Err(Error::invalid(format!(
                "VRAM registration 0x{addr:x}+{len}: the memory is on CUDA device {ordinal}, but devId says {device}"
            )));
        }
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: writes into base/size.
        check("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) })?;
        let end = base + size as u64;
        if addr + len > end {
            return Err(Error::invalid(format!(
                "VRAM registration 0x{addr:x}+{len} runs past the end of its CUDA allocation [0x{base:x}, 0x{end:x})"
            )));
        }
        Ok(DeviceRange { alloc_start: base, alloc_end: end })
    }

    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport> {
        self.device(device)?;
        let mut fd: i32 = -1;
        // SAFETY: writes one int (the fd); the range is only described, not accessed.
        check(&format!("cuMemGetHandleForAddressRange(0x{addr:x}+{len}, DMA_BUF_FD)"), || unsafe {
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
            return Err(Error::new(ErrorKind::NotSupported, "no CUDA device to pin host memory for"));
        }
        self.device(0)?;
        // SAFETY: the caller keeps the memory mapped until unpin_host.
        check("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(addr as *mut c_void, len as usize, sys::CU_MEMHOSTREGISTER_PORTABLE)
        })
    }

    fn unpin_host(&self, addr: u64) {
        if self.device(0).is_ok() {
            // SAFETY: addr was registered by pin_host.
            let _ = check("cuMemHostUnregister", || unsafe { sys::cuMemHostUnregister(addr as *mut c_void) });
        }
    }

    unsafe fn copy_to_host(&self, device: i32, host: u64, dev: u64, len: u64) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        // SAFETY: the caller keeps both ranges valid until the ticket completes.
        check("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, dev, len as usize, d.to_host) })?;
        self.record(&d, d.to_host)
    }

    unsafe fn copy_batch(&self, device: i32, pieces: &[CopyPiece], to_host: bool) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        let stream = if to_host { d.to_host } else { d.to_device };
        // SAFETY: the caller keeps every range valid until the ticket completes.
        if !unsafe { batch::copy(device, pieces, to_host, stream) } {
            for p in pieces {
                // SAFETY: as above; one copy per piece on the same stream, one event for all.
                if to_host {
                    check("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(p.host as *mut c_void, p.dev, p.len as usize, stream) })?;
                } else {
                    check("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(p.dev, p.host as *const c_void, p.len as usize, stream) })?;
                }
            }
        }
        self.record(&d, stream)
    }

    unsafe fn copy_to_device(&self, device: i32, dev: u64, host: u64, len: u64) -> Result<Box<dyn CopyTicket>> {
        let d = self.device(device)?;
        // SAFETY: the caller keeps both ranges valid until the ticket completes.
        check("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(dev, host as *const c_void, len as usize, d.to_device) })?;
        self.record(&d, d.to_device)
    }

    fn fence_app_work(&self, device: i32, host_wait: bool) -> Result<()> {
        let d = self.device(device)?;
        // CU_STREAM_LEGACY: the implicit default stream that applications (PyTorch's default
        // stream among them) queue their kernels on.
        let legacy = 0x1 as sys::CUstream;
        // SAFETY: the event and streams belong to the device's context, current after device().
        check("cuEventRecord(default stream)", || unsafe { sys::cuEventRecord(d.app_done, legacy) })?;
        if host_wait {
            // SAFETY: as above.
            return check("cuEventSynchronize", || unsafe { sys::cuEventSynchronize(d.app_done) });
        }
        for stream in [d.to_host, d.to_device] {
            // SAFETY: as above; the wait captures the record just made (or a later one, which
            // also follows the application's earlier work).
            check("cuStreamWaitEvent", || unsafe { sys::cuStreamWaitEvent(stream, d.app_done, 0) })?;
        }
        Ok(())
    }

    fn make_current(&self, device: i32) -> Result<()> {
        self.device(device).map(drop)
    }

    fn describe(&self) -> String {
        let names: Vec<String> = (0..self.count).map(|i| self.device_name(i).unwrap_or_else(|e| e.message)).collect();
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
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: writes the allocation's address into ptr.
    check("cuMemAlloc", || unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) })?;
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
    // SAFETY: frees the allocation made above.
    let _ = check("cuMemFree", || unsafe { sys::cuMemFree_v2(ptr) });
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
            sys::cuCtxSetCurrent(self.ctx);
            sys::cuMemFree_v2(self.ptr);
            sys::cuDestroyExternalMemory(self.ext)
        });
    }
}

impl Cuda {
    /// The device's UUID (what Vulkan reports as `VkPhysicalDeviceIDProperties::deviceUUID`).
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16]> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes into dev.
        check("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: writes 16 bytes into uuid; _v2 is the form that matches Vulkan/NVML on MIG too.
        check("cuDeviceGetUuid_v2", || unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) })
            // SAFETY: as above, the older entry point.
            .or_else(|_| check("cuDeviceGetUuid", || unsafe { sys::cuDeviceGetUuid(&mut uuid, dev) }))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Imports an opaque POSIX fd exported by another API (Vulkan `VK_KHR_external_memory_fd`,
    /// OPAQUE_FD) of `size` bytes on device `ordinal` and maps the whole object. The fd is
    /// consumed: "Ownership of the file descriptor is transferred to the CUDA driver when the
    /// handle is imported successfully"; on failure it is closed here.
    pub fn import_opaque_fd(&self, ordinal: i32, fd: OwnedFd, size: u64, dedicated: bool) -> Result<ImportedMemory> {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let d = self.device(ordinal)?;
        // Built field by field: the handle-type enum has no zero value, so a zeroed descriptor
        // would be invalid (Rust aborts on it). The union holds an int or pointers: zero is valid.
        // SAFETY: every member of the union is an integer or a raw pointer.
        let mut handle: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st__bindgen_ty_1 = unsafe { std::mem::zeroed() };
        handle.fd = fd.as_raw_fd();
        let desc = sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC {
            type_: sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
            handle,
            size,
            flags: if dedicated { sys::CUDA_EXTERNAL_MEMORY_DEDICATED } else { 0 },
            reserved: [0; 16],
        };
        let mut ext: sys::CUexternalMemory = std::ptr::null_mut();
        // SAFETY: desc is fully initialized; ext receives the handle.
        check("cuImportExternalMemory(OPAQUE_FD)", || unsafe { sys::cuImportExternalMemory(&mut ext, &desc) })?;
        // The driver owns the fd now.
        let _ = fd.into_raw_fd();
        let buf = sys::CUDA_EXTERNAL_MEMORY_BUFFER_DESC { offset: 0, size, flags: 0, reserved: [0; 16] };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: ext was just imported; ptr receives the mapping.
        if let Err(e) = check("cuExternalMemoryGetMappedBuffer", || unsafe { sys::cuExternalMemoryGetMappedBuffer(&mut ptr, ext, &buf) }) {
            // SAFETY: releases the handle imported above.
            let _ = guard("cuDestroyExternalMemory", || unsafe { sys::cuDestroyExternalMemory(ext) });
            return Err(e);
        }
        Ok(ImportedMemory { ext, ptr, size, ctx: d.ctx })
    }
}
