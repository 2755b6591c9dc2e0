//! The engine behind one NIXL backend instance: registrations, prepared requests, the ring.
//!
//! Thread-safety: every method takes `&self`. Registration bookkeeping is behind its own small
//! lock, and everything that touches io_uring goes through the ring's lock, so NIXL may call the
//! data path from many threads at once (sync modes NONE and RW).

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;

use crate::bridge::iud_desc;
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::gpu::cufile::CuFile;
use crate::gpu::{self, GpuProvider};
use crate::mem::live::Registry;
use crate::mem::{DramRegion, FileRegion, MemKind, Registration, VramRegion};
use crate::params::{DramDmabuf, EngineParams, FixedBuffers, VramPath};
use crate::path::cufile_exec::{CufileExecutor, CufileProgress};
use crate::path::select::Selector;
use crate::path::staging::StagingShape;
use crate::path::{self, Route};
use crate::record::Recorder;
use crate::uring::dmabuf_uapi::{self, DmabufSupport};
use crate::uring::{FileKey, Progress, Ring, WorkerConfig, WriterLimits};
use crate::xfer::driver::{Driver, RequestKey};
use crate::xfer::plan::{parts_for, PlanContext};
use crate::xfer::prep_pool::PrepPool;
use crate::xfer::progress::ProgressThread;
use crate::xfer::recycle::OpLists;
use crate::xfer::{plan, profile, Plan, XferOp};

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
    /// The route of each bound (memory registration, target file) pair, decided on first use;
    /// keyed by the registration's MD and the file, dropped when NIXL deregisters either.
    routes: Mutex<HashMap<(usize, FileKey), Route>>,
    /// Held while a pair is bound, so that requests prepared at once on a new pair bind it once.
    binding: Mutex<()>,
    /// Routes (with their reason) already logged at info level.
    routes_logged: Mutex<HashSet<String>>,
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
            routes: Mutex::new(HashMap::new()),
            binding: Mutex::new(()),
            routes_logged: Mutex::new(HashSet::new()),
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

    /// Registers one descriptor; returns the MD pointer handed to NIXL.
    pub fn register(
        &self,
        kind: i32,
        addr: u64,
        len: u64,
        dev_id: u64,
        meta_info: &str,
    ) -> Result<*const c_void> {
        self.failure.check()?;
        let kind = MemKind::from_nixl(kind)
            .ok_or_else(|| Error::invalid(format!("registerMem: unknown memory kind {kind}")))?;
        if len == 0 {
            return Err(Error::invalid(format!(
                "registerMem: {} descriptor devId {dev_id} at {addr} has zero length",
                kind.name()
            )));
        }
        let reg = match kind {
            MemKind::Dram => Registration::Dram(self.register_dram(addr, len, dev_id)?),
            MemKind::Vram => Registration::Vram(self.register_vram(addr, len, dev_id)?),
            MemKind::File | MemKind::Blk => Registration::Storage(self.register_storage(kind, addr, len, dev_id, meta_info)?),
            other => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    format!("registerMem: {} is not supported by IO_URING_DMABUF (supported: DRAM_SEG, VRAM_SEG, FILE_SEG, BLK_SEG)", other.name()),
                ))
            }
        };
        let md = self.registry.insert(reg);
        if let Some(r) = &self.recorder {
            r.register(md as usize, kind.to_nixl(), addr, len, dev_id, meta_info);
        }
        Ok(md)
    }

    fn register_dram(&self, addr: u64, len: u64, dev_id: u64) -> Result<DramRegion> {
        if addr == 0 || addr.checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "registerMem: DRAM range 0x{addr:x}+{len} is not a valid address range"
            )));
        }
        let want_fixed = self.params.fixed_buffers == FixedBuffers::Auto;
        // SAFETY: NIXL's contract: registered memory stays mapped until deregisterMem, and the
        // region (with its pinned slots, taken on first use) is dropped only after
        // deregistration and the release of every request using it.
        let mut region =
            unsafe { DramRegion::register(Arc::clone(&self.ring), addr, len, dev_id, want_fixed) };
        match (self.params.dram_dmabuf, dmabuf_support()) {
            (DramDmabuf::On, DmabufSupport::Absent(why)) => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    format!("registerMem: dram_dmabuf=on cannot work here: {why}"),
                ))
            }
            (DramDmabuf::On, DmabufSupport::Available) => {
                if let Err(why) = region.export_udmabuf() {
                    return Err(Error::not_supported(format!(
                        "registerMem: dram_dmabuf=on: DRAM 0x{addr:x}+{len}: {why}"
                    ))
                    .caused_by(why));
                }
            }
            (DramDmabuf::Auto, DmabufSupport::Available) => {
                if let Err(why) = region.export_udmabuf() {
                    tracing::debug!("DRAM 0x{addr:x}+{len} stays on fixed buffers: {why}");
                }
            }
            _ => {}
        }
        Ok(region)
    }

    fn gpu(&self) -> Result<Arc<dyn GpuProvider>> {
        self.gpu
            .get_or_init(|| {
                let p = gpu::load(self.params.gpu_provider)?;
                tracing::info!("GPU provider {}: {}", p.name(), p.describe());
                Ok(p)
            })
            .clone()
    }

    fn register_vram(&self, addr: u64, len: u64, dev_id: u64) -> Result<VramRegion> {
        let device = i32::try_from(dev_id).map_err(|_| {
            Error::invalid(format!(
                "registerMem: VRAM devId {dev_id} is not a GPU ordinal"
            ))
        })?;
        let provider = self.gpu()?;
        let (export, required) = match self.params.vram_path {
            VramPath::Dmabuf => {
                if let DmabufSupport::Absent(why) = dmabuf_support() {
                    return Err(Error::new(
                        ErrorKind::NotSupported,
                        format!("registerMem: vram_path=dmabuf cannot work here: {why}"),
                    ));
                }
                (true, true)
            }
            VramPath::Cufile => {
                CuFile::load().map_err(|e| {
                    Error::new(
                        ErrorKind::NotSupported,
                        format!("registerMem: vram_path=cufile: {}", e.message),
                    )
                })?;
                (false, false)
            }
            VramPath::Auto => (dmabuf_support().is_available(), false),
            VramPath::Staging => (false, false),
        };
        let region =
            VramRegion::register(Arc::clone(&provider), addr, len, device, export, required)?;
        self.prepare_vram_paths(&provider)?;
        Ok(region)
    }

    /// Does now, at registration, the one-time work the first transfer of this VRAM would
    /// otherwise pay (clients time their first put; LMCache registers its buffer at start-up):
    /// opening cuFile's driver to learn its mode (hundreds of ms in compatibility mode) and
    /// mapping and pinning the staging pool, where the route can end on staging. With DMA-BUF
    /// available (auto) neither is needed until a pair fails to bind, so nothing is done.
    fn prepare_vram_paths(&self, provider: &Arc<dyn GpuProvider>) -> Result<()> {
        let staging_possible = match self.params.vram_path {
            VramPath::Staging => true,
            VramPath::Auto if !dmabuf_support().is_available() => !gpu::cufile::mode().0,
            VramPath::Auto | VramPath::Dmabuf | VramPath::Cufile => false,
        };
        if staging_possible {
            self.driver
                .enable_staging(Arc::clone(provider), self.staging_shape())?;
        }
        Ok(())
    }

    /// How a memory registration reaches `file`: decided and bound on first use of the pair,
    /// cached, logged once with the reason.
    fn route(&self, mem: &Registration, file: &FileRegion) -> Result<Route> {
        if let Registration::Dram(d) = mem {
            if d.dmabuf.is_none() {
                return Ok(Route::Host);
            }
        }
        let key = (mem as *const Registration as usize, file.key());
        let cached = || {
            self.failure
                .lock(&self.routes, "route cache")
                .map(|routes| routes.get(&key).cloned())
        };
        if let Some(r) = cached()? {
            return Ok(r);
        }
        // One binding at a time, and the cache asked again under it: threads preparing requests
        // at once on a new pair would otherwise each bind it (two sets of DMA-BUF slots, cuFile
        // asked to register one fd twice). Pairs already bound never wait here.
        let _binding = self.failure.lock(&self.binding, "route binding")?;
        if let Some(r) = cached()? {
            return Ok(r);
        }
        let what = match mem {
            Registration::Vram(v) => format!("VRAM 0x{:x}+{} (GPU {})", v.addr, v.len, v.device),
            Registration::Dram(d) => format!("DRAM 0x{:x}+{}", d.addr, d.len),
            Registration::Storage(_) => {
                return Err(Error::invalid("a storage registration on the memory side"))
            }
        };
        let selector = Selector {
            ring: &self.ring,
            params: &self.params,
            dmabuf_support: dmabuf_support(),
        };
        let (route, reason) = selector.choose(mem, file)?;
        match (&route, mem) {
            (Route::Staging, Registration::Vram(v)) => self
                .driver
                .enable_staging(Arc::clone(&v.provider), self.staging_shape())?,
            (Route::Cufile, _) => {
                self.cufile_executor();
            }
            _ => {}
        }
        // Once per distinct route and reason at info: a client registering a file per key
        // would otherwise log a line per file.
        let described = format!("{} ({reason})", route.describe());
        if self
            .failure
            .lock(&self.routes_logged, "route log")?
            .insert(described.clone())
        {
            tracing::info!("{what} <-> fd {}: {described}", file.fd);
        } else {
            tracing::debug!("{what} <-> fd {}: {described}", file.fd);
        }
        self.failure
            .lock(&self.routes, "route cache")?
            .insert(key, route.clone());
        Ok(route)
    }

    fn cufile_executor(&self) -> &CufileExecutor {
        self.cufile_exec.get_or_init(|| {
            path::cufile::executor(self.params.cufile_api, self.params.cufile_threads)
        })
    }

    fn register_storage(
        &self,
        kind: MemKind,
        offset: u64,
        len: u64,
        dev_id: u64,
        meta_info: &str,
    ) -> Result<FileRegion> {
        let region = FileRegion::register(
            Arc::clone(&self.ring),
            kind,
            offset,
            len,
            dev_id,
            meta_info,
            self.params.fixed_files,
        )?;
        if region.owned_path.is_some() {
            let mut ids = self.failure.lock(&self.path_dev_ids, "path-mode devIds")?;
            if !ids.insert(dev_id) {
                return Err(Error::invalid(format!(
                    "registerMem: path-mode devId {dev_id} is already registered for another file; path-mode devIds must be unique per file"
                )));
            }
        }
        Ok(region)
    }

    /// Drops NIXL's reference to a registration. Requests that still use it keep it alive. An
    /// `md` that is not live is refused without being touched.
    pub fn deregister(&self, md: *const c_void) -> Result<()> {
        self.failure.check()?;
        if md.is_null() {
            return Err(Error::invalid("deregisterMem: null metadata"));
        }
        let Some(reg) = self.registry.remove(md) else {
            return Err(Error::not_found(format!(
                "deregisterMem: MD {md:p} is not a live registration of this engine (deregistered already?); NIXL's registration lists can hand an MD back twice when several threads use an agent in sync mode NONE, which takes no locks: create the agent with sync mode RW"
            )));
        };
        if let Some(r) = &self.recorder {
            r.deregister(md as usize);
        }
        // A later registration may reuse the address once this one is gone. A file's routes go
        // too: a client registering a file per key (LMCache's dynamic mode) would otherwise grow
        // the cache by one route per file, and a later file with the same fd, device and inode
        // would find this file's route.
        let file = match &*reg {
            Registration::Storage(f) => Some(f.key()),
            _ => None,
        };
        let mem = Arc::as_ptr(&reg) as usize;
        self.failure
            .lock(&self.routes, "route cache")?
            .retain(|(m, k), _| *m != mem && Some(*k) != file);
        if let Registration::Storage(f) = &*reg {
            if f.owned_path.is_some() {
                self.failure
                    .lock(&self.path_dev_ids, "path-mode devIds")?
                    .remove(&f.dev_id);
            }
        }
        drop(reg);
        Ok(())
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
                "prepXfer: remote agent {remote_agent:?} is not this agent {:?}; IO_URING_DMABUF only moves data between this agent's memory and its storage",
                self.local_agent
            )));
        }
        let ctx = PlanContext {
            max_io_size: self.params.max_io_size,
            punt_buffered_min: self.params.punt_buffered_min,
            staging_buffer_size: self.params.staging_buffer_size,
            staging_buffers: self.params.staging_buffers,
            page_cache_threads: self.params.page_cache_threads,
            staged_write_piece_max: self.params.staged_write_piece_max,
            staged_read_piece_max: self.params.staged_read_piece(),
            route: &|mem, file| self.route(mem, file),
            lists: &self.op_lists,
            pool: self.prep_pool(local.len()),
        };
        let plan = plan(
            op,
            local_kind,
            local,
            remote_kind,
            remote,
            &self.registry,
            &ctx,
        )?;
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
                local_kind,
                local,
                remote_kind,
                remote,
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
        Ok(self.failure.lock(&self.routes, "route cache")?.len())
    }

    fn staging_shape(&self) -> StagingShape {
        StagingShape {
            buffer_size: self.params.staging_buffer_size,
            buffers: self.params.staging_buffers,
            pack_max: self.params.staging_pack_max,
            packed_copy: self.params.staging_copy,
            write_window: self.params.staged_write_window,
            max_io_size: self.params.max_io_size,
            kernel_streams: self.params.staging_kernel_streams,
        }
    }

    /// Whether the staging pool exists (for tests and diagnostics).
    pub fn staging_ready(&self) -> Result<bool> {
        self.driver.staging_ready()
    }

    /// Releases a request, aborting it if it is in flight. On error the request is handed back
    /// (NIXL keeps it and may try again).
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
        std::thread::scope(|s| {
            let poisoner = s.spawn(|| {
                let _g = e.routes.lock().unwrap();
                panic!("panic while holding the route cache lock (on purpose)");
            });
            assert!(poisoner.join().is_err());
        });
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
