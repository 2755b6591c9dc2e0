//! Engine-level tests: the Rust engine driven directly (no NIXL), on real files with real
//! io_uring. The NIXL-level proofs live in tests/python and tests/nixl_sys_roundtrip.rs; these
//! pin down the engine's own rules with exact messages.

use std::ffi::c_void;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::ErrorKind;
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;

mod common;
use common::*;

fn engine(params: &[(&str, &str)]) -> Engine {
    Engine::new(AGENT, params.iter().copied()).expect("engine")
}

fn temp_file(direct: bool) -> (TestDir, File) {
    let dir = TestDir::new("engine-test");
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    // A number of its own: a test that closes it must not see another test's file under it.
    let f = lone_file(opts.open(dir.path.join("data")).expect("open temp file"));
    (dir, f)
}

/// Runs a DRAM <-> FILE transfer to completion.
fn run(
    e: &Engine,
    op: i32,
    local: &[iud_desc],
    remote: &[iud_desc],
) -> Result<(), io_uring_dmabuf::error::Error> {
    run_kind(e, op, FILE, local, remote)
}

/// Splits `total` bytes into blocks of mixed sizes (multiples of `unit`).
fn mixed_blocks(total: u64, unit: u64, seed: u64) -> Vec<(u64, u64)> {
    let sizes = [1, 2, 8, 3, 64, 1, 16, 5, 256, 1];
    let mut out = Vec::new();
    let (mut off, mut i) = (0, seed as usize);
    while off < total {
        let len = (sizes[i % sizes.len()] * unit).min(total - off);
        out.push((off, len));
        off += len;
        i += 1;
    }
    out
}

fn roundtrip(params: &[(&str, &str)], direct: bool, unit: u64) {
    let e = engine(params);
    let total = 8 << 20;
    let src = Buf::new(total, 1);
    let dst = Buf::new(total, 2);
    let (_d, f) = temp_file(direct);
    let fd = f.as_raw_fd() as u64;
    let m_src = e.register(DRAM, src.addr(), total as u64, 0, "").unwrap();
    let m_dst = e.register(DRAM, dst.addr(), total as u64, 0, "").unwrap();
    let m_file = e.register(FILE, 0, total as u64, fd, "").unwrap();
    // Memory order differs from file order so that nothing lines up by accident.
    let blocks = mixed_blocks(total as u64, unit, 3);
    let n = blocks.len() as u64;
    let mem_of = |i: u64, (_, len): (u64, u64)| {
        blocks
            .iter()
            .rev()
            .take((n - i) as usize)
            .map(|b| b.1)
            .sum::<u64>()
            - len
    };
    let l_w: Vec<_> = blocks
        .iter()
        .enumerate()
        .map(|(i, &b)| desc(src.addr() + mem_of(i as u64, b), b.1, 0, m_src))
        .collect();
    let l_r: Vec<_> = blocks
        .iter()
        .enumerate()
        .map(|(i, &b)| desc(dst.addr() + mem_of(i as u64, b), b.1, 0, m_dst))
        .collect();
    let r: Vec<_> = blocks
        .iter()
        .map(|&(off, len)| desc(off, len, fd, m_file))
        .collect();
    run(&e, WRITE, &l_w, &r).unwrap();
    run(&e, READ, &l_r, &r).unwrap();
    assert!(
        src.bytes() == dst.bytes(),
        "data read back differs from data written"
    );
    let mut on_disk = Vec::new();
    File::open(format!("/proc/self/fd/{fd}"))
        .unwrap()
        .read_to_end(&mut on_disk)
        .unwrap();
    for (i, &(off, len)) in blocks.iter().enumerate() {
        let m = mem_of(i as u64, (off, len)) as usize;
        assert!(
            on_disk[off as usize..(off + len) as usize] == src.bytes()[m..m + len as usize],
            "file block {i} differs"
        );
    }
    e.deregister(m_src).unwrap();
    e.deregister(m_dst).unwrap();
    e.deregister(m_file).unwrap();
}

