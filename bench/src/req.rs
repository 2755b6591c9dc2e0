//! The per-request workload (issue 26): what a client waits for. Per request, as vLLM and LMCache
//! drive NIXL: makeXferReq over lists prepped once per measurement (NIXL calls the backend's
//! prepXfer every time), post, poll to DONE, release, the time split into prep / post to DONE /
//! release; beside it createXferReq per request and the repost of one request (post to DONE
//! only, the KV workload's figure). Every request is verified byte for byte outside its timed
//! span, and GB/s is bytes over the summed request time (what the callers waited).

use std::io::Write as _;
use std::time::{Duration, Instant};

use nixl_sys::XferRequest;

use crate::cli::Op;
use crate::cpu::{median, per_gb, process_cpu_s};
use crate::kv::{self, Ctx, Layout, Live};
use crate::mem::{AlignedBuf, SplitMix64};
use crate::report::{human_size, letter};
use crate::runner::{post_and_wait, ThreadXfer};

/// How each request is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// makeXferReq over prepped lists, per request.
    Prepped,
    /// createXferReq, per request.
    Init,
    /// One request, posted again and again.
    Repost,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Prepped, Mode::Init, Mode::Repost];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Prepped => "make_prepped",
            Mode::Init => "initialize",
            Mode::Repost => "repost",
        }
    }
}

/// One measurement: requests of one mode for --duration_ms of summed request time.
#[derive(Debug, Clone)]
pub struct Sample {
    pub gbps: f64,
    /// Mean ms per request.
    pub prep_ms: f64,
    pub post_ms: f64,
    pub release_ms: f64,
    pub requests: u64,
    pub cpu_s_per_gb: f64,
    pub verified: Result<(), String>,
}

/// One (op, layout, block) point: per backend, per mode, one sample per round.
#[derive(Debug, Clone)]
pub struct Point {
    pub op: Op,
    pub contig: bool,
    pub block: u64,
    pub blocks: u64,
    pub samples: Vec<[Vec<Sample>; 3]>,
}

impl Point {
    pub fn med(&self, b: usize, m: Mode, f: impl Fn(&Sample) -> f64) -> f64 {
        median(
            &self.samples[b][m as usize]
                .iter()
                .map(f)
                .collect::<Vec<_>>(),
        )
    }

    pub fn verified(&self, b: usize, m: Mode) -> Option<bool> {
        let s = &self.samples[b][m as usize];
        (!s.is_empty()).then(|| s.iter().all(|x| x.verified.is_ok()))
    }
}

pub struct Outcome {
    pub points: Vec<Point>,
    pub errors: Vec<(usize, String)>,
    pub consistency_failures: usize,
    /// The tables as printed (results.md puts them first).
    pub text: String,
}

fn modes(ctx: &Ctx) -> Vec<Mode> {
    let r = &ctx.cfg.req;
    Mode::ALL
        .into_iter()
        .filter(|&m| {
            m == Mode::Prepped || (m == Mode::Init && r.init) || (m == Mode::Repost && r.repost)
        })
        .collect()
}

