//! The Vulkan allocator's C API (declared in include/iud_vulkan.h): the only symbols the plugin
//! exports besides `nixl_plugin_init`/`nixl_plugin_fini`. Applications reach them by loading the
//! same plugin file NIXL loads (dlopen returns the same library, so the allocation registry is
//! shared with the engine).
//!
//! Conventions: 0 on success, a negative `IUD_VK_E*` code on failure, with the message kept for
//! `iud_vulkan_last_error()` on the calling thread; out-parameters are written only on success.
//! No panic crosses the boundary: each body runs under `catch_unwind`.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::{lookup, VulkanProvider};
use crate::error::{Error, ErrorKind, Result};

pub const IUD_VK_OK: c_int = 0;
/// A bad argument (NULL out-pointer, size 0, an address not from iud_vulkan_alloc).
pub const IUD_VK_EINVAL: c_int = -1;
/// No Vulkan loader, driver or suitable device (an absent capability).
pub const IUD_VK_ENOTSUP: c_int = -2;
/// The Vulkan or CUDA driver failed the call (out of memory, import refused, ...).
pub const IUD_VK_EFAIL: c_int = -3;
/// An internal error (a caught panic); please report it.
pub const IUD_VK_EINTERNAL: c_int = -4;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn code_of(e: &Error) -> c_int {
    match e.kind {
        ErrorKind::InvalidParam | ErrorKind::NotFound => IUD_VK_EINVAL,
        ErrorKind::NotSupported => IUD_VK_ENOTSUP,
        _ => IUD_VK_EFAIL,
    }
}

/// Runs `body`, turning its error or panic into a code, the thread's last error and a log line.
fn boundary(what: &str, body: impl FnOnce() -> Result<()>) -> c_int {
    crate::log::init();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            set_last_error("");
            IUD_VK_OK
        }
        Ok(Err(e)) => {
            let msg = if e.message.starts_with(what) { e.message.clone() } else { format!("{what}: {}", e.message) };
            tracing::warn!("{msg}");
            set_last_error(&msg);
            code_of(&e)
        }
        Err(_) => {
            let msg = format!("{what}: internal error (panic); please report this as a bug");
            tracing::error!("{msg}");
            set_last_error(&msg);
            IUD_VK_EINTERNAL
        }
    }
}

/// `int iud_vulkan_alloc(int device, uint64_t size, uint64_t *out_addr)`
///
/// # Safety
/// `out_addr` must be NULL or valid for one `uint64_t` write.
#[no_mangle]
pub unsafe extern "C" fn iud_vulkan_alloc(device: c_int, size: u64, out_addr: *mut u64) -> c_int {
    boundary("iud_vulkan_alloc", || {
        // Arguments first: a bad call is EINVAL on every machine, with or without a driver.
        if out_addr.is_null() {
            return Err(Error::invalid("iud_vulkan_alloc: out_addr is NULL"));
        }
        if size == 0 {
            return Err(Error::invalid("iud_vulkan_alloc: size 0"));
        }
        if device < 0 {
            return Err(Error::invalid(format!("iud_vulkan_alloc: device {device} is negative")));
        }
        let a = VulkanProvider::get()?.allocate(device, size)?;
        // SAFETY: checked non-NULL; the caller guarantees it is writable.
        unsafe { *out_addr = a.addr };
        Ok(())
    })
}

/// `int iud_vulkan_free(uint64_t addr)`: `addr` as returned by iud_vulkan_alloc. Deregister
/// it from NIXL first.
#[no_mangle]
pub extern "C" fn iud_vulkan_free(addr: u64) -> c_int {
    boundary("iud_vulkan_free", || VulkanProvider::free(addr))
}

/// `const char *iud_vulkan_variant(uint64_t addr)`: the variant of the allocation containing
/// `addr` (a static string), or NULL when no allocation contains it.
#[no_mangle]
pub extern "C" fn iud_vulkan_variant(addr: u64) -> *const c_char {
    catch_unwind(|| lookup(addr, 1).map_or(std::ptr::null(), |a| a.variant.c_name().as_ptr())).unwrap_or(std::ptr::null())
}

/// `const char *iud_vulkan_last_error(void)`: why the calling thread's last failed call failed
/// ("" after a success); valid until the thread's next call into this API.
#[no_mangle]
pub extern "C" fn iud_vulkan_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}