/// NIXL's storage backends take the file as either list, the op naming the file's direction
/// (Dynamo's KVBM onboards disk blocks as READ with the file local): the same op on swapped
/// lists moves the same bytes the same way.
#[test]
fn the_storage_side_may_be_the_local_list_and_the_op_names_its_direction() {
    let e = engine(&[]);
    let n = 1u64 << 16;
    let src = Buf::new(n as usize, 31);
    let dst = Buf::new(n as usize, 32);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let ms = e.register(DRAM, src.addr(), n, 0, "").unwrap();
    let md = e.register(DRAM, dst.addr(), n, 0, "").unwrap();
    let mf = e.register(FILE, 0, n, fd, "").unwrap();
    let halves = |base: u64, dev: u64, md| {
        [
            desc(base, n / 2, dev, md),
            desc(base + n / 2, n / 2, dev, md),
        ]
    };
    run_lists(
        &e,
        WRITE,
        FILE,
        &halves(0, fd, mf),
        DRAM,
        &halves(src.addr(), 0, ms),
    )
    .expect("WRITE, file local");
    let mut on_disk = vec![0u8; n as usize];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut on_disk, 0).unwrap();
    assert!(
        on_disk == src.bytes(),
        "WRITE with the file as the local list wrote memory to the file"
    );
    run_lists(
        &e,
        READ,
        FILE,
        &halves(0, fd, mf),
        DRAM,
        &halves(dst.addr(), 0, md),
    )
    .expect("READ, file local");
    assert!(
        dst.bytes() == src.bytes(),
        "READ with the file as the local list read the file into memory"
    );
    let err = run_lists(&e, READ, FILE, &halves(0, fd, mf), FILE, &halves(0, fd, mf)).unwrap_err();
    assert!(
        err.message.contains("unsupported list types"),
        "{}",
        err.message
    );
    for m in [ms, md, mf] {
        e.deregister(m).unwrap();
    }
}

#[test]
fn buffered_round_trip_with_fixed_buffers_and_files() {
    roundtrip(&[], false, 512);
}

#[test]
fn buffered_round_trip_written_inline_by_the_posting_thread() {
    roundtrip(&[("inline_write_max", "16777216")], false, 512);
}

#[test]
fn buffered_round_trip_with_plain_buffers_and_fds() {
    roundtrip(
        &[
            ("fixed_buffers", "off"),
            ("fixed_files", "false"),
            ("inline_write_max", "0"),
        ],
        false,
        512,
    );
}

#[test]
fn direct_round_trip_with_small_split_size() {
    roundtrip(&[("max_io_size", "8192")], true, 4096);
}

#[test]
fn read_past_end_of_file_names_fd_offset_and_length() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 20, 4);
    let (_d, f) = temp_file(false);
    f.set_len(6000).unwrap();
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 20, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 20, fd, "").unwrap();
    // Starts inside the file and runs past its end: a short read, then a resubmitted remainder
    // that hits EOF.
    let err = run(
        &e,
        READ,
        &[desc(buf.addr(), 8192, 0, m)],
        &[desc(4096, 8192, fd, mf)],
    )
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Backend);
    assert!(
        err.message.contains("read past end of file"),
        "{}",
        err.message
    );
    assert!(
        err.message
            .contains(&format!("fd {fd} offset 6000 length 6288")),
        "{}",
        err.message
    );
    // The engine keeps working.
    run(
        &e,
        READ,
        &[desc(buf.addr(), 4096, 0, m)],
        &[desc(0, 4096, fd, mf)],
    )
    .unwrap();
}

#[test]
fn closed_fd_is_refused_at_post() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 16, 5);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, fd, "").unwrap();
    drop(f);
    let err = run(
        &e,
        WRITE,
        &[desc(buf.addr(), 4096, 0, m)],
        &[desc(0, 4096, fd, mf)],
    )
    .unwrap_err();
    assert!(err.message.contains("no longer open"), "{}", err.message);
}

