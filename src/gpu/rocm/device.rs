//! VRAM registrations on the ROCm provider: which allocation a range belongs to, and its export
//! as a DMA-BUF.

use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};

use super::runtime::{not_supported, DmabufQuery, Rocm};
use super::sys::{self, PointerInfo};
use crate::error::{Error, Result};
use crate::gpu::provider::{DeviceRange, DmabufExport};

/// What `hsa_amd_pointer_info` says about `addr`.
fn pointer_info(rocm: &Rocm, addr: u64) -> Result<PointerInfo> {
    let mut info = PointerInfo::default();
    // SAFETY: `info` is a valid out-struct whose `size` says how much the runtime may write; the
    // agent list is not requested (alloc NULL), so nothing is allocated for us. `addr` is only
    // looked up, never dereferenced.
    let st = unsafe {
        (rocm.lib.pointer_info)(
            addr as *const _,
            &mut info,
            None,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    rocm.check(&format!("hsa_amd_pointer_info(0x{addr:x})"), st)?;
    Ok(info)
}

/// Fails unless `[addr, addr+len)` is GPU memory of ROCm device `device` inside one allocation;
/// returns that allocation.
pub fn check_range(rocm: &Rocm, device: i32, addr: u64, len: u64) -> Result<DeviceRange> {
    let gpu = rocm.gpu(device)?;
    let what = format!("VRAM registration 0x{addr:x}+{len}");
    let info = pointer_info(rocm, addr)
        .map_err(|e| Error::new(e.kind, format!("{what}: {}", e.message)))?;
    let refuse = |why: &str| Err(Error::invalid(format!("{what}: {why}")));
    match info.kind {
        sys::POINTER_TYPE_HSA
        | sys::POINTER_TYPE_HSA_VMEM
        | sys::POINTER_TYPE_IPC
        | sys::POINTER_TYPE_GRAPHICS => {}
        sys::POINTER_TYPE_UNKNOWN => {
            return refuse(
                "not memory of the HSA runtime (plain host memory, or another runtime's); \
                 register host memory as DRAM",
            )
        }
        sys::POINTER_TYPE_LOCKED => {
            return refuse(
                "host memory locked for the GPU (hsa_amd_memory_lock / hipHostRegister); register \
                 it as DRAM",
            )
        }
        sys::POINTER_TYPE_RESERVED_ADDR => {
            return refuse(
                "a reserved virtual address range with no memory mapped \
                 (hsa_amd_vmem_address_reserve)",
            )
        }
        other => {
            return refuse(&format!(
                "HSA pointer type {other}, which this build does not know"
            ))
        }
    }
    if info.agent_owner != gpu.agent {
        // Memory from a system (CPU) pool, e.g. hipHostMalloc, is HSA memory owned by a CPU agent.
        return match rocm.gpus.iter().position(|g| g.agent == info.agent_owner) {
            Some(owner) => refuse(&format!(
                "the memory is on ROCm device {owner}, but devId says {device}"
            )),
            None => refuse(&format!(
                "the allocation is owned by HSA agent 0x{:x}, which is not a GPU (host memory \
                 from a system pool, e.g. hipHostMalloc); register it as DRAM",
                info.agent_owner.handle
            )),
        };
    }
    #[cfg(feature = "rocm")]
    rocm.hip.check_pointer(addr, device).map_err(|why| Error {
        message: format!("{what}: {}", why.message),
        ..why
    })?;
    let start = info.agent_base as u64;
    let end = start.saturating_add(info.size_in_bytes as u64);
    if addr < start || addr.checked_add(len).is_none_or(|e| e > end) {
        return refuse(&format!(
            "runs past its HSA allocation [0x{start:x}, 0x{end:x}) ({} bytes)",
            info.size_in_bytes
        ));
    }
    Ok(DeviceRange {
        alloc_start: start,
        alloc_end: end,
    })
}

/// Exports `[addr, addr+len)` as a DMA-BUF. HSA may export the whole allocation: the offset it
/// returns is where `addr` sits inside the DMA-BUF and goes into `DmabufExport::offset`.
pub fn export(rocm: &Rocm, device: i32, addr: u64, len: u64) -> Result<DmabufExport> {
    rocm.gpu(device)?;
    let call = |name: &str| format!("{name}(0x{addr:x}+{len})");
    let Some(entry) = rocm.lib.export else {
        return Err(not_supported(format!(
            "{} has no hsa_amd_portable_export_dmabuf (an older ROCm, e.g. 5.2): VRAM cannot be \
             exported as DMA-BUF",
            rocm.lib.path
        )));
    };
    if rocm.dmabuf == DmabufQuery::NotSupported {
        return Err(not_supported(
            "HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED is false: the amdgpu/KFD driver lacks DMA-BUF \
             export (KFD interface 1.12+ needed)",
        ));
    }
    let mut fd: c_int = -1;
    let mut offset: u64 = 0;
    let (name, st) = match entry {
        // SAFETY: fd and offset are valid out-parameters; the range is only described. Flags 0 =
        // HSA_AMD_DMABUF_MAPPING_TYPE_NONE, the mapping v1 gives.
        sys::Export::V2(f) => ("hsa_amd_portable_export_dmabuf_v2", unsafe {
            f(addr as *const _, len as usize, &mut fd, &mut offset, 0)
        }),
        // SAFETY: as above.
        sys::Export::V1(f) => ("hsa_amd_portable_export_dmabuf", unsafe {
            f(addr as *const _, len as usize, &mut fd, &mut offset)
        }),
    };
    rocm.check(&call(name), st)?;
    if fd < 0 {
        return Err(Error::backend(format!(
            "{} returned success without a DMA-BUF fd ({fd})",
            call(name)
        )));
    }
    // HSA wants its DMA-BUF fds given back through hsa_amd_portable_close_dmabuf (the runtime may
    // keep per-export bookkeeping), but the engine owns slab fds as plain OwnedFds closed whenever
    // a registration drops. So keep a dup (the same DMA-BUF file: the kernel keeps the buffer as
    // long as any fd refers to it) and give HSA's fd back at once.
    // SAFETY: fcntl on the fd HSA just returned; F_DUPFD_CLOEXEC returns a new fd or -1.
    let ours = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    let dup_err = std::io::Error::last_os_error();
    close_hsa_fd(rocm, fd);
    if ours < 0 {
        return Err(Error::os(
            format!("{}: dup of DMA-BUF fd {fd}", call(name)),
            &dup_err,
        ));
    }
    // SAFETY: `ours` is a fresh fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(ours) };
    Ok(DmabufExport {
        fd,
        offset,
        whole_size: None,
    })
}

/// Gives an exported fd back to HSA (or closes it where the runtime has no close call).
fn close_hsa_fd(rocm: &Rocm, fd: c_int) {
    match rocm.lib.close_dmabuf {
        Some(close) => {
            // SAFETY: `fd` came from HSA's export and is given back once.
            let st = unsafe { close(fd) };
            if let Err(e) = rocm.check(&format!("hsa_amd_portable_close_dmabuf({fd})"), st) {
                tracing::warn!(
                    "{}; the DMA-BUF stays usable through the engine's own fd",
                    e.message
                );
            }
        }
        None => {
            // SAFETY: `fd` came from HSA's export and nobody else closes it.
            unsafe { libc::close(fd) };
        }
    }
}
