//! prepXfer's work: check a (local memory list, remote storage list) pair against the
//! registrations and turn it into ring ops.
//!
//! The lists' kinds and counts are checked here; each descriptor is validated and cut in
//! `descriptors.rs`. A large list is planned in parts at once (`prep_pool.rs`), each part as the
//! whole list would be, and the parts' ops are joined in order.

use std::sync::{Arc, Mutex};

use super::bind::Binder;
use super::cut::Limits;
use super::descriptors::{ListPlanner, Part};
use super::direction::XferOp;
use super::prep_pool::PrepPool;
use super::recycle::OpLists;
use super::request::RequestOps;
use crate::error::{Error, ErrorKind, Result};
use crate::ffi::bridge::iud_desc;
use crate::mem::live::Registry;
use crate::mem::{MemKind, Registration};
use crate::params::EngineParams;
use crate::uring::{MAX_FIXED_BUFFER, WORKER_JOB_BYTES};

/// A validated request: its ops plus the registrations they use, kept alive until release.
#[derive(Debug)]
pub struct Plan {
    pub op: XferOp,
    pub ops: Arc<RequestOps>,
    /// Every registration named by the lists (also keeps fd-mode files for the post-time check).
    pub registrations: Vec<Arc<Registration>>,
    pub local_count: usize,
    pub remote_count: usize,
    /// Bytes moved by the request.
    pub total_bytes: u64,
    /// The ops run on the cuFile sub-path (all of them: a request does not mix paths).
    pub cufile: bool,
    /// Some VRAM piece is reached outside the plugin's device streams (cuFile or DMA-BUF I/O),
    /// so posting must wait on the host for the application's queued GPU work.
    pub vram_outside_streams: bool,
}

/// Fewest descriptors in a part planned by a helper thread: below it, waking a helper and
/// joining its ops cost about what the part would.
const PART_MIN: usize = 1024;

/// How many parts a list of `n` descriptors is planned in, by up to `width` threads.
pub fn parts_for(n: usize, width: usize) -> usize {
    (n / PART_MIN).clamp(1, width.max(1))
}

/// prepXfer's planner: what planning needs from the engine.
pub struct Planner<'a> {
    /// The piece limits' parameters: `max_io_size`, `punt_buffered_min`, the staging pool's
    /// size, `page_cache_threads`, `staged_write_piece_max`, `staged_read_piece_max`.
    pub params: &'a EngineParams,
    /// The live registrations descriptors are resolved through.
    pub registry: &'a Registry,
    /// Chooses (once per pair, cached in `path::routes`) how a memory registration reaches a
    /// target.
    pub binder: &'a Binder<'a>,
    /// Op lists of released requests, reused (no page faults per request).
    pub lists: &'a OpLists,
    /// Threads that plan parts of a large list beside the caller (`prep_threads`).
    pub pool: Option<&'a PrepPool>,
}

/// Smallest staged piece worth cutting (below it, per-piece overhead outweighs parallelism).
const STAGED_PIECE_MIN: u64 = 256 << 10;

/// Piece size for staged VRAM: at most a staging buffer, but small enough that the request keeps
/// every staging buffer busy (an 8 MiB request in one 8 MiB piece would run one storage I/O and
/// one copy, one after the other), in 64 KiB multiples so O_DIRECT pieces stay aligned.
fn staged_piece(p: &EngineParams, request: u64) -> u64 {
    let share = (request / u64::from(p.staging_buffers.max(1))) & !((64 << 10) - 1);
    p.staging_buffer_size.min(share.max(STAGED_PIECE_MIN))
}

const WORKER_PIECE_MAX: u64 = 1 << 20;

