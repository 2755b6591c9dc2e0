//! IO_URING_DMABUF: a NIXL transfer-backend plugin that moves bytes between memory and storage
//! through io_uring.
//!
//! Layers, outermost first (docs/ARCHITECTURE.md; tests/architecture.rs keeps them acyclic):
//! - `shim/` (C++): owns NIXL's vtable and std:: objects, forwards every call through the flat C
//!   bridge (`shim/bridge.h`, seen from Rust as [`bridge`]).
//! - [`ffi`]: the only `extern "C"` code of the NIXL plugin: the two NIXL entry points and the
//!   bridge's function table, each body behind one panic boundary.
//! - [`engine`]: one backend instance: registrations, prepared requests.
//! - [`xfer`]: validation and cutting of descriptor lists, a request's state machine, the driver.
//! - [`path`]: the data paths (direct, dmabuf, staging, cufile) behind one trait, their choice
//!   and the route cache.
//! - [`mem`]: one module per NIXL memory kind; [`uring`]: the ring core; [`gpu`]: vendor
//!   providers, a leaf.
//!
//! One error type ([`error::Error`]) is mapped to `nixl_status_t` in one place.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod alias;
pub mod bridge;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod gpu;
pub mod log;
pub mod manifest;
pub mod mem;
pub mod nixl_release;
pub mod params;
pub mod path;
pub mod record;
#[doc(hidden)]
pub mod test_support;
pub mod uring;
pub mod xfer;
