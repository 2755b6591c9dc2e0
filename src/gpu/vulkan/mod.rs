//! The Vulkan provider (`gpu_provider = vulkan`): moves memory that applications allocated
//! through the plugin's own small C API (`iud_vulkan_alloc`, see include/iud_vulkan.h and
//! `ffi::vulkan_alloc`, which calls [`VulkanProvider`]), because a NIXL registration is only (addr, len, devId) and the plugin must map the
//! address back to its Vulkan allocation.
//!
//! Each allocation is a dedicated, exportable VkBuffer allocation on the Vulkan device that
//! matches the CUDA ordinal (by device UUID) when libcuda is present, else on the Vulkan device of
//! that index. Which of four variants runs depends on what the driver offers
//! (`vkGetPhysicalDeviceExternalBufferProperties`):
//!
//! | variant                | memory exported as    | address apps register | DMA-BUF from         | copies |
//! |------------------------|-----------------------|-----------------------|----------------------|--------|
//! | `vulkan-dmabuf+cuda`   | DMA_BUF_EXT+OPAQUE_FD | CUDA import           | Vulkan (DMA_BUF_EXT) | CUDA   |
//! | `opaque-fd+cuda`       | OPAQUE_FD (NVIDIA)    | CUDA import           | CUDA (imported mem.) | CUDA   |
//! | `vulkan-dmabuf+host`   | DMA_BUF_EXT           | host mapping          | Vulkan (DMA_BUF_EXT) | memcpy |
//! | `host-mapped`          | OPAQUE_FD if offered  | host mapping          | none                 | memcpy |
//!
//! Vulkan DMA-BUF exports cover the whole allocation; [`DmabufExport::offset`] says where the
//! slab sits in it. The registry is process-wide: a Python application loads the same plugin
//! file with ctypes that NIXL loads, and both get the same library instance.
//!
//! Registrations go through the same slab, self-test and path-selection code as CUDA
//! (`mem::vram`, `engine`); this module only answers the provider questions.

pub mod driver;
mod provider;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use once_cell::sync::{Lazy, OnceCell};

use super::cuda::import::ImportedMemory;
use super::cuda::Cuda;
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::provider::GpuProvider;

/// Allocation sizes are rounded up to host pages (the DMA-BUF export and mmap granule).
const PAGE: u64 = 4096;
use driver::{AllocSpec, HandleSupport, PhysicalDevice, VkAllocation, Vulkan, DMA_BUF, OPAQUE_FD};

/// How an allocation is made, addressed and exported (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    DmabufCuda,
    OpaqueCuda,
    DmabufHost,
    HostMapped,
}

impl Variant {
    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("?")
    }
    /// The name as a static C string (what `iud_vulkan_variant` returns).
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Variant::DmabufCuda => c"vulkan-dmabuf+cuda",
            Variant::OpaqueCuda => c"opaque-fd+cuda",
            Variant::DmabufHost => c"vulkan-dmabuf+host",
            Variant::HostMapped => c"host-mapped",
        }
    }
    fn explain(self) -> &'static str {
        match self {
            Variant::DmabufCuda => {
                "exportable as DMA_BUF_EXT and OPAQUE_FD: CUDA imports the OPAQUE_FD for the \
                 address and copies, Vulkan exports the DMA-BUF"
            }
            Variant::OpaqueCuda => {
                "exportable as OPAQUE_FD only: CUDA imports it for the address and copies and is \
                 asked for the DMA-BUF"
            }
            Variant::DmabufHost => {
                "exportable as DMA_BUF_EXT, no CUDA device for it: host-mapped address, memcpy \
                 copies, Vulkan exports the DMA-BUF"
            }
            Variant::HostMapped => {
                "no DMA_BUF_EXT export and no CUDA device for it: host-mapped address, memcpy \
                 copies, no DMA-BUF (staging only)"
            }
        }
    }
    fn uses_cuda(self) -> bool {
        matches!(self, Variant::DmabufCuda | Variant::OpaqueCuda)
    }
}

