//! The staging path: pinned host buffers, registered as io_uring fixed buffers, through which
//! VRAM moves when it cannot be addressed by storage I/O directly, and the device copies that
//! fill and drain them.
//!
//! READ: storage -> buffer (io_uring) then buffer -> GPU (async copy). WRITE: GPU -> buffer
//! (async copy) then buffer -> storage (io_uring). With several buffers the copy of one piece
//! overlaps the storage I/O of others. The pool is created on first VRAM use. Small pieces
//! (KV-cache blocks) are packed several to a buffer (a group), each with its own file offset and
//! device address: their device copy is one batched call, and the storage I/O of pieces that
//! follow each other in the file and in the buffer is one I/O (a run): a KV block whose pages
//! sit at scattered VRAM addresses but end to end in its file (the vLLM connector's slots) is
//! read or written in a few large I/Os, not one per page.

use crate::error::Result;
use crate::gpu::{CopyPiece, CopyTicket, PackedCopy};
use crate::mem::VramRegion;
use crate::params::EngineParams;
use crate::uring::{IoOp, WORKER_JOB_BYTES};

mod pool;

pub use pool::{StagingBuf, StagingPool};

/// The staging pool's shape (backend parameters `staging_buffer_size`, `staging_buffers`,
/// `staging_pack_max`).
#[derive(Debug, Clone, Copy)]
pub struct StagingShape {
    pub buffer_size: u64,
    pub buffers: u32,
    /// Pieces up to this size are packed several to a buffer (KV-cache blocks at scattered VRAM
    /// addresses and file offsets): one batched device copy per buffer instead of one copy call
    /// each, whose few microseconds dominate at 16-64 KiB. Larger pieces keep a buffer each.
    pub pack_max: u64,
    /// How a packed buffer reaches the GPU (`staging_copy`).
    pub packed_copy: PackedCopy,
    /// Bytes of buffers that page-cache WRITEs may fill at once (`staged_write_window`, 0 = no
    /// limit): a small working set stays in the CPU's cache between the device's copy into a
    /// buffer and the file system's copy out of it.
    pub write_window: u64,
    /// Largest storage I/O a run of pieces may become (`max_io_size`, 0 = no limit).
    pub max_io_size: u64,
    /// Device streams the buffers' scatter kernels take in turn (`staging_kernel_streams`).
    pub kernel_streams: u32,
}

impl StagingShape {
    /// The shape the backend parameters ask for.
    pub fn from_params(p: &EngineParams) -> StagingShape {
        StagingShape {
            buffer_size: p.staging_buffer_size,
            buffers: p.staging_buffers,
            pack_max: p.staging_pack_max,
            packed_copy: p.staging_copy,
            write_window: p.staged_write_window,
            max_io_size: p.max_io_size,
            kernel_streams: p.staging_kernel_streams,
        }
    }
}

/// Most pieces in one buffer (one batched copy call).
const PACK_PIECES_MAX: usize = 256;
/// Packed pieces start on this alignment in the buffer (O_DIRECT memory alignment).
const PACK_ALIGN: u64 = 4096;

/// One storage I/O on a staging buffer: `count` pieces of a group (a staging buffer and the
/// pieces packed into it) from index `piece` on, end to end in the file and in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub group: usize,
    pub piece: u32,
    pub count: u32,
}

impl Stage {
    /// The stage's pieces, one stage each.
    pub fn pieces(self) -> impl Iterator<Item = Stage> {
        (self.piece..self.piece + self.count).map(move |piece| Stage {
            group: self.group,
            piece,
            count: 1,
        })
    }
}

/// The pieces of one staging buffer and how far their storage I/O got.
struct Group {
    owner: usize,
    buf: usize,
    write: bool,
    /// The ops as planned, on device memory, and where each sits in the buffer.
    pieces: Vec<(IoOp, u64)>,
    used: u64,
    /// Counted against the write window (a page-cache WRITE).
    windowed: bool,
    /// Pieces whose storage I/O has not ended.
    io_left: usize,
    /// Pieces whose storage I/O completed (READ: they wait for the group's copy).
    io_ok: usize,
}

