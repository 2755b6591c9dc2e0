//! The ROCm provider against a fake HSA runtime (tests/rocm_double): loading, the DMA-BUF support
//! query, range checks, export offsets, the v2 -> v1 fallback, staging copies, and HSA statuses
//! reaching the caller by name. Needs a C compiler, no GPU.

#[path = "rocm_double/mod.rs"]
mod double;

use std::os::fd::AsRawFd;

use double::{Ctl, Variant};
use io_uring_dmabuf::error::ErrorKind;
use io_uring_dmabuf::gpu::rocm::{DmabufQuery, Rocm};
use io_uring_dmabuf::gpu::GpuProvider;
use io_uring_dmabuf::mem::dmabuf_slabs::{slab_ranges, DmabufSlabs, PAGE};

const MIB: u64 = 1 << 20;

/// A provider on a private copy of the double, plus the double's controls.
fn provider(variant: Variant, name: &str) -> (std::sync::Arc<Rocm>, Ctl) {
    let path = double::instance(variant, name);
    let ctl = Ctl::open(&path);
    let rocm = Rocm::open(&path).unwrap_or_else(|e| panic!("{}", e.message));
    (rocm, ctl)
}

/// Fills `len` bytes at `addr` with a pattern derived from `seed` (never all zeros).
fn fill(addr: u64, len: u64, seed: u8) {
    // SAFETY: the callers pass memory they own (fake VRAM or their own mappings).
    let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i as u64)
            .wrapping_mul(31)
            .wrapping_add(seed as u64 * 7 + 1) as u8
            | 1;
    }
}

fn bytes(addr: u64, len: u64) -> Vec<u8> {
    // SAFETY: as in fill.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }.to_vec()
}

fn mmap(len: u64) -> u64 {
    // SAFETY: an anonymous private mapping, checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as u64
}

#[test]
fn a_missing_hsa_library_is_an_absent_capability_naming_the_path() {
    let err = Rocm::open("/nonexistent/libhsa-runtime64.so.1")
        .err()
        .expect("no library there");
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(
        err.message
            .contains("/nonexistent/libhsa-runtime64.so.1 could not be loaded"),
        "{}",
        err.message
    );

    // A library that is not HSA: refused with the first missing entry point named.
    let err = Rocm::open("libc.so.6").err().expect("libc is not HSA");
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(
        err.message.contains("libc.so.6 lacks hsa_init"),
        "{}",
        err.message
    );
}

#[test]
fn a_failing_hsa_init_is_reported_with_its_status_name() {
    let path = double::instance(Variant::Full, "init-fails");
    let ctl = Ctl::open(&path);
    ctl.fail("hsa_init", 0x1008);
    let err = Rocm::open(&path).err().expect("hsa_init fails");
    assert_eq!(err.kind, ErrorKind::Backend);
    assert!(
        err.message
            .contains("hsa_init failed: HSA_STATUS_ERROR_OUT_OF_RESOURCES (0x1008)"),
        "{}",
        err.message
    );
    assert!(
        err.message.contains(&path),
        "names the library: {}",
        err.message
    );
    ctl.fail("hsa_init", 0);
    let rocm = Rocm::open(&path).expect("loads once hsa_init works");
    assert_eq!(
        ctl.refcount(),
        1,
        "hsa_init once per provider, never shut down"
    );
    assert_eq!(rocm.device_count(), 1);
}

#[test]
fn agents_support_query_and_export_entry_are_reported() {
    let (rocm, _ctl) = provider(Variant::Full, "describe");
    assert_eq!(rocm.device_count(), 1);
    assert_eq!(rocm.dmabuf_query(), &DmabufQuery::Supported);
    assert_eq!(
        rocm.export_entry(),
        Some("hsa_amd_portable_export_dmabuf_v2")
    );
    let d = rocm.describe();
    println!("{d}");
    assert!(
        d.contains("1 GPU agent(s): Fake Instinct (host memory) (gfx-fake)"),
        "{d}"
    );
    assert!(
        d.contains("DMA-BUF export via hsa_amd_portable_export_dmabuf_v2"),
        "{d}"
    );
    assert!(d.contains("fake-hsa (tests/rocm_double)"), "{d}");
    rocm.make_current(0).expect("HSA needs no context");
    assert_eq!(
        rocm.make_current(1).unwrap_err().kind,
        ErrorKind::InvalidParam
    );
}

