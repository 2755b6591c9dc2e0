//! iud-lab: the NVMe lab's in-VM tests (ci/vm/README.md).
//!
//! As PID 1 of the lab's initramfs it mounts the pseudo file systems, loads packed modules, runs
//! every test against /dev/nvme0n1, prints one PASS/FAIL/SKIP line per test and a final
//! `LAB RESULT: N passed, M failed, K skipped` line, and powers the VM off.
//!
//! Outside a VM: `iud-lab --device /dev/XXX --overwrite` runs the same tests against any
//! block device (they OVERWRITE the whole device), and exits 1 if a test failed.
//!
//! Benchmark mode (bench.rs): `iud-lab --bench --device /dev/XXX --overwrite [options]` outside
//! a VM; as PID 1 when run-lab.sh packed `/lab/bench.args` (LAB_BENCH=1): the engine against fio
//! on the device instead of the tests, ending with `LAB BENCH DONE` or `LAB BENCH FAILED: ...`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod bench;
mod dmabuf_uapi;
mod init;
mod report;
mod t_direct;
mod t_dmabuf;
mod t_engine;
mod t_engine_dmabuf;
mod t_store;
mod udmabuf;
mod util;

use report::{info, Report};

const VM_DEVICE: &str = "/dev/nvme0n1";
/// Written by run-lab.sh with LAB_BENCH=1: the bench options, whitespace separated.
const BENCH_ARGS: &str = "/lab/bench.args";

fn usage() -> ! {
    eprintln!("usage: iud-lab --device /dev/BLOCKDEV --overwrite   (destroys the whole device)");
    eprintln!("       (as PID 1 in the lab VM it tests {VM_DEVICE} without arguments)");
    eprintln!("{}", bench::USAGE);
    std::process::exit(2);
}

/// Benchmark mode; as PID 1 it powers the VM off at the end.
fn bench_main(pid1: bool, args: &[String], device: Option<String>) -> ! {
    if pid1 {
        init::setup(VM_DEVICE);
        info(format!(
            "iud-lab {} benchmark on kernel {}",
            env!("CARGO_PKG_VERSION"),
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
        ));
    }
    let t0 = std::time::Instant::now();
    let r = bench::parse_args(args, device).and_then(|c| bench::run(&c));
    info(format!("benchmark took {} ms", t0.elapsed().as_millis()));
    let ok = match r {
        Ok(()) => {
            println!("LAB BENCH DONE");
            true
        }
        Err(e) => {
            println!("LAB BENCH FAILED: {e}");
            false
        }
    };
    if pid1 {
        init::power_off();
    }
    std::process::exit(if ok { 0 } else { 1 });
}

fn main() {
    let pid1 = init::is_pid1();
    if pid1 {
        if let Ok(a) = std::fs::read_to_string(BENCH_ARGS) {
            let args: Vec<String> = a.split_whitespace().map(str::to_owned).collect();
            bench_main(true, &args, Some(VM_DEVICE.to_owned()));
        }
    } else {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.iter().any(|a| a == "--bench") {
            if !args.iter().any(|a| a == "--overwrite") {
                usage();
            }
            bench_main(false, &args, None);
        }
    }
    let device = if pid1 {
        VM_DEVICE.to_owned()
    } else {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let dev = args
            .iter()
            .position(|a| a == "--device")
            .and_then(|i| args.get(i + 1))
            .cloned();
        match dev {
            Some(d) if args.iter().any(|a| a == "--overwrite") => d,
            _ => usage(),
        }
    };
    if pid1 {
        init::setup(&device);
    }
    let t0 = std::time::Instant::now();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    info(format!(
        "iud-lab {} on kernel {}, device {device}",
        env!("CARGO_PKG_VERSION"),
        release.trim()
    ));

    let mut rep = Report::default();
    match t_direct::DirectLab::new(&device) {
        Ok(mut lab) => {
            info(lab.describe());
            for (i, &len) in t_direct::SIZES.iter().enumerate() {
                let label = util::size_str(len).replace(' ', "");
                rep.run(&format!("a1_direct_fixed_roundtrip_{label}"), || {
                    lab.round_trip(i, len)
                });
            }
            rep.run("a2_direct_fixed_qd64", || lab.queue_depth_64());
            rep.run("a3_direct_refusals_and_device_end", || lab.refusals());
        }
        Err(e) => rep.run("a0_open_device", || Err(e)),
    }
    rep.run("b1_engine_blk_path_mode", || {
        t_engine::round_trip(&device, false)
    });
    rep.run("b2_engine_blk_fd_mode", || {
        t_engine::round_trip(&device, true)
    });
    rep.run("b3_engine_blk_refusals", || t_engine::refusals(&device));
    let mut probe = None;
    rep.run("c1_dmabuf_uapi_probe", || t_dmabuf::probe_test(&mut probe));
    rep.run("c2_engine_dmabuf_probe_agrees", || {
        t_dmabuf::engine_probe_agrees(probe)
    });
    rep.run("d1_udmabuf_export", t_dmabuf::export_test);
    rep.run("d2_udmabuf_pages_as_fixed_buffers", || {
        t_dmabuf::pages_as_fixed_buffers(&device)
    });
    rep.run("d3_udmabuf_dmabuf_registration", || {
        t_dmabuf::dmabuf_registration(&device, probe)
    });
    rep.run("d4_dmabuf_registration_refusals", || {
        t_dmabuf::dmabuf_refusals(&device, probe)
    });
    rep.run("e1_engine_dram_dmabuf_round_trip", || {
        t_engine_dmabuf::dram_dmabuf_round_trip(&device, probe)
    });
    rep.run("e2_engine_dram_dmabuf_slab_boundary", || {
        t_engine_dmabuf::dram_dmabuf_slab_boundary(&device, probe)
    });
    rep.run("f1_raw_store_pattern_fixed_buffers", || {
        t_store::raw_store_pattern(&device, probe, false)
    });
    rep.run("f2_raw_store_pattern_dmabuf", || {
        t_store::raw_store_pattern(&device, probe, true)
    });

    info(format!("tests took {} ms", t0.elapsed().as_millis()));
    println!("{}", rep.summary_line());
    if pid1 {
        init::power_off();
    }
    std::process::exit(if rep.failed > 0 { 1 } else { 0 });
}