/// How a group's storage I/O ended, once every piece's did.
#[derive(Debug, PartialEq, Eq)]
pub struct IoEnd {
    pub group: usize,
    /// Pieces that completed.
    pub ok: usize,
    /// Pieces that did not.
    pub failed: usize,
}

/// A group's device copy ended (or failed to run).
pub struct CopyDone {
    /// The caller's token (its request).
    pub owner: usize,
    pub group: usize,
    pub pieces: usize,
    pub result: Result<()>,
    /// Device -> host copy of a WRITE: the storage writes follow.
    pub then_write: bool,
    /// When the copy was started (for the profile).
    pub started: std::time::Instant,
}

struct PendingCopy {
    group: usize,
    ticket: Box<dyn CopyTicket>,
    started: std::time::Instant,
}

/// The pool, the groups using its buffers, and the device copies in flight on it. Copies are
/// polled, never waited for, on the data path.
pub struct Staging {
    pool: StagingPool,
    pack_max: u64,
    packed_copy: PackedCopy,
    groups: slab::Slab<Group>,
    copies: Vec<PendingCopy>,
    write_window: u64,
    /// Bytes the windowed groups fill now.
    window_used: u64,
    /// Largest storage I/O of a run (`max_io_size`, or no limit).
    max_io_size: u64,
    /// Streams the scatter kernels take in turn (`staging_kernel_streams`).
    kernel_streams: usize,
    /// The lane of the next buffer's copy (used by scatter kernels only).
    next_lane: usize,
}

impl Staging {
    pub fn new(pool: StagingPool, shape: StagingShape) -> Staging {
        let max_io_size = if shape.max_io_size == 0 {
            u64::from(u32::MAX)
        } else {
            shape.max_io_size
        };
        Staging {
            pool,
            pack_max: shape.pack_max,
            packed_copy: shape.packed_copy,
            groups: slab::Slab::new(),
            copies: Vec::new(),
            write_window: shape.write_window,
            window_used: 0,
            max_io_size,
            kernel_streams: shape.kernel_streams.max(1) as usize,
            next_lane: 0,
        }
    }

    /// Whether a page-cache WRITE may open a group for a piece of `len` bytes now: the window
    /// has room, or nothing fills it (a piece larger than the window still goes, alone).
    pub fn window_admits(&self, len: u32) -> bool {
        self.write_window == 0
            || self.window_used == 0
            || self.window_used + u64::from(len) <= self.write_window
    }

    /// A buffer for `first`, the group's first piece, or None while all are busy. `windowed`:
    /// a page-cache WRITE, counted against the write window.
    pub fn open(
        &mut self,
        owner: usize,
        write: bool,
        first: IoOp,
        windowed: bool,
    ) -> Option<usize> {
        let buf = self.pool.take()?;
        let windowed = windowed && self.write_window > 0;
        let g = self.groups.insert(Group {
            owner,
            buf,
            write,
            pieces: Vec::new(),
            used: 0,
            windowed,
            io_left: 0,
            io_ok: 0,
        });
        let added = self.try_add(g, first);
        debug_assert!(added, "a planned staged piece fits an empty buffer");
        Some(g)
    }

    /// Packs `op` into the group if both are small and it fits; false otherwise.
    pub fn try_add(&mut self, g: usize, op: IoOp) -> bool {
        let (size, pack_max) = (self.pool.buffer_size, self.pack_max);
        let grp = &mut self.groups[g];
        let at = grp.used.div_ceil(PACK_ALIGN) * PACK_ALIGN;
        let end = at + u64::from(op.len);
        if let Some((first, _)) = grp.pieces.first() {
            let small = |o: &IoOp| u64::from(o.len) <= pack_max;
            let window_full =
                grp.windowed && self.window_used + (end - grp.used) > self.write_window;
            if !small(first)
                || !small(&op)
                || first.device != op.device
                || grp.pieces.len() >= PACK_PIECES_MAX
                || end > size
                || window_full
            {
                return false;
            }
        } else if u64::from(op.len) > size {
            return false;
        }
        if grp.windowed {
            self.window_used += end - grp.used;
        }
        grp.pieces.push((op, at));
        grp.used = end;
        grp.io_left += 1;
        true
    }

