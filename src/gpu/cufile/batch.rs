//! cuFile's batch API (`cuFileBatchIO*`): asynchronous submission of many pieces at once,
//! completions polled without blocking. Resolved from the same library as the rest of cuFile;
//! a library without every batch symbol has no batch capability.

use std::ffi::c_void;

use super::status::status_name;
use crate::error::{Error, Result};
use crate::gpu::loader::Library;

/// A registered cuFile file handle, borrowed for as long as the `CuFileHandle` it came from.
#[derive(Clone, Copy)]
pub struct RawHandle<'a>(*mut c_void, std::marker::PhantomData<&'a ()>);

impl RawHandle<'_> {
    pub(super) fn new(handle: *mut c_void) -> Self {
        RawHandle(handle, std::marker::PhantomData)
    }
}

/// `CUfileError_t` (cuFile status, CUDA status), returned by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BatchError {
    pub err: i32,
    pub cu_err: i32,
}

/// `CUfileIOParams_t` in CUFILE_BATCH mode.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IoParams {
    mode: i32,
    buf_base: *mut c_void,
    file_offset: i64,
    buf_offset: i64,
    size: usize,
    fh: *mut c_void,
    opcode: i32,
    cookie: *mut c_void,
}
const _: () = assert!(std::mem::size_of::<IoParams>() == 64);
const _: () = assert!(std::mem::offset_of!(IoParams, buf_base) == 8);
const _: () = assert!(std::mem::offset_of!(IoParams, fh) == 40);
const _: () = assert!(std::mem::offset_of!(IoParams, opcode) == 48);
const _: () = assert!(std::mem::offset_of!(IoParams, cookie) == 56);

/// `CUfileIOEvents_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IoEvent {
    pub cookie: *mut c_void,
    pub status: i32,
    pub ret: usize,
}
const _: () = assert!(std::mem::size_of::<IoEvent>() == 24);
const _: () = assert!(std::mem::offset_of!(IoEvent, ret) == 16);

const CUFILE_BATCH: i32 = 1;
const OPCODE_READ: i32 = 0;
const OPCODE_WRITE: i32 = 1;

/// `CUfileStatus_t` values of an event.
pub const STATUS_COMPLETE: i32 = 0x10;
const STATUS_WAITING: i32 = 0x1;
const STATUS_PENDING: i32 = 0x2;

/// Name of an event status.
pub fn event_status_name(status: i32) -> &'static str {
    match status {
        0x1 => "WAITING",
        0x2 => "PENDING",
        0x4 => "INVALID (ill-formed or could not be enqueued)",
        0x8 => "CANCELED",
        0x10 => "COMPLETE",
        0x20 => "TIMEOUT",
        0x40 => "FAILED",
        _ => "unknown status",
    }
}

/// Whether an event status is final.
pub fn is_final(status: i32) -> bool {
    !matches!(status, STATUS_WAITING | STATUS_PENDING)
}

type SetUp = unsafe extern "C" fn(*mut *mut c_void, u32) -> BatchError;
type Submit = unsafe extern "C" fn(*mut c_void, u32, *mut IoParams, u32) -> BatchError;
type GetStatus = unsafe extern "C" fn(
    *mut c_void,
    u32,
    *mut u32,
    *mut IoEvent,
    *mut libc::timespec,
) -> BatchError;
type Cancel = unsafe extern "C" fn(*mut c_void) -> BatchError;
type Destroy = unsafe extern "C" fn(*mut c_void);

/// The batch entry points.
#[derive(Clone, Copy)]
pub struct BatchFns {
    set_up: SetUp,
    submit: Submit,
    get_status: GetStatus,
    cancel: Cancel,
    destroy: Destroy,
}

impl BatchFns {
    /// Resolves every batch symbol of `library` (each type alias spells its C signature in
    /// cufile.h); None if one is missing.
    pub fn resolve(library: &Library) -> Option<BatchFns> {
        Some(BatchFns {
            set_up: library.optional("cuFileBatchIOSetUp")?,
            submit: library.optional("cuFileBatchIOSubmit")?,
            get_status: library.optional("cuFileBatchIOGetStatus")?,
            cancel: library.optional("cuFileBatchIOCancel")?,
            destroy: library.optional("cuFileBatchIODestroy")?,
        })
    }
}

/// A failed batch call: the message names the call and the cuFile status, which travels as
/// ("cufile", code).
fn batch_error(call: &str, st: BatchError) -> Error {
    Error::backend(format!("{call} failed: {}", status_name(st.err)))
        .with_vendor("cufile", st.err as i64)
}

