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

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use once_cell::sync::OnceCell;

mod batch;
pub mod import;
mod lanes;
mod packed;
mod provider;
mod scatter;
mod ticket;

use lanes::CopyLanes;
use scatter::Scatter;

use crate::error::{panic_message, Error, ErrorKind, Result};
use crate::gpu::provider::GpuProvider;

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
