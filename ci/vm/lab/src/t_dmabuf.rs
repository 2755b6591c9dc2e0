//! (c) The io_uring DMA-BUF uAPI probe and (d) udmabuf-exported host buffers against the NVMe
//! namespace: as ordinary registered buffers (the fallback path), and as DMA-BUF registered
//! buffers: moving data where the kernel has the uAPI, refused cleanly where it has not.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use io_uring::{opcode, types, IoUring};

use crate::dmabuf_uapi::{self, Probe, Support};
use crate::report::{Outcome, TestResult};
use crate::udmabuf::{self, HostDmabuf};
use crate::util::{
    compare, errno_str, fd_is_open, open_fd_count, read_buffered, res_str, size_str, submit_all,
    BlockDev, Rng,
};

/// Device bytes [128 MiB, 192 MiB) belong to these tests.
const BASE: u64 = 128 << 20;
const BUF: usize = 4 << 20;

/// "7.3.4+deb13-cloud-amd64" -> (7, 3).
pub fn kernel_version() -> (u32, u32) {
    // SAFETY: uname fills the zeroed struct.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: u is a valid utsname.
    unsafe { libc::uname(&mut u) };
    let rel: String = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    let mut it = rel
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// What this run expects of the kernel under test: `iud_lab.uapi=present|absent` on the kernel
/// command line (run-lab.sh's LAB_UAPI). A version number cannot say: no released kernel has the
/// uAPI, it comes only from the unmerged patch series (docs/kernel-dmabuf-series.md).
fn expected_uapi() -> Option<bool> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    cmdline
        .split_whitespace()
        .find_map(|w| match w.strip_prefix("iud_lab.uapi=")? {
            "present" => Some(true),
            "absent" => Some(false),
            _ => None,
        })
}

/// c1: the probe, checked against what the run expects (`expected_uapi`), if anything.
pub fn probe_test(out: &mut Option<Probe>) -> TestResult {
    let p = dmabuf_uapi::probe().map_err(|e| format!("probe ring: {e}"))?;
    *out = Some(p);
    let (maj, min) = kernel_version();
    let shown = format!(
        "EXTENDED update with an EMPTY regbuf desc on a 1-slot sparse table -> {}; control (same call without the flag) -> {}",
        res_str(p.extended),
        res_str(p.control)
    );
    if p.control != 1 {
        return Err(format!("{shown}: the flag-less control must update 1 slot, so the probe call itself is malformed"));
    }
    let has = match p.support {
        Support::Supported => true,
        Support::Absent => false,
        Support::Unexpected(r) => {
            return Err(format!("{shown}: neither 1 nor -EINVAL ({})", res_str(r)))
        }
    };
    if has && p.dmabuf_type.is_none() {
        return Err(format!(
            "{shown}; {}: EXTENDED updates work but no DMABUF type answers like one (a kernel with the io_uring regbuf rework without the DMA-BUF patch, or a type value the lab does not know)",
            p.revision()
        ));
    }
    let found = if has {
        format!(
            "has the io_uring DMA-BUF uAPI (a kernel with the patch series; {})",
            p.revision()
        )
    } else {
        "is a kernel without the io_uring DMA-BUF uAPI".to_owned()
    };
    match expected_uapi() {
        Some(want) if want == has => Ok(Outcome::Pass(format!("{shown}: kernel {maj}.{min} {found}, as this run expects (iud_lab.uapi)"))),
        Some(true) => Err(format!(
            "{shown}: kernel {maj}.{min} was expected to have the uAPI (iud_lab.uapi=present); check the constants in dmabuf_uapi.rs against the series' uapi header (docs/kernel-dmabuf-series.md)"
        )),
        Some(false) => Err(format!("{shown}: kernel {maj}.{min} was expected to lack the uAPI (iud_lab.uapi=absent) but accepted the EXTENDED update")),
        None => Ok(Outcome::Pass(format!("{shown}: kernel {maj}.{min} {found} (no expectation given: LAB_UAPI unset)"))),
    }
}

