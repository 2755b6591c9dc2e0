//! Page-cache I/O on the engine's own threads (the ops the planner marks `punt`).
//!
//! A buffered read of cached pages is a memory copy. io_uring runs it either inline in the
//! submitting thread (one core) or, with IOSQE_ASYNC, on an io-wq worker. io-wq wakes the first
//! idle worker for each queued item, and a worker that was woken but has not yet started is still
//! "idle", so a burst of items submitted together (one request's pieces) lands on one or two
//! workers and runs serially. Measured on the H200 machine (bench/results): 32 x 1 MiB
//! page-cache reads into staging buffers reached 6.9 GB/s through io-wq, while NIXL's GDS_MT
//! threads reached 15.8 GB/s. These workers take each queued item on a free thread,
//! so one request's copies really run on several cores.
//!
//! Completions are collected by the core under its lock (`take_done`), exactly like CQEs.
//!
//! None of the queue's users can return an error (worker threads, and core calls that return
//! counts), so a poisoned queue lock fails the engine (`error::Failure`), is logged once, and its
//! value is used: results still reach the core, and the core's next `submit` answers the error.
//!
//! The thread that posts or polls a request helps (`QueueHelper::run_queued_reads`): it takes
//! queued read jobs off the same queue and runs them with RWF_NOWAIT, so the thread that would
//! otherwise spin in checkXfer copies too. On a quiet machine that adds a core; on a busy one,
//! where the workers may not get a core soon, the caller does the work itself instead of
//! waiting for them (what made hand-offs lose on a loaded 2-core machine).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::Failure;

/// The lock's name in the failed engine's error.
const QUEUE_LOCK: &str = "page-cache workers' queue";

/// One positioned read or write of host memory.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// Returned with the result (the core's in-flight key).
    pub token: u64,
    pub fd: i32,
    pub offset: u64,
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

#[derive(Default)]
struct Queues {
    /// Batches of jobs; one thread runs a batch's jobs one after another (small pieces packed
    /// together cost one hand-off, not one each).
    jobs: VecDeque<Vec<Job>>,
    /// (token, result): bytes moved, or -errno, as in a CQE.
    done: Vec<(u64, i32)>,
    /// Write batches running now, per fd and in all (see `WriterLimits`).
    writing: HashMap<i32, usize>,
    writing_all: usize,
    /// Tokens of the batch each worker runs now, by worker (empty while it waits): kept per
    /// worker, not in one set, so that taking and ending a batch hashes nothing under the lock
    /// all the workers share (16 KiB pieces end a batch every few microseconds on 14 workers).
    running: Vec<Vec<u64>>,
    /// Running jobs whose request is being released: they stop at their next system call.
    cancelled: HashSet<u64>,
    /// Workers waiting for a job, and how many of them were notified but have not taken the
    /// lock again: a job is handed over with a wake-up only when some worker sleeps unwoken.
    /// A system call per job otherwise (the condvar wakes unconditionally) cost the thread that
    /// posts and polls one futex call per 256 KiB of 16 KiB pieces, while every worker was busy.
    sleeping: usize,
    waking: usize,
    /// Threads in `wait_done`: results are announced only when one waits.
    done_waiters: usize,
}

struct Shared {
    queues: Mutex<Queues>,
    /// Set under the lock whenever results are added to `Queues::done`: the thread that polls
    /// takes the lock for results only when there may be some (it polls far more often than
    /// batches end, and every take would contend with the workers).
    has_done: AtomicBool,
    job_ready: Condvar,
    done_ready: Condvar,
    stop: AtomicBool,
    writers: WriterLimits,
    failure: Arc<Failure>,
    /// Bumped by every `cancel` that reached a running job, so that workers look at
    /// `Queues::cancelled` (under the lock) only after one did.
    cancel_epoch: AtomicU64,
    /// Bumped whenever jobs are queued (`Shared::queued`); spinning workers watch it.
    submitted: AtomicU64,
    /// How long a worker that found no job watches `submitted` before it sleeps.
    spin: std::time::Duration,
}

