//! The io_uring ring of one engine: SQ/CQ, the fixed-buffer and fixed-file tables, the count of
//! ops in flight, and the page-cache workers as a second queue with the same (token, result)
//! completions.
//!
//! Invariants:
//! - Everything that touches the SQ, the CQ or the tables happens under the one core lock.
//! - `user_data` is the caller's token (its own in-flight key), never a pointer; the ring keeps
//!   no per-op state beyond counting, so it knows nothing of requests or paths.
//! - At most `max_inflight` ops are in the kernel or on the workers at once (the CQ is twice as
//!   large), so CQEs never overflow in normal operation; callers ask `has_room` first.
//! - Slots released by registrations are retired through a leaf lock and unregistered the next
//!   time the core lock is taken, so a registration may be dropped anywhere, including while the
//!   core lock is held.
//! - A poisoned core lock fails the engine (`error::Failure`): calls that can answer an error
//!   do; the retire path (taken from `Drop`s) recovers the lock's value, so slots are still
//!   unregistered.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

use super::dmabuf_uapi;
use super::op::IoOp;
use super::slots::SlotPool;
use super::workers::{joins_batch, Job, PageCacheWorkers, QueueHelper, WorkerConfig};
use crate::error::{describe_os_error, Error, Failure, Result};

/// user_data of SQEs whose completions carry no information (cancellations).
const IGNORED_CQE: u64 = u64::MAX;
/// user_data of the op of `run_one`.
const RUN_ONE_CQE: u64 = u64::MAX - 1;
/// Registered-buffer table size: the kernel's IORING_MAX_REG_BUFFERS.
const BUFFER_TABLE_SLOTS: u32 = 1 << 14;
/// Largest fixed buffer the kernel accepts in one slot.
pub const MAX_FIXED_BUFFER: u64 = 1 << 30;
/// Upper bound of the registered-file table (also limited by RLIMIT_NOFILE).
const FILE_TABLE_SLOTS: u32 = 4096;

/// Identity of an open file, so a fd number that was closed and reused maps to a new slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub fd: i32,
    pub dev: u64,
    pub ino: u64,
}

/// One storage I/O handed to the ring: the op, its direction, and the caller's token that comes
/// back with its result.
#[derive(Debug, Clone, Copy)]
pub struct Submission {
    pub op: IoOp,
    pub write: bool,
    pub token: u64,
}

enum Retired {
    Buffer(u16),
    File(FileKey),
}

/// Punted ops smaller than this are gathered into worker jobs of about this many bytes: a
/// thread hand-off costs a few microseconds, as much as copying 16 KiB from the page cache, so
/// KV-cache blocks of 16-64 KiB go to the workers in groups (larger ops stay one job each, so a
/// request's big pieces still spread over all threads).
pub const WORKER_JOB_BYTES: u64 = 256 << 10;

/// The ring of one engine.
pub struct Ring {
    core: Mutex<RingCore>,
    retired: Mutex<Vec<Retired>>,
    pub sq_entries: u32,
    /// The engine's failed state, set when one of the ring's locks is found poisoned.
    failure: Arc<Failure>,
}

struct FileSlot {
    slot: u32,
    refs: u32,
}

/// What the core lock guards.
pub struct RingCore {
    uring: IoUring,
    failure: Arc<Failure>,
    max_inflight: usize,
    /// Ops whose CQE has not arrived yet.
    in_kernel: usize,
    /// Ops queued on or running on the page-cache workers.
    on_workers: usize,
    /// Threads for page-cache I/O (`IoOp::punt`), started on first use.
    workers: Option<PageCacheWorkers>,
    /// How many workers to start and how many may write one file at once.
    worker_config: WorkerConfig,
    /// Small punted ops gathered into one worker job (see `WORKER_JOB_BYTES`), handed over at
    /// the next `submit` or when full.
    batch: Vec<Job>,
    batch_bytes: u64,
    /// Completions reaped while `run_one` waited for its own, handed out by the next `reap`.
    backlog: Vec<(u64, i32)>,
    buffer_slots: Option<SlotPool>,
    file_slots: Option<SlotPool>,
    files: HashMap<FileKey, FileSlot>,
}

