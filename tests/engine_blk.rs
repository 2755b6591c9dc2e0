//! BLK_SEG through the engine on loop devices (losetup --direct-io=on, 512 B and 4 KiB logical
//! blocks): round trips in path and fd mode, the capacity edge, and every alignment and bounds
//! refusal. Needs root and loop devices; without them each test records a skip (test_support) and returns.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::{Error, ErrorKind};
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::test_support::skip;

mod common;
use common::*;

const DEVICE_BYTES: u64 = 64 << 20;

/// A loop device over a sparse image in /var/tmp, detached and removed on drop.
struct Loop {
    dev: String,
    image: String,
}

impl Loop {
    fn new(sector: u32) -> Result<Loop, String> {
        let image = format!(
            "/var/tmp/iud-blk-test-{}-{sector}-{}.img",
            std::process::id(),
            rand_u64()
        );
        let f = std::fs::File::create(&image).map_err(|e| format!("create {image}: {e}"))?;
        f.set_len(DEVICE_BYTES).map_err(|e| e.to_string())?;
        let out = Command::new("losetup")
            .args([
                "-f",
                "--show",
                "--direct-io=on",
                "-b",
                &sector.to_string(),
                &image,
            ])
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&image);
            return Err(format!(
                "losetup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Loop {
            dev: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            image,
        })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
        let _ = std::fs::remove_file(&self.image);
    }
}

fn rand_u64() -> u64 {
    let mut x = 0u64;
    // SAFETY: getrandom writes up to 8 bytes into x.
    unsafe { libc::getrandom((&mut x as *mut u64).cast(), 8, 0) };
    x
}

/// A loop device, or None after recording why the test is skipped.
fn loop_device(sector: u32) -> Option<Loop> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("needs root for losetup");
        return None;
    }
    match Loop::new(sector) {
        Ok(l) => Some(l),
        Err(e) => {
            skip(&format!("no loop device ({e})"));
            None
        }
    }
}

/// Runs a DRAM <-> BLK transfer to completion.
fn run(e: &Engine, op: i32, local: &[iud_desc], remote: &[iud_desc]) -> Result<(), Error> {
    run_kind(e, op, BLK, local, remote)
}

fn prep_err(e: &Engine, local: &[iud_desc], remote: &[iud_desc]) -> Error {
    e.prep(WRITE, DRAM, local, BLK, remote, AGENT)
        .expect_err("prep must refuse")
}

/// WRITE then READ of mixed-size blocks over the whole device, verified against the device.
fn round_trip(sector: u32, path_mode: bool) {
    let name = format!(
        "blk_round_trip_{sector}_{}",
        if path_mode { "path" } else { "fd" }
    );
    let Some(lo) = loop_device(sector) else {
        return;
    };
    let e = Engine::new(AGENT, [("max_io_size", "262144")]).unwrap();
    let src = Buf::random(DEVICE_BYTES as usize);
    let dst = Buf::random(DEVICE_BYTES as usize);
    let _keep_open;
    let (dev_id, meta) = if path_mode {
        (77u64, format!("rw,direct:{}", lo.dev))
    } else {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&lo.dev)
            .unwrap();
        let fd = f.as_raw_fd() as u64;
        _keep_open = f;
        (fd, String::new())
    };
    let ms = e.register(DRAM, src.addr(), DEVICE_BYTES, 0, "").unwrap();
    let md = e.register(DRAM, dst.addr(), DEVICE_BYTES, 0, "").unwrap();
    let mb = e.register(BLK, 0, DEVICE_BYTES, dev_id, &meta).unwrap();
    let unit = sector as u64;
    let mut blocks = Vec::new();
    let mut off = 0;
    for i in 0.. {
        if off >= DEVICE_BYTES {
            break;
        }
        let len = ([1, 8, 3, 256, 1, 2048, 7][i % 7] * unit).min(DEVICE_BYTES - off);
        blocks.push((off, len));
        off += len;
    }
    let lw: Vec<_> = blocks
        .iter()
        .map(|&(o, n)| desc(src.addr() + o, n, 0, ms))
        .collect();
    let lr: Vec<_> = blocks
        .iter()
        .map(|&(o, n)| desc(dst.addr() + o, n, 0, md))
        .collect();
    let r: Vec<_> = blocks
        .iter()
        .map(|&(o, n)| desc(o, n, dev_id, mb))
        .collect();
    run(&e, WRITE, &lw, &r).unwrap();
    run(&e, READ, &lr, &r).unwrap();
    assert!(src.bytes() == dst.bytes(), "{name}: data read back differs");
    let image = std::fs::read(&lo.image).unwrap();
    assert!(
        image == src.bytes(),
        "{name}: backing image differs from what was written"
    );
    for m in [ms, md, mb] {
        e.deregister(m).unwrap();
    }
}

