//! The io_uring ring shared by all requests of one engine, and the request progress it drives.
//!
//! Invariants:
//! - Everything that touches the ring (SQ, CQ, register calls) happens under the one `core`
//!   lock, so NIXL may call post/check/release from any number of threads (sync modes NONE/RW).
//! - `user_data` is a slab key of the in-flight table, never a pointer. An in-flight entry keeps
//!   the op until its CQE arrives; a request is removed only when none of its ops is in flight.
//! - At most `max_inflight` ops are in the kernel at once (the CQ is twice as large), so CQEs
//!   never overflow in normal operation; the rest wait in the engine ("describe, then fill").
//! - Resources released by registrations (fixed-buffer and fixed-file slots) are retired through
//!   a leaf lock and unregistered the next time the core lock is taken, so a registration may be
//!   dropped anywhere, including while the core lock is held.
//! - Ops on GPU memory (`IoOp::device`) move through the staging pool: each takes a pinned
//!   buffer for its whole life (copy, storage I/O, and the copy back), so the pool size bounds
//!   the VRAM bytes in flight; device copies are polled, never waited for, on the data path.

pub mod dmabuf_uapi;
pub mod inline;
mod op;
mod slots;
pub mod staging;
mod workers;

pub use op::{FileRef, IoOp};

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use slab::Slab;

use crate::error::{describe_os_error, Error, ErrorKind, Result};
use crate::gpu::{CopyTicket, GpuProvider};
use slots::SlotPool;
use staging::StagingPool;
use workers::{Job, PageCacheWorkers};

/// user_data of SQEs whose completions carry no information (cancellations).
const IGNORED_CQE: u64 = u64::MAX;
/// Registered-buffer table size: the kernel's IORING_MAX_REG_BUFFERS.
const BUFFER_TABLE_SLOTS: u32 = 1 << 14;
/// Largest fixed buffer the kernel accepts in one slot.
pub const MAX_FIXED_BUFFER: u64 = 1 << 30;
/// Upper bound of the registered-file table (also limited by RLIMIT_NOFILE).
const FILE_TABLE_SLOTS: u32 = 4096;
/// How long teardown waits for in-flight I/O before giving up on it.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);

/// The ops of one prepared request.
#[derive(Debug)]
pub struct RequestOps {
    pub write: bool,
    pub ops: Vec<IoOp>,
    /// Every op is a buffered write from host memory: the calling threads may write them
    /// themselves (see `help_with_writes`).
    pub inline_writes: bool,
    /// Every op is a buffered read into host memory: a small request may be served from the
    /// page cache by the posting thread (see `read_inline_if_cached`).
    pub inline_reads: bool,
}

/// A read request this small is first tried from the page cache by the posting thread: one
/// preadv2 per op beats a ring round trip (SQE, io_uring_enter, CQE, and NIXL's second call to
/// see the completion). Larger requests gain more from one batched io_uring_enter.
const INLINE_READ_MAX_OPS: usize = 4;
const INLINE_READ_MAX_BYTES: u64 = 64 << 10;

/// Buffered writes of one request that may sit in io_uring at once. io_uring's workers run
/// buffered writes to one file one after another, so a few keep them busy; the rest are left for
/// the threads that post and poll, which write them directly.
const RING_WRITES_PER_REQUEST: usize = 4;

/// Key of a request in the ring's progress table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestKey(usize);

/// Outcome of a post or check that did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    InFlight,
    Done,
}

/// Identity of an open file, so a fd number that was closed and reused maps to a new slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub fd: i32,
    pub dev: u64,
    pub ino: u64,
}

enum Retired {
    Buffer(u16),
    File(FileKey),
}

/// The ring of one engine.
pub struct Ring {
    core: Mutex<Core>,
    retired: Mutex<Vec<Retired>>,
    pub sq_entries: u32,
}

struct FileSlot {
    slot: u32,
    refs: u32,
}

enum State {
    Idle,
    Running {
        /// Ops handed out so far (to the ring or to an inline writer).
        next: usize,
        /// Ops not finished yet (including those never handed out).
        outstanding: usize,
        /// Ops being written inline by some thread right now.
        inline_active: usize,
        error: Option<Error>,
        abort: bool,
    },
    Done,
    Failed(Error),
}

struct RequestProgress {
    ops: Arc<RequestOps>,
    state: State,
}

/// A storage I/O the engine owns until its CQE (or a retry of one).
struct InFlight {
    req: usize,
    /// The storage I/O as submitted (on a staging buffer when `stage` is set).
    op: IoOp,
    stage: Option<Stage>,
}

/// The staging side of an op on GPU memory.
#[derive(Clone, Copy)]
struct Stage {
    buf: usize,
    /// The op as planned, on device memory.
    device_op: IoOp,
}

