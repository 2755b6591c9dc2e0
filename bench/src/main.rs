//! iud-bench: a nixlbench-style storage benchmark (DRAM <-> FILE, loopback in one agent) over the
//! real NIXL runtime through nixl-sys, for comparing IO_URING_DMABUF with NIXL's POSIX backend.
//! See `iud-bench --help` and ci/bench.sh.

mod cli;
mod cpu;
mod kv;
mod load;
mod mem;
mod report;
mod req;
mod results;
mod runner;
mod sysinfo;

use once_cell::sync::OnceCell;
use std::ffi::CString;
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cli::{Config, Op, Parsed, SegType};
use mem::{pwrite_full, AlignedBuf, SplitMix64};

/// Temp file to remove at exit, also from the SIGINT/SIGTERM handler.
static TEMP_PATH: OnceCell<CString> = OnceCell::new();

extern "C" fn on_signal(sig: libc::c_int) {
    if let Some(p) = TEMP_PATH.get() {
        // SAFETY: unlink and _exit are async-signal-safe; p is a valid C string.
        unsafe { libc::unlink(p.as_ptr()) };
    }
    // SAFETY: async-signal-safe.
    unsafe { libc::_exit(128 + sig) };
}

struct FileSetup {
    path: PathBuf,
    temp: bool,
    fd: i32,
    verify_fd: i32,
    /// Some(capacity in bytes) when the target is a block device.
    block_dev: Option<u64>,
}