/// c2: the engine's own probe (src/uring/dmabuf_uapi.rs) must reach the same verdict as the
/// lab's independent implementation on this kernel.
pub fn engine_probe_agrees(lab: Option<Probe>) -> TestResult {
    let Some(lab) = lab else {
        return Err("the lab's probe (c1) did not run".into());
    };
    let engine = io_uring_dmabuf::uring::dmabuf_uapi::probe();
    let lab_says = lab.support == Support::Supported && lab.dmabuf_type.is_some();
    if engine.is_available() == lab_says {
        if !lab_says {
            return Ok(Outcome::Pass(format!(
                "engine probe: {engine:?}; lab probe: {:?}",
                lab.support
            )));
        }
        // both found one: the same revision
        let u = io_uring_dmabuf::uring::dmabuf_uapi::uapi();
        let lab_checked = lab.flags == -(libc::EINVAL as i64);
        if Some(u.dmabuf_type) != lab.dmabuf_type || u.flags_checked != lab_checked {
            return Err(format!(
                "engine found {}, the lab {}",
                u.describe(),
                lab.revision()
            ));
        }
        Ok(Outcome::Pass(format!(
            "engine probe: {engine:?}, {}; lab probe: {:?}, {}",
            u.describe(),
            lab.support,
            lab.revision()
        )))
    } else {
        Err(format!(
            "engine probe says {engine:?}, lab probe says {:?} (raw {})",
            lab.support,
            res_str(lab.extended)
        ))
    }
}

