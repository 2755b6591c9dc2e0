//! The KV-cache workload: N blocks at random slots of large DRAM regions against random, pairwise
//! non-adjacent file offsets; every backend alive at once, rounds in rotated order, medians, and
//! every measurement verified byte for byte outside its timed loop.

use std::io::Write as _;
use std::time::{Duration, Instant};

use nixl_sys::{Agent, Backend, MemType, RegistrationHandle, ThreadSync};

use crate::cli::{BackendSpec, Config, Op};
use crate::cpu::{median, per_gb, process_cpu_s};
use crate::mem::{pread_full, AlignedBuf, Region, SplitMix64};
use crate::report::{human_size, letter};
use crate::runner::{open_backend, post_and_wait, register, ThreadXfer};

/// Where the blocks of one request live: descriptor i moves `block` bytes between
/// `mem[i]` = (region index, offset in that region) and file offset `file[i]`.
#[derive(Debug, Clone)]
pub struct Layout {
    pub block: u64,
    pub mem: Vec<(usize, u64)>,
    pub file: Vec<u64>,
}

/// Picks `k` distinct values of `0..n` in random order (partial Fisher-Yates).
fn sample(rng: &mut SplitMix64, n: u64, k: usize) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    for i in 0..k {
        let j = i + (rng.next_u64() % (n - i as u64)) as usize;
        v.swap(i, j);
    }
    v.truncate(k);
    v
}

/// Most blocks of `block` bytes that fit: distinct slots in the regions, and file slots with at
/// least one free slot between any two (2n - 1 slots).
pub fn max_blocks(block: u64, region_size: u64, regions: usize, file_len: u64) -> u64 {
    let mem_slots = regions as u64 * (region_size / block);
    let file_slots = file_len / block;
    mem_slots.min(file_slots.div_ceil(2))
}

/// `n` blocks at random, distinct slots of the regions, paired with random file slots of which
/// no two are neighbours (so no pair of descriptors can merge, in any order), in random order.
/// Deterministic for a seed. `n` must be at most `max_blocks`.
pub fn layout(
    seed: u64,
    block: u64,
    n: u64,
    region_size: u64,
    regions: usize,
    file_len: u64,
) -> Layout {
    assert!(n >= 1 && n <= max_blocks(block, region_size, regions, file_len));
    let mut rng = SplitMix64::new(seed ^ 0x6B76_0000 ^ block.rotate_left(29) ^ n.rotate_left(7));
    let per_region = region_size / block;
    let mem = sample(&mut rng, regions as u64 * per_region, n as usize)
        .into_iter()
        .map(|s| ((s / per_region) as usize, (s % per_region) * block))
        .collect();
    // n sorted values of 0..(slots - n + 1), the k-th shifted by k: sorted slots with gaps >= 1.
    let slots = file_len / block;
    let mut c = sample(&mut rng, slots - n + 1, n as usize);
    c.sort_unstable();
    let mut file: Vec<u64> = c
        .iter()
        .enumerate()
        .map(|(k, &v)| (v + k as u64) * block)
        .collect();
    for i in (1..file.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        file.swap(i, j);
    }
    Layout { block, mem, file }
}

/// One backend in one round of one point.
#[derive(Debug, Clone)]
pub struct Sample {
    pub gbps: f64,
    pub cpu_s_per_gb: f64,
    pub requests: u64,
    pub verified: Result<(), String>,
}

/// One (op, block size) point: every backend's samples, one per round (empty when the backend
/// failed or was not run).
#[derive(Debug, Clone)]
pub struct Point {
    pub op: Op,
    pub block: u64,
    pub blocks: u64,
    pub samples: Vec<Vec<Sample>>,
}

impl Point {
    pub fn median_gbps(&self, b: usize) -> f64 {
        median(&self.samples[b].iter().map(|s| s.gbps).collect::<Vec<_>>())
    }

    pub fn median_cpu(&self, b: usize) -> f64 {
        median(
            &self.samples[b]
                .iter()
                .map(|s| s.cpu_s_per_gb)
                .collect::<Vec<_>>(),
        )
    }

    /// true: every sample verified; false: one failed; None: no samples.
    pub fn verified(&self, b: usize) -> Option<bool> {
        let s = &self.samples[b];
        (!s.is_empty()).then(|| s.iter().all(|x| x.verified.is_ok()))
    }
}

pub struct Ctx<'a> {
    pub cfg: &'a Config,
    pub fd: i32,
    pub verify_fd: i32,
    pub storage_kind: MemType,
    /// Bytes of the file the blocks may use (from offset 0).
    pub file_len: u64,
    pub page_cache_note: &'a (dyn Fn(Op) -> Option<String> + Sync),
}

