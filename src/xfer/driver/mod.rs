//! Drives prepared requests through the ring: the queue of requests with ops still to hand out,
//! the ops in flight by token, retries, the staging pipeline, and the inline I/O of the threads
//! that post and poll.
//!
//! Invariants:
//! - The driver's lock is taken before the ring's core lock, never after, so NIXL may call
//!   post/check/release from any number of threads (sync modes NONE/RW).
//! - An op handed to the ring is owned by `owners` (its token is the slab key) until its result
//!   is reaped; a request is removed only when none of its ops is in flight.
//! - Ops are described once (at prepXfer) and handed to the ring only when it has room
//!   ("describe, then fill"), so a request of any size never needs more SQ entries than exist.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use slab::Slab;

pub mod background;

use super::callers::CallerClock;
use super::profile::Profiles;
use super::request::{Next, Outcome, RequestOps, RequestProgress};
use crate::error::{describe_os_error, Error, Failure, Result};
use crate::gpu::GpuProvider;
use crate::params::CallerReads;
use crate::path::direct;
use crate::path::staging::{CopyDone, Stage, Staging, StagingPool, StagingShape};
use crate::uring::{IoOp, Progress, Ring, RingCore, Submission};

/// How long release and teardown wait for in-flight I/O before giving up on it.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);

/// A read request this small is first tried from the page cache by the posting thread: one
/// preadv2 per op beats a ring round trip (SQE, io_uring_enter, CQE, and NIXL's second call to
/// see the completion). Larger requests gain more from one batched io_uring_enter.
const INLINE_READ_MAX_OPS: usize = 4;
const INLINE_READ_MAX_BYTES: u64 = 64 << 10;

/// Key of a request in the driver's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestKey(usize);

/// A storage I/O the driver owns until its result (or a retry of one).
struct InFlight {
    req: usize,
    /// The storage I/O as submitted (on a staging buffer when `stage` is set).
    op: IoOp,
    stage: Option<Stage>,
    /// When it went to the ring (only while profiling).
    since: Option<Instant>,
}

/// What the driver's lock guards.
#[derive(Default)]
struct Table {
    requests: Slab<RequestProgress>,
    /// Requests that still have ops not yet handed out, oldest first.
    queue: VecDeque<usize>,
    /// Remainders of short I/O, ops the kernel asked to retry, staged writes whose copy ended;
    /// they go first.
    retry: VecDeque<InFlight>,
    /// Ops in the ring, by token.
    owners: Slab<InFlight>,
    staging: Option<Staging>,
    /// Scratch lists, reused.
    completed: Vec<(u64, i32)>,
    copies_done: Vec<CopyDone>,
    /// Per-request timing breakdown (IO_URING_DMABUF_PROFILE=1).
    profiles: Profiles,
}

/// The request driver of one engine.
pub struct Driver {
    ring: Arc<Ring>,
    table: Mutex<Table>,
    /// The engine's failed state, set when the table's lock is found poisoned.
    failure: Arc<Failure>,
    /// Whether posting and polling threads run reads queued for the page-cache workers.
    caller_reads: CallerReads,
    /// Threads in post/check, and when the last one left (the progress thread keeps out of
    /// their way).
    callers: CallerClock,
}

impl Driver {
    pub fn new(ring: Arc<Ring>, failure: Arc<Failure>) -> Driver {
        let table = Table {
            profiles: Profiles::from_env(),
            ..Table::default()
        };
        Driver {
            ring,
            table: Mutex::new(table),
            failure,
            caller_reads: CallerReads::Auto,
            callers: CallerClock::default(),
        }
    }

    /// Sets whether posting and polling threads run queued page-cache reads themselves.
    pub fn with_caller_reads(mut self, how: CallerReads) -> Driver {
        self.caller_reads = how;
        self
    }

