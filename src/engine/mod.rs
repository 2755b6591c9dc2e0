//! The engine behind one NIXL backend instance: registrations, prepared requests, the ring.
//!
//! Thread-safety: every method takes `&self`. Registration bookkeeping is behind its own small
//! lock, and everything that touches io_uring goes through the ring's lock, so NIXL may call the
//! data path from many threads at once (sync modes NONE and RW).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;

use crate::error::{Error, ErrorKind, Failure, Result};
use crate::ffi::bridge::iud_desc;
use crate::gpu::GpuProvider;
use crate::mem::live::Registry;
use crate::mem::Registration;
use crate::params::EngineParams;
use crate::path;
use crate::path::cufile_exec::{CufileExecutor, CufileProgress};
use crate::path::routes::RouteCache;
use crate::path::select::Selector;
use crate::path::staging::StagingShape;
use crate::uring::dmabuf_uapi::{self, DmabufSupport};
use crate::uring::{Progress, Ring, WorkerConfig, WriterLimits};
use crate::xfer::bind::{self, Binder};
use crate::xfer::driver::{Driver, RequestKey};
use crate::xfer::plan::parts_for;
use crate::xfer::prep_pool::PrepPool;
use crate::xfer::progress::ProgressThread;
use crate::xfer::recycle::OpLists;
use crate::xfer::{profile, Plan, Planner, XferOp};
use record::Recorder;

mod record;
mod register;

/// One backend instance.
pub struct Engine {
    local_agent: String,
    params: EngineParams,
    ring: Arc<Ring>,
    /// Moves running requests on while nobody polls (started on the first post; declared before
    /// `driver` so that it is stopped and joined before the driver is dropped).
    progress: OnceCell<Option<ProgressThread>>,
    /// Requests and their progress through the ring.
    driver: Arc<Driver>,
    /// The route of each bound (memory registration, target file) pair, decided on first use,
    /// dropped when NIXL deregisters either.
    routes: RouteCache,
    /// The live registrations, by the opaque token handed to NIXL as MD and by what
    /// descriptors name (NIXL's MDs are only hints: mem/live.rs).
    registry: Registry,
    /// devIds of live path-mode FILE registrations (they must be unique per file).
    path_dev_ids: Mutex<HashSet<u64>>,
    /// Set when a lock is found poisoned; every entry point checks it first.
    failure: Arc<Failure>,
    /// The GPU provider, loaded on the first VRAM registration.
    gpu: OnceCell<std::result::Result<Arc<dyn GpuProvider>, Error>>,
    recorder: Option<Recorder>,
    /// Worker pool of the cuFile sub-path, started on first use.
    cufile_exec: OnceCell<CufileExecutor>,
    /// Op lists of released requests, for the next prepXfer.
    op_lists: OpLists,
    /// Helper threads of large prepXfers (`prep_threads`), started by the first one.
    prep_pool: OnceCell<Option<PrepPool>>,
}

/// The kernel's io_uring DMA-BUF capability, probed once per process.
pub fn dmabuf_support() -> &'static DmabufSupport {
    static SUPPORT: OnceCell<DmabufSupport> = OnceCell::new();
    SUPPORT.get_or_init(dmabuf_uapi::probe)
}

/// A prepared transfer: NIXL holds it between prepXfer and releaseReqH.
#[derive(Debug)]
pub struct Request {
    key: RequestKey,
    plan: Plan,
    /// Progress on the cuFile sub-path (requests whose plan is cuFile).
    cufile: Option<Arc<CufileProgress>>,
}

impl Request {
    /// A stable id for logs and recordings (its address).
    fn id(&self) -> usize {
        self as *const Request as usize
    }
}