impl Drop for FileSetup {
    fn drop(&mut self) {
        // SAFETY: closing our own fds once.
        unsafe {
            libc::close(self.fd);
            libc::close(self.verify_fd);
        }
        if self.temp {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn open_fd(path: &Path, flags: i32) -> Result<i32, String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
    if fd < 0 {
        return Err(format!(
            "open {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(fd)
}

fn setup_file(cfg: &Config, total: u64) -> Result<FileSetup, String> {
    let (path, temp) = match &cfg.filepath {
        Some(p) if !Path::new(p).is_dir() => (PathBuf::from(p), false),
        other => {
            let dir = other.clone().unwrap_or_else(|| "/tmp".into());
            (
                Path::new(&dir).join(format!("iud-bench-{}.dat", std::process::id())),
                true,
            )
        }
    };
    if temp {
        let _ = TEMP_PATH.set(CString::new(path.as_os_str().as_bytes()).unwrap());
        // SAFETY: installing an async-signal-safe handler.
        unsafe {
            libc::signal(
                libc::SIGINT,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
            libc::signal(
                libc::SIGTERM,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
    let is_blk = std::fs::metadata(&path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false);
    // nixlbench: O_RDWR|O_CREAT|O_LARGEFILE (+O_DIRECT). Block devices: no O_CREAT.
    let creat = if is_blk { 0 } else { libc::O_CREAT };
    let verify_fd = open_fd(&path, libc::O_RDWR | creat | libc::O_LARGEFILE)?;
    let direct = if cfg.storage_enable_direct {
        libc::O_DIRECT
    } else {
        0
    };
    let fd = match open_fd(&path, libc::O_RDWR | libc::O_LARGEFILE | direct) {
        Ok(fd) => fd,
        Err(e) => {
            // SAFETY: closing our fd.
            unsafe { libc::close(verify_fd) };
            if temp {
                let _ = std::fs::remove_file(&path);
            }
            return Err(format!(
                "{e}{}",
                if direct != 0 {
                    " (does this filesystem support O_DIRECT?)"
                } else {
                    ""
                }
            ));
        }
    };
    let block_dev = if is_blk {
        let mut bytes = 0u64;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
        if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut bytes as *mut u64) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: closing our fds.
            unsafe {
                libc::close(fd);
                libc::close(verify_fd);
            }
            return Err(format!("ioctl(BLKGETSIZE64) on {}: {e}", path.display()));
        }
        Some(bytes)
    } else {
        None
    };
    let fs = FileSetup {
        path,
        temp,
        fd,
        verify_fd,
        block_dev,
    };
    if let Some(bytes) = block_dev {
        if bytes < total {
            return Err(format!(
                "block device {} holds {bytes} bytes < --total_buffer_size {total}",
                fs.path.display()
            ));
        }
        println!(
            "setup: block device of {bytes} bytes: used in place, not prefilled (WRITE points overwrite its first {total} bytes)"
        );
        return Ok(fs);
    }
    let len = std::fs::metadata(&fs.path).map(|m| m.len()).unwrap_or(0);
    if len < total {
        // Like nixlbench: fill the region when the file is too short. A pattern different from
        // the DRAM buffer's, so that a transfer that did nothing cannot pass a consistency check.
        let t = Instant::now();
        let chunk = 16usize << 20;
        let mut buf = vec![0u8; chunk];
        let mut rng = SplitMix64::new(cfg.seed ^ 0xF11E_F11E_F11E_F11E);
        let mut off = 0u64;
        while off < total {
            let n = chunk.min((total - off) as usize);
            rng.fill(&mut buf[..n]);
            pwrite_full(fs.verify_fd, &buf[..n], off)
                .map_err(|e| format!("prefill write at {off}: {e}"))?;
            off += n as u64;
        }
        // SAFETY: plain syscall.
        unsafe { libc::fdatasync(fs.verify_fd) };
        println!(
            "setup: wrote {} bytes of random data into the file (+fdatasync) in {:.2} s",
            total,
            t.elapsed().as_secs_f64()
        );
    } else {
        println!("setup: file already holds {len} bytes >= {total}; content kept");
    }
    Ok(fs)
}

/// _IOR(0x12, 114, size_t)
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

fn config_rows(cfg: &Config) -> Vec<(&'static str, String)> {
    let b: Vec<String> = cfg.backends.iter().map(|b| b.label()).collect();
    let mut rows: Vec<(&'static str, String)> = vec![
        ("backend", b.join(",")),
        (
            "posix_api_type",
            cfg.posix_api_type
                .clone()
                .unwrap_or_else(|| "(spec params)".into()),
        ),
        (
            "filepath",
            cfg.filepath
                .clone()
                .unwrap_or_else(|| "(temp file in /tmp)".into()),
        ),
        (
            "op_type",
            cfg.ops
                .iter()
                .map(|o| o.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("total_buffer_size", cfg.total_buffer_size.to_string()),
        ("start_block_size", cfg.start_block_size.to_string()),
        ("max_block_size", cfg.max_block_size.to_string()),
        (
            "batch sizes",
            cfg.batches()
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
        (
            "num_iter",
            if cfg.num_iter == 0 {
                format!(
                    "0 (time-based: {} ms per point, >= 3 iterations)",
                    cfg.duration_ms
                )
            } else {
                cfg.num_iter.to_string()
            },
        ),
        ("warmup_iter", cfg.warmup_iter.to_string()),
        ("large_blk_iter_ftr", cfg.large_blk_iter_ftr.to_string()),
        ("num_threads", cfg.num_threads.to_string()),
        (
            "storage_enable_direct",
            cfg.storage_enable_direct.to_string(),
        ),
        ("check_consistency", cfg.check_consistency.to_string()),
        ("recreate_xfer", cfg.recreate_xfer.to_string()),
        ("prepared_xfer", cfg.prepared_xfer.to_string()),
        ("enable_pt", cfg.enable_pt.to_string()),
        (
            "randomize_location_mode",
            if cfg.randomize_blockaligned {
                "blockaligned (file blocks of a request shuffled)".into()
            } else {
                "none (a request = one contiguous range in DRAM and file)".into()
            },
        ),
        ("seed", cfg.seed.to_string()),
        (
            "storage_seg_type",
            match cfg.storage_seg_type {
                SegType::Auto => "auto (BLOCK for a block device, else FILE)".into(),
                SegType::File => "FILE".into(),
                SegType::Block => "BLOCK".into(),
            },
        ),
        ("poll_mode", cfg.poll.describe()),
        ("csv", cfg.csv.clone().unwrap_or_else(|| "(none)".into())),
        (
            "workload",
            [
                (cfg.run_req, "req (per request, printed first)"),
                (cfg.run_kv, "kv"),
                (cfg.contig, "contig"),
            ]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join(", "),
        ),
    ];
    if cfg.run_kv {
        let k = &cfg.kv;
        rows.push((
            "kv",
            format!(
                "blocks {}..{}, {} per request ({}), {} region(s) x {} bytes, {} rounds",
                k.start_block_size,
                k.max_block_size,
                if k.blocks > 0 {
                    k.blocks.to_string()
                } else {
                    "auto".into()
                },
                if k.blocks > 0 {
                    "fixed".to_string()
                } else {
                    format!(
                        "{} bytes / block, at most {}",
                        k.request_size,
                        cli::MAX_KV_BLOCKS
                    )
                },
                k.regions,
                k.region_size,
                k.rounds
            ),
        ));
    }
    rows.push((
        "out_dir",
        cfg.out_dir.clone().unwrap_or_else(|| "(none)".into()),
    ));
    rows
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match cli::parse(&args) {
        Ok(Parsed::Run(c)) => *c,
        Ok(Parsed::Help) => {
            print!("{}", cli::USAGE);
            return;
        }
        Err(e) => {
            eprintln!("iud-bench: {e}\n(run with --help for the flags)");
            std::process::exit(2);
        }
    };
    // Forked before any thread exists; killed when `load` is dropped at the end of main.
    let load = match load::BackgroundLoad::start(cfg.background_load) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("iud-bench: {e}");
            std::process::exit(1);
        }
    };
    let rc = run(&cfg, &load);
    drop(load);
    std::process::exit(rc);
}

/// Prints `key: value` and keeps it for results.md.
fn info(rows: &mut Vec<(String, String)>, key: &str, value: String) {
    println!("{:<9} {value}", format!("{key}:"));
    rows.push((key.to_string(), value));
}

fn run(cfg: &Config, load: &load::BackgroundLoad) -> i32 {
    println!("# iud-bench (nixlbench-style storage benchmark over NIXL via nixl-sys 1.5.2)");
    let mut inf: Vec<(String, String)> = Vec::new();
    info(&mut inf, "date", sysinfo::utc_now());
    info(&mut inf, "host", sysinfo::hostname());
    info(&mut inf, "command", sysinfo::command_line());
    if let Ok(rev) = std::env::var("IUD_BENCH_GIT") {
        // Set by ci/bench.sh: the commit measured, with any uncommitted changes named.
        info(&mut inf, "git", rev);
    }
    let (listed, usable) = sysinfo::cpu_count();
    info(
        &mut inf,
        "cpu",
        format!(
            "{} ({listed} logical CPUs, {usable} usable by this process)",
            sysinfo::cpu_model()
        ),
    );
    info(&mut inf, "memory", sysinfo::mem_total());
    info(&mut inf, "kernel", sysinfo::kernel());
    info(&mut inf, "background load", load.describe());
    info(&mut inf, "loadavg at start", load::loadavg());
    let capi = match sysinfo::locate_capi() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("iud-bench: {e}");
            return 1;
        }
    };
    info(&mut inf, "nixl", capi);
    match std::env::var("NIXL_PLUGIN_DIR") {
        Ok(d) => {
            println!("NIXL_PLUGIN_DIR: {d}");
            let mut seen: Vec<&str> = Vec::new();
            for b in &cfg.backends {
                if !seen.contains(&b.name.as_str()) {
                    seen.push(&b.name);
                    let p = Path::new(&d).join(format!("libplugin_{}.so", b.name));
                    let desc = sysinfo::file_desc(&p);
                    println!("  plugin {}: {desc}", b.name);
                    inf.push((format!("plugin {}", b.name), desc));
                }
            }
        }
        Err(_) => println!("NIXL_PLUGIN_DIR: (unset: NIXL's default plugin dir)"),
    }
    println!("config:");
    for (k, v) in config_rows(cfg) {
        println!("  {k:<24}: {v}");
        inf.push((format!("config {k}"), v));
    }

    let total = cfg.region_per_thread() * cfg.num_threads as u64;
    // The per-request points may need a longer file than the other workloads' region.
    let file_total = if cfg.run_req {
        total.max(cfg.req.file_len().div_ceil(1 << 20) << 20)
    } else {
        total
    };
    let files = match setup_file(cfg, file_total) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("iud-bench: {e}");
            return 1;
        }
    };
    info(
        &mut inf,
        "file",
        format!(
            "{}{} (fd {}{})",
            files.path.display(),
            if files.temp {
                " (temporary, removed at exit)"
            } else {
                ""
            },
            files.fd,
            if cfg.storage_enable_direct {
                ", O_DIRECT"
            } else {
                ", buffered"
            }
        ),
    );
    let storage_kind = match (cfg.storage_seg_type, files.block_dev.is_some()) {
        (SegType::Block, _) | (SegType::Auto, true) => nixl_sys::MemType::Block,
        _ => nixl_sys::MemType::File,
    };
    if storage_kind == nixl_sys::MemType::Block && !cfg.storage_enable_direct {
        eprintln!(
            "iud-bench: BLOCK (BLK_SEG) targets need an O_DIRECT fd: add --storage_enable_direct"
        );
        return 1;
    }
    match files.block_dev {
        Some(bytes) => info(
            &mut inf,
            "block device",
            format!("{bytes} bytes; {}", sysinfo::block_queue_info(&files.path)),
        ),
        None => info(&mut inf, "filesystem", sysinfo::filesystem_of(&files.path)),
    }
    println!(
        "registered as: {}",
        if storage_kind == nixl_sys::MemType::Block {
            "BLOCK (BLK_SEG)"
        } else {
            "FILE (FILE_SEG)"
        }
    );
    let csv = match &cfg.csv {
        None => None,
        Some(p) => match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            Ok(mut f) => {
                if f.metadata().map(|m| m.len() == 0).unwrap_or(false) {
                    let _ = writeln!(f, "{}", report::CSV_HEADER);
                }
                Some(std::sync::Mutex::new(f))
            }
            Err(e) => {
                eprintln!("iud-bench: --csv {p}: {e}");
                return 1;
            }
        },
    };

    let direct = cfg.storage_enable_direct;
    let verify_fd = files.verify_fd;
    let note = move |op: Op| -> Option<String> {
        Some(match (op, direct) {
            (Op::Read, false) => {
                let res = sysinfo::page_cache_residency(verify_fd, total as usize)
                    .map(|f| format!("{:.1}%", f * 100.0))
                    .unwrap_or_else(|| "unknown".into());
                format!(
                    "note: buffered READ: the file was written in setup, so reads are served from the \
                     page cache ({res} of the file region resident now), not from the disk"
                )
            }
            (Op::Read, true) => {
                "note: O_DIRECT READ: reads bypass the page cache and come from the device".into()
            }
            (Op::Write, false) => {
                "note: buffered WRITE: data lands in the page cache (dirty pages); \
                                   fdatasync after each point, not timed"
                    .into()
            }
            (Op::Write, true) => "note: O_DIRECT WRITE: data goes to the device (no fsync)".into(),
        })
    };
    let labels: Vec<String> = cfg.backends.iter().map(|b| b.label()).collect();
    let mut failed: Vec<String> = Vec::new();
    let mut consistency_failures = 0;
    let mut rows = Vec::new();
    let mut notes = vec![
        "GB/s = bytes moved in the timed loop / its wall time / 1e9.".to_string(),
        "CPU s/GB = user+sys CPU seconds of the whole benchmark process (getrusage RUSAGE_SELF: every \
         thread, including NIXL's, the plugin's and io_uring's workers, and the polling loop) over the \
         timed loop, per GB moved; the background load's processes are not counted."
            .to_string(),
        format!(
            "Polling: {}.",
            match cfg.poll {
                cli::PollMode::Spin => "getXferStatus in a busy loop (spin), so the posting thread's CPU time is counted while it waits".to_string(),
                cli::PollMode::Yield => "sched_yield between getXferStatus calls".to_string(),
                cli::PollMode::Sleep(d) => format!("a {} us sleep between getXferStatus calls (a client that polls rarely)", d.as_micros()),
            }
        ),
    ];

    let mut first = String::new();
    if cfg.run_req {
        println!();
        println!("########## per-request workload (what clients wait for) ##########");
        let rctx = kv::Ctx {
            cfg,
            fd: files.fd,
            verify_fd: files.verify_fd,
            storage_kind,
            file_len: file_total,
            page_cache_note: &note,
        };
        let o = req::run(&rctx);
        for (b, e) in &o.errors {
            let l = labels.get(*b).cloned().unwrap_or_default();
            if !failed.contains(&l) {
                failed.push(l);
            }
            println!("PER-REQUEST ERROR: {e}");
        }
        consistency_failures += o.consistency_failures;
        println!(
            "per-request consistency: {} measurement(s) failed",
            o.consistency_failures
        );
        first = o.text;
        rows.extend(results::req_rows(&o.points));
        notes.push(format!(
            "Per request: blocks at random slots of {} DRAM region(s) of {} bytes against random, non-adjacent file \
             offsets (a contiguous READ lays the same descriptors end to end); every request verified byte for byte \
             outside its timed span; backend order and, within each backend, the order of the modes rotated each round; medians of {} rounds; {} ms of summed request \
             time per measurement (>= 3 requests).",
            cfg.kv.regions, cfg.req.region_size, cfg.kv.rounds, cfg.duration_ms
        ));
    }

    if cfg.run_kv {
        println!();
        println!("########## KV-cache workload ##########");
        let kctx = kv::Ctx {
            cfg,
            fd: files.fd,
            verify_fd: files.verify_fd,
            storage_kind,
            file_len: total,
            page_cache_note: &note,
        };
        let o = kv::run(&kctx);
        for (b, e) in &o.errors {
            let l = labels.get(*b).cloned().unwrap_or_default();
            if !failed.contains(&l) {
                failed.push(l);
            }
            println!("KV ERROR: {e}");
        }
        consistency_failures += o.consistency_failures;
        println!(
            "KV consistency: {} measurement(s) failed",
            o.consistency_failures
        );
        rows.extend(results::kv_rows(&o.points));
        notes.push(format!(
            "KV-cache: one request of N descriptors per block size, blocks at random slots of {} separately \
             registered DRAM region(s) of {} bytes, file offsets random with no two blocks adjacent; every \
             measurement (round x backend) verified byte for byte after its timed loop; backend order \
             rotated each round; medians of {} rounds.",
            cfg.kv.regions, cfg.kv.region_size, cfg.kv.rounds
        ));
    }

    if cfg.contig {
        let t = Instant::now();
        let dram = match AlignedBuf::new(total as usize, 4096) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("iud-bench: {e}");
                return 1;
            }
        };
        // SAFETY: nothing else uses the buffer yet.
        SplitMix64::new(cfg.seed).fill(unsafe { dram.slice_mut(0, dram.len()) });
        println!();
        println!(
            "setup: DRAM buffer {} bytes (posix_memalign 4096) filled with random data in {:.2} s",
            dram.len(),
            t.elapsed().as_secs_f64()
        );
        let ctx = runner::Ctx {
            cfg,
            dram: &dram,
            fd: files.fd,
            verify_fd: files.verify_fd,
            page_cache_note: &note,
            storage_kind,
            csv: csv.as_ref(),
        };
        let mut all = Vec::new();
        for (i, spec) in cfg.backends.iter().enumerate() {
            println!();
            println!(
                "########## backend {}/{}: {} ##########",
                i + 1,
                cfg.backends.len(),
                spec.label()
            );
            let _ = std::io::stdout().flush();
            let o = runner::run_spec(i, spec, &ctx);
            if let Some(e) = &o.error {
                println!("ERROR: {e}");
                eprintln!("iud-bench: backend {}: {e}", spec.label());
                if !failed.contains(&spec.label()) {
                    failed.push(spec.label());
                }
            }
            consistency_failures += o.consistency_failures;
            all.push(o.results);
        }
        println!();
        println!("########## summary: contiguous sweep ##########");
        print!("{}", report::summary(&labels, &all, &cfg.ops));
        let layout = format!(
            "descriptor layout: {}; {}",
            if cfg.randomize_blockaligned {
                "blockaligned (file blocks of a request shuffled: every descriptor is its own I/O)"
            } else {
                "none (a request is one contiguous range in DRAM and file: backends may merge descriptors)"
            },
            if cfg.storage_enable_direct {
                "O_DIRECT"
            } else {
                "buffered (page cache)"
            }
        );
        println!("{layout}");
        notes.push(format!(
            "nixlbench-style sweep: {layout}; one run per point, backends one after another."
        ));
        rows.extend(results::contig_rows(&all, cfg.randomize_blockaligned));
    }
    info(&mut inf, "loadavg at end", load::loadavg());

    let mut rc = 0;
    if !failed.is_empty() {
        println!("FAILED backends: {}", failed.join(", "));
        notes.push(format!("FAILED backends: {}", failed.join(", ")));
        rc = 1;
    }
    if cfg.check_consistency || cfg.run_kv || cfg.run_req {
        println!("consistency: {consistency_failures} point(s) failed in total");
        notes.push(format!(
            "consistency: {consistency_failures} point(s) failed in total"
        ));
        if consistency_failures > 0 {
            rc = 1;
        }
    }
    if let Some(dir) = &cfg.out_dir {
        let md = results::markdown(&inf, &labels, &rows, &notes, &first);
        let csv = results::csv(&labels, &rows, cfg.background_load);
        match results::write(Path::new(dir), &md, &csv) {
            Ok(()) => println!("results written: {dir}/results.md, {dir}/results.csv"),
            Err(e) => {
                eprintln!("iud-bench: {e}");
                rc = 1;
            }
        }
    }
    drop(files);
    rc
}