pub struct Outcome {
    pub points: Vec<Point>,
    /// (backend index, error) for backends that failed; they are left out from then on.
    pub errors: Vec<(usize, String)>,
    pub consistency_failures: usize,
}

/// A backend with its agent and registrations, alive for the whole workload.
pub struct Live {
    pub agent: Agent,
    pub name: String,
    pub backend: Backend,
    _regs: Vec<RegistrationHandle>,
}

/// Backend `i` in its own agent, with `regions` and the storage registered.
pub fn open(
    i: usize,
    spec: &BackendSpec,
    ctx: &Ctx,
    regions: &[AlignedBuf],
) -> Result<Live, String> {
    let name = format!("iud-bench-kv-{i}");
    let (agent, backend) = open_backend(&name, spec, ctx.cfg, ThreadSync::Default)?;
    let mut regs = Vec::new();
    for (r, buf) in regions.iter().enumerate() {
        let reg = Region {
            addr: buf.addr(),
            len: buf.len(),
            dev_id: 0,
            kind: MemType::Dram,
        };
        regs.push(register(
            &agent,
            &backend,
            &reg,
            &format!("DRAM region {r}"),
        )?);
    }
    let file = Region {
        addr: 0,
        len: ctx.file_len as usize,
        dev_id: ctx.fd as u64,
        kind: ctx.storage_kind,
    };
    regs.push(register(&agent, &backend, &file, "storage, fd mode")?);
    println!(
        "registered {} DRAM region(s) of {} bytes each and the storage (0, {}, fd {})",
        regions.len(),
        regions.first().map_or(0, |b| b.len()),
        ctx.file_len,
        ctx.fd
    );
    Ok(Live {
        agent,
        name,
        backend,
        _regs: regs,
    })
}

