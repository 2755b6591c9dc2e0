//! The DMA-BUF side of a memory registration (GPU memory exported by a GPU provider, or host
//! memory exported through udmabuf): ≤1 GiB page-aligned slabs, each with its DMA-BUF fd, and the
//! io_uring slots bound for them, released with the registration.

use std::os::fd::OwnedFd;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::gpu::DmabufExport;
use crate::uring::dmabuf_uapi::MAX_DMABUF_SLAB;

/// Host page size assumed for DMA-BUF export alignment.
pub const PAGE: u64 = 4096;

/// One ≤1 GiB, page-aligned piece of a registration.
pub struct Slab {
    pub start: u64,
    pub len: u64,
    /// The exported DMA-BUF, when one was wanted and the export worked.
    pub dmabuf: Option<OwnedFd>,
    /// Where `start` sits inside that DMA-BUF (HSA may export the whole allocation; CUDA and
    /// udmabuf export exactly the slab, offset 0).
    pub export_offset: u64,
}

impl Slab {
    /// The I/O address of `addr` (inside this slab) as an offset into the slab's DMA-BUF.
    pub fn dmabuf_offset_of(&self, addr: u64) -> u64 {
        self.export_offset + (addr - self.start)
    }
}

/// Slabs and their DMA-BUFs of one registration.
pub struct DmabufSlabs {
    pub slabs: Vec<Slab>,
    /// Why the slabs have no DMA-BUFs (export failed or was not attempted).
    pub export_note: Option<String>,
    /// Releases the DMA-BUF slots bound for this registration when it is dropped.
    pub on_drop: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl DmabufSlabs {
    /// Slabs covering `ranges`, none exported yet.
    pub fn new(ranges: Vec<(u64, u64)>, note: &str) -> DmabufSlabs {
        DmabufSlabs {
            slabs: ranges
                .into_iter()
                .map(|(start, len)| Slab {
                    start,
                    len,
                    dmabuf: None,
                    export_offset: 0,
                })
                .collect(),
            export_note: Some(note.to_owned()),
            on_drop: Mutex::new(Vec::new()),
        }
    }

    /// Exports every slab with `export`; on the first failure keeps none and records why.
    /// Returns the failure, if any (the export's error is its source).
    pub fn export_all(
        &mut self,
        mut export: impl FnMut(u64, u64) -> Result<DmabufExport>,
    ) -> Result<()> {
        for i in 0..self.slabs.len() {
            let (start, len) = (self.slabs[i].start, self.slabs[i].len);
            let export = export(start, len).and_then(|e| match e.whole_size {
                // One DMA-BUF is one io_uring buffer, at most MAX_DMABUF_SLAB bytes.
                Some(size) if size > MAX_DMABUF_SLAB => Err(Error::not_supported(format!(
                    "the provider exports a DMA-BUF of the whole allocation ({size} bytes), over \
                     the {MAX_DMABUF_SLAB} byte limit for one io_uring DMA-BUF buffer (v3 of the \
                     kernel series; later versions relax it to a value not known here); allocate \
                     at most 1 GiB per allocation (per iud_vulkan_alloc) for the dmabuf path"
                ))),
                _ => Ok(e),
            });
            match export {
                Ok(e) => {
                    self.slabs[i].dmabuf = Some(e.fd);
                    self.slabs[i].export_offset = e.offset;
                }
                Err(e) => {
                    let why = Error::new(
                        e.kind,
                        format!("DMA-BUF export of slab 0x{start:x}+{len} failed: {e}"),
                    )
                    .caused_by(e);
                    for s in &mut self.slabs {
                        s.dmabuf = None;
                        s.export_offset = 0;
                    }
                    self.export_note = Some(why.message.clone());
                    return Err(why);
                }
            }
        }
        self.export_note = None;
        Ok(())
    }

    /// Index of the slab containing `addr`, and the address where it ends.
    pub fn slab_at(&self, addr: u64) -> Option<(usize, u64)> {
        // Slabs are sorted and contiguous, but not all 1 GiB: udmabuf's size limit can make
        // them smaller.
        let i = self.slabs.partition_point(|s| s.start + s.len <= addr);
        self.slabs
            .get(i)
            .filter(|s| addr >= s.start)
            .map(|s| (i, s.start + s.len))
    }
}

impl Drop for DmabufSlabs {
    fn drop(&mut self) {
        for release in self
            .on_drop
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            release();
        }
    }
}