/// d1: udmabuf export itself: the dma-buf fd is udmabuf's, its mmap shows the memfd's bytes,
/// and the kernel's own rules (sealing, page alignment) hold.
pub fn export_test() -> TestResult {
    if std::fs::metadata(udmabuf::DEVICE).is_err() {
        return Ok(Outcome::Skip(format!(
            "no {}: kernel without CONFIG_UDMABUF",
            udmabuf::DEVICE
        )));
    }
    let how = if std::path::Path::new("/sys/module/udmabuf/initstate").exists() {
        "module"
    } else {
        "built in"
    };
    let limit = udmabuf::size_limit_mb().map_or("unknown".to_owned(), |m| format!("{m} MiB"));
    let mut b = HostDmabuf::create(BUF)?;
    let exp = udmabuf::exporter_name(b.dmabuf_fd()).unwrap_or_default();
    if exp != "udmabuf" {
        return Err(format!(
            "fdinfo of dma-buf fd {} says exp_name {exp:?}, not \"udmabuf\"",
            b.dmabuf_fd()
        ));
    }
    Rng::new().fill(b.bytes_mut());
    // SAFETY: a fresh read-only shared mapping of the dma-buf fd, unmapped below.
    let view = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            BUF,
            libc::PROT_READ,
            libc::MAP_SHARED,
            b.dmabuf_fd(),
            0,
        )
    };
    if view == libc::MAP_FAILED {
        return Err(format!(
            "mmap(dma-buf fd): {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: view is a live BUF-byte read-only mapping.
    let same = compare(
        "dma-buf mmap vs memfd view",
        unsafe { std::slice::from_raw_parts(view.cast::<u8>(), BUF) },
        b.bytes(),
    );
    // SAFETY: unmapping our own mapping once.
    unsafe { libc::munmap(view, BUF) };
    same?;
    // The kernel's rules: an unsealed memfd and a non-page-aligned size are refused.
    // SAFETY: memfd_create with a static name; the fd is owned right after.
    let raw = unsafe { libc::memfd_create(c"iud-unsealed".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: raw is a fresh fd nothing else owns.
    let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on our own fd.
    unsafe { libc::ftruncate(unsealed.as_raw_fd(), 1 << 16) };
    let r_unsealed = udmabuf::create_raw(unsealed.as_raw_fd(), 0, 1 << 16)
        .map(|_| ())
        .err();
    let r_unaligned = udmabuf::create_raw(b.memfd(), 0, 4096 + 512)
        .map(|_| ())
        .err();
    let shown = |r: Option<i32>| r.map_or("accepted".to_owned(), |e| format!("-{}", errno_str(e)));
    if r_unsealed.is_none() || r_unaligned.is_none() {
        return Err(format!(
            "udmabuf accepted an unsealed memfd ({}) or an unaligned size ({})",
            shown(r_unsealed),
            shown(r_unaligned)
        ));
    }
    Ok(Outcome::Pass(format!(
        "udmabuf {how}, size_limit_mb {limit}: {} dma-buf (exp_name udmabuf), its mmap equals the memfd; memfd without F_SEAL_SHRINK -> {}, size 4608 -> {}",
        size_str(BUF as u64),
        shown(r_unsealed),
        shown(r_unaligned)
    )))
}

/// d2: the pages behind a udmabuf, used as ordinary registered buffers (the engine's host
/// fallback when it cannot register the DMA-BUF itself).
pub fn pages_as_fixed_buffers(device: &str) -> TestResult {
    if std::fs::metadata(udmabuf::DEVICE).is_err() {
        return Ok(Outcome::Skip(format!("no {}", udmabuf::DEVICE)));
    }
    let dev = BlockDev::open(device, true)?;
    let mut src = HostDmabuf::create(BUF)?;
    let mut dst = HostDmabuf::create(BUF)?;
    let mut ring = IoUring::new(8).map_err(|e| format!("io_uring_setup: {e}"))?;
    let iov = |b: &HostDmabuf| libc::iovec {
        iov_base: b.ptr().cast(),
        iov_len: b.len(),
    };
    // SAFETY: both mappings outlive the ring (declared before it, so dropped after it).
    unsafe { ring.submitter().register_buffers(&[iov(&src), iov(&dst)]) }
        .map_err(|e| format!("IORING_REGISTER_BUFFERS on memfd pages: {e}"))?;
    let mut rng = Rng::new();
    rng.fill(src.bytes_mut());
    rng.fill(dst.bytes_mut());
    let off = BASE + (48 << 20);
    let fd = types::Fd(dev.fd());
    let w = opcode::WriteFixed::new(fd, src.ptr(), BUF as u32, 0)
        .offset(off)
        .build()
        .user_data(0);
    let r = submit_all(&mut ring, &[w])?;
    if r[0] as usize != BUF {
        return Err(format!(
            "WRITE_FIXED from memfd pages: {}",
            res_str(r[0] as i64)
        ));
    }
    let rd = opcode::ReadFixed::new(fd, dst.ptr(), BUF as u32, 1)
        .offset(off)
        .build()
        .user_data(0);
    let r = submit_all(&mut ring, &[rd])?;
    if r[0] as usize != BUF {
        return Err(format!(
            "READ_FIXED into memfd pages: {}",
            res_str(r[0] as i64)
        ));
    }
    compare("READ_FIXED into udmabuf pages", dst.bytes(), src.bytes())?;
    compare(
        "buffered re-read of the device",
        &read_buffered(device, off, BUF)?,
        src.bytes(),
    )?;
    Ok(Outcome::Pass(format!("{} WRITE_FIXED/READ_FIXED through the udmabufs' memfd pages registered as plain buffers: identical", size_str(BUF as u64))))
}

/// Submits one entry; resubmits it while it completes with -EAGAIN (dma-buf mappings can be
/// invalidated under in-flight I/O), at most 100 times. Returns the last result.
fn submit_retrying(ring: &mut IoUring, e: io_uring::squeue::Entry) -> Result<i32, String> {
    for _ in 0..100 {
        let r = submit_all(ring, &[e.clone().user_data(0)])?[0];
        if r != -libc::EAGAIN {
            return Ok(r);
        }
    }
    Ok(-libc::EAGAIN)
}

/// d3: udmabufs registered as DMA-BUF buffers against the O_DIRECT NVMe fd. Kernels with the
/// uAPI: byte-for-byte verified WRITE_FIXED/READ_FIXED addressed by dma-buf offsets. Kernels
/// without: the registration is refused with -EINVAL, the ring still works, every fd closes.
pub fn dmabuf_registration(device: &str, probe: Option<Probe>) -> TestResult {
    if std::fs::metadata(udmabuf::DEVICE).is_err() {
        return Ok(Outcome::Skip(format!("no {}", udmabuf::DEVICE)));
    }
    let probe = match probe {
        Some(p) => p,
        None => dmabuf_uapi::probe().map_err(|e| format!("probe: {e}"))?,
    };
    let fds_before = open_fd_count();
    let (outcome, fds) = {
        let dev = BlockDev::open(device, true)?;
        let mut src = HostDmabuf::create(BUF)?;
        let mut dst = HostDmabuf::create(BUF)?;
        // Plain ring (no IOPOLL: the uAPI refuses DMA-BUF slots on IOPOLL rings).
        let mut ring = IoUring::new(16).map_err(|e| format!("io_uring_setup: {e}"))?;
        ring.submitter()
            .register_buffers_sparse(4)
            .map_err(|e| format!("sparse buffer table: {e}"))?;
        let fds = [
            src.dmabuf_fd(),
            src.memfd(),
            dst.dmabuf_fd(),
            dst.memfd(),
            ring.as_raw_fd(),
            dev.fd(),
        ];
        let rfd = ring.as_raw_fd();
        let outcome = match probe.support {
            Support::Supported => {
                dmabuf_round_trips(&mut ring, rfd, &dev, device, &mut src, &mut dst)
            }
            _ => match dmabuf_uapi::register_dmabuf(rfd, 0, src.dmabuf_fd(), dev.fd()) {
                Ok(()) => Err(
                    "the probe said the uAPI is absent, yet a DMA-BUF registration succeeded"
                        .to_owned(),
                ),
                Err(e) if e == libc::EINVAL => {
                    // The ring must still be usable.
                    let nop = submit_all(&mut ring, &[opcode::Nop::new().build().user_data(0)])?;
                    let control = dmabuf_uapi::update_plain(
                        rfd,
                        0,
                        &[libc::iovec {
                            iov_base: std::ptr::null_mut(),
                            iov_len: 0,
                        }],
                    );
                    if nop[0] != 0 || control != 1 {
                        Err(format!(
                            "after the refused registration: NOP -> {}, plain slot update -> {}",
                            res_str(nop[0] as i64),
                            res_str(control)
                        ))
                    } else {
                        Ok(Outcome::Pass(String::new()))
                    }
                }
                Err(e) => Err(format!(
                    "DMA-BUF registration on a kernel without the uAPI returned -{} (want -EINVAL)",
                    errno_str(e)
                )),
            },
        };
        (outcome, fds)
    };
    // Everything above is dropped: dma-bufs, memfds, ring and device fds must all be closed.
    let still_open: Vec<i32> = fds.iter().copied().filter(|&fd| fd_is_open(fd)).collect();
    let fds_after = open_fd_count();
    if !still_open.is_empty() || fds_after != fds_before {
        return Err(format!("fds left open after drop: {still_open:?} ({fds_before} open before, {fds_after} after)"));
    }
    match outcome? {
        Outcome::Pass(s) if s.is_empty() => Ok(Outcome::Pass(format!(
            "kernel without the io_uring DMA-BUF uAPI: registering a {} udmabuf against O_DIRECT {device} -> -EINVAL, ring still usable (NOP 0, plain update 1), all {} fds closed",
            size_str(BUF as u64),
            fds.len()
        ))),
        Outcome::Pass(s) => Ok(Outcome::Pass(format!("{s}; all {} fds closed", fds.len()))),
        other => Ok(other),
    }
}

fn dmabuf_round_trips(
    ring: &mut IoUring,
    rfd: i32,
    dev: &BlockDev,
    device: &str,
    src: &mut HostDmabuf,
    dst: &mut HostDmabuf,
) -> TestResult {
    dmabuf_uapi::register_dmabuf(rfd, 0, src.dmabuf_fd(), dev.fd())
        .map_err(|e| format!("register src dma-buf in slot 0: -{}", errno_str(e)))?;
    dmabuf_uapi::register_dmabuf(rfd, 1, dst.dmabuf_fd(), dev.fd())
        .map_err(|e| format!("register dst dma-buf in slot 1: -{}", errno_str(e)))?;
    let lbs = dev.lbs as u64;
    let fd = types::Fd(dev.fd());
    let mut rng = Rng::new();
    // (length, offset in the src dma-buf, offset in the dst dma-buf, device offset)
    let cases: [(u64, u64, u64, u64); 6] = [
        (4096, 0, 0, BASE),
        (lbs, lbs, 4096 + lbs, BASE + (1 << 20) + lbs),
        (65536, 4096, 8192, BASE + (2 << 20)),
        (528384, 0, 4096, BASE + (3 << 20) + lbs),
        (1 << 20, 1 << 20, 0, BASE + (8 << 20)),
        (BUF as u64, 0, 0, BASE + (16 << 20)),
    ];
    let mut done = Vec::new();
    for (len, s_off, d_off, dev_off) in cases {
        let (n, s, d) = (len as usize, s_off as usize, d_off as usize);
        rng.fill(&mut src.bytes_mut()[s..s + n]);
        rng.fill(&mut dst.bytes_mut()[d..d + n]);
        // addr = byte offset into the dma-buf (its base "address" is 0).
        let w = opcode::WriteFixed::new(fd, s_off as *const u8, len as u32, 0)
            .offset(dev_off)
            .build();
        let r = submit_retrying(ring, w)?;
        if r as u64 != len {
            return Err(format!(
                "WRITE_FIXED {} from dma-buf offset {s_off} to device {dev_off}: {}",
                size_str(len),
                res_str(r as i64)
            ));
        }
        let rd = opcode::ReadFixed::new(fd, d_off as *mut u8, len as u32, 1)
            .offset(dev_off)
            .build();
        let r = submit_retrying(ring, rd)?;
        if r as u64 != len {
            return Err(format!(
                "READ_FIXED {} from device {dev_off} to dma-buf offset {d_off}: {}",
                size_str(len),
                res_str(r as i64)
            ));
        }
        compare(
            &format!("{} read into the dst dma-buf", size_str(len)),
            &dst.bytes()[d..d + n],
            &src.bytes()[s..s + n],
        )?;
        compare(
            &format!("{} buffered re-read of the device", size_str(len)),
            &read_buffered(device, dev_off, n)?,
            &src.bytes()[s..s + n],
        )?;
        done.push(size_str(len));
    }
    dmabuf_uapi::clear_slot(rfd, 0).map_err(|e| format!("clear slot 0: -{}", errno_str(e)))?;
    dmabuf_uapi::clear_slot(rfd, 1).map_err(|e| format!("clear slot 1: -{}", errno_str(e)))?;
    Ok(Outcome::Pass(format!(
        "kernel has io_uring DMA-BUF uAPI: two {} udmabufs registered against O_DIRECT {device}; WRITE_FIXED/READ_FIXED of {} by dma-buf offset: identical in the dma-buf and on disk; slots cleared",
        size_str(BUF as u64),
        done.join(", ")
    )))
}

/// d4: the documented refusals of the DMA-BUF registration and I/O (kernels with the uAPI).
pub fn dmabuf_refusals(device: &str, probe: Option<Probe>) -> TestResult {
    match probe.map(|p| p.support) {
        Some(Support::Supported) => {}
        _ => return Ok(Outcome::Skip("kernel without the io_uring DMA-BUF uAPI (probe -EINVAL): nothing to refuse; needs a kernel with the patch series".into())),
    }
    if std::fs::metadata(udmabuf::DEVICE).is_err() {
        return Ok(Outcome::Skip(format!("no {}", udmabuf::DEVICE)));
    }
    let dev = BlockDev::open(device, true)?;
    let buffered = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .map_err(|e| format!("open({device}): {e}"))?;
    let other = BlockDev::open(device, true)?;
    let regular = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open("/tmp/iud-lab-regular")
        .map_err(|e| format!("create /tmp file: {e}"))?;
    let b = HostDmabuf::create(BUF)?;
    let mut ring = IoUring::new(8).map_err(|e| format!("io_uring_setup: {e}"))?;
    let rfd = ring.as_raw_fd();
    let mut seen = Vec::new();
    let mut bad = Vec::new();
    let mut check = |what: &str, got: Result<i32, i32>, want: i32| {
        let shown = match got {
            Ok(r) => res_str(r as i64),
            Err(e) => format!("-{}", errno_str(e)),
        };
        seen.push(format!("{what} -> {shown}"));
        if got != Err(want) && got != Ok(-want) {
            bad.push(format!("{what}: got {shown}, want -{}", errno_str(want)));
        }
    };
    check(
        "registration without a buffer table",
        dmabuf_uapi::register_dmabuf(rfd, 0, b.dmabuf_fd(), dev.fd()).map(|_| 1),
        libc::ENXIO,
    );
    ring.submitter()
        .register_buffers_sparse(4)
        .map_err(|e| format!("sparse buffer table: {e}"))?;
    check(
        "target a regular file",
        dmabuf_uapi::register_dmabuf(rfd, 0, b.dmabuf_fd(), regular.as_raw_fd()).map(|_| 1),
        libc::EOPNOTSUPP,
    );
    check(
        "target the device without O_DIRECT",
        dmabuf_uapi::register_dmabuf(rfd, 0, b.dmabuf_fd(), buffered.as_raw_fd()).map(|_| 1),
        libc::EINVAL,
    );
    check(
        "target fd -1",
        dmabuf_uapi::register_dmabuf(rfd, 0, b.dmabuf_fd(), -1).map(|_| 1),
        libc::EBADF,
    );
    dmabuf_uapi::register_dmabuf(rfd, 0, b.dmabuf_fd(), dev.fd())
        .map_err(|e| format!("register against O_DIRECT {device}: -{}", errno_str(e)))?;
    let lbs = dev.lbs;
    let rd = |fd: i32, addr: u64, len: u32| {
        opcode::ReadFixed::new(types::Fd(fd), addr as *mut u8, len, 0)
            .offset(BASE)
            .build()
    };
    check(
        "READ_FIXED through another open file of the device",
        submit_retrying(&mut ring, rd(other.fd(), 0, lbs)).map(Ok)?,
        libc::EBADF,
    );
    check(
        "READ_FIXED past the dma-buf end",
        submit_retrying(&mut ring, rd(dev.fd(), BUF as u64 - lbs as u64, 2 * lbs)).map(Ok)?,
        libc::EFAULT,
    );
    let iopoll: std::io::Result<IoUring> = IoUring::builder().setup_iopoll().build(8);
    if let Ok(ip) = iopoll {
        ip.submitter()
            .register_buffers_sparse(1)
            .map_err(|e| format!("iopoll sparse table: {e}"))?;
        // v3 accepts it; versions after v3 are reported to refuse it (EOPNOTSUPP; xnvme's docs,
        // built against v5). The engine never registers DMA-BUFs on an IOPOLL ring (and refuses
        // to), so either answer is recorded, not asserted.
        let r = dmabuf_uapi::register_dmabuf(ip.as_raw_fd(), 0, b.dmabuf_fd(), dev.fd());
        seen.push(format!(
            "registration on an IOPOLL ring -> {}",
            r.map_or_else(|e| format!("-{}", errno_str(e)), |()| "accepted".to_owned())
        ));
    }
    dmabuf_uapi::clear_slot(rfd, 0).map_err(|e| format!("clear slot 0: -{}", errno_str(e)))?;
    let _ = std::fs::remove_file("/tmp/iud-lab-regular");
    if bad.is_empty() {
        Ok(Outcome::Pass(seen.join("; ")))
    } else {
        Err(format!("{} (all: {})", bad.join("; "), seen.join("; ")))
    }
}
