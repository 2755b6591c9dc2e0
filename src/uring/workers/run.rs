//! Running the queue's jobs: a worker thread's loop, one job's pread or pwrite (a long read in
//! steps, stopping once its request is cancelled), and the non-blocking reads a posting or
//! polling thread takes off the queue itself (`QueueHelper`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::queue::{Job, Shared};

/// The step of a blocking page-cache read: between steps a worker checks whether its request
/// is being released, so releasing waits for at most one step per busy worker (FUSE's default
/// max_read, 128 KiB: one request to a slow file system per step).
const READ_STEP: usize = 128 << 10;

/// The workers' queue as seen by a thread that would otherwise wait for them.
pub struct QueueHelper {
    pub(super) shared: Arc<Shared>,
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
pub(super) fn work(s: &Shared, me: usize) {
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
