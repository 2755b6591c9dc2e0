//! DRAM registrations: host memory, registered with io_uring as fixed buffers when possible.
//!
//! A region longer than the kernel's 1 GiB fixed-buffer limit takes several consecutive slots;
//! the planner splits descriptors at slot boundaries. If the kernel refuses (file-backed
//! mappings, RLIMIT_MEMLOCK, table full), the region uses plain READ/WRITE instead.

use std::fmt;
use std::sync::Arc;

use crate::error::{describe_os_error, Result};
use crate::mem::dmabuf_slabs::{slab_ranges_of, DmabufSlabs, PAGE};
use crate::mem::udmabuf;
use crate::uring::{Ring, MAX_FIXED_BUFFER};

/// A registered host-memory range.
pub struct DramRegion {
    pub addr: u64,
    pub len: u64,
    pub dev_id: u64,
    /// Fixed-buffer slots covering consecutive MAX_FIXED_BUFFER pieces from `addr`.
    slots: Vec<u16>,
    /// The udmabuf export of the region (`dram_dmabuf`), when one was attempted.
    pub dmabuf: Option<DmabufSlabs>,
    ring: Arc<Ring>,
}

impl fmt::Debug for DramRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DramRegion(0x{:x}+{}, slots {:?})", self.addr, self.len, self.slots)
    }
}

/// Why a region is not using fixed buffers.
#[derive(Debug)]
pub struct FixedBufferFallback(pub String);

impl DramRegion {
    /// Registers `[addr, addr+len)`; with `want_fixed`, also as fixed buffers. Returns the region
    /// and, when fixed buffers were wanted but refused, the reason (for the caller to log).
    ///
    /// # Safety
    /// The memory must stay mapped until the region is dropped (NIXL's registration contract:
    /// the application deregisters before freeing).
    pub unsafe fn register(
        ring: Arc<Ring>,
        addr: u64,
        len: u64,
        dev_id: u64,
        want_fixed: bool,
    ) -> (DramRegion, Option<FixedBufferFallback>) {
        let mut region = DramRegion { addr, len, dev_id, slots: Vec::new(), dmabuf: None, ring };
        if !want_fixed {
            return (region, None);
        }
        let mut start = addr;
        while start < addr + len {
            let piece = (addr + len - start).min(MAX_FIXED_BUFFER);
            // SAFETY: forwarded from the caller: the memory stays mapped while the region lives,
            // and the region releases every slot it took when dropped.
            match unsafe { region.ring.register_buffer(start, piece) } {
                Ok(slot) => region.slots.push(slot),
                Err(e) => {
                    region.release_slots();
                    let why = match e.raw_os_error() {
                        Some(libc::ENXIO) => "the ring has no fixed-buffer table".to_owned(),
                        Some(libc::ENOSPC) => "the ring's 16384 fixed-buffer slots are in use".to_owned(),
                        Some(libc::ENOMEM) => format!("{} (RLIMIT_MEMLOCK too small to pin the region?)", describe_os_error(&e)),
                        _ => format!("{} (file-backed or special mapping?)", describe_os_error(&e)),
                    };
                    return (region, Some(FixedBufferFallback(why)));
                }
            }
            start += piece;
        }
        (region, None)
    }

    /// The fixed-buffer slot covering `addr` and the address where that slot ends.
    pub fn fixed_slot(&self, addr: u64) -> Option<(u16, u64)> {
        if self.slots.is_empty() || addr < self.addr || addr >= self.addr + self.len {
            return None;
        }
        let i = ((addr - self.addr) / MAX_FIXED_BUFFER) as usize;
        let end = (self.addr + (i as u64 + 1) * MAX_FIXED_BUFFER).min(self.addr + self.len);
        self.slots.get(i).map(|&s| (s, end))
    }

    /// Exports the region through udmabuf in slabs of at most 1 GiB and at most udmabuf's
    /// `size_limit_mb` (64 MiB by default upstream); returns why not, if it failed.
    pub fn export_udmabuf(&mut self) -> Result<()> {
        let (start, end) = (self.addr / PAGE * PAGE, (self.addr + self.len).div_ceil(PAGE) * PAGE);
        let cover = slab_ranges_of(self.addr, self.len, start, end, udmabuf::size_limit().unwrap_or(MAX_FIXED_BUFFER));
        let mut slabs = DmabufSlabs::new(cover, "not exported");
        let failure = slabs.export_all(|start, len| {
            let (memfd, offset) = udmabuf::backing_memfd(start, len)?;
            udmabuf::seal_shrink(std::os::fd::AsRawFd::as_raw_fd(&memfd))?;
            udmabuf::create(std::os::fd::AsRawFd::as_raw_fd(&memfd), offset, len).map(Into::into)
        });
        self.dmabuf = Some(slabs);
        failure
    }

    fn release_slots(&mut self) {
        for slot in self.slots.drain(..) {
            self.ring.release_buffer(slot);
        }
    }
}

impl Drop for DramRegion {
    fn drop(&mut self) {
        self.release_slots();
    }
}
