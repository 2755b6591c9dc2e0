//! The io_uring DMA-BUF registered-buffer uAPI, written by hand because the io-uring crate
//! cannot set `flags` in `io_uring_rsrc_update2` (its `register_buffers_update` hard-codes 0).
//! All constants of the feature live here.
//!
//! The uAPI is not in any released kernel: it comes from the unmerged series "Add dmabuf
//! read/write via io_uring" (Pavel Begunkov). What is known, and from where, is in
//! docs/kernel-dmabuf-series.md. Checked against the v3 patches (2026-04-29,
//! https://lore.kernel.org/io-uring/cover.1777475843.git.asml.silence@gmail.com/), the newest
//! whose io_uring patches could be read. Behaviour was also aligned with the later changes listed
//! in the v7 cover letter (2026-09-28,
//! https://lore.kernel.org/linux-block/cover.1790602223.git.asml.silence@gmail.com/):
//! `desc.flags` must be 0, no IOPOLL rings, reissue spurious -EAGAIN, and a relaxed 1 GiB cap.
//!
//! A DMA-BUF slot is registered with IORING_REGISTER_BUFFERS_UPDATE carrying the EXTENDED flag
//! and one 80-byte `io_uring_regbuf_desc` of type DMABUF bound to the O_DIRECT block-device fd the
//! I/O will use. READ_FIXED/WRITE_FIXED then address the buffer by byte offset into the DMA-BUF.
//!
//! Which uAPI the running kernel speaks is probed, never assumed from a version ([`probe_uapi`]):
//! 1. an EXTENDED update with an EMPTY descriptor: kernels without the series read `flags` as the
//!    reserved `resv` and answer -EINVAL; kernels with it clear the slot and return 1;
//! 2. the same with `desc.flags = 1`: the v3 patches ignore `desc.flags` (1), later code refuses
//!    it (-EINVAL; seen in `io_uring/rsrc.c` of the CI tree linux-blktests/linux-block-trial);
//! 3. a DMABUF-shaped descriptor with both fds -1 for each candidate type value
//!    ([`DMABUF_TYPE_CANDIDATES`]): the DMA-BUF handler fails on the fd (-EBADF), any other or
//!    unknown type on the non-zero fd fields (-EINVAL). A kernel with the io_uring registration
//!    rework but without the DMA-BUF patch (the trial tree above is one) passes step 1 and fails
//!    here, so it is not taken for a DMA-BUF kernel.
//!
//! Every probe call fails or clears the slot of a throw-away ring: nothing is registered.

use std::io;
use std::os::fd::RawFd;

/// `IORING_REGISTER_BUFFERS_UPDATE` register opcode.
pub const IORING_REGISTER_BUFFERS_UPDATE: u32 = 16;
/// `io_uring_rsrc_update2.flags`: the data array holds `io_uring_regbuf_desc` entries.
pub const IORING_RSRC_UPDATE_EXTENDED: u32 = 1 << 1;
/// `io_uring_regbuf_desc.type` values of v3 (`enum io_uring_regbuf_type`: EMPTY, UADDR, DMABUF).
pub const IO_REGBUF_TYPE_EMPTY: u32 = 0;
pub const IO_REGBUF_TYPE_UADDR: u32 = 1;
pub const IO_REGBUF_TYPE_DMABUF: u32 = 2;
/// The DMABUF type values the probe tries, in this order: v3's 2, then 3, where DMABUF lands if
/// IO_REGBUF_TYPE_ZCRX (the third entry, 2, in the July 2026 "zcrx tx" RFC, cover.1783614400)
/// is merged first. The value in v4-v7 could not be read (their io_uring patches are not in
/// the stored archives); a kernel using another one probes as Absent with a reason saying so.
pub const DMABUF_TYPE_CANDIDATES: [u32; 2] = [IO_REGBUF_TYPE_DMABUF, 3];

/// The uAPI of the running kernel, as [`probe_uapi`] found it. The descriptor layout is the same
/// 80 bytes in every posting whose header could be read (v3's, asserted below); what differs
/// between the known revisions is the DMABUF type value and whether `desc.flags` is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uapi {
    /// `io_uring_regbuf_desc.type` of a DMA-BUF registration on this kernel.
    pub dmabuf_type: u32,
    /// The kernel refuses `desc.flags != 0` (code after v3; v5's changelog: "Fix io_uring uapi
    /// validation"). v3 ignores the field. The engine sends 0 either way.
    pub flags_checked: bool,
}

impl Uapi {
    /// The v3 posting (2026-04-29), the one whose patches the constants were checked against.
    pub const V3: Uapi = Uapi {
        dmabuf_type: IO_REGBUF_TYPE_DMABUF,
        flags_checked: false,
    };

