//! One storage I/O as the ring sees it: a contiguous piece of one transfer descriptor.
//!
//! Ops are described once (at prepXfer) and turned into SQEs only when the ring has room
//! ("describe, then fill"), so a request of any size never needs more SQ entries than exist.

use std::io;

use io_uring::{opcode, squeue, types};

use crate::error::Error;

/// Outcome of a post or check that did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    InFlight,
    Done,
}

/// How the target file is named in the SQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileRef {
    /// Index into the ring's registered-file table.
    Fixed(u32),
    /// A plain file descriptor.
    Raw(i32),
}

/// One read or write between a memory address and a file offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoOp {
    pub file: FileRef,
    /// The caller-visible fd (or path-mode devId's fd), for error messages only.
    pub fd: i32,
    /// The fd every raw system call uses: the registration's own duplicate of the caller's fd
    /// (`FileRegion::io_fd`), so a caller closing or reusing its number cannot redirect I/O.
    pub io_fd: i32,
    pub file_offset: u64,
    pub addr: u64,
    pub len: u32,
    /// Fixed-buffer slot that covers `addr..addr+len`, if the memory is registered (for a
    /// DMA-BUF slot, `addr` is the byte offset into the DMA-BUF).
    pub buf_index: Option<u16>,
    /// Set when `addr` is GPU memory of this device that moves through the staging pool.
    pub device: Option<i32>,
    /// Page-cache I/O to run on the ring's page-cache workers (uring/workers.rs) instead of in
    /// the submitting thread, so large copies of one request use several cores; when the
    /// workers cannot start, the SQE carries IOSQE_ASYNC (io_uring's own workers) instead.
    pub punt: bool,
    /// Index of the transfer descriptor this op belongs to, for error messages.
    pub desc_index: u32,
}

impl IoOp {
    /// The op that finishes this one after `done` bytes were transferred.
    pub fn remainder(&self, done: u32) -> IoOp {
        debug_assert!(done < self.len);
        IoOp {
            file_offset: self.file_offset + done as u64,
            addr: self.addr + done as u64,
            len: self.len - done,
            ..*self
        }
    }

    /// This op's descriptor, fd and offset on an error about it.
    pub fn annotate(&self, e: Error) -> Error {
        e.at_descriptor(self.desc_index as usize)
            .with_fd(self.fd)
            .with_offset(self.file_offset)
    }

    /// The error for an I/O that failed with `errno`.
    pub fn failed(&self, write: bool, errno: i32) -> Error {
        let e = Error::os(
            format!(
                "{} fd {} offset {} length {} (descriptor {}, memory 0x{:x})",
                if write { "write to" } else { "read from" },
                self.fd,
                self.file_offset,
                self.len,
                self.desc_index,
                self.addr
            ),
            &io::Error::from_raw_os_error(errno),
        );
        self.annotate(e)
    }

    /// The error for an I/O that transferred 0 bytes: end of file for reads.
    pub fn made_no_progress(&self, write: bool) -> Error {
        let e = if write {
            Error::backend(format!(
                "write to fd {} at offset {} ({} bytes left, descriptor {}) made no progress (0 \
                 bytes written)",
                self.fd, self.file_offset, self.len, self.desc_index
            ))
        } else {
            Error::backend(format!(
                "read past end of file: fd {} offset {} length {} (descriptor {}) — the file is \
                 shorter than the descriptor",
                self.fd, self.file_offset, self.len, self.desc_index
            ))
        };
        self.annotate(e)
    }

    /// The same storage I/O aimed at host memory `addr` in fixed-buffer slot `buf_index`
    /// (a staging buffer) instead of this op's device memory.
    pub fn on_host(&self, addr: u64, buf_index: Option<u16>) -> IoOp {
        IoOp {
            addr,
            buf_index,
            device: None,
            ..*self
        }
    }

    /// Builds the SQE. Building is safe; pushing it is where the kernel starts using `addr`.
    pub fn to_sqe(&self, write: bool, user_data: u64) -> squeue::Entry {
        macro_rules! build {
            ($fd:expr) => {
                match (write, self.buf_index) {
                    (false, Some(idx)) => {
                        opcode::ReadFixed::new($fd, self.addr as *mut u8, self.len, idx)
                            .offset(self.file_offset)
                            .build()
                    }
                    (true, Some(idx)) => {
                        opcode::WriteFixed::new($fd, self.addr as *const u8, self.len, idx)
                            .offset(self.file_offset)
                            .build()
                    }
                    (false, None) => opcode::Read::new($fd, self.addr as *mut u8, self.len)
                        .offset(self.file_offset)
                        .build(),
                    (true, None) => opcode::Write::new($fd, self.addr as *const u8, self.len)
                        .offset(self.file_offset)
                        .build(),
                }
            };
        }
        let entry = match self.file {
            FileRef::Fixed(slot) => build!(types::Fixed(slot)),
            FileRef::Raw(fd) => build!(types::Fd(fd)),
        };
        let entry = entry.user_data(user_data);
        if self.punt {
            entry.flags(squeue::Flags::ASYNC)
        } else {
            entry
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remainder_continues_where_the_short_io_stopped() {
        let op = IoOp {
            file: FileRef::Raw(3),
            fd: 3,
            io_fd: 3,
            file_offset: 4096,
            addr: 0x1000,
            len: 8192,
            buf_index: Some(2),
            device: None,
            punt: false,
            desc_index: 5,
        };
        let rest = op.remainder(1000);
        assert_eq!(
            (rest.file_offset, rest.addr, rest.len),
            (5096, 0x1000 + 1000, 7192)
        );
        assert_eq!((rest.buf_index, rest.desc_index, rest.fd), (Some(2), 5, 3));
    }

    #[test]
    fn io_errors_carry_descriptor_fd_offset_and_errno() {
        let op = IoOp {
            file: FileRef::Fixed(0),
            fd: 7,
            io_fd: 7,
            file_offset: 8192,
            addr: 0x1000,
            len: 4096,
            buf_index: None,
            device: None,
            punt: false,
            desc_index: 3,
        };
        let c = op.failed(true, libc::EIO).context;
        assert_eq!(
            (c.descriptor, c.fd, c.offset, c.errno),
            (Some(3), Some(7), Some(8192), Some(libc::EIO))
        );
        let c = op.made_no_progress(false).context;
        assert_eq!(
            (c.descriptor, c.fd, c.offset, c.errno),
            (Some(3), Some(7), Some(8192), None)
        );
    }
}
