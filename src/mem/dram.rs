//! DRAM registrations: host memory, registered with io_uring as fixed buffers when possible.
//!
//! A region longer than the kernel's 1 GiB fixed-buffer limit takes several consecutive slots;
//! the planner splits descriptors at slot boundaries. If the kernel refuses (file-backed
//! mappings, RLIMIT_MEMLOCK, table full), the region uses plain READ/WRITE instead.
//!
//! The slots are taken when a request first plans I/O on the region, not in registerMem:
//! pinning costs milliseconds (7 ms for 8 MiB on the 2-CPU VM), and in sync mode NONE NIXL
//! runs its unlocked registration lists around registerMem, so every millisecond spent there
//! widens a race that corrupts NIXL's heap (docs/reliability.md, "Sync mode NONE", issue 48).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use once_cell::sync::OnceCell;

use crate::error::{describe_os_error, Result};
use crate::mem::dmabuf_slabs::{slab_ranges_of, DmabufSlabs, PAGE};
use crate::mem::udmabuf;
use crate::uring::{Ring, MAX_FIXED_BUFFER};

/// A registered host-memory range.
pub struct DramRegion {
    pub addr: u64,
    pub len: u64,
    pub dev_id: u64,
    /// Whether the region should use fixed buffers (`fixed_buffers=auto`).
    want_fixed: bool,
    /// Fixed-buffer slots covering consecutive MAX_FIXED_BUFFER pieces from `addr`, taken on
    /// first use (empty when refused).
    slots: OnceCell<Vec<u16>>,
    /// The udmabuf export of the region (`dram_dmabuf`), when one was attempted.
    pub dmabuf: Option<DmabufSlabs>,
    ring: Arc<Ring>,
}

impl fmt::Debug for DramRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DramRegion(0x{:x}+{}, slots {:?})",
            self.addr,
            self.len,
            self.slots.get()
        )
    }
}

impl DramRegion {
    /// Registers `[addr, addr+len)`; with `want_fixed`, the region takes fixed-buffer slots
    /// the first time a request plans I/O on it ([`DramRegion::fixed_slot`]), or uses plain
    /// READ/WRITE if the kernel refuses (logged then).
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
    ) -> DramRegion {
        DramRegion {
            addr,
            len,
            dev_id,
            want_fixed,
            slots: OnceCell::new(),
            dmabuf: None,
            ring,
        }
    }

    /// Registers the region's fixed-buffer slots; none when not wanted or refused.
    fn take_slots(&self) -> Vec<u16> {
        let mut slots = Vec::new();
        if !self.want_fixed {
            return slots;
        }
        let mut start = self.addr;
        while start < self.addr + self.len {
            let piece = (self.addr + self.len - start).min(MAX_FIXED_BUFFER);
            // SAFETY: `register`'s contract: the memory stays mapped while the region lives,
            // and the region releases every slot it took when dropped.
            match unsafe { self.ring.register_buffer(start, piece) } {
                Ok(slot) => slots.push(slot),
                Err(e) => {
                    for slot in slots.drain(..) {
                        self.ring.release_buffer(slot);
                    }
                    let why = match e.raw_os_error() {
                        Some(libc::ENXIO) => "the ring has no fixed-buffer table".to_owned(),
                        Some(libc::ENOSPC) => {
                            "the ring's 16384 fixed-buffer slots are in use".to_owned()
                        }
                        Some(libc::ENOMEM) => format!(
                            "{} (RLIMIT_MEMLOCK too small to pin the region?)",
                            describe_os_error(&e)
                        ),
                        _ => format!(
                            "{} (file-backed or special mapping?)",
                            describe_os_error(&e)
                        ),
                    };
                    log_fallback(self.addr, self.len, &why);
                    return slots;
                }
            }
            start += piece;
        }
        slots
    }

    /// The fixed-buffer slot covering `addr` and the address where that slot ends. The first
    /// call registers the region's slots.
    pub fn fixed_slot(&self, addr: u64) -> Option<(u16, u64)> {
        if !self.want_fixed || addr < self.addr || addr >= self.addr + self.len {
            return None;
        }
        let slots = self.slots.get_or_init(|| self.take_slots());
        let i = ((addr - self.addr) / MAX_FIXED_BUFFER) as usize;
        let end = (self.addr + (i as u64 + 1) * MAX_FIXED_BUFFER).min(self.addr + self.len);
        slots.get(i).map(|&s| (s, end))
    }

    /// Exports the region through udmabuf in slabs of at most 1 GiB and at most udmabuf's
    /// `size_limit_mb` (64 MiB by default upstream); returns why not, if it failed.
    pub fn export_udmabuf(&mut self) -> Result<()> {
        let (start, end) = (
            self.addr / PAGE * PAGE,
            (self.addr + self.len).div_ceil(PAGE) * PAGE,
        );
        let cover = slab_ranges_of(
            self.addr,
            self.len,
            start,
            end,
            udmabuf::size_limit().unwrap_or(MAX_FIXED_BUFFER),
        );
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
        for slot in self.slots.take().unwrap_or_default() {
            self.ring.release_buffer(slot);
        }
    }
}

/// Logs a region's fallback to plain READ/WRITE: the first at info level, later ones at debug.
fn log_fallback(addr: u64, len: u64, why: &str) {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "DRAM region 0x{addr:x}+{len} uses plain READ/WRITE instead of fixed buffers: {why}; \
             further fallbacks are logged at debug level"
        );
    } else {
        tracing::debug!("DRAM region 0x{addr:x}+{len} uses plain READ/WRITE: {why}");
    }
}

impl Drop for DramRegion {
    fn drop(&mut self) {
        self.release_slots();
    }
}
