//! (e) The engine's own DMA-BUF I/O path on the real NVMe namespace. DRAM from a shared, sealable
//! memfd mapping is registered with `dram_dmabuf=on`, so the engine must export it through
//! udmabuf, bind the DMA-BUF to the O_DIRECT device fd with the io_uring DMA-BUF uAPI, pass its
//! self-test and move every byte with READ_FIXED/WRITE_FIXED addressed by DMA-BUF offset. It is
//! the same code that carries VRAM exported by a GPU provider; only the exporter differs. Kernels
//! without the uAPI must refuse the registration with NotSupported and say why.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::ErrorKind;

use crate::dmabuf_uapi::{Probe, Support};
use crate::report::{Outcome, TestResult};
use crate::t_engine::{desc, mixed_blocks, register_blk, run, DRAM, READ, WRITE};
use crate::util::{compare, read_buffered, size_str, Rng};

/// Device bytes [192 MiB, 232 MiB) belong to these tests (e1 24 MiB, then e2 16 MiB).
const BASE: u64 = 192 << 20;
const TOTAL: usize = 24 << 20;

/// A shared mapping of a memfd created with MFD_ALLOW_SEALING: the only DRAM udmabuf can export.
pub(crate) struct MemfdBuf {
    pub(crate) ptr: *mut u8,
    len: usize,
    _fd: OwnedFd,
}

