//! gflags-style command line (`--flag value`, `--flag=value`, `-flag`, `--noflag` for booleans),
//! with nixlbench's flag names where nixlbench has the flag.

use std::fmt;

/// The flag list, shared with `ci/bench.sh --help` (which prints this file without building).
pub const USAGE: &str = include_str!("usage.txt");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Write => "WRITE",
            Op::Read => "READ",
        })
    }
}

/// What the polling loop does between getXferStatus calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// A busy loop, as nixlbench does.
    Spin,
    /// sched_yield: leaves the CPU to I/O threads on small machines.
    Yield,
    /// Sleeps this long, as clients that poll rarely do (LMCache sleeps 1 ms).
    Sleep(std::time::Duration),
}

impl PollMode {
    pub fn describe(self) -> String {
        match self {
            PollMode::Spin => "spin".into(),
            PollMode::Yield => "yield (sched_yield between polls)".into(),
            PollMode::Sleep(d) => format!("sleep {} us between polls", d.as_micros()),
        }
    }
}

/// How the storage target is registered with NIXL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegType {
    /// BLOCK for block devices, FILE for anything else.
    Auto,
    File,
    Block,
}

#[derive(Clone, Debug)]
pub struct BackendSpec {
    pub name: String,
    pub params: Vec<(String, String)>,
}

impl BackendSpec {
    pub fn label(&self) -> String {
        if self.params.is_empty() {
            self.name.clone()
        } else {
            let p: Vec<String> = self
                .params
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            format!("{}:{}", self.name, p.join(";"))
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub backends: Vec<BackendSpec>,
    pub posix_api_type: Option<String>,
    pub posix_ios_pool_size: Option<u64>,
    pub posix_kernel_queue_size: Option<u64>,
    pub filepath: Option<String>,
    pub ops: Vec<Op>,
    pub total_buffer_size: u64,
    pub start_block_size: u64,
    pub max_block_size: u64,
    pub start_batch_size: u64,
    pub max_batch_size: u64,
    pub batch_sizes: Option<Vec<u64>>,
    pub num_iter: u64,
    pub duration_ms: u64,
    pub warmup_iter: u64,
    pub large_blk_iter_ftr: u64,
    pub num_threads: usize,
    pub storage_enable_direct: bool,
    pub check_consistency: bool,
    pub recreate_xfer: bool,
    pub prepared_xfer: bool,
    pub enable_pt: bool,
    pub seed: u64,
    /// nixlbench --randomize_location_mode blockaligned: shuffle the file blocks of a request.
    pub randomize_blockaligned: bool,
    pub storage_seg_type: SegType,
    pub csv: Option<String>,
    /// --poll_mode: what the polling loop does between getXferStatus calls.
    pub poll: PollMode,
    /// --workload: run the nixlbench-style contiguous sweep.
    pub contig: bool,
    /// --workload: run the KV-cache pattern.
    pub run_kv: bool,
    pub kv: KvConfig,
    /// --workload: run the per-request tables (req.rs), printed first.
    pub run_req: bool,
    pub req: ReqConfig,
    pub background_load: usize,
    pub out_dir: Option<String>,
}

/// The KV-cache workload's shape (see usage.txt).
#[derive(Clone, Debug)]
pub struct KvConfig {
    pub start_block_size: u64,
    pub max_block_size: u64,
    /// 0 = request_size / block, at most MAX_KV_BLOCKS.
    pub blocks: u64,
    pub request_size: u64,
    pub regions: usize,
    pub region_size: u64,
    pub rounds: usize,
}

/// The per-request workload's shape (see usage.txt); regions, rounds and the time per
/// measurement come from the KV flags and --duration_ms.
#[derive(Clone, Debug)]
pub struct ReqConfig {
    /// (block, descriptors) per point.
    pub points: Vec<(u64, u64)>,
    pub region_size: u64,
    /// make_prepped_xfer per request always; initialize_xfer per request; repost of one request.
    pub init: bool,
    pub repost: bool,
    /// A contiguous READ of the same descriptors per size.
    pub contig: bool,
}

impl ReqConfig {
    /// File bytes the largest scattered point needs (no two blocks adjacent).
    pub fn file_len(&self) -> u64 {
        self.points
            .iter()
            .map(|&(b, n)| (2 * n).saturating_sub(1) * b)
            .max()
            .unwrap_or(0)
    }
}

pub fn parse_points(v: &str) -> Result<Vec<(u64, u64)>, String> {
    v.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            let (b, n) = x
                .split_once(':')
                .ok_or_else(|| format!("--req_points: BLOCK:COUNT, got '{x}'"))?;
            Ok((
                parse_size(b)?,
                n.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("--req_points: bad count '{n}'"))?,
            ))
        })
        .collect()
}