/// An asynchronous device copy of a staged op.
struct PendingCopy {
    req: usize,
    stage: Stage,
    ticket: Box<dyn CopyTicket>,
    /// Device -> host copy of a WRITE: the storage write follows.
    then_write: bool,
}

struct Core {
    uring: IoUring,
    max_inflight: usize,
    inflight: Slab<InFlight>,
    requests: Slab<RequestProgress>,
    /// Requests that still have ops not yet handed to the kernel, oldest first.
    queue: VecDeque<usize>,
    /// Remainders of short I/O and ops the kernel asked to retry; they go first.
    retry: VecDeque<InFlight>,
    buffer_slots: Option<SlotPool>,
    file_slots: Option<SlotPool>,
    files: HashMap<FileKey, FileSlot>,
    staging: Option<StagingPool>,
    copies: Vec<PendingCopy>,
    /// Threads for page-cache I/O (`IoOp::punt`), started on first use.
    workers: Option<PageCacheWorkers>,
    /// Ops of `inflight` that are on `workers` rather than in the kernel.
    on_workers: usize,
    /// Scratch list of (user_data, result) completions, reused.
    completed: Vec<(u64, i32)>,
}

impl Ring {
    /// Creates the ring and its sparse buffer and file tables. A table the kernel refuses is
    /// simply absent (I/O then uses plain buffers or fds), logged once.
    pub fn new(sq_entries: u32, fixed_files: bool) -> Result<Ring> {
        let uring = IoUring::builder()
            .setup_cqsize(sq_entries * 2)
            .setup_submit_all()
            .dontfork()
            .build(sq_entries)
            .or_else(|_| IoUring::builder().setup_cqsize(sq_entries * 2).build(sq_entries))
            .map_err(|e| {
                Error::os(
                    format!("io_uring_setup({sq_entries} entries) failed; is io_uring disabled (sysctl kernel.io_uring_disabled, seccomp)?"),
                    &e,
                )
            })?;
        let sq = uring.params().sq_entries();
        let cq = uring.params().cq_entries();
        let buffer_slots = match uring.submitter().register_buffers_sparse(BUFFER_TABLE_SLOTS) {
            Ok(()) => Some(SlotPool::new(BUFFER_TABLE_SLOTS)),
            Err(e) => {
                tracing::info!("io_uring fixed buffers unavailable ({}); DRAM uses plain READ/WRITE", describe_os_error(&e));
                None
            }
        };
        let file_slots = if fixed_files {
            let nofile = nofile_limit().min(FILE_TABLE_SLOTS as u64) as u32;
            match uring.submitter().register_files_sparse(nofile) {
                Ok(()) => Some(SlotPool::new(nofile)),
                Err(e) => {
                    tracing::info!("io_uring fixed files unavailable ({}); I/O passes raw fds", describe_os_error(&e));
                    None
                }
            }
        } else {
            None
        };
        tracing::debug!(sq, cq, "io_uring ring ready");
        Ok(Ring {
            core: Mutex::new(Core {
                uring,
                max_inflight: (cq / 2).max(1) as usize,
                inflight: Slab::new(),
                requests: Slab::new(),
                queue: VecDeque::new(),
                retry: VecDeque::new(),
                buffer_slots,
                file_slots,
                files: HashMap::new(),
                staging: None,
                workers: None,
                on_workers: 0,
                completed: Vec::new(),
                copies: Vec::new(),
            }),
            retired: Mutex::new(Vec::new()),
            sq_entries: sq,
        })
    }