impl MemfdBuf {
    pub(crate) fn new(len: usize) -> Result<MemfdBuf, String> {
        // SAFETY: the name is a NUL-terminated literal.
        let fd = unsafe {
            libc::memfd_create(
                c"iud-lab-engine".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by memfd_create and is owned here only.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: raw is the open memfd.
        if unsafe { libc::ftruncate(raw, len as libc::off_t) } != 0 {
            return Err(format!(
                "ftruncate(memfd, {len}): {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a fresh shared mapping of the whole memfd; unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "mmap(memfd, {len}): {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(MemfdBuf {
            ptr: p.cast(),
            len,
            _fd: fd,
        })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is this object's live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for MemfdBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new(), unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// e1: write then read back DRAM <-> BLK through the engine with `dram_dmabuf=on`.
pub fn dram_dmabuf_round_trip(device: &str, probe: Option<Probe>) -> TestResult {
    round_trip(device, probe, TOTAL, 0, BASE, None)
}

/// e2: a 96 MiB region with udmabuf's `size_limit_mb` set to 64: the engine must export it as
/// two slabs (64 + 32 MiB), each in its own registered-buffer slot, and split the descriptors
/// that cross the slab boundary; the 16 MiB moved lie across that boundary in memory.
pub fn dram_dmabuf_slab_boundary(device: &str, probe: Option<Probe>) -> TestResult {
    let limit = crate::udmabuf::SIZE_LIMIT_PARAM;
    let Ok(old) = std::fs::read_to_string(limit) else {
        return Ok(Outcome::Skip(format!(
            "no {limit}: kernel without CONFIG_UDMABUF"
        )));
    };
    std::fs::write(limit, "64").map_err(|e| format!("write 64 to {limit}: {e}"))?;
    let r = round_trip(
        device,
        probe,
        96 << 20,
        (64 - 8) << 20,
        BASE + TOTAL as u64,
        Some(64 << 20),
    );
    let _ = std::fs::write(limit, old.trim());
    r.map(|o| match o {
        Outcome::Pass(m) => Outcome::Pass(format!("udmabuf size_limit_mb 64, 96 MiB region (2 slabs of 64 + 32 MiB), memory window [56, 72) MiB: {m}")),
        other => other,
    })
}

/// Registers `region` bytes of memfd DRAM twice (source, destination) with `dram_dmabuf=on` and
/// moves the 16..24 MiB starting at `mem_start` of each through device bytes at `dev_base`.
/// With `boundary` (a slab boundary, as an offset into the region), at least one descriptor must
/// cross it.
fn round_trip(
    device: &str,
    probe: Option<Probe>,
    region: usize,
    mem_start: usize,
    dev_base: u64,
    boundary: Option<u64>,
) -> TestResult {
    if std::fs::metadata(crate::udmabuf::DEVICE).is_err() {
        return Ok(Outcome::Skip(format!(
            "no {}: kernel without CONFIG_UDMABUF",
            crate::udmabuf::DEVICE
        )));
    }
    let supported = match probe.map(|p| p.support) {
        Some(Support::Supported) => true,
        Some(Support::Absent) => false,
        other => return Err(format!("the lab's probe (c1) gave no verdict: {other:?}")),
    };
    let window = if mem_start == 0 { TOTAL } else { 16 << 20 };
    let lbs = crate::util::BlockDev::open(device, true)?.lbs as u64;
    let e = Engine::new(
        "iud-lab",
        [
            ("dram_dmabuf", "on"),
            ("verify_dma", "true"),
            ("max_io_size", "1048576"),
        ],
    )
    .map_err(|e| format!("Engine::new: {}", e.message))?;
    let mut src = MemfdBuf::new(region)?;
    let dst = MemfdBuf::new(region)?;
    Rng::new().fill(src.bytes_mut());
    let ms = match e.register(DRAM, src.ptr as u64, region as u64, 0, "") {
        Ok(md) => md,
        Err(err) if !supported && err.kind == ErrorKind::NotSupported => {
            return Ok(Outcome::Pass(format!("kernel without the io_uring DMA-BUF uAPI: registerMem(DRAM memfd, dram_dmabuf=on) -> NotSupported \"{}\"", err.message)));
        }
        Err(err) => {
            return Err(format!(
                "registerMem(DRAM memfd {}, dram_dmabuf=on): {:?}: {}",
                size_str(region as u64),
                err.kind,
                err.message
            ))
        }
    };
    if !supported {
        let _ = e.deregister(ms);
        return Err("registerMem(dram_dmabuf=on) was accepted on a kernel whose probe says the uAPI is absent".into());
    }
    let md = e
        .register(DRAM, dst.ptr as u64, region as u64, 0, "")
        .map_err(|err| format!("registerMem(dst): {:?}: {}", err.kind, err.message))?;
    let mut mds: Vec<*const c_void> = vec![ms, md];
    let result = (|| -> Result<String, String> {
        let meta = format!("rw,direct:{device}");
        let mb = register_blk(&e, dev_base, window as u64, 4300, &meta)?
            .ok_or("engine refuses BLK_SEG")?;
        mds.push(mb);
        // Mixed sizes (in logical blocks, up to 4 MiB); memory order is the reverse of device
        // order, so every DMA-BUF offset differs from its device offset.
        let blocks = mixed_blocks(&[8, 1, 2048, 3, 256, 8192, 17, 64, 1], lbs, window as u64);
        let mem_pos = |i: usize| -> u64 {
            mem_start as u64 + blocks[i + 1..].iter().map(|b| b.1).sum::<u64>()
        };
        let crossing = boundary.map(|b| {
            (0..blocks.len())
                .filter(|&i| mem_pos(i) < b && mem_pos(i) + blocks[i].1 > b)
                .count()
        });
        if crossing == Some(0) {
            return Err(
                "no descriptor crosses the slab boundary: the layout does not test the split"
                    .into(),
            );
        }
        let remote: Vec<_> = blocks
            .iter()
            .map(|&(o, n)| desc(dev_base + o, n, 4300, mb))
            .collect();
        let lw: Vec<_> = (0..blocks.len())
            .map(|i| desc(src.ptr as u64 + mem_pos(i), blocks[i].1, 0, ms))
            .collect();
        let lr: Vec<_> = (0..blocks.len())
            .map(|i| desc(dst.ptr as u64 + mem_pos(i), blocks[i].1, 0, md))
            .collect();
        run(&e, WRITE, &lw, &remote)
            .map_err(|err| format!("WRITE: {:?}: {}", err.kind, err.message))?;
        let disk = read_buffered(device, dev_base, window)?;
        for (i, &(o, n)) in blocks.iter().enumerate() {
            let m = mem_pos(i) as usize;
            compare(
                &format!("device block {i} ({} at {})", size_str(n), dev_base + o),
                &disk[o as usize..(o + n) as usize],
                &src.bytes()[m..m + n as usize],
            )?;
        }
        run(&e, READ, &lr, &remote)
            .map_err(|err| format!("READ: {:?}: {}", err.kind, err.message))?;
        let w = mem_start..mem_start + window;
        compare(
            "data read back through the engine's DMA-BUF path",
            &dst.bytes()[w.clone()],
            &src.bytes()[w],
        )?;
        Ok(format!(
            "dram_dmabuf=on, verify_dma on: {} descriptors{} of {} .. {} ({} in all) written through udmabuf DMA-BUFs bound to O_DIRECT {device} and read back: identical in memory and on disk",
            blocks.len(),
            crossing.map_or(String::new(), |n| format!(" ({n} crossing the slab boundary)")),
            size_str(lbs),
            size_str(blocks.iter().map(|b| b.1).max().unwrap_or(0)),
            size_str(window as u64)
        ))
    })();
    for m in mds {
        e.deregister(m)
            .map_err(|err| format!("deregister: {}", err.message))?;
    }

    result.map(Outcome::Pass)
}