    /// The request a group belongs to.
    pub fn owner(&self, g: usize) -> usize {
        self.groups[g].owner
    }

    pub fn pieces(&self, g: usize) -> usize {
        self.groups[g].pieces.len()
    }

    /// The group's storage I/O from piece `piece` on: that piece and the ones after it that
    /// continue it in the file and in the buffer, up to `max_io_size`. Buffered reads stop at
    /// one page-cache worker job (`WORKER_JOB_BYTES`), so a request's reads still spread over
    /// every worker; writes to one file take turns on its inode lock anyway, and O_DIRECT gains
    /// from every merge.
    pub fn run_at(&self, group: usize, piece: u32) -> Stage {
        let grp = &self.groups[group];
        let (first, _) = grp.pieces[piece as usize];
        let cap = if first.punt && !grp.write {
            self.max_io_size.min(WORKER_JOB_BYTES)
        } else {
            self.max_io_size
        };
        let mut len = u64::from(first.len);
        let mut count = 1;
        for w in grp.pieces[piece as usize..].windows(2) {
            let ((a, a_at), (b, b_at)) = (w[0], w[1]);
            let continues = b.file == a.file
                && b.io_fd == a.io_fd
                && b.punt == a.punt
                && b.file_offset == a.file_offset + u64::from(a.len)
                && b_at == a_at + u64::from(a.len);
            if !continues || len + u64::from(b.len) > cap {
                break;
            }
            len += u64::from(b.len);
            count += 1;
        }
        Stage {
            group,
            piece,
            count,
        }
    }

    /// The group's runs, in order (see `run_at`).
    pub fn runs(&self, group: usize) -> Vec<Stage> {
        let n = self.groups[group].pieces.len() as u32;
        let mut runs = Vec::new();
        let mut piece = 0;
        while piece < n {
            let run = self.run_at(group, piece);
            piece += run.count;
            runs.push(run);
        }
        runs
    }

    /// The storage I/O of a stage: its pieces' file range on their place in the buffer.
    pub fn host_op(&self, s: Stage) -> IoOp {
        let grp = &self.groups[s.group];
        let run = &grp.pieces[s.piece as usize..(s.piece + s.count) as usize];
        let (op, at) = run[0];
        let len: u64 = run.iter().map(|(o, _)| u64::from(o.len)).sum();
        let host = &self.pool.bufs[grp.buf];
        IoOp {
            len: len as u32,
            ..op.on_host(host.addr + at, host.buf_index)
        }
    }

    /// How many of the stage's leading pieces lie wholly within its first `done` bytes.
    pub fn pieces_within(&self, s: Stage, done: u64) -> u32 {
        let grp = &self.groups[s.group];
        let mut end = 0;
        let run = &grp.pieces[s.piece as usize..(s.piece + s.count) as usize];
        run.iter()
            .take_while(|(o, _)| {
                end += u64::from(o.len);
                end <= done
            })
            .count() as u32
    }

    /// A stage's storage I/O ended; `Some` when it was the group's last.
    pub fn io_over(&mut self, s: Stage, ok: bool) -> Option<IoEnd> {
        let grp = &mut self.groups[s.group];
        let n = s.count as usize;
        grp.io_left -= n;
        grp.io_ok += if ok { n } else { 0 };
        (grp.io_left == 0).then(|| IoEnd {
            group: s.group,
            ok: grp.io_ok,
            failed: grp.pieces.len() - grp.io_ok,
        })
    }