    /// Locks the core. Whatever was retired meanwhile is unregistered now and again when the
    /// guard is dropped.
    fn lock(&self) -> CoreGuard<'_> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        HOLDER.with(|h| h.set(self as *const Ring as usize));
        let mut guard = CoreGuard { core, ring: self };
        guard.flush_retired();
        guard
    }

    /// Queues a slot for unregistration and, unless this thread is inside the ring's lock
    /// already (then the guard does it when released), unregisters it right away: a
    /// deregistered buffer must not stay pinned, nor a file open, until some later call.
    fn retire(&self, r: Retired) {
        self.retired.lock().unwrap_or_else(|p| p.into_inner()).push(r);
        if HOLDER.with(|h| h.get()) != self as *const Ring as usize {
            drop(self.lock());
        }
    }

    /// Registers `len` bytes at `addr` (at most 1 GiB) as a fixed buffer.
    ///
    /// # Safety
    /// The memory must stay mapped until [`Ring::release_buffer`] for the returned slot; the
    /// kernel pins it and may read or write it for any op that names the slot.
    pub unsafe fn register_buffer(&self, addr: u64, len: u64) -> io::Result<u16> {
        debug_assert!(len <= MAX_FIXED_BUFFER);
        let mut core = self.lock();
        let core = &mut *core;
        let pool = core.buffer_slots.as_mut().ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool.take().ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize };
        // SAFETY: the caller keeps the memory mapped until the slot is released.
        match unsafe { core.uring.submitter().register_buffers_update(slot, &[iov], None) } {
            Ok(()) => Ok(slot as u16),
            Err(e) => {
                pool.put(slot);
                Err(e)
            }
        }
    }

    /// Gives a fixed-buffer slot back (deferred until the next time the ring is locked).
    pub fn release_buffer(&self, slot: u16) {
        self.retire(Retired::Buffer(slot));
    }

    /// A registered-file slot for `key`, shared by every registration of the same open file.
    /// None when the table is absent or full (I/O then passes the raw fd).
    pub fn acquire_file(&self, key: FileKey) -> Option<u32> {
        let mut core = self.lock();
        let core = &mut *core;
        if let Some(f) = core.files.get_mut(&key) {
            f.refs += 1;
            return Some(f.slot);
        }
        let pool = core.file_slots.as_mut()?;
        let slot = pool.take()?;
        match core.uring.submitter().register_files_update(slot, &[key.fd]) {
            Ok(_) => {
                core.files.insert(key, FileSlot { slot, refs: 1 });
                Some(slot)
            }
            Err(e) => {
                pool.put(slot);
                tracing::debug!(fd = key.fd, "fixed-file registration failed ({}); using the raw fd", describe_os_error(&e));
                None
            }
        }
    }

    /// Drops one reference to the file slot of `key` (deferred like buffers).
    pub fn release_file(&self, key: FileKey) {
        self.retire(Retired::File(key));
    }

    /// Creates the staging pool on first use (later calls do nothing).
    pub fn enable_staging(&self, provider: Arc<dyn GpuProvider>, buffer_size: u64, count: u32) -> Result<()> {
        let mut core = self.lock();
        if core.staging.is_some() {
            return Ok(());
        }
        let core = &mut *core;
        let (uring, buffer_slots) = (&core.uring, &mut core.buffer_slots);
        let pool = StagingPool::new(provider, buffer_size, count, |addr, len| {
            let pool = buffer_slots.as_mut()?;
            let slot = pool.take()?;
            let iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize };
            // SAFETY: the staging mapping lives as long as the pool, which the core drops only
            // after every op using it has completed.
            match unsafe { uring.submitter().register_buffers_update(slot, &[iov], None) } {
                Ok(()) => Some(slot as u16),
                Err(e) => {
                    pool.put(slot);
                    tracing::info!("staging buffer not registered as a fixed buffer ({}); using plain I/O", describe_os_error(&e));
                    None
                }
            }
        })?;
        core.staging = Some(pool);
        Ok(())
    }

    /// Registers a DMA-BUF in a free fixed-buffer slot, bound to `target_fd`.
    pub fn register_dmabuf(&self, dmabuf_fd: i32, target_fd: i32) -> io::Result<u16> {
        use std::os::fd::AsRawFd;
        let mut core = self.lock();
        let core = &mut *core;
        // v3 accepts DMA-BUFs on IOPOLL rings, later versions are reported to refuse them
        // (docs/kernel-dmabuf-series.md): never rely on it. This ring is never IOPOLL; the check
        // keeps it that way if the setup flags ever change.
        if core.uring.params().is_setup_iopoll() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        let pool = core.buffer_slots.as_mut().ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool.take().ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        match dmabuf_uapi::register_dmabuf(core.uring.as_raw_fd(), slot, dmabuf_fd, target_fd) {
            Ok(()) => Ok(slot as u16),
            Err(e) => {
                pool.put(slot);
                Err(e)
            }
        }
    }

    /// Adds a prepared request; it starts idle.
    pub fn add_request(&self, ops: Arc<RequestOps>) -> RequestKey {
        let mut core = self.lock();
        RequestKey(core.requests.insert(RequestProgress { ops, state: State::Idle }))
    }

    /// Starts (or restarts) a request. Returns Done when everything completed during the call.
    /// `inline_budget`: bytes of buffered writes this thread may write itself (0 = none).
    pub fn post(&self, key: RequestKey, inline_budget: u64) -> Result<Progress> {
        let mut core = self.lock();
        let req = core.requests.get_mut(key.0).ok_or_else(|| Error::backend("postXfer: unknown request handle"))?;
        if matches!(req.state, State::Running { .. }) {
            return Err(Error::new(ErrorKind::RepostActive, "postXfer: the request is still in flight; wait for it or release it"));
        }
        let total = req.ops.ops.len();
        if total == 0 {
            req.state = State::Done;
            return Ok(Progress::Done);
        }
        req.state = State::Running { next: 0, outstanding: total, inline_active: 0, error: None, abort: false };
        let mut core = self.read_inline_if_cached(core, key.0);
        if let Ok(Progress::Done) = core.status(key.0) {
            return Ok(Progress::Done);
        }
        core.queue.push_back(key.0);
        let mut core = self.help_with_writes(core, key.0, inline_budget);
        core.progress()?;
        core.status(key.0)
    }

    /// Reaps completions (for every request) without blocking and reports this request's state.
    pub fn check(&self, key: RequestKey, inline_budget: u64) -> Result<Progress> {
        let mut core = self.lock();
        core.progress()?;
        let mut core = self.help_with_writes(core, key.0, inline_budget);
        core.progress()?;
        core.status(key.0)
    }

    /// Writes up to `budget` bytes of the request's not-yet-started buffered writes with
    /// pwrite(2) in this thread, without holding the lock while writing. Page-cache writes are
    /// memory copies: done here they avoid a hand-off to io_uring's worker per I/O (which is what
    /// makes libaio fast on buffered files), while the ring keeps a few in flight meanwhile.
    fn help_with_writes<'a>(&'a self, mut core: CoreGuard<'a>, key: usize, budget: u64) -> CoreGuard<'a> {
        let Some(req) = core.requests.get_mut(key) else { return core };
        if budget == 0 || !req.ops.inline_writes {
            return core;
        }
        let ops = Arc::clone(&req.ops);
        let State::Running { next, inline_active, error: None, abort: false, .. } = &mut req.state else { return core };
        let (start, mut end, mut bytes) = (*next, *next, 0u64);
        while end < ops.ops.len() && bytes < budget {
            bytes += ops.ops[end].len as u64;
            end += 1;
        }
        if end == start {
            return core;
        }
        *next = end;
        *inline_active += end - start;
        drop(core);
        let result = inline::write_all(&ops.ops[start..end]);
        let mut core = self.lock();
        // The request still exists: release waits until no op is outstanding.
        if let Some(req) = core.requests.get_mut(key) {
            if let State::Running { outstanding, inline_active, .. } = &mut req.state {
                *outstanding -= end - start;
                *inline_active -= end - start;
            }
            if let Err(e) = result {
                fail(req, e);
            }
            finish_if_drained(req);
        }
        core
    }

    /// Serves a small buffered read request from the page cache in this thread, without holding
    /// the lock while copying; what it could not serve stays for the ring.
    fn read_inline_if_cached<'a>(&'a self, mut core: CoreGuard<'a>, key: usize) -> CoreGuard<'a> {
        let Some(req) = core.requests.get_mut(key) else { return core };
        let ops = Arc::clone(&req.ops);
        let n = ops.ops.len();
        if !ops.inline_reads || n > INLINE_READ_MAX_OPS || ops.ops.iter().map(|o| o.len as u64).sum::<u64>() > INLINE_READ_MAX_BYTES {
            return core;
        }
        let State::Running { next: next @ 0, inline_active, error: None, abort: false, .. } = &mut req.state else { return core };
        *next = n;
        *inline_active += n;
        drop(core);
        let done = inline::read_cached_prefix(&ops.ops);
        let mut core = self.lock();
        // The request still exists: release waits until no op is outstanding.
        if let Some(req) = core.requests.get_mut(key) {
            if let State::Running { next, outstanding, inline_active, .. } = &mut req.state {
                *inline_active -= n;
                *outstanding -= done;
                *next = done;
            }
            // A release that came meanwhile drops the ops not read.
            stop_if_failing(req);
            finish_if_drained(req);
        }
        core
    }

    /// Removes a request. One still in flight is aborted: its queued ops are dropped, its
    /// in-flight ops cancelled, and the call waits until the kernel has let go of all of them.
    pub fn remove_request(&self, key: RequestKey) -> Result<()> {
        let deadline = Instant::now() + TEARDOWN_WAIT;
        let mut aborted = false;
        loop {
            // Re-locked every round so that threads writing this request's ops inline can
            // report back.
            let mut core = self.lock();
            let running = matches!(core.requests.get(key.0).map(|r| &r.state), Some(State::Running { .. }));
            if !running {
                if core.requests.contains(key.0) {
                    core.requests.remove(key.0);
                }
                return Ok(());
            }
            if !aborted {
                core.abort(key.0);
                aborted = true;
                continue;
            }
            if Instant::now() > deadline {
                return Err(Error::backend(format!(
                    "releaseReqH: in-flight I/O did not finish within {}s after cancellation; the request is kept",
                    TEARDOWN_WAIT.as_secs()
                )));
            }
            core.wait_one(Duration::from_millis(10))?;
        }
    }
}