/// The variant for a physical device, the handle types to allocate with, or why none works.
fn plan(pd: &PhysicalDevice, cuda: bool) -> Result<(Variant, AllocSpec)> {
    let spec = |export, host_mapped| AllocSpec {
        size: 0,
        export,
        host_mapped,
    };
    let both = |a: &HandleSupport, b: &HandleSupport| {
        a.exportable() && b.exportable() && a.compatible.contains(b.handle_type)
    };
    if cuda {
        if both(&pd.dma_buf, &pd.opaque_fd) {
            return Ok((Variant::DmabufCuda, spec(DMA_BUF | OPAQUE_FD, false)));
        }
        if pd.opaque_fd.exportable() {
            return Ok((Variant::OpaqueCuda, spec(OPAQUE_FD, false)));
        }
    }
    if pd.host_visible() {
        if pd.dma_buf.exportable() {
            return Ok((Variant::DmabufHost, spec(DMA_BUF, true)));
        }
        let export = if pd.opaque_fd.exportable() {
            OPAQUE_FD
        } else {
            ash::vk::ExternalMemoryHandleTypeFlags::empty()
        };
        return Ok((Variant::HostMapped, spec(export, true)));
    }
    Err(Error::new(
        ErrorKind::NotSupported,
        format!(
            "{}: no usable variant ({}; {}; {}; {})",
            pd.name,
            pd.dma_buf.describe(),
            pd.opaque_fd.describe(),
            if cuda {
                "CUDA device matched"
            } else {
                "no CUDA device matched"
            },
            "no HOST_VISIBLE|HOST_COHERENT memory"
        ),
    ))
}

/// One allocation made through the C API.
pub struct Allocation {
    pub addr: u64,
    pub len: u64,
    pub device: i32,
    pub variant: Variant,
    // Field order is drop order: the CUDA mapping goes before the Vulkan memory it maps.
    cuda: Option<ImportedMemory>,
    vk: VkAllocation,
}

impl Allocation {
    /// A pointer-sized view for memcpy copies (host-mapped variants only).
    fn host_range(&self, addr: u64, len: u64) -> Result<u64> {
        match self.vk.host_ptr {
            Some(p)
                if self.cuda.is_none()
                    && addr >= self.addr
                    && addr + len <= self.addr + self.len =>
            {
                Ok(p + (addr - self.addr))
            }
            _ => Err(Error::backend(format!(
                "internal error: 0x{addr:x}+{len} is not host-mapped Vulkan memory"
            ))),
        }
    }
}

/// Allocations by address (process-wide: the C API and every engine share it).
static REGISTRY: Lazy<Mutex<BTreeMap<u64, Arc<Allocation>>>> =
    Lazy::new(|| Mutex::new(BTreeMap::new()));
/// (device, variant) pairs already logged.
static LOGGED: Lazy<Mutex<HashSet<(i32, Variant)>>> = Lazy::new(|| Mutex::new(HashSet::new()));

/// The allocation containing `[addr, addr+len)`, if any.
pub fn lookup(addr: u64, len: u64) -> Option<Arc<Allocation>> {
    let map = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    let (_, a) = map.range(..=addr).next_back()?;
    (addr.checked_add(len)? <= a.addr + a.len).then(|| Arc::clone(a))
}

/// The Vulkan provider: the loaded Vulkan instance plus CUDA when present.
pub struct VulkanProvider {
    vk: Arc<Vulkan>,
    cuda: Option<Arc<Cuda>>,
}

static PROVIDER: OnceCell<std::result::Result<Arc<VulkanProvider>, Error>> = OnceCell::new();

impl VulkanProvider {
    /// Loads Vulkan (and CUDA when present), once per process.
    pub fn get() -> Result<Arc<VulkanProvider>> {
        PROVIDER
            .get_or_init(|| {
                let vk = Vulkan::get()?;
                if vk.devices.is_empty() {
                    return Err(Error::new(
                        ErrorKind::NotSupported,
                        "the Vulkan loader found no device (no Vulkan driver installed? \
                         VK_DRIVER_FILES names the ICD JSON)",
                    ));
                }
                let cuda = Cuda::load().ok().filter(|c| c.device_count() > 0);
                Ok(Arc::new(VulkanProvider { vk, cuda }))
            })
            .clone()
    }