/// The page-aligned cover of `[addr, addr+len)` inside `[alloc_start, alloc_end)`, cut into
/// ≤1 GiB slabs (`MAX_DMABUF_SLAB`: the DMA-BUF size every posting of the series accepts).
pub fn slab_ranges(addr: u64, len: u64, alloc_start: u64, alloc_end: u64) -> Vec<(u64, u64)> {
    slab_ranges_of(addr, len, alloc_start, alloc_end, MAX_DMABUF_SLAB)
}

/// As [`slab_ranges`], with slabs of at most `max_slab` bytes (a page multiple).
pub fn slab_ranges_of(
    addr: u64,
    len: u64,
    alloc_start: u64,
    alloc_end: u64,
    max_slab: u64,
) -> Vec<(u64, u64)> {
    let max_slab = (max_slab / PAGE * PAGE).clamp(PAGE, MAX_DMABUF_SLAB);
    let start = (addr / PAGE * PAGE).max(alloc_start);
    let end = (addr + len)
        .div_ceil(PAGE)
        .saturating_mul(PAGE)
        .min(alloc_end);
    let mut out = Vec::new();
    let mut s = start;
    while s < end {
        let n = (end - s).min(max_slab);
        out.push((s, n));
        s += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaller_slabs_when_the_exporter_caps_the_size() {
        let mib = 1u64 << 20;
        let base = 0x7f00_0000_0000;
        let s = slab_ranges_of(base, 96 * mib, base, base + 96 * mib, 64 * mib);
        assert_eq!(s, vec![(base, 64 * mib), (base + 64 * mib, 32 * mib)]);
        // A cap above 1 GiB still yields 1 GiB slabs (io_uring's registered-buffer limit).
        assert_eq!(
            slab_ranges_of(base, 3 << 30, base, base + (3 << 30), 8 << 30).len(),
            3
        );
    }

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

    #[test]
    fn a_failed_export_keeps_no_dmabuf_and_says_why() {
        let gib = 1u64 << 30;
        let mut d = DmabufSlabs::new(vec![(0, gib), (gib, 4096)], "not attempted");
        let why = d.export_all(|start, _| {
            if start == 0 {
                Err(Error::backend("nope").with_errno(libc::EIO))
            } else {
                unreachable!()
            }
        });
        let why = why.unwrap_err();
        assert!(why.message.contains("nope"));
        assert_eq!(
            why.context.errno,
            Some(libc::EIO),
            "the export's context is kept"
        );
        assert!(d.slabs.iter().all(|s| s.dmabuf.is_none()));
        assert!(d.export_note.is_some());
        assert_eq!(d.slab_at(5000), Some((0, gib)));
        assert_eq!(d.slab_at(gib + 100), Some((1, gib + 4096)));
        assert_eq!(d.slab_at(gib + 5000), None);
    }

    #[test]
    fn slab_lookup_works_for_slabs_smaller_than_one_gib() {
        let mib = 1u64 << 20;
        let base = 0x7f00_0000_0000;
        let d = DmabufSlabs::new(
            slab_ranges_of(base, 96 * mib, base, base + 96 * mib, 64 * mib),
            "not attempted",
        );
        assert_eq!(d.slab_at(base - 1), None);
        assert_eq!(d.slab_at(base), Some((0, base + 64 * mib)));
        assert_eq!(d.slab_at(base + 64 * mib - 1), Some((0, base + 64 * mib)));
        assert_eq!(d.slab_at(base + 64 * mib), Some((1, base + 96 * mib)));
        assert_eq!(d.slab_at(base + 96 * mib - 1), Some((1, base + 96 * mib)));
        assert_eq!(d.slab_at(base + 96 * mib), None);
    }

    #[test]
    fn export_offsets_shift_io_addresses_into_the_dmabuf() {
        use std::os::fd::{FromRawFd, OwnedFd};
        let gib = 1u64 << 30;
        let base = 0x7000_0000_0000u64;
        let mut d = DmabufSlabs::new(vec![(base, gib), (base + gib, 8192)], "not attempted");
        let why = d.export_all(|start, _| {
            // SAFETY: a fresh fd from dup that the export now owns.
            let fd = unsafe { OwnedFd::from_raw_fd(libc::dup(0).max(libc::dup(2))) };
            // An allocation-wide export: the slab sits (start - base) + 64 KiB into the DMA-BUF.
            Ok(DmabufExport {
                fd,
                offset: start - base + 65536,
                whole_size: None,
            })
        });
        assert!(why.is_ok());
        assert_eq!(d.slabs[0].dmabuf_offset_of(base + 4096), 65536 + 4096);
        assert_eq!(
            d.slabs[1].dmabuf_offset_of(base + gib + 100),
            gib + 65536 + 100
        );
    }
}
