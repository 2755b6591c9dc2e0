//! Descriptor planning (prepXfer's validation, split at max_io_size / fixed-buffer slots, merge of
//! neighbours) driven through the real engine with real registrations, and every accepted READ
//! executed through io_uring.
//!
//! Fixture (built once): a 1 MiB file with a position-dependent pattern, opened buffered (RW) and
//! O_DIRECT (RO); a 2 MiB page-aligned buffer registered as two DRAM regions; three engines
//! (max_io_size 0 / 4096 / 65536, ring_entries 16 / 16 / 512) each with these registrations.
//!
//! Oracles:
//! - never panics or crashes (ASan build);
//! - prep accepts exactly the valid requests: kinds DRAM->FILE, equal counts, equal non-zero
//!   lengths, each side inside one registration of its kind and devId (whatever MD the
//!   descriptor carries: MDs are hints), no WRITE to the read-only fd,
//!   O_DIRECT alignment (4096-aligned always accepted, not 512-aligned always refused);
//! - refusals are validation errors (InvalidParam / NotFound / Mismatch), never Backend;
//! - an accepted READ completes, every descriptor's memory holds the file's bytes at its file
//!   offset, and no byte outside the descriptors changed (split/merge moved exactly the bytes).
#![no_main]

use std::ffi::c_void;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::ErrorKind;
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;
use libfuzzer_sys::fuzz_target;

const DRAM: i32 = 0;
const FILE: i32 = 4;
const AGENT: &str = "fuzz";
const FILE_LEN: u64 = 1 << 20;
const MEM_LEN: u64 = 2 << 20;
const SENTINEL: u8 = 0xA5;

fn pattern(off: u64) -> u8 {
    let x = off.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (off >> 7);
    let b = (x >> 29) as u8;
    if b == SENTINEL {
        0x5A
    } else {
        b
    }
}

struct EngineFix {
    engine: Engine,
    dram: [usize; 2],
    files: [usize; 2],
}

struct Fix {
    mem: usize,
    fds: [i32; 2], // buffered RW, O_DIRECT RO
    engines: Vec<EngineFix>,
}

// SAFETY: the fixture is only touched from libFuzzer's one fuzzing thread; the raw addresses
// are plain integers here.
unsafe impl Sync for Fix {}
// SAFETY: as above.
unsafe impl Send for Fix {}

fn fix() -> &'static Fix {
    static FIX: OnceLock<Fix> = OnceLock::new();
    FIX.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("iud-fuzz-plan-{}", std::process::id()));
        let dir = if std::path::Path::new("/var/tmp").is_dir() {
            std::path::PathBuf::from(format!("/var/tmp/iud-fuzz-plan-{}", std::process::id()))
        } else {
            dir
        };
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        let bytes: Vec<u8> = (0..FILE_LEN).map(pattern).collect();
        std::fs::write(&path, &bytes).unwrap();
        let fd_b = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
            .into_raw_fd();
        let fd_d = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap()
            .into_raw_fd();
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
        let mut mem: *mut c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign writes an aligned allocation (kept for the process's life).
        assert_eq!(
            unsafe { libc::posix_memalign(&mut mem, 4096, MEM_LEN as usize) },
            0
        );
        let mem = mem as usize;
        let mut engines = Vec::new();
        for (max_io, ring) in [("0", "16"), ("4096", "16"), ("65536", "512")] {
            let engine =
                Engine::new(AGENT, [("max_io_size", max_io), ("ring_entries", ring)]).unwrap();
            let half = MEM_LEN / 2;
            let d0 = engine.register(DRAM, mem as u64, half, 0, "").unwrap() as usize;
            let d1 = engine
                .register(DRAM, mem as u64 + half, half, 0, "")
                .unwrap() as usize;
            let f0 = engine.register(FILE, 0, FILE_LEN, fd_b as u64, "").unwrap() as usize;
            let f1 = engine.register(FILE, 0, FILE_LEN, fd_d as u64, "").unwrap() as usize;
            engines.push(EngineFix {
                engine,
                dram: [d0, d1],
                files: [f0, f1],
            });
        }
        Fix {
            mem,
            fds: [fd_b, fd_d],
            engines,
        }
    })
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
}