    /// The Vulkan device index for a devId, and whether a CUDA device is paired with it.
    fn resolve(&self, device: i32) -> Result<(usize, bool)> {
        if let Some(cuda) = &self.cuda {
            if device < 0 || device >= cuda.device_count() {
                return Err(Error::invalid(format!(
                    "CUDA device {device} does not exist ({} visible)",
                    cuda.device_count()
                )));
            }
            let uuid = cuda.device_uuid(device)?;
            return match self.vk.devices.iter().position(|d| d.uuid == uuid) {
                Some(i) => Ok((i, true)),
                None => Err(Error::new(
                    ErrorKind::NotSupported,
                    format!(
                        "no Vulkan device has the UUID of CUDA device {device} ({}); Vulkan sees: \
                         {}",
                        driver::uuid_string(&uuid),
                        self.vk
                            .devices
                            .iter()
                            .map(|d| d.describe())
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                )),
            };
        }
        usize::try_from(device)
            .ok()
            .filter(|&i| i < self.vk.devices.len())
            .map(|i| (i, false))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "Vulkan device {device} does not exist ({} visible)",
                    self.vk.devices.len()
                ))
            })
    }

    /// What `iud_vulkan_alloc` would do on `device`.
    pub fn plan_for(&self, device: i32) -> Result<(Variant, AllocSpec)> {
        let (index, cuda) = self.resolve(device)?;
        plan(&self.vk.devices[index], cuda)
    }

    /// Allocates `size` bytes on `device` and records the allocation; returns its address.
    pub fn allocate(&self, device: i32, size: u64) -> Result<Arc<Allocation>> {
        if size == 0 {
            return Err(Error::invalid("iud_vulkan_alloc: size 0"));
        }
        let len = size
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| Error::invalid(format!("iud_vulkan_alloc: size {size} too large")))?;
        let (index, _) = self.resolve(device)?;
        let (variant, mut spec) = self.plan_for(device)?;
        spec.size = len;
        let logical = self.vk.logical(index)?;
        let vk = match logical.allocate(spec) {
            // Host-mapped without DMA-BUF: the export type is only a convenience; retry plain if
            // no host-visible type can back an exportable buffer.
            Err(e)
                if variant == Variant::HostMapped
                    && !spec.export.is_empty()
                    && e.kind == ErrorKind::NotSupported =>
            {
                logical.allocate(AllocSpec {
                    export: ash::vk::ExternalMemoryHandleTypeFlags::empty(),
                    ..spec
                })?
            }
            r => r?,
        };
        let (addr, cuda) = if variant.uses_cuda() {
            let c = self
                .cuda
                .as_ref()
                .ok_or_else(|| Error::backend("internal error: a CUDA variant without CUDA"))?;
            let fd = vk.export_fd(OPAQUE_FD)?;
            let imported = c
                .import_opaque_fd(device, fd, vk.alloc_size, true)
                .map_err(|e| {
                    Error::new(
                        e.kind,
                        format!(
                            "CUDA could not import the Vulkan allocation (OPAQUE_FD): {}",
                            e.message
                        ),
                    )
                })?;
            (imported.ptr(), Some(imported))
        } else {
            (
                vk.host_ptr.ok_or_else(|| {
                    Error::backend("internal error: host variant without a mapping")
                })?,
                None,
            )
        };
        let a = Arc::new(Allocation {
            addr,
            len,
            device,
            variant,
            cuda,
            vk,
        });
        REGISTRY
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr, Arc::clone(&a));
        if LOGGED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((device, variant))
        {
            tracing::info!(
                "Vulkan allocations on device {device} ({}) use variant {}: {}",
                self.vk.devices[index].describe(),
                variant.name(),
                variant.explain()
            );
        }
        tracing::debug!(
            "iud_vulkan_alloc: 0x{addr:x}+{len} on device {device}, variant {}",
            variant.name()
        );
        Ok(a)
    }

    /// Forgets the allocation at `addr` (its start) and frees it once no copy holds it.
    pub fn free(addr: u64) -> Result<()> {
        let a = REGISTRY
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
        match a {
            Some(a) => {
                tracing::debug!("iud_vulkan_free: 0x{addr:x}+{}", a.len);
                Ok(())
            }
            None => Err(Error::invalid(format!(
                "iud_vulkan_free: 0x{addr:x} is not the start of an allocation made by \
                 iud_vulkan_alloc"
            ))),
        }
    }

    fn registered(&self, addr: u64, len: u64) -> Result<Arc<Allocation>> {
        lookup(addr, len).ok_or_else(|| {
            Error::invalid(format!(
                "VRAM 0x{addr:x}+{len} was not allocated through iud_vulkan_alloc of this plugin \
                 library (gpu_provider=vulkan moves only such memory; allocate with \
                 iud_vulkan_alloc, see include/iud_vulkan.h, or use gpu_provider=cuda)"
            ))
        })
    }
}

