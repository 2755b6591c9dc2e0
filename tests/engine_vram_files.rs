//! The engine with VRAM from the fake HSA runtime (tests/rocm_double), no GPU: what a VRAM
//! registration prepares before the first transfer, and files registered and dropped one per key
//! (LMCache's dynamic mode) against one VRAM buffer, byte for byte, and a staged request that
//! finishes while its client sleeps. Its own test binary: the HSA library is chosen once per
//! process (IUD_HSA_LIBRARY), so every test here shares one copy of the double.

mod common;
#[path = "rocm_double/mod.rs"]
mod double;

use std::ffi::c_void;
use std::os::fd::AsRawFd;

use common::*;
use double::{Ctl, Variant};
use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::uring::Progress;

const MIB: u64 = 1 << 20;

fn transfer(
    e: &Engine,
    op: i32,
    local: &[io_uring_dmabuf::ffi::bridge::iud_desc],
    remote: &[io_uring_dmabuf::ffi::bridge::iud_desc],
) {
    let req = e
        .prep(op, VRAM, local, FILE, remote, AGENT)
        .unwrap_or_else(|err| panic!("prep: {}", err.message));
    let mut res = e.post(&req, op, local.len(), remote.len());
    while let Ok(Progress::InFlight) = res {
        res = e.check(&req);
    }
    e.release(req)
        .map_err(|(_, err)| err.message)
        .expect("release");
    res.unwrap_or_else(|err| panic!("transfer: {}", err.message));
}

