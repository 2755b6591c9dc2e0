//! The page-cache workers' queue: jobs batched by fd and direction, the writer limits, which
//! worker runs what, sleeping and waking, cancellation and finished results, all under one lock
//! (`Shared`), shared by the workers, the core and the threads that help.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::Failure;

/// The lock's name in the failed engine's error.
pub(super) const QUEUE_LOCK: &str = "page-cache workers' queue";

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
pub(super) struct Queues {
    /// Batches of jobs; one thread runs a batch's jobs one after another (small pieces packed
    /// together cost one hand-off, not one each).
    pub(super) jobs: VecDeque<Vec<Job>>,
    /// (token, result): bytes moved, or -errno, as in a CQE.
    pub(super) done: Vec<(u64, i32)>,
    /// Write batches running now, per fd and in all (see `WriterLimits`).
    pub(super) writing: HashMap<i32, usize>,
    pub(super) writing_all: usize,
    /// Tokens of the batch each worker runs now, by worker (empty while it waits): kept per
    /// worker, not in one set, so that taking and ending a batch hashes nothing under the lock
    /// all the workers share (16 KiB pieces end a batch every few microseconds on 14 workers).
    pub(super) running: Vec<Vec<u64>>,
    /// Running jobs whose request is being released: they stop at their next system call.
    pub(super) cancelled: HashSet<u64>,
    /// Workers waiting for a job, and how many of them were notified but have not taken the
    /// lock again: a job is handed over with a wake-up only when some worker sleeps unwoken.
    /// A system call per job otherwise (the condvar wakes unconditionally) cost the thread that
    /// posts and polls one futex call per 256 KiB of 16 KiB pieces, while every worker was busy.
    pub(super) sleeping: usize,
    pub(super) waking: usize,
    /// Threads in `wait_done`: results are announced only when one waits.
    pub(super) done_waiters: usize,
}

pub(super) struct Shared {
    pub(super) queues: Mutex<Queues>,
    /// Set under the lock whenever results are added to `Queues::done`: the thread that polls
    /// takes the lock for results only when there may be some (it polls far more often than
    /// batches end, and every take would contend with the workers).
    pub(super) has_done: AtomicBool,
    pub(super) job_ready: Condvar,
    pub(super) done_ready: Condvar,
    pub(super) stop: AtomicBool,
    pub(super) writers: WriterLimits,
    pub(super) failure: Arc<Failure>,
    /// Bumped by every `cancel` that reached a running job, so that workers look at
    /// `Queues::cancelled` (under the lock) only after one did.
    pub(super) cancel_epoch: AtomicU64,
    /// Bumped whenever jobs are queued (`Shared::queued`); spinning workers watch it.
    pub(super) submitted: AtomicU64,
    /// How long a worker that found no job watches `submitted` before it sleeps.
    pub(super) spin: std::time::Duration,
}

impl Shared {
    pub(super) fn new(
        workers: usize,
        writers: WriterLimits,
        spin_us: u32,
        failure: Arc<Failure>,
    ) -> Shared {
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
    pub(super) fn queued(&self, q: &mut Queues) -> bool {
        self.submitted.fetch_add(1, Ordering::Release);
        q.wake_one()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.failure.lock_or_recover(&self.queues, QUEUE_LOCK)
    }

    /// Whether the running job `token` was cancelled; `seen` is the epoch this worker last
    /// looked at (updated).
    pub(super) fn cancelled(&self, token: u64, seen: &mut u64) -> bool {
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
    pub(super) fn any(&self) -> bool {
        self.file > 0 || self.all > 0
    }
}

/// The fd a write batch writes to (every job of a batch names the same fd and direction:
/// `joins_batch`); None for reads.
pub(super) fn write_fd(batch: &[Job]) -> Option<i32> {
    batch.first().filter(|j| j.write).map(|j| j.fd)
}

impl Queues {
    pub(super) fn new(workers: usize) -> Queues {
        Queues {
            running: vec![Vec::new(); workers],
            ..Queues::default()
        }
    }

    /// The position of the first batch a worker may run now: any read, or a write within `limits`.
    pub(super) fn first_runnable(&self, limits: WriterLimits) -> Option<usize> {
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
    pub(super) fn take_runnable(
        &mut self,
        limits: WriterLimits,
        worker: usize,
    ) -> Option<Vec<Job>> {
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
    pub(super) fn wake_one(&mut self) -> bool {
        let wake = self.sleeping > self.waking;
        self.waking += usize::from(wake);
        wake
    }

    /// Counts a wake-up for every sleeping worker.
    pub(super) fn wake_all(&mut self) {
        self.waking = self.sleeping;
    }

    /// `worker`'s batch ended, and it takes its next one now, under the same lock: after a
    /// write, often the write that this one's end let run. Waking every sleeping worker per
    /// write's end instead (13 per process on 16 CPUs, nearly all to find nothing) costs four
    /// processes writing staged 256 KiB pieces a fifth of their rate
    /// (bench/results/2026-12-05-per-request-h200.md).
    /// True when one sleeping worker is to be woken: the place a write freed let a batch run
    /// besides the one taken.
    pub(super) fn end_and_take(
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
    pub(super) fn add_done(
        &mut self,
        shared: &Shared,
        results: impl IntoIterator<Item = (u64, i32)>,
    ) {
        self.done.extend(results);
        shared.has_done.store(true, Ordering::Release);
    }

    /// The batch `worker` took by `take_runnable` ended.
    pub(super) fn batch_ended(&mut self, batch: &[Job], worker: usize) {
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