    fn lock(&self) -> Result<MutexGuard<'_, Table>> {
        self.failure.lock(&self.table, "request table")
    }

    /// Creates the staging pool on first use (later calls do nothing).
    pub fn enable_staging(
        &self,
        provider: Arc<dyn GpuProvider>,
        shape: StagingShape,
    ) -> Result<()> {
        let mut t = self.lock()?;
        if t.staging.is_some() {
            return Ok(());
        }
        let pool = StagingPool::new(provider, shape.buffer_size, shape.buffers, |addr, len| {
            // SAFETY: the staging mapping lives as long as the pool, which the driver drops only
            // after every op using it has completed (or leaks, see Drop).
            match unsafe { self.ring.register_buffer(addr, len) } {
                Ok(slot) => Some(slot),
                Err(e) => {
                    tracing::info!(
                        "staging buffer not registered as a fixed buffer ({}); using plain I/O",
                        describe_os_error(&e)
                    );
                    None
                }
            }
        })?;
        t.staging = Some(Staging::new(pool, shape));
        Ok(())
    }

    /// Whether the staging pool exists.
    pub fn staging_ready(&self) -> Result<bool> {
        Ok(self.lock()?.staging.is_some())
    }

    /// Adds a prepared request; it starts idle.
    pub fn add_request(&self, ops: Arc<RequestOps>) -> Result<RequestKey> {
        Ok(RequestKey(
            self.lock()?.requests.insert(RequestProgress::new(ops)),
        ))
    }

    /// Starts (or restarts) a request. Returns Done when everything completed during the call.
    /// `inline_budget`: bytes of buffered writes this thread may write itself (0 = none).
    pub fn post(&self, key: RequestKey, inline_budget: u64) -> Result<Progress> {
        let _caller = self.callers.enter();
        let mut t = self.lock()?;
        let req = t
            .requests
            .get_mut(key.0)
            .ok_or_else(|| Error::backend("postXfer: unknown request handle"))?;
        if let Some(done) = req.start()? {
            return Ok(done);
        }
        t.profiles.start(key.0);
        let mut t = self.read_inline_if_cached(t, key.0, inline_budget == u64::MAX)?;
        if let Ok(Progress::Done) = t.status(key.0) {
            return Ok(Progress::Done);
        }
        t.queue.push_back(key.0);
        let mut t = self.help_with_writes(t, key.0, inline_budget)?;
        t.progress(&self.ring)?;
        let mut t = self.help_page_cache_workers(t)?;
        t.finished_status(key.0)
    }

    /// Reaps completions (for every request) without blocking and reports this request's state.
    pub fn check(&self, key: RequestKey, inline_budget: u64) -> Result<Progress> {
        let _caller = self.callers.enter();
        let mut t = self.lock()?;
        t.progress(&self.ring)?;
        let mut t = self.help_with_writes(t, key.0, inline_budget)?;
        t.progress(&self.ring)?;
        let mut t = self.help_page_cache_workers(t)?;
        t.finished_status(key.0)
    }

    /// Runs reads queued for the page-cache workers in this thread, without holding the lock
    /// while copying, refilling the queue from waiting requests between rounds, until none is
    /// left to take (the rest runs on the workers or waits for the disk). A thread that posts or
    /// polls would otherwise wait for the workers: on a busy machine they may get no core soon.
    /// `page_cache_caller_reads` decides when (`CallerReads`).
    fn help_page_cache_workers<'a>(
        &'a self,
        mut t: MutexGuard<'a, Table>,
    ) -> Result<MutexGuard<'a, Table>> {
        loop {
            // The staging buffers' device copies wait for this thread (a staged READ's copy
            // starts when its buffer's reads have landed): under auto it drives them instead.
            if !self
                .caller_reads
                .helps(t.staging.as_ref().is_some_and(Staging::in_use))
            {
                return Ok(t);
            }
            let Some(helper) = self.ring.lock()?.page_cache_helper() else {
                return Ok(t);
            };
            drop(t);
            let ran = helper.run_queued_reads();
            t = self.lock()?;
            t.progress(&self.ring)?;
            if ran == 0 {
                // Only the workers' own jobs are left: give them this core (a spinning poller
                // would otherwise keep a worker that holds the last job off the CPU).
                drop(t);
                std::thread::yield_now();
                t = self.lock()?;
                t.progress(&self.ring)?;
                return Ok(t);
            }
        }
    }

    /// Writes up to `budget` bytes of the request's not-yet-started buffered writes with
    /// pwrite(2) in this thread, without holding the lock while writing. Page-cache writes are
    /// memory copies: done here they avoid a hand-off to io_uring's worker per I/O (which is what
    /// makes libaio fast on buffered files), while the ring keeps a few in flight meanwhile.
    fn help_with_writes<'a>(
        &'a self,
        mut t: MutexGuard<'a, Table>,
        key: usize,
        budget: u64,
    ) -> Result<MutexGuard<'a, Table>> {
        let Some(req) = t.requests.get_mut(key) else {
            return Ok(t);
        };
        let Some((start, end)) = req.take_inline_writes(budget) else {
            return Ok(t);
        };
        let ops = Arc::clone(&req.ops);
        drop(t);
        let result = direct::write_all(&ops.ops[start..end]);
        let mut t = self.lock()?;
        // The request still exists: release waits until no op is outstanding.
        if let Some(req) = t.requests.get_mut(key) {
            req.inline_writes_done(end - start, result);
        }
        Ok(t)
    }

    /// Serves a small buffered read request from the page cache in this thread, without holding
    /// the lock while copying; what it could not serve stays for the ring. With `any_size` (few
    /// CPUs: `inline_write_max=auto` below 8) requests of any size are tried, as buffered writes
    /// are: copying in the calling thread beats a ring round trip when cores are few and busy.
    fn read_inline_if_cached<'a>(
        &'a self,
        mut t: MutexGuard<'a, Table>,
        key: usize,
        any_size: bool,
    ) -> Result<MutexGuard<'a, Table>> {
        let Some(req) = t.requests.get_mut(key) else {
            return Ok(t);
        };
        let ops = Arc::clone(&req.ops);
        let small = ops.ops.len() <= INLINE_READ_MAX_OPS
            && ops.ops.iter().map(|o| o.len as u64).sum::<u64>() <= INLINE_READ_MAX_BYTES;
        if !ops.inline_reads || !(small || any_size) {
            return Ok(t);
        }
        let Some(n) = req.take_inline_read() else {
            return Ok(t);
        };
        drop(t);
        let done = direct::read_cached_prefix(&ops.ops);
        let mut t = self.lock()?;
        // The request still exists: release waits until no op is outstanding.
        if let Some(req) = t.requests.get_mut(key) {
            req.inline_read_done(n, done);
        }
        Ok(t)
    }

    /// Removes a request. One still in flight is aborted: its queued ops are dropped, its
    /// in-flight ops cancelled, and the call waits until the kernel has let go of all of them.
    pub fn remove_request(&self, key: RequestKey) -> Result<()> {
        let deadline = Instant::now() + TEARDOWN_WAIT;
        let mut aborted = false;
        loop {
            // Re-locked every round so that threads writing this request's ops inline can
            // report back.
            let mut t = self.lock()?;
            let running = t
                .requests
                .get(key.0)
                .is_some_and(RequestProgress::is_running);
            if !running {
                if t.requests.contains(key.0) {
                    t.requests.remove(key.0);
                }
                return Ok(());
            }
            if !aborted {
                t.abort(&self.ring, key.0)?;
                aborted = true;
                continue;
            }
            if Instant::now() > deadline {
                return Err(Error::backend(format!(
                    "releaseReqH: in-flight I/O did not finish within {}s after cancellation; the request is kept",
                    TEARDOWN_WAIT.as_secs()
                )));
            }
            t.wait_one(&self.ring, Duration::from_millis(10))?;
        }
    }
}