/// One piece of a batch: its file, registered buffer base, offset into it, file offset, length.
#[derive(Clone, Copy)]
pub struct Piece<'a> {
    pub file: RawHandle<'a>,
    pub base: u64,
    pub buf_offset: u64,
    pub file_offset: u64,
    pub len: u64,
}

/// A submitted batch. Dropping it cancels what is still pending and destroys it.
pub struct Batch {
    fns: BatchFns,
    handle: *mut c_void,
    params: Vec<IoParams>,
    /// Final status and byte count per piece (None: not reported yet).
    pub results: Vec<Option<(i32, usize)>>,
    open: usize,
}

// SAFETY: the batch handle may be polled and destroyed from any thread (cuFile is thread-safe);
// the parameter array is owned here and only read by cuFile during submission.
unsafe impl Send for Batch {}

impl Batch {
    /// Sets up a batch for `pieces` (at most the driver's max_batch_io_size) and submits it.
    pub fn submit(fns: BatchFns, write: bool, pieces: &[Piece<'_>]) -> Result<Batch> {
        let mut handle = std::ptr::null_mut();
        let n = pieces.len() as u32;
        // SAFETY: writes one handle.
        let st = unsafe { (fns.set_up)(&mut handle, n) };
        if st.err != 0 {
            return Err(batch_error(&format!("cuFileBatchIOSetUp({n})"), st));
        }
        let params: Vec<IoParams> = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| IoParams {
                mode: CUFILE_BATCH,
                buf_base: p.base as *mut c_void,
                file_offset: p.file_offset as i64,
                buf_offset: p.buf_offset as i64,
                size: p.len as usize,
                fh: p.file.0,
                opcode: if write { OPCODE_WRITE } else { OPCODE_READ },
                // The cookie is the piece's index (plus one, so it is never null).
                cookie: (i + 1) as *mut c_void,
            })
            .collect();
        let mut batch = Batch {
            fns,
            handle,
            results: vec![None; params.len()],
            open: params.len(),
            params,
        };
        // SAFETY: the parameter array lives in the batch until it is destroyed; the buffers and
        // the file handle are kept alive by the request that owns this batch.
        let st = unsafe { (fns.submit)(batch.handle, n, batch.params.as_mut_ptr(), 0) };
        if st.err != 0 {
            batch.open = 0; // nothing was queued: nothing to cancel
            return Err(batch_error(&format!("cuFileBatchIOSubmit({n} pieces)"), st));
        }
        Ok(batch)
    }

    /// Collects finished pieces without waiting. Returns true once every piece has a result.
    pub fn poll(&mut self) -> Result<bool> {
        if self.open == 0 {
            return Ok(true);
        }
        let mut events = vec![
            IoEvent {
                cookie: std::ptr::null_mut(),
                status: 0,
                ret: 0
            };
            self.open
        ];
        let mut nr = self.open as u32;
        let mut zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: events has room for nr entries; a zero timeout makes the call non-blocking.
        let st = unsafe {
            (self.fns.get_status)(self.handle, 0, &mut nr, events.as_mut_ptr(), &mut zero)
        };
        if st.err != 0 {
            return Err(batch_error("cuFileBatchIOGetStatus", st));
        }
        for e in &events[..(nr as usize).min(events.len())] {
            let i = (e.cookie as usize).wrapping_sub(1);
            if i < self.results.len() && is_final(e.status) && self.results[i].is_none() {
                self.results[i] = Some((e.status, e.ret));
                self.open -= 1;
            }
        }
        Ok(self.open == 0)
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if self.open > 0 {
            // SAFETY: cancelling our own batch; cuFile stops touching the buffers once it returns.
            let _ = unsafe { (self.fns.cancel)(self.handle) };
        }
        // SAFETY: destroying our own batch, once.
        unsafe { (self.fns.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_statuses_are_named_and_classified() {
        assert_eq!(event_status_name(STATUS_COMPLETE), "COMPLETE");
        assert!(event_status_name(0x40).starts_with("FAILED"));
        assert!(!is_final(STATUS_PENDING) && !is_final(STATUS_WAITING));
        assert!(is_final(STATUS_COMPLETE) && is_final(0x8) && is_final(0x40));
    }

    #[test]
    fn a_library_without_the_batch_api_has_no_batch_capability() {
        let libc = Library::open("libc.so.6").expect("libc loads");
        assert!(BatchFns::resolve(&libc).is_none());
    }
}
