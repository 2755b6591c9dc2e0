//! The Vulkan allocator's C API (declared in include/iud_vulkan.h): the only symbols the plugin
//! exports besides `nixl_plugin_init`/`nixl_plugin_fini`. Applications reach them by loading the
//! same plugin file NIXL loads (dlopen returns the same library, so the allocation registry is
//! shared with the engine).
//!
//! Conventions: 0 on success, a negative `IUD_VK_E*` code on failure, with the message kept for
//! `iud_vulkan_last_error()` on the calling thread; out-parameters are written only on success.
//! No panic crosses the boundary: each body runs under `catch_unwind`.
//!
//! This file is only the C side; the allocator itself is `gpu::vulkan` (`VulkanProvider`,
//! `lookup`), which `ffi/` calls like any Rust API so that `ffi/` holds every `extern "C"`.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, ErrorKind, Result};
use crate::gpu::vulkan::{lookup, VulkanProvider};

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
            let msg = if e.message.starts_with(what) {
                e.message.clone()
            } else {
                format!("{what}: {}", e.message)
            };
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
            return Err(Error::invalid(format!(
                "iud_vulkan_alloc: device {device} is negative"
            )));
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
    catch_unwind(|| lookup(addr, 1).map_or(std::ptr::null(), |a| a.variant.c_name().as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// `const char *iud_vulkan_last_error(void)`: why the calling thread's last failed call failed
/// ("" after a success); valid until the thread's next call into this API.
#[no_mangle]
pub extern "C" fn iud_vulkan_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;
    use crate::test_support::skip;

    fn last_error() -> String {
        // SAFETY: the API returns a NUL-terminated thread-local string.
        unsafe { CStr::from_ptr(iud_vulkan_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn c_api_refuses_a_null_out_pointer_with_a_message() {
        // SAFETY: NULL is allowed and refused.
        let rc = unsafe { iud_vulkan_alloc(0, 4096, std::ptr::null_mut()) };
        assert_eq!(rc, IUD_VK_EINVAL);
        let msg = last_error();
        assert!(msg.contains("out_addr is NULL"), "{msg}");
    }

    #[test]
    fn c_api_checks_size_and_device_before_looking_for_a_driver() {
        // With or without libvulkan.so.1 and a driver: EINVAL, and the out-parameter untouched.
        for (device, size, what) in [(0, 0, "size 0"), (-1, 4096, "negative")] {
            let mut addr = 0u64;
            // SAFETY: addr is a valid out-pointer.
            let rc = unsafe { iud_vulkan_alloc(device, size, &mut addr) };
            assert_eq!(rc, IUD_VK_EINVAL, "{what}");
            assert_eq!(addr, 0);
            let msg = last_error();
            assert!(msg.contains(what), "{msg}");
        }
    }

    #[test]
    fn c_api_refuses_to_free_an_unknown_address_and_knows_no_variant_for_it() {
        assert_eq!(iud_vulkan_free(0x1234_5000), IUD_VK_EINVAL);
        assert!(iud_vulkan_variant(0x1234_5000).is_null());
    }

    /// Where a Vulkan driver is installed: alloc, variant and free through the C API.
    #[test]
    fn c_api_allocates_names_the_variant_and_frees_where_a_driver_exists() {
        let p = match VulkanProvider::get() {
            Ok(p) => p,
            Err(e) => return skip(&e.message),
        };
        let (variant, _) = match p.plan_for(0) {
            Ok(v) => v,
            Err(e) => return skip(&e.message),
        };
        let mut addr = 0u64;
        // SAFETY: addr is a valid out-pointer.
        let rc = unsafe { iud_vulkan_alloc(0, 3 * 4096 + 100, &mut addr) };
        assert_eq!(rc, IUD_VK_OK, "{}", last_error());
        assert_eq!(last_error(), "");
        // SAFETY: the variant string is static.
        let name = unsafe { CStr::from_ptr(iud_vulkan_variant(addr + 5000)) }
            .to_str()
            .unwrap();
        assert_eq!(name, variant.name());
        assert_eq!(iud_vulkan_free(addr), IUD_VK_OK);
        assert!(lookup(addr, 1).is_none());
        assert_eq!(
            iud_vulkan_free(addr),
            IUD_VK_EINVAL,
            "a second free is refused"
        );
    }
}