impl Drop for Driver {
    /// Never unmap staging buffers while the kernel, a page-cache worker or a device copy may
    /// still write into them: cancel and wait (bounded) for every op first; device copies are
    /// always waited for; what is still in flight after the wait keeps its staging memory,
    /// leaked on purpose.
    fn drop(&mut self) {
        let ring = Arc::clone(&self.ring);
        let t = self.table.get_mut().unwrap_or_else(|p| p.into_inner());
        let copying = t.staging.as_ref().is_some_and(Staging::copying);
        if t.owners.is_empty() && !copying {
            return;
        }
        let keys: Vec<usize> = t.requests.iter().map(|(k, _)| k).collect();
        // A poisoned ring lock fails abort and wait_one: nothing can be cancelled or waited
        // for, so what is in flight keeps its staging memory (below) rather than risk a write
        // into freed memory.
        for k in keys {
            if t.abort(&ring, k).is_err() {
                break;
            }
        }
        let deadline = Instant::now() + TEARDOWN_WAIT;
        while !(t.owners.is_empty() && !t.staging.as_ref().is_some_and(Staging::copying))
            && Instant::now() < deadline
        {
            if t.wait_one(&ring, Duration::from_millis(100)).is_err() {
                break;
            }
        }
        if let Some(s) = t.staging.as_mut() {
            s.wait_all();
        }
        if !t.owners.is_empty() {
            tracing::error!(
                ops = t.owners.len(),
                "engine destroyed with I/O still in flight after cancellation"
            );
            if let Some(s) = t.staging.take() {
                tracing::error!(
                    "staging buffers left mapped on purpose: in-flight I/O may still write them"
                );
                std::mem::forget(s);
            }
        }
    }
}

