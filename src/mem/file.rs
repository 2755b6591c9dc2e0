//! FILE_SEG and BLK_SEG registrations: a byte range of a file or raw block device, named by an fd
//! the application opened (fd mode, devId = fd) or by a path the plugin opens and closes itself
//! (path mode, see `path_meta`). BLK_SEG requires a block device opened with O_DIRECT; the
//! registration must lie within the device's capacity (BLKGETSIZE64), and descriptors must follow
//! its logical block size (BLKSSZGET).
//!
//! The rule for an application's fd (fd mode): the registration takes its own duplicate of the
//! fd (`io_fd`) and every path uses only that one (ring SQEs with or without the fixed-file
//! table, inline pwrite, preadv2, the page-cache workers, staged VRAM, DMA-BUF binding, cuFile
//! handles), so no byte can reach another file whatever the application does with its number.
//! It also remembers the file's identity (st_dev, st_ino) and path, and prep and every post
//! refuse the request when the application's fd is closed or names another file (the
//! application's view and the registration disagree: one error naming fd, file and cause).
//! The O_DIRECT alignment is remembered so that misaligned descriptors are refused at prep time
//! with a message instead of an EINVAL from the kernel.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::mem::kind::MemKind;
use crate::mem::path_meta::PathMeta;
use crate::uring::{FileKey, FileRef, Ring};

/// O_DIRECT alignment of a file: memory address and file offset/length granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectAlign {
    pub mem: u64,
    pub offset: u64,
}

/// A registered file or block-device range.
pub struct FileRegion {
    /// FILE_SEG or BLK_SEG.
    pub kind: MemKind,
    /// The fd the application named (fd mode) or the plugin opened (path mode); for messages.
    pub fd: i32,
    /// The fd all I/O uses: in fd mode a duplicate owned by this registration, in path mode `fd`.
    pub io_fd: i32,
    /// Where the file was when it was registered (from /proc/self/fd), for messages.
    pub name: String,
    pub dev_id: u64,
    pub offset: u64,
    pub len: u64,
    /// Set when the file was opened with O_DIRECT.
    pub direct: Option<DirectAlign>,
    /// For O_DIRECT: the largest I/O the underlying device takes in one request
    /// (queue/max_sectors_kb). Larger direct I/O is split into several bios, which io_uring
    /// cannot issue without blocking, so it hands the whole I/O to a worker thread.
    pub max_direct_io: Option<u64>,
    pub writable: bool,
    pub readable: bool,
    /// The plugin opened the file (path mode) and closes it on drop.
    pub owned_path: Option<String>,
    key: FileKey,
    fixed_files: bool,
    /// The ring's fixed-file slot, acquired when a request first plans I/O on the file (not in
    /// registerMem, whose time widens NIXL's list race in sync mode NONE: mem/dram.rs).
    fixed_slot: once_cell::sync::OnceCell<Option<u32>>,
    ring: Arc<Ring>,
    /// The cuFile handle, registered when the cuFile sub-path first targets this file.
    pub cufile: once_cell::sync::OnceCell<Arc<crate::gpu::cufile::CuFileHandle>>,
}

impl fmt::Debug for FileRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "FileRegion(fd {}, devId {}, {}+{}, path {:?})",
            self.fd, self.dev_id, self.offset, self.len, self.owned_path
        )
    }
}

