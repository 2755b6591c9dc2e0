//! Memory another API allocated, imported into CUDA (Vulkan's OPAQUE_FD export): the CUDA
//! address the Vulkan provider registers and copies through, and the device UUID that matches a
//! Vulkan device to its CUDA device.

use std::os::fd::OwnedFd;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::{call, check, guard, Cuda};
use crate::error::Result;

/// Device memory that another API allocated and CUDA imported (`cuImportExternalMemory` plus
/// `cuExternalMemoryGetMappedBuffer`): the CUDA address of the whole imported object. Dropping it
/// frees the mapping and destroys the external-memory handle; the exporting API's allocation
/// stays the exporter's to free (after this).
pub struct ImportedMemory {
    ext: sys::CUexternalMemory,
    ptr: sys::CUdeviceptr,
    size: u64,
    ctx: sys::CUcontext,
}

// SAFETY: the handles are process-wide driver objects; drop makes their context current first.
unsafe impl Send for ImportedMemory {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for ImportedMemory {}

impl ImportedMemory {
    /// The CUDA device address of the imported object's first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        // SAFETY: both handles were created by import_opaque_fd and are released once, the
        // mapping before the external memory (CUDA's order: "cuMemFree ... then
        // cuDestroyExternalMemory").
        let _ = guard("free imported memory", || unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::memory_free(self.ptr);
            result::external_memory::destroy_external_memory(self.ext)
        });
    }
}

impl Cuda {
    /// The device's UUID (what Vulkan reports as `VkPhysicalDeviceIDProperties::deviceUUID`).
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16]> {
        let dev = call("cuDeviceGet", || result::device::get(ordinal))?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // sys: `result::device::get_uuid` calls only cuDeviceGetUuid under cuda-12080; _v2 is the
        // form that matches Vulkan/NVML on MIG too, so it is tried first.
        // SAFETY: writes 16 bytes into uuid.
        let uuid = check("cuDeviceGetUuid_v2", || unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })
        .map(|()| uuid)
        .or_else(|_| call("cuDeviceGetUuid", || result::device::get_uuid(dev)))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Imports an opaque POSIX fd exported by another API (Vulkan `VK_KHR_external_memory_fd`,
    /// OPAQUE_FD) of `size` bytes on device `ordinal` and maps the whole object. The fd is
    /// consumed: "Ownership of the file descriptor is transferred to the CUDA driver when the
    /// handle is imported successfully"; on failure it is closed here.
    pub fn import_opaque_fd(
        &self,
        ordinal: i32,
        fd: OwnedFd,
        size: u64,
        dedicated: bool,
    ) -> Result<ImportedMemory> {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let d = self.device(ordinal)?;
        // Built field by field: the handle-type enum has no zero value, so a zeroed descriptor
        // would be invalid (Rust aborts on it). The union holds an int or pointers: zero is valid.
        // SAFETY: every member of the union is an integer or a raw pointer.
        let mut handle: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st__bindgen_ty_1 =
            unsafe { std::mem::zeroed() };
        handle.fd = fd.as_raw_fd();
        let desc = sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC {
            type_: sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
            handle,
            size,
            flags: if dedicated {
                sys::CUDA_EXTERNAL_MEMORY_DEDICATED
            } else {
                0
            },
            reserved: [0; 16],
        };
        let mut ext: sys::CUexternalMemory = std::ptr::null_mut();
        // sys: `result::external_memory::import_external_memory_opaque_fd` always passes flags 0,
        // and a dedicated Vulkan allocation needs CUDA_EXTERNAL_MEMORY_DEDICATED.
        // SAFETY: desc is fully initialized; ext receives the handle.
        check("cuImportExternalMemory(OPAQUE_FD)", || unsafe {
            sys::cuImportExternalMemory(&mut ext, &desc)
        })?;
        // The driver owns the fd now.
        let _ = fd.into_raw_fd();
        // The whole object: offset 0, `size` bytes, flags 0.
        // SAFETY: ext was just imported.
        let ptr = match call("cuExternalMemoryGetMappedBuffer", || unsafe {
            result::external_memory::get_mapped_buffer(ext, 0, size)
        }) {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: releases the handle imported above, once; nothing is mapped on it.
                let _ = guard("cuDestroyExternalMemory", || unsafe {
                    result::external_memory::destroy_external_memory(ext)
                });
                return Err(e);
            }
        };
        Ok(ImportedMemory {
            ext,
            ptr,
            size,
            ctx: d.ctx,
        })
    }
}
