//! prepXfer's cost per request without NIXL (issue 26): `Engine::prep` + release of one list of
//! 8192 and 65536 scattered descriptors, DRAM and VRAM (the fake HSA runtime of
//! tests/rocm_double: the staging route, as on a machine without the DMA-BUF uAPI), median
//! microseconds printed per list. A measurement, not a check: it asserts only that every prep
//! succeeds and names every descriptor's bytes, so it is `#[ignore]`d; run it with
//!   cargo test --release --test prep_profile -- --ignored --nocapture
//! (and `perf record` on that binary for where the time goes). `IUD_PREP_SWEEP_MIB=256` sweeps
//! that many MiB through the CPU's caches before each prep, as a request's data does between a
//! client's preps (the cold-cache cost seen on the H200). `IUD_PREP_THREADS` sets `prep_threads`.

mod common;
#[path = "rocm_double/mod.rs"]
mod double;

use std::os::fd::AsRawFd;
use std::time::Instant;

use common::*;
use double::{Ctl, Variant};
use io_uring_dmabuf::engine::Engine;

const BLOCK: u64 = 4096;

/// Median microseconds of `prep` + `release` over `reps` requests of the lists.
fn time_prep(
    e: &Engine,
    op: i32,
    kind: i32,
    local: &[io_uring_dmabuf::ffi::bridge::iud_desc],
    remote: &[io_uring_dmabuf::ffi::bridge::iud_desc],
    reps: usize,
) -> (f64, f64) {
    let (mut prep, mut rel) = (Vec::new(), Vec::new());
    let mut sweep = vec![
        0u8;
        std::env::var("IUD_PREP_SWEEP_MIB")
            .ok()
            .and_then(|m| m.parse::<usize>().ok())
            .unwrap_or(0)
            << 20
    ];
    for r in 0..reps {
        sweep.fill(r as u8);
        std::hint::black_box(&sweep);
        let t0 = Instant::now();
        let req = e
            .prep(op, kind, local, FILE, remote, AGENT)
            .unwrap_or_else(|err| panic!("prep: {}", err.message));
        let t1 = Instant::now();
        e.release(req)
            .map_err(|(_, err)| err.message)
            .expect("release");
        prep.push((t1 - t0).as_secs_f64() * 1e6);
        rel.push(t1.elapsed().as_secs_f64() * 1e6);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    (med(&mut prep), med(&mut rel))
}

/// Scattered lists of `n` blocks: memory slot j*7 mod 2n (two memory regions when `split`),
/// file slots 2*(j*5 mod n): nothing merges.
fn lists(
    n: u64,
    base: [(u64, *const std::ffi::c_void); 2],
    fd: u64,
    m_file: *const std::ffi::c_void,
) -> (
    Vec<io_uring_dmabuf::ffi::bridge::iud_desc>,
    Vec<io_uring_dmabuf::ffi::bridge::iud_desc>,
) {
    let local = (0..n)
        .map(|j| {
            let (b, md) = base[(j % 2) as usize];
            desc(b + ((j * 7) % n) * BLOCK, BLOCK, 0, md)
        })
        .collect();
    let remote = (0..n)
        .map(|j| desc(2 * ((j * 5) % n) * BLOCK, BLOCK, fd, m_file))
        .collect();
    (local, remote)
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn prep_of_large_lists_dram_and_staged_vram() {
    let lib = double::instance(Variant::NoExport, "prep-profile");
    std::env::set_var("IUD_HSA_LIBRARY", &lib);
    let ctl = Ctl::open(&lib);
    let threads = std::env::var("IUD_PREP_THREADS").unwrap_or_else(|_| "auto".into());
    let e = Engine::new(
        AGENT,
        [("gpu_provider", "rocm"), ("prep_threads", threads.as_str())],
    )
    .expect("engine");
    println!("prep_threads={threads}");
    let top = 65536u64;
    let path = std::env::temp_dir().join(format!("iud-prep-profile-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(2 * top * BLOCK).unwrap();
    let fd = f.as_raw_fd() as u64;
    let m_file = e.register(FILE, 0, 2 * top * BLOCK, fd, "").unwrap();
    let dram = [
        Buf::new((top * BLOCK) as usize, 1),
        Buf::new((top * BLOCK) as usize, 2),
    ];
    let m_dram: Vec<_> = dram
        .iter()
        .map(|b| e.register(DRAM, b.addr(), top * BLOCK, 0, "").unwrap())
        .collect();
    let vram: Vec<u64> = (0..2)
        .map(|_| ctl.alloc_vram((top * BLOCK) as usize))
        .collect();
    let m_vram: Vec<_> = vram
        .iter()
        .map(|&v| e.register(VRAM, v, top * BLOCK, 0, "").unwrap())
        .collect();
    println!("| memory | op | descriptors | prep us | us per descriptor | release us |");
    println!("|---|---|---:|---:|---:|---:|");
    for (name, kind, base) in [
        (
            "DRAM, 2 regions",
            DRAM,
            [(dram[0].addr(), m_dram[0]), (dram[1].addr(), m_dram[1])],
        ),
        (
            "VRAM (staged), 2 regions",
            VRAM,
            [(vram[0], m_vram[0]), (vram[1], m_vram[1])],
        ),
    ] {
        for n in [8192u64, 65536] {
            let (local, remote) = lists(n, base, fd, m_file);
            for (op, opn) in [(READ, "READ"), (WRITE, "WRITE")] {
                let reps = if n > 10000 { 40 } else { 200 };
                time_prep(&e, op, kind, &local, &remote, 5);
                let (p, r) = time_prep(&e, op, kind, &local, &remote, reps);
                println!(
                    "| {name} | {opn} | {n} | {p:.0} | {:.3} | {r:.0} |",
                    p / n as f64
                );
            }
        }
    }
    for m in m_vram.into_iter().chain(m_dram).chain([m_file]) {
        e.deregister(m).unwrap();
    }
    drop(e);
    for v in vram {
        ctl.free_vram(v);
    }
    drop(f);
    let _ = std::fs::remove_file(&path);
}
