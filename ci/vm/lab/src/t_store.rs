//! (f) The vLLM connector's raw-device store (`devices`, python/nixl_io_uring_dmabuf/
//! vllm_connector/) as the engine sees it: the device registered as one BLK_SEG range by its
//! O_DIRECT fd (devId = fd), starting past the store's 1 MiB header (layout.DEVICE_HEADER), and
//! transfers of whole slots whose pieces are the KV tensors' per-block pages, page-major inside a
//! slot (layout.page_runs: page p of sub-block j at run[p] + j * page[p]). Slots are taken at the
//! start, the middle and the very end of the device, loaded back into other KV blocks, and
//! checked byte for byte in memory and on the device; the header must stay untouched.
//!
//! f1 moves the KV memory through the engine's default path (registered fixed buffers), f2 with
//! `dram_dmabuf=on`: memfd DRAM exported through udmabuf and bound to the device fd with the
//! io_uring DMA-BUF uAPI, the path GPU memory takes. Without the uAPI f2 must be refused with
//! NotSupported.

use std::ffi::c_void;
use std::os::unix::fs::FileExt;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::ErrorKind;

use crate::dmabuf_uapi::{Probe, Support};
use crate::report::{Outcome, TestResult};
use crate::t_engine::{desc, register_blk, run, DRAM, READ, WRITE};
use crate::t_engine_dmabuf::MemfdBuf;
use crate::util::{compare, read_buffered, size_str, BlockDev, MmapBuf, Rng};

/// layout.DEVICE_HEADER: bytes at the start of each device that hold no slot.
const HEADER: u64 = 1 << 20;
/// layout.SLOT_ALIGN.
const SLOT_ALIGN: u64 = 4096;
/// Bytes one KV block takes in each of four KV tensors (the store's "pages"), unequal on
/// purpose, and blocks per slot (blocks_per_chunk).
const PAGES: [u64; 4] = [16 << 10, 16 << 10, 8 << 10, 24 << 10];
const BPC: u64 = 4;
/// KV blocks per tensor in memory.
const BLOCKS: u64 = 32;

struct Geometry {
    slot_bytes: u64,
    num_slots: u64,
    runs: [u64; 4],
}

impl Geometry {
    /// layout.Geometry for one rank, one device of `device_bytes`, no capacity cap.
    fn new(device_bytes: u64) -> Geometry {
        let block: u64 = PAGES.iter().sum();
        let slot_bytes = (block * BPC).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let mut runs = [0; 4];
        let mut off = 0;
        for (p, page) in PAGES.iter().enumerate() {
            runs[p] = off;
            off += page * BPC;
        }
        Geometry {
            slot_bytes,
            num_slots: (device_bytes - HEADER) / slot_bytes,
            runs,
        }
    }
    /// Device offset of page `p` of sub-block `j` of slot `s` (rank 0, the only device).
    fn at(&self, s: u64, j: u64, p: usize) -> u64 {
        HEADER + s * self.slot_bytes + self.runs[p] + j * PAGES[p]
    }
}

/// Memory offset of block `b` of tensor `p` in a region holding the four tensors back to back.
fn mem_at(b: u64, p: usize) -> u64 {
    BLOCKS * PAGES[..p].iter().sum::<u64>() + b * PAGES[p]
}

fn region_bytes() -> usize {
    (BLOCKS * PAGES.iter().sum::<u64>()) as usize
}

/// KV memory of one side: plain anonymous memory (f1) or a sealable memfd (f2, for udmabuf).
enum Kv {
    Plain(MmapBuf),
    Memfd(MemfdBuf),
}

impl Kv {
    fn new(dmabuf: bool) -> Result<Kv, String> {
        Ok(if dmabuf {
            Kv::Memfd(MemfdBuf::new(region_bytes())?)
        } else {
            Kv::Plain(MmapBuf::new(region_bytes()).map_err(|e| format!("mmap: {e}"))?)
        })
    }
    fn ptr(&self) -> u64 {
        match self {
            Kv::Plain(b) => b.ptr() as u64,
            Kv::Memfd(b) => b.ptr as u64,
        }
    }
    fn bytes(&self) -> &[u8] {
        match self {
            Kv::Plain(b) => b.bytes(),
            Kv::Memfd(b) => b.bytes(),
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Kv::Plain(b) => b.bytes_mut(),
            Kv::Memfd(b) => b.bytes_mut(),
        }
    }
}