impl FileRegion {
    /// Registers `[offset, offset+len)` of the file (kind FILE_SEG) or block device (BLK_SEG)
    /// named by `dev_id`/`meta_info`.
    pub fn register(
        ring: Arc<Ring>,
        kind: MemKind,
        offset: u64,
        len: u64,
        dev_id: u64,
        meta_info: &str,
        fixed_files: bool,
    ) -> Result<FileRegion> {
        let what = match kind {
            MemKind::Blk => "BLK_SEG",
            _ => "FILE",
        };
        let path_meta = PathMeta::parse(meta_info).map_err(|e| {
            Error::invalid(format!("{what} registration devId {dev_id}: {}", e.message))
        })?;
        let (fd, owned_path) = match &path_meta {
            Some(m) => (open_path(m, dev_id)?, Some(m.path.clone())),
            None => {
                let fd = i32::try_from(dev_id).map_err(|_| {
                    Error::invalid(format!(
                        "{what} registration: devId {dev_id} is not a file descriptor; pass an \
                         open fd, or metaInfo \"rw:/path\" for path mode"
                    ))
                })?;
                (fd, None)
            }
        };
        let mut guard = ClosesOnError {
            fds: [owned_path.as_ref().map(|_| fd), None],
        };
        let st = fstat(fd).map_err(|e| {
            Error::os(
                format!(
                    "{what} registration: fstat(fd {fd}) failed; devId must be an fd open in this \
                     process, or use path-mode metaInfo"
                ),
                &e,
            )
            .with_fd(fd)
        })?;
        let fmt = st.st_mode & libc::S_IFMT;
        let is_block = fmt == libc::S_IFBLK;
        match kind {
            MemKind::Blk if !is_block => {
                return Err(Error::invalid(format!(
                    "BLK_SEG registration: fd {fd} is not a block device; register files as FILE"
                ))
                .with_fd(fd))
            }
            _ if fmt != libc::S_IFREG && !is_block => {
                return Err(Error::invalid(format!(
                    "FILE registration: fd {fd} is neither a regular file nor a block device"
                ))
                .with_fd(fd))
            }
            _ => {}
        }
        // SAFETY: F_GETFL on an fd we just fstat'ed; no memory is involved.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(Error::os(
                format!("{what} registration: fcntl(fd {fd}, F_GETFL)"),
                &io::Error::last_os_error(),
            )
            .with_fd(fd));
        }
        let access = flags & libc::O_ACCMODE;
        let direct = if flags & libc::O_DIRECT != 0 {
            Some(direct_align(fd, is_block))
        } else {
            None
        };
        if kind == MemKind::Blk {
            if direct.is_none() {
                return Err(Error::invalid(format!(
                    "BLK_SEG registration: fd {fd} is not open with O_DIRECT; open the device \
                     with O_DIRECT (path mode: \"rw,direct:/dev/...\")"
                ))
                .with_fd(fd));
            }
            let capacity = block_capacity(fd)?;
            if offset.checked_add(len).is_none_or(|end| end > capacity) {
                return Err(Error::invalid(format!(
                    "BLK_SEG registration: range [{offset}, +{len}) runs past the end of the \
                     device on fd {fd} ({capacity} bytes)"
                ))
                .with_fd(fd)
                .with_offset(offset));
            }
        }
        if kind == MemKind::File && offset.checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "FILE registration: range [{offset}, +{len}) on fd {fd} ends past 2^64"
            ))
            .with_fd(fd)
            .with_offset(offset));
        }
        let max_direct_io =
            direct.and_then(|_| device_max_io(if is_block { st.st_rdev } else { st.st_dev }));
        let io_fd = match owned_path {
            Some(_) => fd,
            None => {
                let dup = duplicate(fd)?;
                guard.fds[1] = Some(dup);
                dup
            }
        };
        let name = std::fs::read_link(format!("/proc/self/fd/{io_fd}"))
            .map_or_else(|_| "?".to_owned(), |p| p.display().to_string());
        let key = FileKey {
            fd,
            dev: st.st_dev,
            ino: st.st_ino,
        };
        std::mem::forget(guard);
        Ok(FileRegion {
            kind,
            fd,
            io_fd,
            name,
            dev_id,
            offset,
            len,
            direct,
            max_direct_io,
            writable: access == libc::O_WRONLY || access == libc::O_RDWR,
            readable: access == libc::O_RDONLY || access == libc::O_RDWR,
            owned_path,
            key,
            fixed_files,
            fixed_slot: once_cell::sync::OnceCell::new(),
            ring,
            cufile: once_cell::sync::OnceCell::new(),
        })
    }

    /// The file's identity (fd, device, inode).
    pub fn key(&self) -> FileKey {
        self.key
    }

    /// How SQEs name this file. The first call acquires the fixed-file slot.
    pub fn file_ref(&self) -> FileRef {
        let slot = self.fixed_slot.get_or_init(|| {
            if self.fixed_files {
                self.ring.acquire_file(self.key, self.io_fd)
            } else {
                None
            }
        });
        match *slot {
            Some(slot) => FileRef::Fixed(slot),
            None => FileRef::Raw(self.io_fd),
        }
    }

    /// Fails when the application's fd was closed, or now names another file, since the
    /// registration. I/O would still reach the registered file (it uses `io_fd`), but the
    /// application no longer holds what it registered, so the request is refused instead.
    pub fn check_still_open(&self) -> Result<()> {
        if self.owned_path.is_some() {
            return Ok(());
        }
        let what = match self.kind {
            MemKind::Blk => "BLK_SEG",
            _ => "FILE",
        };
        match fstat(self.fd) {
            Ok(st) if st.st_dev == self.key.dev && st.st_ino == self.key.ino => Ok(()),
            Ok(_) => {
                let now = std::fs::read_link(format!("/proc/self/fd/{}", self.fd))
                    .map_or_else(|_| "?".to_owned(), |p| p.display().to_string());
                Err(Error::new(
                    ErrorKind::NotAllowed,
                    format!(
                        "fd {} registered as {what} for {} now refers to a different file \
                         ({now}); nothing was moved; deregister it and register the new file",
                        self.fd, self.name
                    ),
                )
                .with_fd(self.fd))
            }
            Err(e) => Err(Error::os(
                format!(
                    "fd {} registered as {what} for {} is no longer open; nothing was moved; keep \
                     it open until deregistration",
                    self.fd, self.name
                ),
                &e,
            )
            .with_fd(self.fd)),
        }
    }
}

