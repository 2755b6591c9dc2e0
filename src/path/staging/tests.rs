//! Unit tests of the staging groups: packing, the write window, runs and merged copies.

use std::sync::Arc;

use super::*;
use crate::error::Error;
use crate::gpu::{CopyFinished, DeviceRange, DmabufExport, GpuProvider};
use crate::uring::FileRef;

/// "Device" memory that is host memory; copies are done at once.
struct HostAsDevice;
impl GpuProvider for HostAsDevice {
    fn name(&self) -> &'static str {
        "host-as-device"
    }
    fn device_count(&self) -> i32 {
        1
    }
    fn check_device_range(&self, _: i32, _: u64, _: u64) -> Result<DeviceRange> {
        Err(Error::backend("not in this test"))
    }
    fn export_dmabuf(&self, _: i32, _: u64, _: u64) -> Result<DmabufExport> {
        Err(Error::backend("not in this test"))
    }
    unsafe fn pin_host(&self, _: u64, _: u64) -> Result<()> {
        Ok(())
    }
    fn unpin_host(&self, _: u64) {}
    unsafe fn copy_to_host(
        &self,
        _: i32,
        host: u64,
        dev: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: both ranges are host memory of the test, valid for `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(dev as *const u8, host as *mut u8, len as usize) };
        Ok(Box::new(CopyFinished))
    }
    unsafe fn copy_to_device(
        &self,
        _: i32,
        dev: u64,
        host: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(host as *const u8, dev as *mut u8, len as usize) };
        Ok(Box::new(CopyFinished))
    }
    fn make_current(&self, _: i32) -> Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        "host memory posing as a device".into()
    }
}

const KIB: u64 = 1024;

fn staging(buffers: u32, write_window: u64) -> Staging {
    let shape = StagingShape {
        buffer_size: 512 * KIB,
        buffers,
        pack_max: 256 * KIB,
        packed_copy: PackedCopy::Batch,
        write_window,
        max_io_size: 0,
        kernel_streams: 1,
    };
    let pool = StagingPool::new(
        Arc::new(HostAsDevice),
        shape.buffer_size,
        shape.buffers,
        |_, _| None,
    )
    .expect("pool");
    Staging::new(pool, shape)
}

fn piece(len: u64) -> IoOp {
    IoOp {
        file: FileRef::Raw(3),
        fd: 3,
        io_fd: 3,
        file_offset: 0,
        addr: 0x1000,
        len: len as u32,
        buf_index: None,
        device: Some(0),
        punt: true,
        desc_index: 0,
    }
}

#[test]
fn page_cache_writes_fill_no_more_than_the_write_window_and_get_it_back_on_close() {
    let mut s = staging(8, 1024 * KIB);
    assert!(s.window_admits(512 * KIB as u32));
    let a = s.open(1, true, piece(512 * KIB), true).expect("a buffer");
    assert!(s.window_admits(512 * KIB as u32), "512 of 1024 KiB used");
    let b = s.open(1, true, piece(512 * KIB), true).expect("a buffer");
    assert!(!s.window_admits(4 * KIB as u32), "the window is full");
    // Other traffic does not count against it: reads and O_DIRECT writes still get buffers.
    let read = s
        .open(2, false, piece(512 * KIB), false)
        .expect("a buffer for a read");
    let direct = s
        .open(3, true, piece(512 * KIB), false)
        .expect("a buffer for an O_DIRECT write");
    assert!(!s.window_admits(4 * KIB as u32));
    s.close(a);
    assert!(
        s.window_admits(512 * KIB as u32),
        "closing a group gives its bytes back"
    );
    for g in [b, read, direct] {
        s.close(g);
    }
    assert_eq!(s.window_used, 0);
}

#[test]
fn packing_stops_at_the_write_window_and_a_lone_piece_larger_than_it_still_goes() {
    let mut s = staging(8, 192 * KIB);
    let g = s.open(1, true, piece(64 * KIB), true).expect("a buffer");
    assert!(s.try_add(g, piece(64 * KIB)));
    assert!(s.try_add(g, piece(64 * KIB)));
    assert!(
        !s.try_add(g, piece(64 * KIB)),
        "a fourth 64 KiB piece would pass 192 KiB"
    );
    assert_eq!(s.pieces(g), 3);
    s.close(g);
    // Nothing fills the window: a piece larger than the whole window is admitted alone.
    assert!(s.window_admits(256 * KIB as u32));
    let big = s.open(1, true, piece(256 * KIB), true).expect("a buffer");
    assert!(!s.window_admits(4 * KIB as u32));
    s.close(big);
    // No window: never limited.
    let mut s = staging(4, 0);
    let gs: Vec<usize> = (0..4)
        .map(|_| s.open(1, true, piece(512 * KIB), true).expect("a buffer"))
        .collect();
    assert!(s.window_admits(512 * KIB as u32));
    gs.into_iter().for_each(|g| s.close(g));
}

fn at(file_offset: u64, len: u64, punt: bool) -> IoOp {
    IoOp {
        file_offset,
        punt,
        ..piece(len)
    }
}

#[test]
fn pieces_end_to_end_in_file_and_buffer_become_one_run() {
    let mut s = staging(4, 0);
    let g = s
        .open(1, false, at(0, 16 * KIB, false), false)
        .expect("a buffer");
    // 16 KiB pieces: 0, 16K, 32K follow each other; 80K leaves a gap in the file; 96K
    // continues it; a 5000-byte piece is padded in the buffer, so what follows it starts a run.
    for op in [
        at(16 * KIB, 16 * KIB, false),
        at(32 * KIB, 16 * KIB, false),
        at(80 * KIB, 16 * KIB, false),
        at(96 * KIB, 5000, false),
        at(96 * KIB + 5000, 4096, false),
    ] {
        assert!(s.try_add(g, op));
    }
    let runs: Vec<(u32, u32)> = s.runs(g).iter().map(|r| (r.piece, r.count)).collect();
    assert_eq!(runs, [(0, 3), (3, 2), (5, 1)]);
    let first = s.host_op(s.runs(g)[0]);
    assert_eq!((first.file_offset, first.len), (0, 48 * KIB as u32));
    let second = s.host_op(s.runs(g)[1]);
    assert_eq!(
        (second.file_offset, second.len, second.addr - first.addr),
        (80 * KIB, 16 * KIB as u32 + 5000, 48 * KIB)
    );
    assert_eq!(s.pieces_within(s.runs(g)[0], 0), 0);
    assert_eq!(s.pieces_within(s.runs(g)[0], 32 * KIB - 1), 1);
    assert_eq!(s.pieces_within(s.runs(g)[0], 48 * KIB), 3);
    s.close(g);
}

#[test]
fn runs_stop_at_another_file_at_max_io_size_and_at_a_worker_job_for_buffered_reads() {
    let mut s = staging(4, 0);
    let g = s
        .open(1, false, at(0, 64 * KIB, false), false)
        .expect("a buffer");
    assert!(
        s.try_add(
            g,
            IoOp {
                io_fd: 4,
                ..at(64 * KIB, 64 * KIB, false)
            }
        ),
        "another file, end to end"
    );
    assert_eq!(s.runs(g).len(), 2);
    s.close(g);
    // Buffered reads (punted to the page-cache workers): at most one worker job per run.
    let g = s
        .open(1, false, at(0, 64 * KIB, true), false)
        .expect("a buffer");
    (1..8).for_each(|i| assert!(s.try_add(g, at(i * 64 * KIB, 64 * KIB, true))));
    let runs: Vec<u32> = s.runs(g).iter().map(|r| r.count).collect();
    assert_eq!(runs, [WORKER_JOB_BYTES as u32 / (64 * KIB as u32); 2]);
    s.close(g);
    // The same pieces written: one run; with max_io_size 128 KiB, four.
    let g = s
        .open(1, true, at(0, 64 * KIB, true), false)
        .expect("a buffer");
    (1..8).for_each(|i| assert!(s.try_add(g, at(i * 64 * KIB, 64 * KIB, true))));
    assert_eq!(s.runs(g).len(), 1);
    s.max_io_size = 128 * KIB;
    assert_eq!(
        s.runs(g).iter().map(|r| r.count).collect::<Vec<_>>(),
        [2; 4]
    );
    s.close(g);
}

#[test]
fn copies_of_neighbours_in_vram_and_buffer_merge() {
    let p = |dev: u64, host: u64, len: u64| CopyPiece { dev, host, len };
    let merged = copy_pieces(
        [
            p(0, 100, 8),
            p(8, 108, 8),
            p(16, 116, 8),
            p(40, 124, 8),
            p(48, 140, 8),
            p(56, 148, 8),
        ]
        .into_iter(),
    );
    let got: Vec<(u64, u64, u64)> = merged.iter().map(|c| (c.dev, c.host, c.len)).collect();
    // A VRAM gap (24 -> 40) and a buffer gap (132 -> 140) each start a new copy.
    assert_eq!(got, [(0, 100, 24), (40, 124, 8), (48, 140, 16)]);
}