/// f1 (`dmabuf` false) and f2 (true).
pub fn raw_store_pattern(device: &str, probe: Option<Probe>, dmabuf: bool) -> TestResult {
    let mut supported = true;
    if dmabuf {
        if std::fs::metadata(crate::udmabuf::DEVICE).is_err() {
            return Ok(Outcome::Skip(format!(
                "no {}: kernel without CONFIG_UDMABUF",
                crate::udmabuf::DEVICE
            )));
        }
        supported = match probe {
            Some(p) if p.support == Support::Supported => p.dmabuf_type.is_some(),
            Some(p) if p.support == Support::Absent => false,
            other => return Err(format!("the lab's probe (c1) gave no verdict: {other:?}")),
        };
    }
    let dev = BlockDev::open(device, true)?;
    let geo = Geometry::new(dev.bytes);
    if geo.num_slots < 8 {
        return Err(format!("{device} holds only {} slots", geo.num_slots));
    }
    let n = geo.num_slots;
    // start, neighbours, the middle, the last slot (ending at the device's last byte or before)
    let slots = [0, 1, 2, 7, n / 2, n - 1];
    let params: Vec<(&str, &str)> = if dmabuf {
        vec![
            ("dram_dmabuf", "on"),
            ("verify_dma", "true"),
            ("max_io_size", "1048576"),
        ]
    } else {
        vec![("max_io_size", "1048576")]
    };
    let e = Engine::new("iud-lab", params).map_err(|e| format!("Engine::new: {}", e.message))?;
    let mut src = Kv::new(dmabuf)?;
    let dst = Kv::new(dmabuf)?;
    Rng::new().fill(src.bytes_mut());
    let len = region_bytes() as u64;
    let ms = match e.register(DRAM, src.ptr(), len, 0, "") {
        Ok(m) => m,
        Err(err) if dmabuf && !supported && err.kind == ErrorKind::NotSupported => {
            return Ok(Outcome::Pass(format!("kernel without the io_uring DMA-BUF uAPI: registerMem(KV memory, dram_dmabuf=on) -> NotSupported \"{}\"", err.message)));
        }
        Err(err) => {
            return Err(format!(
                "registerMem(KV memory{}): {:?}: {}",
                if dmabuf { ", dram_dmabuf=on" } else { "" },
                err.kind,
                err.message
            ))
        }
    };
    if dmabuf && !supported {
        let _ = e.deregister(ms);
        return Err("registerMem(dram_dmabuf=on) was accepted on a kernel whose probe says the uAPI is absent".into());
    }
    let mut mds: Vec<*const c_void> = vec![ms];
    let result = (|| -> Result<String, String> {
        let md = e
            .register(DRAM, dst.ptr(), len, 0, "")
            .map_err(|err| format!("registerMem(dst): {:?}: {}", err.kind, err.message))?;
        mds.push(md);
        // the store's header: written first, must survive every slot write
        let mut header = MmapBuf::new(HEADER as usize).map_err(|e| format!("mmap: {e}"))?;
        Rng::new().fill(header.bytes_mut());
        dev.file
            .write_all_at(header.bytes(), 0)
            .map_err(|e| format!("O_DIRECT write of the 1 MiB header: {e}"))?;
        // as transfers.py: one BLOCK registration per device, (file_base, slots * slot_bytes, fd)
        let fd = dev.fd() as u64;
        let mb = register_blk(&e, HEADER, n * geo.slot_bytes, fd, "")?
            .ok_or("engine refuses BLK_SEG")?;
        mds.push(mb);
        // slot slots[i] holds KV blocks i*BPC .. i*BPC+BPC-1 of src; loaded into the mirrored
        // blocks of dst (BLOCKS-1-b), as a new engine would place them
        let mut remote = Vec::new();
        let mut lw = Vec::new();
        let mut lr = Vec::new();
        for (i, &s) in slots.iter().enumerate() {
            for j in 0..BPC {
                let b = i as u64 * BPC + j;
                for (p, &page) in PAGES.iter().enumerate() {
                    remote.push(desc(geo.at(s, j, p), page, fd, mb));
                    lw.push(desc(src.ptr() + mem_at(b, p), page, 0, ms));
                    lr.push(desc(dst.ptr() + mem_at(BLOCKS - 1 - b, p), page, 0, md));
                }
            }
        }
        run(&e, WRITE, &lw, &remote)
            .map_err(|err| format!("store (WRITE): {:?}: {}", err.kind, err.message))?;
        for (i, &s) in slots.iter().enumerate() {
            let base = HEADER + s * geo.slot_bytes;
            let disk = read_buffered(device, base, geo.slot_bytes as usize)?;
            for j in 0..BPC {
                for (p, &page) in PAGES.iter().enumerate() {
                    let d = (geo.at(s, j, p) - base) as usize;
                    let m = mem_at(i as u64 * BPC + j, p) as usize;
                    compare(
                        &format!("slot {s} sub-block {j} page {p} on the device"),
                        &disk[d..d + page as usize],
                        &src.bytes()[m..m + page as usize],
                    )?;
                }
            }
        }
        run(&e, READ, &lr, &remote)
            .map_err(|err| format!("load (READ): {:?}: {}", err.kind, err.message))?;
        for b in 0..slots.len() as u64 * BPC {
            for (p, &page) in PAGES.iter().enumerate() {
                let (g, w) = (mem_at(BLOCKS - 1 - b, p) as usize, mem_at(b, p) as usize);
                compare(
                    &format!("KV block {b} page {p} loaded into block {}", BLOCKS - 1 - b),
                    &dst.bytes()[g..g + page as usize],
                    &src.bytes()[w..w + page as usize],
                )?;
            }
        }
        compare(
            "the store's header after the slot writes",
            &read_buffered(device, 0, HEADER as usize)?,
            header.bytes(),
        )?;
        let last_end = HEADER + (n - 1) * geo.slot_bytes + geo.slot_bytes;
        Ok(format!(
            "{}: slot {} ({} KV blocks of 4 pages {:?} B, page-major), {n} slots after the 1 MiB header; slots {slots:?} (the last ending at byte {last_end} of {}) stored from {} descriptors and loaded into other blocks: identical on the device and in memory, header untouched",
            if dmabuf {
                "dram_dmabuf=on, verify_dma on, KV memory as udmabuf DMA-BUFs bound to the O_DIRECT device fd"
            } else {
                "default path (registered fixed buffers)"
            },
            size_str(geo.slot_bytes),
            BPC,
            PAGES,
            dev.bytes,
            remote.len()
        ))
    })();
    for m in mds {
        e.deregister(m)
            .map_err(|err| format!("deregister: {}", err.message))?;
    }
    result.map(Outcome::Pass)
}
