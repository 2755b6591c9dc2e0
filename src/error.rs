//! The one error type of the engine and its one mapping to `nixl_status_t`.
//!
//! Every error carries a complete, human-readable cause (descriptor index, fd, offset, errno,
//! what to do). The FFI boundary logs it exactly once when it turns it into a status.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use once_cell::sync::OnceCell;

/// NIXL status numbers (`nixl_status_t`), taken from the bridge's `iud_status` (bindgen), which
/// `src/ffi/shim/engine.cpp` static_asserts against nixl-headers/nixl_abi.h: a drift fails the build.
#[allow(
    clippy::unnecessary_cast,
    reason = "bindgen gives the C enum's constants the integer type it picks for the enum (i32 or \
              u32, by platform and values); the cast pins nixl_status_t's i32 either way"
)]
pub mod status {
    use crate::ffi::bridge as b;
    pub const IN_PROG: i32 = b::iud_status_IUD_IN_PROG as i32;
    pub const SUCCESS: i32 = b::iud_status_IUD_SUCCESS as i32;
    pub const ERR_INVALID_PARAM: i32 = b::iud_status_IUD_ERR_INVALID_PARAM as i32;
    pub const ERR_BACKEND: i32 = b::iud_status_IUD_ERR_BACKEND as i32;
    pub const ERR_NOT_FOUND: i32 = b::iud_status_IUD_ERR_NOT_FOUND as i32;
    pub const ERR_MISMATCH: i32 = b::iud_status_IUD_ERR_MISMATCH as i32;
    pub const ERR_NOT_ALLOWED: i32 = b::iud_status_IUD_ERR_NOT_ALLOWED as i32;
    pub const ERR_REPOST_ACTIVE: i32 = b::iud_status_IUD_ERR_REPOST_ACTIVE as i32;
    pub const ERR_NOT_SUPPORTED: i32 = b::iud_status_IUD_ERR_NOT_SUPPORTED as i32;
    pub const ERR_CANCELED: i32 = b::iud_status_IUD_ERR_CANCELED as i32;
}

/// What went wrong, at the granularity NIXL's status codes can express.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller passed something malformed (list types, lengths, alignment, params).
    InvalidParam,
    /// A descriptor is not covered by a registration of this engine.
    NotFound,
    /// The request does not fit what the engine or kernel can do.
    NotSupported,
    /// Lists of a request disagree with each other or with what was prepared.
    Mismatch,
    /// The request is still in flight.
    RepostActive,
    /// The operation is not allowed in the current state (e.g. a fd that changed under a
    /// registration).
    NotAllowed,
    /// The kernel or a device failed the I/O, or the engine failed internally.
    Backend,
    /// The request was aborted by releaseReqH.
    Canceled,
}

/// An engine error: a kind, the full message for the log line, the structured context a caller
/// or test can inspect without parsing text, and the lower-level error that caused it.
#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
    pub context: Context,
    /// The lower-level error (an OS error, a vendor error), shared so `Error` stays `Clone`.
    pub source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

/// Where an error happened, as far as the code that raised it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    /// Index of the descriptor in the request's (or registration's) list.
    pub descriptor: Option<usize>,
    pub fd: Option<i32>,
    pub offset: Option<u64>,
    pub errno: Option<i32>,
    /// A vendor library's status: (library, status code), e.g. ("cuda", 700).
    pub vendor: Option<(&'static str, i64)>,
}

