//! The opaque handles NIXL holds for the plugin, and the one place that turns them back into Rust
//! values: every pointer the shim hands in is null-checked here and becomes a typed reference or
//! an error status, instead of a cast at each call.
//!
//! Handles and their ownership:
//! - engine: a `Box<Engine>` ([`Handle`]), made by `engine_create`, freed by `engine_destroy`;
//! - request: a `Box<Request>` ([`Handle`]), made by `prep_xfer`, freed by a successful
//!   `release_req` (after a failed one NIXL keeps it, so the box is handed back);
//! - MD: an `Arc<Registration>` made by `Engine::register`. `ffi/` never dereferences an MD: it
//!   passes it on, and the engine looks it up among its live MDs first (`mem::live`), because
//!   NIXL can hand back an MD that was deregistered already (DESIGN.md: unloadMD never
//!   dereferences its argument).
//!
//! Shim-owned arguments (config, descriptor lists, out-pointers) go through [`arg`] and
//! [`write_out`], which check them for null the same way.

use std::ffi::c_void;

use crate::engine::{Engine, Request};
use crate::error::{Error, Result};

/// A Rust value NIXL holds as an opaque pointer it got from a `Box`.
///
/// Only this trait turns such pointers into Box or reference, so a pointer is read back as the
/// type it was made from: an engine handle cannot be read as a request (each call site names the
/// type it expects, and the shim passes each handle only where its C++ class keeps it).
pub trait Handle: Sized {
    /// What the handle is, for the error on a null pointer.
    const NAME: &'static str;

    /// Hands ownership to NIXL as an opaque pointer.
    fn into_raw(value: Box<Self>) -> *mut c_void {
        Box::into_raw(value).cast()
    }

    /// The value behind a handle, borrowed for the call.
    ///
    /// # Safety
    /// `p` must be null or a pointer from [`Handle::into_raw`] of this type that was not
    /// taken back, and stay so for `'a`.
    unsafe fn try_ref<'a>(p: *const c_void) -> Result<&'a Self> {
        if p.is_null() {
            return Err(null(Self::NAME));
        }
        // SAFETY: non-null, and per the contract it points at a live `Self` made by `into_raw`;
        // NIXL does not free or take it back during the call, so a shared borrow is valid.
        Ok(unsafe { &*p.cast::<Self>() })
    }

    /// Takes ownership back from NIXL.
    ///
    /// # Safety
    /// `p` must be null or a pointer from [`Handle::into_raw`] of this type, taken back at most
    /// once (a box handed out again with `into_raw` may be taken again).
    unsafe fn try_take(p: *mut c_void) -> Result<Box<Self>> {
        if p.is_null() {
            return Err(null(Self::NAME));
        }
        // SAFETY: per the contract the pointer came from Box::into_raw of a `Self` and nothing
        // else owns it now.
        Ok(unsafe { Box::from_raw(p.cast::<Self>()) })
    }
}

impl Handle for Engine {
    const NAME: &'static str = "engine handle";
}

impl Handle for Request {
    const NAME: &'static str = "request handle";
}

fn null(what: &str) -> Error {
    Error::invalid(format!("{what} is NULL"))
}

/// A shim-owned argument (a config, a descriptor list), borrowed for the call.
///
/// # Safety
/// `p` must be null or point at a valid `T` for the duration of the call.
pub unsafe fn arg<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: per the contract, a non-null `p` is valid for the call.
    unsafe { p.as_ref() }.ok_or_else(|| null(what))
}

/// Refuses a null out-pointer before the work whose result it is to receive.
pub fn check_out<T>(out: *mut T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(null(what));
    }
    Ok(())
}

/// Writes a result through an out-pointer (only on success, as the shim expects).
///
/// # Safety
/// `out` must be null or valid for one write of `T`.
pub unsafe fn write_out<T>(out: *mut T, value: T, what: &str) -> Result<()> {
    check_out(out, what)?;
    // SAFETY: non-null and, per the contract, valid for one write.
    unsafe { out.write(value) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::status;

    #[test]
    fn null_handles_and_arguments_are_invalid_params_naming_what_was_null() {
        // SAFETY: null is allowed and refused by every one of these.
        unsafe {
            let e = Engine::try_ref(std::ptr::null()).err().unwrap();
            assert_eq!(
                (e.to_status(), e.message.as_str()),
                (status::ERR_INVALID_PARAM, "engine handle is NULL")
            );
            let e = Request::try_take(std::ptr::null_mut()).err().unwrap();
            assert_eq!(e.message, "request handle is NULL");
            assert_eq!(
                arg::<u32>(std::ptr::null(), "config").unwrap_err().message,
                "config is NULL"
            );
            assert!(write_out::<u32>(std::ptr::null_mut(), 1, "md_out").is_err());
        }
    }

    #[test]
    fn a_handle_reads_back_as_the_value_it_was_made_from() {
        let engine = Engine::new("agent", std::iter::empty()).expect("engine");
        let p = Engine::into_raw(Box::new(engine));
        // SAFETY: p came from into_raw and is taken back once, after the borrow ends.
        unsafe {
            assert!(Engine::try_ref(p).is_ok());
            drop(Engine::try_take(p).unwrap());
        }
        let mut out = 0u64;
        // SAFETY: out is a valid out-pointer.
        unsafe { write_out(&mut out, 7, "out") }.unwrap();
        assert_eq!(out, 7);
    }
}