impl Table {
    /// This request's state as a post/check result.
    fn status(&self, key: usize) -> Result<Progress> {
        self.requests
            .get(key)
            .ok_or_else(|| Error::backend("unknown request handle"))?
            .status()
    }

    /// `status`, logging the request's profile once it is over.
    fn finished_status(&mut self, key: usize) -> Result<Progress> {
        let status = self.status(key);
        if !matches!(status, Ok(Progress::InFlight)) {
            self.profiles.finish(key, status.is_ok());
        }
        status
    }

    /// Polls device copies, fills the ring, submits, reaps; repeats while that made progress.
    /// Returns how many completions (storage I/O and device copies) it handled.
    fn progress(&mut self, ring: &Ring) -> Result<usize> {
        let mut core = ring.lock()?;
        let mut handled = 0;
        loop {
            let copied = self.poll_copies();
            self.fill(&mut core);
            core.submit()?;
            let reaped = self.reap(&mut core);
            if reaped == 0 && copied == 0 {
                return Ok(handled);
            }
            handled += reaped + copied;
        }
    }

    /// Hands one op to the ring; false (the op is handed back) when there is no room.
    fn push(
        core: &mut RingCore,
        owners: &mut Slab<InFlight>,
        mut entry: InFlight,
        write: bool,
        profiling: bool,
    ) -> std::result::Result<(), InFlight> {
        let token = owners.vacant_key() as u64;
        if core.push(&Submission {
            op: entry.op,
            write,
            token,
        }) {
            if profiling {
                entry.since = Some(Instant::now());
            }
            owners.insert(entry);
            Ok(())
        } else {
            Err(entry)
        }
    }

