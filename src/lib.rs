//! IO_URING_DMABUF: a NIXL transfer-backend plugin that moves bytes between memory and storage
//! through io_uring.
//!
//! Layers, outermost first (docs/ARCHITECTURE.md; tests/architecture.rs keeps them acyclic):
//! - [`ffi`]: the NIXL-facing layer: the C++ shim (`ffi/shim/`, owning NIXL's vtable and std::
//!   objects) and the flat C bridge it calls through ([`ffi::bridge`]), the plugin's entry points
//!   and the bridge's function table (the only `extern "C"` code, each body behind one panic
//!   boundary), the manifest, backend aliases and the NIXL release check.
//! - [`engine`]: one backend instance: registrations, prepared requests.
//! - [`xfer`]: validation and cutting of descriptor lists, a request's state machine, the driver.
//! - [`path`]: the data paths (direct, dmabuf, staging, cufile) behind one trait, their choice
//!   and the route cache.
//! - [`mem`]: one module per NIXL memory kind; [`uring`]: the ring core; [`gpu`]: vendor
//!   providers, a leaf.
//!
//! Shared by all: one error type ([`error::Error`], mapped to `nixl_status_t` in one place) and
//! [`log`].
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod engine;
pub mod error;
pub mod ffi;
pub mod gpu;
pub mod log;
pub mod mem;
pub mod params;
pub mod path;
#[doc(hidden)]
pub mod test_support;
pub mod uring;
pub mod xfer;