thread_local! {
    /// The ring whose core lock this thread holds (its address), or 0.
    static HOLDER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The locked core. Dropping it unregisters retired slots before the lock is released.
struct CoreGuard<'a> {
    core: MutexGuard<'a, Core>,
    ring: &'a Ring,
}

impl CoreGuard<'_> {
    fn flush_retired(&mut self) {
        let retired = std::mem::take(&mut *self.ring.retired.lock().unwrap_or_else(|p| p.into_inner()));
        for r in retired {
            self.core.unregister(r);
        }
    }
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        &mut self.core
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.flush_retired();
        HOLDER.with(|h| h.set(0));
    }
}

impl Core {
    /// Polls device copies, fills the SQ, submits, reaps; repeats while that made progress.
    fn progress(&mut self) -> Result<()> {
        loop {
            let copied = self.poll_copies();
            self.fill();
            self.submit()?;
            let reaped = self.reap();
            if reaped == 0 && copied == 0 {
                return Ok(());
            }
        }
    }

    /// Moves waiting ops into the SQ (or, for staged WRITEs, onto a device stream) as far as
    /// the SQ, the in-flight bound and the staging pool allow.
    fn fill(&mut self) {
        let Core { uring, max_inflight, inflight, requests, queue, retry, staging, copies, workers, on_workers, .. } = self;
        let (submitter, mut sq, _) = uring.split();
        let mut throttled = 0;
        loop {
            if inflight.len() >= *max_inflight {
                break;
            }
            // Retries first: remainders of short I/O, EAGAIN, and staged writes whose copy ended.
            if let Some(entry) = retry.pop_front() {
                let Some(req) = requests.get_mut(entry.req) else { continue };
                let write = req.ops.write;
                if !is_healthy(req) {
                    drop_op(req, entry.stage, staging);
                    continue;
                }
                if !push_sqe(&submitter, &mut sq, inflight, entry, write, retry, (workers, on_workers)) {
                    break;
                }
                continue;
            }
            let Some(&key) = queue.front() else { break };
            let Some(req) = requests.get_mut(key) else {
                queue.pop_front();
                continue;
            };
            let total = req.ops.ops.len();
            let inline_writes = req.ops.inline_writes;
            let State::Running { next, outstanding, inline_active, error: None, abort: false } = &mut req.state else {
                queue.pop_front();
                continue;
            };
            if *next >= total {
                queue.pop_front();
                continue;
            }
            if inline_writes && *next - (total - *outstanding) - *inline_active >= RING_WRITES_PER_REQUEST {
                // Enough of this request's writes are in the ring: let the next request go.
                queue.rotate_left(1);
                throttled += 1;
                if throttled >= queue.len() {
                    break;
                }
                continue;
            }
            let op = req.ops.ops[*next];
            let write = req.ops.write;
            let stage = match op.device {
                None => None,
                Some(_) => {
                    let Some(pool) = staging.as_mut() else {
                        fail(req, Error::backend("internal error: a VRAM op reached the ring before its staging pool existed"));
                        continue;
                    };
                    // All buffers busy: wait for completions to free one.
                    let Some(buf) = pool.take() else { break };
                    Some(Stage { buf, device_op: op })
                }
            };
            *next += 1;
            if *next == total {
                queue.pop_front();
            }
            match stage {
                None => {
                    if !push_sqe(&submitter, &mut sq, inflight, InFlight { req: key, op, stage: None }, write, retry, (workers, on_workers)) {
                        break;
                    }
                }
                Some(stage) => {
                    let pool = staging.as_mut().expect("checked above");
                    let host = &pool.bufs[stage.buf];
                    let host_op = op.on_host(host.addr, host.buf_index);
                    if write {
                        // GPU -> staging buffer first; the storage write follows in poll_copies.
                        // SAFETY: the staging buffer is ours until released; the device range is
                        // registered VRAM kept alive by the request's plan.
                        let started = unsafe { pool.provider.copy_to_host(op.device.unwrap_or(0), host.addr, op.addr, op.len as u64) };
                        match started {
                            Ok(ticket) => copies.push(PendingCopy { req: key, stage, ticket, then_write: true }),
                            Err(e) => {
                                fail(req, e);
                                drop_op(req, Some(stage), staging);
                            }
                        }
                    } else if !push_sqe(
                        &submitter,
                        &mut sq,
                        inflight,
                        InFlight { req: key, op: host_op, stage: Some(stage) },
                        write,
                        retry,
                        (workers, on_workers),
                    ) {
                        break;
                    }
                }
            }
        }
        sq.sync();
    }