/// Exports the slabs of `[addr, addr+len)` and checks that every I/O address, taken through
/// `dmabuf_offset_of`, reads the same bytes from the DMA-BUF fd as from memory.
fn export_and_verify(rocm: &Rocm, base: u64, alloc: u64, addr: u64, len: u64) -> DmabufSlabs {
    let range = rocm
        .check_device_range(0, addr, len)
        .unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!((range.alloc_start, range.alloc_end), (base, base + alloc));
    let mut slabs = DmabufSlabs::new(
        slab_ranges(addr, len, range.alloc_start, range.alloc_end),
        "not attempted",
    );
    let why = slabs.export_all(|start, n| rocm.export_dmabuf(0, start, n));
    assert!(why.is_ok(), "{why:?}");
    for slab in &slabs.slabs {
        // The double exports the whole allocation: the slab starts (start - base) into it.
        assert_eq!(slab.export_offset, slab.start - base);
        let fd = slab.dmabuf.as_ref().expect("exported").as_raw_fd();
        for probe in [addr, addr + 1, addr + len / 2, addr + len - 4096] {
            if probe < slab.start || probe + 4096 > slab.start + slab.len {
                continue;
            }
            let mut got = vec![0u8; 4096];
            let off = slab.dmabuf_offset_of(probe);
            // SAFETY: reads 4096 bytes into `got` from the exported fd.
            let n = unsafe { libc::pread(fd, got.as_mut_ptr().cast(), 4096, off as i64) };
            assert_eq!(n, 4096, "pread at DMA-BUF offset {off}");
            assert_eq!(
                got,
                bytes(probe, 4096),
                "DMA-BUF offset {off} for address 0x{probe:x}"
            );
        }
    }
    slabs
}

#[test]
fn a_slab_in_the_middle_of_an_allocation_is_addressed_at_its_export_offset() {
    let (rocm, ctl) = provider(Variant::Full, "offsets");
    let alloc = 8 * MIB;
    let base = ctl.alloc_vram(alloc as usize);
    fill(base, alloc, 3);
    // A registration starting 1 MiB + 512 bytes into the allocation.
    let addr = base + MIB + 512;
    let len = 3 * MIB;
    let slabs = export_and_verify(&rocm, base, alloc, addr, len);
    assert_eq!(slabs.slabs.len(), 1);
    assert_eq!(
        slabs.slabs[0].start,
        base + MIB,
        "page-aligned down, not below the allocation"
    );
    assert_eq!(slabs.slabs[0].dmabuf_offset_of(addr), MIB + 512);
    assert_eq!(
        ctl.open_exports(),
        0,
        "HSA's own fds are given back through hsa_amd_portable_close_dmabuf at once"
    );
    drop(slabs);
    ctl.free_vram(base);
}

#[test]
fn without_the_v2_symbol_export_falls_back_to_v1() {
    let (rocm, ctl) = provider(Variant::NoV2, "v1");
    assert_eq!(rocm.export_entry(), Some("hsa_amd_portable_export_dmabuf"));
    let base = ctl.alloc_vram(2 * MIB as usize);
    fill(base, 2 * MIB, 9);
    let slabs = export_and_verify(&rocm, base, 2 * MIB, base + 3 * PAGE, MIB);
    assert_eq!(slabs.slabs[0].export_offset, 3 * PAGE);
    assert_eq!(ctl.open_exports(), 0);
}

#[test]
fn a_runtime_without_dmabuf_export_refuses_it_but_still_stages() {
    let (rocm, ctl) = provider(Variant::NoExport, "old-rocm");
    assert_eq!(rocm.export_entry(), None);
    match rocm.dmabuf_query() {
        DmabufQuery::Unknown(why) => {
            assert!(why.contains("HSA_STATUS_ERROR_INVALID_ARGUMENT"), "{why}")
        }
        q => panic!("unexpected {q:?}"),
    }
    let base = ctl.alloc_vram(MIB as usize);
    rocm.check_device_range(0, base, MIB)
        .expect("range checks do not need export");
    let err = rocm
        .export_dmabuf(0, base, MIB)
        .err()
        .expect("no export entry point");
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(
        err.message
            .contains("has no hsa_amd_portable_export_dmabuf"),
        "{}",
        err.message
    );
    copy_round_trip(&rocm, &ctl, base, MIB);
}

#[test]
fn an_unsupported_dmabuf_query_refuses_export_with_the_reason() {
    let path = double::instance(Variant::Full, "kfd-too-old");
    let ctl = Ctl::open(&path);
    ctl.set_dmabuf_supported(false);
    let rocm = Rocm::open(&path).expect("loads");
    assert_eq!(rocm.dmabuf_query(), &DmabufQuery::NotSupported);
    let base = ctl.alloc_vram(MIB as usize);
    let err = rocm.export_dmabuf(0, base, MIB).err().expect("refused");
    assert_eq!(err.kind, ErrorKind::NotSupported);
    assert!(
        err.message
            .contains("HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED is false"),
        "{}",
        err.message
    );
    assert!(
        rocm.describe().contains("driver lacks DMA-BUF support"),
        "{}",
        rocm.describe()
    );
}

