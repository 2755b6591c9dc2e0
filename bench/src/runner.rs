//! One backend spec = one agent: create the backend, register DRAM + FILE, run every
//! (op, block size, batch size) point.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, NixlError, OptArgs, Params, RegistrationHandle,
    ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use crate::cli::{BackendSpec, Config, Op, PollMode};
use crate::cpu::process_cpu_s;
use crate::mem::{pread_full, AlignedBuf, Region, SplitMix64};
use std::io::Write as _;

use crate::report::{csv_row, table_header, table_row, PointResult};

/// A transfer that has not completed after this long is reported as hung.
const STALL_TIMEOUT: Duration = Duration::from_secs(120);
/// In time-based mode every point runs at least this many timed iterations.
const MIN_TIMED_ITERS: u64 = 3;

/// What the points of one run share: the buffer, the file, the configuration.
pub struct Ctx<'a> {
    pub cfg: &'a Config,
    pub dram: &'a AlignedBuf,
    /// The fd registered with NIXL (O_DIRECT with --storage_enable_direct).
    pub fd: i32,
    /// A buffered fd of the same file, for setup and verification.
    pub verify_fd: i32,
    pub page_cache_note: &'a (dyn Fn(Op) -> Option<String> + Sync),
    /// MemType::File (FILE_SEG) or MemType::Block (BLK_SEG) for the storage side.
    pub storage_kind: MemType,
    /// --csv: one line per point.
    pub csv: Option<&'a std::sync::Mutex<std::fs::File>>,
}

pub struct SpecOutcome {
    pub results: Vec<PointResult>,
    pub error: Option<String>,
    pub consistency_failures: usize,
}

pub fn nerr(what: &str, e: NixlError) -> String {
    format!("{what}: {e} ({e:?})")
}

/// The Params to pass, the same as a sorted map for printing, and the keys the plugin does not
/// advertise.
type BuiltParams = (Params, BTreeMap<String, String>, Vec<String>);

/// Effective backend params: the plugin's advertised defaults, then nixlbench's POSIX flags,
/// then the spec's own key=value pairs.
fn build_params(
    spec: &BackendSpec,
    cfg: &Config,
    defaults: &Params,
) -> Result<BuiltParams, String> {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    let default_keys: Vec<String> = defaults.into_iter().map(|(k, _)| k.to_string()).collect();
    for (k, v) in defaults {
        map.insert(k.to_string(), v.to_string());
    }
    if spec.name == "POSIX" {
        let explicit_api = spec
            .params
            .iter()
            .any(|(k, _)| k == "use_aio" || k == "use_uring" || k == "use_posix_aio");
        if let (Some(api), false) = (&cfg.posix_api_type, explicit_api) {
            let (a, u, p) = match api.as_str() {
                "AIO" => ("true", "false", "false"),
                "URING" => ("false", "true", "false"),
                _ => ("false", "false", "true"),
            };
            map.insert("use_aio".into(), a.into());
            map.insert("use_uring".into(), u.into());
            map.insert("use_posix_aio".into(), p.into());
        }
        if let Some(n) = cfg.posix_ios_pool_size {
            map.insert("ios_pool_size".into(), n.to_string());
        }
        if let Some(n) = cfg.posix_kernel_queue_size {
            map.insert("kernel_queue_size".into(), n.to_string());
        }
    }
    let mut unknown = Vec::new();
    for (k, v) in &spec.params {
        if !default_keys.contains(k) {
            unknown.push(k.clone());
        }
        map.insert(k.clone(), v.clone());
    }
    let params = Params::from(map.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| nerr("building backend params", e))?;
    Ok((params, map, unknown))
}

fn fmt_map<'a>(it: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let v: Vec<String> = it.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    if v.is_empty() {
        "(none)".into()
    } else {
        v.join(" ")
    }
}

fn mems_str(m: &nixl_sys::MemList) -> String {
    m.iter()
        .map(|t| t.map(|t| format!("{t:?}")).unwrap_or_else(|_| "?".into()))
        .collect::<Vec<_>>()
        .join(",")
}

