//! The io_uring DMA-BUF registered-buffer uAPI, by raw syscall: the io-uring crate cannot set
//! the EXTENDED flag of a buffer update.
//!
//! The uAPI is in no released kernel: it comes from the unmerged series "Add dmabuf read/write
//! via io_uring" (docs/kernel-dmabuf-series.md). Checked against the v3 patches (2026-04-29,
//! https://lore.kernel.org/io-uring/cover.1777475843.git.asml.silence@gmail.com/), the newest
//! whose patches could be read; the later changes known from the v7 cover letter (2026-09-28,
//! https://lore.kernel.org/linux-block/cover.1790602223.git.asml.silence@gmail.com/) are kept
//! too: `flags` 0 in every descriptor, no IOPOLL ring for real registrations, -EAGAIN reissued.
//!
//! There is no new register opcode: `IORING_REGISTER_BUFFERS_UPDATE` (16) takes a
//! `struct io_uring_rsrc_update2` whose former `resv` field carries `IORING_RSRC_UPDATE_EXTENDED`,
//! and `data` then points at an array of 80-byte `struct io_uring_regbuf_desc`. Kernels before
//! the feature reject a non-zero `resv` with -EINVAL, so an EXTENDED update carrying one EMPTY
//! descriptor is a harmless probe: 1 (one slot updated) where supported, -EINVAL where not.
//!
//! Which revision of the uAPI the kernel speaks is probed, as the engine does, in its own code:
//! after the EMPTY probe, an EMPTY descriptor with `flags` 1 (v3 ignores the field and returns 1,
//! later code refuses it with -EINVAL), then a DMA-BUF-shaped descriptor with both fds -1 for
//! each candidate type value (the DMA-BUF handler answers -EBADF, any other type -EINVAL). The
//! type found is what `RegbufDesc::dmabuf` uses from then on (`DMABUF_TYPE`).
//!
//! The engine has its own copy (src/uring/dmabuf_uapi.rs). This one is kept on purpose as an
//! independent oracle: it speaks raw errnos, adds the plain-update control call, and test c2
//! checks that both reach the same verdict on the kernel under test, so a mistake in one shows.

use std::io;
use std::os::fd::RawFd;

use std::sync::atomic::{AtomicU32, Ordering};

use io_uring::IoUring;

/// `IORING_REGISTER_BUFFERS_UPDATE`: update slots of the registered-buffer table.
pub const IORING_REGISTER_BUFFERS_UPDATE: libc::c_uint = 16;
/// `io_uring_rsrc_update2.flags`: `data` points at `io_uring_regbuf_desc`s, not iovecs.
pub const IORING_RSRC_UPDATE_EXTENDED: u32 = 1 << 1;

/// `enum io_uring_regbuf_type` (v3). DMABUF = 2 is unverified after v3: a July 2026 RFC gives 2
/// to IO_REGBUF_TYPE_ZCRX (docs/kernel-dmabuf-series.md), so the probe also tries 3.
pub const IO_REGBUF_TYPE_EMPTY: u32 = 0;
#[allow(dead_code)] // ordinary user memory through the extended update; unused by the lab
pub const IO_REGBUF_TYPE_UADDR: u32 = 1;
pub const IO_REGBUF_TYPE_DMABUF: u32 = 2;
/// The DMABUF type values the probe tries, in order.
pub const TYPE_CANDIDATES: [u32; 2] = [IO_REGBUF_TYPE_DMABUF, 3];

/// The DMABUF type value `RegbufDesc::dmabuf` uses: v3's until `probe` finds the kernel's.
static DMABUF_TYPE: AtomicU32 = AtomicU32::new(IO_REGBUF_TYPE_DMABUF);

/// `struct io_uring_rsrc_update2` (32 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RsrcUpdate2 {
    pub offset: u32,
    /// `resv` in kernels without the series: must be 0 there.
    pub flags: u32,
    pub data: u64,
    pub tags: u64,
    pub nr: u32,
    pub resv2: u32,
}

