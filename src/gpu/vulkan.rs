//! The Vulkan provider. (Scaffold: being written.)

use std::sync::Arc;

use super::GpuProvider;
use crate::error::{Error, ErrorKind, Result};

/// Loads the provider, or says why it is unavailable.
pub fn load() -> Result<Arc<dyn GpuProvider>> {
    Err(Error::new(ErrorKind::NotSupported, "gpu_provider=vulkan is not available in this build yet; use cuda or auto"))
}

/// Lines for iud-doctor about this vendor on this machine.
pub fn doctor_report() -> Vec<String> {
    vec!["vulkan: not built yet".to_owned()]
}
