//! prepXfer's work: check a (local memory list, remote storage list) pair against the
//! registrations and turn it into ring ops.
//!
//! Every rule the kernel would otherwise enforce with a bare EINVAL is checked here with a
//! message that names the descriptor: list kinds, counts, equal lengths, coverage by a
//! registration of this engine, the file's access mode, and O_DIRECT alignment. Descriptors are
//! split at `max_io_size` and at fixed-buffer slot boundaries, and neighbours that continue each
//! other in memory and file are merged up to the same size.

use std::collections::HashMap;
use std::sync::Arc;

use crate::bridge::iud_desc;
use crate::error::{Error, ErrorKind, Result};
use super::recycle::OpLists;
use super::request::RequestOps;
use crate::mem::live::{Coverage, Registry, Unresolved};
use crate::mem::{FileRegion, MemKind, Registration};
use crate::path::{direct, dmabuf, staging, Route};
use crate::uring::{IoOp, MAX_FIXED_BUFFER, WORKER_JOB_BYTES};

/// NIXL's transfer direction: READ = storage -> memory, WRITE = memory -> storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    Read,
    Write,
}

impl XferOp {
    pub fn from_nixl(value: i32) -> Result<XferOp> {
        match value {
            0 => Ok(XferOp::Read),
            1 => Ok(XferOp::Write),
            v => Err(Error::invalid(format!("unknown transfer operation {v} (expected NIXL_READ=0 or NIXL_WRITE=1)"))),
        }
    }
}

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

/// How many (MD, registration) hints each side keeps; lists name one or a few registrations per
/// side (KV caches: one per layer or region), and a short scan is cheaper than any lookup.
const HINTS: usize = 8;

/// The registrations of a request's descriptors, resolved through the engine's registry and
/// deduplicated (lists name one or a few registrations for thousands of descriptors).
struct Registrations<'a> {
    registry: &'a Registry,
    index: HashMap<usize, usize>,
    list: Vec<Arc<Registration>>,
    /// Per side (memory, storage): up to `HINTS` recent distinct MDs and the registration each
    /// last resolved to; a descriptor with one of them whose registration covers it needs no
    /// registry lookup (no lock, no hash), whatever order the regions come in.
    hints: [Vec<Hint>; 2],
    /// Per side: the hint a new MD replaces when all are taken (the oldest).
    victim: [usize; 2],
    /// Descriptors whose MD did not name a registration covering them (sync mode NONE).
    unhinted: usize,
}

/// An MD and the coverage of the registration it last resolved to, copied so that the check
/// per descriptor reads only this (the registration is immutable).
#[derive(Clone, Copy)]
struct Hint {
    md: usize,
    index: usize,
    coverage: Coverage,
}

impl Hint {
    /// `live::covers` of the hinted registration, for a descriptor carrying this MD.
    #[inline]
    fn covers(&self, kind: MemKind, d: &iud_desc) -> bool {
        self.md == d.md as usize && self.coverage.covers(kind, d)
    }
}

impl<'a> Registrations<'a> {
    fn new(registry: &'a Registry) -> Self {
        Registrations { registry, index: HashMap::new(), list: Vec::new(), hints: [Vec::new(), Vec::new()], victim: [0; 2], unhinted: 0 }
    }

    /// Index into `list` of the live registration of `kind` that covers `d`.
    #[inline]
    fn get(&mut self, side: usize, kind: MemKind, d: &iud_desc) -> std::result::Result<usize, Unresolved> {
        match self.hints[side].iter().find(|h| h.covers(kind, d)) {
            Some(h) => Ok(h.index),
            None => self.resolve(side, kind, d),
        }
    }

