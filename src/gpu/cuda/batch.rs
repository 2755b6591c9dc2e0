//! CUDA's batched asynchronous copy (cuMemcpyBatchAsync, driver API of CUDA >= 12.8): many
//! scattered pieces in one call, resolved once per process, with the fallback decision logged once.
//!
//! cudarc 0.19 binds the entry point (feature cuda-12080: the 12.8 signature with `failIdx`;
//! features cuda-13xxx: `cuMemcpyBatchAsync_v2` without it) but its loader panics on a missing
//! symbol, so both names are looked up here through cudarc's library handle (`sys::culib`) and
//! called with local signatures (`sys`, not `result`: cudarc's `result` layer has no batched
//! copy). Layouts from CUDA 12.8's cuda.h (CUmemcpyAttributes: access order, source and
//! destination location hints, flags; 24 bytes).

use once_cell::sync::OnceCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use crate::gpu::provider::CopyPiece;

#[repr(C)]
#[derive(Clone, Copy)]
struct Location {
    kind: u32,
    id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Attributes {
    src_access_order: u32,
    src_loc_hint: Location,
    dst_loc_hint: Location,
    flags: u32,
}

/// CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order.
const ACCESS_ORDER_STREAM: u32 = 1;
/// CU_MEM_LOCATION_TYPE_DEVICE / CU_MEM_LOCATION_TYPE_HOST.
const LOC_DEVICE: u32 = 1;
const LOC_HOST: u32 = 2;

type V1 = unsafe extern "C" fn(
    *mut u64,
    *mut u64,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;
type V2 = unsafe extern "C" fn(
    *mut u64,
    *mut u64,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum Entry {
    V1(V1),
    V2(V2),
}

/// Set when a batched call failed once: every later batch uses per-piece copies.
static DISABLED: AtomicBool = AtomicBool::new(false);
static LOGGED: AtomicBool = AtomicBool::new(false);

fn entry() -> Option<Entry> {
    static ENTRY: OnceCell<Option<Entry>> = OnceCell::new();
    *ENTRY.get_or_init(|| {
        let found = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: culib() opens the driver library Cuda::load already found; the symbols are
            // looked up with the signatures of cuda.h 12.8 (V1) and 13.0 (V2).
            let lib = unsafe { sys::culib() };
            // SAFETY: as above.
            if let Ok(f) = unsafe { lib.get::<V2>(b"cuMemcpyBatchAsync_v2\0") } {
                return Some(Entry::V2(*f));
            }
            // SAFETY: as above.
            unsafe { lib.get::<V1>(b"cuMemcpyBatchAsync\0") }
                .ok()
                .map(|f| Entry::V1(*f))
        }))
        .ok()
        .flatten();
        if found.is_none() {
            log_once(
                "per-piece cuMemcpy*Async (the driver has no cuMemcpyBatchAsync; CUDA < 12.8)",
            );
        }
        found
    })
}

fn log_once(what: &str) {
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!("staging copies of packed pieces use {what}");
    }
}

/// Queues the pieces' copies on `stream` with one batched call. False when the caller must copy
/// piece by piece (no entry point, or the driver refused a batch once: CUDA_ERROR_NOT_SUPPORTED or
/// any other error, logged once; nothing of a refused batch is assumed to have run).
///
/// # Safety
/// The ranges must stay valid until the stream passed them; the device's context is current.
pub unsafe fn copy(
    device: i32,
    pieces: &[CopyPiece],
    to_host: bool,
    stream: sys::CUstream,
) -> bool {
    if pieces.len() < 2 || DISABLED.load(Ordering::Relaxed) {
        return false;
    }
    let Some(entry) = entry() else { return false };
    let (mut dsts, mut srcs, mut sizes): (Vec<u64>, Vec<u64>, Vec<usize>) = pieces
        .iter()
        .map(|p| {
            if to_host {
                (p.host, p.dev, p.len as usize)
            } else {
                (p.dev, p.host, p.len as usize)
            }
        })
        .fold((Vec::new(), Vec::new(), Vec::new()), |mut v, (d, s, n)| {
            v.0.push(d);
            v.1.push(s);
            v.2.push(n);
            v
        });
    let dev = Location {
        kind: LOC_DEVICE,
        id: device,
    };
    let host = Location {
        kind: LOC_HOST,
        id: 0,
    };
    let (src_loc_hint, dst_loc_hint) = if to_host { (dev, host) } else { (host, dev) };
    let mut attrs = Attributes {
        src_access_order: ACCESS_ORDER_STREAM,
        src_loc_hint,
        dst_loc_hint,
        flags: 0,
    };
    let mut attr_idx: usize = 0;
    let mut fail_idx: usize = usize::MAX;
    let n = pieces.len();
    // SAFETY: arrays of `n` entries, one attribute applying from index 0; the caller keeps the
    // ranges valid and the context current.
    let rc = unsafe {
        match entry {
            Entry::V2(f) => f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                n,
                &mut attrs,
                &mut attr_idx,
                1,
                stream,
            ),
            Entry::V1(f) => f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                n,
                &mut attrs,
                &mut attr_idx,
                1,
                &mut fail_idx,
                stream,
            ),
        }
    };
    if rc == sys::CUresult::CUDA_SUCCESS {
        log_once(match entry {
            Entry::V2(_) => "cuMemcpyBatchAsync_v2 (one call per staging buffer)",
            Entry::V1(_) => "cuMemcpyBatchAsync (one call per staging buffer)",
        });
        return true;
    }
    DISABLED.store(true, Ordering::Relaxed);
    tracing::info!(
        "cuMemcpyBatchAsync returned {:?} (failIdx {}); staging copies of packed pieces use \
         per-piece cuMemcpy*Async from now on",
        rc,
        if fail_idx == usize::MAX {
            "-".to_string()
        } else {
            fail_idx.to_string()
        }
    );
    LOGGED.store(true, Ordering::Relaxed);
    false
}
