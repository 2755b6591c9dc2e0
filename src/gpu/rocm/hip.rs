//! HIP's view of devices and pointers (`--features rocm`, through hip-runtime-sys, which links
//! libamdhip64 and needs ROCm's headers to build).
//!
//! HIP numbers devices the way applications do (PyTorch's `cuda:N` on ROCm, HIP_VISIBLE_DEVICES
//! applied), so with this feature a registration's devId is checked against HIP's ordinal as well
//! as against the HSA agent that owns the allocation.
//!
//! hip-runtime-sys 0.1.2 carries bindings generated from HIP 5.4 whose enums are Rust enums.
//! HIP 6 renumbered `hipMemoryType` (Device 1 -> 2) and may return error codes that the 5.4 enum
//! lacks; reading such a value into a Rust enum is undefined behaviour. So the crate's functions
//! are called through pointers whose C-compatible types read plain integers (same ABI: the enums
//! are `repr(u32)`), and the memory type is interpreted by the runtime's major version.

use std::ffi::{c_int, c_uint, c_void};

use hip_runtime_sys as hip;

use crate::error::{Error, Result};

/// `hipPointerAttribute_t` (HIP 5: `memoryType`, HIP 6: `type`; same layout).
#[repr(C)]
struct PointerAttributes {
    memory_type: u32,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    is_managed: c_int,
    allocation_flags: c_uint,
}
const _: () = assert!(
    std::mem::size_of::<PointerAttributes>() == std::mem::size_of::<hip::hipPointerAttribute_t>()
);

type IntOutFn = unsafe extern "C" fn(*mut c_int) -> u32;
type PointerFn = unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> u32;

fn count_fn() -> IntOutFn {
    let f: unsafe extern "C" fn(*mut c_int) -> hip::hipError_t = hip::hipGetDeviceCount;
    // SAFETY: same C signature; hipError_t is repr(u32), read here as the plain u32 it is.
    unsafe {
        std::mem::transmute::<unsafe extern "C" fn(*mut c_int) -> hip::hipError_t, IntOutFn>(f)
    }
}

fn version_fn() -> IntOutFn {
    let f: unsafe extern "C" fn(*mut c_int) -> hip::hipError_t = hip::hipRuntimeGetVersion;
    // SAFETY: as in count_fn.
    unsafe {
        std::mem::transmute::<unsafe extern "C" fn(*mut c_int) -> hip::hipError_t, IntOutFn>(f)
    }
}

fn pointer_fn() -> PointerFn {
    let f: unsafe extern "C" fn(*mut hip::hipPointerAttribute_t, *const c_void) -> hip::hipError_t =
        hip::hipPointerGetAttributes;
    // SAFETY: PointerAttributes has the layout of hipPointerAttribute_t (asserted above) with the
    // enum read as u32; the return value as in count_fn.
    unsafe {
        std::mem::transmute::<
            unsafe extern "C" fn(*mut hip::hipPointerAttribute_t, *const c_void) -> hip::hipError_t,
            PointerFn,
        >(f)
    }
}

/// What HIP reported when the provider was loaded.
pub struct HipView {
    /// Device count, or the hipError_t number of the failed call.
    count: std::result::Result<i32, u32>,
    /// `hipRuntimeGetVersion` (major * 10^7 + minor * 10^5 + patch), 0 if it failed.
    version: i32,
}

impl HipView {
    pub fn query() -> HipView {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let version = if unsafe { version_fn()(&mut v) } == 0 {
            v
        } else {
            0
        };
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let count = match unsafe { count_fn()(&mut n) } {
            0 => Ok(n),
            e => Err(e),
        };
        HipView { count, version }
    }

    pub fn describe(&self) -> String {
        let v = format!(
            "runtime {}.{}",
            self.version / 10_000_000,
            (self.version / 100_000) % 100
        );
        match self.count {
            Ok(n) => format!("{v}, {n} device(s)"),
            Err(100) => format!("{v}, hipGetDeviceCount: hipErrorNoDevice (100)"),
            Err(e) => format!("{v}, hipGetDeviceCount failed: hipError_t {e}"),
        }
    }

    /// HIP's `hipMemoryTypeDevice` for this runtime (HIP 6 renumbered the enum).
    fn device_type(&self) -> u32 {
        if self.version >= 60_000_000 {
            2
        } else {
            1
        }
    }

    /// Fails unless HIP says `addr` is device memory of HIP device `device`. Where HIP sees no
    /// device at all (no GPU, or HIP_VISIBLE_DEVICES hides them while HSA still lists agents,
    /// or a test runtime such as tests/rocm_double), HIP cannot vouch for any pointer and the
    /// HSA agent check alone decides.
    pub fn check_pointer(&self, addr: u64, device: i32) -> Result<()> {
        if !matches!(self.count, Ok(n) if n > 0) {
            return Ok(());
        }
        let mut a = PointerAttributes {
            memory_type: 0,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: `a` is a valid out-struct; `addr` is only looked up.
        let e = unsafe { pointer_fn()(&mut a, addr as *const c_void) };
        if e != 0 {
            return Err(
                Error::invalid(format!("hipPointerGetAttributes failed: hipError_t {e}"))
                    .with_vendor("hip", e as i64),
            );
        }
        if a.memory_type != self.device_type() {
            return Err(Error::invalid(format!(
                "HIP says this is not device memory (hipMemoryType {})",
                a.memory_type
            )));
        }
        if a.device != device {
            return Err(Error::invalid(format!(
                "the memory is on HIP device {}, but devId says {device}",
                a.device
            )));
        }
        Ok(())
    }
}