/// Upper bound of the automatic KV block count (the largest count in issue 13's table).
pub const MAX_KV_BLOCKS: u64 = 8192;

impl KvConfig {
    pub fn block_sizes(&self) -> Vec<u64> {
        doubling(self.start_block_size, self.max_block_size)
    }

    /// Descriptors per request at `block` before the fit checks of kv::layout.
    pub fn blocks_for(&self, block: u64) -> u64 {
        if self.blocks > 0 {
            self.blocks
        } else {
            (self.request_size / block).clamp(1, MAX_KV_BLOCKS)
        }
    }
}

fn doubling(start: u64, max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut b = start;
    while b <= max && b > 0 {
        v.push(b);
        b *= 2;
    }
    v
}

impl Default for Config {
    fn default() -> Self {
        Self {
            backends: parse_backends("IO_URING_DMABUF").unwrap(),
            posix_api_type: None,
            posix_ios_pool_size: None,
            posix_kernel_queue_size: None,
            filepath: None,
            ops: vec![Op::Write],
            total_buffer_size: 1 << 30,
            start_block_size: 4096,
            max_block_size: 16 << 20,
            start_batch_size: 1,
            max_batch_size: 1,
            batch_sizes: None,
            num_iter: 0,
            duration_ms: 500,
            warmup_iter: 10,
            large_blk_iter_ftr: 16,
            num_threads: 1,
            storage_enable_direct: false,
            check_consistency: false,
            recreate_xfer: false,
            prepared_xfer: false,
            enable_pt: false,
            seed: 1,
            randomize_blockaligned: false,
            storage_seg_type: SegType::Auto,
            csv: None,
            poll: PollMode::Spin,
            contig: true,
            run_kv: false,
            kv: KvConfig {
                start_block_size: 4096,
                max_block_size: 2 << 20,
                blocks: 0,
                request_size: 64 << 20,
                regions: 2,
                region_size: 256 << 20,
                rounds: 3,
            },
            run_req: false,
            req: ReqConfig {
                points: parse_points("16K:8192,32K:8192,64K:4096,256K:2048,2M:512").unwrap(),
                region_size: 1 << 30,
                init: true,
                repost: true,
                contig: true,
            },
            background_load: 0,
            out_dir: None,
        }
    }
}

impl Config {
    pub fn block_sizes(&self) -> Vec<u64> {
        doubling(self.start_block_size, self.max_block_size)
    }

    pub fn batches(&self) -> Vec<u64> {
        if let Some(b) = &self.batch_sizes {
            return b.clone();
        }
        let mut v = Vec::new();
        let mut b = self.start_batch_size;
        while b <= self.max_batch_size {
            v.push(b);
            b *= 2;
        }
        v
    }

    /// Per-thread share of the buffer (and of the file region), page aligned.
    pub fn region_per_thread(&self) -> u64 {
        (self.total_buffer_size / self.num_threads as u64) & !4095
    }
}

#[derive(Debug)]
pub enum Parsed {
    Run(Box<Config>),
    Help,
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("bad size '{s}'")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("bad size '{s}'"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size '{s}' overflows"))
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "y" | "t" => Ok(true),
        "0" | "false" | "no" | "n" | "f" => Ok(false),
        _ => Err(format!("bad boolean '{s}'")),
    }
}

