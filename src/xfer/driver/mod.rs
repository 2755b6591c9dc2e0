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
mod inline;
mod staged;

use super::callers::CallerClock;
use super::profile::Profiles;
use super::request::{Next, Outcome, RequestOps, RequestProgress};
use crate::error::{Error, Failure, Result};
use crate::params::CallerReads;
use crate::path::staging::{CopyDone, Stage, Staging};
use crate::uring::{IoOp, Progress, Ring, RingCore, Submission};

/// How long release and teardown wait for in-flight I/O before giving up on it.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);

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

/// What became of a staged op that `fill` offered.
enum Staged {
    /// It went (into a buffer, or failed its request): take the next op.
    Went,
    /// The write window is full: let the next request go.
    Throttled,
    /// Every buffer is busy: wait for completions to free one.
    NoBuffer,
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
                    "releaseReqH: in-flight I/O did not finish within {}s after cancellation; the \
                     request is kept",
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
        while (!t.owners.is_empty() || t.staging.as_ref().is_some_and(Staging::copying))
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
                    Table::io_over(
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
            match self.fill_staged(key, op) {
                Staged::Went => {}
                Staged::NoBuffer => break,
                Staged::Throttled => {
                    self.queue.rotate_left(1);
                    throttled += 1;
                    if throttled >= self.queue.len() {
                        break;
                    }
                }
            }
        }
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
        if !self
            .requests
            .get(entry.req)
            .is_some_and(RequestProgress::is_running)
        {
            tracing::error!("io_uring completion for a request that is not running; ignored");
            return;
        }
        if let Some(since) = entry.since {
            self.profiles.io_done(entry.req, since);
        }
        if self.run_cut_short(&entry, res) {
            return;
        }
        let Some(req) = self.requests.get_mut(entry.req) else {
            return;
        };
        match req.on_result(&entry.op, res) {
            Outcome::Complete => Table::io_over(
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
            Outcome::Over => Table::io_over(
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