impl Ring {
    /// Creates the ring and its sparse buffer and file tables. A table the kernel refuses is
    /// simply absent (I/O then uses plain buffers or fds), logged once. `workers`: the page-cache
    /// workers started on the first punted op.
    pub fn new(
        sq_entries: u32,
        fixed_files: bool,
        workers: WorkerConfig,
        failure: Arc<Failure>,
    ) -> Result<Ring> {
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
        let buffer_slots = match uring
            .submitter()
            .register_buffers_sparse(BUFFER_TABLE_SLOTS)
        {
            Ok(()) => Some(SlotPool::new(BUFFER_TABLE_SLOTS)),
            Err(e) => {
                tracing::info!(
                    "io_uring fixed buffers unavailable ({}); DRAM uses plain READ/WRITE",
                    describe_os_error(&e)
                );
                None
            }
        };
        let file_slots = if fixed_files {
            let nofile = nofile_limit().min(FILE_TABLE_SLOTS as u64) as u32;
            match uring.submitter().register_files_sparse(nofile) {
                Ok(()) => Some(SlotPool::new(nofile)),
                Err(e) => {
                    tracing::info!(
                        "io_uring fixed files unavailable ({}); I/O passes raw fds",
                        describe_os_error(&e)
                    );
                    None
                }
            }
        } else {
            None
        };
        tracing::debug!(sq, cq, "io_uring ring ready");
        Ok(Ring {
            core: Mutex::new(RingCore {
                uring,
                failure: Arc::clone(&failure),
                max_inflight: (cq / 2).max(1) as usize,
                in_kernel: 0,
                on_workers: 0,
                workers: None,
                worker_config: workers,
                batch: Vec::new(),
                batch_bytes: 0,
                backlog: Vec::new(),
                buffer_slots,
                file_slots,
                files: HashMap::new(),
            }),
            retired: Mutex::new(Vec::new()),
            sq_entries: sq,
            failure,
        })
    }

