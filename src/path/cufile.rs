//! The cuFile path (GPUDirect Storage): VRAM moved by NVIDIA's cuFile library with a file handle
//! per target and, when it works, a buffer registration per VRAM region; executed by
//! [`CufileExecutor`] rather than the ring.

use std::sync::Arc;

use super::cufile_exec::{CufileApi, CufileExecutor, CufileProgress, Job};
use super::route::{Path, Route};
use crate::error::{Error, Result};
use crate::gpu::cufile::{self, CuFile};
use crate::mem::{FileRegion, Registration};
use crate::params::CufileApiChoice;
use crate::uring::IoOp;

/// Binds VRAM to targets through cuFile.
pub struct Cufile {
    pub api: CufileApiChoice,
}

impl Path for Cufile {
    fn check(&self, mem: &Registration, _file: &FileRegion) -> Result<()> {
        if !matches!(mem, Registration::Vram(_)) {
            return Err(Error::not_supported("cuFile moves only VRAM"));
        }
        let lib = CuFile::load()?;
        if self.api == CufileApiChoice::Batch && lib.batch.is_none() {
            return Err(Error::not_supported(format!(
                "cufile_api=batch: {} has no batch API (cuFileBatchIO*)",
                lib.path
            )));
        }
        Ok(())
    }

    /// Opens the cuFile file handle of the target (once per file registration) and registers
    /// the VRAM region with cuFile (once per region; without it cuFile still works, slower).
    fn bind(&self, mem: &Registration, file: &FileRegion) -> Result<Route> {
        self.check(mem, file)?;
        let Registration::Vram(vram) = mem else {
            return Err(Error::not_supported("cuFile moves only VRAM"));
        };
        let lib = CuFile::load()?;
        if file.cufile.get().is_none() {
            let h = lib
                .register_handle(file.io_fd)
                .map_err(|e| e.with_fd(file.fd))?;
            let _ = file.cufile.set(Arc::new(h));
        }
        vram.cufile.get_or_init(|| {
            vram.provider.make_current(vram.device).ok()?;
            lib.register_buffer(vram.addr, vram.len)
                .inspect_err(|e| {
                    tracing::info!(
                        "{}; cuFile moves this VRAM without a buffer registration",
                        e.message
                    )
                })
                .ok()
        });
        Ok(Route::Cufile)
    }
}

/// The executor for `cufile_api` with `threads` workers: the batch API when asked, or under
/// `auto` when cuFile is direct; else the thread pool.
pub fn executor(api: CufileApiChoice, threads: u32) -> CufileExecutor {
    let lib = CuFile::load().ok();
    let direct = cufile::mode().0;
    let batch = lib.and_then(|l| {
        l.batch.map(|f| {
            (
                f,
                l.props
                    .as_ref()
                    .map_or(128, |p| p.max_batch_io_size.max(1) as usize),
            )
        })
    });
    let wants_batch = match api {
        CufileApiChoice::Batch => true,
        CufileApiChoice::Auto => direct,
        CufileApiChoice::Threads => false,
    };
    // Binding refused cufile_api=batch already when the library lacks the batch API.
    let api = match batch.filter(|_| wants_batch) {
        Some((f, max)) => {
            tracing::info!("cuFile sub-path: batch API, up to {max} pieces per batch");
            CufileApi::Batch(f, max)
        }
        None => {
            tracing::info!(
                "cuFile sub-path: {threads} worker threads{}",
                if direct {
                    ""
                } else {
                    " (compatibility mode: the batch API is used only when cuFile is direct)"
                }
            );
            CufileApi::Threads
        }
    };
    CufileExecutor::new(threads as usize, api)
}

/// The worker jobs of a cuFile request: each op with its file handle and buffer base.
pub fn jobs(
    ops: &[IoOp],
    write: bool,
    registrations: &[Arc<Registration>],
    progress: &Arc<CufileProgress>,
) -> Result<Vec<Job>> {
    let mut jobs = Vec::with_capacity(ops.len());
    for op in ops {
        let file = registrations.iter().find_map(|r| match &**r {
            Registration::Storage(f) if f.io_fd == op.io_fd => f.cufile.get().cloned(),
            _ => None,
        });
        let vram = registrations.iter().find_map(|r| match &**r {
            Registration::Vram(v) if v.addr <= op.addr && op.addr < v.addr + v.len => Some(v),
            _ => None,
        });
        let (Some(handle), Some(vram)) = (file, vram) else {
            return Err(Error::backend(
                "cuFile request without its file handle or VRAM registration",
            ));
        };
        let base = if matches!(vram.cufile.get(), Some(Some(_))) {
            vram.addr
        } else {
            op.addr
        };
        jobs.push(Job {
            progress: Arc::clone(progress),
            op: *op,
            write,
            handle,
            base,
            provider: Arc::clone(&vram.provider),
        });
    }
    Ok(jobs)
}