    /// One line for logs and the lab: which revision, and why.
    pub fn describe(&self) -> String {
        let rev = if *self == Uapi::V3 { "v3" } else { "after v3" };
        format!(
            "{rev} uAPI: DMABUF type {}, desc.flags {}",
            self.dmabuf_type,
            if self.flags_checked {
                "checked (non-zero -> EINVAL)"
            } else {
                "ignored"
            }
        )
    }
}

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
/// `size` and `uaddr` (DMABUF), `__resv`; the fds only for DMABUF. (Only the probe sets `flags`.)
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

/// Registers `dmabuf_fd` in `slot`, bound to `target_fd` (an O_DIRECT NVMe block device), with
/// the DMABUF type value of the running kernel ([`uapi`]). The ring must not be IOPOLL
/// (reported refused after v3; see [`Ring::register_dmabuf`]).
///
/// [`Ring::register_dmabuf`]: crate::uring::Ring::register_dmabuf
pub fn register_dmabuf(
    ring_fd: RawFd,
    slot: u32,
    dmabuf_fd: RawFd,
    target_fd: RawFd,
) -> io::Result<()> {
    let d = desc(uapi().dmabuf_type, dmabuf_fd, target_fd);
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

/// Probes the running kernel once per call with a throw-away ring: Available when
/// [`probe_uapi`] finds a DMA-BUF uAPI it knows.
pub fn probe() -> DmabufSupport {
    match probe_uapi() {
        Ok(_) => DmabufSupport::Available,
        Err(reason) => DmabufSupport::Absent(reason),
    }
}

/// The uAPI of the running kernel, probed once per process (the first successful
/// [`probe_uapi`] is kept); v3's where the probe finds none (registrations then fail as the
/// kernel answers, and callers check [`probe`] first).
pub fn uapi() -> Uapi {
    match PROBED.get() {
        Some(u) => *u,
        None => probe_uapi().unwrap_or(Uapi::V3),
    }
}

static PROBED: std::sync::OnceLock<Uapi> = std::sync::OnceLock::new();

/// Finds which uAPI the running kernel speaks (module documentation: the three steps), on a
/// throw-away ring with a sparse one-slot table. Err: why there is none the engine can use.
pub fn probe_uapi() -> Result<Uapi, String> {
    use std::os::fd::AsRawFd;
    let ring = io_uring::IoUring::new(4).map_err(|e| {
        format!(
            "io_uring_setup failed: {}",
            crate::error::describe_os_error(&e)
        )
    })?;
    ring.submitter().register_buffers_sparse(1).map_err(|e| {
        format!(
            "sparse buffer table refused: {}",
            crate::error::describe_os_error(&e)
        )
    })?;
    let fd = ring.as_raw_fd();
    let update = |d: &IoUringRegbufDesc| {
        // SAFETY: the probe only sends EMPTY and DMABUF descriptors, which reference no user
        // memory.
        unsafe { update_extended(fd, 0, d) }
    };
    if let DmabufSupport::Absent(reason) =
        interpret_probe(update(&desc(IO_REGBUF_TYPE_EMPTY, 0, 0)))
    {
        return Err(reason);
    }
    let flagged = IoUringRegbufDesc {
        flags: 1,
        ..desc(IO_REGBUF_TYPE_EMPTY, 0, 0)
    };
    let flags = update(&flagged);
    let mut types = Vec::new();
    for t in DMABUF_TYPE_CANDIDATES {
        let r = update(&desc(t, -1, -1));
        let stop = !matches!(&r, Err(e) if e.raw_os_error() == Some(libc::EINVAL));
        if matches!(r, Ok(n) if n > 0) {
            // never expected (fd -1 registered?): leave nothing behind
            let _ = update(&desc(IO_REGBUF_TYPE_EMPTY, 0, 0));
        }
        types.push((t, r));
        if stop {
            break;
        }
    }
    let found = classify(flags, &types)?;
    Ok(*PROBED.get_or_init(|| found))
}

/// Steps 2 and 3 of the probe, given step 1 passed: `flags` is the answer to the EMPTY update
/// with `desc.flags = 1`, `types` the answers to the DMABUF-shaped descriptors with fds -1.
pub fn classify(flags: io::Result<i32>, types: &[(u32, io::Result<i32>)]) -> Result<Uapi, String> {
    let flags_checked = match flags {
        Ok(n) if n >= 1 => false,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => true,
        other => {
            return Err(format!(
                "{ABSENT_KNOWN} (an EMPTY descriptor with desc.flags 1 gave {}, neither 1 nor \
                 EINVAL)",
                show(&other)
            ))
        }
    };
    for (t, r) in types {
        match r {
            Err(e) if e.raw_os_error() == Some(libc::EBADF) => {
                return Ok(Uapi {
                    dmabuf_type: *t,
                    flags_checked,
                })
            }
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                return Err(format!(
                    "the kernel has the io_uring DMA-BUF uAPI (type {t}) but refuses DMA-BUF \
                     registrations (EOPNOTSUPP): built without the series' DMA-BUF support \
                     (v3: CONFIG_DMABUF_TOKEN)"
                ))
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            other => {
                return Err(format!(
                    "{ABSENT_KNOWN} (a DMA-BUF descriptor of type {t} with fd -1 gave {}, \
                     expected EBADF)",
                    show(other)
                ))
            }
        }
    }
    let tried: Vec<String> = types.iter().map(|(t, _)| t.to_string()).collect();
    Err(format!(
        "{ABSENT_KNOWN}: EXTENDED buffer updates work, but no DMA-BUF registration type ({}) \
         answers a descriptor with fd -1 with EBADF: the kernel has the io_uring \
         registration rework without the DMA-BUF patch, or a revision of the series whose type \
         value the engine does not know (docs/kernel-dmabuf-series.md)",
        tried.join(", ")
    ))
}

/// How the reasons of [`classify`] start.
const ABSENT_KNOWN: &str = "kernel without an io_uring DMA-BUF uAPI this engine knows";

fn show(r: &io::Result<i32>) -> String {
    match r {
        Ok(n) => format!("{n}"),
        Err(e) => crate::error::describe_os_error(e),
    }
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

    fn errno(e: i32) -> io::Result<i32> {
        Err(io::Error::from_raw_os_error(e))
    }

    #[test]
    fn the_v3_answers_give_the_v3_uapi() {
        // v3: desc.flags ignored (1), type 2 fails on fget(-1) (EBADF)
        let u = classify(Ok(1), &[(2, errno(libc::EBADF))]).unwrap();
        assert_eq!(u, Uapi::V3);
        assert!(
            u.describe().starts_with("v3 uAPI: DMABUF type 2"),
            "{}",
            u.describe()
        );
    }

    #[test]
    fn a_later_revision_is_told_apart_by_its_answers() {
        // flags checked, and DMABUF moved to 3 (ZCRX at 2): type 2 is ZCRX's, which refuses the
        // fd fields (they are its reserved words) with EINVAL
        let u = classify(
            errno(libc::EINVAL),
            &[(2, errno(libc::EINVAL)), (3, errno(libc::EBADF))],
        )
        .unwrap();
        assert_eq!(
            u,
            Uapi {
                dmabuf_type: 3,
                flags_checked: true
            }
        );
        assert!(u.describe().starts_with("after v3"), "{}", u.describe());
        // flags checked, DMABUF still 2
        let u = classify(errno(libc::EINVAL), &[(2, errno(libc::EBADF))]).unwrap();
        assert_eq!((u.dmabuf_type, u.flags_checked), (2, true));
    }

    #[test]
    fn the_registration_rework_without_the_dmabuf_patch_is_absent() {
        // like io_uring/rsrc.c of linux-blktests/linux-block-trial at 14adc61c: EXTENDED updates
        // and a checked desc.flags, but no DMABUF type (type >= __IO_REGBUF_TYPE_MAX: EINVAL)
        let r = classify(
            errno(libc::EINVAL),
            &[(2, errno(libc::EINVAL)), (3, errno(libc::EINVAL))],
        );
        let msg = r.unwrap_err();
        assert!(
            msg.contains("without the DMA-BUF patch") && msg.contains("2, 3"),
            "{msg}"
        );
    }

    #[test]
    fn other_answers_are_absent_with_their_reason() {
        let msg = classify(Ok(1), &[(2, errno(libc::EOPNOTSUPP))]).unwrap_err();
        assert!(msg.contains("CONFIG_DMABUF_TOKEN"), "{msg}");
        let msg = classify(errno(libc::EFAULT), &[(2, errno(libc::EBADF))]).unwrap_err();
        assert!(msg.contains("desc.flags 1"), "{msg}");
        let msg = classify(Ok(1), &[(2, Ok(1))]).unwrap_err();
        assert!(msg.contains("expected EBADF"), "{msg}");
    }

    #[test]
    fn probe_and_probe_uapi_agree_on_this_kernel() {
        let u = probe_uapi();
        assert_eq!(u.is_ok(), probe().is_available(), "{u:?}");
        if let Ok(u) = u {
            assert_eq!(uapi(), u);
            assert!(DMABUF_TYPE_CANDIDATES.contains(&u.dmabuf_type));
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