    /// Moves waiting ops into the ring (or, for staged WRITEs, onto a device stream) as far as
    /// the ring's room and the staging pool allow.
    fn fill(&mut self, core: &mut RingCore) {
        let mut throttled = 0;
        while core.has_room() {
            // Retries first: remainders of short I/O, EAGAIN, and staged writes whose copy ended.
            if let Some(entry) = self.retry.pop_front() {
                let Some(req) = self.requests.get_mut(entry.req) else {
                    continue;
                };
                if !req.is_healthy() {
                    io_over(
                        req,
                        entry.stage,
                        false,
                        &mut self.staging,
                        &mut self.profiles,
                    );
                    continue;
                }
                if let Err(entry) = Table::push(
                    core,
                    &mut self.owners,
                    entry,
                    req.ops.write,
                    self.profiles.on(),
                ) {
                    self.retry.push_front(entry);
                    break;
                }
                continue;
            }
            let Some(&key) = self.queue.front() else {
                break;
            };
            let Some(req) = self.requests.get_mut(key) else {
                self.queue.pop_front();
                continue;
            };
            let op = match req.peek_next() {
                Next::Nothing => {
                    self.queue.pop_front();
                    continue;
                }
                Next::Throttled => {
                    // Enough of this request's writes are in the ring: let the next request go.
                    self.queue.rotate_left(1);
                    throttled += 1;
                    if throttled >= self.queue.len() {
                        break;
                    }
                    continue;
                }
                Next::Op(op) => op,
            };
            let write = req.ops.write;
            if op.device.is_none() {
                if req.advance() {
                    self.queue.pop_front();
                }
                let entry = InFlight {
                    req: key,
                    op,
                    stage: None,
                    since: None,
                };
                if let Err(entry) =
                    Table::push(core, &mut self.owners, entry, write, self.profiles.on())
                {
                    self.retry.push_front(entry);
                    break;
                }
                continue;
            }
            let Some(staging) = self.staging.as_mut() else {
                req.fail(Error::backend(
                    "internal error: a VRAM op reached the ring before its staging pool existed",
                ));
                req.settle();
                continue;
            };
            // Page-cache WRITEs fill at most the write window: let the next request go.
            let windowed = write && req.ops.page_cache;
            if windowed && !staging.window_admits(op.len) {
                self.queue.rotate_left(1);
                throttled += 1;
                if throttled >= self.queue.len() {
                    break;
                }
                continue;
            }
            // All buffers busy: wait for completions to free one.
            let Some(group) = staging.open(key, write, op, windowed) else {
                break;
            };
            // Pack the request's next small pieces into the same buffer.
            let mut last = req.advance();
            while !last {
                match req.peek_next() {
                    Next::Op(next) if next.device.is_some() && staging.try_add(group, next) => {
                        last = req.advance()
                    }
                    _ => break,
                }
            }
            if last {
                self.queue.pop_front();
            }
            let pieces = staging.pieces(group);
            self.profiles.group(key, pieces);
            if write {
                // GPU -> staging buffer first; the storage writes follow in poll_copies.
                let t0 = self.profiles.now();
                let started = staging.start_copy(group);
                self.profiles.copy_submitted(key, t0);
                if let Err(e) = started {
                    req.fail(e);
                    (0..pieces).for_each(|_| req.op_over());
                    staging.close(group);
                }
                continue;
            }
            // READ: each run's storage read lands at its place in the buffer; they go through
            // the retry queue, which hands them to the ring as it has room.
            for stage in staging.runs(group) {
                self.retry.push_back(InFlight {
                    req: key,
                    op: staging.host_op(stage),
                    stage: Some(stage),
                    since: None,
                });
            }
        }
    }

    /// Finishes device copies that completed; returns how many did.
    fn poll_copies(&mut self) -> usize {
        let Some(staging) = self.staging.as_mut() else {
            return 0;
        };
        if !staging.copying() {
            return 0;
        }
        let mut done = std::mem::take(&mut self.copies_done);
        let n = staging.poll(&mut done);
        for c in done.drain(..) {
            self.profiles.copy_waited(c.owner, c.started);
            let Some(staging) = self.staging.as_mut() else {
                break;
            };
            let Some(req) = self.requests.get_mut(c.owner) else {
                staging.close(c.group);
                continue;
            };
            match c.result {
                Ok(()) if c.then_write && req.is_healthy() => {
                    for stage in staging.runs(c.group) {
                        self.retry.push_back(InFlight {
                            req: c.owner,
                            op: staging.host_op(stage),
                            stage: Some(stage),
                            since: None,
                        });
                    }
                }
                // The H2D copy of a READ ended, a copy failed, or the request is failing: the
                // group's pieces are over.
                result => {
                    if let Err(e) = result {
                        req.fail(e);
                    }
                    (0..c.pieces).for_each(|_| req.op_over());
                    staging.close(c.group);
                }
            }
        }
        self.copies_done = done;
        n
    }

    /// Processes every available completion; returns how many there were.
    fn reap(&mut self, core: &mut RingCore) -> usize {
        let mut done = std::mem::take(&mut self.completed);
        done.clear();
        let n = core.reap(&mut done);
        for &(token, res) in &done {
            self.complete(token, res);
        }
        self.completed = done;
        n
    }

