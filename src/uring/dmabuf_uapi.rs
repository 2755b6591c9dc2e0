//! The io_uring DMA-BUF registered-buffer uAPI, written by hand because the io-uring crate
//! cannot set `flags` in `io_uring_rsrc_update2` (its `register_buffers_update` hard-codes 0).
//! All constants of the feature live here.
//!
//! The uAPI is not in any released kernel: it comes from the unmerged series "Add dmabuf
//! read/write via io_uring" (Pavel Begunkov). What is known, and from where, is in
//! docs/kernel-dmabuf-series.md. Checked against the v3 patches (2026-04-29,
//! https://lore.kernel.org/io-uring/cover.1777475843.git.asml.silence@gmail.com/), the newest
//! whose patches could be read. Behaviour was also aligned with the later changes listed in the
//! v7 cover letter (2026-09-28,
//! https://lore.kernel.org/linux-block/cover.1790602223.git.asml.silence@gmail.com/):
//! `desc.flags` must be 0, no IOPOLL rings, reissue spurious -EAGAIN, and a relaxed 1 GiB cap.
//!
//! A DMA-BUF slot is registered with IORING_REGISTER_BUFFERS_UPDATE carrying the EXTENDED flag
//! and one 80-byte `io_uring_regbuf_desc` of type DMABUF bound to the O_DIRECT block-device fd the
//! I/O will use. READ_FIXED/WRITE_FIXED then address the buffer by byte offset into the DMA-BUF.
//! Kernels without the series read `flags` as the reserved `resv` and answer -EINVAL; the probe
//! tells the two apart with a harmless EMPTY descriptor, which supporting kernels accept
//! (return 1).

use std::io;
use std::os::fd::RawFd;

/// `IORING_REGISTER_BUFFERS_UPDATE` register opcode.
pub const IORING_REGISTER_BUFFERS_UPDATE: u32 = 16;
/// `io_uring_rsrc_update2.flags`: the data array holds `io_uring_regbuf_desc` entries.
pub const IORING_RSRC_UPDATE_EXTENDED: u32 = 1 << 1;
/// `io_uring_regbuf_desc.type` values (v3). Unverified for v7: a July 2026 RFC ("zcrx tx",
/// cover.1783614400) gives the value 2 to IO_REGBUF_TYPE_ZCRX; if a kernel with the series
/// probes as Available but refuses DMABUF registrations with EINVAL, check this value first.
pub const IO_REGBUF_TYPE_EMPTY: u32 = 0;
pub const IO_REGBUF_TYPE_UADDR: u32 = 1;
pub const IO_REGBUF_TYPE_DMABUF: u32 = 2;

/// Largest DMA-BUF the engine registers in one slot. v3 refuses a dma-buf over 1 GiB with
/// EINVAL; v6 "relaxed the 1G io_uring registered dma-buf limit" (v7 cover letter, 2026-09-28)
/// to a value not readable in the archives. 1 GiB works under both, so slabs stay at 1 GiB.
pub const MAX_DMABUF_SLAB: u64 = 1 << 30;

/// `struct io_uring_rsrc_update2` (32 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct IoUringRsrcUpdate2 {
    pub offset: u32,
    pub flags: u32,
    pub data: u64,
    pub tags: u64,
    pub nr: u32,
    pub resv2: u32,
}

/// `struct io_uring_regbuf_desc` (80 bytes). `flags` must be 0: v3 ignores it, later versions
/// refuse anything else with EINVAL (see docs/kernel-dmabuf-series.md); only [`desc`] builds one.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct IoUringRegbufDesc {
    pub kind: u32,
    pub flags: u32,
    pub size: u64,
    pub uaddr: u64,
    pub dmabuf_fd: i32,
    pub target_fd: i32,
    pub resv: [u64; 6],
}

const _: () = assert!(std::mem::size_of::<IoUringRsrcUpdate2>() == 32);
const _: () = assert!(std::mem::align_of::<IoUringRsrcUpdate2>() == 8);
const _: () = assert!(std::mem::size_of::<IoUringRegbufDesc>() == 80);
const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, size) == 8);
const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, uaddr) == 16);
const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, dmabuf_fd) == 24);
const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, target_fd) == 28);
const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, resv) == 32);
const _: () = assert!(std::mem::offset_of!(IoUringRsrcUpdate2, data) == 8);
const _: () = assert!(std::mem::offset_of!(IoUringRsrcUpdate2, nr) == 24);