pub fn run_spec(idx: usize, spec: &BackendSpec, ctx: &Ctx) -> SpecOutcome {
    let mut outcome = SpecOutcome {
        results: Vec::new(),
        error: None,
        consistency_failures: 0,
    };
    if let Err(e) = run_spec_inner(idx, spec, ctx, &mut outcome) {
        outcome.error = Some(e);
    }
    outcome
}

/// Creates agent `agent_name` and backend `spec` in it (params: the plugin's defaults, then the
/// POSIX flags, then the spec's own), printing what was asked and what the backend reports.
pub fn open_backend(
    agent_name: &str,
    spec: &BackendSpec,
    cfg: &Config,
    sync: ThreadSync,
) -> Result<(Agent, Backend), String> {
    let acfg = AgentConfig {
        enable_prog_thread: cfg.enable_pt,
        thread_sync: sync,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(agent_name, &acfg).map_err(|e| nerr("creating agent", e))?;
    let (plugin_mems, defaults) = agent.get_plugin_params(&spec.name).map_err(|e| {
        nerr(
            &format!(
                "get_plugin_params({}) — is libplugin_{}.so in NIXL_PLUGIN_DIR?",
                spec.name, spec.name
            ),
            e,
        )
    })?;
    println!(
        "plugin {}: mems [{}], defaults: {}",
        spec.name,
        mems_str(&plugin_mems),
        fmt_map(&defaults)
    );
    let (params, effective, unknown) = build_params(spec, cfg, &defaults)?;
    if !unknown.is_empty() {
        println!(
            "warning: {} does not advertise param(s) {} (passed anyway)",
            spec.name,
            unknown.join(",")
        );
    }
    println!(
        "create_backend({}) with: {}",
        spec.name,
        fmt_map(effective.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    );
    let backend = agent
        .create_backend(&spec.name, &params)
        .map_err(|e| nerr(&format!("create_backend({})", spec.name), e))?;
    match agent.get_backend_params(&backend) {
        Ok((m, p)) => println!(
            "backend params after init: mems [{}], {}",
            mems_str(&m),
            fmt_map(&p)
        ),
        Err(e) => println!("get_backend_params failed: {e}"),
    }
    Ok((agent, backend))
}

/// Registers `r` with `backend` only.
pub fn register(
    agent: &Agent,
    backend: &Backend,
    r: &Region,
    what: &str,
) -> Result<RegistrationHandle, String> {
    let mut reg_args = OptArgs::new().map_err(|e| nerr("OptArgs", e))?;
    reg_args
        .add_backend(backend)
        .map_err(|e| nerr("OptArgs::add_backend", e))?;
    agent
        .register_memory(r, Some(&reg_args))
        .map_err(|e| nerr(&format!("register_memory({what})"), e))
}

fn run_spec_inner(
    idx: usize,
    spec: &BackendSpec,
    ctx: &Ctx,
    out: &mut SpecOutcome,
) -> Result<(), String> {
    let cfg = ctx.cfg;
    let agent_name = format!("iud-bench-{idx}");
    let sync = if cfg.num_threads > 1 {
        ThreadSync::Rw
    } else {
        ThreadSync::Default
    };
    let (agent, backend) = open_backend(&agent_name, spec, cfg, sync)?;

    let total = cfg.region_per_thread() as usize * cfg.num_threads;
    let dram = Region {
        addr: ctx.dram.addr(),
        len: total,
        dev_id: 0,
        kind: MemType::Dram,
    };
    let file = Region {
        addr: 0,
        len: total,
        dev_id: ctx.fd as u64,
        kind: ctx.storage_kind,
    };
    let kind_name = if ctx.storage_kind == MemType::Block {
        "BLOCK"
    } else {
        "FILE"
    };
    let t = Instant::now();
    let _dram_reg = register(&agent, &backend, &dram, "DRAM")?;
    let _file_reg = register(&agent, &backend, &file, &format!("{kind_name}, fd mode"))?;
    println!(
        "registered DRAM (0x{:x}, {total}, 0) and {kind_name} (0, {total}, fd {}) in {:.1} ms",
        dram.addr,
        ctx.fd,
        t.elapsed().as_secs_f64() * 1e3
    );

    for &op in &cfg.ops {
        println!();
        println!(
            "=== {} | {} | {} | threads {} ===",
            spec.label(),
            op,
            if cfg.storage_enable_direct {
                "O_DIRECT"
            } else {
                "buffered"
            },
            cfg.num_threads
        );
        if let Some(n) = (ctx.page_cache_note)(op) {
            println!("{n}");
        }
        println!("{}", table_header());
        for block in cfg.block_sizes() {
            for batch in cfg.batches() {
                if block * batch > cfg.region_per_thread() {
                    println!(
                        "{block:<20}{batch:<15}skipped: block x batch = {} > per-thread region {}",
                        block * batch,
                        cfg.region_per_thread()
                    );
                    continue;
                }
                let r = run_point(&agent, &agent_name, &backend, ctx, op, block, batch).map_err(
                    |e| format!("{} {} block {block} batch {batch}: {e}", spec.label(), op),
                )?;
                println!("{}", table_row(&r));
                if let Some(csv) = ctx.csv {
                    let layout = if cfg.randomize_blockaligned {
                        "rand"
                    } else {
                        "seq"
                    };
                    let mut f = csv.lock().unwrap_or_else(|p| p.into_inner());
                    writeln!(f, "{}", csv_row(&spec.label(), layout, &r))
                        .map_err(|e| format!("--csv: {e}"))?;
                }
                if let Some(Err(e)) = &r.consistency {
                    println!("  CONSISTENCY FAILED: {e}");
                    out.consistency_failures += 1;
                }
                out.results.push(r);
                if op == Op::Write {
                    // Not timed: keep dirty pages of one point from being written back during the next.
                    // SAFETY: plain syscall on our fd.
                    unsafe { libc::fdatasync(ctx.verify_fd) };
                }
            }
        }
        if cfg.check_consistency {
            let mine = out.results.iter().filter(|r| r.op == op);
            let failed = mine
                .clone()
                .filter(|r| matches!(r.consistency, Some(Err(_))))
                .count();
            println!(
                "consistency: {} point(s) verified, {failed} failed",
                mine.count()
            );
        }
    }
    Ok(())
}

struct ThreadStats {
    iters: u64,
    start: Instant,
    end: Instant,
    /// Process CPU seconds (cpu::process_cpu_s) when this thread's timed loop began and ended.
    cpu_start: f64,
    cpu_end: f64,
    prep: Vec<f64>,
    post: Vec<f64>,
    tx: Vec<f64>,
}

/// Iteration plan of one point, per thread.
struct Plan {
    iters: Option<u64>,
    warmup: u64,
    duration: Option<Duration>,
}

fn plan(cfg: &Config, block: u64) -> Plan {
    let threads = cfg.num_threads as u64;
    if cfg.num_iter > 0 {
        let (mut n, mut w) = (cfg.num_iter, cfg.warmup_iter);
        if block > 1 << 20 {
            n /= cfg.large_blk_iter_ftr;
            w /= cfg.large_blk_iter_ftr;
        }
        Plan {
            iters: Some(n.div_ceil(threads).max(1)),
            warmup: w.div_ceil(threads),
            duration: None,
        }
    } else {
        Plan {
            iters: None,
            warmup: cfg.warmup_iter,
            duration: Some(Duration::from_millis(cfg.duration_ms)),
        }
    }
}

/// (DRAM offset, file offset) of every descriptor of thread `t`'s request, both absolute within
/// the buffer / file. Descriptor j uses block j of the thread's region on both sides (nixlbench's
/// layout: a request covers one contiguous range, which a backend may merge); with
/// `--randomize_location_mode blockaligned` the file blocks are shuffled (seeded), so neighbouring
/// descriptors are (almost never) contiguous in the file.
fn desc_pairs(cfg: &Config, block: u64, batch: u64, t: usize) -> Vec<(u64, u64)> {
    let base = t as u64 * cfg.region_per_thread();
    let mut file: Vec<u64> = (0..batch).map(|j| base + j * block).collect();
    if cfg.randomize_blockaligned {
        let mut rng =
            SplitMix64::new(cfg.seed ^ 0x5EED ^ (t as u64) << 32 ^ block ^ batch.rotate_left(20));
        for i in (1..file.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            file.swap(i, j);
        }
    }
    (0..batch).map(|j| base + j * block).zip(file).collect()
}

fn run_point(
    agent: &Agent,
    agent_name: &str,
    backend: &Backend,
    ctx: &Ctx,
    op: Op,
    block: u64,
    batch: u64,
) -> Result<PointResult, String> {
    let cfg = ctx.cfg;
    if cfg.check_consistency {
        // WRITE: fresh random source data, so the file cannot already hold it.
        // READ: zero the destinations, so stale data cannot pass.
        let mut rng =
            SplitMix64::new(cfg.seed ^ block.rotate_left(17) ^ batch.rotate_left(41) ^ 0xA5A5);
        for t in 0..cfg.num_threads {
            for (mem, _) in desc_pairs(cfg, block, batch, t) {
                // SAFETY: no transfer is in flight between points.
                let s = unsafe { ctx.dram.slice_mut(mem as usize, block as usize) };
                match op {
                    Op::Write => rng.fill(s),
                    Op::Read => s.fill(0),
                }
            }
        }
    }
    let p = plan(cfg, block);
    let barrier = Barrier::new(cfg.num_threads);
    let abort = AtomicBool::new(false);
    let results: Vec<Result<ThreadStats, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.num_threads)
            .map(|t| {
                let (barrier, abort, p) = (&barrier, &abort, &p);
                s.spawn(move || {
                    let r = thread_run(
                        agent, agent_name, backend, ctx, op, block, batch, t, barrier, abort, p,
                    );
                    if r.is_err() {
                        abort.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("benchmark thread panicked".into()))
            })
            .collect()
    });
    let (mut stats, mut errs) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(s) => stats.push(s),
            Err(e) => errs.push(e),
        }
    }
    if !errs.is_empty() {
        // Report the thread that failed, not the ones it stopped.
        return Err(errs
            .iter()
            .find(|e| *e != ABORTED)
            .unwrap_or(&errs[0])
            .clone());
    }
    let start = stats.iter().map(|s| s.start).min().unwrap();
    let end = stats.iter().map(|s| s.end).max().unwrap();
    let mut r = PointResult {
        op,
        block,
        batch,
        iters: stats.iter().map(|s| s.iters).sum(),
        threads: cfg.num_threads,
        elapsed_s: (end - start).as_secs_f64().max(1e-9),
        prep_us: stats.iter().flat_map(|s| s.prep.iter().copied()).collect(),
        post_us: stats.iter().flat_map(|s| s.post.iter().copied()).collect(),
        tx_us: stats.iter().flat_map(|s| s.tx.iter().copied()).collect(),
        // The process-wide counter: from the earliest start sample to the latest end sample.
        cpu_s: stats.iter().map(|s| s.cpu_end).fold(f64::MIN, f64::max)
            - stats.iter().map(|s| s.cpu_start).fold(f64::MAX, f64::min),
        consistency: None,
    };
    if cfg.check_consistency {
        r.consistency = Some(verify(ctx, block, batch));
    }
    Ok(r)
}

