//! 8 threads x mixed requests on one engine, driven directly (no NIXL): random round trips
//! (buffered and O_DIRECT, byte-checked), posts released while in flight (racing the other
//! threads' post/check on the shared ring), reposts of one request, and register/deregister
//! cycles of memory and files while the other threads transfer. Buffered reads of 16 KiB and more
//! go to the page-cache worker threads (punt_buffered_min), so releases also race those, and the
//! engine's progress thread runs beside the callers; lists of 2048 blocks are planned in parts by
//! the prep helper threads. Built
//! with -Zsanitizer=thread it checks the request state machine and the ring's locking for data
//! races.
//!
//!   iud-tsan-stress DIR ITERATIONS_PER_THREAD

use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;

const DRAM: i32 = 0;
const FILE: i32 = 4;
const READ: i32 = 0;
const WRITE: i32 = 1;
const AGENT: &str = "tsan";
const THREADS: usize = 8;
const REGION: usize = 4 << 20;

struct Buf(*mut u8, usize);
// SAFETY: each buffer is used by one thread at a time (the kernel writes it only while a request
// of that thread is in flight).
unsafe impl Send for Buf {}
impl Buf {
    fn new(n: usize) -> Buf {
        let mut p = std::ptr::null_mut();
        // SAFETY: posix_memalign writes an aligned allocation into p.
        assert_eq!(unsafe { libc::posix_memalign(&mut p, 4096, n) }, 0);
        // SAFETY: fresh allocation of n bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, n) };
        Buf(p as *mut u8, n)
    }
    fn addr(&self) -> u64 {
        self.0 as u64
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: our allocation; no request of ours is in flight when this is called.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated by posix_memalign.
        unsafe { libc::free(self.0 as *mut c_void) }
    }
}

fn d(addr: u64, len: u64, dev: u64, md: usize) -> iud_desc {
    iud_desc {
        addr,
        len,
        dev_id: dev,
        md: md as *const c_void,
    }
}