pub fn run(ctx: &Ctx) -> Outcome {
    let cfg = ctx.cfg;
    let k = &cfg.kv;
    let mut out = Outcome {
        points: Vec::new(),
        errors: Vec::new(),
        consistency_failures: 0,
    };
    let t = Instant::now();
    let mut regions = Vec::new();
    for r in 0..k.regions {
        match AlignedBuf::new(k.region_size as usize, 4096) {
            Ok(b) => {
                // SAFETY: nothing uses the buffer yet. Touches every page before the first point.
                SplitMix64::new(cfg.seed ^ 0x4B56 ^ r as u64)
                    .fill(unsafe { b.slice_mut(0, b.len()) });
                regions.push(b);
            }
            Err(e) => {
                out.errors.push((0, format!("KV regions: {e}")));
                return out;
            }
        }
    }
    println!(
        "setup: {} KV DRAM region(s) of {} bytes (posix_memalign 4096, each registered on its own) in {:.2} s",
        k.regions,
        k.region_size,
        t.elapsed().as_secs_f64()
    );
    let mut live: Vec<Option<Live>> = Vec::new();
    for (i, spec) in cfg.backends.iter().enumerate() {
        println!("--- [{}] {} ---", letter(i), spec.label());
        match open(i, spec, ctx, &regions) {
            Ok(l) => live.push(Some(l)),
            Err(e) => {
                println!("ERROR: {e}");
                out.errors.push((i, e));
                live.push(None);
            }
        }
    }
    let nb = cfg.backends.len();
    for &op in &cfg.ops {
        println!();
        println!(
            "=== KV-cache {op} | {} | {} region(s) x {} | rounds {} (order rotated), medians ===",
            if cfg.storage_enable_direct {
                "O_DIRECT"
            } else {
                "buffered"
            },
            k.regions,
            human_size(k.region_size),
            k.rounds
        );
        if let Some(n) = (ctx.page_cache_note)(op) {
            println!("{n}");
        }
        for block in k.block_sizes() {
            let want = k.blocks_for(block);
            let fit = max_blocks(block, k.region_size, k.regions, ctx.file_len);
            let n = want.min(fit);
            if n == 0 {
                println!("{op} {}: skipped, no block fits", human_size(block));
                continue;
            }
            if n < want {
                println!(
                    "note: {} x {want} does not fit (regions hold {} blocks, the file region {} non-adjacent ones): {n} blocks",
                    human_size(block),
                    k.regions as u64 * (k.region_size / block),
                    (ctx.file_len / block).div_ceil(2)
                );
            }
            let lay = layout(cfg.seed, block, n, k.region_size, k.regions, ctx.file_len);
            let pairs: Vec<(usize, u64)> = lay
                .mem
                .iter()
                .zip(&lay.file)
                .map(|(&(r, off), &f)| (regions[r].addr() + off as usize, f))
                .collect();
            let mut point = Point {
                op,
                block,
                blocks: n,
                samples: vec![Vec::new(); nb],
            };
            for round in 0..k.rounds {
                let mut line = format!(
                    "{op} {} x {n} round {}/{}:",
                    human_size(block),
                    round + 1,
                    k.rounds
                );
                for j in 0..nb {
                    let b = (j + round) % nb;
                    let Some(l) = &live[b] else { continue };
                    match measure(l, ctx, &regions, &lay, &pairs, op, round, b) {
                        Ok(s) => {
                            line.push_str(&format!(
                                " [{}] {:.3} GB/s {:.3} s/GB {} req {}",
                                letter(b),
                                s.gbps,
                                s.cpu_s_per_gb,
                                s.requests,
                                if s.verified.is_ok() { "ok" } else { "MISMATCH" }
                            ));
                            if let Err(e) = &s.verified {
                                println!("  CONSISTENCY FAILED [{}]: {e}", letter(b));
                                out.consistency_failures += 1;
                            }
                            point.samples[b].push(s);
                        }
                        Err(e) => {
                            let e = format!("KV {op} block {block} x {n}: {e}");
                            println!("ERROR [{}] {}: {e}", letter(b), cfg.backends[b].label());
                            eprintln!("iud-bench: backend {}: {e}", cfg.backends[b].label());
                            out.errors.push((b, e));
                            live[b] = None;
                        }
                    }
                }
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
            out.points.push(point);
        }
        let labels: Vec<String> = cfg.backends.iter().map(|b| b.label()).collect();
        println!();
        print!("{}", table(&labels, &out.points, op));
    }
    out
}

/// Refills the request's blocks (WRITE: fresh random data; READ: zeros), posts it for the
/// configured time, then compares every block with the file.
#[allow(clippy::too_many_arguments)]
fn measure(
    l: &Live,
    ctx: &Ctx,
    regions: &[AlignedBuf],
    lay: &Layout,
    pairs: &[(usize, u64)],
    op: Op,
    round: usize,
    b: usize,
) -> Result<Sample, String> {
    let cfg = ctx.cfg;
    let block = lay.block as usize;
    let mut rng = SplitMix64::new(
        cfg.seed ^ lay.block.rotate_left(13) ^ ((round as u64) << 40) ^ ((b as u64) << 52) ^ 0xD1CE,
    );
    for &(r, off) in &lay.mem {
        // SAFETY: no transfer is in flight between measurements.
        let s = unsafe { regions[r].slice_mut(off as usize, block) };
        match op {
            Op::Write => rng.fill(s),
            Op::Read => s.fill(0),
        }
    }
    let x = ThreadXfer::from_pairs(
        &l.agent,
        &l.name,
        &l.backend,
        cfg.prepared_xfer,
        ctx.storage_kind,
        ctx.fd,
        op,
        lay.block,
        pairs,
    )?;
    let req = x.create(&l.agent, &l.name, None)?;
    let duration = Duration::from_millis(cfg.duration_ms);
    let wstart = Instant::now();
    for _ in 0..cfg.warmup_iter {
        post_and_wait(&l.agent, &req, cfg.poll).map_err(|e| format!("warmup: {e}"))?;
        if cfg.num_iter == 0 && wstart.elapsed() >= duration / 5 {
            break;
        }
    }
    let cpu0 = process_cpu_s();
    let t0 = Instant::now();
    let mut n = 0u64;
    loop {
        let done = if cfg.num_iter > 0 {
            n >= cfg.num_iter
        } else {
            n >= 3 && t0.elapsed() >= duration
        };
        if done {
            break;
        }
        post_and_wait(&l.agent, &req, cfg.poll).map_err(|e| format!("request {n}: {e}"))?;
        n += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64().max(1e-9);
    let cpu = process_cpu_s() - cpu0;
    drop(req);
    drop(x);
    let bytes = n as f64 * pairs.len() as f64 * lay.block as f64;
    let verified = verify(ctx, regions, lay);
    if op == Op::Write {
        // Not timed: keep one measurement's dirty pages from being written back during the next.
        // SAFETY: plain syscall on our fd.
        unsafe { libc::fdatasync(ctx.verify_fd) };
    }
    Ok(Sample {
        gbps: bytes / elapsed / 1e9,
        cpu_s_per_gb: per_gb(cpu, bytes),
        requests: n,
        verified,
    })
}

/// Every block of the request against the file (read through the buffered fd).
pub fn verify(ctx: &Ctx, regions: &[AlignedBuf], lay: &Layout) -> Result<(), String> {
    let mut tmp = vec![0u8; lay.block as usize];
    for (i, (&(r, off), &f)) in lay.mem.iter().zip(&lay.file).enumerate() {
        pread_full(ctx.verify_fd, &mut tmp, f).map_err(|e| format!("pread at {f}: {e}"))?;
        // SAFETY: no transfer is in flight after the timed loop.
        let d = unsafe { regions[r].slice(off as usize, lay.block as usize) };
        if d != tmp.as_slice() {
            let j = d.iter().zip(&tmp).position(|(a, b)| a != b).unwrap();
            return Err(format!(
                "descriptor {i} (region {r} offset {off}, file offset {f}, len {}): first difference at byte {j}: \
                 DRAM 0x{:02x} file 0x{:02x}",
                lay.block, d[j], tmp[j]
            ));
        }
    }
    Ok(())
}

/// Block x backend table of one op: median GB/s and CPU s/GB per backend, [A]'s ratio to each other.
pub fn table(labels: &[String], points: &[Point], op: Op) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "KV-cache {op} summary: medians over rounds; cpu = CPU s/GB; A/X = GB/s of [A] / GB/s of [X]\n"
    ));
    let mut hdr = format!("{:<6}{:>8}{:>8}", "Op", "Block", "Blocks");
    for i in 0..labels.len() {
        hdr.push_str(&format!(
            "{:>10}{:>8}",
            format!("{} GB/s", letter(i)),
            format!("{} cpu", letter(i))
        ));
    }
    for i in 1..labels.len() {
        hdr.push_str(&format!("{:>8}", format!("A/{}", letter(i))));
    }
    out.push_str(&hdr);
    out.push('\n');
    out.push_str(&"-".repeat(hdr.len()));
    out.push('\n');
    for p in points.iter().filter(|p| p.op == op) {
        let mut row = format!(
            "{:<6}{:>8}{:>8}",
            op.to_string(),
            human_size(p.block),
            p.blocks
        );
        for i in 0..labels.len() {
            if p.samples[i].is_empty() {
                row.push_str(&format!("{:>10}{:>8}", "-", "-"));
            } else {
                row.push_str(&format!(
                    "{:>10.3}{:>8.3}",
                    p.median_gbps(i),
                    p.median_cpu(i)
                ));
            }
        }
        for i in 1..labels.len() {
            let (a, x) = (p.median_gbps(0), p.median_gbps(i));
            if a.is_nan() || x.is_nan() || x <= 0.0 {
                row.push_str(&format!("{:>8}", "-"));
            } else {
                row.push_str(&format!("{:>8.2}", a / x));
            }
        }
        out.push_str(&row);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_scattered_distinct_and_never_adjacent_in_the_file() {
        for &(block, n, region, regions, file) in &[
            (4096u64, 8192u64, 64u64 << 20, 2usize, 1u64 << 30),
            (65536, 1024, 256 << 20, 1, 128 << 20),
            (2 << 20, 32, 64 << 20, 2, 128 << 20),
            (4096, 5, 8192, 3, 9 * 4096),
        ] {
            assert!(n <= max_blocks(block, region, regions, file));
            let l = layout(7, block, n, region, regions, file);
            assert_eq!((l.mem.len(), l.file.len()), (n as usize, n as usize));
            let mut f = l.file.clone();
            f.sort_unstable();
            for w in f.windows(2) {
                assert!(
                    w[1] >= w[0] + 2 * block,
                    "file blocks {} and {} touch",
                    w[0],
                    w[1]
                );
            }
            assert!(f.iter().all(|&o| o % block == 0 && o + block <= file));
            let mut m = l.mem.clone();
            m.sort_unstable();
            m.dedup();
            assert_eq!(m.len(), n as usize, "two blocks share a memory slot");
            assert!(m
                .iter()
                .all(|&(r, o)| r < regions && o % block == 0 && o + block <= region));
            // Not simply in file order: a request whose file offsets only rise would be a
            // sequential pattern in disguise.
            if n > 4 {
                assert!(l.file.windows(2).any(|w| w[1] < w[0]));
            }
            let again = layout(7, block, n, region, regions, file);
            assert_eq!((again.mem, again.file), (l.mem.clone(), l.file.clone()));
        }
        // The tightest fit: 5 blocks need 9 file slots.
        assert_eq!(max_blocks(4096, 8192, 3, 9 * 4096), 5);
        assert_eq!(max_blocks(4096, 1 << 20, 1, 8 * 4096), 4);
    }
}