    /// `get` past the hints: the registry, then a hint for the MD.
    #[cold]
    fn resolve(&mut self, side: usize, kind: MemKind, d: &iud_desc) -> std::result::Result<usize, Unresolved> {
        let md = d.md as usize;
        let found = self.registry.resolve(kind, d)?;
        self.unhinted += usize::from(!found.by_hint);
        let list = &mut self.list;
        let i = *self.index.entry(Arc::as_ptr(&found.reg) as usize).or_insert_with(|| {
            list.push(found.reg);
            list.len() - 1
        });
        // A new MD takes a free hint, else the oldest one's place: a list naming more than
        // `HINTS` MDs in runs (one region after another) still finds each run's MD here.
        let hint = Hint { md, index: i, coverage: Coverage::of(&self.list[i]) };
        let hints = &mut self.hints[side];
        if let Some(h) = hints.iter_mut().find(|h| h.md == md) {
            *h = hint;
        } else if hints.len() < HINTS {
            hints.push(hint);
        } else {
            hints[self.victim[side]] = hint;
            self.victim[side] = (self.victim[side] + 1) % HINTS;
        }
        Ok(i)
    }
}

/// The distinct (memory, storage) registration pairs of a request in order of first use;
/// descriptors refer to them by position. Consecutive descriptors mostly share a pair, and a
/// request has few: the last one and a short scan serve almost every descriptor, a map the rest
/// (a client with a file per key).
#[derive(Default)]
struct Pairs {
    list: Vec<(usize, usize)>,
    map: HashMap<(usize, usize), u32>,
    last: u32,
}

impl Pairs {
    const SCAN: usize = 16;

    /// The pair's position; a new pair takes the next one (`list.len()` before the call).
    fn index(&mut self, pair: (usize, usize)) -> u32 {
        if self.list.get(self.last as usize) == Some(&pair) {
            return self.last;
        }
        let found = if self.list.len() <= Self::SCAN {
            self.list.iter().position(|&p| p == pair).map(|k| k as u32)
        } else {
            self.map.get(&pair).copied()
        };
        let k = found.unwrap_or_else(|| {
            self.list.push(pair);
            let k = (self.list.len() - 1) as u32;
            if self.list.len() > Self::SCAN {
                if self.map.is_empty() {
                    self.map.extend(self.list.iter().enumerate().map(|(j, &p)| (p, j as u32)));
                } else {
                    self.map.insert(pair, k);
                }
            }
            k
        });
        self.last = k;
        k
    }
}

/// The message for a descriptor that no live registration covers.
fn not_covered(i: usize, what: String, kind: MemKind, d: &iud_desc, why: Unresolved) -> Error {
    let mut m = format!("descriptor {i}: {what} is not covered by any live {} registration of this engine", kind.name());
    if let Some(other) = why.other_kind {
        m += &format!(" (a {} registration covers it: the list's memory type does not match)", other.name());
    } else if !d.md.is_null() && !why.md_live {
        m += &format!(" (its MD {:p} was deregistered, or NIXL handed back a stale MD)", d.md);
    }
    Error::not_found(m)
}

/// Limits and decisions the planner needs from the engine.
pub struct PlanContext<'a> {
    pub max_io_size: u64,
    /// Buffered I/Os of at least this many bytes go to io_uring's worker pool (0 = never).
    pub punt_buffered_min: u64,
    /// Piece size of the staging path, and how many staging buffers there are.
    pub staging_buffer_size: u64,
    pub staging_buffers: u32,
    /// The engine's page-cache worker threads (a request's punted reads are spread over them).
    pub page_cache_threads: usize,
    /// Largest staged piece of a page-cache WRITE (`staged_write_piece_max`).
    pub staged_write_piece_max: u64,
    /// Largest staged piece of a page-cache READ the workers read (`staged_read_piece_max`, 0 = none).
    pub staged_read_piece_max: u64,
    /// Chooses (once per pair, cached by the engine) how a memory registration reaches a target.
    pub route: &'a dyn Fn(&Registration, &FileRegion) -> Result<Route>,
    /// Op lists of released requests, reused (no page faults per request).
    pub lists: &'a OpLists,
}

/// Smallest staged piece worth cutting (below it, per-piece overhead outweighs parallelism).
const STAGED_PIECE_MIN: u64 = 256 << 10;

