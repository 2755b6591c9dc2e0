//! The staging pipeline as the driver runs it: a staged op takes a staging buffer (with the
//! request's next small pieces packed into it), a WRITE's device copy starts and its storage
//! writes follow when the copy ends, a READ's storage reads land in the buffer and its one
//! device copy starts when the last of them ended. `path::staging` keeps the buffers and groups;
//! this file decides when each step runs.

use std::sync::Arc;

use super::{Driver, InFlight, Staged, Table};
use crate::error::{describe_os_error, Error, Result};
use crate::gpu::GpuProvider;
use crate::path::staging::{Stage, Staging, StagingPool, StagingShape};
use crate::uring::IoOp;
use crate::xfer::profile::Profiles;
use crate::xfer::request::{Next, RequestProgress};

impl Driver {
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
}

impl Table {
    /// Gives a staged op (VRAM through a staging buffer) its buffer: opens a group, packs the
    /// request's next small pieces into it, then starts a WRITE's device copy or queues a READ's
    /// storage reads of its runs.
    pub(super) fn fill_staged(&mut self, key: usize, op: IoOp) -> Staged {
        let Some(req) = self.requests.get_mut(key) else {
            return Staged::Went;
        };
        let write = req.ops.write;
        let Some(staging) = self.staging.as_mut() else {
            req.fail(Error::backend(
                "internal error: a VRAM op reached the ring before its staging pool existed",
            ));
            req.settle();
            return Staged::Went;
        };
        // Page-cache WRITEs fill at most the write window: let the next request go.
        let windowed = write && req.ops.page_cache;
        if windowed && !staging.window_admits(op.len) {
            return Staged::Throttled;
        }
        // All buffers busy: wait for completions to free one.
        let Some(group) = staging.open(key, write, op, windowed) else {
            return Staged::NoBuffer;
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
            return Staged::Went;
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
        Staged::Went
    }

    /// Finishes device copies that completed; returns how many did.
    pub(super) fn poll_copies(&mut self) -> usize {
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

    /// A staged run of several pieces that did not move whole (`res`: bytes moved or -errno):
    /// the pieces it finished are over, the others go again one by one, so a short transfer or
    /// an error names its own descriptor. False, with nothing done, for any other I/O.
    pub(super) fn run_cut_short(&mut self, entry: &InFlight, res: i32) -> bool {
        let whole = res >= 0 && res as u32 == entry.op.len;
        let Some(req) = self.requests.get_mut(entry.req) else {
            return false;
        };
        let (Some(run), Some(staging), false, true) =
            (entry.stage, self.staging.as_ref(), whole, req.is_healthy())
        else {
            return false;
        };
        if run.count <= 1 {
            return false;
        }
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
            Table::io_over(req, Some(one), true, &mut self.staging, &mut self.profiles);
        }
        self.retry.extend(again);
        req.settle();
        true
    }

    /// One storage I/O of the request ended (`ok`: every byte moved) or was dropped. A staged run
    /// counts its pieces toward their group: a WRITE's buffer is freed after its last piece; a
    /// READ's group starts its one device copy when every piece's read landed (its pieces are over
    /// when it ends).
    pub(super) fn io_over(
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
}