#[test]
fn direct_misalignment_is_refused_at_prep() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 16, 6);
    let (_d, f) = temp_file(true);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, fd, "").unwrap();
    for (mem_off, file_off, len) in [(0, 100, 4096), (0, 0, 1000), (1, 0, 4096)] {
        let l = [desc(buf.addr() + mem_off, len, 0, m)];
        let r = [desc(file_off, len, fd, mf)];
        let err = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidParam);
        assert!(err.message.contains("O_DIRECT"), "{}", err.message);
    }
    run(
        &e,
        WRITE,
        &[desc(buf.addr(), 4096, 0, m)],
        &[desc(4096, 4096, fd, mf)],
    )
    .unwrap();
}

#[test]
fn prep_rejects_wrong_kinds_counts_lengths_ranges_and_agents() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 16, 7);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 4096, fd, "").unwrap();
    let l = [desc(buf.addr(), 4096, 0, m)];
    let r = [desc(0, 4096, fd, mf)];
    {
        assert_eq!(
            e.prep(WRITE, DRAM, &l, DRAM, &l, AGENT).unwrap_err().kind,
            ErrorKind::InvalidParam
        );
        assert_eq!(
            e.prep(WRITE, FILE, &r, FILE, &r, AGENT).unwrap_err().kind,
            ErrorKind::InvalidParam
        );
        assert_eq!(
            e.prep(WRITE, DRAM, &l, FILE, &[], AGENT).unwrap_err().kind,
            ErrorKind::Mismatch
        );
        assert_eq!(
            e.prep(WRITE, DRAM, &[desc(buf.addr(), 512, 0, m)], FILE, &r, AGENT)
                .unwrap_err()
                .kind,
            ErrorKind::Mismatch
        );
        assert_eq!(
            e.prep(WRITE, DRAM, &l, FILE, &[desc(2048, 4096, fd, mf)], AGENT)
                .unwrap_err()
                .kind,
            ErrorKind::NotFound
        );
        // A null MD is only a missing hint: the descriptor is found by what it names.
        e.release(
            e.prep(
                WRITE,
                DRAM,
                &l,
                FILE,
                &[desc(0, 4096, fd, std::ptr::null())],
                AGENT,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            e.prep(
                WRITE,
                DRAM,
                &l,
                FILE,
                &[desc(0, 4096, fd + 1, std::ptr::null())],
                AGENT
            )
            .unwrap_err()
            .kind,
            ErrorKind::NotFound
        );
        assert_eq!(
            e.prep(WRITE, DRAM, &l, FILE, &r, "someone-else")
                .unwrap_err()
                .kind,
            ErrorKind::InvalidParam
        );
        assert_eq!(
            e.prep(7, DRAM, &l, FILE, &r, AGENT).unwrap_err().kind,
            ErrorKind::InvalidParam
        );
    }
    run(&e, WRITE, &l, &r).unwrap();
}

#[test]
fn path_mode_opens_the_file_and_rejects_a_reused_dev_id() {
    let e = engine(&[]);
    let dir = TestDir::new("engine-test");
    let path = dir.path.join("kv.bin");
    let meta = format!("rw,create:{}", path.display());
    let buf = Buf::new(1 << 16, 8);
    let back = Buf::new(1 << 16, 9);
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mb = e.register(DRAM, back.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, 1234, &meta).unwrap();
    let err = e
        .register(
            FILE,
            0,
            1 << 16,
            1234,
            &format!("rw,create:{}.other", path.display()),
        )
        .unwrap_err();
    assert!(
        err.message.contains("devId 1234 is already registered"),
        "{}",
        err.message
    );
    run(
        &e,
        WRITE,
        &[desc(buf.addr(), 1 << 16, 0, m)],
        &[desc(0, 1 << 16, 1234, mf)],
    )
    .unwrap();
    run(
        &e,
        READ,
        &[desc(back.addr(), 1 << 16, 0, mb)],
        &[desc(0, 1 << 16, 1234, mf)],
    )
    .unwrap();
    assert!(buf.bytes() == back.bytes());
    assert!(std::fs::read(&path).unwrap() == buf.bytes());
    // After deregistration the devId may be used again.
    e.deregister(mf).unwrap();
    let again = e.register(FILE, 0, 1 << 16, 1234, &meta).unwrap();
    e.deregister(again).unwrap();
    let missing = e
        .register(
            FILE,
            0,
            4096,
            99,
            &format!("ro:{}/missing", dir.path.display()),
        )
        .unwrap_err();
    assert!(missing.message.contains("ENOENT"), "{}", missing.message);
}