/// Piece size for staged VRAM: at most a staging buffer, but small enough that the request keeps
/// every staging buffer busy (an 8 MiB request in one 8 MiB piece would run one storage I/O and
/// one copy, one after the other), in 64 KiB multiples so O_DIRECT pieces stay aligned.
fn staged_piece(ctx: &PlanContext<'_>, request: u64) -> u64 {
    let share = (request / u64::from(ctx.staging_buffers.max(1))) & !((64 << 10) - 1);
    ctx.staging_buffer_size.min(share.max(STAGED_PIECE_MIN))
}

const WORKER_PIECE_MAX: u64 = 1 << 20;

/// Piece size for buffered reads handed to the page-cache workers: the request spread over all
/// of them (merging neighbours into max_io_size pieces would leave most idle: 128 x 64 KiB
/// became two 4 MiB reads), but never below `punt_buffered_min` (smaller ones are not punted).
fn worker_piece(ctx: &PlanContext<'_>, request: u64) -> u64 {
    // The workers and the posting thread, which runs queued reads too. At most 1 MiB: a piece
    // a worker holds while the scheduler keeps it off the CPU (a busy machine) is what the
    // request waits for at its end, so pieces stay short.
    let share = (request / (ctx.page_cache_threads as u64 + 1)).div_ceil(4096) * 4096;
    share.min(WORKER_PIECE_MAX).max(ctx.punt_buffered_min)
}