/// A length, offset or address delta: mostly aligned values of useful sizes, sometimes raw.
fn value(c: &mut Cursor<'_>, max: u64) -> u64 {
    let sel = c.u8();
    let v = match sel % 8 {
        0 => c.u16() as u64,               // any small value
        1 | 2 => (c.u16() as u64) * 512,   // sector aligned
        3 | 4 => (c.u8() as u64) * 4096,   // page aligned
        5 => (c.u8() as u64 % 17) * 65536, // large, aligned
        6 => c.u32() as u64,               // anything
        _ => (c.u8() as u64 % 5) * 262144 + (c.u8() as u64 % 3) * 4096,
    };
    if sel & 0x80 != 0 {
        v
    } else {
        v % (max + 1)
    }
}

/// Outcome counters, printed every 2^13 inputs: inputs, accepted, refused, READs executed and
/// verified, bytes verified.
static STATS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

fn count(i: usize, n: u64) {
    let v = STATS[i].fetch_add(n, Relaxed) + n;
    if i == 0 && v % (1 << 13) == 0 {
        let s: Vec<u64> = STATS.iter().map(|a| a.load(Relaxed)).collect();
        eprintln!(
            "plan stats: inputs {} accepted {} refused {} reads-verified {} bytes-verified {}",
            s[0], s[1], s[2], s[3], s[4]
        );
    }
}

