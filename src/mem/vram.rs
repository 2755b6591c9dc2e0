//! VRAM registrations: GPU memory of any size, seen as page-aligned slabs of at most 1 GiB (the
//! io_uring per-buffer limit), each exportable as a DMA-BUF by the GPU provider.
//!
//! The path that moves a registration's bytes (dmabuf, cufile or staging) is chosen per
//! (registration, target) the first time a request pairs them, and logged once with the reason.
//! Descriptors are split at slab boundaries so that no I/O straddles two DMA-BUFs.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::GpuProvider;
use crate::mem::dmabuf_slabs::{slab_ranges, DmabufSlabs};

/// A registered range of GPU memory.
pub struct VramRegion {
    pub addr: u64,
    pub len: u64,
    pub device: i32,
    pub provider: Arc<dyn GpuProvider>,
    pub dmabuf: DmabufSlabs,
    /// The cuFile buffer registration (None inside: cuFile refused it; compatibility mode works
    /// without one), made when the cuFile sub-path is first chosen.
    pub cufile: once_cell::sync::OnceCell<Option<crate::gpu::cufile::CuFileBuffer>>,
}

impl fmt::Debug for VramRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VramRegion(dev {}, 0x{:x}+{}, {} slabs)",
            self.device,
            self.addr,
            self.len,
            self.dmabuf.slabs.len()
        )
    }
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
        let mut dmabuf = DmabufSlabs::new(
            slab_ranges(addr, len, range.alloc_start, range.alloc_end),
            "DMA-BUF export not attempted (the dmabuf path is not in use)",
        );
        if export {
            let p = Arc::clone(&provider);
            if let Err(why) = dmabuf.export_all(|start, n| p.export_dmabuf(device, start, n)) {
                if export_required {
                    return Err(Error::backend(format!(
                        "VRAM registration 0x{addr:x}+{len}: {why}"
                    ))
                    .caused_by(why));
                }
            }
        }
        Ok(VramRegion {
            addr,
            len,
            device,
            provider,
            dmabuf,
            cufile: once_cell::sync::OnceCell::new(),
        })
    }
}
