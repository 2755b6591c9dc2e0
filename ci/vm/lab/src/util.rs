//! Small helpers shared by the tests: page-aligned buffers, random data, block-device facts,
//! byte-for-byte comparison, errno text, and "submit these SQEs and collect their CQEs".

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use io_uring::{squeue, IoUring};

/// "EINVAL (Invalid argument)" for a positive errno.
pub fn errno_str(errno: i32) -> String {
    let text = io::Error::from_raw_os_error(errno).to_string();
    let text = text
        .split(" (os error")
        .next()
        .unwrap_or_default()
        .to_owned();
    format!("{} ({text})", io_uring_dmabuf::error::errno_name(errno))
}

/// "-EINVAL (Invalid argument)" for a negative io_uring result, the number for anything else.
pub fn res_str(res: i64) -> String {
    if res < 0 {
        format!("-{}", errno_str(-res as i32))
    } else {
        res.to_string()
    }
}

pub fn size_str(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// xorshift64*: fast enough for megabytes under TCG, seeded from getrandom so that every run
/// writes data the disk has never held.
pub struct Rng(u64);

impl Rng {
    pub fn new() -> Rng {
        let mut seed = 0u64;
        // SAFETY: getrandom writes at most 8 bytes into the u64.
        let n = unsafe { libc::getrandom((&mut seed as *mut u64).cast(), 8, 0) };
        if n != 8 {
            seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
        }
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// Anonymous, page-aligned, private memory (mmap), unmapped on drop.
pub struct MmapBuf {
    ptr: *mut u8,
    len: usize,
}

impl MmapBuf {
    pub fn new(len: usize) -> io::Result<MmapBuf> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MmapBuf { ptr: p.cast(), len })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr/len describe our live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe our live mapping, and &mut self means no other view exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for MmapBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once; no slice into it outlives self.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Compares two byte ranges; the error names the first differing byte and how many differ.
pub fn compare(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: length {} != expected {}",
            got.len(),
            want.len()
        ));
    }
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    let ndiff = got.iter().zip(want).filter(|(a, b)| a != b).count();
    Err(format!(
        "{what}: {ndiff} of {} bytes differ, first at byte {first} (got 0x{:02x}, want 0x{:02x})",
        got.len(),
        got[first],
        want[first]
    ))
}

/// An open block device with its capacity and logical block size.
pub struct BlockDev {
    pub file: File,
    pub bytes: u64,
    pub lbs: u32,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

impl BlockDev {
    pub fn open(path: &str, direct: bool) -> Result<BlockDev, String> {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o.open(path).map_err(|e| {
            format!(
                "open({path}, O_RDWR{}): {e}",
                if direct { "|O_DIRECT" } else { "" }
            )
        })?;
        let fd = file.as_raw_fd();
        let mut bytes = 0u64;
        // SAFETY: BLKGETSIZE64 writes one u64 into `bytes`.
        if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut bytes) } != 0 {
            return Err(format!(
                "ioctl({path}, BLKGETSIZE64): {}",
                io::Error::last_os_error()
            ));
        }
        let mut lbs: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int into `lbs`.
        if unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs) } != 0 {
            return Err(format!(
                "ioctl({path}, BLKSSZGET): {}",
                io::Error::last_os_error()
            ));
        }
        Ok(BlockDev {
            file,
            bytes,
            lbs: lbs as u32,
        })
    }
    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// Reads `len` bytes at `off` through a separate, buffered (page-cache) open of `path`: an
/// independent view of what reached the disk (O_DIRECT writes invalidate cached pages).
pub fn read_buffered(path: &str, off: u64, len: usize) -> Result<Vec<u8>, String> {
    let f = File::open(path).map_err(|e| format!("open({path}) buffered: {e}"))?;
    let mut v = vec![0u8; len];
    f.read_exact_at(&mut v, off)
        .map_err(|e| format!("pread({path}, {len} @ {off}) buffered: {e}"))?;
    Ok(v)
}

/// Submits every entry (user_data must be its index), waits for all completions, and returns
/// the results in entry order. Errors only for ring failures; I/O errors come back as
/// negative results.
pub fn submit_all(ring: &mut IoUring, entries: &[squeue::Entry]) -> Result<Vec<i32>, String> {
    let mut res = vec![i32::MIN; entries.len()];
    let mut next = 0;
    let mut done = 0;
    while done < entries.len() {
        {
            let mut sq = ring.submission();
            while next < entries.len() {
                // SAFETY: the callers keep every buffer an entry names alive and unaliased
                // until submit_all returns, and all completions are reaped before that.
                if unsafe { sq.push(&entries[next]) }.is_err() {
                    break;
                }
                next += 1;
            }
        }
        ring.submit_and_wait(1)
            .map_err(|e| format!("io_uring_enter: {e}"))?;
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            if i >= res.len() || res[i] != i32::MIN {
                return Err(format!("unexpected CQE user_data {i}"));
            }
            res[i] = cqe.result();
            done += 1;
        }
    }
    Ok(res)
}

/// Is `fd` open in this process?
pub fn fd_is_open(fd: i32) -> bool {
    // SAFETY: F_GETFD only queries the descriptor table.
    let r = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    r != -1
}

/// Number of open file descriptors of this process.
pub fn open_fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}
