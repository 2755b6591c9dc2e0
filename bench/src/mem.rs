//! Buffers, regions and the random pattern generator of the benchmark.

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

/// A region handed to `Agent::register_memory`: DRAM `(ptr, len, 0)` or FILE `(offset, len, fd)`.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    pub addr: usize,
    pub len: usize,
    pub dev_id: u64,
    pub kind: MemType,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.kind
    }

    fn device_id(&self) -> u64 {
        self.dev_id
    }
}

/// Page-aligned heap memory from `posix_memalign` (as nixlbench allocates its DRAM buffers).
///
/// NIXL backends write into it behind Rust's back, so it is only ever accessed through raw
/// pointers and short-lived slices taken while no transfer is in flight.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; the benchmark synchronises access to it
// (no slice is alive while a transfer may touch the same bytes).
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; shared access only hands out raw addresses.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize, align: usize) -> Result<Self, String> {
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign writes an allocation (or nothing) into p.
        let rc = unsafe { libc::posix_memalign(&mut p, align, len.max(1)) };
        if rc != 0 || p.is_null() {
            return Err(format!(
                "posix_memalign({len} bytes, align {align}) failed: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(Self { ptr: p.cast(), len })
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// # Safety
    /// No transfer may write `[off, off+len)` while the slice is alive.
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; caller guarantees no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// # Safety
    /// No transfer may touch `[off, off+len)` while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from posix_memalign and is freed once.
        unsafe { libc::free(self.ptr.cast()) }
    }
}

/// splitmix64: a small, fast, seedable generator for the random data patterns.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let v = self.next_u64().to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&v[..n]);
        }
    }
}

/// A `File` view of a borrowed fd (never closed here).
fn borrowed(fd: i32) -> std::mem::ManuallyDrop<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: the caller's fd stays open for the call; ManuallyDrop keeps us from closing it.
    std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Full pread of `buf.len()` bytes at `off` (std's loop over short reads; EOF is an error).
pub fn pread_full(fd: i32, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    borrowed(fd).read_exact_at(buf, off)
}

/// Full pwrite of `buf` at `off` (std's loop over short writes).
pub fn pwrite_full(fd: i32, buf: &[u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    borrowed(fd).write_all_at(buf, off)
}