/// Compares every descriptor's DRAM range with the file range (read through the buffered fd).
fn verify(ctx: &Ctx, block: u64, batch: u64) -> Result<(), String> {
    let mut tmp = vec![0u8; block as usize];
    for t in 0..ctx.cfg.num_threads {
        for (j, (mem, file)) in desc_pairs(ctx.cfg, block, batch, t).into_iter().enumerate() {
            pread_full(ctx.verify_fd, &mut tmp, file)
                .map_err(|e| format!("pread at {file}: {e}"))?;
            // SAFETY: no transfer is in flight after the point.
            let d = unsafe { ctx.dram.slice(mem as usize, block as usize) };
            if d != tmp.as_slice() {
                let i = d.iter().zip(&tmp).position(|(a, b)| a != b).unwrap();
                return Err(format!(
                    "thread {t} descriptor {j} (DRAM offset {mem}, file offset {file}, len {block}): \
                     first difference at byte {i}: DRAM 0x{:02x} file 0x{:02x}",
                    d[i], tmp[i]
                ));
            }
        }
    }
    Ok(())
}

/// The descriptor lists, opt args and (with --prepared_xfer) prepped dlist handles of one request.
pub struct ThreadXfer<'a> {
    xop: XferOp,
    local: XferDescList<'a>,
    remote: XferDescList<'a>,
    opt: OptArgs,
    idx: Vec<i32>,
    prepped: Option<(XferDlistHandle, XferDlistHandle)>,
}