/// Piece size for buffered reads handed to the page-cache workers: the request spread over all
/// of them (merging neighbours into max_io_size pieces would leave most idle: 128 x 64 KiB
/// became two 4 MiB reads), but never below `punt_buffered_min` (smaller ones are not punted).
fn worker_piece(p: &EngineParams, request: u64) -> u64 {
    // The workers and the posting thread, which runs queued reads too. At most 1 MiB: a piece
    // a worker holds while the scheduler keeps it off the CPU (a busy machine) is what the
    // request waits for at its end, so pieces stay short.
    let share = (request / (p.page_cache_threads as u64 + 1)).div_ceil(4096) * 4096;
    share.min(WORKER_PIECE_MAX).max(p.punt_buffered_min)
}

/// A descriptor list shared with the helper threads for the length of one `PrepPool::run`.
#[derive(Clone, Copy)]
struct Lists<'a>(&'a [iud_desc]);

// SAFETY: descriptors are plain values; their MD pointers are opaque tokens that the plugin
// compares and never dereferences (mem::live), so reading them from several threads is safe.
unsafe impl Sync for Lists<'_> {}

impl<'a> Lists<'a> {
    /// Descriptors `a..b` (a method, so that closures capture the `Sync` wrapper, not the slice).
    fn range(&self, a: usize, b: usize) -> &'a [iud_desc] {
        &self.0[a..b]
    }
}

/// The piece limits of a request of `total_bytes`.
fn limits(p: &EngineParams, total_bytes: u64) -> Limits {
    // A host request no larger than one worker job stays with the posting thread: one job
    // cannot be spread, and the hand-off would only add a wake-up.
    let spreadable = total_bytes > WORKER_JOB_BYTES;
    let max_piece = if p.max_io_size == 0 {
        MAX_FIXED_BUFFER
    } else {
        p.max_io_size.min(MAX_FIXED_BUFFER)
    };
    Limits {
        max_piece,
        staged: max_piece.min(staged_piece(p, total_bytes)),
        // Cut for the workers only what goes to them.
        worker: if p.punt_buffered_min > 0 && spreadable {
            max_piece.min(worker_piece(p, total_bytes))
        } else {
            max_piece
        },
        punt_buffered_min: p.punt_buffered_min,
        staged_write: p.staged_write_piece_max,
        staged_read: p.staged_read_piece(),
        spreadable,
    }
}