    /// Finishes device copies that completed; returns how many did.
    fn poll_copies(&mut self) -> usize {
        if self.copies.is_empty() {
            return 0;
        }
        let mut done = 0;
        let mut i = 0;
        while i < self.copies.len() {
            let finished = self.copies[i].ticket.is_done();
            if let Ok(false) = finished {
                i += 1;
                continue;
            }
            let copy = self.copies.swap_remove(i);
            done += 1;
            let Some(req) = self.requests.get_mut(copy.req) else { continue };
            match finished {
                Err(e) => {
                    fail(req, e);
                    drop_op(req, Some(copy.stage), &mut self.staging);
                }
                Ok(_) if copy.then_write && is_healthy(req) => {
                    let pool = self.staging.as_ref().expect("staged op without pool");
                    let host = &pool.bufs[copy.stage.buf];
                    let op = copy.stage.device_op.on_host(host.addr, host.buf_index);
                    self.retry.push_back(InFlight { req: copy.req, op, stage: Some(copy.stage) });
                }
                Ok(_) => {
                    // The H2D copy of a READ ended (or the request is failing): the op is done.
                    drop_op(req, Some(copy.stage), &mut self.staging);
                }
            }
        }
        done
    }

    /// Hands queued SQEs to the kernel (and flushes overflowed CQEs when the kernel says so).
    fn submit(&mut self) -> Result<()> {
        let need = {
            let sq = self.uring.submission();
            !sq.is_empty() || sq.cq_overflow() || sq.taskrun()
        };
        if !need {
            return Ok(());
        }
        loop {
            match self.uring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The kernel is short of resources or CQ room: what was not consumed stays in
                // the SQ and goes with the next submit.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => return Ok(()),
                Err(e) => return Err(Error::os("io_uring_enter (submit)", &e)),
            }
        }
    }

    /// Processes every available completion (CQEs and page-cache workers' results); returns how
    /// many there were.
    fn reap(&mut self) -> usize {
        let mut done = std::mem::take(&mut self.completed);
        done.clear();
        let mut n = 0;
        for cqe in self.uring.completion() {
            n += 1;
            if cqe.user_data() != IGNORED_CQE {
                done.push((cqe.user_data(), cqe.result()));
            }
        }
        if self.on_workers > 0 {
            if let Some(w) = &self.workers {
                let before = done.len();
                w.take_done(&mut done);
                self.on_workers -= done.len() - before;
                n += done.len() - before;
            }
        }
        for &(ud, res) in &done {
            self.complete(ud, res);
        }
        self.completed = done;
        n
    }

    /// One storage I/O ended with `res` (bytes moved or -errno).
    fn complete(&mut self, ud: u64, res: i32) {
        let Core { inflight, requests, retry, staging, copies, .. } = self;
        let Some(entry) = inflight.try_remove(ud as usize) else {
            tracing::error!(user_data = ud, "io_uring completion for an unknown op; ignored");
            return;
        };
        let req = &mut requests[entry.req];
        let write = req.ops.write;
        let State::Running { error, abort, .. } = &mut req.state else {
            tracing::error!("io_uring completion for a request that is not running; ignored");
            return;
        };
        let op = entry.op;
        if res >= 0 && res as u32 == op.len {
            match entry.stage {
                // A staged READ landed in its buffer: copy it up to the GPU.
                Some(stage) if !write && error.is_none() && !*abort => {
                    let pool = staging.as_ref().expect("staged op without pool");
                    let host = pool.bufs[stage.buf].addr;
                    let d = stage.device_op;
                    // SAFETY: the buffer stays ours until the copy completes; the device range
                    // is registered VRAM kept alive by the plan.
                    match unsafe { pool.provider.copy_to_device(d.device.unwrap_or(0), d.addr, host, d.len as u64) } {
                        Ok(ticket) => copies.push(PendingCopy { req: entry.req, stage, ticket, then_write: false }),
                        Err(e) => {
                            fail(req, e);
                            drop_op(req, Some(stage), staging);
                        }
                    }
                }
                stage => drop_op(req, stage, staging),
            }
        } else if res > 0 {
            // Short transfer: finish the remainder (NIXL's POSIX fails the request here).
            retry.push_back(InFlight { req: entry.req, op: op.remainder(res as u32), stage: entry.stage });
        } else if res == 0 {
            if error.is_none() {
                *error = Some(op.made_no_progress(write));
            }
            drop_op(req, entry.stage, staging);
        } else {
            let errno = -res;
            // EAGAIN includes the spurious ones of DMA-BUF slots (mapping invalidated by the
            // exporter), which the series asks users to reissue (v3 10/10, checked up to v7).
            let retryable = errno == libc::EAGAIN || errno == libc::EINTR || (errno == libc::ECANCELED && !*abort);
            if retryable && error.is_none() && !*abort {
                retry.push_back(InFlight { req: entry.req, op, stage: entry.stage });
            } else {
                if error.is_none() && !*abort {
                    *error = Some(op.failed(write, errno));
                }
                drop_op(req, entry.stage, staging);
            }
        }
        stop_if_failing(req);
        finish_if_drained(req);
    }

    /// This request's state as a post/check result.
    fn status(&mut self, key: usize) -> Result<Progress> {
        let req = self.requests.get_mut(key).ok_or_else(|| Error::backend("unknown request handle"))?;
        match &req.state {
            State::Idle => Err(Error::new(ErrorKind::InvalidParam, "checkXfer on a request that was never posted")),
            State::Running { .. } => Ok(Progress::InFlight),
            State::Done => Ok(Progress::Done),
            State::Failed(e) => Err(e.clone()),
        }
    }

    /// Marks a request aborted and asks the kernel to cancel its in-flight ops.
    fn abort(&mut self, key: usize) {
        let Some(req) = self.requests.get_mut(key) else { return };
        if let State::Running { abort, .. } = &mut req.state {
            *abort = true;
        }
        stop_if_failing(req);
        finish_if_drained(req);
        let targets: Vec<u64> = self.inflight.iter().filter(|(_, f)| f.req == key).map(|(k, _)| k as u64).collect();
        if let (Some(w), true) = (&self.workers, self.on_workers > 0) {
            w.cancel(&targets);
        }
        for ud in targets {
            let sqe = opcode::AsyncCancel::new(ud).build().user_data(IGNORED_CQE);
            loop {
                // SAFETY: a cancel SQE references no memory.
                if unsafe { self.uring.submission().push(&sqe) }.is_ok() {
                    break;
                }
                if self.submit().is_err() {
                    break;
                }
                self.reap();
            }
        }
        let _ = self.submit();
    }

    /// Waits (bounded) for at least one completion, storage or device copy, and processes what
    /// arrived.
    fn wait_one(&mut self, timeout: Duration) -> Result<()> {
        let in_kernel = self.inflight.len() - self.on_workers;
        if self.inflight.is_empty() && !self.copies.is_empty() {
            // Only device copies are pending: block on the oldest.
            if let Err(e) = self.copies[0].ticket.wait() {
                tracing::error!("waiting for a device copy: {e}");
            }
        } else if in_kernel == 0 && self.copies.is_empty() && self.on_workers > 0 {
            // Only page-cache workers are busy: wait for one of them.
            if let Some(w) = &self.workers {
                w.wait_done(timeout);
            }
        } else {
            // Results of device copies and workers arrive outside the ring: look again soon.
            let timeout = if self.copies.is_empty() && self.on_workers == 0 { timeout } else { Duration::from_millis(1) };
            let ts = types::Timespec::new().sec(timeout.as_secs()).nsec(timeout.subsec_nanos());
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.uring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                Err(e) => return Err(Error::os("io_uring_enter (wait)", &e)),
            }
        }
        self.progress()
    }

    fn unregister(&mut self, r: Retired) {
        match r {
            Retired::Buffer(slot) => {
                let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
                // SAFETY: an empty iovec clears the slot; no memory is handed to the kernel.
                let res = unsafe { self.uring.submitter().register_buffers_update(slot as u32, &[empty], None) };
                match res {
                    Ok(()) => {
                        if let Some(pool) = self.buffer_slots.as_mut() {
                            pool.put(slot as u32)
                        }
                    }
                    Err(e) => tracing::error!(slot, "unregistering fixed buffer slot failed ({}); slot leaked", describe_os_error(&e)),
                }
            }
            Retired::File(key) => {
                let Some(f) = self.files.get_mut(&key) else { return };
                f.refs -= 1;
                if f.refs > 0 {
                    return;
                }
                let slot = f.slot;
                self.files.remove(&key);
                match self.uring.submitter().register_files_update(slot, &[-1]) {
                    Ok(_) => {
                        if let Some(pool) = self.file_slots.as_mut() {
                            pool.put(slot)
                        }
                    }
                    Err(e) => tracing::error!(slot, "unregistering fixed file slot failed ({}); slot leaked", describe_os_error(&e)),
                }
            }
        }
    }
}