fuzz_target!(|data: &[u8]| {
    count(0, 1);
    let f = fix();
    let mut c = Cursor(data);
    let head = c.u8();
    let ef = &f.engines[head as usize % f.engines.len()];
    let op = ((head >> 2) & 1) as i32; // 0 READ, 1 WRITE
    let kinds = c.u8();
    let (local_kind, remote_kind) = match kinds % 32 {
        0 => (FILE, DRAM),
        1 => (DRAM, DRAM),
        2 => (1, FILE), // VRAM list with DRAM registrations
        3 => (DRAM, 2), // BLK list with FILE registrations
        _ => (DRAM, FILE),
    };
    let n = (c.u8() % 40) as usize + 1;
    let count_skew = c.u8();
    let mut local = Vec::with_capacity(n);
    let mut remote = Vec::with_capacity(n);
    let mut valid = local_kind == DRAM && remote_kind == FILE;
    let (mut all_4k, mut some_not_512) = (true, false);
    for _ in 0..n {
        let flags = c.u8();
        let mem_reg = (flags & 1) as usize;
        let file_reg = ((flags >> 1) & 1) as usize;
        let len = value(&mut c, FILE_LEN);
        let rlen = if flags & 0x40 != 0 {
            value(&mut c, FILE_LEN)
        } else {
            len
        };
        let moff = value(&mut c, MEM_LEN / 2);
        let foff = value(&mut c, FILE_LEN);
        let mstart = f.mem as u64 + mem_reg as u64 * (MEM_LEN / 2);
        let maddr = mstart.wrapping_add(moff);
        let lmd = match flags >> 4 & 3 {
            0 if flags & 0x80 != 0 => std::ptr::null(),
            1 if flags & 0x80 != 0 => ef.files[file_reg] as *const c_void, // wrong kind
            _ => ef.dram[mem_reg] as *const c_void,
        };
        let l_dev = if flags & 0x08 != 0 && flags & 0x80 != 0 {
            7
        } else {
            0
        };
        let r_dev = if flags & 0x04 != 0 && flags & 0x80 != 0 {
            12345
        } else {
            f.fds[file_reg] as u64
        };
        local.push(iud_desc {
            addr: maddr,
            len,
            dev_id: l_dev,
            md: lmd,
        });
        remote.push(iud_desc {
            addr: foff,
            len: rlen,
            dev_id: r_dev,
            md: ef.files[file_reg] as *const c_void,
        });
        // The MD is only a hint (the engine resolves a descriptor by its kind, devId and range):
        // a null or wrong-kind MD is fine when one DRAM registration holds the whole range.
        let mem_ok = l_dev == 0
            && (0..2u64).any(|r| {
                let start = f.mem as u64 + r * (MEM_LEN / 2);
                maddr >= start
                    && maddr
                        .checked_add(len)
                        .is_some_and(|e| e <= start + MEM_LEN / 2)
            });
        let file_ok = r_dev == f.fds[file_reg] as u64
            && foff.checked_add(rlen).is_some_and(|e| e <= FILE_LEN);
        valid &= len == rlen && len > 0 && mem_ok && file_ok && !(op == 1 && file_reg == 1);
        if file_reg == 1 {
            let a = maddr | foff | len;
            all_4k &= a % 4096 == 0;
            some_not_512 |= a % 512 != 0;
        }
    }
    if count_skew % 29 == 0 && n > 1 {
        remote.pop();
        valid = false;
    }
    let direct_undecided = valid && !all_4k && !some_not_512;
    if valid && some_not_512 {
        valid = false;
    }
    let res = ef
        .engine
        .prep(op, local_kind, &local, remote_kind, &remote, AGENT);
    let req = match res {
        Ok(req) => {
            assert!(
                valid || direct_undecided,
                "prep accepted an invalid request: {local:?} {remote:?}"
            );
            count(1, 1);
            req
        }
        Err(e) => {
            assert!(
                !valid,
                "prep refused a valid request: {} ({local:?} {remote:?})",
                e.message
            );
            count(2, 1);
            assert!(
                matches!(
                    e.kind,
                    ErrorKind::InvalidParam
                        | ErrorKind::NotFound
                        | ErrorKind::Mismatch
                        | ErrorKind::NotSupported
                ),
                "refusal of kind {:?}: {}",
                e.kind,
                e.message
            );
            return;
        }
    };
    // Execute READs whose memory ranges do not overlap (overlaps have no single right answer).
    let mut ranges: Vec<(u64, u64)> = local.iter().map(|d| (d.addr, d.addr + d.len)).collect();
    ranges.sort();
    let overlap = ranges.windows(2).any(|w| w[1].0 < w[0].1);
    if op == 0 && !overlap {
        // SAFETY: the fixture's buffer, MEM_LEN bytes; no request is in flight now.
        let mem = unsafe { std::slice::from_raw_parts_mut(f.mem as *mut u8, MEM_LEN as usize) };
        mem.fill(SENTINEL);
        let mut st = ef.engine.post(&req, op, local.len(), remote.len());
        let mut spins = 0u64;
        while let Ok(Progress::InFlight) = st {
            st = ef.engine.check(&req);
            spins += 1;
            assert!(spins < 50_000_000, "READ never completed");
        }
        if let Err(e) = st {
            panic!("valid READ failed: {} ({local:?} {remote:?})", e.message);
        }
        let mut covered = vec![false; MEM_LEN as usize];
        for (l, r) in local.iter().zip(&remote) {
            let m0 = (l.addr - f.mem as u64) as usize;
            for k in 0..l.len as usize {
                let want = pattern(r.addr + k as u64);
                assert_eq!(
                    mem[m0 + k],
                    want,
                    "byte {k} of descriptor at mem {:#x} file {}",
                    l.addr,
                    r.addr
                );
                covered[m0 + k] = true;
            }
        }
        for (i, b) in mem.iter().enumerate() {
            assert!(
                covered[i] || *b == SENTINEL,
                "byte {i} outside every descriptor was written"
            );
        }
        count(3, 1);
        count(4, local.iter().map(|d| d.len).sum());
    }
    if ef.engine.release(req).is_err() {
        panic!("release failed");
    }
});
