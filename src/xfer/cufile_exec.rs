//! Runs requests on the cuFile sub-path: cuFileRead/cuFileWrite are synchronous, so a small pool
//! of worker threads executes a request's pieces in parallel while checkXfer polls a counter.
//! (cuFile's batch API would be asynchronous, but NIXL's GDS backend, which uses it, hung on the
//! project's GPU machine in compatibility mode; the thread pool mirrors GDS_MT, which works.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
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

/// Progress of one request on the cuFile path.
#[derive(Default, Debug)]
pub struct CufileProgress {
    outstanding: AtomicUsize,
    error: Mutex<Option<Error>>,
}

impl CufileProgress {
    /// Ok(Done) when every piece finished, Ok(InFlight) before; the first error once all ended.
    pub fn status(&self) -> Result<Progress> {
        if self.outstanding.load(Ordering::Acquire) > 0 {
            return Ok(Progress::InFlight);
        }
        match self.error.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(e) => Err(e),
            None => Ok(Progress::Done),
        }
    }

    fn fail(&self, e: Error) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// The worker pool of one engine.
pub struct CufileExecutor {
    tx: Mutex<Option<Sender<Job>>>,
    workers: Vec<JoinHandle<()>>,
}

impl CufileExecutor {
    pub fn new(threads: usize) -> CufileExecutor {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new().name(format!("iud-cufile-{i}")).spawn(move || worker(&rx)).expect("spawn cuFile worker")
            })
            .collect();
        CufileExecutor { tx: Mutex::new(Some(tx)), workers }
    }

    /// Starts a request. Fails if it is still running.
    pub fn post(&self, progress: &Arc<CufileProgress>, jobs: Vec<Job>) -> Result<Progress> {
        if progress.outstanding.load(Ordering::Acquire) > 0 {
            return Err(Error::new(ErrorKind::RepostActive, "postXfer: the request is still in flight; wait for it or release it"));
        }
        *progress.error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        progress.outstanding.store(jobs.len(), Ordering::Release);
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let tx = tx.as_ref().ok_or_else(|| Error::backend("cuFile workers are shut down"))?;
        for job in jobs {
            tx.send(job).map_err(|_| Error::backend("cuFile workers are gone"))?;
        }
        progress.status()
    }

    /// Waits (bounded) until none of the request's pieces runs: synchronous cuFile calls cannot
    /// be cancelled, so release waits for them.
    pub fn drain(&self, progress: &CufileProgress, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while progress.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() > deadline {
                return Err(Error::backend("releaseReqH: cuFile I/O still running; the request is kept"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

impl Drop for CufileExecutor {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(rx: &Mutex<Receiver<Job>>) {
    loop {
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
    if job.progress.error.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
        return Ok(()); // the request already failed: skip the rest
    }
    let op = job.op;
    let device = op.device.unwrap_or(0);
    // cuFile uses the calling thread's CUDA context.
    job.provider.make_current(device)?;
    let mut done = 0u64;
    while done < op.len as u64 {
        let n = job
            .handle
            .io(job.write, job.base, op.addr + done - job.base, op.len as u64 - done, op.file_offset + done)
            .map_err(|e| {
                Error::backend(format!(
                    "cuFile {} fd {} offset {} length {} (descriptor {}): {e}",
                    if job.write { "write to" } else { "read from" },
                    op.fd,
                    op.file_offset + done,
                    op.len as u64 - done,
                    op.desc_index
                ))
            })?;
        if n == 0 {
            return Err(op.remainder(done as u32).made_no_progress(job.write));
        }
        done += n;
    }
    Ok(())
}