/// `NAME` or `NAME:k=v;k=v`, comma separated. A comma-separated token without ':' that contains
/// '=' continues the previous spec's parameters (so `POSIX:use_uring=true,kernel_queue_size=512`
/// is one spec).
pub fn parse_backends(s: &str) -> Result<Vec<BackendSpec>, String> {
    let mut out: Vec<BackendSpec> = Vec::new();
    for tok in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (name, params) = match tok.split_once(':') {
            Some((n, p)) => (Some(n.trim()), p),
            None if tok.contains('=') => (None, tok),
            None => (Some(tok), ""),
        };
        let mut kv = Vec::new();
        for p in params.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| format!("backend parameter '{p}' is not key=value"))?;
            kv.push((k.trim().to_string(), v.trim().to_string()));
        }
        match name {
            Some(n) => {
                if n.is_empty() {
                    return Err(format!("empty backend name in '{tok}'"));
                }
                out.push(BackendSpec {
                    name: n.to_string(),
                    params: kv,
                })
            }
            None => match out.last_mut() {
                Some(last) => last.params.extend(kv),
                None => return Err(format!("backend list starts with parameters: '{tok}'")),
            },
        }
    }
    if out.is_empty() {
        return Err("empty --backend".into());
    }
    Ok(out)
}

const BOOL_FLAGS: &[&str] = &[
    "storage_enable_direct",
    "check_consistency",
    "recreate_xfer",
    "prepared_xfer",
    "enable_pt",
    "req_contig",
    "help",
];

const VALUE_FLAGS: &[&str] = &[
    "backend",
    "posix_api_type",
    "posix_ios_pool_size",
    "posix_kernel_queue_size",
    "filepath",
    "op_type",
    "total_buffer_size",
    "start_block_size",
    "max_block_size",
    "start_batch_size",
    "max_batch_size",
    "batch_sizes",
    "num_iter",
    "duration_ms",
    "warmup_iter",
    "large_blk_iter_ftr",
    "num_threads",
    "seed",
    "randomize_location_mode",
    "initiator_seg_type",
    "worker_type",
    "storage_seg_type",
    "csv",
    "poll_mode",
    "workload",
    "kv_start_block_size",
    "kv_max_block_size",
    "kv_blocks",
    "kv_request_size",
    "kv_regions",
    "kv_region_size",
    "kv_rounds",
    "req_points",
    "req_region_size",
    "req_modes",
    "background_load",
    "out_dir",
];

pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut c = Config::default();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        let body = a
            .strip_prefix("--")
            .or_else(|| a.strip_prefix('-'))
            .ok_or_else(|| format!("unexpected argument '{a}'"))?;
        let (key, inline_val) = match body.split_once('=') {
            Some((k, v)) => (k.replace('-', "_"), Some(v.to_string())),
            None => (body.replace('-', "_"), None),
        };
        // Booleans: --flag, --flag=value, --noflag.
        let bool_key = if BOOL_FLAGS.contains(&key.as_str()) {
            Some((key.clone(), true))
        } else {
            key.strip_prefix("no")
                .filter(|k| BOOL_FLAGS.contains(k) && inline_val.is_none())
                .map(|k| (k.to_string(), false))
        };
        if let Some((k, dflt)) = bool_key {
            let v = match &inline_val {
                Some(v) => parse_bool(v)?,
                None => dflt,
            };
            match k.as_str() {
                "storage_enable_direct" => c.storage_enable_direct = v,
                "check_consistency" => c.check_consistency = v,
                "recreate_xfer" => c.recreate_xfer = v,
                "prepared_xfer" => c.prepared_xfer = v,
                "enable_pt" => c.enable_pt = v,
                "req_contig" => c.req.contig = v,
                "help" => return Ok(Parsed::Help),
                _ => unreachable!(),
            }
            continue;
        }
        if !VALUE_FLAGS.contains(&key.as_str()) {
            return Err(format!("unknown flag --{key} (see --help)"));
        }
        let val = match inline_val {
            Some(v) => v,
            None => {
                let v = args
                    .get(i)
                    .ok_or_else(|| format!("flag --{key} needs a value"))?
                    .clone();
                i += 1;
                v
            }
        };
        let num = |v: &str| -> Result<u64, String> {
            v.trim()
                .parse::<u64>()
                .map_err(|_| format!("--{key}: bad number '{v}'"))
        };
        match key.as_str() {
            "backend" => c.backends = parse_backends(&val)?,
            "posix_api_type" => {
                let t = val.to_ascii_uppercase();
                if !["AIO", "URING", "POSIXAIO"].contains(&t.as_str()) {
                    return Err(format!(
                        "--posix_api_type: expected AIO|URING|POSIXAIO, got '{val}'"
                    ));
                }
                c.posix_api_type = Some(t);
            }
            "posix_ios_pool_size" => c.posix_ios_pool_size = Some(num(&val)?),
            "posix_kernel_queue_size" => c.posix_kernel_queue_size = Some(num(&val)?),
            "filepath" => c.filepath = Some(val),
            "op_type" => {
                c.ops = match val.to_ascii_uppercase().as_str() {
                    "READ" => vec![Op::Read],
                    "WRITE" => vec![Op::Write],
                    "BOTH" | "WRITE,READ" => vec![Op::Write, Op::Read],
                    "READ,WRITE" => vec![Op::Read, Op::Write],
                    _ => return Err(format!("--op_type: expected READ|WRITE|BOTH, got '{val}'")),
                }
            }
            "total_buffer_size" => c.total_buffer_size = parse_size(&val)?,
            "start_block_size" => c.start_block_size = parse_size(&val)?,
            "max_block_size" => c.max_block_size = parse_size(&val)?,
            "start_batch_size" => c.start_batch_size = num(&val)?,
            "max_batch_size" => c.max_batch_size = num(&val)?,
            "batch_sizes" => {
                let v: Result<Vec<u64>, String> = val
                    .split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(&num)
                    .collect();
                c.batch_sizes = Some(v?);
            }
            "num_iter" => c.num_iter = num(&val)?,
            "duration_ms" => c.duration_ms = num(&val)?,
            "warmup_iter" => c.warmup_iter = num(&val)?,
            "large_blk_iter_ftr" => c.large_blk_iter_ftr = num(&val)?,
            "num_threads" => c.num_threads = num(&val)? as usize,
            "seed" => c.seed = num(&val)?,
            "randomize_location_mode" => {
                c.randomize_blockaligned = match val.to_ascii_lowercase().as_str() {
                    "none" => false,
                    "blockaligned" => true,
                    _ => {
                        return Err(format!(
                            "--randomize_location_mode: none|blockaligned, got '{val}'"
                        ))
                    }
                }
            }
            "initiator_seg_type" => {
                if !val.eq_ignore_ascii_case("DRAM") {
                    return Err(format!(
                        "--initiator_seg_type {val}: only DRAM is supported"
                    ));
                }
            }
            "storage_seg_type" => {
                c.storage_seg_type = match val.to_ascii_uppercase().as_str() {
                    "AUTO" => SegType::Auto,
                    "FILE" => SegType::File,
                    "BLOCK" | "BLK" => SegType::Block,
                    _ => return Err(format!("--storage_seg_type: FILE|BLOCK|auto, got '{val}'")),
                }
            }
            "csv" => c.csv = Some(val),
            "poll_mode" => {
                c.poll = match val.to_ascii_lowercase().as_str() {
                    "spin" => PollMode::Spin,
                    "yield" => PollMode::Yield,
                    v => match v
                        .strip_prefix("sleep:")
                        .and_then(|us| us.parse::<u64>().ok())
                    {
                        Some(us) => PollMode::Sleep(std::time::Duration::from_micros(us)),
                        None => {
                            return Err(format!("--poll_mode: spin|yield|sleep:<us>, got '{val}'"))
                        }
                    },
                }
            }
            "workload" => {
                c.contig = false;
                c.run_kv = false;
                c.run_req = false;
                for w in val.split(',').map(|w| w.trim().to_ascii_lowercase()) {
                    match w.as_str() {
                        "contig" => c.contig = true,
                        "kv" => c.run_kv = true,
                        "req" => c.run_req = true,
                        "" => {}
                        _ => {
                            return Err(format!("--workload: any of req, kv, contig, got '{val}'"))
                        }
                    }
                }
            }
            "kv_start_block_size" => c.kv.start_block_size = parse_size(&val)?,
            "kv_max_block_size" => c.kv.max_block_size = parse_size(&val)?,
            "kv_blocks" => c.kv.blocks = num(&val)?,
            "kv_request_size" => c.kv.request_size = parse_size(&val)?,
            "kv_regions" => c.kv.regions = num(&val)? as usize,
            "kv_region_size" => c.kv.region_size = parse_size(&val)?,
            "kv_rounds" => c.kv.rounds = num(&val)? as usize,
            "req_points" => c.req.points = parse_points(&val)?,
            "req_region_size" => c.req.region_size = parse_size(&val)?,
            "req_modes" => {
                c.req.init = false;
                c.req.repost = false;
                for m in val.split(',').map(|m| m.trim().to_ascii_lowercase()) {
                    match m.as_str() {
                        "prepped" | "" => {}
                        "init" => c.req.init = true,
                        "repost" => c.req.repost = true,
                        _ => {
                            return Err(format!(
                                "--req_modes: any of prepped, init, repost, got '{val}'"
                            ))
                        }
                    }
                }
            }
            "background_load" => c.background_load = num(&val)? as usize,
            "out_dir" => c.out_dir = Some(val),
            "worker_type" => {
                if val != "nixl" {
                    return Err(format!("--worker_type {val}: only nixl is supported"));
                }
            }
            _ => return Err(format!("unknown flag --{key} (see --help)")),
        }
    }
    validate(&c)?;
    Ok(Parsed::Run(Box::new(c)))
}

