//! (b) The project's engine with BLK_SEG (nixl_mem_t 2) as the remote kind, on the real NVMe
//! namespace: path mode (metaInfo "rw,direct:/dev/nvme0n1") and fd mode (devId = an O_DIRECT fd),
//! mixed descriptor sizes 512 B .. 4 MiB, data verified byte for byte in memory and on disk.

use std::ffi::c_void;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::{Error, ErrorKind};
use io_uring_dmabuf::ffi::bridge::iud_desc;
use io_uring_dmabuf::uring::Progress;

use crate::report::{Outcome, TestResult};
use crate::util::{compare, read_buffered, size_str, MmapBuf, Rng};

pub(crate) const DRAM: i32 = 0;
pub(crate) const BLK: i32 = 2;
pub(crate) const READ: i32 = 0;
pub(crate) const WRITE: i32 = 1;
const AGENT: &str = "iud-lab";
/// Device bytes [64 MiB, 128 MiB) belong to these tests: path mode in the first half, fd mode
/// in the second.
const BASE: u64 = 64 << 20;
const REGION: u64 = 24 << 20;

pub(crate) fn desc(addr: u64, len: u64, dev_id: u64, md: *const c_void) -> iud_desc {
    iud_desc {
        addr,
        len,
        dev_id,
        md,
    }
}

pub(crate) fn run(
    e: &Engine,
    op: i32,
    local: &[iud_desc],
    remote: &[iud_desc],
) -> Result<(), Error> {
    let req = e.prep(op, DRAM, local, BLK, remote, AGENT)?;
    let mut res = e.post(&req, op, local.len(), remote.len());
    while let Ok(Progress::InFlight) = res {
        res = e.check(&req);
    }
    if let Err((_, err)) = e.release(req) {
        return Err(err);
    }
    res.map(|_| ())
}

/// Cuts `total` bytes into consecutive (offset, length) blocks whose lengths cycle through
/// `unit_sizes` logical blocks, each at most 4 MiB.
pub(crate) fn mixed_blocks(unit_sizes: &[u64], lbs: u64, total: u64) -> Vec<(u64, u64)> {
    let mut blocks = Vec::new();
    let mut off = 0;
    for i in 0.. {
        if off >= total {
            break;
        }
        let len = (unit_sizes[i % unit_sizes.len()] * lbs)
            .min(total - off)
            .min(4 << 20);
        blocks.push((off, len));
        off += len;
    }
    blocks
}

/// Registers the device range; Ok(None) = the engine does not support BLK_SEG (yet): SKIP.
pub(crate) fn register_blk(
    e: &Engine,
    offset: u64,
    len: u64,
    dev_id: u64,
    meta: &str,
) -> Result<Option<*const c_void>, String> {
    match e.register(BLK, offset, len, dev_id, meta) {
        Ok(md) => Ok(Some(md)),
        Err(err) if err.kind == ErrorKind::NotSupported => Ok(None),
        Err(err) => Err(format!(
            "register(BLK_SEG, {offset}, {len}, devId {dev_id}, {meta:?}): {:?}: {}",
            err.kind, err.message
        )),
    }
}

fn not_supported_message(e: &Engine, meta: &str, dev_id: u64) -> String {
    match e.register(BLK, BASE, 4096, dev_id, meta) {
        Err(err) => format!("engine refuses BLK_SEG: {:?}: {}", err.kind, err.message),
        Ok(md) => {
            let _ = e.deregister(md);
            "engine refused BLK_SEG once and accepted it on retry".to_owned()
        }
    }
}

