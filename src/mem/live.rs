//! The MDs of one engine that NIXL still holds: every MD that NIXL hands back is looked up here
//! before the plugin dereferences it.
//!
//! Why: NIXL passes MDs out of its own registration lists, and with an agent in sync mode NONE
//! (the Python default without a listen thread) those lists are not locked (nixl
//! src/core/sync.h). Threads that register and deregister at once can then leave a list holding
//! the MD of a registration that is already deregistered (issue 16, bench/results/). Taking a
//! reference through such a pointer would write into freed memory; looking it up here turns it
//! into one error instead.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use super::Registration;

/// Hands a registration to NIXL as its MD: NIXL's reference is the `Arc`'s count of one. The
/// three functions below are the only casts between MDs and registrations.
pub fn into_md(reg: Arc<Registration>) -> *const c_void {
    Arc::into_raw(reg).cast()
}

/// Takes NIXL's reference back (deregistration).
///
/// # Safety
/// `md` must come from [`into_md`] and NIXL's reference must not have been taken back yet.
pub unsafe fn take_md(md: *const c_void) -> Arc<Registration> {
    // SAFETY: per the contract, md came from Arc::into_raw and its reference is still counted.
    unsafe { Arc::from_raw(md.cast::<Registration>()) }
}

/// A reference of our own on the registration behind `md`, NIXL's left in place; None for null.
///
/// # Safety
/// `md` must be null or come from [`into_md`] with NIXL's reference still counted for the call.
pub unsafe fn share_md(md: *const c_void) -> Option<Arc<Registration>> {
    if md.is_null() {
        return None;
    }
    let ptr = md.cast::<Registration>();
    // SAFETY: per the contract ptr came from Arc::into_raw and is still counted by NIXL's
    // reference; we add one for ourselves before rebuilding an Arc.
    unsafe {
        Arc::increment_strong_count(ptr);
        Some(Arc::from_raw(ptr))
    }
}

/// The set of MD pointers handed to NIXL by `register` and not yet taken back by `deregister`.
#[derive(Debug, Default)]
pub struct LiveMds(Mutex<HashSet<usize>>);

impl LiveMds {
    fn set(&self) -> MutexGuard<'_, HashSet<usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, md: *const c_void) {
        self.set().insert(md as usize);
    }

    /// Takes `md` out of the set; false when it was not in it (deregistered before, or never
    /// returned by this engine).
    pub fn remove(&self, md: *const c_void) -> bool {
        self.set().remove(&(md as usize))
    }

    /// A reference on the registration behind each distinct non-null MD of `mds`, taken under
    /// the set's lock so that no deregistration frees one in between; while they are held, the
    /// planner may turn the same pointers into registrations. `Err((i, md))`: the i-th MD is
    /// not live.
    pub fn hold(&self, mds: impl Iterator<Item = *const c_void>) -> Result<Vec<Arc<Registration>>, (usize, *const c_void)> {
        // Distinct MDs first, outside the lock: lists repeat one or a few MDs.
        let mut distinct: Vec<(usize, usize)> = Vec::new();
        let mut seen = HashSet::new();
        for (i, md) in mds.enumerate() {
            let key = md as usize;
            if key != 0 && distinct.last().map_or(true, |&(k, _)| k != key) && seen.insert(key) {
                distinct.push((key, i));
            }
        }
        let set = self.set();
        let mut held = Vec::with_capacity(distinct.len());
        for (key, i) in distinct {
            if !set.contains(&key) {
                return Err((i, key as *const c_void));
            }
            // SAFETY: `key` is in the set, so it came from into_md in Engine::register and
            // NIXL's reference is still counted (deregistration removes it under this lock
            // before dropping that reference).
            held.extend(unsafe { share_md(key as *const c_void) });
        }
        Ok(held)
    }
}
