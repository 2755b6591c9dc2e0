//! GPU memory providers: the seam between the engine and a vendor's driver API.
//!
//! A provider validates VRAM registrations, exports device memory as DMA-BUF, pins the staging
//! buffers and runs the asynchronous host<->device copies of the staging path. `gpu_provider =
//! cuda|rocm|vulkan|auto` picks one; vendor libraries are loaded at run time, so a missing one is
//! an absent capability with a message, never a crash or a link dependency.

pub mod cuda;
pub mod cufile;
mod loader;
pub mod provider;
pub mod rocm;
pub mod vulkan;

use std::sync::Arc;

use crate::error::{Error, Result};
pub use provider::{
    CopyFinished, CopyPiece, CopyTicket, DeviceRange, DmabufExport, GpuProvider, PackedCopy,
};

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

/// Loads the chosen provider. `auto` takes CUDA, else ROCm; Vulkan only when named (its memory
/// must come from the plugin's Vulkan allocator, so the application knows it uses it).
pub fn load(choice: ProviderChoice) -> Result<Arc<dyn GpuProvider>> {
    match choice {
        ProviderChoice::Cuda => cuda::Cuda::load().map(|c| c as Arc<dyn GpuProvider>),
        ProviderChoice::Rocm => rocm::load(),
        ProviderChoice::Vulkan => vulkan::load(),
        ProviderChoice::Auto => cuda::Cuda::load()
            .map(|c| c as Arc<dyn GpuProvider>)
            .or_else(|cuda_err| {
                rocm::load().map_err(|rocm_err| {
                    Error::new(
                        cuda_err.kind,
                        format!(
                            "no GPU provider available: {}; ROCm: {}",
                            cuda_err.message, rocm_err.message
                        ),
                    )
                })
            }),
    }
}