#[test]
fn repost_after_completion_moves_new_data() {
    let e = engine(&[]);
    let mut buf = Buf::new(1 << 16, 10);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, fd, "").unwrap();
    let l = [desc(buf.addr(), 1 << 16, 0, m)];
    let r = [desc(0, 1 << 16, fd, mf)];
    let req = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap();
    for round in 0..3u8 {
        buf.bytes_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i as u8).wrapping_mul(31).wrapping_add(round + 1));
        let mut p = e.post(&req, WRITE, 1, 1).unwrap();
        while p == Progress::InFlight {
            p = e.check(&req).unwrap();
        }
        assert!(
            std::fs::read(format!("/proc/self/fd/{fd}")).unwrap() == buf.bytes(),
            "round {round}"
        );
    }
    e.release(req).unwrap();
}

#[test]
fn release_of_an_in_flight_request_cancels_and_drains() {
    let e = engine(&[("max_io_size", "65536")]);
    let total = 64 << 20;
    let buf = Buf::new(total, 11);
    let (_d, f) = temp_file(true);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), total as u64, 0, "").unwrap();
    let mf = e.register(FILE, 0, total as u64, fd, "").unwrap();
    let l = [desc(buf.addr(), total as u64, 0, m)];
    let r = [desc(0, total as u64, fd, mf)];
    for _ in 0..3 {
        let req = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap();
        let _ = e.post(&req, WRITE, 1, 1).unwrap();
        e.release(req).map_err(|(_, err)| err).unwrap();
    }
    run(&e, WRITE, &l, &r).unwrap();
    assert!(std::fs::read(format!("/proc/self/fd/{fd}")).unwrap() == buf.bytes());
}

#[test]
fn deregistering_memory_in_use_keeps_it_registered_until_release() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 20, 12);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let m = e.register(DRAM, buf.addr(), 1 << 20, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 20, fd, "").unwrap();
    let l = [desc(buf.addr(), 1 << 20, 0, m)];
    let r = [desc(0, 1 << 20, fd, mf)];
    let req = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap();
    e.deregister(m).unwrap();
    e.deregister(mf).unwrap();

    let mut p = e.post(&req, WRITE, 1, 1).unwrap();
    while p == Progress::InFlight {
        p = e.check(&req).unwrap();
    }
    e.release(req).unwrap();
    assert!(std::fs::read(format!("/proc/self/fd/{fd}")).unwrap() == buf.bytes());
}

