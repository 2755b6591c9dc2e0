//! (a) io_uring straight onto the NVMe namespace through the real nvme-pci driver: O_DIRECT,
//! registered buffers (READ_FIXED/WRITE_FIXED), random data verified byte for byte, both through
//! the fixed read and through an independent buffered re-read of the device.

use io_uring::{opcode, types, IoUring};

use crate::report::{Outcome, TestResult};
use crate::util::{compare, read_buffered, res_str, size_str, submit_all, BlockDev, MmapBuf, Rng};

/// Device bytes [0, 64 MiB) belong to these tests.
const BASE: u64 = 0;
const BUF_BYTES: usize = 8 << 20;

/// Transfer sizes of the single round trips: 512 B .. 4 MiB, including sizes that are not
/// powers of two and sizes above QEMU NVMe's 512 KiB maximum transfer (split by the kernel).
pub const SIZES: [u64; 9] = [
    512,
    4096,
    8704,
    65536,
    135168,
    524288,
    528384,
    1 << 20,
    4 << 20,
];

pub struct DirectLab {
    path: String,
    dev: BlockDev,
    ring: IoUring,
    src: MmapBuf,
    dst: MmapBuf,
    rng: Rng,
}

impl DirectLab {
    pub fn new(path: &str) -> Result<DirectLab, String> {
        let dev = BlockDev::open(path, true)?;
        let ring = IoUring::new(128).map_err(|e| format!("io_uring_setup(128): {e}"))?;
        let src = MmapBuf::new(BUF_BYTES).map_err(|e| format!("mmap: {e}"))?;
        let dst = MmapBuf::new(BUF_BYTES).map_err(|e| format!("mmap: {e}"))?;
        // SAFETY: both mappings stay alive (and are not unmapped) for as long as the ring holds
        // the registration: the ring is dropped with DirectLab, and Rust drops fields in
        // declaration order, ring before src/dst.
        unsafe {
            ring.submitter()
                .register_buffers(&[src.iovec(), dst.iovec()])
        }
        .map_err(|e| format!("IORING_REGISTER_BUFFERS: {e}"))?;
        Ok(DirectLab {
            path: path.to_owned(),
            dev,
            ring,
            src,
            dst,
            rng: Rng::new(),
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: {} bytes ({}), logical block {} B",
            self.path,
            self.dev.bytes,
            size_str(self.dev.bytes),
            self.dev.lbs
        )
    }

    /// One WRITE_FIXED + READ_FIXED round trip of `len` bytes (test index `i` picks offsets).
    pub fn round_trip(&mut self, i: usize, len: u64) -> TestResult {
        let lbs = self.dev.lbs as u64;
        if len % lbs != 0 {
            return Ok(Outcome::Skip(format!(
                "{} is not a multiple of the logical block size {lbs}",
                size_str(len)
            )));
        }
        // Device offsets lbs-aligned but mostly not 4 KiB-aligned; buffer offsets differ between
        // source and destination so that nothing lines up by accident.
        let dev_off = BASE + i as u64 * (5 << 20) + (i as u64 % 7) * lbs;
        let s_off = ((i % 3) as u64 * lbs) as usize;
        let d_off = ((i % 5) as u64 * lbs + 4096) as usize;
        let n = len as usize;
        let (want, fill_back) = (
            &mut self.src.bytes_mut()[s_off..s_off + n],
            &mut self.dst.bytes_mut()[d_off..d_off + n],
        );
        self.rng.fill(want);
        self.rng.fill(fill_back);
        let fd = types::Fd(self.dev.fd());
        // SAFETY: s_off + len <= BUF_BYTES, so the pointer stays inside registered buffer 0.
        let s_ptr = unsafe { self.src.ptr().add(s_off) };
        // SAFETY: d_off + len <= BUF_BYTES, so the pointer stays inside registered buffer 1.
        let d_ptr = unsafe { self.dst.ptr().add(d_off) };
        let w = opcode::WriteFixed::new(fd, s_ptr, len as u32, 0)
            .offset(dev_off)
            .build()
            .user_data(0);
        let r = submit_all(&mut self.ring, &[w])?;
        if r[0] as i64 != len as i64 {
            return Err(format!(
                "WRITE_FIXED {} at {dev_off}: result {} (want {len})",
                size_str(len),
                res_str(r[0] as i64)
            ));
        }
        let rd = opcode::ReadFixed::new(fd, d_ptr, len as u32, 1)
            .offset(dev_off)
            .build()
            .user_data(0);
        let r = submit_all(&mut self.ring, &[rd])?;
        if r[0] as i64 != len as i64 {
            return Err(format!(
                "READ_FIXED {} at {dev_off}: result {} (want {len})",
                size_str(len),
                res_str(r[0] as i64)
            ));
        }
        let want = &self.src.bytes()[s_off..s_off + n];
        compare("READ_FIXED data", &self.dst.bytes()[d_off..d_off + n], want)?;
        compare(
            "buffered re-read of the device",
            &read_buffered(&self.path, dev_off, n)?,
            want,
        )?;
        Ok(Outcome::Pass(format!(
            "WRITE_FIXED+READ_FIXED {} at device offset {dev_off} (buffers +{s_off}/+{d_off}): identical, buffered re-read identical",
            size_str(len)
        )))
    }

    /// 64 scattered 4 KiB writes in one submission, then 64 reads in one submission.
    pub fn queue_depth_64(&mut self) -> TestResult {
        const N: usize = 64;
        const BS: u64 = 4096;
        let area = BASE + (48 << 20);
        // Scatter: slot k goes to a pseudo-random 128 KiB-strided position (a permutation).
        let pos: Vec<u64> = (0..N as u64)
            .map(|k| area + ((k * 37) % N as u64) * (128 << 10) + (k % 4) * 512)
            .collect();
        let n = N * BS as usize;
        self.rng.fill(&mut self.src.bytes_mut()[..n]);
        self.rng.fill(&mut self.dst.bytes_mut()[..n]);
        let fd = types::Fd(self.dev.fd());
        let writes: Vec<_> = (0..N)
            .map(|k| {
                // SAFETY: inside registered buffer 0.
                let p = unsafe { self.src.ptr().add(k * BS as usize) };
                opcode::WriteFixed::new(fd, p, BS as u32, 0)
                    .offset(pos[k])
                    .build()
                    .user_data(k as u64)
            })
            .collect();
        let res = submit_all(&mut self.ring, &writes)?;
        if let Some((k, r)) = res.iter().enumerate().find(|(_, &r)| r as u64 != BS) {
            return Err(format!(
                "write {k} at {}: result {}",
                pos[k],
                res_str(*r as i64)
            ));
        }
        let reads: Vec<_> = (0..N)
            .map(|k| {
                // SAFETY: inside registered buffer 1; the reads go to distinct 4 KiB pieces.
                let p = unsafe { self.dst.ptr().add(k * BS as usize) };
                opcode::ReadFixed::new(fd, p, BS as u32, 1)
                    .offset(pos[k])
                    .build()
                    .user_data(k as u64)
            })
            .collect();
        let res = submit_all(&mut self.ring, &reads)?;
        if let Some((k, r)) = res.iter().enumerate().find(|(_, &r)| r as u64 != BS) {
            return Err(format!(
                "read {k} at {}: result {}",
                pos[k],
                res_str(*r as i64)
            ));
        }
        compare(
            "64 scattered 4 KiB blocks",
            &self.dst.bytes()[..n],
            &self.src.bytes()[..n],
        )?;
        for k in [0, 17, N - 1] {
            let b = k * BS as usize;
            compare(
                &format!("buffered re-read of block {k}"),
                &read_buffered(&self.path, pos[k], BS as usize)?,
                &self.src.bytes()[b..b + BS as usize],
            )?;
        }
        Ok(Outcome::Pass(format!("{N} WRITE_FIXED then {N} READ_FIXED of 4 KiB in flight at once, scattered over 8 MiB: identical")))
    }

    /// What the kernel answers to O_DIRECT I/O it must refuse, and at the device end.
    pub fn refusals(&mut self) -> TestResult {
        let fd = types::Fd(self.dev.fd());
        let lbs = self.dev.lbs as u64;
        let end = self.dev.bytes;
        let p = self.dst.ptr();
        // SAFETY: one byte into the 8 MiB registered buffer 1; the I/O there is refused or stays
        // inside the buffer (lengths of at most two logical blocks).
        let p1 = unsafe { p.add(1) };
        let cases = [
            (
                "READ_FIXED of 100 B",
                opcode::ReadFixed::new(fd, p, 100, 1).offset(0).build(),
            ),
            (
                "READ_FIXED at an unaligned offset 100",
                opcode::ReadFixed::new(fd, p, lbs as u32, 1)
                    .offset(100)
                    .build(),
            ),
            (
                "READ_FIXED from memory misaligned by 1 byte",
                opcode::ReadFixed::new(fd, p1, lbs as u32, 1)
                    .offset(0)
                    .build(),
            ),
            (
                "READ_FIXED at the device end",
                opcode::ReadFixed::new(fd, p, lbs as u32, 1)
                    .offset(end)
                    .build(),
            ),
            (
                "READ_FIXED across the device end",
                opcode::ReadFixed::new(fd, p, 2 * lbs as u32, 1)
                    .offset(end - lbs)
                    .build(),
            ),
            (
                "WRITE_FIXED at the device end",
                opcode::WriteFixed::new(fd, p, lbs as u32, 1)
                    .offset(end)
                    .build(),
            ),
            (
                "WRITE_FIXED across the device end",
                opcode::WriteFixed::new(fd, p, 2 * lbs as u32, 1)
                    .offset(end - lbs)
                    .build(),
            ),
        ];
        let entries: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, (_, e))| e.clone().user_data(i as u64))
            .collect();
        let res = submit_all(&mut self.ring, &entries)?;
        let seen: Vec<String> = cases
            .iter()
            .zip(&res)
            .map(|((what, _), r)| format!("{what} -> {}", res_str(*r as i64)))
            .collect();
        let einval = -libc::EINVAL;
        // Misalignment must be EINVAL; at/after the end a read is EOF (0) or short, a write fails.
        let ok = res[0] == einval
            && res[1] == einval
            && res[3] == 0
            && res[4] == lbs as i32
            && res[5] < 0
            && (res[6] < 0 || res[6] == lbs as i32);
        // Memory misaligned by one byte: refused unless the queue's dma_alignment is 0.
        let note = if res[2] == einval {
            ""
        } else {
            " (1-byte memory misalignment accepted by this queue)"
        };
        if ok {
            Ok(Outcome::Pass(format!("{}{note}", seen.join("; "))))
        } else {
            Err(format!("unexpected: {}", seen.join("; ")))
        }
    }
}