/// `struct io_uring_regbuf_desc` (80 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RegbufDesc {
    pub kind: u32,
    /// Must be 0: v3 ignores it, later versions answer -EINVAL to anything else.
    pub flags: u32,
    /// UADDR: length; DMABUF: 0.
    pub size: u64,
    /// UADDR: address; DMABUF: 0.
    pub uaddr: u64,
    /// DMABUF: the dma-buf fd; 0 otherwise.
    pub dmabuf_fd: i32,
    /// DMABUF: the O_DIRECT block-device fd the I/O on this slot will use; 0 otherwise.
    pub target_fd: i32,
    pub resv: [u64; 6],
}

const _: () = assert!(std::mem::size_of::<RsrcUpdate2>() == 32);
const _: () = assert!(std::mem::size_of::<RegbufDesc>() == 80);
const _: () = assert!(std::mem::offset_of!(RegbufDesc, dmabuf_fd) == 24);
const _: () = assert!(std::mem::offset_of!(RsrcUpdate2, nr) == 24);

impl RegbufDesc {
    pub fn empty() -> RegbufDesc {
        RegbufDesc {
            kind: IO_REGBUF_TYPE_EMPTY,
            flags: 0,
            size: 0,
            uaddr: 0,
            dmabuf_fd: 0,
            target_fd: 0,
            resv: [0; 6],
        }
    }
    /// A DMA-BUF registration with the type value the probe found (v3's before any probe).
    pub fn dmabuf(dmabuf_fd: RawFd, target_fd: RawFd) -> RegbufDesc {
        RegbufDesc::dmabuf_of_type(DMABUF_TYPE.load(Ordering::Relaxed), dmabuf_fd, target_fd)
    }
    pub fn dmabuf_of_type(kind: u32, dmabuf_fd: RawFd, target_fd: RawFd) -> RegbufDesc {
        RegbufDesc {
            kind,
            flags: 0,
            size: 0,
            uaddr: 0,
            dmabuf_fd,
            target_fd,
            resv: [0; 6],
        }
    }
}

/// `io_uring_register(ring_fd, IORING_REGISTER_BUFFERS_UPDATE, up, 32)`: the raw return value
/// (number of slots updated, or -errno).
pub fn buffers_update_raw(ring_fd: RawFd, up: &RsrcUpdate2) -> i64 {
    // SAFETY: `up` is a valid 32-byte io_uring_rsrc_update2 for the duration of the call; its
    // `data` (and `tags`, if non-zero) point at arrays of `nr` entries that the caller keeps
    // alive across the call. The kernel only reads them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring_fd,
            IORING_REGISTER_BUFFERS_UPDATE,
            up as *const RsrcUpdate2,
            std::mem::size_of::<RsrcUpdate2>() as libc::c_uint,
        )
    };
    if r < 0 {
        -(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO) as i64)
    } else {
        r
    }
}

/// EXTENDED update of `descs.len()` slots starting at `slot`: raw return (count or -errno).
pub fn update_extended(ring_fd: RawFd, slot: u32, descs: &[RegbufDesc]) -> i64 {
    let up = RsrcUpdate2 {
        offset: slot,
        flags: IORING_RSRC_UPDATE_EXTENDED,
        data: descs.as_ptr() as u64,
        tags: 0,
        nr: descs.len() as u32,
        resv2: 0,
    };
    buffers_update_raw(ring_fd, &up)
}

/// Classic (non-extended) update with iovecs: clears a sparse slot with `{NULL, 0}` on every
/// kernel since 5.13. Used as the control for the probe: same call, same struct, no flag.
pub fn update_plain(ring_fd: RawFd, slot: u32, iovs: &[libc::iovec]) -> i64 {
    let up = RsrcUpdate2 {
        offset: slot,
        flags: 0,
        data: iovs.as_ptr() as u64,
        tags: 0,
        nr: iovs.len() as u32,
        resv2: 0,
    };
    buffers_update_raw(ring_fd, &up)
}

/// Registers `dmabuf_fd` into buffer slot `slot`, bound to `target_fd` (an O_DIRECT NVMe block
/// device fd). The ring must have a buffer table (sparse is fine) and should not be IOPOLL: v3
/// accepts that, later versions are reported to refuse it (d4 records which).
pub fn register_dmabuf(
    ring_fd: RawFd,
    slot: u32,
    dmabuf_fd: RawFd,
    target_fd: RawFd,
) -> Result<(), i32> {
    match update_extended(ring_fd, slot, &[RegbufDesc::dmabuf(dmabuf_fd, target_fd)]) {
        1 => Ok(()),
        r if r < 0 => Err(-r as i32),
        r => Err(-(r as i32).max(1)), // positive but not 1: never expected; reported as such
    }
}

