//! Cutting: one validated descriptor pair, bound to its route, checked for O_DIRECT alignment on
//! the addresses that route hands to storage and cut into ring ops at the request's piece limits,
//! slot and slab ends, neighbours that continue each other in memory and file merged.

use super::direction::XferOp;
use crate::error::{Error, Result};
use crate::ffi::bridge::iud_desc;
use crate::mem::{FileRegion, Registration};
use crate::path::{direct, dmabuf, staging, Route};
use crate::uring::IoOp;

/// Piece-size limits of one request.
pub struct Limits {
    pub max_piece: u64,
    pub staged: u64,
    pub worker: u64,
    pub punt_buffered_min: u64,
    pub staged_write: u64,
    pub staged_read: u64,
    /// The request is larger than one worker job (host requests are punted only then).
    pub spreadable: bool,
}

/// One validated descriptor pair (descriptor `i` of the request): its two descriptors, the
/// registrations that cover them and the route of their pair.
#[derive(Clone, Copy)]
pub struct Bound<'a> {
    pub i: usize,
    pub l: &'a iud_desc,
    pub r: &'a iud_desc,
    pub mem: &'a Registration,
    pub file: &'a FileRegion,
    pub route: &'a Route,
}

impl Bound<'_> {
    /// O_DIRECT needs offset, length and memory aligned; the memory address is the one the path
    /// hands to storage (an offset into the DMA-BUF; staged VRAM goes through page-aligned
    /// buffers).
    pub fn check_alignment(&self) -> Result<()> {
        let Bound {
            i,
            l,
            r,
            mem,
            file,
            route,
        } = *self;
        let Some(a) = file.direct else { return Ok(()) };
        let mem_addr = match (route, dmabuf::slabs_of(mem)) {
            (Route::Dmabuf { .. }, Some(slabs)) => dmabuf::aligned_address(slabs, l.addr),
            (Route::Staging, _) => 0,
            _ => l.addr,
        };
        if r.addr % a.offset != 0 || r.len % a.offset != 0 || mem_addr % a.mem != 0 {
            return Err(Error::invalid(format!(
                "descriptor {i}: O_DIRECT on fd {} needs offset and length multiples of {} and \
                 memory aligned to {}; got offset {}, length {}, memory 0x{:x}",
                file.fd, a.offset, a.mem, r.addr, r.len, l.addr
            )));
        }
        Ok(())
    }

    /// Cuts one descriptor into ops that fit the limits and never straddle a fixed-buffer slot or a
    /// slab, merging pieces that continue each other.
    pub fn cut(&self, op: XferOp, lim: &Limits, ops: &mut Vec<IoOp>) -> Result<()> {
        let Bound {
            i,
            l,
            r,
            mem,
            file,
            route,
        } = *self;
        let staged = *route == Route::Staging;
        let mut limit = if staged { lim.staged } else { lim.max_piece };
        if staged && op == XferOp::Write && file.direct.is_none() {
            limit = limit.min(lim.staged_write);
        }
        if staged
            && op == XferOp::Read
            && file.direct.is_none()
            && lim.punt_buffered_min > 0
            && lim.staged_read > 0
        {
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
        let outside = |what: &str, addr: u64| {
            Error::not_found(format!(
                "descriptor {i}: {what}address 0x{addr:x} is outside the registration's slabs"
            ))
        };
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
                    let (a, slot, end) =
                        dmabuf::address(slabs, slots, addr).ok_or_else(|| outside("", addr))?;
                    (a, Some(slot), None, Some(end))
                }
                // Both move VRAM by its address; pieces still stop at slab ends.
                (Registration::Vram(vram), Route::Staging | Route::Cufile) => {
                    let (a, device, end) =
                        staging::address(vram, addr).ok_or_else(|| outside("VRAM ", addr))?;
                    (a, None, Some(device), Some(end))
                }
                _ => {
                    return Err(Error::backend(format!(
                    "descriptor {i}: no way to address this memory for the chosen route {route:?}"
                )))
                }
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
        IoOp {
            file: FileRef::Fixed(0),
            fd: 5,
            io_fd: 5,
            file_offset,
            addr,
            len,
            buf_index,
            device: None,
            punt: false,
            desc_index: 0,
        }
    }
    #[test]
    fn neighbours_in_memory_and_file_merge_up_to_the_limit() {
        let mut ops = Vec::new();
        for i in 0..4u64 {
            push_coalesced(
                &mut ops,
                op(i * 4096, 0x10000 + i * 4096, 4096, Some(1)),
                8192,
            );
        }
        assert_eq!(ops.len(), 2);
        assert_eq!(
            (ops[0].len, ops[1].file_offset, ops[1].len),
            (8192, 8192, 8192)
        );
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
