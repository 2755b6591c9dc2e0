//! Host memory exported as a DMA-BUF through udmabuf (`/dev/udmabuf`, CONFIG_UDMABUF): a sealed
//! memfd, page-aligned, turned into a dma-buf fd by `UDMABUF_CREATE`. The CPU fills and checks
//! the bytes through a shared mapping of the memfd (the same pages the dma-buf exports).
//!
//! Rules (kernel-gpu-interfaces.md §2.4): the memfd needs `MFD_ALLOW_SEALING` and `F_SEAL_SHRINK`
//! and must not carry `F_SEAL_WRITE`; offset and size page-aligned; the module parameter
//! `size_limit_mb` caps one buffer (64 MiB by default).

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// `struct udmabuf_create`.
#[repr(C)]
struct UdmabufCreate {
    memfd: u32,
    flags: u32,
    offset: u64,
    size: u64,
}
const _: () = assert!(std::mem::size_of::<UdmabufCreate>() == 24);

const UDMABUF_FLAGS_CLOEXEC: u32 = 0x01;
/// `_IOW('u', 0x42, struct udmabuf_create)`.
const UDMABUF_CREATE: libc::c_ulong = (1 << 30)
    | ((std::mem::size_of::<UdmabufCreate>() as libc::c_ulong) << 16)
    | ((b'u' as libc::c_ulong) << 8)
    | 0x42;
const _: () = assert!(UDMABUF_CREATE == 0x4018_7542);

pub const DEVICE: &str = "/dev/udmabuf";
pub const SIZE_LIMIT_PARAM: &str = "/sys/module/udmabuf/parameters/size_limit_mb";

/// A udmabuf-exported host buffer: the memfd, the dma-buf fd, and a CPU mapping.
pub struct HostDmabuf {
    memfd: OwnedFd,
    dmabuf: OwnedFd,
    map: *mut u8,
    len: usize,
}

impl HostDmabuf {
    /// Creates a `len`-byte buffer (`len` must be a multiple of the page size).
    pub fn create(len: usize) -> Result<HostDmabuf, String> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        if len == 0 || len % page != 0 {
            return Err(format!(
                "udmabuf size {len} is not a non-zero multiple of the page size {page}"
            ));
        }
        let name: &CStr = c"iud-udmabuf";
        // SAFETY: name is a NUL-terminated string; memfd_create returns a new fd or -1.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC)
        };
        if raw < 0 {
            return Err(format!("memfd_create: {}", io::Error::last_os_error()));
        }
        // SAFETY: raw is a fresh fd that nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on our own fd.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(format!(
                "ftruncate(memfd, {len}): {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(format!(
                "fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK): {}",
                io::Error::last_os_error()
            ));
        }
        let dmabuf = create_raw(memfd.as_raw_fd(), 0, len as u64).map_err(|e| {
            format!(
                "ioctl({DEVICE}, UDMABUF_CREATE, {len} bytes): {}",
                io::Error::from_raw_os_error(e)
            )
        })?;
        // SAFETY: a new shared mapping of our memfd, `len` bytes as sized above.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                memfd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mmap(memfd, {len}): {}",
                io::Error::last_os_error()
            ));
        }
        Ok(HostDmabuf {
            memfd,
            dmabuf,
            map: map.cast(),
            len,
        })
    }

    pub fn dmabuf_fd(&self) -> RawFd {
        self.dmabuf.as_raw_fd()
    }
    pub fn memfd(&self) -> RawFd {
        self.memfd.as_raw_fd()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    /// The CPU mapping's address (for registering the same pages as an ordinary buffer).
    pub fn ptr(&self) -> *mut u8 {
        self.map
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: map/len describe our live shared mapping.
        unsafe { std::slice::from_raw_parts(self.map, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self means no other CPU view exists.
        unsafe { std::slice::from_raw_parts_mut(self.map, self.len) }
    }
}

impl Drop for HostDmabuf {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once; the fds close after this.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

/// `UDMABUF_CREATE` on `[offset, offset+size)` of `memfd`: the new dma-buf fd, or the errno
/// (ENOENT when /dev/udmabuf is missing).
pub fn create_raw(memfd: RawFd, offset: u64, size: u64) -> Result<OwnedFd, i32> {
    let dev = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(DEVICE)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    let arg = UdmabufCreate {
        memfd: memfd as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset,
        size,
    };
    // SAFETY: UDMABUF_CREATE reads one struct udmabuf_create, which outlives the call; on
    // success it returns a new dma-buf fd.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &arg) };
    if fd < 0 {
        return Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    // SAFETY: fd is a fresh dma-buf fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The exporter name the dma-buf core shows for `fd` (`exp_name:` in /proc/self/fdinfo).
pub fn exporter_name(fd: RawFd) -> Option<String> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("exp_name:").map(|v| v.trim().to_owned()))
}

/// udmabuf's per-buffer limit in MiB, if the module parameter is visible.
pub fn size_limit_mb() -> Option<u64> {
    std::fs::read_to_string(SIZE_LIMIT_PARAM)
        .ok()?
        .trim()
        .parse()
        .ok()
}