#[test]
fn blk_round_trip_512_path_mode() {
    round_trip(512, true);
}

#[test]
fn blk_round_trip_4096_fd_mode() {
    round_trip(4096, false);
}

#[test]
fn blk_refuses_misalignment_and_ranges_past_the_end() {
    let Some(lo) = loop_device(4096) else { return };
    let e = Engine::new(AGENT, std::iter::empty()).unwrap();
    let buf = Buf::random(1 << 20);
    let m = e.register(DRAM, buf.addr(), 1 << 20, 0, "").unwrap();
    let meta = format!("rw,direct:{}", lo.dev);

    // Registration rules.
    let past = e
        .register(BLK, DEVICE_BYTES - 4096, 8192, 5, &meta)
        .unwrap_err();
    assert!(
        past.message.contains("runs past the end of the device"),
        "{}",
        past.message
    );
    let buffered = e
        .register(BLK, 0, 4096, 5, &format!("rw:{}", lo.dev))
        .unwrap_err();
    assert!(
        buffered.message.contains("O_DIRECT"),
        "{}",
        buffered.message
    );
    let not_block = e
        .register(BLK, 0, 4096, 5, &format!("rw,direct:{}", lo.image))
        .unwrap_err();
    assert!(
        not_block.message.contains("not a block device"),
        "{}",
        not_block.message
    );

    let mb = e.register(BLK, 0, DEVICE_BYTES, 5, &meta).unwrap();
    // Alignment to the 4 KiB logical block: offset, length, memory address.
    for (mem_off, dev_off, len) in [(0u64, 512u64, 4096u64), (0, 0, 512), (512, 0, 4096)] {
        let err = prep_err(
            &e,
            &[desc(buf.addr() + mem_off, len, 0, m)],
            &[desc(dev_off, len, 5, mb)],
        );
        assert_eq!(err.kind, ErrorKind::InvalidParam);
        assert!(err.message.contains("multiples of 4096"), "{}", err.message);
    }
    // Past the registration (= the device end).
    let err = prep_err(
        &e,
        &[desc(buf.addr(), 8192, 0, m)],
        &[desc(DEVICE_BYTES - 4096, 8192, 5, mb)],
    );
    assert_eq!(err.kind, ErrorKind::NotFound);
    // A FILE list naming a BLK registration.
    let kinds = e
        .prep(
            WRITE,
            DRAM,
            &[desc(buf.addr(), 4096, 0, m)],
            FILE,
            &[desc(0, 4096, 5, mb)],
            AGENT,
        )
        .unwrap_err();
    assert!(
        kinds
            .message
            .contains("not covered by any live FILE_SEG registration")
            && kinds.message.contains("a BLK_SEG registration covers it"),
        "{}",
        kinds.message
    );

    // The capacity edge: the last block moves, and the engine still works after every refusal.
    let tail = [desc(DEVICE_BYTES - 4096, 4096, 5, mb)];
    run(&e, WRITE, &[desc(buf.addr(), 4096, 0, m)], &tail).unwrap();
    run(&e, READ, &[desc(buf.addr() + 4096, 4096, 0, m)], &tail).unwrap();
    assert!(buf.bytes()[..4096] == buf.bytes()[4096..8192]);
    let image = std::fs::read(&lo.image).unwrap();
    assert!(image[(DEVICE_BYTES - 4096) as usize..] == buf.bytes()[..4096]);
}