/// Write then read back through the engine, `dev_id`/`meta` naming the device.
pub fn round_trip(device: &str, fd_mode: bool) -> TestResult {
    let lbs = crate::util::BlockDev::open(device, true)?.lbs as u64;
    let base = if fd_mode { BASE + (32 << 20) } else { BASE };
    let e = Engine::new(AGENT, [("max_io_size", "1048576")])
        .map_err(|e| format!("Engine::new: {}", e.message))?;
    let _keep_open;
    let (dev_id, meta, how) = if fd_mode {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(device)
            .map_err(|e| format!("open({device}, O_RDWR|O_DIRECT): {e}"))?;
        let fd = f.as_raw_fd() as u64;
        _keep_open = f;
        (
            fd,
            String::new(),
            format!("fd mode (devId = O_DIRECT fd {fd})"),
        )
    } else {
        (
            4242u64,
            format!("rw,direct:{device}"),
            format!("path mode (devId 4242, metaInfo \"rw,direct:{device}\")"),
        )
    };
    let Some(mb) = register_blk(&e, base, REGION, dev_id, &meta)? else {
        return Ok(Outcome::Skip(not_supported_message(&e, &meta, dev_id)));
    };
    // Mixed sizes 512 B .. 4 MiB (in logical blocks) over 16 MiB of the device; in memory the
    // blocks sit in reverse order so that memory and device layouts never coincide.
    let unit_sizes = [1u64, 8, 3, 256, 1, 2048, 7, 8192, 17, 64];
    let total = 16u64 << 20;
    let mut src = MmapBuf::new(total as usize).map_err(|e| format!("mmap: {e}"))?;
    let dst = MmapBuf::new(total as usize).map_err(|e| format!("mmap: {e}"))?;
    let mut rng = Rng::new();
    rng.fill(src.bytes_mut());
    let ms = e
        .register(DRAM, src.ptr() as u64, total, 0, "")
        .map_err(|e| format!("register DRAM: {}", e.message))?;
    let md = e
        .register(DRAM, dst.ptr() as u64, total, 0, "")
        .map_err(|e| format!("register DRAM: {}", e.message))?;
    let blocks = mixed_blocks(&unit_sizes, lbs, total);
    let mem_pos = |i: usize| -> u64 { blocks[i + 1..].iter().map(|b| b.1).sum() };
    let remote: Vec<_> = blocks
        .iter()
        .map(|&(o, n)| desc(base + o, n, dev_id, mb))
        .collect();
    let lw: Vec<_> = (0..blocks.len())
        .map(|i| desc(src.ptr() as u64 + mem_pos(i), blocks[i].1, 0, ms))
        .collect();
    let lr: Vec<_> = (0..blocks.len())
        .map(|i| desc(dst.ptr() as u64 + mem_pos(i), blocks[i].1, 0, md))
        .collect();
    let result = (|| -> Result<(), String> {
        run(&e, WRITE, &lw, &remote)
            .map_err(|err| format!("WRITE: {:?}: {}", err.kind, err.message))?;
        // What reached the disk, through an independent buffered open of the device.
        let disk = read_buffered(device, base, total as usize)?;
        for (i, &(o, n)) in blocks.iter().enumerate() {
            let m = mem_pos(i) as usize;
            compare(
                &format!("device block {i} ({} at {})", size_str(n), base + o),
                &disk[o as usize..(o + n) as usize],
                &src.bytes()[m..m + n as usize],
            )?;
        }
        run(&e, READ, &lr, &remote)
            .map_err(|err| format!("READ: {:?}: {}", err.kind, err.message))?;
        compare(
            "data read back through the engine",
            &dst.bytes()[..total as usize],
            &src.bytes()[..total as usize],
        )
    })();
    for m in [ms, md, mb] {
        e.deregister(m)
            .map_err(|err| format!("deregister: {}", err.message))?;
    }

    result?;
    Ok(Outcome::Pass(format!(
        "{how}: {} descriptors of {} .. {} ({} in all) written and read back at device offset {base}: identical in memory and on disk",
        blocks.len(),
        size_str(lbs),
        size_str(blocks.iter().map(|b| b.1).max().unwrap_or(0)),
        size_str(total)
    )))
}

/// The engine's refusals on a real NVMe namespace: a buffered fd, a range past the end, and a
/// descriptor that is not a multiple of the logical block size.
pub fn refusals(device: &str) -> TestResult {
    let dev = crate::util::BlockDev::open(device, true)?;
    let e = Engine::new(AGENT, std::iter::empty())
        .map_err(|e| format!("Engine::new: {}", e.message))?;
    let Some(probe) = register_blk(&e, BASE, 4096, 4243, &format!("rw,direct:{device}"))? else {
        return Ok(Outcome::Skip(not_supported_message(
            &e,
            &format!("rw,direct:{device}"),
            4243,
        )));
    };
    e.deregister(probe).map_err(|err| err.message)?;
    let mut seen = Vec::new();
    let buffered = OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .map_err(|e| format!("open({device}): {e}"))?;
    match e.register(BLK, BASE, 4096, buffered.as_raw_fd() as u64, "") {
        Err(err) => seen.push(format!("buffered fd -> {:?} \"{}\"", err.kind, err.message)),
        Ok(_) => return Err("BLK_SEG registration of a fd without O_DIRECT was accepted".into()),
    }
    match e.register(
        BLK,
        dev.bytes - 4096,
        8192,
        4244,
        &format!("rw,direct:{device}"),
    ) {
        Err(err) => seen.push(format!(
            "range past the end -> {:?} \"{}\"",
            err.kind, err.message
        )),
        Ok(_) => {
            return Err(format!(
                "BLK_SEG registration of [{}, +8192) on a {}-byte device was accepted",
                dev.bytes - 4096,
                dev.bytes
            ))
        }
    }
    let mb = register_blk(&e, BASE, 1 << 20, 4245, &format!("rw,direct:{device}"))?
        .ok_or("BLK_SEG refused on second try")?;
    let buf = MmapBuf::new(1 << 20).map_err(|e| format!("mmap: {e}"))?;
    let m = e
        .register(DRAM, buf.ptr() as u64, 1 << 20, 0, "")
        .map_err(|e| e.message)?;
    let odd = dev.lbs as u64 / 2;
    let r = run(
        &e,
        WRITE,
        &[desc(buf.ptr() as u64, odd, 0, m)],
        &[desc(BASE, odd, 4245, mb)],
    );
    let _ = e.deregister(m);
    let _ = e.deregister(mb);

    match r {
        Err(err) => seen.push(format!(
            "{odd}-byte descriptor -> {:?} \"{}\"",
            err.kind, err.message
        )),
        Ok(()) => {
            return Err(format!(
                "a {odd}-byte WRITE on a {}-byte-sector device was accepted",
                dev.lbs
            ))
        }
    }
    Ok(Outcome::Pass(seen.join("; ")))
}
