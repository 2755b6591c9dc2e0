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

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

use super::op::IoOp;
use super::slots::SlotPool;
use super::workers::{joins_batch, Job, PageCacheWorkers, QueueHelper, WorkerConfig};
use crate::error::{Error, Failure, Result};

mod tables;

/// Largest fixed buffer the kernel accepts in one slot.
pub const MAX_FIXED_BUFFER: u64 = 1 << 30;

/// Identity of an open file, so a fd number that was closed and reused maps to a new slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub fd: i32,
    pub dev: u64,
    pub ino: u64,
}

pub(super) enum Retired {
    Buffer(u16),
    File(FileKey),
}

pub(super) struct FileSlot {
    slot: u32,
    refs: u32,
}

/// user_data of SQEs whose completions carry no information (cancellations).
const IGNORED_CQE: u64 = u64::MAX;
/// user_data of the op of `run_one`.
const RUN_ONE_CQE: u64 = u64::MAX - 1;
/// One storage I/O handed to the ring: the op, its direction, and the caller's token that comes
/// back with its result.
#[derive(Debug, Clone, Copy)]
pub struct Submission {
    pub op: IoOp,
    pub write: bool,
    pub token: u64,
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
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(sq_entries * 2)
                    .build(sq_entries)
            })
            .map_err(|e| {
                Error::os(
                    format!(
                        "io_uring_setup({sq_entries} entries) failed; is io_uring disabled \
                         (sysctl kernel.io_uring_disabled, seccomp)?"
                    ),
                    &e,
                )
            })?;
        let sq = uring.params().sq_entries();
        let cq = uring.params().cq_entries();
        let (buffer_slots, file_slots) = Ring::sparse_tables(&uring, fixed_files);
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
    pub(crate) fn poison_core(&self) {
        crate::error::poison(&self.core);
    }

    fn guard<'a>(&'a self, core: MutexGuard<'a, RingCore>) -> CoreGuard<'a> {
        HOLDER.with(|h| h.set(self as *const Ring as usize));
        let mut guard = CoreGuard { core, ring: self };
        guard.flush_retired();
        guard
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
}
