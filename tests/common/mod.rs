//! Shared by the engine test binaries: memory kinds, an aligned host buffer with a pattern
//! that is never zeros, a scratch directory, descriptor construction, and running one request to
//! completion.
#![allow(dead_code)]

use std::ffi::c_void;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::Error;
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;

pub const DRAM: i32 = 0;
pub const VRAM: i32 = 1;
pub const BLK: i32 = 2;
pub const FILE: i32 = 4;
pub const READ: i32 = 0;
pub const WRITE: i32 = 1;
pub const AGENT: &str = "agent";

/// Page-aligned host buffer.
pub struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    /// Filled with a pattern unique to `seed` (never all zeros).
    pub fn new(len: usize, seed: u64) -> Buf {
        let mut b = Buf::alloc(len);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for byte in b.bytes_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *byte = (x >> 24) as u8;
        }
        b
    }

    /// Filled from the kernel's random source.
    pub fn random(len: usize) -> Buf {
        let b = Buf::alloc(len);
        let mut filled = 0;
        while filled < len {
            // SAFETY: writes into our allocation.
            let n = unsafe { libc::getrandom(b.ptr.add(filled).cast(), len - filled, 0) };
            assert!(n > 0);
            filled += n as usize;
        }
        b
    }

    fn alloc(len: usize) -> Buf {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: posix_memalign writes an aligned allocation into ptr.
        assert_eq!(unsafe { libc::posix_memalign(&mut ptr, 4096, len) }, 0);
        Buf {
            ptr: ptr.cast(),
            len,
        }
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr/len describe our allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe our allocation; &mut self excludes other views.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated by posix_memalign.
        unsafe { libc::free(self.ptr.cast()) }
    }
}

// SAFETY: the buffer is plain memory; tests coordinate access.
unsafe impl Send for Buf {}
// SAFETY: as above.
unsafe impl Sync for Buf {}

/// A directory under /var/tmp (a disk file system: O_DIRECT works there, unlike tmpfs), named
/// after the test, this process and a counter, removed on drop.
pub struct TestDir {
    pub path: std::path::PathBuf,
}

impl TestDir {
    pub fn new(name: &str) -> TestDir {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::path::PathBuf::from(format!(
            "/var/tmp/iud-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TestDir { path }
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub fn desc(addr: u64, len: u64, dev_id: u64, md: *const c_void) -> iud_desc {
    iud_desc {
        addr,
        len,
        dev_id,
        md,
    }
}

/// Runs a DRAM <-> `remote_kind` transfer to completion, polling like NIXL's clients.
pub fn run_kind(
    e: &Engine,
    op: i32,
    remote_kind: i32,
    local: &[iud_desc],
    remote: &[iud_desc],
) -> Result<(), Error> {
    run_lists(e, op, DRAM, local, remote_kind, remote)
}

/// Runs a transfer of any list kinds to completion, polling like NIXL's clients.
pub fn run_lists(
    e: &Engine,
    op: i32,
    local_kind: i32,
    local: &[iud_desc],
    remote_kind: i32,
    remote: &[iud_desc],
) -> Result<(), Error> {
    let req = e.prep(op, local_kind, local, remote_kind, remote, AGENT)?;
    let mut res = e.post(&req, op, local.len(), remote.len());
    while let Ok(Progress::InFlight) = res {
        res = e.check(&req);
    }
    e.release(req).map_err(|(_, err)| err).expect("release");
    res.map(|_| ())
}

/// What an application does to a registered fd before a post (the fd rule, mem/file.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdFate {
    /// close(fd).
    Closed,
    /// close(fd), then another file opened under the same number (dup2 makes the reuse certain).
    Reused,
}

/// Applies `fate` to `fd`; for `Reused`, `other` is opened (O_RDWR, plus `flags`) under `fd`.
pub fn doom_fd(fd: i32, fate: FdFate, other: &std::path::Path, flags: i32) {
    match fate {
        FdFate::Closed => {
            // SAFETY: the test owns fd.
            assert_eq!(unsafe { libc::close(fd) }, 0);
        }
        FdFate::Reused => {
            let c = std::ffi::CString::new(other.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: c is NUL-terminated; the new fd is the test's.
            let b = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | flags) };
            assert!(b >= 0, "open {other:?}");
            // SAFETY: dup2 closes fd and makes it name `other`; then b is closed.
            assert_eq!(unsafe { libc::dup2(b, fd) }, fd);
            // SAFETY: as above.
            unsafe { libc::close(b) };
        }
    }
}

/// Opens `path` read-write (creating it) with extra `flags`; the caller owns the fd, a number of
/// its own (`lone_fd`).
pub fn open_fd(path: &std::path::Path, flags: i32) -> i32 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: c is NUL-terminated.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | flags, 0o644) };
    assert!(
        fd >= 0,
        "open {path:?}: {}",
        std::io::Error::last_os_error()
    );
    lone_fd(fd)
}

/// Moves `fd` (closing it) to a number that no other open in this process takes while a test
/// has it closed: the kernel hands out the lowest free number, and these sit high above it, each
/// used once. Without it a test that closes its fd races the binary's other tests, whose next
/// open may get the number (then the test sees a reused fd, not a closed one).
pub fn lone_fd(fd: i32) -> i32 {
    use std::sync::atomic::{AtomicI32, Ordering};
    static NEXT: AtomicI32 = AtomicI32::new(0);
    static BASE: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: r is a valid rlimit to fill and then to set (soft limit up to the hard one).
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
            r.rlim_cur = r.rlim_max.min(1 << 16);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        }
        (r.rlim_cur / 2) as i32
    });
    let n = base + NEXT.fetch_add(1, Ordering::Relaxed);
    assert!(
        n < 2 * base,
        "lone_fd: out of numbers under RLIMIT_NOFILE ({})",
        2 * base
    );
    // SAFETY: dup2 onto a number nothing else in the process uses (see above); then the
    // original is closed, as the caller handed it over.
    let moved = unsafe { libc::dup2(fd, n) };
    assert_eq!(
        moved,
        n,
        "dup2({fd}, {n}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the caller handed fd over.
    unsafe { libc::close(fd) };
    n
}

/// `f` under a number of its own (`lone_fd`).
pub fn lone_file(f: std::fs::File) -> std::fs::File {
    use std::os::fd::{FromRawFd, IntoRawFd};
    // SAFETY: lone_fd returns an fd that now owns f's open file, and nothing else owns it.
    unsafe { std::fs::File::from_raw_fd(lone_fd(f.into_raw_fd())) }
}