impl Shared {
    fn new(workers: usize, writers: WriterLimits, spin_us: u32, failure: Arc<Failure>) -> Shared {
        Shared {
            queues: Mutex::new(Queues::new(workers)),
            has_done: AtomicBool::new(false),
            job_ready: Condvar::new(),
            done_ready: Condvar::new(),
            stop: AtomicBool::new(false),
            writers,
            failure,
            cancel_epoch: AtomicU64::new(0),
            submitted: AtomicU64::new(0),
            spin: std::time::Duration::from_micros(u64::from(spin_us)),
        }
    }

    /// Jobs were just queued under `q`: tells spinning workers; true when a sleeping one is to be
    /// notified (`job_ready`, once the lock is dropped).
    fn queued(&self, q: &mut Queues) -> bool {
        self.submitted.fetch_add(1, Ordering::Release);
        q.wake_one()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.failure.lock_or_recover(&self.queues, QUEUE_LOCK)
    }

    /// Whether the running job `token` was cancelled; `seen` is the epoch this worker last
    /// looked at (updated).
    fn cancelled(&self, token: u64, seen: &mut u64) -> bool {
        let now = self.cancel_epoch.load(Ordering::Acquire);
        if now == *seen {
            return false;
        }
        let hit = self.lock().cancelled.contains(&token);
        if !hit {
            *seen = now;
        }
        hit
    }
}

/// The step of a blocking page-cache read: between steps a worker checks whether its request
/// is being released, so releasing waits for at most one step per busy worker (FUSE's default
/// max_read, 128 KiB: one request to a slow file system per step).
const READ_STEP: usize = 128 << 10;

/// Whether `job` may join `batch`: a batch's jobs share one fd and one direction, so that the
/// writer limit counts a batch against the right file and a caller helping with reads never
/// takes a write along.
pub fn joins_batch(batch: &[Job], job: &Job) -> bool {
    batch
        .first()
        .is_none_or(|first| first.fd == job.fd && first.write == job.write)
}

/// How many workers may write at once (0 = no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterLimits {
    /// To one fd. Buffered writes to one file serialize on its inode lock anyway; more writers
    /// only spin on it (io_uring's io-wq serializes them the same way, hashing buffered writes
    /// by inode).
    pub file: usize,
    /// To all files together: buffered writes are memory copies, and a burst of stores that
    /// takes every worker takes as many cores from the threads beside the engine (an inference
    /// engine's own thread) and keeps reads waiting for a free worker.
    pub all: usize,
}

impl WriterLimits {
    fn any(&self) -> bool {
        self.file > 0 || self.all > 0
    }
}

/// The fd a write batch writes to (every job of a batch names the same fd and direction:
/// `joins_batch`); None for reads.
fn write_fd(batch: &[Job]) -> Option<i32> {
    batch.first().filter(|j| j.write).map(|j| j.fd)
}

impl Queues {
    fn new(workers: usize) -> Queues {
        Queues {
            running: vec![Vec::new(); workers],
            ..Queues::default()
        }
    }

    /// The position of the first batch a worker may run now: any read, or a write within `limits`.
    fn first_runnable(&self, limits: WriterLimits) -> Option<usize> {
        let (writing, all) = (&self.writing, self.writing_all);
        let admits = |fd: i32| {
            (limits.file == 0 || writing.get(&fd).copied().unwrap_or(0) < limits.file)
                && (limits.all == 0 || all < limits.all)
        };
        self.jobs
            .iter()
            .position(|b| write_fd(b).is_none_or(admits))
    }

    /// Takes the first batch a worker may run now.
    fn take_runnable(&mut self, limits: WriterLimits, worker: usize) -> Option<Vec<Job>> {
        let i = self.first_runnable(limits)?;
        let batch = self.jobs.remove(i)?;
        if let Some(fd) = write_fd(&batch) {
            *self.writing.entry(fd).or_insert(0) += 1;
            self.writing_all += 1;
        }
        self.running[worker].extend(batch.iter().map(|j| j.token));
        Some(batch)
    }

    /// Counts a wake-up for a sleeping worker that no notify has reached yet; false when
    /// every worker is busy or already being woken (the job waits in the queue for the next
    /// free one).
    fn wake_one(&mut self) -> bool {
        let wake = self.sleeping > self.waking;
        self.waking += usize::from(wake);
        wake
    }