impl Engine {
    pub fn new<'a>(
        local_agent: &str,
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Engine> {
        let (params, ignored) = EngineParams::parse(params)?;
        if !ignored.is_empty() {
            tracing::debug!(
                "ignoring backend parameters this backend does not define: {}",
                ignored.join(", ")
            );
        }
        let failure = Arc::new(Failure::default());
        let workers = WorkerConfig {
            threads: params.page_cache_threads,
            writers: WriterLimits {
                file: params.page_cache_file_writers as usize,
                all: params.page_cache_writers as usize,
            },
            spin_us: params.page_cache_spin_us,
        };
        let ring = Arc::new(Ring::new(
            params.ring_entries,
            params.fixed_files,
            workers,
            Arc::clone(&failure),
        )?);
        let record_path = match params.record.as_str() {
            "" => std::env::var("IO_URING_DMABUF_RECORD").unwrap_or_default(),
            p => p.to_owned(),
        };
        let recorder = if record_path.is_empty() {
            None
        } else {
            Some(Recorder::open(&record_path)?)
        };
        tracing::debug!(
            agent = local_agent,
            ?params,
            "IO_URING_DMABUF engine created"
        );
        let driver = Arc::new(
            Driver::new(Arc::clone(&ring), Arc::clone(&failure))
                .with_caller_reads(params.page_cache_caller_reads),
        );
        Ok(Engine {
            local_agent: local_agent.to_owned(),
            params,
            progress: OnceCell::new(),
            driver,
            ring,
            routes: RouteCache::new(Arc::clone(&failure)),
            registry: Registry::default(),
            path_dev_ids: Mutex::new(HashSet::new()),
            failure,
            gpu: OnceCell::new(),
            recorder,
            cufile_exec: OnceCell::new(),
            op_lists: OpLists::default(),
            prep_pool: OnceCell::new(),
        })
    }

    fn cufile_executor(&self) -> &CufileExecutor {
        bind::cufile_executor(&self.cufile_exec, &self.params)
    }

    /// The helper threads for a prepXfer of `descriptors` pairs, when it is large enough to be
    /// planned in parts and `prep_threads` allows more than the caller.
    fn prep_pool(&self, descriptors: usize) -> Option<&PrepPool> {
        if parts_for(descriptors, self.params.prep_threads) < 2 {
            return None;
        }
        self.prep_pool
            .get_or_init(|| PrepPool::start(self.params.prep_threads - 1))
            .as_ref()
    }

    /// Validates the lists against the live registrations and prepares a request.
    pub fn prep(
        &self,
        op: i32,
        local_kind: i32,
        local: &[iud_desc],
        remote_kind: i32,
        remote: &[iud_desc],
        remote_agent: &str,
    ) -> Result<Box<Request>> {
        let started = profile::prep_enabled().then(std::time::Instant::now);
        self.failure.check()?;
        let op = XferOp::from_nixl(op)?;
        if remote_agent != self.local_agent {
            return Err(Error::invalid(format!(
                "prepXfer: remote agent {remote_agent:?} is not this agent {:?}; IO_URING_DMABUF \
                 only moves data between this agent's memory and its storage",
                self.local_agent
            )));
        }
        let binder = Binder {
            routes: &self.routes,
            selector: Selector {
                ring: &self.ring,
                params: &self.params,
                dmabuf_support: dmabuf_support(),
            },
            driver: &self.driver,
            cufile: &self.cufile_exec,
        };
        let planner = Planner {
            params: &self.params,
            registry: &self.registry,
            binder: &binder,
            lists: &self.op_lists,
            pool: self.prep_pool(local.len()),
        };
        let plan = planner.plan(op, local_kind, local, remote_kind, remote)?;
        for reg in &plan.registrations {
            if let Registration::Storage(f) = &**reg {
                f.check_still_open()?;
            }
        }
        let key = self.driver.add_request(Arc::clone(&plan.ops))?;
        let cufile = plan
            .cufile
            .then(|| Arc::new(CufileProgress::new(Arc::clone(&self.failure))));
        let req = Box::new(Request { key, plan, cufile });
        if let Some(r) = &self.recorder {
            r.prep(
                req.id(),
                op as i32,
                (local_kind, local),
                (remote_kind, remote),
                req.plan.ops.ops.len(),
                req.plan.total_bytes,
            );
        }
        profile::prep_done(started, local.len(), req.plan.ops.ops.len());
        Ok(req)
    }

