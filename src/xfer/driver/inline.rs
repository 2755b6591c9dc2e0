//! The I/O that threads posting and polling a request do themselves, without the driver's lock
//! while they copy: small cached reads and buffered writes of their own request, and reads
//! queued for the page-cache workers.

use std::sync::{Arc, MutexGuard};

use super::{Driver, Staging, Table};
use crate::error::Result;
use crate::path::direct;

/// A read request this small is first tried from the page cache by the posting thread: one
/// preadv2 per op beats a ring round trip (SQE, io_uring_enter, CQE, and NIXL's second call to
/// see the completion). Larger requests gain more from one batched io_uring_enter.
const INLINE_READ_MAX_OPS: usize = 4;
const INLINE_READ_MAX_BYTES: u64 = 64 << 10;

impl Driver {
    /// Runs reads queued for the page-cache workers in this thread, without holding the lock
    /// while copying, refilling the queue from waiting requests between rounds, until none is
    /// left to take (the rest runs on the workers or waits for the disk). A thread that posts or
    /// polls would otherwise wait for the workers: on a busy machine they may get no core soon.
    /// `page_cache_caller_reads` decides when (`CallerReads`).
    pub(super) fn help_page_cache_workers<'a>(
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
    pub(super) fn help_with_writes<'a>(
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
    pub(super) fn read_inline_if_cached<'a>(
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
}