impl Drop for Core {
    /// Never free the ring while the kernel may still write into user memory: cancel and wait
    /// (bounded) for every in-flight op first.
    fn drop(&mut self) {
        if self.inflight.is_empty() && self.copies.is_empty() {
            return;
        }
        let keys: Vec<usize> = self.requests.iter().map(|(k, _)| k).collect();
        for k in keys {
            self.abort(k);
        }
        let deadline = Instant::now() + TEARDOWN_WAIT;
        while !(self.inflight.is_empty() && self.copies.is_empty()) && Instant::now() < deadline {
            if self.wait_one(Duration::from_millis(100)).is_err() {
                break;
            }
        }
        if !self.inflight.is_empty() {
            tracing::error!(ops = self.inflight.len(), "engine destroyed with I/O still in flight after cancellation");
        }
    }
}

/// Once a request has an error or is aborted, ops not yet handed to the kernel are dropped.
fn stop_if_failing(req: &mut RequestProgress) {
    let total = req.ops.ops.len();
    if let State::Running { next, outstanding, error, abort, .. } = &mut req.state {
        if (error.is_some() || *abort) && *next < total {
            *outstanding -= total - *next;
            *next = total;
        }
    }
}

/// Whether a request's ops should still go ahead.
fn is_healthy(req: &RequestProgress) -> bool {
    matches!(req.state, State::Running { error: None, abort: false, .. })
}