impl Drop for FileRegion {
    fn drop(&mut self) {
        // cuFile's handle goes before the fd it names.
        drop(self.cufile.take());
        if let Some(Some(_)) = self.fixed_slot.get() {
            self.ring.release_file(self.key);
        }
        // SAFETY: io_fd is this registration's own fd (the plugin's duplicate, or the fd it
        // opened in path mode) and nothing else closes it. The fixed-file slot (if any) holds
        // its own reference to the file.
        unsafe { libc::close(self.io_fd) };
    }
}

/// Closes the fds a registration opened (path mode) or duplicated if it fails after that.
struct ClosesOnError {
    fds: [Option<i32>; 2],
}

impl Drop for ClosesOnError {
    fn drop(&mut self) {
        for fd in self.fds.iter().flatten() {
            // SAFETY: the fd was opened or duplicated by the registration that is failing.
            unsafe { libc::close(*fd) };
        }
    }
}

/// The registration's own fd for the application's `fd` (close-on-exec, like the plugin's other
/// fds).
fn duplicate(fd: i32) -> Result<i32> {
    // SAFETY: F_DUPFD_CLOEXEC on an fd we just fstat'ed returns a new fd or -1.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(Error::os(
            format!(
                "FILE registration: could not duplicate fd {fd} for the registration's own use"
            ),
            &io::Error::last_os_error(),
        )
        .with_fd(fd));
    }
    Ok(dup)
}

fn open_path(m: &PathMeta, dev_id: u64) -> Result<i32> {
    let c = CString::new(m.path.as_bytes()).map_err(|_| {
        Error::invalid(format!(
            "FILE registration devId {dev_id}: path {:?} contains a NUL byte",
            m.path
        ))
    })?;
    // SAFETY: c is a valid NUL-terminated string; the mode argument is read only with O_CREAT.
    let fd = unsafe { libc::open(c.as_ptr(), m.open_flags(), 0o644 as libc::c_uint) };
    if fd < 0 {
        return Err(Error::os(
            format!("FILE registration devId {dev_id}: open({:?})", m.path),
            &io::Error::last_os_error(),
        ));
    }
    Ok(fd)
}

/// queue/max_sectors_kb of the block device `dev` (a partition reads its disk's queue), in bytes.
fn device_max_io(dev: libc::dev_t) -> Option<u64> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    ["queue/max_sectors_kb", "../queue/max_sectors_kb"]
        .iter()
        .find_map(|rel| {
            let kb: u64 = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{rel}"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            (kb >= 4).then_some(kb * 1024)
        })
}

/// `_IOR(0x12, 114, size_t)` from linux/fs.h; the libc crate does not export it.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Size of a block device in bytes.
fn block_capacity(fd: i32) -> Result<u64> {
    let mut bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64.
    if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut bytes) } != 0 {
        return Err(Error::os(
            format!("BLK_SEG registration: ioctl(fd {fd}, BLKGETSIZE64)"),
            &io::Error::last_os_error(),
        )
        .with_fd(fd));
    }
    Ok(bytes)
}

fn fstat(fd: i32) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into st; an invalid fd is reported through errno.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// The O_DIRECT alignment of an open file: statx(STATX_DIOALIGN) where the kernel and file
/// system report it, the logical block size for block devices, else 512 (the smallest logical
/// block size Linux supports, so a conservative check never rejects valid I/O... on 512-byte
/// devices; on 4 KiB devices the kernel's EINVAL remains the backstop).
fn direct_align(fd: i32, is_block: bool) -> DirectAlign {
    if is_block {
        let mut lbs: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int.
        if unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs) } == 0 && lbs > 0 {
            return DirectAlign {
                mem: lbs as u64,
                offset: lbs as u64,
            };
        }
    }
    // SAFETY: an all-zero statx is a valid value to be overwritten.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx with AT_EMPTY_PATH and "" queries the fd itself and writes into stx.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align > 0 {
        return DirectAlign {
            mem: stx.stx_dio_mem_align.max(1) as u64,
            offset: stx.stx_dio_offset_align as u64,
        };
    }
    DirectAlign {
        mem: 512,
        offset: 512,
    }
}