    /// Starts a prepared request; Ok(Done) when it completed during the call.
    pub fn post(
        &self,
        req: &Request,
        op: i32,
        local_count: usize,
        remote_count: usize,
    ) -> Result<Progress> {
        self.failure.check()?;
        let op = XferOp::from_nixl(op)?;
        if op != req.plan.op
            || local_count != req.plan.local_count
            || remote_count != req.plan.remote_count
        {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "postXfer: operation or descriptor lists differ from what was prepared",
            ));
        }
        // I/O uses each registration's own fd, so it cannot reach another file; a request whose
        // application fd was closed or reused since prep is still refused (mem/file.rs).
        for reg in &req.plan.registrations {
            if let Registration::Storage(f) = &**reg {
                f.check_still_open()?;
            }
        }
        self.fence_app_work(req)?;
        let result = match &req.cufile {
            Some(progress) => path::cufile::jobs(
                &req.plan.ops.ops,
                req.plan.ops.write,
                &req.plan.registrations,
                progress,
            )
            .and_then(|jobs| self.cufile_executor().post(progress, jobs)),
            None => {
                let result = self.driver.post(req.key, self.params.inline_write_max);
                if let (Ok(Progress::InFlight), true) = (&result, self.params.progress_thread) {
                    let thread = self
                        .progress
                        .get_or_init(|| ProgressThread::start(Arc::downgrade(&self.driver)));
                    if let Some(t) = thread {
                        t.wake();
                    }
                }
                result
            }
        };
        if let Some(r) = &self.recorder {
            r.post(
                req.id(),
                match &result {
                    Ok(Progress::Done) => "DONE",
                    Ok(Progress::InFlight) => "PROC",
                    Err(_) => "ERR",
                },
            );
        }
        result
    }

    /// Orders a VRAM request after the application's work already queued on the GPU (see
    /// `GpuProvider::fence_app_work`): staged copies wait on the device; cuFile and DMA-BUF I/O,
    /// which touch VRAM outside our streams, wait here.
    fn fence_app_work(&self, req: &Request) -> Result<()> {
        let mut fenced: Vec<i32> = Vec::new();
        for reg in &req.plan.registrations {
            let Registration::Vram(v) = &**reg else {
                continue;
            };
            if !fenced.contains(&v.device) {
                v.provider
                    .fence_app_work(v.device, req.plan.vram_outside_streams)?;
                fenced.push(v.device);
            }
        }
        Ok(())
    }

    /// Reaps completions without blocking; Ok(Done) once the request finished.
    pub fn check(&self, req: &Request) -> Result<Progress> {
        self.failure.check()?;
        match &req.cufile {
            Some(progress) => progress.status(),
            None => self.driver.check(req.key, self.params.inline_write_max),
        }
    }

    /// How many (memory, file) routes are cached (for tests and diagnostics).
    pub fn cached_routes(&self) -> Result<usize> {
        self.routes.count()
    }

    fn staging_shape(&self) -> StagingShape {
        StagingShape::from_params(&self.params)
    }

    /// Whether the staging pool exists (for tests and diagnostics).
    pub fn staging_ready(&self) -> Result<bool> {
        self.driver.staging_ready()
    }

    /// Releases a request, aborting it if it is in flight. On error the request is handed back
    /// (NIXL keeps it and may try again).
    #[allow(
        clippy::result_large_err,
        reason = "the error hands the request back to the FFI boundary, which returns it to \
                  NIXL; one call per releaseReqH, not a hot path"
    )]
    pub fn release(&self, req: Box<Request>) -> std::result::Result<(), (Box<Request>, Error)> {
        if let Err(e) = self.failure.check() {
            return Err((req, e));
        }
        if let Some(r) = &self.recorder {
            r.release(req.id());
        }
        if let Some(progress) = &req.cufile {
            if let Err(e) = self
                .cufile_executor()
                .drain(progress, std::time::Duration::from_secs(30))
            {
                return Err((req, e));
            }
        }
        match self.driver.remove_request(req.key) {
            Ok(()) => {
                // The driver held the only other reference to the ops.
                if let Ok(ops) = Arc::try_unwrap(req.plan.ops) {
                    self.op_lists.give_back(ops.ops);
                }
                Ok(())
            }
            Err(e) => Err((req, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::status;

    #[test]
    fn a_poisoned_lock_makes_every_later_call_an_error_not_a_panic() {
        let e = Engine::new("agent", []).expect("engine");
        let buf = vec![0u8; 4096];
        let md = e
            .register(0, buf.as_ptr() as u64, buf.len() as u64, 0, "")
            .expect("register DRAM");
        e.routes.poison();
        let err = e.deregister(md).unwrap_err();
        assert_eq!(err.to_status(), status::ERR_BACKEND);
        assert!(
            err.message.contains("route cache is poisoned"),
            "{}",
            err.message
        );
        let err = e
            .register(0, buf.as_ptr() as u64, buf.len() as u64, 0, "")
            .unwrap_err();
        assert_eq!(err.to_status(), status::ERR_BACKEND);
        assert!(err.message.contains("failed earlier"), "{}", err.message);
    }
}