    /// Starts the group's device copy: device -> buffer for a WRITE (the storage writes follow),
    /// buffer -> device for a READ whose storage reads all landed. One batched call per buffer.
    pub fn start_copy(&mut self, g: usize) -> Result<()> {
        let grp = &self.groups[g];
        let host = self.pool.bufs[grp.buf].addr;
        let pieces = copy_pieces(grp.pieces.iter().map(|(op, at)| CopyPiece {
            dev: op.addr,
            host: host + at,
            len: u64::from(op.len),
        }));
        let device = grp.pieces[0].0.device.unwrap_or(0);
        let lane = self.next_lane;
        self.next_lane = (lane + 1) % self.kernel_streams;
        let provider = &self.pool.provider;
        // SAFETY: the staging buffer is the group's until `close`; the device ranges are
        // registered VRAM kept alive by the request's plan.
        let ticket = unsafe {
            match pieces.as_slice() {
                [one] if grp.write => provider.copy_to_host(device, one.host, one.dev, one.len),
                [one] => provider.copy_to_device(device, one.dev, one.host, one.len),
                _ => provider.copy_batch(device, &pieces, grp.write, self.packed_copy, lane),
            }
        }?;
        if grp.write {
            self.groups[g].io_left = self.groups[g].pieces.len();
        }
        self.copies.push(PendingCopy {
            group: g,
            ticket,
            started: std::time::Instant::now(),
        });
        Ok(())
    }

    /// Frees the group's buffer.
    pub fn close(&mut self, g: usize) {
        if let Some(grp) = self.groups.try_remove(g) {
            if grp.windowed {
                self.window_used -= grp.used;
            }
            self.pool.put(grp.buf);
        }
    }

    /// Moves the copies that ended into `out`; returns how many did.
    pub fn poll(&mut self, out: &mut Vec<CopyDone>) -> usize {
        let mut done = 0;
        let mut i = 0;
        while i < self.copies.len() {
            let finished = self.copies[i].ticket.is_done();
            if let Ok(false) = finished {
                i += 1;
                continue;
            }
            let c = self.copies.swap_remove(i);
            done += 1;
            let grp = &self.groups[c.group];
            out.push(CopyDone {
                owner: grp.owner,
                group: c.group,
                pieces: grp.pieces.len(),
                result: finished.map(drop),
                then_write: grp.write,
                started: c.started,
            });
        }
        done
    }

    /// Whether some buffer is in use (filling, copying or draining).
    pub fn in_use(&self) -> bool {
        !self.groups.is_empty()
    }

    /// Whether device copies are in flight.
    pub fn copying(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Blocks until the oldest copy ended (when nothing else can make progress).
    pub fn wait_oldest(&self) {
        if let Some(c) = self.copies.first() {
            if let Err(e) = c.ticket.wait() {
                tracing::error!("waiting for a device copy: {e}");
            }
        }
    }

    /// Blocks until every copy ended (teardown: the buffers may be unmapped afterwards).
    pub fn wait_all(&mut self) {
        for c in self.copies.drain(..) {
            if let Err(e) = c.ticket.wait() {
                tracing::error!("waiting for a device copy at teardown: {e}");
            }
        }
    }
}

/// Where a staged piece starting at `addr` must end: VRAM moves by address, but pieces stop at
/// the registration's slab ends. Returns (memory address, device, end).
pub fn address(vram: &VramRegion, addr: u64) -> Option<(u64, i32, u64)> {
    let (_, slab_end) = vram.dmabuf.slab_at(addr)?;
    Some((addr, vram.device, slab_end))
}

/// A group's device copies, neighbours that continue each other in VRAM and in the buffer
/// merged: a run of a contiguous descriptor cut into worker-sized pieces is one plain copy.
fn copy_pieces(pieces: impl Iterator<Item = CopyPiece>) -> Vec<CopyPiece> {
    let mut out: Vec<CopyPiece> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some(last) if last.dev + last.len == p.dev && last.host + last.len == p.host => {
                last.len += p.len
            }
            _ => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests;