/// Loads the provider, or says why it is unavailable.
pub fn load() -> Result<Arc<dyn GpuProvider>> {
    VulkanProvider::get().map(|p| p as Arc<dyn GpuProvider>)
}

/// Lines for iud-doctor: the loader, each Vulkan device with its external-memory handle types,
/// the variant the provider would use, and a trial allocation with a DMA-BUF export.
pub fn doctor_report() -> Vec<String> {
    let vk = match Vulkan::get() {
        Ok(v) => v,
        Err(e) => return vec![format!("vulkan: unavailable ({})", e.message)],
    };
    let mut out = vec![format!(
        "vulkan: loader found, instance version {}, {} device(s)",
        vk.version(),
        vk.devices.len()
    )];
    for (i, d) in vk.devices.iter().enumerate() {
        out.push(format!("  vulkan device {i}: {}", d.describe()));
        out.push(format!(
            "    buffer external memory: {}; {}",
            d.opaque_fd.describe(),
            d.dma_buf.describe()
        ));
        out.push(format!(
            "    HOST_VISIBLE|HOST_COHERENT memory: {}",
            if d.host_visible() { "yes" } else { "no" }
        ));
    }
    let p = match VulkanProvider::get() {
        Ok(p) => p,
        Err(e) => {
            out.push(format!(
                "  gpu_provider=vulkan: unavailable ({})",
                e.message
            ));
            return out;
        }
    };
    for dev in 0..p.device_count() {
        match p.plan_for(dev) {
            Ok((v, _)) => {
                out.push(format!(
                    "  gpu_provider=vulkan, devId {dev}: variant {} ({})",
                    v.name(),
                    v.explain()
                ));
                out.push(format!("    trial: {}", trial(&p, dev)));
            }
            Err(e) => out.push(format!(
                "  gpu_provider=vulkan, devId {dev}: unavailable ({})",
                e.message
            )),
        }
    }
    out
}

/// Allocates 2 MiB, exports it as a DMA-BUF the way a registration would, frees it.
fn trial(p: &VulkanProvider, dev: i32) -> String {
    const SIZE: u64 = 2 << 20;
    let a = match p.allocate(dev, SIZE) {
        Ok(a) => a,
        Err(e) => return format!("allocation of {SIZE} bytes failed: {}", e.message),
    };
    let export = match p.export_dmabuf(dev, a.addr, a.len) {
        Ok(e) => format!("DMA-BUF export ok (offset {})", e.offset),
        Err(e) => format!("DMA-BUF export failed: {}", e.message),
    };
    let freed = VulkanProvider::free(a.addr)
        .map(|()| "freed".to_owned())
        .unwrap_or_else(|e| e.message);
    format!(
        "allocated {SIZE} bytes at 0x{:x} ({}), {export}, {freed}",
        a.addr,
        a.variant.name()
    )
}

#[cfg(test)]
mod tests;