fn validate(c: &Config) -> Result<(), String> {
    if c.num_threads == 0 {
        return Err("--num_threads must be >= 1".into());
    }
    if c.start_block_size == 0 || c.start_block_size > c.max_block_size {
        return Err("need 0 < --start_block_size <= --max_block_size".into());
    }
    let batches = c.batches();
    if batches.is_empty() || batches.contains(&0) {
        return Err("need batch sizes >= 1 (--start_batch_size <= --max_batch_size)".into());
    }
    if c.large_blk_iter_ftr == 0 {
        return Err("--large_blk_iter_ftr must be > 0".into());
    }
    if c.region_per_thread() < c.start_block_size {
        return Err(format!(
            "--total_buffer_size {} / --num_threads {} is smaller than --start_block_size {}",
            c.total_buffer_size, c.num_threads, c.start_block_size
        ));
    }
    if c.num_iter == 0 && c.duration_ms == 0 {
        return Err("--num_iter 0 needs --duration_ms > 0".into());
    }
    if !c.contig && !c.run_kv && !c.run_req {
        return Err("--workload names no workload".into());
    }
    if c.run_req {
        let r = &c.req;
        if r.points.is_empty()
            || r.points
                .iter()
                .any(|&(b, n)| b == 0 || b % 512 != 0 || n == 0)
        {
            return Err("--req_points: every block a multiple of 512, every count >= 1".into());
        }
        if c.kv.regions == 0 || c.kv.rounds == 0 {
            return Err("--kv_regions and --kv_rounds must be >= 1".into());
        }
        for &(b, n) in &r.points {
            if r.region_size % b != 0 || b * n > r.region_size {
                return Err(format!(
                    "--req_region_size {} must be a multiple of every block and hold one point's blocks (the contiguous READ): {b} x {n}",
                    r.region_size
                ));
            }
        }
    }
    if c.run_kv {
        let k = &c.kv;
        if k.start_block_size == 0
            || k.start_block_size > k.max_block_size
            || k.start_block_size % 512 != 0
        {
            return Err(
                "need 0 < --kv_start_block_size <= --kv_max_block_size, a multiple of 512".into(),
            );
        }
        if k.regions == 0 || k.rounds == 0 {
            return Err("--kv_regions and --kv_rounds must be >= 1".into());
        }
        if k.region_size < k.max_block_size || k.region_size % 4096 != 0 {
            return Err(
                "--kv_region_size must be a multiple of 4096 and >= --kv_max_block_size".into(),
            );
        }
        if c.total_buffer_size < k.max_block_size {
            return Err(
                "--total_buffer_size (the file region) must be >= --kv_max_block_size".into(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn backend_specs() {
        let b = parse_backends("IO_URING_DMABUF,POSIX:use_uring=true,POSIX:use_aio=true;kernel_queue_size=512,ios_pool_size=128").unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b[0].name, "IO_URING_DMABUF");
        assert!(b[0].params.is_empty());
        assert_eq!(b[1].label(), "POSIX:use_uring=true");
        assert_eq!(b[2].params.len(), 3);
        assert_eq!(b[2].params[2], ("ios_pool_size".into(), "128".into()));
        assert!(parse_backends("k=v").is_err());
    }

    #[test]
    fn flags() {
        let Parsed::Run(c) = parse(&s(&[
            "--op_type=BOTH",
            "--max_block_size",
            "64K",
            "-storage_enable_direct",
            "--nocheck_consistency",
            "--batch_sizes=1,64",
            "--num_iter",
            "100",
        ]))
        .unwrap() else {
            panic!()
        };
        assert_eq!(c.ops, vec![Op::Write, Op::Read]);
        assert_eq!(c.block_sizes(), vec![4096, 8192, 16384, 32768, 65536]);
        assert!(c.storage_enable_direct && !c.check_consistency);
        assert_eq!(c.batches(), vec![1, 64]);
        assert_eq!(c.num_iter, 100);
        assert!(parse(&s(&["--bogus", "1"]))
            .unwrap_err()
            .contains("unknown flag"));
        assert!(parse(&s(&["--bogus"]))
            .unwrap_err()
            .contains("unknown flag"));
        assert!(parse(&s(&["--max_block_size"])).is_err());
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        let Parsed::Run(c) =
            parse(&s(&["--storage_seg_type", "block", "--csv=/tmp/x.csv"])).unwrap()
        else {
            panic!()
        };
        assert_eq!(c.storage_seg_type, SegType::Block);
        assert_eq!(c.csv.as_deref(), Some("/tmp/x.csv"));
        assert!(parse(&s(&["--storage_seg_type", "VRAM"])).is_err());
        let Parsed::Run(c) = parse(&s(&[
            "--workload=kv,contig",
            "--kv_max_block_size",
            "64K",
            "--kv_regions=3",
            "--background_load",
            "2",
            "--out_dir=/tmp/o",
        ]))
        .unwrap() else {
            panic!()
        };
        assert!(c.contig && c.run_kv);
        assert_eq!(c.kv.block_sizes(), vec![4096, 8192, 16384, 32768, 65536]);
        assert_eq!(c.kv.blocks_for(4096), MAX_KV_BLOCKS);
        assert_eq!(c.kv.blocks_for(2 << 20), 32);
        assert_eq!(
            (c.kv.regions, c.background_load, c.out_dir.as_deref()),
            (3, 2, Some("/tmp/o"))
        );
        assert!(parse(&s(&["--workload", "fast"])).is_err());
    }

    /// usage.txt (also printed by `ci/bench.sh --help`) lists exactly the flags the parser takes.
    #[test]
    fn usage_lists_every_flag() {
        let listed: Vec<&str> = USAGE
            .lines()
            .filter_map(|l| l.strip_prefix("  --"))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let known: Vec<&str> = BOOL_FLAGS.iter().chain(VALUE_FLAGS).copied().collect();
        for f in &known {
            assert!(
                listed.contains(f),
                "--{f} is parsed but missing from usage.txt"
            );
        }
        for f in &listed {
            assert!(
                known.contains(f),
                "usage.txt lists --{f}, which the parser does not take"
            );
        }
    }
}