    /// Locks the core. Whatever was retired meanwhile is unregistered now and again when the
    /// guard is dropped.
    pub fn lock(&self) -> Result<CoreGuard<'_>> {
        let core = self.failure.lock(&self.core, "io_uring ring")?;
        Ok(self.guard(core))
    }

    /// As [`Ring::lock`] where no error can be returned: releasing a slot happens in `Drop`s,
    /// and a slot left registered would keep memory pinned or a file open.
    fn lock_for_teardown(&self) -> CoreGuard<'_> {
        self.guard(self.failure.lock_or_recover(&self.core, "io_uring ring"))
    }

    /// Poisons the core lock (tests of the failed state, `ring_tests.rs`).
    #[cfg(test)]
    pub(super) fn poison_core(&self) {
        crate::error::poison(&self.core);
    }

    fn guard<'a>(&'a self, core: MutexGuard<'a, RingCore>) -> CoreGuard<'a> {
        HOLDER.with(|h| h.set(self as *const Ring as usize));
        let mut guard = CoreGuard { core, ring: self };
        guard.flush_retired();
        guard
    }

    /// Queues a slot for unregistration and, unless this thread is inside the ring's lock
    /// already (then the guard does it when released), unregisters it right away: a
    /// deregistered buffer must not stay pinned, nor a file open, until some later call.
    fn retire(&self, r: Retired) {
        self.failure
            .lock_or_recover(&self.retired, "ring retired slots")
            .push(r);
        if HOLDER.with(|h| h.get()) != self as *const Ring as usize {
            drop(self.lock_for_teardown());
        }
    }

    /// Registers `len` bytes at `addr` (at most 1 GiB) as a fixed buffer.
    ///
    /// # Safety
    /// The memory must stay mapped until [`Ring::release_buffer`] for the returned slot; the
    /// kernel pins it and may read or write it for any op that names the slot.
    pub unsafe fn register_buffer(&self, addr: u64, len: u64) -> io::Result<u16> {
        debug_assert!(len <= MAX_FIXED_BUFFER);
        let mut core = self.lock().map_err(io::Error::other)?;
        let core = &mut *core;
        let pool = core
            .buffer_slots
            .as_mut()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool
            .take()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        };
        // SAFETY: the caller keeps the memory mapped until the slot is released.
        match unsafe {
            core.uring
                .submitter()
                .register_buffers_update(slot, &[iov], None)
        } {
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
    /// `io_fd` is the registration's own fd for the file (the table takes its own reference).
    pub fn acquire_file(&self, key: FileKey, io_fd: i32) -> Option<u32> {
        // A poisoned lock has failed the engine; the raw fd serves until the next call fails.
        let mut core = self.lock().ok()?;
        let core = &mut *core;
        if let Some(f) = core.files.get_mut(&key) {
            f.refs += 1;
            return Some(f.slot);
        }
        let pool = core.file_slots.as_mut()?;
        let slot = pool.take()?;
        match core.uring.submitter().register_files_update(slot, &[io_fd]) {
            Ok(_) => {
                core.files.insert(key, FileSlot { slot, refs: 1 });
                Some(slot)
            }
            Err(e) => {
                pool.put(slot);
                tracing::debug!(
                    fd = key.fd,
                    "fixed-file registration failed ({}); using the raw fd",
                    describe_os_error(&e)
                );
                None
            }
        }
    }

    /// Drops one reference to the file slot of `key` (deferred like buffers).
    pub fn release_file(&self, key: FileKey) {
        self.retire(Retired::File(key));
    }

    /// Registers a DMA-BUF in a free fixed-buffer slot, bound to `target_fd`.
    pub fn register_dmabuf(&self, dmabuf_fd: i32, target_fd: i32) -> io::Result<u16> {
        use std::os::fd::AsRawFd;
        let mut core = self.lock().map_err(io::Error::other)?;
        let core = &mut *core;
        // v3 accepts DMA-BUFs on IOPOLL rings, later versions are reported to refuse them
        // (docs/kernel-dmabuf-series.md): never rely on it. This ring is never IOPOLL; the check
        // keeps it that way if the setup flags ever change.
        if core.uring.params().is_setup_iopoll() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        let pool = core
            .buffer_slots
            .as_mut()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENXIO))?;
        let slot = pool
            .take()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        match dmabuf_uapi::register_dmabuf(core.uring.as_raw_fd(), slot, dmabuf_fd, target_fd) {
            Ok(()) => Ok(slot as u16),
            Err(e) => {
                pool.put(slot);
                Err(e)
            }
        }
    }
}

thread_local! {
    /// The ring whose core lock this thread holds (its address), or 0.
    static HOLDER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The locked core. Dropping it unregisters retired slots before the lock is released.
pub struct CoreGuard<'a> {
    core: MutexGuard<'a, RingCore>,
    ring: &'a Ring,
}

impl CoreGuard<'_> {
    fn flush_retired(&mut self) {
        // The retired list is a leaf lock, also taken from Drops: recovered when poisoned.
        let retired = std::mem::take(
            &mut *self
                .ring
                .failure
                .lock_or_recover(&self.ring.retired, "ring retired slots"),
        );
        for r in retired {
            self.core.unregister(r);
        }
    }
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = RingCore;
    fn deref(&self) -> &RingCore {
        &self.core
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut RingCore {
        &mut self.core
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.flush_retired();
        HOLDER.with(|h| h.set(0));
    }
}

impl Drop for RingCore {
    fn drop(&mut self) {
        if self.in_flight() > 0 {
            tracing::error!(
                ops = self.in_flight(),
                "io_uring ring closed with I/O still in flight after cancellation"
            );
        }
    }
}

impl RingCore {
    /// Whether another op may be handed over without risking CQ overflow.
    pub fn has_room(&self) -> bool {
        self.in_flight() < self.max_inflight
    }

    /// Ops handed over whose result has not been reaped (kernel and workers).
    pub fn in_flight(&self) -> usize {
        self.in_kernel + self.on_workers
    }

