//! The DMA-BUF path self-test (`verify_dma`): before a (slab, target) pair is first used, read
//! one logical block of the target through the DMA-BUF and through a plain O_DIRECT read, and
//! refuse the path if the bytes differ. This catches platforms where peer-to-peer DMA silently
//! goes nowhere (IOMMU in translation mode with exporters that hand out physical addresses).
//!
//! The test is read-only for the device and leaves the registered memory as it found it: the
//! block it reads into is saved first and restored afterwards.

use crate::error::{Error, Result};
use crate::mem::dmabuf_slabs::DmabufSlabs;
use crate::mem::FileRegion;
use crate::uring::{FileRef, IoOp, Ring};

/// Copies between the registered memory and a host buffer: (to_host, dst, src, len).
pub type CopyFn<'a> = &'a dyn Fn(bool, u64, u64, u64) -> Result<()>;

/// Runs the self-test on the first slab of `slabs` (registered in fixed-buffer `slot`) against
/// `file`. `copy` moves bytes between that memory and host buffers.
pub fn dmabuf_read(
    ring: &Ring,
    slabs: &DmabufSlabs,
    file: &FileRegion,
    slot: u16,
    copy: CopyFn<'_>,
) -> Result<()> {
    let block = file.direct.map_or(4096, |a| a.offset.max(a.mem)).max(4096);
    let slab = slabs
        .slabs
        .first()
        .ok_or_else(|| Error::not_supported("registration has no slab"))?;
    if slab.len < block {
        return Err(Error::not_supported(format!(
            "slab smaller than one block ({block} bytes)"
        )));
    }
    let host = AlignedBuf::new(3 * block as usize)?;
    let (saved, via_plain, via_dmabuf) =
        (host.addr(), host.addr() + block, host.addr() + 2 * block);
    copy(true, saved, slab.start, block)?;
    // SAFETY: reading into our own buffer.
    let n = unsafe {
        libc::pread(
            file.io_fd,
            via_plain as *mut libc::c_void,
            block as usize,
            file.offset as libc::off_t,
        )
    };
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .filter(|_| n < 0);
    if n != block as isize {
        let e = Error::backend(format!(
            "plain O_DIRECT read of the test block failed ({n})"
        ))
        .with_fd(file.fd)
        .with_offset(file.offset);
        return Err(match errno {
            Some(code) => e.with_errno(code),
            None => e,
        });
    }
    let op = IoOp {
        file: FileRef::Raw(file.io_fd),
        fd: file.fd,
        io_fd: file.io_fd,
        file_offset: file.offset,
        addr: slab.dmabuf_offset_of(slab.start),
        len: block as u32,
        buf_index: Some(slot),
        device: None,
        punt: false,
        desc_index: 0,
    };
    let result = run_one(ring, op);
    let copied = copy(true, via_dmabuf, slab.start, block);
    // Restores the user's bytes whatever happened.
    let restored = copy(false, slab.start, saved, block);
    result?;
    copied?;
    restored?;
    if host.slice(block as usize, block as usize) != host.slice(2 * block as usize, block as usize)
    {
        return Err(Error::not_supported(
            "self-test: bytes read through the DMA-BUF differ from a plain read (peer-to-peer DMA \
             does not reach this memory on this platform)",
        )
        .with_fd(file.fd)
        .with_offset(file.offset));
    }
    Ok(())
}

/// Runs one READ op through the ring and waits for it.
fn run_one(ring: &Ring, op: IoOp) -> Result<()> {
    let failed = |e: Error| {
        Error::backend(format!("self-test read through the DMA-BUF failed: {e}")).caused_by(e)
    };
    match ring.lock().and_then(|mut core| core.run_one(op, false)) {
        Ok(n) if n == op.len as i32 => Ok(()),
        Ok(n) if n < 0 => Err(failed(op.failed(false, -n))),
        Ok(n) => Err(op.annotate(Error::backend(format!(
            "self-test read through the DMA-BUF moved {n} of {} bytes",
            op.len
        )))),
        Err(e) => Err(failed(op.annotate(e))),
    }
}

struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Result<AlignedBuf> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: posix_memalign writes an aligned allocation into ptr.
        if unsafe { libc::posix_memalign(&mut ptr, 4096, len) } != 0 {
            return Err(
                Error::backend("out of memory for the self-test buffer").with_errno(libc::ENOMEM)
            );
        }
        Ok(AlignedBuf {
            ptr: ptr.cast(),
            len,
        })
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: within our allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by posix_memalign.
        unsafe { libc::free(self.ptr.cast()) }
    }
}