#[test]
fn dram_dmabuf_on_is_refused_with_the_reason_when_the_kernel_lacks_the_uapi() {
    use io_uring_dmabuf::engine::dmabuf_support;
    if dmabuf_support().is_available() {
        return skip("this kernel has the io_uring DMA-BUF uAPI (the NVMe lab covers it)");
    }
    let e = Engine::new(AGENT, [("dram_dmabuf", "on")]).unwrap();
    let buf = Buf::random(1 << 16);
    let err = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(
        err.message.contains("dram_dmabuf=on")
            && err
                .message
                .contains("kernel without the io_uring DMA-BUF uAPI"),
        "{}",
        err.message
    );
    assert!(
        !err.message.contains("7.4"),
        "no kernel version has the uAPI: {}",
        err.message
    );
    // auto falls back to fixed buffers and moves data.
    let Some(lo) = loop_device(4096) else { return };
    let auto = Engine::new(AGENT, [("dram_dmabuf", "auto")]).unwrap();
    let m = auto.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mb = auto
        .register(BLK, 0, 1 << 16, 9, &format!("rw,direct:{}", lo.dev))
        .unwrap();
    run(
        &auto,
        WRITE,
        &[desc(buf.addr(), 1 << 16, 0, m)],
        &[desc(0, 1 << 16, 9, mb)],
    )
    .unwrap();
    assert!(std::fs::read(&lo.image).unwrap()[..1 << 16] == buf.bytes()[..]);
}

/// The fd rule (mem/file.rs) on BLK_SEG: a block-device fd closed, or closed and its number
/// reused for another file, before the first post or between posts, is refused naming fd and
/// cause; the device, the other file and memory are unchanged. (Other tests of this binary open
/// files meanwhile, so a closed number may already name theirs: either cause is a refusal.)
#[test]
fn blk_a_closed_or_reused_fd_is_refused() {
    let Some(lo) = loop_device(512) else { return };
    let other = format!("{}.other", lo.image);
    let other_bytes = Buf::new(1 << 20, 21).bytes().to_vec();
    for op in [WRITE, READ] {
        for fate in [FdFate::Closed, FdFate::Reused] {
            for between_posts in [false, true] {
                let case = format!("op {op} / {fate:?} / between posts {between_posts}");
                std::fs::write(&other, &other_bytes).unwrap();
                let e = Engine::new(AGENT, std::iter::empty()).expect("engine");
                let buf = Buf::new(1 << 20, 22);
                let fd = open_fd(std::path::Path::new(&lo.dev), libc::O_DIRECT);
                let m = e.register(DRAM, buf.addr(), 1 << 20, 0, "").unwrap();
                let mb = e.register(BLK, 0, DEVICE_BYTES, fd as u64, "").unwrap();
                let local: Vec<_> = (0..8)
                    .map(|i| desc(buf.addr() + i * 65536, 65536, 0, m))
                    .collect();
                let remote: Vec<_> = (0..8)
                    .map(|i| desc(i * 3 * 65536, 65536, fd as u64, mb))
                    .collect();
                let req = e
                    .prep(op, DRAM, &local, BLK, &remote, AGENT)
                    .unwrap_or_else(|err| panic!("{case}: prep: {}", err.message));
                let post = |e: &Engine| -> Result<(), String> {
                    let mut p = e.post(&req, op, 8, 8).map_err(|err| err.message)?;
                    while p == io_uring_dmabuf::uring::Progress::InFlight {
                        p = e.check(&req).map_err(|err| err.message)?;
                    }
                    Ok(())
                };
                if between_posts {
                    post(&e).unwrap_or_else(|err| panic!("{case}: first post: {err}"));
                }
                let (dev_before, mem_before) =
                    (std::fs::read(&lo.image).unwrap(), buf.bytes().to_vec());
                doom_fd(fd, fate, std::path::Path::new(&other), libc::O_DIRECT);
                let err = post(&e).expect_err(&format!("{case}: the post must be refused"));
                assert!(
                    err.contains(&format!("fd {fd} registered as BLK_SEG for {}", lo.dev)),
                    "{case}: {err}"
                );
                assert!(
                    err.contains("is no longer open")
                        || err.contains("now refers to a different file"),
                    "{case}: {err}"
                );
                assert!(
                    std::fs::read(&lo.image).unwrap() == dev_before,
                    "{case}: the device changed"
                );
                assert!(
                    std::fs::read(&other).unwrap() == other_bytes,
                    "{case}: the other file changed"
                );
                assert!(
                    buf.bytes() == mem_before.as_slice(),
                    "{case}: memory changed"
                );
                e.release(req).map_err(|(_, err)| err.message).unwrap();
                e.deregister(mb).unwrap();
                e.deregister(m).unwrap();
                if fate == FdFate::Reused {
                    // SAFETY: fd names the other file now, opened by doom_fd for the test.
                    unsafe { libc::close(fd) };
                }
            }
        }
    }
    let _ = std::fs::remove_file(&other);
}