impl ThreadXfer<'_> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        agent: &Agent,
        agent_name: &str,
        backend: &Backend,
        ctx: &Ctx,
        op: Op,
        block: u64,
        batch: u64,
        t: usize,
    ) -> Result<Self, String> {
        let pairs: Vec<(usize, u64)> = desc_pairs(ctx.cfg, block, batch, t)
            .into_iter()
            .map(|(mem, file)| (ctx.dram.addr() + mem as usize, file))
            .collect();
        Self::from_pairs(
            agent,
            agent_name,
            backend,
            ctx.cfg.prepared_xfer,
            ctx.storage_kind,
            ctx.fd,
            op,
            block,
            &pairs,
        )
    }

    /// One DRAM descriptor (absolute address) and one storage descriptor (offset in `fd`) of
    /// `block` bytes per pair, in order.
    #[allow(clippy::too_many_arguments)]
    pub fn from_pairs(
        agent: &Agent,
        agent_name: &str,
        backend: &Backend,
        prepared: bool,
        storage_kind: MemType,
        fd: i32,
        op: Op,
        block: u64,
        pairs: &[(usize, u64)],
    ) -> Result<Self, String> {
        let mut local =
            XferDescList::new(MemType::Dram).map_err(|e| nerr("XferDescList(DRAM)", e))?;
        let mut remote =
            XferDescList::new(storage_kind).map_err(|e| nerr("XferDescList(storage)", e))?;
        for &(addr, file) in pairs {
            local.add_desc(addr, block as usize, 0);
            remote.add_desc(file as usize, block as usize, fd as u64);
        }
        let mut opt = OptArgs::new().map_err(|e| nerr("OptArgs", e))?;
        opt.add_backend(backend)
            .map_err(|e| nerr("OptArgs::add_backend", e))?;
        let prepped = if prepared {
            // NIXL_INIT_AGENT ("") for the local side, our own name for the loopback FILE side.
            let lh = agent
                .prepare_xfer_dlist("", &local, Some(&opt))
                .map_err(|e| nerr("prep_xfer_dlist(DRAM)", e))?;
            let rh = agent
                .prepare_xfer_dlist(agent_name, &remote, Some(&opt))
                .map_err(|e| nerr("prep_xfer_dlist(FILE)", e))?;
            Some((lh, rh))
        } else {
            None
        };
        let xop = match op {
            Op::Read => XferOp::Read,
            Op::Write => XferOp::Write,
        };
        Ok(Self {
            xop,
            local,
            remote,
            opt,
            idx: (0..pairs.len() as i32).collect(),
            prepped,
        })
    }

    /// createXferReq (or makeXferReq from the prepped lists); the time goes to `prep` if given.
    pub fn create(
        &self,
        agent: &Agent,
        agent_name: &str,
        prep: Option<&mut Vec<f64>>,
    ) -> Result<XferRequest, String> {
        let t0 = Instant::now();
        let r = match &self.prepped {
            Some((lh, rh)) => agent
                .make_xfer_req(self.xop, lh, &self.idx, rh, &self.idx, Some(&self.opt))
                .map_err(|e| nerr("make_xfer_req", e)),
            None => agent
                .create_xfer_req(
                    self.xop,
                    &self.local,
                    &self.remote,
                    agent_name,
                    Some(&self.opt),
                )
                .map_err(|e| nerr("create_xfer_req", e)),
        }?;
        if let Some(p) = prep {
            p.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        Ok(r)
    }
}

