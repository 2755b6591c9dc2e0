//! The loaded HSA runtime as the ROCm provider holds it: its agents, what it can export, and the
//! host ranges it pinned.

use std::sync::Mutex;

#[cfg(feature = "rocm")]
use super::hip;
use super::sys::{Agent, Lib};
use crate::error::{Error, ErrorKind};

/// What `HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmabufQuery {
    Supported,
    /// The runtime answered false: the kernel driver (KFD) predates its DMA-BUF interface (1.12).
    NotSupported,
    /// The runtime does not know the attribute (ROCm before 5.x) or the query failed.
    Unknown(String),
}

/// One GPU agent.
#[derive(Debug, Clone)]
pub struct GpuAgent {
    pub agent: Agent,
    /// `HSA_AGENT_INFO_NAME` (the ISA, e.g. gfx90a) and the marketing name when known.
    pub name: String,
}

/// The loaded HSA runtime with its agents.
pub struct Rocm {
    pub(super) lib: &'static Lib,
    pub(super) gpus: Vec<GpuAgent>,
    /// The agent for the host side of copies (system memory); HSA always lists one.
    pub(super) cpu: Option<Agent>,
    pub(super) dmabuf: DmabufQuery,
    pub(super) version: (u16, u16),
    pub(super) build: Option<String>,
    /// Host ranges pinned by `pin_host`: (start, len, the address agents use for it).
    pub(super) locked: Mutex<Vec<(u64, u64, u64)>>,
    #[cfg(feature = "rocm")]
    pub(super) hip: hip::HipView,
}

/// Why a caller gets `NotSupported` from the provider in this state, for messages.
pub(super) fn not_supported(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::NotSupported, what)
}
