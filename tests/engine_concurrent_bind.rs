//! Requests prepared at once by several threads on a (memory, file) pair that no request used
//! before: the pair is bound once. Binding is what DMA-BUF registration and cuFile handle
//! registration happen in; bound twice, a pair holds two sets of io_uring DMA-BUF slots, or asks
//! cuFile to register one fd twice. Here the memory is VRAM of the fake HSA runtime
//! (tests/rocm_double), whose route is the staging path; each binding logs one line naming the
//! pair ("VRAM ... <-> fd N: ..."), which this test counts.

mod common;
#[path = "rocm_double/mod.rs"]
mod double;

use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::{Barrier, Mutex};

use common::*;
use double::{Ctl, Variant};
use io_uring_dmabuf::engine::Engine;

static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_pair_first_used_by_eight_threads_at_once_is_bound_once() {
    tracing_subscriber::fmt()
        .with_writer(|| Capture)
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .init();
    let lib = double::instance(Variant::NoExport, "concurrent-bind");
    std::env::set_var("IUD_HSA_LIBRARY", &lib);
    let ctl = Ctl::open(&lib);
    let e = Engine::new(AGENT, [("gpu_provider", "rocm")]).expect("engine");
    const THREADS: usize = 8;
    const BLOCK: u64 = 64 << 10;
    let path = std::env::temp_dir().join(format!("iud-concurrent-bind-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(THREADS as u64 * BLOCK).unwrap();
    let fd = f.as_raw_fd();
    let m_file = e
        .register(FILE, 0, THREADS as u64 * BLOCK, fd as u64, "")
        .unwrap();
    let vram = ctl.alloc_vram((THREADS as u64 * BLOCK) as usize);
    let m_vram = e
        .register(VRAM, vram, THREADS as u64 * BLOCK, 0, "")
        .unwrap();
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS as u64 {
            let (e, start) = (&e, &start);
            let (m_vram, m_file) = (m_vram as usize, m_file as usize);
            s.spawn(move || {
                let local = [desc(vram + t * BLOCK, BLOCK, 0, m_vram as *const _)];
                let remote = [desc(t * BLOCK, BLOCK, fd as u64, m_file as *const _)];
                start.wait();
                let req = e
                    .prep(WRITE, VRAM, &local, FILE, &remote, AGENT)
                    .unwrap_or_else(|err| panic!("prep: {}", err.message));
                e.release(req)
                    .map_err(|(_, err)| err.message)
                    .expect("release");
            });
        }
    });
    let log = String::from_utf8_lossy(&LOG.lock().unwrap()).into_owned();
    let pair = format!("<-> fd {fd}: ");
    let binds = log.lines().filter(|l| l.contains(&pair)).count();
    assert_eq!(binds, 1, "the pair was bound {binds} times:\n{log}");
    e.deregister(m_vram).unwrap();
    e.deregister(m_file).unwrap();
    drop(e);
    ctl.free_vram(vram);
    drop(f);
    let _ = std::fs::remove_file(&path);
}