/// Validates the lists against the live registrations of `registry` and builds the request's
/// ops. The descriptors' MDs are only hints (`mem::live`).
pub fn plan(
    op_kind: XferOp,
    local_kind: i32,
    local: &[iud_desc],
    remote_kind: i32,
    remote: &[iud_desc],
    registry: &Registry,
    ctx: &PlanContext<'_>,
) -> Result<Plan> {
    let op = op_kind;
    let lk = MemKind::from_nixl(local_kind);
    let rk = MemKind::from_nixl(remote_kind);
    let (lk, rk, local, remote) = match (lk, rk) {
        (Some(l @ (MemKind::Dram | MemKind::Vram)), Some(r @ (MemKind::File | MemKind::Blk))) => (l, r, local, remote),
        // The storage side as the local list: NIXL's own storage backends (GDS, GDS_MT, HF3FS,
        // AIS) take either list as the file and read the op as the file's direction (READ: file
        // -> memory), and Dynamo's KVBM onboards disk blocks this way (local FILE, remote VRAM,
        // READ). The same op on swapped lists moves the same bytes the same way.
        (Some(s @ (MemKind::File | MemKind::Blk)), Some(m @ (MemKind::Dram | MemKind::Vram))) => (m, s, remote, local),
        _ => {
            return Err(Error::invalid(format!(
                "unsupported list types: local {} / remote {}; IO_URING_DMABUF moves DRAM_SEG or VRAM_SEG <-> FILE_SEG or BLK_SEG (either list may be the storage side; the op names the storage's direction: READ from it, WRITE to it)",
                lk.map_or("unknown", |k| k.name()),
                rk.map_or("unknown", |k| k.name())
            )))
        }
    };
    if local.len() != remote.len() {
        return Err(Error::new(
            ErrorKind::Mismatch,
            format!("local list has {} descriptors but remote list has {}", local.len(), remote.len()),
        ));
    }
    // The request's size sets the piece limits, so it is summed before the descriptors are cut.
    let total_bytes = local.iter().fold(0u64, |sum, l| sum.saturating_add(l.len));
    // A host request no larger than one worker job stays with the posting thread: one job
    // cannot be spread, and the hand-off would only add a wake-up.
    let spreadable = total_bytes > WORKER_JOB_BYTES;
    let max_piece = if ctx.max_io_size == 0 { MAX_FIXED_BUFFER } else { ctx.max_io_size.min(MAX_FIXED_BUFFER) };
    let limits = Limits {
        max_piece,
        staged: max_piece.min(staged_piece(ctx, total_bytes)),
        // Cut for the workers only what goes to them.
        worker: if ctx.punt_buffered_min > 0 && spreadable { max_piece.min(worker_piece(ctx, total_bytes)) } else { max_piece },
        punt_buffered_min: ctx.punt_buffered_min,
        staged_write: ctx.staged_write_piece_max,
        staged_read: ctx.staged_read_piece_max,
    };
    // One pass over the lists after the sum of the lengths above: with the caches cold, as
    // between a client's requests, reading them twice cost a fifth of the plan
    // (tests/prep_profile.rs, IUD_PREP_SWEEP_MIB). Each descriptor is validated against its
    // registrations, its (memory, target) pair bound to a path on first use (cached by the
    // engine: DMA-BUF registration and self-test, cuFile handles, the staging pool happen once
    // per pair), its O_DIRECT alignment checked on that path's addresses, and it is cut into
    // ops. A request refused at a later descriptor leaves only those per-pair bindings, which
    // the next request of the same pair would make anyway.
    let mut regs = Registrations::new(registry);
    let mut distinct = Pairs::default();
    let mut routes: Vec<Route> = Vec::new();
    let mut cufile_descs = 0usize;
    let mut ops = ctx.lists.take(local.len());
    let (mut all_buffered, mut all_host) = (true, true);
    let mut vram_outside_streams = false;
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        let pair = validate(i, op, lk, rk, l, r, &mut regs).map_err(|e| e.at_descriptor(i))?;
        let k = distinct.index(pair) as usize;
        let (m, f) = pair;
        let Registration::Storage(file) = &*regs.list[f] else { unreachable!("validated as storage") };
        if k == routes.len() {
            routes.push((ctx.route)(&regs.list[m], file).map_err(|e| e.at_descriptor(i).with_fd(file.fd))?);
        }
        let (mem, route) = (&*regs.list[m], &routes[k]);
        cufile_descs += usize::from(*route == Route::Cufile);
        check_alignment(i, l, r, mem, file, route).map_err(|e| e.at_descriptor(i).with_fd(file.fd).with_offset(r.addr))?;
        cut(i, op, l, r, mem, file, route, &limits, &mut ops).map_err(|e| e.at_descriptor(i))?;
        vram_outside_streams |= matches!(mem, Registration::Vram(_)) && *route != Route::Staging;
        all_buffered &= file.direct.is_none();
        // Inline pwrite needs real addresses: only memory addressed directly qualifies.
        all_host &= *route == Route::Host;
    }
    if regs.unhinted > 0 {
        tracing::debug!("prepXfer: {} of {} descriptor pairs carried an MD of no registration covering them (NIXL's lists in sync mode NONE); resolved by address", regs.unhinted, local.len());
    }
    if cufile_descs > 0 && cufile_descs < local.len() {
        return Err(Error::invalid(
            "descriptors of one request take different paths (cuFile for some, io_uring for others); split the request by memory region",
        ));
    }
    // Decided after merging, on the final sizes; punted ops run on the page-cache workers
    // (uring/workers.rs). Reads, and the writes of staged VRAM: their device copies overlap the
    // workers' writes, while DRAM writes are written by the calling threads (`inline_writes`).
    // Staged pieces of any size qualify: the small ones are packed several to a staging buffer
    // and reach the workers in groups (uring/ring.rs gathers small punted ops into one job).
    // Host requests go only when `spreadable`.
    let mut any_punt = false;
    for o in &mut ops {
        let kind_ok = op == XferOp::Read || o.device.is_some();
        let big_enough = (o.len as u64 >= ctx.punt_buffered_min && spreadable) || o.device.is_some();
        o.punt &= kind_ok && ctx.punt_buffered_min > 0 && big_enough;
        any_punt |= o.punt;
    }
    let write = op == XferOp::Write;
    // Reads meant for the page-cache workers are not served by the posting thread.
    Ok(Plan {
        op,
        ops: Arc::new(RequestOps { write, inline_writes: write && all_buffered && all_host, inline_reads: !write && all_buffered && all_host && !any_punt, page_cache: all_buffered, ops }),
        registrations: regs.list,
        local_count: local.len(),
        remote_count: remote.len(),
        total_bytes,
        cufile: cufile_descs > 0,
        vram_outside_streams,
    })
}