    /// Whether some op is on the page-cache workers (their results arrive outside the CQ).
    pub fn on_workers(&self) -> bool {
        self.on_workers > 0
    }

    /// The workers' queue, for a caller that runs queued reads itself while ops are on it.
    pub fn page_cache_helper(&self) -> Option<QueueHelper> {
        self.workers
            .as_ref()
            .filter(|_| self.on_workers > 0)
            .map(PageCacheWorkers::helper)
    }

    /// Queues one op: a punted op goes to the page-cache workers (started on first use), any
    /// other into the SQ, submitting first when the SQ is full. False when there is still no
    /// room (the caller keeps the op for later).
    pub fn push(&mut self, s: &Submission) -> bool {
        if s.op.punt && self.push_to_workers(s) {
            return true;
        }
        let sqe = s.op.to_sqe(s.write, s.token);
        let mut sq = self.uring.submission();
        if sq.is_full() {
            drop(sq);
            if self.uring.submit().is_err() {
                return false;
            }
            sq = self.uring.submission();
            if sq.is_full() {
                return false;
            }
        }
        // SAFETY: the SQE names memory that the caller keeps valid until the op's result is
        // reaped: a registration its request keeps alive, a staging buffer it owns, or user
        // memory that NIXL's contract keeps valid until the request is released, which waits
        // for every op.
        unsafe { sq.push(&sqe) }.expect("SQ has room: checked above");
        self.in_kernel += 1;
        true
    }

    fn push_to_workers(&mut self, s: &Submission) -> bool {
        if self.workers.is_none() {
            match PageCacheWorkers::new(self.worker_config, Arc::clone(&self.failure)) {
                Ok(w) => {
                    tracing::debug!(threads = w.threads(), "page-cache workers started");
                    self.workers = Some(w);
                }
                Err(e) => tracing::info!(
                    "page-cache workers unavailable ({e}); punted I/O goes to io_uring's workers"
                ),
            }
        }
        let Some(w) = &self.workers else { return false };
        let op = s.op;
        let job = Job {
            token: s.token,
            fd: op.io_fd,
            offset: op.file_offset,
            addr: op.addr,
            len: op.len,
            write: s.write,
        };
        self.on_workers += 1;
        if u64::from(op.len) >= WORKER_JOB_BYTES {
            w.submit(job);
            return true;
        }
        if !joins_batch(&self.batch, &job) {
            self.flush_batch();
        }
        self.batch.push(job);
        self.batch_bytes += u64::from(op.len);
        if self.batch_bytes >= WORKER_JOB_BYTES {
            self.flush_batch();
        }
        true
    }

    /// Hands the gathered small page-cache ops to one worker.
    fn flush_batch(&mut self) {
        if let (Some(w), false) = (&self.workers, self.batch.is_empty()) {
            w.submit_batch(std::mem::take(&mut self.batch));
        }
        self.batch_bytes = 0;
    }