    /// Counts a wake-up for every sleeping worker.
    fn wake_all(&mut self) {
        self.waking = self.sleeping;
    }

    /// `worker`'s batch ended, and it takes its next one now, under the same lock: after a
    /// write, often the write that this one's end let run. Waking every sleeping worker per
    /// write's end instead (13 per process on 16 CPUs, nearly all to find nothing) cost four
    /// processes writing staged 256 KiB pieces a fifth of their rate
    /// (bench/results/2026-12-05-per-request-h200.md).
    /// True when one sleeping worker is to be woken: the place a write freed let a batch run
    /// besides the one taken.
    fn end_and_take(
        &mut self,
        batch: &[Job],
        worker: usize,
        limits: WriterLimits,
    ) -> (Option<Vec<Job>>, bool) {
        self.batch_ended(batch, worker);
        let next = self.take_runnable(limits, worker);
        let wake = limits.any()
            && write_fd(batch).is_some()
            && next.is_some()
            && self.first_runnable(limits).is_some()
            && self.wake_one();
        (next, wake)
    }

    /// Adds results, for `take_done`.
    fn add_done(&mut self, shared: &Shared, results: impl IntoIterator<Item = (u64, i32)>) {
        self.done.extend(results);
        shared.has_done.store(true, Ordering::Release);
    }

    /// The batch `worker` took by `take_runnable` ended.
    fn batch_ended(&mut self, batch: &[Job], worker: usize) {
        self.running[worker].clear();
        if !self.cancelled.is_empty() {
            for j in batch {
                self.cancelled.remove(&j.token);
            }
        }
        let Some(fd) = write_fd(batch) else { return };
        self.writing_all -= 1;
        if let Some(n) = self.writing.get_mut(&fd) {
            *n -= 1;
            if *n == 0 {
                self.writing.remove(&fd);
            }
        }
    }
}