fn fill_random(addr: u64, len: u64, seed: u64) {
    // SAFETY: fake VRAM owned by the test.
    let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in s.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn bytes(addr: u64, len: u64) -> Vec<u8> {
    // SAFETY: as in fill_random.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }.to_vec()
}

/// The double every test of this process uses (the plugin loads the HSA library once).
fn double_ctl() -> Ctl {
    static LIB: once_cell::sync::Lazy<String> = once_cell::sync::Lazy::new(|| {
        let lib = double::instance(Variant::NoExport, "engine-vram-files");
        std::env::set_var("IUD_HSA_LIBRARY", &lib);
        lib
    });
    Ctl::open(&LIB)
}

#[test]
fn vram_registration_prepares_staging_and_per_key_files_leave_no_route_behind() {
    let ctl = double_ctl();
    let e = Engine::new(
        AGENT,
        [
            ("gpu_provider", "rocm"),
            ("staging_buffer_size", "1048576"),
            ("staging_buffers", "8"),
        ],
    )
    .expect("engine");
    let len = 16 * MIB;
    let vram = ctl.alloc_vram(len as usize);
    assert!(
        !e.staging_ready().unwrap(),
        "no staging pool before any VRAM"
    );
    let m_vram = e
        .register(VRAM, vram, len, 0, "")
        .unwrap_or_else(|err| panic!("register VRAM: {}", err.message));
    // The one-time work is done at registration, not inside the client's first (timed) put.
    assert!(
        e.staging_ready().unwrap(),
        "the staging pool is created when VRAM that can only be staged is registered"
    );
    let dir = std::env::temp_dir().join(format!("iud-vram-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Chunks of one key each: 4 pieces of 64 KiB scattered over the buffer's two halves.
    let chunk = 256 << 10;
    for key in 0..24u64 {
        let src = vram + (key % 8) * chunk;
        let dst = vram + len / 2 + ((key * 3) % 8) * chunk;
        fill_random(src, chunk, key + 1);
        fill_random(dst, chunk, key + 1000);
        let path = dir.join(format!("key-{key}"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let fd = f.as_raw_fd() as u64;
        let m_file = e.register(FILE, 0, chunk, fd, "").unwrap();
        let pieces = |base: u64, md: *const c_void| -> Vec<_> {
            (0..4)
                .map(|i| desc(base + ((i * 5) % 4) * (chunk / 4), chunk / 4, 0, md))
                .collect()
        };
        let file: Vec<_> = (0..4)
            .map(|i| desc(i * (chunk / 4), chunk / 4, fd, m_file))
            .collect();
        transfer(&e, WRITE, &pieces(src, m_vram), &file);
        transfer(&e, READ, &pieces(dst, m_vram), &file);
        assert!(
            bytes(src, chunk) == bytes(dst, chunk),
            "key {key}: the chunk read back differs"
        );
        assert_eq!(
            e.cached_routes().unwrap(),
            1,
            "key {key}: the pair's route is cached while the file is registered"
        );
        e.deregister(m_file).unwrap();
        assert_eq!(
            e.cached_routes().unwrap(),
            0,
            "key {key}: deregistering the file drops its route"
        );
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }
    e.deregister(m_vram).unwrap();
    drop(e);
    ctl.free_vram(vram);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A staged READ of 64 scattered 256 KiB blocks through 4 staging buffers (16 rounds of
/// storage read, device copy, buffer reuse), posted and then left alone for 300 ms: returns how
/// many checks then found it done (1 = it finished while nobody polled).
fn staged_checks_after_a_sleep(ctl: &Ctl, progress_thread: &str) -> usize {
    let e = Engine::new(
        AGENT,
        [
            ("gpu_provider", "rocm"),
            ("staging_buffer_size", "262144"),
            ("staging_buffers", "4"),
            ("progress_thread", progress_thread),
        ],
    )
    .expect("engine");
    let (blocks, block) = (64u64, 256u64 << 10);
    let len = 2 * blocks * block;
    let vram = ctl.alloc_vram(len as usize);
    fill_random(vram, len / 2, 77);
    let m_vram = e.register(VRAM, vram, len, 0, "").unwrap();
    let path = std::env::temp_dir().join(format!(
        "iud-vram-sleep-{}-{progress_thread}",
        std::process::id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let fd = f.as_raw_fd() as u64;
    let m_file = e.register(FILE, 0, 2 * blocks * block, fd, "").unwrap();
    // Memory and file order differ and no two file blocks touch, so nothing merges.
    let file: Vec<_> = (0..blocks)
        .map(|i| desc(((i * 7) % blocks) * 2 * block, block, fd, m_file))
        .collect();
    transfer(
        &e,
        WRITE,
        &(0..blocks)
            .map(|i| desc(vram + i * block, block, 0, m_vram))
            .collect::<Vec<_>>(),
        &file,
    );
    let back = vram + len / 2;
    let local: Vec<_> = (0..blocks)
        .map(|i| desc(back + i * block, block, 0, m_vram))
        .collect();
    let req = e
        .prep(READ, VRAM, &local, FILE, &file, AGENT)
        .unwrap_or_else(|err| panic!("prep: {}", err.message));
    let posted = e
        .post(&req, READ, local.len(), file.len())
        .unwrap_or_else(|err| panic!("post: {}", err.message));
    assert_eq!(
        posted,
        Progress::InFlight,
        "16 rounds of the staging pool are not done at post"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut checks = 1;
    while let Progress::InFlight = e
        .check(&req)
        .unwrap_or_else(|err| panic!("check: {}", err.message))
    {
        checks += 1;
    }
    e.release(req)
        .map_err(|(_, err)| err.message)
        .expect("release");
    assert!(
        bytes(vram, len / 2) == bytes(back, len / 2),
        "the blocks read back differ"
    );
    tear_down(e, [m_file, m_vram], f, &path, ctl, vram);
    checks
}

/// Deregisters the test's registrations, drops the engine, then removes the file and frees the
/// fake VRAM (in that order: nothing of the engine may still use them).
fn tear_down(
    e: Engine,
    mds: [*const c_void; 2],
    f: std::fs::File,
    path: &std::path::Path,
    ctl: &Ctl,
    vram: u64,
) {
    for md in mds {
        e.deregister(md).unwrap();
    }
    drop(e);
    drop(f);
    let _ = std::fs::remove_file(path);
    ctl.free_vram(vram);
}

#[test]
fn a_staged_request_advances_while_its_client_sleeps_between_checks() {
    let ctl = double_ctl();
    assert_eq!(
        staged_checks_after_a_sleep(&ctl, "true"),
        1,
        "the progress thread ran the staging pipeline during the client's sleep"
    );
    // Without it the pipeline moves only when the client comes back: the assertion above can fail.
    let off = staged_checks_after_a_sleep(&ctl, "false");
    assert!(off > 1, "with progress_thread=false one check after the sleep finished 16 staging rounds ({off} checks)");
}

/// Scattered staged blocks of mixed sizes (64 KiB to 1 MiB) written and read back through a
/// pool of 4 buffers of 1 MiB, with `staging_pack_max` packing nothing, blocks up to 256 KiB, or
/// up to a whole buffer: every packing moves the same bytes to the same places.
#[test]
fn staged_blocks_round_trip_whatever_the_pack_size() {
    let ctl = double_ctl();
    let sizes = [
        64u64 << 10,
        192 << 10,
        256 << 10,
        512 << 10,
        1 << 20,
        256 << 10,
        64 << 10,
        320 << 10,
    ];
    let blocks: Vec<u64> = (0..48).map(|i| sizes[i % sizes.len()]).collect();
    let slot = 1 << 20;
    for pack in ["0", "262144", "1048576", "auto"] {
        let e = Engine::new(
            AGENT,
            [
                ("gpu_provider", "rocm"),
                ("staging_buffer_size", "1048576"),
                ("staging_buffers", "4"),
                ("staging_pack_max", pack),
            ],
        )
        .unwrap_or_else(|err| panic!("engine (pack {pack}): {}", err.message));
        let len = 2 * blocks.len() as u64 * slot;
        let vram = ctl.alloc_vram(len as usize);
        fill_random(vram, len, 5 + pack.len() as u64);
        let m_vram = e.register(VRAM, vram, len, 0, "").unwrap();
        let path =
            std::env::temp_dir().join(format!("iud-vram-pack-{}-{pack}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let fd = f.as_raw_fd() as u64;
        let n = blocks.len() as u64;
        let m_file = e.register(FILE, 0, 2 * n * slot, fd, "").unwrap();
        // Block i at VRAM slot (i * 5) % n and file slot (i * 7) % n, each slot 1 MiB apart (a
        // gap after every block smaller than a slot), so nothing merges in memory or file.
        let at = |i: u64, base: u64, mult: u64| base + ((i * mult) % n) * 2 * slot;
        let local = |base: u64| -> Vec<_> {
            blocks
                .iter()
                .enumerate()
                .map(|(i, &b)| desc(at(i as u64, base, 5), b, 0, m_vram))
                .collect()
        };
        let file: Vec<_> = blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| desc(at(i as u64, 0, 7), b, fd, m_file))
            .collect();
        let (src, dst) = (vram, vram + slot);
        transfer(&e, WRITE, &local(src), &file);
        transfer(&e, READ, &local(dst), &file);
        let file_bytes = std::fs::read(&path).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            let (s, d, o) = (
                at(i as u64, src, 5),
                at(i as u64, dst, 5),
                at(i as u64, 0, 7) as usize,
            );
            assert!(
                bytes(s, b) == file_bytes[o..o + b as usize],
                "pack {pack}: block {i} ({b} bytes) in the file differs from VRAM"
            );
            assert!(
                bytes(s, b) == bytes(d, b),
                "pack {pack}: block {i} ({b} bytes) read back differs"
            );
        }
        tear_down(e, [m_file, m_vram], f, &path, &ctl, vram);
    }
}

/// Staged page-cache READs cut into worker-sized pieces (`staged_read_piece_max`) land whole:
/// pieces packed into one buffer and read by several workers, neighbours in VRAM copied as one
/// (one 6 MiB descriptor; 24 blocks end to end in VRAM at permuted file offsets; 24 blocks
/// apart in VRAM), whatever the piece, against the file's bytes.
#[test]
fn staged_reads_in_worker_pieces_land_whole_whatever_the_piece() {
    let ctl = double_ctl();
    let block = 256 << 10;
    let n = 24u64;
    let len = n * block;
    for piece in ["0", "65536", "262144", "1048576"] {
        let e = Engine::new(
            AGENT,
            [
                ("gpu_provider", "rocm"),
                ("staging_buffer_size", "1048576"),
                ("staging_buffers", "4"),
                ("staged_read_piece_max", piece),
            ],
        )
        .unwrap_or_else(|err| panic!("engine (piece {piece}): {}", err.message));
        let vram = ctl.alloc_vram((3 * len) as usize);
        let m_vram = e.register(VRAM, vram, 3 * len, 0, "").unwrap();
        let path = std::env::temp_dir().join(format!(
            "iud-vram-read-piece-{}-{piece}",
            std::process::id()
        ));
        std::fs::write(
            &path,
            (0..len)
                .map(|i| (i * 31 + i / 4093) as u8)
                .collect::<Vec<u8>>(),
        )
        .unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let fd = f.as_raw_fd() as u64;
        let m_file = e.register(FILE, 0, len, fd, "").unwrap();
        let file_bytes = std::fs::read(&path).unwrap();
        let file_at = |i: u64| ((i * 7) % n) * block;
        // One descriptor.
        fill_random(vram, 3 * len, 9);
        transfer(
            &e,
            READ,
            &[desc(vram, len, 0, m_vram)],
            &[desc(0, len, fd, m_file)],
        );
        assert!(
            bytes(vram, len) == file_bytes,
            "piece {piece}: one 6 MiB descriptor read back differs from the file"
        );
        // End to end in VRAM, permuted in the file.
        fill_random(vram, 3 * len, 10);
        let local: Vec<_> = (0..n)
            .map(|i| desc(vram + i * block, block, 0, m_vram))
            .collect();
        let file: Vec<_> = (0..n)
            .map(|i| desc(file_at(i), block, fd, m_file))
            .collect();
        transfer(&e, READ, &local, &file);
        for i in 0..n {
            let o = file_at(i) as usize;
            assert!(
                bytes(vram + i * block, block) == file_bytes[o..o + block as usize],
                "piece {piece}: block {i} (VRAM end to end) differs"
            );
        }
        // Apart in VRAM (a block's gap after each), the gaps untouched.
        fill_random(vram, 3 * len, 11);
        let before = bytes(vram, 3 * len);
        let local: Vec<_> = (0..n)
            .map(|i| desc(vram + 2 * i * block + 4096, block, 0, m_vram))
            .collect();
        transfer(&e, READ, &local, &file);
        let after = bytes(vram, 3 * len);
        for i in 0..n {
            let (at, o) = ((2 * i * block + 4096) as usize, file_at(i) as usize);
            assert!(
                after[at..at + block as usize] == file_bytes[o..o + block as usize],
                "piece {piece}: block {i} (VRAM apart) differs"
            );
            let gap = at + block as usize..(at + 2 * block as usize).min(after.len());
            assert!(
                after[gap.clone()] == before[gap],
                "piece {piece}: the gap after block {i} changed"
            );
        }
        assert!(
            after[..4096] == before[..4096],
            "piece {piece}: the bytes before the first block changed"
        );
        tear_down(e, [m_file, m_vram], f, &path, &ctl, vram);
    }
}

/// The fd rule (mem/file.rs) on the staging path: a staged VRAM request whose FILE fd was closed,
/// or closed and its number reused for another file, before the first post or between posts, is
/// refused naming fd, file and cause, and neither file nor the VRAM changes. (Other tests of this
/// binary open files meanwhile, so a closed number may already name their file: either cause
/// is a refusal.)
#[test]
fn a_closed_or_reused_fd_is_refused_on_the_staging_path() {
    let ctl = double_ctl();
    let len = 4 * MIB;
    let dir = std::env::temp_dir().join(format!("iud-vram-fd-rule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for op in [WRITE, READ] {
        for fate in [FdFate::Closed, FdFate::Reused] {
            for between_posts in [false, true] {
                let case = format!("op {op} / {fate:?} / between posts {between_posts}");
                let e = Engine::new(
                    AGENT,
                    [
                        ("gpu_provider", "rocm"),
                        ("staging_buffer_size", "1048576"),
                        ("staging_buffers", "4"),
                    ],
                )
                .expect("engine");
                let vram = ctl.alloc_vram(len as usize);
                fill_random(vram, len, 11);
                let m_vram = e.register(VRAM, vram, len, 0, "").unwrap();
                let (a, b) = (dir.join("registered"), dir.join("other"));
                fill_random(vram, len, 12);
                std::fs::write(&a, bytes(vram, len)).unwrap();
                fill_random(vram, len, 13);
                std::fs::write(&b, bytes(vram, len)).unwrap();
                let b_bytes = bytes(vram, len);
                fill_random(vram, len, 14);
                let fd = open_fd(&a, 0);
                let m_file = e.register(FILE, 0, len, fd as u64, "").unwrap();
                let local: Vec<_> = (0..16)
                    .map(|i| desc(vram + i * (len / 16), len / 32, 0, m_vram))
                    .collect();
                let remote: Vec<_> = (0..16)
                    .map(|i| desc(((i * 5) % 16) * (len / 16), len / 32, fd as u64, m_file))
                    .collect();
                let req = e
                    .prep(op, VRAM, &local, FILE, &remote, AGENT)
                    .unwrap_or_else(|err| panic!("{case}: prep: {}", err.message));
                let post = |e: &Engine| -> Result<(), String> {
                    let mut p = e.post(&req, op, 16, 16).map_err(|err| err.message)?;
                    while p == Progress::InFlight {
                        p = e.check(&req).map_err(|err| err.message)?;
                    }
                    Ok(())
                };
                if between_posts {
                    post(&e).unwrap_or_else(|err| panic!("{case}: first post: {err}"));
                }
                let (a_before, vram_before) = (std::fs::read(&a).unwrap(), bytes(vram, len));
                doom_fd(fd, fate, &b, 0);
                let err = post(&e).expect_err(&format!("{case}: the post must be refused"));
                assert!(
                    err.contains(&format!("fd {fd} registered as FILE for {}", a.display())),
                    "{case}: {err}"
                );
                assert!(
                    err.contains("is no longer open")
                        || err.contains("now refers to a different file"),
                    "{case}: {err}"
                );
                assert!(
                    std::fs::read(&a).unwrap() == a_before,
                    "{case}: the registered file changed"
                );
                assert!(
                    std::fs::read(&b).unwrap() == b_bytes,
                    "{case}: the other file changed"
                );
                assert!(bytes(vram, len) == vram_before, "{case}: VRAM changed");
                e.release(req).map_err(|(_, err)| err.message).unwrap();
                e.deregister(m_file).unwrap();
                e.deregister(m_vram).unwrap();
                drop(e);
                if fate == FdFate::Reused {
                    // SAFETY: fd names the other file now, opened by doom_fd for the test.
                    unsafe { libc::close(fd) };
                }
                ctl.free_vram(vram);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Pages end to end in the file but scattered in VRAM (the vLLM connector's slots) are read as
/// one storage I/O; when the file ends inside such a run, the error still names the descriptor
/// the file ends in and the offset where it ends (not the run's first descriptor).
#[test]
fn a_file_that_ends_inside_a_merged_run_names_the_descriptor_it_ends_in() {
    let ctl = double_ctl();
    let page = 16u64 << 10;
    let len = 4 * MIB;
    let vram = ctl.alloc_vram(len as usize);
    let path = std::env::temp_dir().join(format!("iud-vram-eof-{}", std::process::id()));
    // The file holds 2.5 of the 3 pages read: page 2 is cut short.
    fill_random(vram, len, 21);
    std::fs::write(&path, bytes(vram, 2 * page + page / 2)).unwrap();
    for direct in [false, true] {
        let e = Engine::new(
            AGENT,
            [
                ("gpu_provider", "rocm"),
                ("staging_buffer_size", "1048576"),
                ("staging_buffers", "4"),
            ],
        )
        .expect("engine");
        let m_vram = e.register(VRAM, vram, len, 0, "").unwrap();
        let f = open_fd(&path, if direct { libc::O_DIRECT } else { 0 });
        let m_file = e.register(FILE, 0, 8 * page, f as u64, "").unwrap();
        // Page i at VRAM slot 7 - i (scattered), file offset i * page (end to end).
        let local: Vec<_> = (0..3)
            .map(|i| desc(vram + (7 - i) * MIB / 2, page, 0, m_vram))
            .collect();
        let remote: Vec<_> = (0..3)
            .map(|i| desc(i * page, page, f as u64, m_file))
            .collect();
        let req = e
            .prep(READ, VRAM, &local, FILE, &remote, AGENT)
            .unwrap_or_else(|err| panic!("prep: {}", err.message));
        let mut res = e.post(&req, READ, 3, 3);
        while let Ok(Progress::InFlight) = res {
            res = e.check(&req);
        }
        let err = res
            .expect_err("a READ past the end of the file fails")
            .message;
        e.release(req)
            .map_err(|(_, err)| err.message)
            .expect("release");
        assert!(
            err.contains("read past end of file")
                && err.contains(&format!("offset {}", 2 * page + page / 2))
                && err.contains("descriptor 2"),
            "direct {direct}: {err}"
        );
        e.deregister(m_file).unwrap();
        e.deregister(m_vram).unwrap();
        drop(e);
        // SAFETY: the fd opened above, closed once.
        unsafe { libc::close(f) };
    }
    let _ = std::fs::remove_file(&path);
    ctl.free_vram(vram);
}
