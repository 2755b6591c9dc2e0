//! The DMA-BUF path: memory exported as DMA-BUF slabs (GPU memory by its provider, host memory
//! through udmabuf), registered with io_uring bound to one O_DIRECT block device, and moved by
//! the ring with the slab's fixed-buffer slot and an offset into the DMA-BUF.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::dmabuf_verify;
use super::route::{Path, Route};
use crate::error::{Error, Result};
use crate::mem::dmabuf_slabs::DmabufSlabs;
use crate::mem::{FileRegion, MemKind, Registration};
use crate::uring::dmabuf_uapi::DmabufSupport;
use crate::uring::Ring;

/// Binds slabs to targets on one ring, with the self-test when `verify` is set.
pub struct Dmabuf<'a> {
    pub ring: &'a Arc<Ring>,
    pub support: &'a DmabufSupport,
    pub verify: bool,
}

/// The slabs of a registration, when it has some.
pub fn slabs_of(mem: &Registration) -> Option<&DmabufSlabs> {
    match mem {
        Registration::Vram(v) => Some(&v.dmabuf),
        Registration::Dram(d) => d.dmabuf.as_ref(),
        Registration::Storage(_) => None,
    }
}

impl Path for Dmabuf<'_> {
    fn check(&self, mem: &Registration, file: &FileRegion) -> Result<()> {
        if let DmabufSupport::Absent(why) = self.support {
            return Err(Error::not_supported(why.clone()));
        }
        if file.kind != MemKind::Blk || file.direct.is_none() {
            return Err(Error::not_supported(
                "the target is not a raw block device opened with O_DIRECT (the kernel supports \
                 DMA-BUF I/O only there)",
            )
            .with_fd(file.fd));
        }
        let slabs = slabs_of(mem).ok_or_else(no_slabs)?;
        match &slabs.export_note {
            Some(note) => Err(Error::not_supported(note.clone())),
            None => Ok(()),
        }
    }

    /// Registers every slab as an io_uring DMA-BUF buffer bound to `file` (released with the
    /// registration), then runs the self-test.
    fn bind(&self, mem: &Registration, file: &FileRegion) -> Result<Route> {
        self.check(mem, file)?;
        let slabs = slabs_of(mem).ok_or_else(no_slabs)?;
        let mut slots = Vec::with_capacity(slabs.slabs.len());
        for slab in &slabs.slabs {
            let fd = slab
                .dmabuf
                .as_ref()
                .map(|f| f.as_raw_fd())
                .ok_or_else(|| Error::not_supported("slab has no DMA-BUF"))?;
            match self.ring.register_dmabuf(fd, file.io_fd) {
                Ok(slot) => slots.push(slot),
                Err(e) => {
                    for s in slots {
                        self.ring.release_buffer(s);
                    }
                    return Err(Error::os(
                        format!("io_uring refused the DMA-BUF for fd {}", file.fd),
                        &e,
                    )
                    .with_fd(file.fd));
                }
            }
        }
        let ring = Arc::clone(self.ring);
        let owned = slots.clone();
        slabs
            .on_drop
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(move || {
                for s in owned {
                    ring.release_buffer(s);
                }
            }));
        if self.verify {
            dmabuf_verify::dmabuf_read(
                self.ring,
                slabs,
                file,
                slots[0],
                &|to_host, dst, src, len| self_test_copy(mem, to_host, dst, src, len),
            )?;
        }
        Ok(Route::Dmabuf { slots })
    }
}

fn no_slabs() -> Error {
    Error::not_supported("the memory has no DMA-BUF slabs")
}

/// The self-test's copies between the registered memory and a host buffer: the provider's
/// copies for VRAM, memcpy for host memory.
fn self_test_copy(mem: &Registration, to_host: bool, dst: u64, src: u64, len: u64) -> Result<()> {
    match mem {
        Registration::Vram(vram) => {
            // SAFETY: the self-test copies one block between its own host buffer and the first
            // block of a registered slab.
            let ticket = unsafe {
                if to_host {
                    vram.provider.copy_to_host(vram.device, dst, src, len)
                } else {
                    vram.provider.copy_to_device(vram.device, dst, src, len)
                }
            };
            ticket.and_then(|t| t.wait())
        }
        _ => {
            // SAFETY: the self-test copies one block between its own buffer and the first block
            // of the registered host memory; the ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize)
            };
            Ok(())
        }
    }
}

/// The piece at `addr`: its offset into the slab's DMA-BUF, the slab's slot, and the slab end.
pub fn address(slabs: &DmabufSlabs, slots: &[u16], addr: u64) -> Option<(u64, u16, u64)> {
    let (slab, slab_end) = slabs.slab_at(addr)?;
    Some((
        slabs.slabs[slab].dmabuf_offset_of(addr),
        slots[slab],
        slab_end,
    ))
}

/// The address O_DIRECT alignment is checked on: the offset into the DMA-BUF.
pub fn aligned_address(slabs: &DmabufSlabs, addr: u64) -> u64 {
    slabs
        .slab_at(addr)
        .map_or(addr, |(s, _)| slabs.slabs[s].dmabuf_offset_of(addr))
}