/// Records the first error of a running request and stops its unsubmitted ops.
fn fail(req: &mut RequestProgress, e: Error) {
    if let State::Running { error, .. } = &mut req.state {
        if error.is_none() {
            *error = Some(e);
        }
    }
    stop_if_failing(req);
}

/// One op of the request is over (done, failed or dropped): release its staging buffer and
/// count it.
fn drop_op(req: &mut RequestProgress, stage: Option<Stage>, staging: &mut Option<StagingPool>) {
    if let (Some(stage), Some(pool)) = (stage, staging.as_mut()) {
        pool.put(stage.buf);
    }
    if let State::Running { outstanding, .. } = &mut req.state {
        *outstanding -= 1;
    }
    finish_if_drained(req);
}

/// Page-cache workers for punted ops: more threads than this rarely help one file's copies.
const PAGE_CACHE_WORKERS_MAX: usize = 8;

/// How many page-cache worker threads an engine starts: half the CPUs, 2 to 8. Asked once per
/// process (the planner uses it per request; the answer reads cgroup files).
pub fn page_cache_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(2, |n| n.get() / 2).clamp(2, PAGE_CACHE_WORKERS_MAX))
}

/// Pushes one SQE, submitting first if the SQ is full, or hands a punted op to the page-cache
/// workers. Returns false (and keeps the entry for a retry) when there is still no room.
fn push_sqe(
    submitter: &io_uring::Submitter<'_>,
    sq: &mut io_uring::SubmissionQueue<'_>,
    inflight: &mut Slab<InFlight>,
    entry: InFlight,
    write: bool,
    retry: &mut VecDeque<InFlight>,
    (workers, on_workers): (&mut Option<PageCacheWorkers>, &mut usize),
) -> bool {
    if entry.op.punt {
        if workers.is_none() {
            match PageCacheWorkers::new(page_cache_threads()) {
                Ok(w) => {
                    tracing::debug!(threads = w.threads(), "page-cache workers started");
                    *workers = Some(w);
                }
                Err(e) => tracing::info!("page-cache workers unavailable ({e}); punted I/O goes to io_uring's workers"),
            }
        }
        if let Some(w) = workers.as_ref() {
            let op = entry.op;
            let token = inflight.insert(entry) as u64;
            *on_workers += 1;
            w.submit(Job { token, fd: op.fd, offset: op.file_offset, addr: op.addr, len: op.len, write });
            return true;
        }
    }
    if sq.is_full() {
        sq.sync();
        if submitter.submit().is_err() {
            retry.push_front(entry);
            return false;
        }
        sq.sync();
        if sq.is_full() {
            retry.push_front(entry);
            return false;
        }
    }
    let user_data = inflight.vacant_key() as u64;
    let sqe = entry.op.to_sqe(write, user_data);
    inflight.insert(entry);
    // SAFETY: the SQE names memory of a registration that the request keeps alive (its plan
    // holds the registration Arcs), a staging buffer owned by the entry, or user memory that
    // NIXL's contract keeps valid until the request is released; release waits for every op.
    unsafe { sq.push(&sqe) }.expect("SQ has room: checked above");
    true
}

fn finish_if_drained(req: &mut RequestProgress) {
    if let State::Running { outstanding: 0, error, abort, .. } = &mut req.state {
        req.state = if *abort {
            State::Failed(Error::new(ErrorKind::Canceled, "request released while in flight"))
        } else if let Some(e) = error.take() {
            State::Failed(e)
        } else {
            State::Done
        };
    }
}

fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}
