//! VRAM registrations: GPU memory of any size, seen as page-aligned slabs of at most 1 GiB (the
//! io_uring per-buffer limit), each exportable as a DMA-BUF.
//!
//! The path that moves a registration's bytes (dmabuf, cufile or staging) is chosen per
//! (registration, target) the first time a request pairs them, and logged once with the reason.
//! Descriptors are split at slab boundaries so that no I/O straddles two DMA-BUFs.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::gpu::GpuProvider;
use crate::uring::{FileKey, MAX_FIXED_BUFFER};

/// Host page size assumed for DMA-BUF export alignment.
pub const PAGE: u64 = 4096;

/// One ≤1 GiB, page-aligned piece of a VRAM registration.
pub struct Slab {
    pub start: u64,
    pub len: u64,
    /// The exported DMA-BUF, when the dmabuf path wanted one and the export worked.
    pub dmabuf: Option<OwnedFd>,
}

/// How a (registration, target) pair moves bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VramRoute {
    /// GPU memory registered with io_uring as DMA-BUF; fixed-buffer slot per slab.
    Dmabuf { slots: Vec<u16> },
    /// Through the pinned host staging pool.
    Staging,
}

/// A registered range of GPU memory.
pub struct VramRegion {
    pub addr: u64,
    pub len: u64,
    pub device: i32,
    pub provider: Arc<dyn GpuProvider>,
    pub slabs: Vec<Slab>,
    /// Why the slabs have no DMA-BUFs (export failed or was not attempted).
    pub export_note: Option<String>,
    /// Decided routes per target file, with the reason logged when decided.
    pub routes: Mutex<HashMap<FileKey, VramRoute>>,
    /// Releases the DMA-BUF slots bound for this region when it is dropped.
    pub on_drop: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl fmt::Debug for VramRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VramRegion(dev {}, 0x{:x}+{}, {} slabs)", self.device, self.addr, self.len, self.slabs.len())
    }
}

/// The page-aligned cover of `[addr, addr+len)` inside its allocation, cut into ≤1 GiB slabs.
pub fn slab_ranges(addr: u64, len: u64, alloc_start: u64, alloc_end: u64) -> Vec<(u64, u64)> {
    let start = (addr / PAGE * PAGE).max(alloc_start);
    let end = (addr + len).div_ceil(PAGE).saturating_mul(PAGE).min(alloc_end);
    let mut out = Vec::new();
    let mut s = start;
    while s < end {
        let n = (end - s).min(MAX_FIXED_BUFFER);
        out.push((s, n));
        s += n;
    }
    out
}

impl VramRegion {
    /// Validates the range with the provider and lays out its slabs; with `export`, exports
    /// every slab as a DMA-BUF (an export failure is fatal only when `export_required`).
    pub fn register(
        provider: Arc<dyn GpuProvider>,
        addr: u64,
        len: u64,
        device: i32,
        export: bool,
        export_required: bool,
    ) -> Result<VramRegion> {
        let range = provider.check_device_range(device, addr, len)?;
        let mut slabs: Vec<Slab> = slab_ranges(addr, len, range.alloc_start, range.alloc_end)
            .into_iter()
            .map(|(start, len)| Slab { start, len, dmabuf: None })
            .collect();
        let mut export_note = Some("DMA-BUF export not attempted (the dmabuf path is not in use)".to_owned());
        if export {
            let mut failure = None;
            for slab in &mut slabs {
                match provider.export_dmabuf(device, slab.start, slab.len) {
                    Ok(fd) => slab.dmabuf = Some(fd),
                    Err(e) => {
                        failure = Some(format!("DMA-BUF export of slab 0x{:x}+{} failed: {}", slab.start, slab.len, e.message));
                        break;
                    }
                }
            }
            match failure {
                Some(why) if export_required => return Err(crate::error::Error::backend(format!("VRAM registration 0x{addr:x}+{len}: {why}"))),
                Some(why) => {
                    for slab in &mut slabs {
                        slab.dmabuf = None;
                    }
                    export_note = Some(why);
                }
                None => export_note = None,
            }
        }
        Ok(VramRegion {
            addr,
            len,
            device,
            provider,
            slabs,
            export_note,
            routes: Mutex::new(HashMap::new()),
            on_drop: Mutex::new(Vec::new()),
        })
    }

    /// Index of the slab containing `addr`, and the address where it ends.
    pub fn slab_at(&self, addr: u64) -> Option<(usize, u64)> {
        let first = self.slabs.first()?;
        if addr < first.start {
            return None;
        }
        let i = ((addr - first.start) / MAX_FIXED_BUFFER) as usize;
        self.slabs.get(i).filter(|s| addr < s.start + s.len).map(|s| (i, s.start + s.len))
    }
}

impl Drop for VramRegion {
    fn drop(&mut self) {
        for release in self.on_drop.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_cover_the_page_aligned_range_in_one_gib_pieces() {
        let gib = 1u64 << 30;
        let base = 0x7f00_0000_0000;
        // 2.5 GiB starting 512 bytes into a page-aligned allocation.
        let s = slab_ranges(base + 512, 5 * gib / 2, base, base + 3 * gib);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0], (base, gib));
        assert_eq!(s[1], (base + gib, gib));
        assert_eq!(s[2].0, base + 2 * gib);
        assert_eq!(s[2].1, (5 * gib / 2 + 512).div_ceil(PAGE) * PAGE - 2 * gib);
    }

    #[test]
    fn slabs_never_leave_the_allocation() {
        let s = slab_ranges(0x1000_0200, 100, 0x1000_0100, 0x1000_0400);
        assert_eq!(s, vec![(0x1000_0100, 0x300)]);
    }
}
