//! The rule for an application's FILE fd (mem/file.rs), on every host path: a registration does
//! its I/O through its own duplicate of the fd, and prep and every post refuse the request when
//! the application's fd was closed or now names another file. For each path x (closed; closed
//! and the number reused for another file) x (before the first post; between posts): the post
//! fails naming fd, file and cause, and neither the registered file, the other file nor the
//! memory changes. A close and reuse while a request is in flight cannot redirect it: the
//! registered file gets the bytes. fd numbers are per process, so the cases run one after the
//! other.

mod common;

use std::sync::Mutex;

use common::*;
use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::uring::Progress;

const KIB: u64 = 1024;

/// Held by each test: a closed fd number must not be taken by another test's open meanwhile.
static FDS: Mutex<()> = Mutex::new(());

/// One way a host request reaches its file.
struct HostPath {
    name: &'static str,
    params: &'static [(&'static str, &'static str)],
    direct: bool,
    op: i32,
    /// Descriptors of `block` bytes, one block apart in memory and file (never merged).
    descs: u64,
    block: u64,
}

const RING: &[(&str, &str)] = &[
    ("inline_write_max", "0"),
    ("punt_buffered_min", "0"),
    ("page_cache_caller_reads", "false"),
];
const RING_RAW: &[(&str, &str)] = &[
    ("inline_write_max", "0"),
    ("punt_buffered_min", "0"),
    ("page_cache_caller_reads", "false"),
    ("fixed_files", "false"),
];

const PATHS: &[HostPath] = &[
    HostPath {
        name: "inline pwrite",
        params: &[],
        direct: false,
        op: WRITE,
        descs: 4,
        block: 16 * KIB,
    },
    HostPath {
        name: "preadv2 RWF_NOWAIT",
        params: &[],
        direct: false,
        op: READ,
        descs: 4,
        block: 16 * KIB,
    },
    HostPath {
        name: "page-cache workers",
        params: &[("punt_buffered_min", "4096")],
        direct: false,
        op: READ,
        descs: 32,
        block: 256 * KIB,
    },
    HostPath {
        name: "ring WRITE, fixed file",
        params: RING,
        direct: false,
        op: WRITE,
        descs: 8,
        block: 64 * KIB,
    },
    HostPath {
        name: "ring READ, fixed file",
        params: RING,
        direct: false,
        op: READ,
        descs: 8,
        block: 64 * KIB,
    },
    HostPath {
        name: "ring WRITE, raw fd",
        params: RING_RAW,
        direct: false,
        op: WRITE,
        descs: 8,
        block: 64 * KIB,
    },
    HostPath {
        name: "ring READ, raw fd",
        params: RING_RAW,
        direct: false,
        op: READ,
        descs: 8,
        block: 64 * KIB,
    },
    HostPath {
        name: "O_DIRECT WRITE",
        params: &[],
        direct: true,
        op: WRITE,
        descs: 8,
        block: 64 * KIB,
    },
    HostPath {
        name: "O_DIRECT READ",
        params: &[],
        direct: true,
        op: READ,
        descs: 8,
        block: 64 * KIB,
    },
];

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    Buf::new(len as usize, seed).bytes().to_vec()
}

fn flags(direct: bool) -> i32 {
    if direct {
        libc::O_DIRECT
    } else {
        0
    }
}

fn run_to_end(
    e: &Engine,
    req: &io_uring_dmabuf::engine::Request,
    op: i32,
    n: usize,
) -> Result<(), String> {
    let mut p = e.post(req, op, n, n).map_err(|e| e.message)?;
    while p == Progress::InFlight {
        p = e.check(req).map_err(|e| e.message)?;
    }
    Ok(())
}

/// One case: prepare, maybe post once, doom the fd, post again: refused, nothing moved.
fn refused_after(p: &HostPath, fate: FdFate, between_posts: bool) {
    let case = format!(
        "{} / {fate:?} / {}",
        p.name,
        if between_posts {
            "between posts"
        } else {
            "before the first post"
        }
    );
    let dir = TestDir::new(&format!(
        "fd-rule-{}-{fate:?}-{between_posts}",
        p.name.replace([' ', ','], "_")
    ));
    let span = p.descs * p.block * 2;
    let (a, b) = (dir.path.join("registered"), dir.path.join("other"));
    std::fs::write(&a, pattern(span, 1)).unwrap();
    std::fs::write(&b, pattern(span, 2)).unwrap();
    let fd = open_fd(&a, flags(p.direct));
    let e = Engine::new(AGENT, p.params.iter().copied()).expect("engine");
    let mem = Buf::new(span as usize, 3);
    let m = e.register(DRAM, mem.addr(), span, 0, "").unwrap();
    let mf = e.register(FILE, 0, span, fd as u64, "").unwrap();
    let local: Vec<_> = (0..p.descs)
        .map(|i| desc(mem.addr() + 2 * i * p.block, p.block, 0, m))
        .collect();
    let remote: Vec<_> = (0..p.descs)
        .map(|i| desc(2 * i * p.block + p.block, p.block, fd as u64, mf))
        .collect();
    let req = e
        .prep(p.op, DRAM, &local, FILE, &remote, AGENT)
        .unwrap_or_else(|err| panic!("{case}: prep: {}", err.message));
    if between_posts {
        run_to_end(&e, &req, p.op, local.len())
            .unwrap_or_else(|err| panic!("{case}: first post: {err}"));
    }
    let (a_before, mem_before) = (std::fs::read(&a).unwrap(), mem.bytes().to_vec());
    doom_fd(fd, fate, &b, flags(p.direct));
    let err = run_to_end(&e, &req, p.op, local.len())
        .expect_err(&format!("{case}: the post must be refused"));
    let cause = if fate == FdFate::Closed {
        "is no longer open"
    } else {
        "now refers to a different file"
    };
    let named = format!("fd {fd} registered as FILE for {}", a.display());
    assert!(err.contains(&named) && err.contains(cause), "{case}: {err}");
    assert!(
        std::fs::read(&a).unwrap() == a_before,
        "{case}: the registered file changed"
    );
    assert!(
        std::fs::read(&b).unwrap() == pattern(span, 2),
        "{case}: the other file changed"
    );
    assert!(
        mem.bytes() == mem_before.as_slice(),
        "{case}: memory changed"
    );
    // A new request is refused at prep the same way.
    let again = e
        .prep(p.op, DRAM, &local, FILE, &remote, AGENT)
        .expect_err("prep after the fd went");
    assert!(again.message.contains(cause), "{case}: {}", again.message);
    e.release(req).map_err(|(_, err)| err.message).unwrap();
    e.deregister(mf).unwrap();
    e.deregister(m).unwrap();
    if fate == FdFate::Reused {
        // SAFETY: fd now names the other file, opened by doom_fd for the test.
        unsafe { libc::close(fd) };
    }
}