#[test]
fn host_memory_and_ranges_leaving_the_allocation_are_refused_with_the_address() {
    let (rocm, ctl) = provider(Variant::Full, "refusals");
    let base = ctl.alloc_vram(MIB as usize);

    let host = mmap(MIB);
    let e = rocm.check_device_range(0, host, 4096).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidParam);
    assert!(
        e.message.contains(&format!(
            "VRAM registration 0x{host:x}+4096: not memory of the HSA runtime"
        )),
        "{}",
        e.message
    );

    // SAFETY: the mapping stays until the end of the test; unpinned below.
    unsafe { rocm.pin_host(host, MIB) }.expect("lock");
    let e = rocm.check_device_range(0, host + 8192, 4096).unwrap_err();
    assert!(
        e.message.contains("host memory locked for the GPU"),
        "{}",
        e.message
    );
    rocm.unpin_host(host);
    assert_eq!(ctl.locked_ranges(), 0);

    let e = rocm.check_device_range(0, base + 4096, MIB).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidParam);
    let end = base + MIB;
    assert!(
        e.message.contains(&format!(
            "VRAM registration 0x{:x}+{MIB}: runs past its HSA allocation [0x{base:x}, 0x{end:x})",
            base + 4096
        )),
        "{}",
        e.message
    );

    let e = rocm.check_device_range(1, base, 4096).unwrap_err();
    assert!(
        e.message
            .contains("ROCm device 1 does not exist (1 HSA GPU agent(s) visible)"),
        "{}",
        e.message
    );
    assert_eq!(
        rocm.check_device_range(0, base, MIB).unwrap().alloc_start,
        base
    );
}

/// Pinned host buffer -> VRAM -> another pinned buffer, through signal tickets.
fn copy_round_trip(rocm: &Rocm, ctl: &Ctl, vram: u64, len: u64) {
    let host = mmap(2 * len);
    fill(host, len, 5);
    // SAFETY: the mapping outlives the pin (unpinned below).
    unsafe { rocm.pin_host(host, 2 * len) }.expect("pin");
    // SAFETY: both ranges stay valid until the tickets complete (waited on below).
    let up = unsafe { rocm.copy_to_device(0, vram, host, len) }.expect("start h2d");
    up.wait().expect("h2d");
    assert!(up.is_done().unwrap());
    assert_eq!(bytes(vram, len), bytes(host, len));
    // SAFETY: as above.
    let down = unsafe { rocm.copy_to_host(0, host + len, vram, len) }.expect("start d2h");
    while !down.is_done().expect("d2h") {
        std::thread::yield_now();
    }
    assert_eq!(bytes(host + len, len), bytes(host, len));
    drop((up, down));
    rocm.unpin_host(host);
    assert_eq!(ctl.locked_ranges(), 0);
}

#[test]
fn staging_copies_complete_through_their_signals() {
    let (rocm, ctl) = provider(Variant::Full, "copies");
    let vram = ctl.alloc_vram(4 * MIB as usize);
    copy_round_trip(&rocm, &ctl, vram + MIB, 2 * MIB);

    // Unpinned host memory (the dmabuf self-test's block) is locked for the one copy only.
    let host = mmap(PAGE);
    fill(host, PAGE, 11);
    // SAFETY: both ranges outlive the ticket.
    let t = unsafe { rocm.copy_to_device(0, vram, host, PAGE) }.expect("temporary lock");
    assert_eq!(ctl.locked_ranges(), 1);
    t.wait().unwrap();
    drop(t);
    assert_eq!(
        ctl.locked_ranges(),
        0,
        "the temporary lock ends with the ticket"
    );
    assert_eq!(bytes(vram, PAGE), bytes(host, PAGE));
}

#[test]
fn a_failed_asynchronous_copy_is_an_error_not_a_completion() {
    let (rocm, ctl) = provider(Variant::Full, "copy-fails");
    let vram = ctl.alloc_vram(MIB as usize);
    let host = mmap(MIB);
    // SAFETY: unpinned below, mapping kept.
    unsafe { rocm.pin_host(host, MIB) }.unwrap();
    ctl.set_copy_error(true);
    // SAFETY: both ranges outlive the ticket.
    let t = unsafe { rocm.copy_to_device(0, vram, host, MIB) }.expect("queued");
    let e = t.wait().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Backend);
    assert!(e.message.contains(&format!("host->device copy 0x{host:x} -> 0x{vram:x} ({MIB} bytes) failed: HSA set its completion signal to -1")), "{}", e.message);
    assert!(t.is_done().is_err());
    drop(t);
    rocm.unpin_host(host);
}