impl PartialEq for Error {
    /// Errors compare by what they say; the source is the cause of the message, not a second value.
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message && self.context == other.context
    }
}
impl Eq for Error {}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            context: Context::default(),
            source: None,
        }
    }
    pub fn with_descriptor(mut self, index: usize) -> Self {
        self.context.descriptor = Some(index);
        self
    }
    pub fn with_fd(mut self, fd: i32) -> Self {
        self.context.fd = Some(fd);
        self
    }
    pub fn with_offset(mut self, offset: u64) -> Self {
        self.context.offset = Some(offset);
        self
    }
    pub fn with_errno(mut self, errno: i32) -> Self {
        self.context.errno = Some(errno);
        self
    }
    pub fn with_vendor(mut self, library: &'static str, status: i64) -> Self {
        self.context.vendor = Some((library, status));
        self
    }
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }
    /// This error, caused by `inner`: `inner` becomes the source, and the context fields this
    /// error does not know yet are taken from it (a path's refusal keeps the fd and errno of
    /// the call that failed underneath).
    pub fn caused_by(mut self, inner: Error) -> Self {
        let (mine, theirs) = (&mut self.context, &inner.context);
        mine.descriptor = mine.descriptor.or(theirs.descriptor);
        mine.fd = mine.fd.or(theirs.fd);
        mine.offset = mine.offset.or(theirs.offset);
        mine.errno = mine.errno.or(theirs.errno);
        mine.vendor = mine.vendor.or(theirs.vendor);
        self.source = Some(Arc::new(inner));
        self
    }
    /// Sets the descriptor index unless a lower layer set it already.
    pub fn at_descriptor(mut self, index: usize) -> Self {
        self.context.descriptor.get_or_insert(index);
        self
    }
    pub fn not_supported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotSupported, message)
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidParam, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    pub fn backend(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Backend, message)
    }
    /// A failed system call: the message names the call's context and the errno.
    pub fn os(context: impl fmt::Display, err: &io::Error) -> Self {
        let e = Self::backend(format!("{context}: {}", describe_os_error(err)));
        let e = match err.raw_os_error() {
            Some(code) => e.with_errno(code),
            None => e,
        };
        e.with_source(io::Error::new(err.kind(), err.to_string()))
    }

    /// The one mapping from engine errors to NIXL status numbers.
    pub fn to_status(&self) -> i32 {
        match self.kind {
            ErrorKind::InvalidParam => status::ERR_INVALID_PARAM,
            ErrorKind::NotFound => status::ERR_NOT_FOUND,
            ErrorKind::NotSupported => status::ERR_NOT_SUPPORTED,
            ErrorKind::Mismatch => status::ERR_MISMATCH,
            ErrorKind::RepostActive => status::ERR_REPOST_ACTIVE,
            ErrorKind::NotAllowed => status::ERR_NOT_ALLOWED,
            ErrorKind::Backend => status::ERR_BACKEND,
            ErrorKind::Canceled => status::ERR_CANCELED,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// An engine's failed state. A lock found poisoned (a thread panicked while holding it) sets it;
/// from then on every engine call answers an error naming the cause instead of panicking or
/// carrying on with state a panic left half-updated.
#[derive(Debug, Default)]
pub struct Failure {
    failed: AtomicBool,
    cause: OnceCell<String>,
}

impl Failure {
    /// Err once the engine has failed; checked at the top of every engine entry point.
    pub fn check(&self) -> Result<()> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let cause = self.cause.get().map_or("unknown cause", String::as_str);
        Err(Error::backend(format!(
            "the engine failed earlier and answers every call with an error: {cause}"
        )))
    }

    /// Locks `m`; a poisoned lock marks the engine failed and becomes an error naming `what`.
    pub fn lock<'a, T>(&self, m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
        m.lock().map_err(|_| {
            let cause = self.mark(what);
            Error::backend(format!(
                "{cause}; the engine is now failed and answers every call with an error"
            ))
        })
    }

    /// Locks `m` where no error can be returned (teardown, worker threads, `Drop`): a poisoned
    /// lock marks the engine failed as [`Failure::lock`] does, is logged once, and its value is
    /// used as it is, since leaving it (a slot not unregistered, a result not delivered) would
    /// be worse than state a panic may have left half-updated. The engine's next call fails.
    pub fn lock_or_recover<'a, T>(&self, m: &'a Mutex<T>, what: &str) -> MutexGuard<'a, T> {
        m.lock().unwrap_or_else(|poisoned| {
            let first = !self.failed.load(Ordering::Acquire);
            let cause = self.mark(what);
            if first {
                tracing::error!(
                    "{cause}; the engine is now failed; teardown goes on with the lock's value"
                );
            }
            poisoned.into_inner()
        })
    }

    /// Marks the engine failed by the poisoned lock `what` (the first cause is kept).
    fn mark(&self, what: &str) -> String {
        let cause =
            format!("internal lock {what} is poisoned (a thread panicked while holding it)");
        let _ = self.cause.set(cause.clone());
        self.failed.store(true, Ordering::Release);
        cause
    }
}

/// Poisons `m` by panicking in a thread while holding it (for tests of the failed state).
#[cfg(test)]
pub fn poison<T: Send>(m: &Mutex<T>) {
    std::thread::scope(|s| {
        let _ = s
            .spawn(|| {
                let _g = m.lock().unwrap();
                panic!("panic while holding the lock (on purpose)");
            })
            .join();
    });
}

