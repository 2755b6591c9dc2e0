//! Benchmark mode: DRAM <-> BLK through the project's engine (`io_uring_dmabuf::engine::Engine`,
//! no NIXL) against fio (ioengine=io_uring, fixedbufs, registerfiles, direct=1) on the same block
//! device, point by point, and one side-by-side table.
//!
//! In the lab VM it runs when run-lab.sh packed `/lab/bench.args` (LAB_BENCH=1) and prints
//! `LAB BENCH DONE` (or `LAB BENCH FAILED: ...`) at the end. Outside a VM:
//! `iud-lab --bench --device /dev/XXX --overwrite [options]` (overwrites the first
//! max-block x max-batch bytes of the device); bench/blk_vs_fio.py calls it per point with
//! `--no-fio` for its engine-only column.
//!
//! The request pattern is iud-bench's (and so nixlbench's): one request of `batch` descriptors of
//! `block` bytes; descriptor j = DRAM block j <-> device block j of [0, batch x block), the device
//! blocks shuffled for layout `rand` (every descriptor a separate I/O) and in order for `seq` (the
//! engine merges neighbours up to max_io_size). The request is prepared once, then posted and
//! polled (getXferStatus-style: Engine::check in a busy loop) until done, again and again for the
//! point's duration, after at most 10 warm-up posts (at most a fifth of the duration). fio gets
//! the same range (offset=0, size=batch x block) with iodepth = iodepth_batch_submit =
//! iodepth_batch_complete_min = iodepth_batch_complete_max = batch, i.e. the same
//! submit-all/wait-for-all rhythm, ramp_time = a fifth of the duration. The two tools alternate
//! which one goes first from point to point. Every engine point is verified after its timed loop
//! (WRITE: the device range read back through a buffered open equals the DRAM source; READ: the
//! zeroed DRAM destinations equal the device range).

use std::ffi::c_void;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;

use crate::util::{read_buffered, MmapBuf, Rng};

const DRAM: i32 = 0;
const BLK: i32 = 2;
const READ: i32 = 0;
const WRITE: i32 = 1;
const AGENT: &str = "iud-lab-bench";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Write => "WRITE",
            Op::Read => "READ",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Layout {
    Rand,
    Seq,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Rand => "rand",
            Layout::Seq => "seq",
        }
    }
}

#[derive(Debug)]
pub struct BenchCfg {
    pub device: String,
    pub ops: Vec<Op>,
    pub layouts: Vec<Layout>,
    pub blocks: Vec<u64>,
    pub batches: Vec<u64>,
    pub duration: Duration,
    pub reps: usize,
    /// fio binary; None = engine only.
    pub fio: Option<String>,
    pub poll_yield: bool,
}

pub const USAGE: &str = "\
iud-lab --bench --device /dev/BLOCKDEV --overwrite [options]
  --ops WRITE,READ        --layouts rand,seq      --blocks 4K-1M (LO-HI doubling, or a list)
  --batches 1,32          --duration-ms 500       --reps 1 (median of N runs per tool)
  --fio PATH (default: fio from PATH, /bin/fio or /usr/bin/fio)   --no-fio (engine only)
  --poll spin|yield       (spin: Engine::check in a busy loop, like nixlbench)
Overwrites the device's first max(block) x max(batch) bytes.";

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("bad size '{s}'"))
}

fn parse_blocks(s: &str) -> Result<Vec<u64>, String> {
    if let Some((lo, hi)) = s.split_once('-') {
        let (mut lo, hi) = (parse_size(lo)?, parse_size(hi)?);
        let mut v = Vec::new();
        while lo > 0 && lo <= hi {
            v.push(lo);
            lo *= 2;
        }
        Ok(v)
    } else {
        s.split(',').map(parse_size).collect()
    }
}

