//! Page-cache I/O on the engine's own threads (the ops the planner marks `punt`).
//!
//! A buffered read of cached pages is a memory copy. io_uring runs it either inline in the
//! submitting thread (one core) or, with IOSQE_ASYNC, on an io-wq worker. io-wq wakes the first
//! idle worker for each queued item, and a worker that was woken but has not yet started is still
//! "idle", so a burst of items submitted together (one request's pieces) lands on one or two
//! workers and runs serially: on the H200 machine, 32 x 1 MiB page-cache reads into staging
//! buffers reach 6.9 GB/s through io-wq against 15.8 on NIXL's GDS_MT threads
//! (bench/results/2026-11-29-gpu-h200-session4.md). These workers take each queued item on a
//! free thread, so one request's copies really run on several cores.
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

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::Failure;

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

mod queue;
mod run;
#[cfg(test)]
mod tests;

pub use queue::{joins_batch, Job, WriterLimits};
use queue::{Queues, Shared};
use run::work;
pub use run::QueueHelper;

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