/// A descriptor of `kind` with every field the kernel requires to be zero left zero: `flags`,
/// `size` and `uaddr` (DMABUF), `__resv`; the fds only for DMABUF.
fn desc(kind: u32, dmabuf_fd: RawFd, target_fd: RawFd) -> IoUringRegbufDesc {
    IoUringRegbufDesc {
        kind,
        flags: 0,
        size: 0,
        uaddr: 0,
        dmabuf_fd,
        target_fd,
        resv: [0; 6],
    }
}

/// One EXTENDED buffer update of `slot` on the ring `ring_fd`.
///
/// # Safety
/// For a UADDR descriptor the memory must stay valid while registered; EMPTY and DMABUF
/// descriptors hand no user memory to the kernel.
unsafe fn update_extended(ring_fd: RawFd, slot: u32, desc: &IoUringRegbufDesc) -> io::Result<i32> {
    let up = IoUringRsrcUpdate2 {
        offset: slot,
        flags: IORING_RSRC_UPDATE_EXTENDED,
        data: desc as *const IoUringRegbufDesc as u64,
        tags: 0,
        nr: 1,
        resv2: 0,
    };
    // SAFETY: `up` and `desc` live across the call; the kernel only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring_fd,
            IORING_REGISTER_BUFFERS_UPDATE,
            &up as *const IoUringRsrcUpdate2,
            std::mem::size_of::<IoUringRsrcUpdate2>() as u32,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as i32)
    }
}

/// Registers `dmabuf_fd` in `slot`, bound to `target_fd` (an O_DIRECT NVMe block device).
/// The ring must not be IOPOLL (reported refused after v3; see [`Ring::register_dmabuf`]).
///
/// [`Ring::register_dmabuf`]: crate::uring::Ring::register_dmabuf
pub fn register_dmabuf(
    ring_fd: RawFd,
    slot: u32,
    dmabuf_fd: RawFd,
    target_fd: RawFd,
) -> io::Result<()> {
    let d = desc(IO_REGBUF_TYPE_DMABUF, dmabuf_fd, target_fd);
    // SAFETY: a DMABUF descriptor references no user memory.
    unsafe { update_extended(ring_fd, slot, &d) }.map(drop)
}

/// What the running kernel offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmabufSupport {
    /// The kernel accepted an EXTENDED update: DMA-BUF registered buffers are available.
    Available,
    /// The kernel has no such uAPI (or refuses it here); the reason says why.
    Absent(String),
}

impl DmabufSupport {
    pub fn is_available(&self) -> bool {
        matches!(self, DmabufSupport::Available)
    }
}

/// How the doctor and every refusal name a kernel that lacks the uAPI (no version: no released
/// kernel has it).
pub const ABSENT: &str = "kernel without the io_uring DMA-BUF uAPI";

/// Interprets the result of the EMPTY-descriptor probe update.
pub fn interpret_probe(result: io::Result<i32>) -> DmabufSupport {
    match result {
        Ok(n) if n >= 1 => DmabufSupport::Available,
        Ok(n) => DmabufSupport::Absent(format!(
            "the kernel accepted the probe but updated {n} entries; treating DMA-BUF buffers as \
             unavailable"
        )),
        Err(e) => DmabufSupport::Absent(match e.raw_os_error() {
            Some(libc::EINVAL) => format!(
                "{ABSENT} (EXTENDED buffer update refused with EINVAL; the uAPI is only in the \
                 unmerged \"io_uring dmabuf read/write\" patch series, in no released kernel)"
            ),
            Some(libc::ENXIO) => "probe ring has no buffer table (ENXIO); internal error".into(),
            Some(libc::EOPNOTSUPP) => {
                "DMA-BUF buffers are refused on this ring (EOPNOTSUPP; versions after v3 refuse \
             IOPOLL rings)"
                    .into()
            }
            Some(libc::EFAULT) => "the kernel could not read the probe descriptor (EFAULT)".into(),
            Some(libc::ENOSYS) => "io_uring is not available (ENOSYS)".into(),
            Some(libc::EPERM) | Some(libc::EACCES) => {
                "io_uring registration is not permitted here (EPERM/EACCES: seccomp or \
                 io_uring_disabled)"
                    .into()
            }
            Some(libc::ENOMEM) => "out of memory while probing (ENOMEM)".into(),
            _ => format!("probe failed: {}", crate::error::describe_os_error(&e)),
        }),
    }
}