/// Clears buffer slot `slot` (EMPTY descriptor), releasing a DMA-BUF registered there.
pub fn clear_slot(ring_fd: RawFd, slot: u32) -> Result<(), i32> {
    match update_extended(ring_fd, slot, &[RegbufDesc::empty()]) {
        1 => Ok(()),
        r if r < 0 => Err(-r as i32),
        r => Err(-(r as i32).max(1)),
    }
}

/// What the probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The EXTENDED EMPTY update returned 1.
    Supported,
    /// It returned -EINVAL: the kernel predates the uAPI (the flag sits in the old `resv`).
    Absent,
    /// Anything else (raw return value): the probe itself went wrong.
    Unexpected(i64),
}

#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub support: Support,
    /// Raw return of the EXTENDED EMPTY update.
    pub extended: i64,
    /// Raw return of the same update without the flag (an iovec `{NULL, 0}`): must be 1.
    pub control: i64,
    /// Raw return of the EMPTY update with `desc.flags` 1 (0 when step 1 failed): 1 = ignored
    /// (v3), -EINVAL = checked (after v3).
    pub flags: i64,
    /// Raw returns of the DMA-BUF descriptors with fds -1, per `TYPE_CANDIDATES` (0 = not tried).
    pub types: [i64; 2],
    /// The candidate that answered -EBADF: the kernel's DMABUF type value.
    pub dmabuf_type: Option<u32>,
}

impl Probe {
    /// What steps 2 and 3 found, for the test lines.
    pub fn revision(&self) -> String {
        if self.support != Support::Supported {
            return "no revision probed".into();
        }
        let tried: Vec<String> = TYPE_CANDIDATES
            .iter()
            .zip(self.types)
            .filter(|(_, r)| *r != 0)
            .map(|(t, r)| format!("type {t} -> {}", crate::util::res_str(r)))
            .collect();
        let flags = match self.flags {
            1 => "ignored, as v3".to_owned(),
            r if r == -(libc::EINVAL as i64) => "checked, as after v3".to_owned(),
            r => format!("unexpected {}", crate::util::res_str(r)),
        };
        format!(
            "desc.flags 1 -> {} ({flags}); DMA-BUF desc with fds -1: {}: {}",
            crate::util::res_str(self.flags),
            tried.join(", "),
            match self.dmabuf_type {
                Some(t) => format!("DMABUF type {t}"),
                None => "no DMABUF type".into(),
            }
        )
    }
}

/// Probes the running kernel: a small non-IOPOLL ring with a one-slot sparse buffer table, one
/// EXTENDED update with an EMPTY descriptor, plus the flag-less control on the same slot; where
/// supported, the revision steps (module documentation), which set `DMABUF_TYPE`.
pub fn probe() -> io::Result<Probe> {
    let ring = IoUring::new(2)?;
    ring.submitter().register_buffers_sparse(1)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&ring);
    let control = update_plain(
        fd,
        0,
        &[libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }],
    );
    let extended = update_extended(fd, 0, &[RegbufDesc::empty()]);
    let support = match extended {
        1 => Support::Supported,
        r if r == -(libc::EINVAL as i64) => Support::Absent,
        r => Support::Unexpected(r),
    };
    let mut p = Probe {
        support,
        extended,
        control,
        flags: 0,
        types: [0; 2],
        dmabuf_type: None,
    };
    if support != Support::Supported {
        return Ok(p);
    }
    let flagged = RegbufDesc {
        flags: 1,
        ..RegbufDesc::empty()
    };
    p.flags = update_extended(fd, 0, &[flagged]);
    for (i, t) in TYPE_CANDIDATES.into_iter().enumerate() {
        let r = update_extended(fd, 0, &[RegbufDesc::dmabuf_of_type(t, -1, -1)]);
        p.types[i] = r;
        if r > 0 {
            let _ = update_extended(fd, 0, &[RegbufDesc::empty()]);
        }
        if r == -(libc::EBADF as i64) {
            p.dmabuf_type = Some(t);
            DMABUF_TYPE.store(t, Ordering::Relaxed);
        }
        if r != -(libc::EINVAL as i64) {
            break;
        }
    }
    Ok(p)
}