const ABORTED: &str = "aborted because another thread failed";

#[allow(clippy::too_many_arguments)]
fn thread_run(
    agent: &Agent,
    agent_name: &str,
    backend: &Backend,
    ctx: &Ctx,
    op: Op,
    block: u64,
    batch: u64,
    t: usize,
    barrier: &Barrier,
    abort: &AtomicBool,
    p: &Plan,
) -> Result<ThreadStats, String> {
    let recreate = ctx.cfg.recreate_xfer;
    let mut st = ThreadStats::new();
    // Setup + first request + warmup.
    let ready = (|| -> Result<(ThreadXfer, XferRequest), String> {
        let x = ThreadXfer::new(agent, agent_name, backend, ctx, op, block, batch, t)?;
        let mut req = x.create(agent, agent_name, Some(&mut st.prep))?;
        let wstart = Instant::now();
        for i in 0..p.warmup {
            if abort.load(Ordering::Relaxed) {
                break;
            }
            if recreate && i > 0 {
                drop(req);
                req = x.create(agent, agent_name, None)?;
            }
            post_and_wait(agent, &req, ctx.cfg.poll).map_err(|e| format!("warmup: {e}"))?;
            // Time-based mode: warmup takes at most a fifth of the point's duration.
            if p.duration.is_some_and(|d| wstart.elapsed() >= d / 5) {
                break;
            }
        }
        Ok((x, req))
    })();
    if ready.is_err() {
        abort.store(true, Ordering::Relaxed);
    }
    // Every thread passes this barrier exactly once, whatever happened before it.
    barrier.wait();
    let (x, mut req) = ready?;
    if abort.load(Ordering::Relaxed) {
        return Err(ABORTED.into());
    }

    st.cpu_start = process_cpu_s();
    st.start = Instant::now();
    let mut n = 0u64;
    let result = loop {
        let done = match (p.iters, p.duration) {
            (Some(max), _) => n >= max,
            (None, Some(d)) => n >= MIN_TIMED_ITERS && st.start.elapsed() >= d,
            (None, None) => true,
        };
        if done {
            break Ok(());
        }
        if abort.load(Ordering::Relaxed) {
            break Err(ABORTED.to_string());
        }
        if recreate && n > 0 {
            drop(req);
            req = x
                .create(agent, agent_name, Some(&mut st.prep))
                .map_err(|e| format!("iteration {n}: {e}"))?;
        }
        match post_and_wait(agent, &req, ctx.cfg.poll) {
            Ok((post, tx)) => {
                st.post.push(post);
                st.tx.push(tx);
                n += 1;
            }
            Err(e) => break Err(format!("iteration {n}: {e}")),
        }
    };
    st.end = Instant::now();
    st.cpu_end = process_cpu_s();
    st.iters = n;
    drop(req);
    drop(x);
    result.map(|_| st)
}