/// Probes the running kernel once per call with a throw-away ring: sparse table of one slot,
/// EXTENDED update with an EMPTY descriptor.
pub fn probe() -> DmabufSupport {
    let ring = match io_uring::IoUring::new(4) {
        Ok(r) => r,
        Err(e) => {
            return DmabufSupport::Absent(format!(
                "io_uring_setup failed: {}",
                crate::error::describe_os_error(&e)
            ))
        }
    };
    if let Err(e) = ring.submitter().register_buffers_sparse(1) {
        return DmabufSupport::Absent(format!(
            "sparse buffer table refused: {}",
            crate::error::describe_os_error(&e)
        ));
    }
    use std::os::fd::AsRawFd;
    let d = desc(IO_REGBUF_TYPE_EMPTY, 0, 0);
    // SAFETY: an EMPTY descriptor references no user memory.
    interpret_probe(unsafe { update_extended(ring.as_raw_fd(), 0, &d) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_result_one_means_available() {
        assert_eq!(interpret_probe(Ok(1)), DmabufSupport::Available);
    }

    #[test]
    fn every_probe_errno_is_absent_with_a_reason() {
        for errno in [
            libc::EINVAL,
            libc::ENXIO,
            libc::EOPNOTSUPP,
            libc::EFAULT,
            libc::ENOSYS,
            libc::EPERM,
            libc::EACCES,
            libc::ENOMEM,
            libc::EBUSY,
        ] {
            match interpret_probe(Err(io::Error::from_raw_os_error(errno))) {
                DmabufSupport::Absent(reason) => assert!(!reason.is_empty(), "errno {errno}"),
                other => panic!("errno {errno} gave {other:?}"),
            }
        }
        let DmabufSupport::Absent(r) =
            interpret_probe(Err(io::Error::from_raw_os_error(libc::EINVAL)))
        else {
            unreachable!()
        };
        assert!(r.starts_with(ABSENT) && !r.contains("7.4"), "{r}");
        assert!(!interpret_probe(Ok(0)).is_available());
    }

    #[test]
    fn the_live_probe_is_stable_and_matches_what_the_machine_is_expected_to_have() {
        // Two probes on fresh rings give the same answer, an absence always carries its reason,
        // and where the environment says what this kernel has (IUD_EXPECT_DMABUF_UAPI=0|1, for
        // whoever knows the kernel; the NVMe lab checks its own probe against LAB_UAPI) the probe
        // must agree with it.
        let first = probe();
        let second = probe();
        println!("DMA-BUF uAPI probe on this kernel: {first:?}");
        assert_eq!(first, second, "the probe changed its answer");
        if let DmabufSupport::Absent(r) = &first {
            assert!(!r.is_empty(), "an absence without a reason");
        }
        match std::env::var("IUD_EXPECT_DMABUF_UAPI").as_deref() {
            Ok("1") => assert!(
                first.is_available(),
                "expected the uAPI, probe says {first:?}"
            ),
            Ok("0") => assert!(
                !first.is_available(),
                "expected no uAPI, probe says {first:?}"
            ),
            _ => {}
        }
    }

    #[test]
    fn descriptors_serialize_as_the_kernel_expects() {
        let d = desc(IO_REGBUF_TYPE_DMABUF, 7, 9);
        // SAFETY: reading the bytes of a plain repr(C) value.
        let bytes: [u8; 80] = unsafe { std::mem::transmute(d) };
        assert_eq!(&bytes[0..4], &2u32.to_ne_bytes());
        // flags, size, uaddr: all 0 (flags != 0 is EINVAL after v3; size/uaddr must be 0 for DMABUF)
        assert!(bytes[4..24].iter().all(|&b| b == 0));
        assert_eq!(&bytes[24..28], &7i32.to_ne_bytes());
        assert_eq!(&bytes[28..32], &9i32.to_ne_bytes());
        assert!(bytes[32..].iter().all(|&b| b == 0));
        // SAFETY: as above.
        let empty: [u8; 80] = unsafe { std::mem::transmute(desc(IO_REGBUF_TYPE_EMPTY, 0, 0)) };
        assert!(empty.iter().all(|&b| b == 0));
    }
}
