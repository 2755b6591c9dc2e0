//! registerMem and deregisterMem: DRAM (fixed-buffer slots, an optional udmabuf export), VRAM
//! (the GPU provider loaded on first use, the one-time work of the routes it may take), FILE
//! and BLK (path-mode devIds unique per file), each handed to NIXL as a live-registry token.

use std::ffi::c_void;
use std::sync::Arc;

use super::{dmabuf_support, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::cufile::CuFile;
use crate::gpu::{self, GpuProvider};
use crate::mem::{DramRegion, FileRegion, MemKind, Registration, VramRegion};
use crate::params::{DramDmabuf, FixedBuffers, VramPath};
use crate::uring::dmabuf_uapi::DmabufSupport;

impl Engine {
    /// Registers one descriptor; returns the MD pointer handed to NIXL.
    pub fn register(
        &self,
        kind: i32,
        addr: u64,
        len: u64,
        dev_id: u64,
        meta_info: &str,
    ) -> Result<*const c_void> {
        self.failure.check()?;
        let kind = MemKind::from_nixl(kind)
            .ok_or_else(|| Error::invalid(format!("registerMem: unknown memory kind {kind}")))?;
        if len == 0 {
            return Err(Error::invalid(format!(
                "registerMem: {} descriptor devId {dev_id} at {addr} has zero length",
                kind.name()
            )));
        }
        let reg = match kind {
            MemKind::Dram => Registration::Dram(self.register_dram(addr, len, dev_id)?),
            MemKind::Vram => Registration::Vram(self.register_vram(addr, len, dev_id)?),
            MemKind::File | MemKind::Blk => {
                Registration::Storage(self.register_storage(kind, addr, len, dev_id, meta_info)?)
            }
            other => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    format!(
                        "registerMem: {} is not supported by IO_URING_DMABUF (supported: \
                         DRAM_SEG, VRAM_SEG, FILE_SEG, BLK_SEG)",
                        other.name()
                    ),
                ))
            }
        };
        let md = self.registry.insert(reg);
        if let Some(r) = &self.recorder {
            r.register(md as usize, kind.to_nixl(), addr, len, dev_id, meta_info);
        }
        Ok(md)
    }

    fn register_dram(&self, addr: u64, len: u64, dev_id: u64) -> Result<DramRegion> {
        if addr == 0 || addr.checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "registerMem: DRAM range 0x{addr:x}+{len} is not a valid address range"
            )));
        }
        let want_fixed = self.params.fixed_buffers == FixedBuffers::Auto;
        // SAFETY: NIXL's contract: registered memory stays mapped until deregisterMem, and the
        // region (with its pinned slots, taken on first use) is dropped only after
        // deregistration and the release of every request using it.
        let mut region =
            unsafe { DramRegion::register(Arc::clone(&self.ring), addr, len, dev_id, want_fixed) };
        match (self.params.dram_dmabuf, dmabuf_support()) {
            (DramDmabuf::On, DmabufSupport::Absent(why)) => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    format!("registerMem: dram_dmabuf=on cannot work here: {why}"),
                ))
            }
            (DramDmabuf::On, DmabufSupport::Available) => {
                if let Err(why) = region.export_udmabuf() {
                    return Err(Error::not_supported(format!(
                        "registerMem: dram_dmabuf=on: DRAM 0x{addr:x}+{len}: {why}"
                    ))
                    .caused_by(why));
                }
            }
            (DramDmabuf::Auto, DmabufSupport::Available) => {
                if let Err(why) = region.export_udmabuf() {
                    tracing::debug!("DRAM 0x{addr:x}+{len} stays on fixed buffers: {why}");
                }
            }
            _ => {}
        }
        Ok(region)
    }

    fn gpu(&self) -> Result<Arc<dyn GpuProvider>> {
        self.gpu
            .get_or_init(|| {
                let p = gpu::load(self.params.gpu_provider)?;
                tracing::info!("GPU provider {}: {}", p.name(), p.describe());
                Ok(p)
            })
            .clone()
    }

    fn register_vram(&self, addr: u64, len: u64, dev_id: u64) -> Result<VramRegion> {
        let device = i32::try_from(dev_id).map_err(|_| {
            Error::invalid(format!(
                "registerMem: VRAM devId {dev_id} is not a GPU ordinal"
            ))
        })?;
        let provider = self.gpu()?;
        let (export, required) = match self.params.vram_path {
            VramPath::Dmabuf => {
                if let DmabufSupport::Absent(why) = dmabuf_support() {
                    return Err(Error::new(
                        ErrorKind::NotSupported,
                        format!("registerMem: vram_path=dmabuf cannot work here: {why}"),
                    ));
                }
                (true, true)
            }
            VramPath::Cufile => {
                CuFile::load().map_err(|e| {
                    Error::new(
                        ErrorKind::NotSupported,
                        format!("registerMem: vram_path=cufile: {}", e.message),
                    )
                })?;
                (false, false)
            }
            VramPath::Auto => (dmabuf_support().is_available(), false),
            VramPath::Staging => (false, false),
        };
        let region =
            VramRegion::register(Arc::clone(&provider), addr, len, device, export, required)?;
        self.prepare_vram_paths(&provider)?;
        Ok(region)
    }

    /// Does now, at registration, the one-time work the first transfer of this VRAM would
    /// otherwise pay (clients time their first put; LMCache registers its buffer at start-up):
    /// opening cuFile's driver to learn its mode (hundreds of ms in compatibility mode) and
    /// mapping and pinning the staging pool, where the route can end on staging. With DMA-BUF
    /// available (auto) neither is needed until a pair fails to bind, so nothing is done.
    fn prepare_vram_paths(&self, provider: &Arc<dyn GpuProvider>) -> Result<()> {
        let staging_possible = match self.params.vram_path {
            VramPath::Staging => true,
            VramPath::Auto if !dmabuf_support().is_available() => !gpu::cufile::mode().0,
            VramPath::Auto | VramPath::Dmabuf | VramPath::Cufile => false,
        };
        if staging_possible {
            self.driver
                .enable_staging(Arc::clone(provider), self.staging_shape())?;
        }
        Ok(())
    }

    fn register_storage(
        &self,
        kind: MemKind,
        offset: u64,
        len: u64,
        dev_id: u64,
        meta_info: &str,
    ) -> Result<FileRegion> {
        let region = FileRegion::register(
            Arc::clone(&self.ring),
            kind,
            offset,
            len,
            dev_id,
            meta_info,
            self.params.fixed_files,
        )?;
        if region.owned_path.is_some() {
            let mut ids = self.failure.lock(&self.path_dev_ids, "path-mode devIds")?;
            if !ids.insert(dev_id) {
                return Err(Error::invalid(format!(
                    "registerMem: path-mode devId {dev_id} is already registered for another \
                     file; path-mode devIds must be unique per file"
                )));
            }
        }
        Ok(region)
    }

    /// Drops NIXL's reference to a registration. Requests that still use it keep it alive. An
    /// `md` that is not live is refused without being touched.
    pub fn deregister(&self, md: *const c_void) -> Result<()> {
        self.failure.check()?;
        if md.is_null() {
            return Err(Error::invalid("deregisterMem: null metadata"));
        }
        let Some(reg) = self.registry.remove(md) else {
            return Err(Error::not_found(format!(
                "deregisterMem: MD {md:p} is not a live registration of this engine (deregistered \
                 already?); NIXL's registration lists can hand an MD back twice when several \
                 threads use an agent in sync mode NONE, which takes no locks: create the agent \
                 with sync mode RW"
            )));
        };
        if let Some(r) = &self.recorder {
            r.deregister(md as usize);
        }
        // A later registration may reuse the address once this one is gone. A file's routes go
        // too: a client registering a file per key (LMCache's dynamic mode) would otherwise grow
        // the cache by one route per file, and a later file with the same fd, device and inode
        // would find this file's route.
        self.routes.forget(&reg)?;
        if let Registration::Storage(f) = &*reg {
            if f.owned_path.is_some() {
                self.failure
                    .lock(&self.path_dev_ids, "path-mode devIds")?
                    .remove(&f.dev_id);
            }
        }
        drop(reg);
        Ok(())
    }
}