fn find_fio() -> Option<String> {
    let mut dirs: Vec<String> = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(str::to_owned)
        .collect();
    dirs.extend(["/bin".to_owned(), "/usr/bin".to_owned()]);
    dirs.into_iter()
        .map(|d| format!("{d}/fio"))
        .find(|p| std::fs::metadata(p).is_ok())
}

/// Parses the bench options (everything after `--bench`, plus `--device`).
pub fn parse_args(args: &[String], device: Option<String>) -> Result<BenchCfg, String> {
    let mut c = BenchCfg {
        device: device.unwrap_or_default(),
        ops: vec![Op::Write, Op::Read],
        layouts: vec![Layout::Rand, Layout::Seq],
        blocks: parse_blocks("4K-1M")?,
        batches: vec![1, 32],
        duration: Duration::from_millis(500),
        reps: 1,
        fio: None,
        poll_yield: false,
    };
    let mut no_fio = false;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        let mut val = || -> Result<String, String> {
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a {
            "--bench" | "--overwrite" => {}
            "--device" => c.device = val()?,
            "--ops" => {
                c.ops = val()?
                    .split(',')
                    .map(|o| match o.trim().to_ascii_uppercase().as_str() {
                        "READ" => Ok(Op::Read),
                        "WRITE" => Ok(Op::Write),
                        _ => Err(format!("--ops: READ|WRITE, got '{o}'")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--layouts" => {
                c.layouts = val()?
                    .split(',')
                    .map(|l| match l.trim() {
                        "rand" => Ok(Layout::Rand),
                        "seq" => Ok(Layout::Seq),
                        _ => Err(format!("--layouts: rand|seq, got '{l}'")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--blocks" => c.blocks = parse_blocks(&val()?)?,
            "--batches" => {
                c.batches = val()?
                    .split(',')
                    .map(|b| {
                        b.trim()
                            .parse::<u64>()
                            .map_err(|_| format!("--batches: bad '{b}'"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--duration-ms" => {
                c.duration =
                    Duration::from_millis(val()?.parse().map_err(|_| "--duration-ms: bad number")?)
            }
            "--reps" => c.reps = val()?.parse().map_err(|_| "--reps: bad number")?,
            "--fio" => c.fio = Some(val()?),
            "--no-fio" => no_fio = true,
            "--poll" => {
                c.poll_yield = match val()?.as_str() {
                    "spin" => false,
                    "yield" => true,
                    p => return Err(format!("--poll: spin|yield, got '{p}'")),
                }
            }
            _ => return Err(format!("unknown bench option '{a}'")),
        }
        i += 1;
    }
    if c.device.is_empty() {
        return Err("--device is required".into());
    }
    if c.blocks.is_empty()
        || c.batches.is_empty()
        || c.batches.contains(&0)
        || c.reps == 0
        || c.duration.is_zero()
    {
        return Err("need block sizes, batch sizes >= 1, --reps >= 1 and --duration-ms > 0".into());
    }
    if no_fio {
        c.fio = None;
    } else if c.fio.is_none() {
        c.fio = find_fio();
        if c.fio.is_none() {
            return Err("no fio found (PATH, /bin, /usr/bin); pass --fio PATH or --no-fio".into());
        }
    }
    Ok(c)
}

/// splitmix64, for the (fixed-seed) shuffle of the device blocks.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Device block index of descriptor j.
fn device_order(layout: Layout, block: u64, batch: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..batch).collect();
    if layout == Layout::Rand {
        let mut s = 0x5EED ^ block ^ batch.rotate_left(20);
        for i in (1..v.len()).rev() {
            let j = (splitmix(&mut s) % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
    v
}

/// One measured point of one tool: (IOPS, GB/s decimal).
type Sample = (f64, f64);

struct EngineBench {
    e: Engine,
    buf: MmapBuf,
    _dev: std::fs::File,
    dev_id: u64,
    md_dram: *const c_void,
    md_blk: *const c_void,
}

impl EngineBench {
    fn new(device: &str, region: u64) -> Result<EngineBench, String> {
        let e = Engine::new(AGENT, std::iter::empty())
            .map_err(|e| format!("Engine::new: {}", e.message))?;
        let mut buf = MmapBuf::new(region as usize).map_err(|e| format!("mmap {region}: {e}"))?;
        Rng::new().fill(buf.bytes_mut());
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(device)
            .map_err(|e| format!("open({device}, O_RDWR|O_DIRECT): {e}"))?;
        let dev_id = dev.as_raw_fd() as u64;
        let md_dram = e
            .register(DRAM, buf.ptr() as u64, region, 0, "")
            .map_err(|e| format!("register DRAM: {}", e.message))?;
        let md_blk = e.register(BLK, 0, region, dev_id, "").map_err(|e| {
            format!(
                "register BLK_SEG (fd mode, O_DIRECT fd {dev_id}, [0, {region})): {}",
                e.message
            )
        })?;
        Ok(EngineBench {
            e,
            buf,
            _dev: dev,
            dev_id,
            md_dram,
            md_blk,
        })
    }

    fn point(
        &mut self,
        c: &BenchCfg,
        op: Op,
        layout: Layout,
        block: u64,
        batch: u64,
    ) -> Result<Sample, String> {
        let (device, duration, poll_yield) = (c.device.as_str(), c.duration, c.poll_yield);
        let order = device_order(layout, block, batch);
        let base = self.buf.ptr() as u64;
        let local: Vec<iud_desc> = (0..batch)
            .map(|j| iud_desc {
                addr: base + j * block,
                len: block,
                dev_id: 0,
                md: self.md_dram,
            })
            .collect();
        let remote: Vec<iud_desc> = order
            .iter()
            .map(|&k| iud_desc {
                addr: k * block,
                len: block,
                dev_id: self.dev_id,
                md: self.md_blk,
            })
            .collect();
        let bytes = (block * batch) as usize;
        if op == Op::Read {
            self.buf.bytes_mut()[..bytes].fill(0);
        }
        let nop = if op == Op::Read { READ } else { WRITE };
        let req = self
            .e
            .prep(nop, DRAM, &local, BLK, &remote, AGENT)
            .map_err(|e| format!("prep: {:?}: {}", e.kind, e.message))?;
        let once = |req: &io_uring_dmabuf::engine::Request| -> Result<(), String> {
            let mut r = self.e.post(req, nop, local.len(), remote.len());
            while let Ok(Progress::InFlight) = r {
                if poll_yield {
                    // SAFETY: plain syscall.
                    unsafe { libc::sched_yield() };
                } else {
                    std::hint::spin_loop();
                }
                r = self.e.check(req);
            }
            r.map(|_| ())
                .map_err(|e| format!("{:?}: {}", e.kind, e.message))
        };
        let result = (|| -> Result<Sample, String> {
            let w0 = Instant::now();
            for _ in 0..10 {
                once(&req).map_err(|e| format!("warm-up: {e}"))?;
                if w0.elapsed() >= duration / 5 {
                    break;
                }
            }
            let t0 = Instant::now();
            let mut n = 0u64;
            while n < 3 || t0.elapsed() < duration {
                once(&req)?;
                n += 1;
            }
            let secs = t0.elapsed().as_secs_f64();
            let iops = (n * batch) as f64 / secs;
            Ok((iops, iops * block as f64 / 1e9))
        })();
        if let Err((_, e)) = self.e.release(req) {
            return Err(format!("release: {}", e.message));
        }
        let sample = result?;
        // Outside the timed loop: what the last request moved is where it belongs.
        let disk = read_buffered(device, 0, bytes)?;
        for (j, &k) in order.iter().enumerate() {
            let (m, d) = ((j as u64 * block) as usize, (k * block) as usize);
            if self.buf.bytes()[m..m + block as usize] != disk[d..d + block as usize] {
                return Err(format!(
                    "{} {} {block} x {batch}: descriptor {j} (DRAM +{m}, device offset {d}) differs after the run",
                    op.name(),
                    layout.name()
                ));
            }
        }
        Ok(sample)
    }
}

impl Drop for EngineBench {
    fn drop(&mut self) {
        let _ = self.e.deregister(self.md_blk);
        let _ = self.e.deregister(self.md_dram);
    }
}

fn fio_point(
    fio: &str,
    device: &str,
    op: Op,
    layout: Layout,
    block: u64,
    batch: u64,
    duration: Duration,
) -> Result<Sample, String> {
    let rw = match (op, layout) {
        (Op::Read, Layout::Rand) => "randread",
        (Op::Write, Layout::Rand) => "randwrite",
        (Op::Read, Layout::Seq) => "read",
        (Op::Write, Layout::Seq) => "write",
    };
    let ms = duration.as_millis();
    let args = [
        "--name=p".to_owned(),
        format!("--filename={device}"),
        "--ioengine=io_uring".into(),
        "--fixedbufs=1".into(),
        "--registerfiles=1".into(),
        "--direct=1".into(),
        format!("--rw={rw}"),
        format!("--bs={block}"),
        "--offset=0".into(),
        format!("--size={}", block * batch),
        format!("--iodepth={batch}"),
        format!("--iodepth_batch_submit={batch}"),
        format!("--iodepth_batch_complete_min={batch}"),
        format!("--iodepth_batch_complete_max={batch}"),
        "--time_based=1".into(),
        format!("--runtime={ms}ms"),
        format!("--ramp_time={}ms", ms / 5),
        "--gtod_reduce=1".into(),
        "--scramble_buffers=0".into(),
        "--output-format=terse".into(),
        "--terse-version=3".into(),
    ];
    let out = Command::new(fio)
        .args(&args)
        .output()
        .map_err(|e| format!("running {fio}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("3;")).ok_or_else(|| {
        format!(
            "fio {} {} {block} x {batch}: exit {:?}, no terse line; stderr: {}",
            op.name(),
            layout.name(),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    let f: Vec<&str> = line.split(';').collect();
    // terse v3: 5 = error, 8 = read iops, 49 = write iops (1-based).
    let field = |n: usize| f.get(n - 1).copied().unwrap_or("");
    if field(5) != "0" {
        return Err(format!(
            "fio {} {} {block} x {batch}: error {}",
            op.name(),
            layout.name(),
            field(5)
        ));
    }
    let iops: f64 = field(if op == Op::Read { 8 } else { 49 })
        .parse()
        .map_err(|_| format!("fio: cannot parse terse line {line}"))?;
    Ok((iops, iops * block as f64 / 1e9))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn human(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Runs every point; prints `BENCH,<tool>,<op>,<layout>,<block>,<batch>,<iops>,<gbps>` lines
/// (tool = engine | fio) and, with fio, the side-by-side table.
pub fn run(c: &BenchCfg) -> Result<(), String> {
    let region = c.blocks.iter().max().unwrap() * c.batches.iter().max().unwrap();
    let dev = crate::util::BlockDev::open(&c.device, true)?;
    if dev.bytes < region {
        return Err(format!(
            "{} holds {} bytes < the {region} bytes the points use",
            c.device, dev.bytes
        ));
    }
    if let Some(b) = c.blocks.iter().find(|&&b| b % dev.lbs as u64 != 0) {
        return Err(format!(
            "block size {b} is not a multiple of {}'s logical block size {}",
            c.device, dev.lbs
        ));
    }
    let name = std::fs::canonicalize(&c.device)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let q = |f: &str| {
        std::fs::read_to_string(format!("/sys/class/block/{name}/queue/{f}"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "?".into())
    };
    println!(
        "INFO bench: device {}: {} bytes, logical block {} B, max_sectors_kb {}, nr_requests {}, scheduler {}",
        c.device,
        dev.bytes,
        dev.lbs,
        q("max_sectors_kb"),
        q("nr_requests"),
        q("scheduler")
    );
    drop(dev);
    println!(
        "INFO bench: engine (io_uring_dmabuf::engine::Engine, default params, DRAM + BLK_SEG fd mode){} on {}, region [0, {region}), {} ms per point, {} rep(s), poll {}",
        if c.fio.is_some() { " vs fio" } else { "" },
        c.device,
        c.duration.as_millis(),
        c.reps,
        if c.poll_yield { "yield" } else { "spin" }
    );
    if let Some(fio) = &c.fio {
        let v = Command::new(fio)
            .arg("--version")
            .output()
            .map_err(|e| format!("{fio} --version: {e}"))?;
        println!(
            "INFO bench: fio {} = {}",
            fio,
            String::from_utf8_lossy(&v.stdout).trim()
        );
    }
    let mut eng = EngineBench::new(&c.device, region)?;
    let mut rows = Vec::new();
    let mut k = 0usize;
    for &op in &c.ops {
        for &layout in &c.layouts {
            for &batch in &c.batches {
                for &block in &c.blocks {
                    let (mut ei, mut fi) = (Vec::new(), Vec::new());
                    for _ in 0..c.reps {
                        let engine_first = k % 2 == 0;
                        k += 1;
                        for which in if engine_first { [0, 1] } else { [1, 0] } {
                            if which == 0 {
                                ei.push(eng.point(c, op, layout, block, batch)?.0);
                            } else if let Some(fio) = &c.fio {
                                fi.push(
                                    fio_point(
                                        fio, &c.device, op, layout, block, batch, c.duration,
                                    )?
                                    .0,
                                );
                            }
                        }
                    }
                    let e = median(&mut ei);
                    println!(
                        "BENCH,engine,{},{},{block},{batch},{e:.1},{:.6}",
                        op.name(),
                        layout.name(),
                        e * block as f64 / 1e9
                    );
                    let f = if fi.is_empty() {
                        None
                    } else {
                        let f = median(&mut fi);
                        println!(
                            "BENCH,fio,{},{},{block},{batch},{f:.1},{:.6}",
                            op.name(),
                            layout.name(),
                            f * block as f64 / 1e9
                        );
                        Some(f)
                    };
                    rows.push((op, layout, block, batch, e, f));
                }
            }
        }
    }
    drop(eng);
    if c.fio.is_none() {
        return Ok(());
    }
    let hdr = format!(
        "{:<6}{:<7}{:>6}{:>6} | {:>9}{:>9} | {:>9}{:>9} | {:>7}",
        "Op", "Layout", "Block", "Batch", "ENG IOPS", "ENG GB/s", "fio IOPS", "fio GB/s", "ENG/fio"
    );
    println!("TABLE {hdr}");
    println!("TABLE {}", "-".repeat(hdr.len()));
    let mut ratios = Vec::new();
    for (op, layout, block, batch, e, f) in &rows {
        let f = f.unwrap_or(0.0);
        let ratio = if f > 0.0 { e / f } else { f64::NAN };
        if f > 0.0 {
            ratios.push(ratio);
        }
        println!(
            "TABLE {:<6}{:<7}{:>6}{:>6} | {:>9}{:>9.3} | {:>9}{:>9.3} | {:>7.2}",
            op.name(),
            layout.name(),
            human(*block),
            batch,
            si(*e),
            e * *block as f64 / 1e9,
            si(f),
            f * *block as f64 / 1e9,
            ratio
        );
    }
    if !ratios.is_empty() {
        let g = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
        let min = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = ratios.iter().cloned().fold(0.0, f64::max);
        println!("TABLE {}", "-".repeat(hdr.len()));
        println!(
            "TABLE ENG/fio over {} points: geometric mean {g:.2}, min {min:.2}, max {max:.2}{}",
            ratios.len(),
            if c.reps > 1 {
                format!(" (each point: median of {} runs per tool)", c.reps)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
