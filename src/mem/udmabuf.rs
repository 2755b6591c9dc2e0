//! Host memory as DMA-BUF (`dram_dmabuf`): a DRAM registration backed by a shared memfd mapping
//! is exported through `/dev/udmabuf`, so that with the io_uring DMA-BUF uAPI the IOMMU mapping is
//! built once per buffer instead of per I/O.
//!
//! udmabuf can only wrap memfd pages: the registration must lie in one MAP_SHARED mapping of a
//! memfd created with MFD_ALLOW_SEALING (found through /proc/self/maps and opened through
//! /proc/self/map_files). The memfd gets F_SEAL_SHRINK (udmabuf requires it: the exported pages
//! must not disappear). Offsets and sizes are page-aligned; the module's `size_limit_mb` caps one
//! buffer. Anonymous memory (malloc, numpy, torch CPU tensors) cannot be exported: the registration
//! then keeps ordinary fixed buffers.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use crate::error::{Error, Result};

/// `struct udmabuf_create` (linux/udmabuf.h).
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
const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542;

pub const DEVICE: &str = "/dev/udmabuf";

/// An error of a failed I/O call whose message shows `err` as std does (the texts of this
/// module predate `describe_os_error`), with its errno and source.
fn io_failure(message: String, err: io::Error) -> Error {
    let e = Error::backend(message);
    let e = match err.raw_os_error() {
        Some(code) => e.with_errno(code),
        None => e,
    };
    e.with_source(err)
}

/// The memfd behind `[addr, addr+len)` and the file offset of `addr`, or why there is none.
pub fn backing_memfd(addr: u64, len: u64) -> Result<(File, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| io_failure(format!("cannot read /proc/self/maps: {e}"), e))?;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(off)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        if addr < start || addr >= end {
            continue;
        }
        let path = f.nth(2).unwrap_or("");
        if addr + len > end {
            return Err(Error::not_supported(format!(
                "the range spans more than one mapping (mapping ends at 0x{end:x})"
            )));
        }
        if !path.starts_with("/memfd:") || !perms.contains('s') {
            return Err(Error::not_supported(format!(
                "the memory is not a shared memfd mapping (it is {:?}, {perms}); udmabuf can only \
                 export memfd pages",
                if path.is_empty() { "anonymous" } else { path }
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(format!("/proc/self/map_files/{range}"))
            .map_err(|e| {
                io_failure(
                    format!("cannot open the memfd through /proc/self/map_files/{range}: {e}"),
                    e,
                )
            })?;
        let map_off =
            u64::from_str_radix(off, 16).map_err(|_| Error::backend("bad mapping offset"))?;
        return Ok((file, map_off + (addr - start)));
    }
    Err(Error::not_found(format!("0x{addr:x} is not mapped")))
}

/// Seals the memfd against shrinking (required by udmabuf; harmless for a buffer that stays).
pub fn seal_shrink(memfd: RawFd) -> Result<()> {
    // SAFETY: fcntl on an fd we own.
    let seals = unsafe { libc::fcntl(memfd, libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(memfd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
        let err = io::Error::last_os_error();
        let e = io_failure(
            format!(
                "cannot seal the memfd against shrinking (created without MFD_ALLOW_SEALING?): \
                 {err}"
            ),
            err,
        );
        return Err(e.with_fd(memfd));
    }
    Ok(())
}

/// udmabuf's per-buffer limit in bytes (module parameter `size_limit_mb`), when it is visible.
pub fn size_limit() -> Option<u64> {
    let mb: u64 = std::fs::read_to_string("/sys/module/udmabuf/parameters/size_limit_mb")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(mb.saturating_mul(1 << 20))
}

/// `UDMABUF_CREATE` on `[offset, offset+size)` of `memfd`.
pub fn create(memfd: RawFd, offset: u64, size: u64) -> Result<OwnedFd> {
    let dev = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(DEVICE)
        .map_err(|e| io_failure(format!("cannot open {DEVICE} (CONFIG_UDMABUF): {e}"), e))?;
    let arg = UdmabufCreate {
        memfd: memfd as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset,
        size,
    };
    // SAFETY: UDMABUF_CREATE reads one struct that outlives the call and returns a new fd.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &arg) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        let e = Error::os(
            format!("UDMABUF_CREATE({size} bytes at {offset}) failed"),
            &err,
        );
        return Err(e.with_fd(memfd).with_offset(offset));
    }
    // SAFETY: a fresh dma-buf fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_is_refused_with_the_reason() {
        let v = vec![1u8; 1 << 16];
        let err = backing_memfd(v.as_ptr() as u64, v.len() as u64).unwrap_err();
        assert!(
            err.message.contains("not a shared memfd mapping")
                || err.message.contains("more than one mapping"),
            "{err}"
        );
    }

    #[test]
    fn a_shared_memfd_mapping_is_found_at_the_right_offset() {
        // SAFETY: plain syscalls on fds and a mapping this test owns.
        unsafe {
            let fd = libc::memfd_create(
                c"iud-test".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            );
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, 1 << 20), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                1 << 19,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                1 << 19,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let (file, off) = backing_memfd(p as u64 + 8192, 4096).unwrap();
            assert_eq!(off, (1 << 19) + 8192);
            assert!(seal_shrink(file.as_raw_fd()).is_ok());
            let err = create(file.as_raw_fd(), off, 4096);
            if !std::path::Path::new(DEVICE).exists() {
                assert!(err.unwrap_err().message.contains("CONFIG_UDMABUF"));
            }
            libc::munmap(p, 1 << 19);
            libc::close(fd);
        }
    }
}