#[test]
fn hsa_statuses_of_each_call_reach_the_caller_by_name() {
    let (rocm, ctl) = provider(Variant::Full, "statuses");
    let vram = ctl.alloc_vram(MIB as usize);
    let host = mmap(MIB);

    ctl.fail("hsa_amd_pointer_info", 0x100B);
    let e = rocm.check_device_range(0, vram, 4096).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotAllowed);
    assert!(e.message.contains(&format!("VRAM registration 0x{vram:x}+4096: hsa_amd_pointer_info(0x{vram:x}) failed: HSA_STATUS_ERROR_NOT_INITIALIZED (0x100b)")), "{}", e.message);
    ctl.fail("hsa_amd_pointer_info", 0);

    ctl.fail("hsa_amd_portable_export_dmabuf_v2", 0x1003);
    let e = rocm
        .export_dmabuf(0, vram, MIB)
        .err()
        .expect("export fails");
    assert_eq!(e.kind, ErrorKind::InvalidParam);
    assert!(
        e.message.contains(&format!(
            "hsa_amd_portable_export_dmabuf_v2(0x{vram:x}+{MIB}) failed: HSA_STATUS_ERROR_INVALID_ALLOCATION (0x1003): fake-hsa: the requested allocation is not valid"
        )),
        "{}",
        e.message
    );
    ctl.fail("hsa_amd_portable_export_dmabuf_v2", 0x1004);
    let e = rocm
        .export_dmabuf(0, vram, MIB)
        .err()
        .expect("export fails");
    assert!(
        e.message
            .contains("HSA_STATUS_ERROR_INVALID_AGENT (0x1004)"),
        "{}",
        e.message
    );
    ctl.fail("hsa_amd_portable_export_dmabuf_v2", 0);

    // A failing close of HSA's fd is only logged: the engine's dup stays valid.
    ctl.fail("hsa_amd_portable_close_dmabuf", 0x1000);
    let x = rocm
        .export_dmabuf(0, vram, MIB)
        .expect("export works, close of HSA's fd fails");
    assert!(x.fd.as_raw_fd() >= 0);
    ctl.fail("hsa_amd_portable_close_dmabuf", 0);

    ctl.fail("hsa_amd_memory_lock", 0x1008);
    // SAFETY: nothing gets pinned (the call fails).
    let e = unsafe { rocm.pin_host(host, MIB) }.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Backend);
    assert!(e.message.contains(&format!("hsa_amd_memory_lock(0x{host:x}+{MIB}) failed: HSA_STATUS_ERROR_OUT_OF_RESOURCES (0x1008): fake-hsa: out of resources")), "{}", e.message);
    ctl.fail("hsa_amd_memory_lock", 0);

    // SAFETY: unpinned at the end.
    unsafe { rocm.pin_host(host, MIB) }.unwrap();
    ctl.fail("hsa_signal_create", 0x1008);
    // SAFETY: the copy is refused before anything is queued.
    let e = unsafe { rocm.copy_to_host(0, host, vram, 4096) }
        .err()
        .unwrap();
    assert!(
        e.message
            .contains("hsa_signal_create failed: HSA_STATUS_ERROR_OUT_OF_RESOURCES"),
        "{}",
        e.message
    );
    ctl.fail("hsa_signal_create", 0);
    ctl.fail("hsa_amd_memory_async_copy", 0x1004);
    // SAFETY: as above.
    let e = unsafe { rocm.copy_to_host(0, host, vram, 4096) }
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidParam);
    assert!(
        e.message.contains(&format!("device->host copy 0x{vram:x} -> 0x{host:x} (4096 bytes): hsa_amd_memory_async_copy failed: HSA_STATUS_ERROR_INVALID_AGENT (0x1004)")),
        "{}",
        e.message
    );
    ctl.fail("hsa_amd_memory_async_copy", 0x4242);
    // SAFETY: as above.
    let e = unsafe { rocm.copy_to_host(0, host, vram, 4096) }
        .err()
        .unwrap();
    assert!(
        e.message
            .contains("HSA status unknown to this build (0x4242)"),
        "{}",
        e.message
    );
    ctl.fail("hsa_amd_memory_async_copy", 0);
    rocm.unpin_host(host);
    assert_eq!(ctl.locked_ranges(), 0);
}