    /// One storage I/O ended with `res` (bytes moved or -errno).
    fn complete(&mut self, token: u64, res: i32) {
        let Some(entry) = self.owners.try_remove(token as usize) else {
            tracing::error!(
                user_data = token,
                "io_uring completion for an unknown op; ignored"
            );
            return;
        };
        let Some(req) = self.requests.get_mut(entry.req).filter(|r| r.is_running()) else {
            tracing::error!("io_uring completion for a request that is not running; ignored");
            return;
        };
        if let Some(since) = entry.since {
            self.profiles.io_done(entry.req, since);
        }
        let whole = res >= 0 && res as u32 == entry.op.len;
        if let (Some(run), Some(staging), false, true) =
            (entry.stage, self.staging.as_ref(), whole, req.is_healthy())
        {
            if run.count > 1 {
                // A run of several pieces that did not move whole: the pieces it did not finish
                // go again one by one, so a short transfer or an error names its own descriptor.
                let finished = staging.pieces_within(run, res.max(0) as u64);
                let again: Vec<InFlight> = run
                    .pieces()
                    .skip(finished as usize)
                    .map(|one| InFlight {
                        req: entry.req,
                        op: staging.host_op(one),
                        stage: Some(one),
                        since: None,
                    })
                    .collect();
                for one in run.pieces().take(finished as usize) {
                    io_over(req, Some(one), true, &mut self.staging, &mut self.profiles);
                }
                self.retry.extend(again);
                req.settle();
                return;
            }
        }
        match req.on_result(&entry.op, res) {
            Outcome::Complete => io_over(
                req,
                entry.stage,
                true,
                &mut self.staging,
                &mut self.profiles,
            ),
            Outcome::Retry(op) => self.retry.push_back(InFlight {
                req: entry.req,
                op,
                stage: entry.stage,
                since: None,
            }),
            Outcome::Over => io_over(
                req,
                entry.stage,
                false,
                &mut self.staging,
                &mut self.profiles,
            ),
        }
        req.settle();
    }

    /// Marks a request aborted and asks the ring to cancel its in-flight ops.
    fn abort(&mut self, ring: &Ring, key: usize) -> Result<()> {
        let Some(req) = self.requests.get_mut(key) else {
            return Ok(());
        };
        req.abort();
        let targets: Vec<u64> = self
            .owners
            .iter()
            .filter(|(_, f)| f.req == key)
            .map(|(k, _)| k as u64)
            .collect();
        ring.lock()?.cancel(&targets);
        Ok(())
    }

    /// Waits (bounded) for at least one completion, storage or device copy, and processes what
    /// arrived.
    fn wait_one(&mut self, ring: &Ring, timeout: Duration) -> Result<()> {
        let copying = self.staging.as_ref().is_some_and(Staging::copying);
        {
            let mut core = ring.lock()?;
            if core.in_flight() == 0 && copying {
                // Only device copies are pending: block on the oldest.
                if let Some(s) = &self.staging {
                    s.wait_oldest();
                }
            } else {
                core.wait(timeout, copying)?;
            }
        }
        self.progress(ring).map(|_| ())
    }
}

/// One storage I/O of the request ended (`ok`: every byte moved) or was dropped. A staged run
/// counts its pieces toward their group: a WRITE's buffer is freed after its last piece; a READ's group starts
/// its one device copy when every piece's read landed (its pieces are over when it ends).
fn io_over(
    req: &mut RequestProgress,
    stage: Option<Stage>,
    ok: bool,
    staging: &mut Option<Staging>,
    profiles: &mut Profiles,
) {
    let (Some(s), Some(st)) = (stage, staging.as_mut()) else {
        req.op_over();
        return;
    };
    let write = req.ops.write;
    if write || !ok {
        (0..s.count).for_each(|_| req.op_over());
    }
    let Some(end) = st.io_over(s, ok) else { return };
    if !write && end.ok > 0 && end.failed == 0 && req.is_healthy() {
        let owner = st.owner(end.group);
        let t0 = profiles.now();
        let started = st.start_copy(end.group);
        profiles.copy_submitted(owner, t0);
        match started {
            Ok(()) => return,
            Err(e) => req.fail(e),
        }
    }
    if !write {
        (0..end.ok).for_each(|_| req.op_over());
    }
    st.close(end.group);
}