/// Checks one descriptor pair: equal non-zero lengths, live registrations of the lists' kinds
/// that cover it, the file's access mode. Returns (memory, storage) indices into `regs`.
fn validate(i: usize, op: XferOp, lk: MemKind, rk: MemKind, l: &iud_desc, r: &iud_desc, regs: &mut Registrations<'_>) -> Result<(usize, usize)> {
    if l.len != r.len {
        return Err(Error::new(ErrorKind::Mismatch, format!("descriptor {i}: local length {} differs from remote length {}", l.len, r.len)));
    }
    if l.len == 0 {
        return Err(Error::invalid(format!("descriptor {i}: zero length")));
    }
    let mi = regs
        .get(0, lk, l)
        .map_err(|why| not_covered(i, format!("local memory devId {} [0x{:x}, +{})", l.dev_id, l.addr, l.len), lk, l, why))?;
    let fi = regs
        .get(1, rk, r)
        .map_err(|why| not_covered(i, format!("file range devId {} [{}, +{})", r.dev_id, r.addr, r.len), rk, r, why))?;
    let Registration::Storage(file) = &*regs.list[fi] else { unreachable!("resolved as {}", rk.name()) };
    match op {
        XferOp::Write if !file.writable => return Err(Error::invalid(format!("descriptor {i}: WRITE to fd {} which is open read-only", file.fd)).with_fd(file.fd)),
        XferOp::Read if !file.readable => return Err(Error::invalid(format!("descriptor {i}: READ from fd {} which is open write-only", file.fd)).with_fd(file.fd)),
        _ => {}
    }
    Ok((mi, fi))
}

/// O_DIRECT needs offset, length and memory aligned; the memory address is the one the path
/// hands to storage (an offset into the DMA-BUF; staged VRAM goes through page-aligned buffers).
fn check_alignment(i: usize, l: &iud_desc, r: &iud_desc, mem: &Registration, file: &FileRegion, route: &Route) -> Result<()> {
    let Some(a) = file.direct else { return Ok(()) };
    let mem_addr = match (route, dmabuf::slabs_of(mem)) {
        (Route::Dmabuf { .. }, Some(slabs)) => dmabuf::aligned_address(slabs, l.addr),
        (Route::Staging, _) => 0,
        _ => l.addr,
    };
    if r.addr % a.offset != 0 || r.len % a.offset != 0 || mem_addr % a.mem != 0 {
        return Err(Error::invalid(format!(
            "descriptor {i}: O_DIRECT on fd {} needs offset and length multiples of {} and memory aligned to {}; got offset {}, length {}, memory 0x{:x}",
            file.fd, a.offset, a.mem, r.addr, r.len, l.addr
        )));
    }
    Ok(())
}

/// Piece-size limits of one request.
struct Limits {
    max_piece: u64,
    staged: u64,
    worker: u64,
    punt_buffered_min: u64,
    staged_write: u64,
    staged_read: u64,
}

