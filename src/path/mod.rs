//! The data paths, one module each behind one trait ([`Path`]): `direct` (host memory by
//! pointer), `dmabuf` (DMA-BUF registered with io_uring), `staging` (VRAM through pinned host
//! buffers), `cufile` (VRAM through GPUDirect Storage); `select` picks and binds one per
//! (registration, target) pair.

pub mod cufile;
pub mod cufile_exec;
pub mod direct;
pub mod dmabuf;
mod dmabuf_verify;
pub mod route;
pub mod routes;
pub mod select;
pub mod staging;

pub use route::{Path, Route};