fn run(e: &Engine, op: i32, l: &[iud_desc], r: &[iud_desc]) {
    let req = e.prep(op, DRAM, l, FILE, r, AGENT).expect("prep");
    let mut s = e.post(&req, op, l.len(), r.len());
    while let Ok(Progress::InFlight) = s {
        s = e.check(&req);
    }
    s.expect("transfer");
    e.release(req).map_err(|(_, e)| e).expect("release");
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(args.get(1).map(String::as_str).unwrap_or("/var/tmp"))
        .join(format!("iud-tsan-{}", std::process::id()));
    let iters: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("shared.bin");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len((THREADS * REGION) as u64).unwrap();
    let fdirect = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    // The progress thread and the prep helpers are forced on (auto leaves them off below 8 CPUs)
    // so that they race the callers too.
    let e = Arc::new(
        Engine::new(
            AGENT,
            [
                ("ring_entries", "64"),
                ("punt_buffered_min", "16384"),
                ("progress_thread", "true"),
                ("prep_threads", "4"),
            ],
        )
        .unwrap(),
    );
    let total = (THREADS * REGION) as u64;
    let mf = e
        .register(FILE, 0, total, f.as_raw_fd() as u64, "")
        .unwrap() as usize;
    let mfd = e
        .register(FILE, 0, total, fdirect.as_raw_fd() as u64, "")
        .unwrap() as usize;
    let fds = [f.as_raw_fd() as u64, fdirect.as_raw_fd() as u64];
    let ops = Arc::new(AtomicU64::new(0));
    let inflight = Arc::new(AtomicU64::new(0));
    let mut th = Vec::new();
    for t in 0..THREADS {
        let (e, ops, inflight, path) = (
            Arc::clone(&e),
            Arc::clone(&ops),
            Arc::clone(&inflight),
            path.clone(),
        );
        th.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9E37_79B9 + t as u64 * 7919);
            let mut src = Buf::new(REGION);
            let mut dst = Buf::new(REGION);
            let ms = e.register(DRAM, src.addr(), REGION as u64, 0, "").unwrap() as usize;
            let md = e.register(DRAM, dst.addr(), REGION as u64, 0, "").unwrap() as usize;
            let base = (t * REGION) as u64;
            for i in 0..iters {
                let direct = rng.next() % 2 == 0;
                let (fd, fmd) = if direct { (fds[1], mfd) } else { (fds[0], mf) };
                match rng.next() % 4 {
                    0 | 1 => {
                        let seed = rng.next();
                        for (k, b) in src.bytes().iter_mut().enumerate() {
                            *b = (seed as usize ^ k.wrapping_mul(31)) as u8;
                        }
                        let mut l = Vec::new();
                        let mut r = Vec::new();
                        let mut off = 0u64;
                        // One list in four is 2048 blocks of 2 KiB: planned in parts by the
                        // prep helpers (prep_threads) while other threads prepare too.
                        let large = rng.next() % 4 == 0;
                        loop {
                            let len = if large {
                                2048
                            } else {
                                4096 * (1 + rng.next() % 32)
                            };
                            if off + len > REGION as u64 {
                                break;
                            }
                            l.push((off, len));
                            off += len;
                        }
                        for &(o, n) in l.iter().rev() {
                            r.push((o, n));
                        }
                        let wl: Vec<_> = r
                            .iter()
                            .map(|&(o, n)| d(src.addr() + o, n, 0, ms))
                            .collect();
                        let wr: Vec<_> = r.iter().map(|&(o, n)| d(base + o, n, fd, fmd)).collect();
                        run(&e, WRITE, &wl, &wr);
                        let rl: Vec<_> = r
                            .iter()
                            .map(|&(o, n)| d(dst.addr() + o, n, 0, md))
                            .collect();
                        run(&e, READ, &rl, &wr);
                        let n = off as usize;
                        let ok = src.bytes()[..n] == dst.bytes()[..n];
                        assert!(ok, "thread {t} iteration {i}: bytes differ");
                    }
                    2 => {
                        let l: Vec<_> = (0..4u64)
                            .map(|k| d(dst.addr() + k * (1 << 20), 1 << 20, 0, md))
                            .collect();
                        // Direct reads go to the kernel, buffered ones to the page-cache workers.
                        let (rfd, rmd) = if rng.next() % 2 == 0 {
                            (fds[1], mfd)
                        } else {
                            (fds[0], mf)
                        };
                        let r: Vec<_> = (0..4u64)
                            .map(|k| d(base + k * (1 << 20), 1 << 20, rfd, rmd))
                            .collect();
                        let req = e.prep(READ, DRAM, &l, FILE, &r, AGENT).expect("prep");
                        if let Ok(Progress::InFlight) = e.post(&req, READ, 4, 4) {
                            inflight.fetch_add(1, Relaxed);
                        }
                        if rng.next() % 2 == 0 {
                            let _ = e.check(&req);
                        }
                        e.release(req)
                            .map_err(|(_, e)| e)
                            .expect("release in flight");
                    }
                    _ => {
                        // register/deregister while others transfer; repost one request 3 times
                        let scratch = Buf::new(1 << 20);
                        let sm = e.register(DRAM, scratch.addr(), 1 << 20, 0, "").unwrap() as usize;
                        let dev = 1000 + t as u64;
                        let meta = format!("rw:{}", path.display());
                        let pm =
                            e.register(FILE, base, REGION as u64, dev, &meta).unwrap() as usize;
                        let l = [d(scratch.addr(), 1 << 16, 0, sm)];
                        let r = [d(base, 1 << 16, dev, pm)];
                        let req = e.prep(READ, DRAM, &l, FILE, &r, AGENT).expect("prep");
                        for _ in 0..3 {
                            let mut s = e.post(&req, READ, 1, 1);
                            while let Ok(Progress::InFlight) = s {
                                s = e.check(&req);
                            }
                            s.expect("repost");
                        }
                        e.release(req).map_err(|(_, e)| e).expect("release");
                        e.deregister(pm as *const c_void).unwrap();
                        e.deregister(sm as *const c_void).unwrap();
                    }
                }
                ops.fetch_add(1, Relaxed);
            }
            e.deregister(ms as *const c_void).unwrap();
            e.deregister(md as *const c_void).unwrap();
        }));
    }
    for h in th {
        h.join().expect("thread panicked");
    }
    e.deregister(mf as *const c_void).unwrap();
    e.deregister(mfd as *const c_void).unwrap();

    drop(e);
    drop(f);
    drop(fdirect);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "stress: {THREADS} threads, {} operations, {} releases in flight, ok",
        ops.load(Relaxed),
        inflight.load(Relaxed)
    );
}
