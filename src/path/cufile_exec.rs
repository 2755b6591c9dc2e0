//! Runs requests on the cuFile sub-path, in one of two ways (`cufile_api`):
//! - `threads`: cuFileRead/cuFileWrite are synchronous, so a small pool of worker threads executes
//!   a request's pieces in parallel while checkXfer polls a counter (as NIXL's GDS_MT does);
//! - `batch`: the pieces go to cuFile's batch API in batches of at most max_batch_io_size, and
//!   checkXfer polls their events without blocking (as NIXL's GDS does).
//!
//! `auto` takes the batch API only when cuFile is really direct: in compatibility mode NIXL's GDS
//! backend (batch API) hung on the project's GPU machine while the thread pool worked.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Failure, Result};
use crate::gpu::cufile::batch::{event_status_name, Batch, BatchFns, Piece, STATUS_COMPLETE};
use crate::gpu::cufile::CuFileHandle;
use crate::gpu::GpuProvider;
use crate::uring::{IoOp, Progress};

/// One piece of a request for a worker.
pub struct Job {
    pub progress: Arc<CufileProgress>,
    pub op: IoOp,
    pub write: bool,
    pub handle: Arc<CuFileHandle>,
    /// Registered buffer base and the op's offset from it (base = op address when the memory
    /// is not registered with cuFile).
    pub base: u64,
    pub provider: Arc<dyn GpuProvider>,
}

/// Names of this module's locks in a failed engine's error.
const ERROR_LOCK: &str = "cuFile request's error slot";
const BATCHES_LOCK: &str = "cuFile request's batches";
const SENDER_LOCK: &str = "cuFile workers' queue";

/// Progress of one request on the cuFile path.
pub struct CufileProgress {
    /// The engine's failed state: a poisoned lock here sets it (worker threads and batch polls
    /// cannot return an error, so they recover the value; the request's next call answers it).
    failure: Arc<Failure>,
    outstanding: AtomicUsize,
    error: Mutex<Option<Error>>,
    /// Batch mode: the submitted batches with the jobs they carry.
    batches: Mutex<Vec<(Batch, Vec<Job>)>>,
}

impl std::fmt::Debug for CufileProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CufileProgress({} outstanding)",
            self.outstanding.load(Ordering::Relaxed)
        )
    }
}

impl CufileProgress {
    pub fn new(failure: Arc<Failure>) -> CufileProgress {
        CufileProgress {
            failure,
            outstanding: AtomicUsize::new(0),
            error: Mutex::new(None),
            batches: Mutex::new(Vec::new()),
        }
    }

    /// Ok(Done) when every piece finished, Ok(InFlight) before; the first error once all ended.
    pub fn status(&self) -> Result<Progress> {
        self.failure.check()?;
        self.poll_batches();
        self.failure.check()?;
        if self.outstanding.load(Ordering::Acquire) > 0 {
            return Ok(Progress::InFlight);
        }
        match self.failure.lock(&self.error, ERROR_LOCK)?.clone() {
            Some(e) => Err(e),
            None => Ok(Progress::Done),
        }
    }

    /// Batch mode: collects finished pieces, finishes short ones synchronously, and records the
    /// first failure. Batches whose pieces all ended are destroyed.
    fn poll_batches(&self) {
        let mut batches = self.failure.lock_or_recover(&self.batches, BATCHES_LOCK);
        batches.retain_mut(|(batch, jobs)| {
            match batch.poll() {
                Err(e) => {
                    self.fail(e);
                    self.outstanding.fetch_sub(
                        batch.results.iter().filter(|r| r.is_none()).count(),
                        Ordering::AcqRel,
                    );
                    false // dropping cancels and destroys it
                }
                Ok(false) => true,
                Ok(true) => {
                    for (job, result) in jobs.iter().zip(&batch.results) {
                        let (status, ret) = result.unwrap_or((0, 0));
                        let outcome = if status != STATUS_COMPLETE {
                            Err(piece_error(
                                job,
                                0,
                                &format!(
                                    "batch event {} (ret {})",
                                    event_status_name(status),
                                    ret as isize
                                ),
                            ))
                        } else if (ret as u64) < job.op.len as u64 {
                            // A short piece: move the rest with the synchronous call.
                            run_from(job, ret as u64)
                        } else {
                            Ok(())
                        };
                        if let Err(e) = outcome {
                            self.fail(e);
                        }
                    }
                    self.outstanding.fetch_sub(jobs.len(), Ordering::AcqRel);
                    false
                }
            }
        });
    }

