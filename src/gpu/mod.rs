//! GPU memory providers: the seam between the engine and a vendor's driver API.
//!
//! A provider validates VRAM registrations, exports device memory as DMA-BUF, pins the staging
//! buffers and runs the asynchronous host<->device copies of the staging path. `gpu_provider =
//! cuda|rocm|vulkan|auto` picks one; vendor libraries are loaded at run time, so a missing one is
//! an absent capability with a message, never a crash or a link dependency.

pub mod cuda;
pub mod cufile;
pub mod cufile_batch;
pub mod rocm;
pub mod vulkan;

use std::sync::Arc;

use crate::error::{Error, Result};
pub use crate::mem::dmabuf_slabs::DmabufExport;

/// Which provider the parameter asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderChoice {
    Auto,
    Cuda,
    Rocm,
    Vulkan,
}

impl ProviderChoice {
    pub fn parse(value: &str) -> Option<ProviderChoice> {
        Some(match value.to_ascii_lowercase().as_str() {
            "auto" => ProviderChoice::Auto,
            "cuda" => ProviderChoice::Cuda,
            "rocm" => ProviderChoice::Rocm,
            "vulkan" => ProviderChoice::Vulkan,
            _ => return None,
        })
    }
}

/// A copy in flight on a device stream.
pub trait CopyTicket: Send {
    /// Non-blocking: has the copy finished? An error names the vendor's error.
    fn is_done(&self) -> Result<bool>;
    /// Blocks until the copy finished.
    fn wait(&self) -> Result<()>;
}

/// The device memory of one allocation, as the provider sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// Start and end of the allocation that contains the registration.
    pub alloc_start: u64,
    pub alloc_end: u64,
}

pub trait GpuProvider: Send + Sync {
    fn name(&self) -> &'static str;
    /// Number of devices the provider sees.
    fn device_count(&self) -> i32;
    /// Fails unless `[addr, addr+len)` is device memory of `device`.
    fn check_device_range(&self, device: i32, addr: u64, len: u64) -> Result<DeviceRange>;
    /// Exports `[addr, addr+len)` (host-page aligned) as a DMA-BUF, with the offset at which
    /// `addr` sits inside it (0 when exactly the range is exported).
    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport>;
    /// Page-locks host memory for fast asynchronous copies.
    ///
    /// # Safety
    /// The memory must stay mapped until `unpin_host`.
    unsafe fn pin_host(&self, addr: u64, len: u64) -> Result<()>;
    fn unpin_host(&self, addr: u64);
    /// Starts a device -> host copy.
    ///
    /// # Safety
    /// Both ranges must stay valid until the ticket reports completion.
    unsafe fn copy_to_host(&self, device: i32, host: u64, dev: u64, len: u64) -> Result<Box<dyn CopyTicket>>;
    /// Starts a host -> device copy.
    ///
    /// # Safety
    /// Both ranges must stay valid until the ticket reports completion.
    unsafe fn copy_to_device(&self, device: i32, dev: u64, host: u64, len: u64) -> Result<Box<dyn CopyTicket>>;
    /// Makes the device's context current on the calling thread (for vendor libraries such as
    /// cuFile that use the thread's context).
    fn make_current(&self, device: i32) -> Result<()>;
    /// One line about the provider (driver version, devices) for logs and the doctor.
    fn describe(&self) -> String;
    /// Orders the provider's next copies on `device` after the work the application already
    /// queued on the device's default stream, so a buffer a kernel is still writing is not read
    /// early (NIXL users hand over memory right after launching the kernel that fills it, as
    /// they may with cuFile, whose copies run on the default stream). With `host_wait` the
    /// calling thread also waits for that work (for paths where storage reads or writes the
    /// device memory directly). One-way: the application's later work does not wait for ours.
    fn fence_app_work(&self, device: i32, host_wait: bool) -> Result<()> {
        let _ = (device, host_wait);
        Ok(())
    }
}

/// Loads the chosen provider. `auto` takes CUDA, else ROCm; Vulkan only when named (its memory
/// must come from the plugin's Vulkan allocator, so the application knows it uses it).
pub fn load(choice: ProviderChoice) -> Result<Arc<dyn GpuProvider>> {
    match choice {
        ProviderChoice::Cuda => cuda::Cuda::load().map(|c| c as Arc<dyn GpuProvider>),
        ProviderChoice::Rocm => rocm::load(),
        ProviderChoice::Vulkan => vulkan::load(),
        ProviderChoice::Auto => cuda::Cuda::load().map(|c| c as Arc<dyn GpuProvider>).or_else(|cuda_err| {
            rocm::load().map_err(|rocm_err| {
                Error::new(cuda_err.kind, format!("no GPU provider available: {}; ROCm: {}", cuda_err.message, rocm_err.message))
            })
        }),
    }
}