/// Cuts one descriptor into ops that fit the limits and never straddle a fixed-buffer slot or a
/// slab, merging pieces that continue each other.
#[allow(clippy::too_many_arguments)]
fn cut(i: usize, op: XferOp, l: &iud_desc, r: &iud_desc, mem: &Registration, file: &FileRegion, route: &Route, lim: &Limits, ops: &mut Vec<IoOp>) -> Result<()> {
    let staged = *route == Route::Staging;
    let mut limit = if staged { lim.staged } else { lim.max_piece };
    if staged && op == XferOp::Write && file.direct.is_none() {
        limit = limit.min(lim.staged_write);
    }
    if staged && op == XferOp::Read && file.direct.is_none() && lim.punt_buffered_min > 0 && lim.staged_read > 0 {
        // Worker-sized pieces share a buffer and are read by several workers at once: the
        // buffer's copy to the GPU starts after one piece's read, not one buffer's.
        limit = limit.min(lim.staged_read);
    }
    if !staged && op == XferOp::Read && file.direct.is_none() && lim.punt_buffered_min > 0 {
        // Page-cache reads go to the workers: cut so that every worker gets a share.
        limit = lim.worker;
    }
    if let Some(dev_max) = file.max_direct_io {
        // One device request per I/O keeps O_DIRECT on io_uring's non-blocking path.
        limit = limit.min(dev_max);
    }
    let outside = |what: &str, addr: u64| Error::not_found(format!("descriptor {i}: {what}address 0x{addr:x} is outside the registration's slabs"));
    let mut done = 0u64;
    while done < l.len {
        let addr = l.addr + done;
        let mut piece = (l.len - done).min(limit);
        let (mem_addr, buf_index, device, end) = match (mem, route) {
            (Registration::Dram(dram), Route::Host) => {
                let (a, slot, end) = direct::address(dram, addr);
                (a, slot, None, end)
            }
            (_, Route::Dmabuf { slots }) => {
                let slabs = dmabuf::slabs_of(mem).ok_or_else(|| outside("", addr))?;
                let (a, slot, end) = dmabuf::address(slabs, slots, addr).ok_or_else(|| outside("", addr))?;
                (a, Some(slot), None, Some(end))
            }
            // Both move VRAM by its address; pieces still stop at slab ends.
            (Registration::Vram(vram), Route::Staging | Route::Cufile) => {
                let (a, device, end) = staging::address(vram, addr).ok_or_else(|| outside("VRAM ", addr))?;
                (a, None, Some(device), Some(end))
            }
            _ => return Err(Error::backend(format!("descriptor {i}: no way to address this memory for the chosen route {route:?}"))),
        };
        if let Some(end) = end {
            piece = piece.min(end - addr);
        }
        push_coalesced(
            ops,
            IoOp {
                file: file.file_ref(),
                fd: file.fd,
                io_fd: file.io_fd,
                file_offset: r.addr + done,
                addr: mem_addr,
                len: piece as u32,
                buf_index,
                device,
                // Marks buffered I/O for now; the size rule is applied after merging.
                punt: file.direct.is_none(),
                desc_index: i as u32,
            },
            limit,
        );
        done += piece;
    }
    Ok(())
}

