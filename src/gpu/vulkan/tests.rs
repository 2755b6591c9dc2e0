//! Variant choice on synthetic devices and, where a Vulkan driver is installed (Mesa lavapipe on
//! CPU machines), a real allocation through the provider. The C API's tests are with it in
//! `ffi::vulkan_alloc`.

use ash::vk;

use super::driver::{HandleSupport, PhysicalDevice, DMA_BUF, OPAQUE_FD};
use super::*;
use crate::test_support::skip;

fn support(
    t: vk::ExternalMemoryHandleTypeFlags,
    exportable: bool,
    compatible: vk::ExternalMemoryHandleTypeFlags,
) -> HandleSupport {
    HandleSupport {
        handle_type: t,
        extension: true,
        features: if exportable {
            vk::ExternalMemoryFeatureFlags::EXPORTABLE
        } else {
            vk::ExternalMemoryFeatureFlags::empty()
        },
        compatible,
    }
}

fn device(dma_buf: bool, opaque: bool, host_visible: bool) -> PhysicalDevice {
    let mut memory = vk::PhysicalDeviceMemoryProperties {
        memory_type_count: 1,
        ..Default::default()
    };
    memory.memory_types[0].property_flags = if host_visible {
        vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT
    } else {
        vk::MemoryPropertyFlags::DEVICE_LOCAL
    };
    PhysicalDevice {
        handle: vk::PhysicalDevice::null(),
        name: "test".into(),
        driver: "test".into(),
        api_version: vk::API_VERSION_1_3,
        uuid: [0; 16],
        opaque_fd: support(OPAQUE_FD, opaque, OPAQUE_FD | DMA_BUF),
        dma_buf: support(DMA_BUF, dma_buf, OPAQUE_FD | DMA_BUF),
        memory,
        queue_family: 0,
    }
}

#[test]
fn nvidia_like_device_with_cuda_imports_the_opaque_fd() {
    let (v, spec) = plan(&device(false, true, true), true).unwrap();
    assert_eq!(v, Variant::OpaqueCuda);
    assert!(spec.export == OPAQUE_FD);
    assert!(!spec.host_mapped);
}

#[test]
fn dma_buf_device_with_cuda_exports_both_handle_types() {
    let (v, spec) = plan(&device(true, true, false), true).unwrap();
    assert_eq!(v, Variant::DmabufCuda);
    assert!(spec.export == OPAQUE_FD | DMA_BUF);
}

#[test]
fn dma_buf_device_without_cuda_maps_host_visible_memory() {
    let (v, spec) = plan(&device(true, true, true), false).unwrap();
    assert_eq!(v, Variant::DmabufHost);
    assert!(spec.host_mapped);
}

#[test]
fn lavapipe_like_device_is_host_mapped_with_its_opaque_fd_export() {
    let (v, spec) = plan(&device(false, true, true), false).unwrap();
    assert_eq!(v, Variant::HostMapped);
    assert!(spec.export == OPAQUE_FD);
}

#[test]
fn device_local_only_memory_without_cuda_has_no_variant_and_says_why() {
    let why = plan(&device(true, true, false), false).unwrap_err().message;
    assert!(
        why.contains("no CUDA device matched") && why.contains("HOST_VISIBLE"),
        "{why}"
    );
}

#[test]
fn dma_buf_incompatible_with_opaque_fd_falls_back_to_the_opaque_import() {
    let mut d = device(true, true, false);
    d.dma_buf.compatible = DMA_BUF;
    assert_eq!(plan(&d, true).unwrap().0, Variant::OpaqueCuda);
}

/// The provider on a real driver, when one is installed and no CUDA is around (lavapipe).
#[test]
fn host_mapped_allocation_round_trips_through_the_provider_where_a_driver_exists() {
    let p = match VulkanProvider::get() {
        Ok(p) if p.cuda.is_none() => p,
        Ok(_) => return skip("CUDA is present (the GPU tests cover the CUDA variants)"),
        Err(e) => return skip(&e.message),
    };
    let (variant, _) = match p.plan_for(0) {
        Ok(v) => v,
        Err(e) => return skip(&e.message),
    };
    let addr = p.allocate(0, 3 * 4096 + 100).unwrap().addr;
    assert_eq!(lookup(addr + 5000, 1).unwrap().variant, variant);
    let range = p.check_device_range(0, addr + 4096, 8192).unwrap();
    assert_eq!(
        (range.alloc_start, range.alloc_end),
        (addr, addr + 4 * 4096)
    );
    assert!(
        p.check_device_range(0, addr + 4096, 4 * 4096).is_err(),
        "a range past the end is refused"
    );
    assert!(
        p.check_device_range(1, addr, 4096).is_err(),
        "a wrong devId is refused"
    );
    let unknown = p.check_device_range(0, 0x10, 16).unwrap_err();
    assert!(
        unknown.message.contains("iud_vulkan_alloc"),
        "{}",
        unknown.message
    );

    let src: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    let mut back = vec![0u8; 8192];
    // SAFETY: both host buffers live across the (synchronous) copies; the device range is inside
    // the allocation.
    unsafe {
        p.copy_to_device(0, addr + 4096, src.as_ptr() as u64, 8192)
            .unwrap()
            .wait()
            .unwrap();
        p.copy_to_host(0, back.as_mut_ptr() as u64, addr + 4096, 8192)
            .unwrap()
            .wait()
            .unwrap();
    }
    assert_eq!(src, back);
    match variant {
        Variant::HostMapped => {
            let e = p.export_dmabuf(0, addr, 4096).map(|_| ()).unwrap_err();
            assert_eq!(e.kind, ErrorKind::NotSupported, "{}", e.message);
        }
        _ => {
            let e = p.export_dmabuf(0, addr + 4096, 4096).unwrap();
            assert_eq!(e.offset, 4096);
        }
    }
    VulkanProvider::free(addr).unwrap();
    assert!(lookup(addr, 1).is_none());
    assert_eq!(
        VulkanProvider::free(addr).unwrap_err().kind,
        ErrorKind::InvalidParam,
        "a second free is refused"
    );
}
