//! The Path trait every data path implements, and the route a bound (registration, target) pair
//! takes.

use crate::error::Result;
use crate::mem::{FileRegion, Registration};

/// How a (registration, target) pair moves bytes, once bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Registered with io_uring as DMA-BUF buffers bound to the target; one slot per slab.
    Dmabuf { slots: Vec<u16> },
    /// VRAM through the pinned host staging pool.
    Staging,
    /// VRAM through cuFile (GPUDirect Storage).
    Cufile,
    /// Host memory addressed directly (fixed buffers or plain pointers).
    Host,
}

impl Route {
    /// The route in words, for the log line that announces it.
    pub fn describe(&self) -> &'static str {
        match self {
            Route::Dmabuf { .. } => "io_uring DMA-BUF",
            Route::Staging => "pinned host staging",
            Route::Cufile => "cuFile",
            Route::Host => "host buffers",
        }
    }
}

/// One way of moving a memory registration's bytes to and from storage.
///
/// `check` answers without side effects; `bind` does the per-pair work (DMA-BUF registration and
/// self-test, cuFile handles) once, and the engine caches the route it returns. Each path's
/// module also has `address` (where a piece's memory side is, as the SQE names it, and where
/// the piece must end) used by the planner, and its execution: the ring for `direct` and
/// `dmabuf`, the ring plus device copies for `staging`, the cuFile executor for `cufile`.
pub trait Path {
    /// Whether the path can serve the pair here; the reason when not (its message is the
    /// reason alone: the selector wraps it with the policy that asked).
    fn check(&self, mem: &Registration, file: &FileRegion) -> Result<()>;
    /// Prepares the pair and returns the route its ops take.
    fn bind(&self, mem: &Registration, file: &FileRegion) -> Result<Route>;
}
