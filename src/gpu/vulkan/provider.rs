//! `GpuProvider` for Vulkan: ranges checked against the plugin's own allocations
//! (`iud_vulkan_alloc`), DMA-BUF export by the variant's exporter (Vulkan or CUDA), and the
//! staging copies through CUDA (imported memory) or memcpy (host-mapped memory).

use super::{Variant, VulkanProvider, DMA_BUF};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::cuda::Cuda;
use crate::gpu::provider::{CopyFinished, CopyTicket, DeviceRange, DmabufExport, GpuProvider};

impl GpuProvider for VulkanProvider {
    fn name(&self) -> &'static str {
        "vulkan"
    }

    fn device_count(&self) -> i32 {
        match &self.cuda {
            Some(c) => c.device_count(),
            None => self.vk.devices.len() as i32,
        }
    }

    fn check_device_range(&self, device: i32, addr: u64, len: u64) -> Result<DeviceRange> {
        let a = self.registered(addr, len)?;
        if a.device != device {
            return Err(Error::invalid(format!(
                "VRAM registration 0x{addr:x}+{len}: the Vulkan allocation is on device {}, but \
                 devId says {device}",
                a.device
            )));
        }
        Ok(DeviceRange {
            alloc_start: a.addr,
            alloc_end: a.addr + a.len,
        })
    }

    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport> {
        let a = self.registered(addr, len)?;
        match a.variant {
            Variant::DmabufCuda | Variant::DmabufHost => {
                let fd = a.vk.export_fd(DMA_BUF)?;
                Ok(DmabufExport {
                    fd,
                    offset: addr - a.addr,
                    whole_size: Some(a.vk.alloc_size),
                })
            }
            Variant::OpaqueCuda => {
                let cuda = self.variant_cuda()?;
                cuda.export_dmabuf(device, addr, len).map_err(|e| {
                    Error::new(
                        e.kind,
                        format!(
                            "CUDA could not export the imported Vulkan memory as a DMA-BUF: {}",
                            e.message
                        ),
                    )
                })
            }
            Variant::HostMapped => Err(Error::new(
                ErrorKind::NotSupported,
                "Vulkan variant host-mapped has no DMA-BUF export (the driver offers no \
                 exportable VK_EXT_external_memory_dma_buf); vram_path=staging or auto moves it",
            )),
        }
    }

    unsafe fn pin_host(&self, addr: u64, len: u64) -> Result<()> {
        match &self.cuda {
            // SAFETY: forwarded contract (the memory stays mapped until unpin_host).
            Some(c) => unsafe { c.pin_host(addr, len) },
            // memcpy copies need no page-locked memory.
            None => Ok(()),
        }
    }

    fn unpin_host(&self, addr: u64) {
        if let Some(c) = &self.cuda {
            c.unpin_host(addr);
        }
    }

    unsafe fn copy_to_host(
        &self,
        device: i32,
        host: u64,
        dev: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: forwarded contract.
        unsafe { self.copy(device, dev, host, len, true) }
    }

    unsafe fn copy_to_device(
        &self,
        device: i32,
        dev: u64,
        host: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: forwarded contract.
        unsafe { self.copy(device, dev, host, len, false) }
    }

    fn fence_app_work(&self, device: i32, host_wait: bool) -> Result<()> {
        match &self.cuda {
            Some(c) => c.fence_app_work(device, host_wait),
            None => Ok(()),
        }
    }

    fn make_current(&self, device: i32) -> Result<()> {
        match &self.cuda {
            Some(c) => c.make_current(device),
            None => Ok(()),
        }
    }

    fn describe(&self) -> String {
        let devices: Vec<String> = (0..self.device_count())
            .map(|d| match (self.resolve(d), self.plan_for(d)) {
                (Ok((i, _)), Ok((v, _))) => format!(
                    "device {d}: {}, variant {}",
                    self.vk.devices[i].describe(),
                    v.name()
                ),
                (Err(e), _) | (_, Err(e)) => format!("device {d}: {}", e.message),
            })
            .collect();
        let cuda = match &self.cuda {
            Some(c) => c.describe(),
            None => "no CUDA".to_owned(),
        };
        format!(
            "Vulkan {}; {}; {}",
            self.vk.version(),
            devices.join("; "),
            cuda
        )
    }
}

impl VulkanProvider {
    /// The CUDA driver a CUDA variant's allocation is imported into.
    fn variant_cuda(&self) -> Result<&Cuda> {
        self.cuda
            .as_deref()
            .ok_or_else(|| Error::backend("internal error: a CUDA variant without CUDA"))
    }

    /// One staging copy between host memory and a Vulkan allocation (`to_host`: device ->
    /// host): through CUDA for a CUDA variant, else a memcpy on the allocation's host mapping.
    ///
    /// # Safety
    /// As `GpuProvider::copy_to_host` / `copy_to_device`: both ranges must stay valid until the
    /// ticket reports completion.
    unsafe fn copy(
        &self,
        device: i32,
        dev: u64,
        host: u64,
        len: u64,
        to_host: bool,
    ) -> Result<Box<dyn CopyTicket>> {
        let a = self.registered(dev, len)?;
        if a.variant.uses_cuda() {
            let c = self.variant_cuda()?;
            // SAFETY: forwarded contract.
            return unsafe {
                if to_host {
                    c.copy_to_host(device, host, dev, len)
                } else {
                    c.copy_to_device(device, dev, host, len)
                }
            };
        }
        let mapped = a.host_range(dev, len)?;
        let (src, dst) = if to_host {
            (mapped, host)
        } else {
            (host, mapped)
        };
        // SAFETY: `mapped` is inside the live mapping of `a` (held by the Arc for the copy); the
        // caller guarantees the host range; staging buffers never overlap device memory.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) };
        Ok(Box::new(CopyFinished))
    }
}