#[test]
fn a_closed_or_reused_fd_is_refused_on_every_host_path_and_nothing_moves() {
    let _fds = FDS.lock().unwrap_or_else(|p| p.into_inner());
    for p in PATHS {
        for fate in [FdFate::Closed, FdFate::Reused] {
            for between_posts in [false, true] {
                refused_after(p, fate, between_posts);
            }
        }
    }
}

/// The application closes its fd and opens another file under the same number while a request
/// is in flight: every byte goes to (or comes from) the registered file.
fn in_flight(name: &str, params: &[(&str, &str)], direct: bool, op: i32) {
    let dir = TestDir::new(&format!("fd-rule-inflight-{}", name.replace(' ', "_")));
    let (span, block) = (64 << 20, 1 << 20);
    let (a, b) = (dir.path.join("registered"), dir.path.join("other"));
    let file_a = pattern(span, 4);
    std::fs::write(&a, &file_a).unwrap();
    std::fs::write(&b, pattern(span, 5)).unwrap();
    let fd = open_fd(&a, flags(direct));
    let e = Engine::new(AGENT, params.iter().copied()).expect("engine");
    let mem = Buf::new(span as usize, 6);
    let m = e.register(DRAM, mem.addr(), span, 0, "").unwrap();
    let mf = e.register(FILE, 0, span, fd as u64, "").unwrap();
    let n = span / block;
    let local: Vec<_> = (0..n)
        .map(|i| desc(mem.addr() + i * block, block, 0, m))
        .collect();
    // File blocks in reverse order: nothing merges into one large I/O.
    let remote: Vec<_> = (0..n)
        .map(|i| desc((n - 1 - i) * block, block, fd as u64, mf))
        .collect();
    let req = e.prep(op, DRAM, &local, FILE, &remote, AGENT).unwrap();
    let mut p = e.post(&req, op, n as usize, n as usize).unwrap();
    let was_in_flight = p == Progress::InFlight;
    doom_fd(fd, FdFate::Reused, &b, flags(direct));
    while p == Progress::InFlight {
        p = e
            .check(&req)
            .unwrap_or_else(|err| panic!("{name}: {}", err.message));
    }
    e.release(req).map_err(|(_, err)| err.message).unwrap();
    assert!(
        std::fs::read(&b).unwrap() == pattern(span, 5),
        "{name}: the other file changed"
    );
    let want_file = if op == WRITE {
        mem.bytes().to_vec()
    } else {
        file_a.clone()
    };
    let file_now = std::fs::read(&a).unwrap();
    for i in 0..n as usize {
        let (mo, fo) = (i * block as usize, (n as usize - 1 - i) * block as usize);
        let (got, want) = if op == WRITE {
            (
                &file_now[fo..fo + block as usize],
                &want_file[mo..mo + block as usize],
            )
        } else {
            (
                &mem.bytes()[mo..mo + block as usize],
                &file_a[fo..fo + block as usize],
            )
        };
        assert!(got == want, "{name}: block {i} is not the registered file's (in flight at the reuse: {was_in_flight})");
    }
    e.deregister(mf).unwrap();
    e.deregister(m).unwrap();
    // SAFETY: fd names the other file now, opened for the test.
    unsafe { libc::close(fd) };
}

#[test]
fn a_reuse_while_in_flight_cannot_redirect_the_request() {
    let _fds = FDS.lock().unwrap_or_else(|p| p.into_inner());
    in_flight(
        "page-cache workers READ",
        &[("punt_buffered_min", "4096")],
        false,
        READ,
    );
    in_flight("ring WRITE raw fd", RING_RAW, false, WRITE);
    in_flight("O_DIRECT WRITE", &[], true, WRITE);
    in_flight("O_DIRECT READ", &[], true, READ);
}