pub fn run(ctx: &Ctx) -> Outcome {
    let cfg = ctx.cfg;
    let r = &cfg.req;
    let mut out = Outcome {
        points: Vec::new(),
        errors: Vec::new(),
        consistency_failures: 0,
        text: String::new(),
    };
    let t = Instant::now();
    let mut regions = Vec::new();
    for i in 0..cfg.kv.regions {
        match AlignedBuf::new(r.region_size as usize, 4096) {
            Ok(b) => {
                // SAFETY: nothing uses the buffer yet. Touches every page before the first point.
                SplitMix64::new(cfg.seed ^ 0x5245_5155 ^ i as u64)
                    .fill(unsafe { b.slice_mut(0, b.len()) });
                regions.push(b);
            }
            Err(e) => {
                out.errors.push((0, format!("per-request regions: {e}")));
                return out;
            }
        }
    }
    println!(
        "setup: {} per-request DRAM region(s) of {} bytes in {:.2} s",
        cfg.kv.regions,
        r.region_size,
        t.elapsed().as_secs_f64()
    );
    let mut live: Vec<Option<Live>> = Vec::new();
    for (i, spec) in cfg.backends.iter().enumerate() {
        println!("--- [{}] {} ---", letter(i), spec.label());
        match kv::open(i, spec, ctx, &regions) {
            Ok(l) => live.push(Some(l)),
            Err(e) => {
                println!("ERROR: {e}");
                out.errors.push((i, e));
                live.push(None);
            }
        }
    }
    let nb = cfg.backends.len();
    let ms = modes(ctx);
    let mut seq = 0u64;
    let mut todo: Vec<(Op, bool)> = cfg.ops.iter().map(|&op| (op, false)).collect();
    if r.contig && cfg.ops.contains(&Op::Read) {
        todo.push((Op::Read, true));
    }
    for (op, contig) in todo {
        println!();
        println!(
            "=== per request {op}{} | {} | rounds {} (order rotated), medians ===",
            if contig { " contiguous" } else { "" },
            if cfg.storage_enable_direct {
                "O_DIRECT"
            } else {
                "buffered"
            },
            cfg.kv.rounds
        );
        for &(block, n) in &r.points {
            let lay = if contig {
                Layout {
                    block,
                    mem: (0..n).map(|j| (0, j * block)).collect(),
                    file: (0..n).map(|j| j * block).collect(),
                }
            } else {
                kv::layout(
                    cfg.seed,
                    block,
                    n,
                    r.region_size,
                    cfg.kv.regions,
                    ctx.file_len,
                )
            };
            let pairs: Vec<(usize, u64)> = lay
                .mem
                .iter()
                .zip(&lay.file)
                .map(|(&(ri, off), &f)| (regions[ri].addr() + off as usize, f))
                .collect();
            let mut point = Point {
                op,
                contig,
                block,
                blocks: n,
                samples: vec![Default::default(); nb],
            };
            for round in 0..cfg.kv.rounds {
                let mut line = format!(
                    "{op}{} {} x {n} round {}/{}:",
                    if contig { " contiguous" } else { "" },
                    human_size(block),
                    round + 1,
                    cfg.kv.rounds
                );
                for j in 0..nb {
                    let b = (j + round) % nb;
                    // The modes rotate too: a fixed order would give each mode the same
                    // predecessor (and its page-cache aftermath) in every round.
                    for k in 0..ms.len() {
                        let m = ms[(k + round) % ms.len()];
                        let Some(l) = &live[b] else { continue };
                        match measure(l, ctx, &regions, &lay, &pairs, op, m, &mut seq) {
                            Ok(s) => {
                                line.push_str(&format!(
                                    " [{}] {} {:.3} GB/s ({:.2}/{:.2}/{:.2} ms, {} req, {:.3} s/GB) {}",
                                    letter(b),
                                    m.name(),
                                    s.gbps,
                                    s.prep_ms,
                                    s.post_ms,
                                    s.release_ms,
                                    s.requests,
                                    s.cpu_s_per_gb,
                                    if s.verified.is_ok() { "ok" } else { "MISMATCH" }
                                ));
                                if let Err(e) = &s.verified {
                                    println!(
                                        "  CONSISTENCY FAILED [{}] {}: {e}",
                                        letter(b),
                                        m.name()
                                    );
                                    out.consistency_failures += 1;
                                }
                                point.samples[b][m as usize].push(s);
                            }
                            Err(e) => {
                                let e = format!(
                                    "per request {op} block {block} x {n} {}: {e}",
                                    m.name()
                                );
                                println!("ERROR [{}] {}: {e}", letter(b), cfg.backends[b].label());
                                out.errors.push((b, e));
                                live[b] = None;
                            }
                        }
                    }
                }
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
            out.points.push(point);
        }
    }
    let labels: Vec<String> = cfg.backends.iter().map(|b| b.label()).collect();
    out.text = tables(&labels, &out.points, &ms);
    println!();
    print!("{}", out.text);
    out
}

/// Untimed, before each request: READ destinations get a poison byte; WRITE blocks get the
/// request's number in their first 8 bytes (so every request writes what the file lacks).
fn before(regions: &[AlignedBuf], lay: &Layout, op: Op, seq: u64) {
    for &(r, off) in &lay.mem {
        // SAFETY: no transfer is in flight between requests.
        let s = unsafe { regions[r].slice_mut(off as usize, lay.block as usize) };
        match op {
            Op::Read => s.fill(0x5A ^ seq as u8),
            Op::Write => s[..8].copy_from_slice(&seq.to_le_bytes()),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn measure(
    l: &Live,
    ctx: &Ctx,
    regions: &[AlignedBuf],
    lay: &Layout,
    pairs: &[(usize, u64)],
    op: Op,
    mode: Mode,
    seq: &mut u64,
) -> Result<Sample, String> {
    let cfg = ctx.cfg;
    if op == Op::Write {
        let mut rng = SplitMix64::new(cfg.seed ^ lay.block.rotate_left(11) ^ *seq ^ 0xBEEF);
        for &(r, off) in &lay.mem {
            // SAFETY: no transfer is in flight between measurements.
            rng.fill(unsafe { regions[r].slice_mut(off as usize, lay.block as usize) });
        }
    }
    let x = ThreadXfer::from_pairs(
        &l.agent,
        &l.name,
        &l.backend,
        mode != Mode::Init,
        ctx.storage_kind,
        ctx.fd,
        op,
        lay.block,
        pairs,
    )?;
    let held = match mode {
        Mode::Repost => Some(x.create(&l.agent, &l.name, None)?),
        _ => None,
    };
    // One request: (prep, post to DONE, release) seconds.
    let one = || -> Result<(f64, f64, f64), String> {
        let t0 = Instant::now();
        let mut owned: Option<XferRequest> = None;
        let req = match &held {
            Some(h) => h,
            None => owned.insert(x.create(&l.agent, &l.name, None)?),
        };
        let t1 = Instant::now();
        post_and_wait(&l.agent, req, cfg.poll)?;
        let t2 = Instant::now();
        drop(owned);
        let t3 = Instant::now();
        Ok((
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64(),
        ))
    };
    *seq += 1;
    before(regions, lay, op, *seq);
    one().map_err(|e| format!("warm-up: {e}"))?;
    let mut verified = kv::verify(ctx, regions, lay).map_err(|e| format!("warm-up request: {e}"));
    let (mut prep, mut post, mut rel, mut cpu, mut k) = (0.0, 0.0, 0.0, 0.0, 0u64);
    let duration = Duration::from_millis(cfg.duration_ms).as_secs_f64();
    while verified.is_ok() && (k < 3 || prep + post + rel < duration) {
        *seq += 1;
        before(regions, lay, op, *seq);
        let c0 = process_cpu_s();
        let (a, b, c) = one().map_err(|e| format!("request {k}: {e}"))?;
        cpu += process_cpu_s() - c0;
        prep += a;
        post += b;
        rel += c;
        k += 1;
        verified = kv::verify(ctx, regions, lay).map_err(|e| format!("request {k}: {e}"));
    }
    drop(held);
    drop(x);
    if op == Op::Write {
        // Not timed: keep one measurement's dirty pages from being written back during the next.
        // SAFETY: plain syscall on our fd.
        unsafe { libc::fdatasync(ctx.verify_fd) };
    }
    let total = (prep + post + rel).max(1e-9);
    let bytes = k as f64 * lay.mem.len() as f64 * lay.block as f64;
    let per = |v: f64| v / k.max(1) as f64 * 1e3;
    Ok(Sample {
        gbps: bytes / total / 1e9,
        prep_ms: per(prep),
        post_ms: per(post),
        release_ms: per(rel),
        requests: k,
        cpu_s_per_gb: per_gb(cpu, bytes),
        verified,
    })
}

/// The per-request tables: per op, make_prepped per request with its split and [A]'s ratios,
/// then the other modes' GB/s and ratios; then scattered READ as a share of contiguous.
pub fn tables(labels: &[String], points: &[Point], ms: &[Mode]) -> String {
    let nb = labels.len();
    let mut s = String::from(
        "Per request (what clients wait for): make_prepped = makeXferReq over prepped lists + post + poll to DONE + release, \
         per request; GB/s = bytes / summed request time; split = mean ms prep / post->DONE / release; medians over rounds; \
         every request verified byte for byte (untimed); A/X = GB/s of [A] / GB/s of [X].\n\n",
    );
    let mut hdr = String::from("| op | block | descriptors |");
    let mut sep = String::from("|---|---:|---:|");
    for i in 0..nb {
        hdr.push_str(&format!(
            " [{0}] GB/s | [{0}] prep / post->DONE / release ms |",
            letter(i)
        ));
        sep.push_str("---:|---:|");
    }
    for i in 1..nb {
        hdr.push_str(&format!(" A/{} |", letter(i)));
        sep.push_str("---:|");
    }
    for &m in ms.iter().filter(|&&m| m != Mode::Prepped) {
        for i in 0..nb {
            hdr.push_str(&format!(" {} [{}] GB/s |", m.name(), letter(i)));
            sep.push_str("---:|");
        }
        for i in 1..nb {
            hdr.push_str(&format!(" {} A/{} |", m.name(), letter(i)));
            sep.push_str("---:|");
        }
    }
    s.push_str(&format!("{hdr} verified |\n{sep}---|\n"));
    let ratio = |a: f64, x: f64| {
        if a.is_finite() && x.is_finite() && x > 0.0 {
            format!("{:.2}x", a / x)
        } else {
            "-".into()
        }
    };
    for p in points {
        let mut row = format!(
            "| {}{} | {} | {} |",
            p.op,
            if p.contig { " contiguous" } else { "" },
            human_size(p.block),
            p.blocks
        );
        let g = |b: usize, m: Mode| p.med(b, m, |x| x.gbps);
        for b in 0..nb {
            if p.samples[b][0].is_empty() {
                row.push_str(" - | - |");
            } else {
                row.push_str(&format!(
                    " {:.3} | {:.3} / {:.3} / {:.3} |",
                    g(b, Mode::Prepped),
                    p.med(b, Mode::Prepped, |x| x.prep_ms),
                    p.med(b, Mode::Prepped, |x| x.post_ms),
                    p.med(b, Mode::Prepped, |x| x.release_ms)
                ));
            }
        }
        for b in 1..nb {
            row.push_str(&format!(
                " {} |",
                ratio(g(0, Mode::Prepped), g(b, Mode::Prepped))
            ));
        }
        for &m in ms.iter().filter(|&&m| m != Mode::Prepped) {
            for b in 0..nb {
                let v = g(b, m);
                row.push_str(&if v.is_finite() {
                    format!(" {v:.3} |")
                } else {
                    " - |".into()
                });
            }
            for b in 1..nb {
                row.push_str(&format!(" {} |", ratio(g(0, m), g(b, m))));
            }
        }
        let v: Vec<Option<bool>> = (0..nb)
            .flat_map(|b| ms.iter().map(move |&m| (b, m)))
            .map(|(b, m)| p.verified(b, m))
            .collect();
        let verdict = if v.contains(&Some(false)) {
            "FAILED"
        } else if v.iter().any(|x| x.is_some()) {
            "yes"
        } else {
            "not run"
        };
        s.push_str(&format!("{row} {verdict} |\n"));
    }
    let contig: Vec<&Point> = points.iter().filter(|p| p.contig).collect();
    if !contig.is_empty() {
        s.push_str("\nScattered READ per request (make_prepped) as a share of the contiguous READ of the same descriptors:\n\n| block |");
        for i in 0..nb {
            s.push_str(&format!(" [{}] |", letter(i)));
        }
        s.push_str(&format!("\n|---|{}\n", "---:|".repeat(nb)));
        for c in contig {
            let Some(sc) = points
                .iter()
                .find(|p| !p.contig && p.op == Op::Read && p.block == c.block)
            else {
                continue;
            };
            s.push_str(&format!("| {} |", human_size(c.block)));
            for b in 0..nb {
                let (x, y) = (
                    sc.med(b, Mode::Prepped, |v| v.gbps),
                    c.med(b, Mode::Prepped, |v| v.gbps),
                );
                s.push_str(&if x.is_finite() && y > 0.0 {
                    format!(" {:.0} % |", 100.0 * x / y)
                } else {
                    " - |".into()
                });
            }
            s.push('\n');
        }
    }
    s
}
