//! The io_uring ring core: SQ/CQ, fixed-buffer and fixed-file tables, ops in flight by token,
//! and the page-cache workers behind the same submit/reap interface. It knows nothing of
//! requests, paths or GPUs (those are `xfer` and `path`).

pub mod dmabuf_uapi;
mod op;
mod ring;
#[cfg(test)]
mod ring_tests;
mod slots;
mod worker_defaults;
mod workers;

pub use op::{FileRef, IoOp, Progress};
pub use ring::{
    CoreGuard, FileKey, Ring, RingCore, Submission, MAX_FIXED_BUFFER, WORKER_JOB_BYTES,
};
pub use worker_defaults::{default_page_cache_threads, default_page_cache_writers, usable_cpus};
pub use workers::{WorkerConfig, WriterLimits};