/// Appends `op`, or extends the previous op when `op` continues it in both memory and file (same
/// file, same fixed-buffer slot) and the result stays within `max_piece`. Applications often
/// describe one contiguous run as many small blocks (KV-cache pages); one larger I/O moves the
/// same bytes with one SQE and one completion.
fn push_coalesced(ops: &mut Vec<IoOp>, op: IoOp, max_piece: u64) {
    if let Some(last) = ops.last_mut() {
        let continues = last.file == op.file
            && last.buf_index == op.buf_index
            && last.device == op.device
            && last.file_offset + last.len as u64 == op.file_offset
            && last.addr + last.len as u64 == op.addr
            && last.len as u64 + op.len as u64 <= max_piece;
        if continues {
            last.len += op.len;
            return;
        }
    }
    ops.push(op);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uring::FileRef;

    fn op(file_offset: u64, addr: u64, len: u32, buf_index: Option<u16>) -> IoOp {
        IoOp { file: FileRef::Fixed(0), fd: 5, io_fd: 5, file_offset, addr, len, buf_index, device: None, punt: false, desc_index: 0 }
    }

    #[test]
    fn registrations_resolve_every_descriptor_to_its_region_with_more_regions_than_hints() {
        let workers = crate::uring::WorkerConfig { threads: 0, writers: crate::uring::WriterLimits::default(), spin_us: 0 };
        let ring = Arc::new(crate::uring::Ring::new(8, false, workers, Arc::default()).expect("ring"));
        let registry = Registry::default();
        // 12 regions (more than HINTS) of 64 KiB, 1 MiB apart.
        let mds: Vec<*const std::ffi::c_void> = (0..12u64)
            .map(|k| {
                // SAFETY: without fixed buffers the region only records the range; nothing touches it.
                let (r, _) = unsafe { crate::mem::DramRegion::register(Arc::clone(&ring), 0x100_0000 + (k << 20), 0x1_0000, 0, false) };
                registry.insert(Registration::Dram(r))
            })
            .collect();
        let mut regs = Registrations::new(&registry);
        let desc = |k: u64, j: u64, md: *const std::ffi::c_void| iud_desc { addr: 0x100_0000 + (k << 20) + j * 0x1000, len: 0x1000, dev_id: 0, md: md as *mut _ };
        // Runs (region after region), then interleaved, then stale MDs (another region's).
        let order: Vec<(u64, u64)> = (0..12).flat_map(|k| (0..4).map(move |j| (k, j)))
            .chain((0..48).map(|i| (i % 12, i % 16)))
            .collect();
        for (pass, &(k, j)) in order.iter().enumerate() {
            for md in [mds[k as usize], mds[(k as usize + 5) % 12]] {
                let i = regs.get(0, MemKind::Dram, &desc(k, j, md)).unwrap_or_else(|_| panic!("descriptor {pass} unresolved"));
                assert_eq!(regs.list[i].range().0, 0x100_0000 + (k << 20), "descriptor {pass} (region {k}) resolved elsewhere");
            }
        }
        assert_eq!(regs.list.len(), 12);
        assert!(regs.hints[0].len() <= HINTS);
        // A range no region covers is refused, whatever the hints hold.
        assert!(regs.get(0, MemKind::Dram, &desc(3, 16, mds[3])).is_err());
    }

    #[test]
    fn pairs_keep_their_positions_past_the_scan() {
        let mut p = Pairs::default();
        // 40 distinct pairs in a scattered order, each seen again later: positions never move,
        // whether found by the last-hit check, the scan or (past 16 pairs) the map, and a new
        // pair takes the next position (the planner binds its route then).
        let order: Vec<usize> = (0..200).map(|i| (i * 7 + i / 13) % 40).collect();
        let mut seen: Vec<Option<u32>> = vec![None; 40];
        for &x in &order {
            let before = p.list.len();
            let k = p.index((x, 1000 + x));
            match seen[x] {
                Some(was) => assert_eq!(was, k, "pair {x} moved"),
                None => {
                    assert_eq!(k as usize, before, "a new pair takes the next position");
                    assert_eq!(p.list[k as usize], (x, 1000 + x), "first use of pair {x}");
                    seen[x] = Some(k);
                }
            }
        }
        assert_eq!(p.list.len(), 40);
        let mut ks: Vec<u32> = seen.iter().map(|k| k.unwrap()).collect();
        ks.sort_unstable();
        assert_eq!(ks, (0..40).collect::<Vec<u32>>());
    }

    #[test]
    fn neighbours_in_memory_and_file_merge_up_to_the_limit() {
        let mut ops = Vec::new();
        for i in 0..4u64 {
            push_coalesced(&mut ops, op(i * 4096, 0x10000 + i * 4096, 4096, Some(1)), 8192);
        }
        assert_eq!(ops.len(), 2);
        assert_eq!((ops[0].len, ops[1].file_offset, ops[1].len), (8192, 8192, 8192));
    }

    #[test]
    fn gaps_other_slots_and_other_files_do_not_merge() {
        let mut ops = vec![op(0, 0x1000, 512, Some(1))];
        push_coalesced(&mut ops, op(1024, 0x1200, 512, Some(1)), 1 << 20); // file gap
        push_coalesced(&mut ops, op(1536, 0x2000, 512, Some(1)), 1 << 20); // memory gap
        push_coalesced(&mut ops, op(2048, 0x2200, 512, Some(2)), 1 << 20); // other slot
        let mut other = op(2560, 0x2400, 512, Some(2));
        other.file = FileRef::Fixed(1);
        push_coalesced(&mut ops, other, 1 << 20); // other file
        assert_eq!(ops.len(), 5);
    }
}