    fn fail(&self, e: Error) {
        let mut slot = self.failure.lock_or_recover(&self.error, ERROR_LOCK);
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// How requests reach cuFile.
#[derive(Clone, Copy)]
pub enum CufileApi {
    Threads,
    /// The batch API with at most this many pieces per batch.
    Batch(BatchFns, usize),
}

/// The worker pool (or batch submitter) of one engine.
pub struct CufileExecutor {
    tx: Mutex<Option<Sender<Job>>>,
    workers: Vec<JoinHandle<()>>,
    api: CufileApi,
}

impl CufileExecutor {
    pub fn new(threads: usize, api: CufileApi) -> CufileExecutor {
        if let CufileApi::Batch(..) = api {
            return CufileExecutor {
                tx: Mutex::new(None),
                workers: Vec::new(),
                api,
            };
        }
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("iud-cufile-{i}"))
                    .spawn(move || worker(&rx))
                    .expect("spawn cuFile worker")
            })
            .collect();
        CufileExecutor {
            tx: Mutex::new(Some(tx)),
            workers,
            api,
        }
    }

    /// Starts a request. Fails if it is still running.
    pub fn post(&self, progress: &Arc<CufileProgress>, jobs: Vec<Job>) -> Result<Progress> {
        if progress.outstanding.load(Ordering::Acquire) > 0 {
            return Err(Error::new(
                ErrorKind::RepostActive,
                "postXfer: the request is still in flight; wait for it or release it",
            ));
        }
        progress.failure.check()?;
        *progress.failure.lock(&progress.error, ERROR_LOCK)? = None;
        progress.outstanding.store(jobs.len(), Ordering::Release);
        if let CufileApi::Batch(fns, max) = self.api {
            return self.post_batches(progress, jobs, fns, max);
        }
        let tx = progress.failure.lock(&self.tx, SENDER_LOCK)?;
        let tx = tx
            .as_ref()
            .ok_or_else(|| Error::backend("cuFile workers are shut down"))?;
        for job in jobs {
            tx.send(job)
                .map_err(|_| Error::backend("cuFile workers are gone"))?;
        }
        progress.status()
    }

    /// Submits the jobs in batches of at most `max` pieces (one read or write direction per
    /// request, files may differ per piece).
    fn post_batches(
        &self,
        progress: &Arc<CufileProgress>,
        jobs: Vec<Job>,
        fns: BatchFns,
        max: usize,
    ) -> Result<Progress> {
        let Some(first) = jobs.first() else {
            return progress.status();
        };
        // cuFile uses the calling thread's CUDA context.
        if let Err(e) = first.provider.make_current(first.op.device.unwrap_or(0)) {
            progress.outstanding.store(0, Ordering::Release);
            return Err(e);
        }
        let mut batches = progress.failure.lock(&progress.batches, BATCHES_LOCK)?;
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            let chunk: Vec<Job> = jobs.by_ref().take(max.max(1)).collect();
            let pieces: Vec<Piece<'_>> = chunk
                .iter()
                .map(|j| Piece {
                    file: j.handle.raw(),
                    base: j.base,
                    buf_offset: j.op.addr - j.base,
                    file_offset: j.op.file_offset,
                    len: j.op.len as u64,
                })
                .collect();
            match Batch::submit(fns, chunk[0].write, &pieces) {
                Ok(b) => batches.push((b, chunk)),
                Err(e) => {
                    // Pieces of this chunk and of the ones not yet submitted will not run.
                    let not_run = chunk.len() + jobs.count();
                    progress.outstanding.fetch_sub(not_run, Ordering::AcqRel);
                    progress.fail(e);
                    break;
                }
            }
        }
        drop(batches);
        progress.status()
    }

    /// Waits (bounded) until none of the request's pieces runs: synchronous cuFile calls cannot
    /// be cancelled, so release waits for them; batches are cancelled.
    pub fn drain(&self, progress: &CufileProgress, limit: Duration) -> Result<()> {
        // Teardown: a poisoned list is still drained (its batches must be cancelled).
        let cancelled: usize = progress
            .failure
            .lock_or_recover(&progress.batches, BATCHES_LOCK)
            .drain(..)
            .map(|(_, jobs)| jobs.len())
            .sum();
        if cancelled > 0 {
            progress.outstanding.fetch_sub(cancelled, Ordering::AcqRel);
        }
        let deadline = Instant::now() + limit;
        while progress.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() > deadline {
                return Err(Error::backend(
                    "releaseReqH: cuFile I/O still running; the request is kept",
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

impl Drop for CufileExecutor {
    fn drop(&mut self) {
        // Dropping the sender ends the workers, poisoned or not.
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(rx: &Mutex<Receiver<Job>>) {
    loop {
        // Only this module's workers take this lock, and none panics while holding it (recv).
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        if let Err(e) = run(&job) {
            job.progress.fail(e);
        }
        job.progress.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Moves one piece, finishing short transfers.
fn run(job: &Job) -> Result<()> {
    if job
        .progress
        .failure
        .lock_or_recover(&job.progress.error, ERROR_LOCK)
        .is_some()
    {
        return Ok(()); // the request already failed: skip the rest
    }
    run_from(job, 0)
}

/// The error of a piece that failed after `done` bytes, naming the file range and descriptor.
fn piece_error(job: &Job, done: u64, why: &dyn std::fmt::Display) -> Error {
    let op = job.op;
    let e = Error::backend(format!(
        "cuFile {} fd {} offset {} length {} (descriptor {}): {why}",
        if job.write { "write to" } else { "read from" },
        op.fd,
        op.file_offset + done,
        op.len as u64 - done,
        op.desc_index
    ));
    e.at_descriptor(op.desc_index as usize)
        .with_fd(op.fd)
        .with_offset(op.file_offset + done)
}

/// Moves the piece from byte `done` on with synchronous calls.
fn run_from(job: &Job, mut done: u64) -> Result<()> {
    let op = job.op;
    let device = op.device.unwrap_or(0);
    // cuFile uses the calling thread's CUDA context.
    job.provider.make_current(device)?;
    while done < op.len as u64 {
        let n = job
            .handle
            .io(
                job.write,
                job.base,
                op.addr + done - job.base,
                op.len as u64 - done,
                op.file_offset + done,
            )
            // The piece's context plus what cuFile said (errno or cuFile status).
            .map_err(|e| piece_error(job, done, &e.message).caused_by(e))?;
        if n == 0 {
            return Err(op.remainder(done as u32).made_no_progress(job.write));
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_request_lock_fails_the_engine_instead_of_panicking() {
        let failure = Arc::new(Failure::default());
        let progress = CufileProgress::new(Arc::clone(&failure));
        assert_eq!(progress.status().unwrap(), Progress::Done);
        crate::error::poison(&progress.error);
        let e = progress.status().unwrap_err();
        assert!(
            e.message.contains("cuFile request's error slot"),
            "{}",
            e.message
        );
        // From now on every call of the engine answers the error.
        assert!(failure.check().is_err());
        let exec = CufileExecutor::new(1, CufileApi::Threads);
        assert!(exec
            .post(
                &Arc::new(CufileProgress::new(Arc::clone(&failure))),
                Vec::new()
            )
            .is_err());
    }
}