pub struct PageCacheWorkers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl PageCacheWorkers {
    /// Starts `config.threads` threads (at least one); a thread that cannot be spawned is
    /// skipped. At most `config.writers` of them write at once.
    pub fn new(config: WorkerConfig, failure: Arc<Failure>) -> std::io::Result<PageCacheWorkers> {
        let count = config.threads;
        let shared = Arc::new(Shared::new(
            count.max(1),
            config.writers,
            config.spin_us,
            failure,
        ));
        let mut threads = Vec::new();
        for i in 0..count.max(1) {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name(format!("iud-pagecache-{i}"))
                .spawn(move || work(&s, i))
            {
                Ok(t) => threads.push(t),
                Err(e) if threads.is_empty() => return Err(e),
                Err(e) => {
                    tracing::info!(
                        "page-cache worker {i} not started ({e}); continuing with {}",
                        threads.len()
                    );
                    break;
                }
            }
        }
        Ok(PageCacheWorkers { shared, threads })
    }

    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// A handle with which a posting or polling thread runs queued reads itself.
    pub fn helper(&self) -> QueueHelper {
        QueueHelper {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Queues a job. The memory and the fd must stay valid until its result is taken.
    pub fn submit(&self, job: Job) {
        self.submit_batch(vec![job]);
    }

    /// Queues jobs that one thread runs in order, each with its own result.
    pub fn submit_batch(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let wake = {
            let mut q = self.lock();
            q.jobs.push_back(jobs);
            self.shared.queued(&mut q)
        };
        if wake {
            self.shared.job_ready.notify_one();
        }
    }

    /// Takes the jobs among `tokens` that no thread has started yet out of the queue; they
    /// complete with -ECANCELED. Started ones stop at their next system call: a read between
    /// its steps, a batch between its jobs (a running pread or pwrite cannot be interrupted);
    /// they complete with what they moved, or -ECANCELED.
    pub fn cancel(&self, tokens: &[u64]) {
        let mut q = self.lock();
        let before_running = q.cancelled.len();
        let running_now: HashSet<u64> = q.running.iter().flatten().copied().collect();
        let running: Vec<u64> = tokens
            .iter()
            .copied()
            .filter(|t| running_now.contains(t))
            .collect();
        q.cancelled.extend(running);
        if q.cancelled.len() != before_running {
            self.shared.cancel_epoch.fetch_add(1, Ordering::Release);
        }
        let mut dropped = Vec::new();
        for batch in q.jobs.iter_mut() {
            batch.retain(|j| {
                let hit = tokens.contains(&j.token);
                if hit {
                    dropped.push((j.token, -libc::ECANCELED));
                }
                !hit
            });
        }
        q.jobs.retain(|b| !b.is_empty());
        if !dropped.is_empty() {
            q.add_done(&self.shared, dropped);
            if q.done_waiters > 0 {
                drop(q);
                self.shared.done_ready.notify_all();
            }
        }
    }

    /// Moves the finished jobs' results into `out` without blocking.
    pub fn take_done(&self, out: &mut Vec<(u64, i32)>) {
        // Cleared before the lock is taken: a result added meanwhile sets it again (under the
        // lock, after adding), so none is left behind unseen.
        if self.shared.has_done.swap(false, Ordering::Acquire) {
            out.append(&mut self.lock().done);
        }
    }

    /// Blocks until some job has finished or `timeout` passed.
    pub fn wait_done(&self, timeout: Duration) {
        let mut q = self.lock();
        if q.done.is_empty() {
            q.done_waiters += 1;
            let (mut q, _) = self
                .shared
                .done_ready
                .wait_timeout(q, timeout)
                .unwrap_or_else(|p| p.into_inner());
            q.done_waiters -= 1;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.shared.lock()
    }
}

impl Drop for PageCacheWorkers {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.lock().wake_all();
        self.shared.job_ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The workers' queue as seen by a thread that would otherwise wait for them.
pub struct QueueHelper {
    shared: Arc<Shared>,
}

impl QueueHelper {
    /// Runs queued read batches in this thread, front first, until no read batch is queued or a
    /// read would block (pages not cached: that batch goes back to the front for the workers,
    /// whose reads may block). Write batches are left to the workers. Returns how many jobs
    /// finished here; their results are taken by `take_done` like the workers' own.
    pub fn run_queued_reads(&self) -> usize {
        let s = &*self.shared;
        let mut ran = 0;
        loop {
            let batch = {
                let mut q = s.lock();
                match q.jobs.front() {
                    Some(b) if b.first().is_some_and(|j| !j.write) => {
                        q.jobs.pop_front().unwrap_or_default()
                    }
                    _ => return ran,
                }
            };
            let mut results = Vec::with_capacity(batch.len());
            let mut blocked_at = None;
            for (i, job) in batch.iter().enumerate() {
                match read_nowait(job) {
                    Some(res) => results.push((job.token, res)),
                    None => {
                        blocked_at = Some(i);
                        break;
                    }
                }
            }
            ran += results.len();
            let mut q = s.lock();
            q.add_done(s, results);
            let announce = q.done_waiters > 0;
            if let Some(i) = blocked_at {
                q.jobs.push_front(batch[i..].to_vec());
                let wake = s.queued(&mut q);
                drop(q);
                if wake {
                    s.job_ready.notify_one();
                }
                if announce {
                    s.done_ready.notify_all();
                }
                return ran;
            }
            drop(q);
            if announce {
                s.done_ready.notify_all();
            }
        }
    }
}

/// A page-cache read that must not wait for the disk: Some(bytes or -errno), or None when the
/// pages are not cached (or the file system cannot say so without blocking).
fn read_nowait(job: &Job) -> Option<i32> {
    let iov = libc::iovec {
        iov_base: job.addr as *mut libc::c_void,
        iov_len: job.len as usize,
    };
    loop {
        // SAFETY: as for `run`: the core keeps the memory and the fd valid until it takes this
        // job's result, and the job is off the queue, so no other thread runs it.
        let n =
            unsafe { libc::preadv2(job.fd, &iov, 1, job.offset as libc::off_t, libc::RWF_NOWAIT) };
        if n >= 0 {
            return Some(n as i32);
        }
        match std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
        {
            libc::EINTR => continue,
            libc::EAGAIN | libc::EOPNOTSUPP => return None,
            errno => return Some(-errno),
        }
    }
}

/// Worker `me`'s loop.
fn work(s: &Shared, me: usize) {
    let mut results: Vec<(u64, i32)> = Vec::new();
    // The batch taken when the last one ended, under the same lock.
    let mut next: Option<Vec<Job>> = None;
    loop {
        let batch = if let Some(b) = next.take() {
            b
        } else {
            let mut q = s.lock();
            let mut spun = s.spin.is_zero();
            loop {
                if let Some(b) = q.take_runnable(s.writers, me) {
                    break b;
                }
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                if !spun {
                    // Watch for the next job a moment, off the lock: a sleeping worker's
                    // wake-up costs the submitter a system call and the job a scheduler delay.
                    let (seen, until) = (
                        s.submitted.load(Ordering::Acquire),
                        std::time::Instant::now() + s.spin,
                    );
                    drop(q);
                    while s.submitted.load(Ordering::Acquire) == seen
                        && std::time::Instant::now() < until
                        && !s.stop.load(Ordering::Relaxed)
                    {
                        std::hint::spin_loop();
                    }
                    spun = true;
                    q = s.lock();
                    continue;
                }
                q.sleeping += 1;
                q = s.job_ready.wait(q).unwrap_or_else(|p| p.into_inner());
                q.sleeping -= 1;
                // A spurious wake-up may take a notified one's count: the count errs toward
                // one more notify, never one less.
                q.waking = q.waking.saturating_sub(1);
            }
        };
        let mut seen = s.cancel_epoch.load(Ordering::Acquire);
        results.extend(batch.iter().map(|j| {
            (
                j.token,
                if s.cancelled(j.token, &mut seen) {
                    -libc::ECANCELED
                } else {
                    run(j, s, &mut seen)
                },
            )
        }));
        let mut q = s.lock();
        q.add_done(s, results.drain(..));
        let held_back;
        (next, held_back) = q.end_and_take(&batch, me, s.writers);
        let announce = q.done_waiters > 0;
        drop(q);
        if held_back {
            s.job_ready.notify_one();
        }
        if announce {
            s.done_ready.notify_all();
        }
    }
}

/// One job; a short count is returned as is (the core issues the remainder, unless the request
/// is being released). A read first tries the whole job from the page cache in one call, then
/// goes on in `READ_STEP`s, stopping early once its request is cancelled.
fn run(job: &Job, s: &Shared, seen: &mut u64) -> i32 {
    if job.write {
        return pread_or_pwrite(job);
    }
    let mut done = match read_nowait(job) {
        // 0 is the end of the file (an uncached range is EAGAIN: None).
        Some(n) if n <= 0 || n as u32 == job.len => return n,
        Some(n) => n as u32,
        None => 0,
    };
    while done < job.len {
        if s.cancelled(job.token, seen) {
            return if done > 0 {
                done as i32
            } else {
                -libc::ECANCELED
            };
        }
        let step = Job {
            offset: job.offset + u64::from(done),
            addr: job.addr + u64::from(done),
            len: (job.len - done).min(READ_STEP as u32),
            ..*job
        };
        match pread_or_pwrite(&step) {
            n if n < 0 => return if done > 0 { done as i32 } else { n },
            0 => break,
            n => done += n as u32,
        }
    }
    done as i32
}

/// One pread or pwrite of the whole job.
fn pread_or_pwrite(job: &Job) -> i32 {
    loop {
        // SAFETY: the core keeps `addr..addr+len` (user memory of a live registration, or a
        // staging buffer owned by the in-flight entry) and the fd valid until it takes this
        // job's result.
        let n = unsafe {
            if job.write {
                libc::pwrite(
                    job.fd,
                    job.addr as *const libc::c_void,
                    job.len as usize,
                    job.offset as libc::off_t,
                )
            } else {
                libc::pread(
                    job.fd,
                    job.addr as *mut libc::c_void,
                    job.len as usize,
                    job.offset as libc::off_t,
                )
            }
        };
        if n >= 0 {
            return n as i32;
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -errno;
        }
    }
}

#[cfg(test)]
mod tests;

/// The page-cache workers an engine starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Worker threads (started on first punted op).
    pub threads: usize,
    /// How many of them may write at once.
    pub writers: WriterLimits,
    /// Microseconds a worker that found no job watches for one before it sleeps (0 = none).
    pub spin_us: u32,
}