impl Planner<'_> {
    /// Validates the lists against the live registrations and builds the request's ops. The
    /// descriptors' MDs are only hints (`mem::live`).
    pub fn plan(
        &self,
        op: XferOp,
        local_kind: i32,
        local: &[iud_desc],
        remote_kind: i32,
        remote: &[iud_desc],
    ) -> Result<Plan> {
        let lk = MemKind::from_nixl(local_kind);
        let rk = MemKind::from_nixl(remote_kind);
        let (lk, rk, local, remote) = match (lk, rk) {
            (
                Some(l @ (MemKind::Dram | MemKind::Vram)),
                Some(r @ (MemKind::File | MemKind::Blk)),
            ) => (l, r, local, remote),
            // The storage side as the local list: NIXL's own storage backends (GDS, GDS_MT, HF3FS,
            // AIS) take either list as the file and read the op as the file's direction (READ: file
            // -> memory), and Dynamo's KVBM onboards disk blocks this way (local FILE, remote VRAM,
            // READ). The same op on swapped lists moves the same bytes the same way.
            (
                Some(s @ (MemKind::File | MemKind::Blk)),
                Some(m @ (MemKind::Dram | MemKind::Vram)),
            ) => (m, s, remote, local),
            _ => {
                return Err(Error::invalid(format!(
                    "unsupported list types: local {} / remote {}; IO_URING_DMABUF moves DRAM_SEG \
                     or VRAM_SEG <-> FILE_SEG or BLK_SEG (either list may be the storage side; \
                     the op names the storage's direction: READ from it, WRITE to it)",
                    lk.map_or("unknown", |k| k.name()),
                    rk.map_or("unknown", |k| k.name())
                )))
            }
        };
        if local.len() != remote.len() {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "local list has {} descriptors but remote list has {}",
                    local.len(),
                    remote.len()
                ),
            ));
        }
        // The request's size sets the piece limits, so it is summed before the descriptors are cut.
        let total_bytes = local.iter().fold(0u64, |sum, l| sum.saturating_add(l.len));
        let lists = ListPlanner {
            op,
            kinds: (lk, rk),
            registry: self.registry,
            binder: self.binder,
            limits: limits(self.params, total_bytes),
        };
        // In parts when the list is large enough and the helpers are free, else whole.
        let in_parts = match self
            .pool
            .map(|pool| (pool, parts_for(local.len(), pool.width())))
        {
            Some((pool, parts)) if parts > 1 => {
                self.in_parts(&lists, pool, parts, Lists(local), Lists(remote))?
            }
            _ => None,
        };
        let part = match in_parts {
            Some(part) => part,
            None => lists.part(0, local, remote, self.lists.take(local.len()))?,
        };
        if part.unhinted > 0 {
            tracing::debug!(
                "prepXfer: {} of {} descriptor pairs carried an MD of no registration covering \
                 them (NIXL's lists in sync mode NONE); resolved by address",
                part.unhinted,
                local.len()
            );
        }
        if part.cufile_descs > 0 && part.cufile_descs < local.len() {
            self.lists.give_back(part.ops);
            return Err(Error::invalid(
                "descriptors of one request take different paths (cuFile for some, io_uring for \
                 others); split the request by memory region",
            ));
        }
        let write = op == XferOp::Write;
        let (all_buffered, all_host) = (part.all_buffered, part.all_host);
        // Reads meant for the page-cache workers are not served by the posting thread.
        Ok(Plan {
            op,
            ops: Arc::new(RequestOps {
                write,
                inline_writes: write && all_buffered && all_host,
                inline_reads: !write && all_buffered && all_host && !part.any_punt,
                page_cache: all_buffered,
                ops: part.ops,
            }),
            registrations: part.registrations,
            local_count: local.len(),
            remote_count: remote.len(),
            total_bytes,
            cufile: part.cufile_descs > 0,
            vram_outside_streams: part.vram_outside_streams,
        })
    }

    /// Plans the lists in `parts` parts on the pool and joins them in order, as one `Part`. The
    /// first failing descriptor fails the request, as planned whole (a later part may have bound a
    /// pair's route meanwhile, which the next request of that pair would do anyway). None when the
    /// pool was busy with another request's parts.
    fn in_parts(
        &self,
        lists: &ListPlanner<'_>,
        pool: &PrepPool,
        parts: usize,
        local: Lists<'_>,
        remote: Lists<'_>,
    ) -> Result<Option<Part>> {
        let n = local.0.len();
        let bounds = |p: usize| (p * n / parts, (p + 1) * n / parts);
        let results: Vec<Mutex<Option<Result<Part>>>> =
            (0..parts).map(|_| Mutex::new(None)).collect();
        let ran = pool.run(parts, &|p| {
            let (a, b) = bounds(p);
            // Part 0's list becomes the request's: room for all of them.
            let ops = self.lists.take(if p == 0 { n } else { b - a });
            let r = lists.part(a, local.range(a, b), remote.range(a, b), ops);
            *results[p].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        });
        if !ran {
            return Ok(None);
        }
        let mut joined: Option<Part> = None;
        let mut failed = None;
        for slot in results {
            let r = slot
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| {
                    Err(Error::backend(
                        "prepXfer: a part of the lists was not planned",
                    ))
                });
            match (r, &mut joined) {
                (Err(e), _) => {
                    failed.get_or_insert(e);
                }
                (Ok(part), _) if failed.is_some() => self.lists.give_back(part.ops),
                (Ok(part), None) => joined = Some(part),
                (Ok(part), Some(all)) => all.append(part, self.lists),
            }
        }
        if let Some(e) = failed {
            if let Some(all) = joined {
                self.lists.give_back(all.ops);
            }
            return Err(e);
        }
        Ok(joined)
    }
}