    /// Hands queued SQEs to the kernel (and flushes overflowed CQEs when the kernel says so).
    pub fn submit(&mut self) -> Result<()> {
        self.flush_batch();
        // A poisoned page-cache workers' lock (found where no error could be returned) fails
        // the call that submits next.
        self.failure.check()?;
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
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                    return Ok(())
                }
                Err(e) => return Err(Error::os("io_uring_enter (submit)", &e)),
            }
        }
    }

    /// Appends every available (token, result) to `out`: CQEs and the workers' results. Returns
    /// how many completions there were (cancellation CQEs included).
    pub fn reap(&mut self, out: &mut Vec<(u64, i32)>) -> usize {
        let mut n = self.backlog.len();
        out.append(&mut self.backlog);
        for cqe in self.uring.completion() {
            n += 1;
            if cqe.user_data() != IGNORED_CQE {
                self.in_kernel -= 1;
                out.push((cqe.user_data(), cqe.result()));
            }
        }
        if self.on_workers > 0 {
            if let Some(w) = &self.workers {
                let before = out.len();
                w.take_done(out);
                self.on_workers -= out.len() - before;
                n += out.len() - before;
            }
        }
        n
    }

    /// Asks the kernel (and the workers) to cancel the ops of `tokens`; their results still come
    /// through `reap` (typically -ECANCELED).
    pub fn cancel(&mut self, tokens: &[u64]) {
        self.flush_batch();
        if let (Some(w), true) = (&self.workers, self.on_workers > 0) {
            w.cancel(tokens);
        }
        let mut scratch = Vec::new();
        for &ud in tokens {
            let sqe = opcode::AsyncCancel::new(ud).build().user_data(IGNORED_CQE);
            loop {
                // SAFETY: a cancel SQE references no memory.
                if unsafe { self.uring.submission().push(&sqe) }.is_ok() {
                    break;
                }
                if self.submit().is_err() {
                    break;
                }
                // Make CQ room; what is reaped here is handed out by the next reap.
                self.reap(&mut scratch);
            }
        }
        self.backlog.append(&mut scratch);
        let _ = self.submit();
    }

    /// Waits (bounded) for a completion. `poll_soon`: results also arrive outside the ring
    /// (device copies), so the wait is kept short.
    pub fn wait(&mut self, timeout: Duration, poll_soon: bool) -> Result<()> {
        self.flush_batch();
        if !self.backlog.is_empty() {
            return Ok(());
        }
        if self.in_kernel == 0 && self.on_workers > 0 && !poll_soon {
            // Only page-cache workers are busy: wait for one of them.
            if let Some(w) = &self.workers {
                w.wait_done(timeout);
            }
            return Ok(());
        }
        let timeout = if poll_soon || self.on_workers > 0 {
            Duration::from_millis(1)
        } else {
            timeout
        };
        let ts = types::Timespec::new()
            .sec(timeout.as_secs())
            .nsec(timeout.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.uring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(Error::os("io_uring_enter (wait)", &e)),
        }
    }

    /// Runs one op to its end under the lock and returns its result (bytes or -errno); other
    /// completions that arrive meanwhile are kept for the next `reap`. For short, one-off I/O
    /// such as the DMA-BUF self-test.
    pub fn run_one(&mut self, op: IoOp, write: bool) -> Result<i32> {
        let op = IoOp { punt: false, ..op };
        while !self.push(&Submission {
            op,
            write,
            token: RUN_ONE_CQE,
        }) {
            self.submit()?;
        }
        loop {
            self.submit()?;
            let mut got = None;
            for cqe in self.uring.completion() {
                match cqe.user_data() {
                    IGNORED_CQE => {}
                    RUN_ONE_CQE => {
                        self.in_kernel -= 1;
                        got = Some(cqe.result());
                    }
                    ud => {
                        self.in_kernel -= 1;
                        self.backlog.push((ud, cqe.result()));
                    }
                }
            }
            if let Some(res) = got {
                return Ok(res);
            }
            match self.uring.submitter().submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                    ) => {}
                Err(e) => return Err(Error::os("io_uring_enter (wait)", &e)),
            }
        }
    }

    fn unregister(&mut self, r: Retired) {
        match r {
            Retired::Buffer(slot) => {
                let empty = libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                };
                // SAFETY: an empty iovec clears the slot; no memory is handed to the kernel.
                let res = unsafe {
                    self.uring
                        .submitter()
                        .register_buffers_update(slot as u32, &[empty], None)
                };
                match res {
                    Ok(()) => {
                        if let Some(pool) = self.buffer_slots.as_mut() {
                            pool.put(slot as u32)
                        }
                    }
                    Err(e) => tracing::error!(
                        slot,
                        "unregistering fixed buffer slot failed ({}); slot leaked",
                        describe_os_error(&e)
                    ),
                }
            }
            Retired::File(key) => {
                let Some(f) = self.files.get_mut(&key) else {
                    return;
                };
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
                    Err(e) => tracing::error!(
                        slot,
                        "unregistering fixed file slot failed ({}); slot leaked",
                        describe_os_error(&e)
                    ),
                }
            }
        }
    }
}

fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}