/// The text a panic carried (`panic!` with a literal or a formatted message), if any.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
}

/// "EIO (Input/output error)" style text for an OS error.
pub fn describe_os_error(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(code) => {
            // std's text ends in " (os error N)"; the symbolic name says that already.
            let text = io::Error::from_raw_os_error(code).to_string();
            let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
            format!("{} ({text})", errno_name(code))
        }
        None => err.to_string(),
    }
}

/// The symbolic name of the errno values the engine meets; the number for the rest.
pub fn errno_name(code: i32) -> String {
    let name = match code {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EMFILE => "EMFILE",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ECANCELED => "ECANCELED",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EDQUOT => "EDQUOT",
        _ => return format!("errno {code}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panics_text_is_read_whether_literal_or_formatted() {
        let caught = |f: fn()| std::panic::catch_unwind(f).expect_err("it panics");
        assert_eq!(
            panic_message(&*caught(|| panic!("literal"))).as_deref(),
            Some("literal")
        );
        assert_eq!(
            panic_message(&*caught(|| panic!("formatted {}", 7))).as_deref(),
            Some("formatted 7")
        );
        assert_eq!(
            panic_message(&*caught(|| std::panic::panic_any(7u32))),
            None
        );
    }

    #[test]
    fn every_kind_maps_to_a_distinct_nixl_error_status() {
        let kinds = [
            ErrorKind::InvalidParam,
            ErrorKind::NotFound,
            ErrorKind::NotSupported,
            ErrorKind::Mismatch,
            ErrorKind::RepostActive,
            ErrorKind::NotAllowed,
            ErrorKind::Backend,
            ErrorKind::Canceled,
        ];
        let mut seen = std::collections::HashSet::new();
        for k in kinds {
            let s = Error::new(k, "x").to_status();
            assert!(s < 0, "{k:?} must be an error status");
            assert!(seen.insert(s), "{k:?} shares status {s}");
        }
    }

    #[test]
    fn os_errors_name_the_errno() {
        let e = Error::os("pwrite fd 7", &io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.message, "pwrite fd 7: ENOSPC (No space left on device)");
        assert_eq!(e.to_status(), status::ERR_BACKEND);
        assert_eq!(e.context.errno, Some(libc::ENOSPC));
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn a_wrapping_error_keeps_the_inner_context_and_its_own() {
        let inner = Error::os("register", &io::Error::from_raw_os_error(libc::EINVAL)).with_fd(9);
        let e = Error::not_supported("cannot reach fd 9: register: EINVAL")
            .with_descriptor(2)
            .caused_by(inner);
        assert_eq!(
            e.context,
            Context {
                descriptor: Some(2),
                fd: Some(9),
                errno: Some(libc::EINVAL),
                ..Context::default()
            }
        );
        assert!(
            std::error::Error::source(&e).is_some_and(|s| s.to_string().starts_with("register"))
        );
        assert_eq!(e.clone().at_descriptor(7).context.descriptor, Some(2));
    }

    #[test]
    fn a_poisoned_lock_fails_the_engine_instead_of_panicking() {
        let failure = Failure::default();
        let m = std::sync::Arc::new(Mutex::new(0u32));
        let m2 = std::sync::Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("panic while holding the lock (on purpose)");
        })
        .join();
        assert!(failure.check().is_ok());
        let e = failure.lock(&m, "test").unwrap_err();
        assert_eq!(e.to_status(), status::ERR_BACKEND);
        assert!(
            e.message.contains("internal lock test is poisoned"),
            "{}",
            e.message
        );
        let e = failure.check().unwrap_err();
        assert_eq!(e.to_status(), status::ERR_BACKEND);
        assert!(
            e.message.contains("failed earlier") && e.message.contains("lock test"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_poisoned_lock_on_a_teardown_path_is_recovered_and_fails_the_engine() {
        let failure = Failure::default();
        let m = Mutex::new(5u32);
        poison(&m);
        assert_eq!(*failure.lock_or_recover(&m, "teardown test"), 5);
        let e = failure.check().unwrap_err();
        assert!(
            e.message.contains("lock teardown test is poisoned"),
            "{}",
            e.message
        );
    }
}