impl ThreadStats {
    fn new() -> Self {
        let now = Instant::now();
        Self {
            iters: 0,
            start: now,
            end: now,
            cpu_start: 0.0,
            cpu_end: 0.0,
            prep: Vec::new(),
            post: Vec::new(),
            tx: Vec::new(),
        }
    }
}

/// Posts and polls get_xfer_status until done (spinning as nixlbench does, or as `poll` says).
/// Returns (post µs, tx µs).
pub fn post_and_wait(
    agent: &Agent,
    req: &XferRequest,
    poll: PollMode,
) -> Result<(f64, f64), String> {
    let t0 = Instant::now();
    let in_prog = agent
        .post_xfer_req(req, None)
        .map_err(|e| nerr("post_xfer_req", e))?;
    let t1 = Instant::now();
    if in_prog {
        let mut polls = 0u64;
        loop {
            match agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => break,
                Ok(XferStatus::InProgress) => {
                    polls += 1;
                    if polls % 4096 == 0 && t1.elapsed() > STALL_TIMEOUT {
                        return Err(format!(
                            "transfer still in progress after {} s ({polls} polls)",
                            STALL_TIMEOUT.as_secs()
                        ));
                    }
                    match poll {
                        PollMode::Spin => std::hint::spin_loop(),
                        // SAFETY: plain syscall.
                        PollMode::Yield => unsafe {
                            libc::sched_yield();
                        },
                        PollMode::Sleep(d) => std::thread::sleep(d),
                    }
                }
                Err(e) => return Err(nerr("get_xfer_status", e)),
            }
        }
    }
    let t2 = Instant::now();
    Ok(((t1 - t0).as_secs_f64() * 1e6, (t2 - t1).as_secs_f64() * 1e6))
}