#[test]
fn eight_threads_post_on_one_engine() {
    let e = Arc::new(engine(&[("ring_entries", "64")]));
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let per = 2 << 20;
    let mf = e.register(FILE, 0, 8 * per as u64, fd, "").unwrap() as usize;
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let e = Arc::clone(&e);
            std::thread::spawn(move || {
                let src = Buf::new(per, 100 + t);
                let dst = Buf::new(per, 200 + t);
                let ms = e.register(DRAM, src.addr(), per as u64, 0, "").unwrap();
                let md = e.register(DRAM, dst.addr(), per as u64, 0, "").unwrap();
                let base = t * per as u64;
                for _ in 0..5 {
                    let blocks = mixed_blocks(per as u64, 512, t);
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
                        .map(|&(o, n)| desc(base + o, n, fd, mf as *const c_void))
                        .collect();
                    run(&e, WRITE, &lw, &r).unwrap();
                    run(&e, READ, &lr, &r).unwrap();
                    assert!(src.bytes() == dst.bytes(), "thread {t}");
                }
                e.deregister(ms).unwrap();
                e.deregister(md).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// NIXL's lists can hand back an MD after its deregistration, or another registration's MD
/// (several threads on an agent in sync mode NONE, issue 23). MDs are only hints: a descriptor
/// is served by whichever live registration covers it, a stale MD is never touched, and only a
/// descriptor no live registration covers is refused (NOT_FOUND, naming it). A second
/// deregistration is refused, not a second release.
#[test]
fn stale_and_foreign_mds_resolve_by_what_the_descriptor_names() {
    let e = engine(&[]);
    let buf = Buf::new(1 << 16, 13);
    let other = Buf::new(1 << 16, 15);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let gone = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mo = e.register(DRAM, other.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, fd, "").unwrap();
    // A request holds `gone` across its deregistration.
    let held = [desc(buf.addr(), 1 << 16, 0, gone)];
    let r = [desc(0, 1 << 16, fd, mf)];
    let req = e.prep(WRITE, DRAM, &held, FILE, &r, AGENT).unwrap();
    e.deregister(gone).unwrap();
    // The stale MD on a range `m` covers: served through `m`.
    run(&e, WRITE, &held, &r).unwrap();
    // Foreign MDs (the file's on a memory descriptor, another buffer's, a null one): same.
    run(
        &e,
        WRITE,
        &[desc(buf.addr(), 1 << 16, 0, mf)],
        &[desc(0, 1 << 16, fd, mo)],
    )
    .unwrap();
    run(
        &e,
        WRITE,
        &[desc(buf.addr(), 1 << 16, 0, mo)],
        &[desc(0, 1 << 16, fd, std::ptr::null())],
    )
    .unwrap();
    // Nothing covers: refused with the descriptor named.
    e.deregister(m).unwrap();
    let err = e.prep(WRITE, DRAM, &held, FILE, &r, AGENT).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    assert!(
        err.message.contains("descriptor 0")
            && err
                .message
                .contains("not covered by any live DRAM_SEG registration"),
        "{}",
        err.message
    );
    assert!(
        err.message
            .contains("deregistered, or NIXL handed back a stale MD"),
        "{}",
        err.message
    );
    // A file list naming memory: the other kind is named.
    let err = e
        .prep(
            READ,
            DRAM,
            &[desc(other.addr(), 4096, 0, mo)],
            FILE,
            &[desc(other.addr(), 4096, 0, mo)],
            AGENT,
        )
        .unwrap_err();
    assert!(
        err.message.contains("a DRAM_SEG registration covers it"),
        "{}",
        err.message
    );
    let err = e.deregister(gone).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    assert!(
        err.message.contains("not a live registration"),
        "{}",
        err.message
    );
    // The request prepared before still holds its registration and completes.
    let mut p = e.post(&req, WRITE, 1, 1).unwrap();
    while p == Progress::InFlight {
        p = e.check(&req).unwrap();
    }
    e.release(req).unwrap();
    let back = Buf::new(1 << 16, 14);
    let mb = e.register(DRAM, back.addr(), 1 << 16, 0, "").unwrap();
    run(&e, READ, &[desc(back.addr(), 1 << 16, 0, mb)], &r).unwrap();
    assert!(back.bytes() == buf.bytes());
    e.deregister(mo).unwrap();
    e.deregister(mb).unwrap();
    e.deregister(mf).unwrap();
}

#[test]
fn vram_without_a_gpu_driver_is_refused_with_the_reason() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return io_uring_dmabuf::test_support::skip(
            "this machine has an NVIDIA driver (the GPU tests cover VRAM)",
        );
    }
    let e = engine(&[]);
    let err = e.register(1, 0x7000_0000, 1 << 20, 0, "").unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(err.message.contains("libcuda"), "{}", err.message);
    let forced = engine(&[("vram_path", "cufile")]);
    let err = forced.register(1, 0x7000_0000, 1 << 20, 0, "").unwrap_err();
    assert!(
        err.message.contains("libcuda") || err.message.contains("cufile"),
        "{}",
        err.message
    );
}

/// Posts a READ of `blocks` non-adjacent 4 KiB O_DIRECT blocks through a 16-entry ring (16
/// rounds of the ring), sleeps as a client that polls rarely would, and returns how many
/// checkXfer calls then found it done (1 = it finished while nobody polled).
fn checks_after_a_sleep(params: &[(&str, &str)]) -> usize {
    let e = engine(params);
    let blocks = 256u64;
    let len = blocks * 2 * 4096;
    let src = Buf::new(len as usize, 21);
    let dst = Buf::new(len as usize, 22);
    let (_d, f) = temp_file(true);
    let fd = f.as_raw_fd() as u64;
    let m_src = e.register(DRAM, src.addr(), len, 0, "").unwrap();
    let m_dst = e.register(DRAM, dst.addr(), len, 0, "").unwrap();
    let m_file = e.register(FILE, 0, len, fd, "").unwrap();
    let at = |i: u64| i * 2 * 4096;
    let file: Vec<_> = (0..blocks).map(|i| desc(at(i), 4096, fd, m_file)).collect();
    run(
        &e,
        WRITE,
        &(0..blocks)
            .map(|i| desc(src.addr() + at(i), 4096, 0, m_src))
            .collect::<Vec<_>>(),
        &file,
    )
    .unwrap();
    let local: Vec<_> = (0..blocks)
        .map(|i| desc(dst.addr() + at(i), 4096, 0, m_dst))
        .collect();
    let req = e.prep(READ, DRAM, &local, FILE, &file, AGENT).unwrap();
    assert!(
        matches!(
            e.post(&req, READ, local.len(), file.len()),
            Ok(Progress::InFlight)
        ),
        "a 16-round request is not done at post"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut checks = 1;
    while let Progress::InFlight = e.check(&req).unwrap() {
        checks += 1;
    }
    e.release(req).map_err(|(_, err)| err.message).unwrap();
    for i in 0..blocks as usize {
        let r = i * 8192..i * 8192 + 4096;
        assert!(
            src.bytes()[r.clone()] == dst.bytes()[r],
            "block {i} differs"
        );
    }
    checks
}

#[test]
fn a_request_advances_while_its_client_sleeps_between_checks() {
    let ring = [("ring_entries", "16"), ("progress_thread", "true")];
    assert_eq!(
        checks_after_a_sleep(&ring),
        1,
        "the progress thread finished the request during the client's sleep"
    );
    // Without it, the ring is refilled only when the client comes back: the test above can fail.
    let off = checks_after_a_sleep(&[ring[0], ("progress_thread", "false")]);
    assert!(off > 1, "with progress_thread=false one check after the sleep finished a 16-round request ({off} checks)");
}

/// A FILE range whose end passes 2^64 is refused at registration, as the same DRAM range is.
#[test]
fn ranges_past_two_to_the_64_are_refused_for_files_and_memory() {
    let e = engine(&[]);
    let (_d, f) = temp_file(false);
    let fd = f.as_raw_fd() as u64;
    let err = e.register(FILE, u64::MAX - 4095, 8192, fd, "").unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidParam);
    assert!(err.message.contains("ends past 2^64"), "{}", err.message);
    let err = e.register(DRAM, u64::MAX - 4095, 8192, 0, "").unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidParam);
    let ok = e.register(FILE, u64::MAX - 8192, 8192, fd, "").unwrap();
    e.deregister(ok).unwrap();
}
