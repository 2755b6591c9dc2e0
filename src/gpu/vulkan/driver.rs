//! The thin Vulkan layer (ash, `libvulkan.so.1` loaded at run time): one instance per process,
//! what each physical device offers for external memory, one logical device per physical device
//! used, and exportable buffer allocations.
//!
//! Every `unsafe` block here is a Vulkan call whose arguments are built right before it; the
//! objects it creates are destroyed exactly once by the owning Rust value's `Drop`.
//! References: VK_KHR_external_memory_fd, VK_EXT_external_memory_dma_buf,
//! vkGetPhysicalDeviceExternalBufferProperties (Vulkan 1.1 core).

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use ash::vk;
use once_cell::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};

/// The buffer usage every allocation is created with (and the external-memory query asks about).
const USAGE: vk::BufferUsageFlags = vk::BufferUsageFlags::from_raw(
    vk::BufferUsageFlags::TRANSFER_SRC.as_raw()
        | vk::BufferUsageFlags::TRANSFER_DST.as_raw()
        | vk::BufferUsageFlags::STORAGE_BUFFER.as_raw(),
);

pub const OPAQUE_FD: vk::ExternalMemoryHandleTypeFlags =
    vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
pub const DMA_BUF: vk::ExternalMemoryHandleTypeFlags =
    vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT;

const DMA_BUF_EXT_NAME: &CStr = ash::ext::external_memory_dma_buf::NAME;
const MEMORY_FD_EXT_NAME: &CStr = ash::khr::external_memory_fd::NAME;

/// The name Vulkan's spec uses for a handle type.
pub fn handle_type_name(t: vk::ExternalMemoryHandleTypeFlags) -> &'static str {
    match t {
        OPAQUE_FD => "OPAQUE_FD",
        DMA_BUF => "DMA_BUF_EXT",
        vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT => "HOST_ALLOCATION_EXT",
        vk::ExternalMemoryHandleTypeFlags::HOST_MAPPED_FOREIGN_MEMORY_EXT => {
            "HOST_MAPPED_FOREIGN_MEMORY_EXT"
        }
        _ => "other",
    }
}

fn names_of(flags: vk::ExternalMemoryHandleTypeFlags) -> String {
    let mut out: Vec<&str> = [OPAQUE_FD, DMA_BUF]
        .into_iter()
        .filter(|t| flags.contains(*t))
        .map(handle_type_name)
        .collect();
    if out.is_empty() {
        out.push("none");
    }
    out.join("|")
}

fn vk_error(what: &str, r: vk::Result) -> Error {
    let kind = match r {
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            ErrorKind::Backend
        }
        vk::Result::ERROR_INCOMPATIBLE_DRIVER
        | vk::Result::ERROR_EXTENSION_NOT_PRESENT
        | vk::Result::ERROR_INITIALIZATION_FAILED => ErrorKind::NotSupported,
        _ => ErrorKind::Backend,
    };
    Error::new(kind, format!("{what} failed: {r:?} ({})", r.as_raw()))
}

fn version(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}

/// A 16-byte UUID in the usual 8-4-4-4-12 form.
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn c_array_string(a: &[c_char]) -> String {
    let bytes: Vec<u8> = a
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// What a physical device offers for one external handle type on buffers.
#[derive(Clone, Copy)]
pub struct HandleSupport {
    pub handle_type: vk::ExternalMemoryHandleTypeFlags,
    /// The device extension that provides the type is present.
    pub extension: bool,
    pub features: vk::ExternalMemoryFeatureFlags,
    /// Handle types that may be requested together with this one in one allocation.
    pub compatible: vk::ExternalMemoryHandleTypeFlags,
}

impl HandleSupport {
    pub fn exportable(&self) -> bool {
        self.extension
            && self
                .features
                .contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE)
    }
    pub fn dedicated_only(&self) -> bool {
        self.features
            .contains(vk::ExternalMemoryFeatureFlags::DEDICATED_ONLY)
    }
    /// One phrase for the doctor.
    pub fn describe(&self) -> String {
        if !self.extension {
            let ext = if self.handle_type == DMA_BUF {
                DMA_BUF_EXT_NAME
            } else {
                MEMORY_FD_EXT_NAME
            };
            return format!(
                "{} not offered (no {})",
                handle_type_name(self.handle_type),
                ext.to_string_lossy()
            );
        }
        let f = self.features;
        let mut words = Vec::new();
        for (flag, word) in [
            (vk::ExternalMemoryFeatureFlags::EXPORTABLE, "exportable"),
            (vk::ExternalMemoryFeatureFlags::IMPORTABLE, "importable"),
            (
                vk::ExternalMemoryFeatureFlags::DEDICATED_ONLY,
                "dedicated-only",
            ),
        ] {
            if f.contains(flag) {
                words.push(word);
            }
        }
        if words.is_empty() {
            words.push("not supported for buffers");
        }
        format!(
            "{} {} (compatible with {})",
            handle_type_name(self.handle_type),
            words.join(" "),
            names_of(self.compatible)
        )
    }
}

/// One physical device as the provider sees it.
pub struct PhysicalDevice {
    pub handle: vk::PhysicalDevice,
    pub name: String,
    pub driver: String,
    pub api_version: u32,
    pub uuid: [u8; 16],
    pub opaque_fd: HandleSupport,
    pub dma_buf: HandleSupport,
    pub memory: vk::PhysicalDeviceMemoryProperties,
    pub queue_family: u32,
}

impl PhysicalDevice {
    /// Whether some memory type is HOST_VISIBLE and HOST_COHERENT (CPU access without flushes).
    pub fn host_visible(&self) -> bool {
        self.memory
            .memory_types_as_slice()
            .iter()
            .any(|t| t.property_flags.contains(HOST_MEMORY))
    }
    pub fn describe(&self) -> String {
        format!(
            "{} (driver {}, Vulkan {}, UUID {})",
            self.name,
            self.driver,
            version(self.api_version),
            uuid_string(&self.uuid)
        )
    }
}

const HOST_MEMORY: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(
    vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw()
        | vk::MemoryPropertyFlags::HOST_COHERENT.as_raw(),
);

/// The loaded library, the instance and the physical devices (process lifetime).
pub struct Vulkan {
    _entry: ash::Entry,
    instance: ash::Instance,
    pub instance_version: u32,
    pub devices: Vec<PhysicalDevice>,
    logical: Mutex<HashMap<usize, Arc<LogicalDevice>>>,
}

// SAFETY: Vulkan instance-level calls are externally synchronized only for vkDestroyInstance,
// which never runs (the instance lives for the process); the device map is behind a Mutex.
unsafe impl Send for Vulkan {}
// SAFETY: as above.
unsafe impl Sync for Vulkan {}

static VULKAN: OnceCell<std::result::Result<Arc<Vulkan>, Error>> = OnceCell::new();

impl Vulkan {
    /// Loads libvulkan.so.1 and creates the instance, once per process.
    pub fn get() -> Result<Arc<Vulkan>> {
        VULKAN.get_or_init(|| Vulkan::load().map(Arc::new)).clone()
    }

    fn load() -> Result<Vulkan> {
        // SAFETY: dlopens the loader (libvulkan.so.1) and resolves vkGetInstanceProcAddr; no
        // Vulkan call is made yet.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| {
            Error::new(
                ErrorKind::NotSupported,
                format!("the Vulkan loader (libvulkan.so.1) could not be loaded: {e}"),
            )
        })?;
        // SAFETY: a global-level query through the loaded entry.
        let instance_version = match unsafe { entry.try_enumerate_instance_version() } {
            Ok(Some(v)) => v,
            Ok(None) => vk::API_VERSION_1_0,
            Err(r) => return Err(vk_error("vkEnumerateInstanceVersion", r)),
        };
        if instance_version < vk::API_VERSION_1_1 {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "the Vulkan loader offers {} only; external memory needs Vulkan 1.1",
                    version(instance_version)
                ),
            ));
        }
        let app = vk::ApplicationInfo::default()
            .application_name(c"IO_URING_DMABUF")
            .engine_name(c"IO_URING_DMABUF")
            .api_version(instance_version.min(vk::API_VERSION_1_3));
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: info and app live across the call; no allocation callbacks.
        let instance = unsafe { entry.create_instance(&info, None) }.map_err(|r| match r {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => Error::new(
                ErrorKind::NotSupported,
                "vkCreateInstance failed: ERROR_INCOMPATIBLE_DRIVER: the Vulkan loader found no \
                 driver (install one, e.g. mesa-vulkan-drivers, or point VK_DRIVER_FILES at the \
                 driver's ICD JSON)",
            ),
            r => vk_error("vkCreateInstance", r),
        })?;
        // SAFETY: instance is valid.
        let handles = match unsafe { instance.enumerate_physical_devices() } {
            Ok(h) => h,
            Err(r) => {
                // SAFETY: nothing else uses the instance yet.
                unsafe { instance.destroy_instance(None) };
                return Err(vk_error("vkEnumeratePhysicalDevices", r));
            }
        };
        let devices = handles
            .into_iter()
            .map(|h| describe_physical(&instance, h, instance_version))
            .collect();
        Ok(Vulkan {
            _entry: entry,
            instance,
            instance_version,
            devices,
            logical: Mutex::new(HashMap::new()),
        })
    }

    pub fn version(&self) -> String {
        version(self.instance_version)
    }

    /// The logical device of physical device `index`, created on first use with the external
    /// memory extensions it offers.
    pub fn logical(&self, index: usize) -> Result<Arc<LogicalDevice>> {
        let mut map = self.logical.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&index) {
            return Ok(Arc::clone(d));
        }
        let pd = self
            .devices
            .get(index)
            .ok_or_else(|| Error::invalid(format!("Vulkan device {index} does not exist")))?;
        let mut exts: Vec<*const c_char> = Vec::new();
        if pd.opaque_fd.extension {
            exts.push(MEMORY_FD_EXT_NAME.as_ptr());
        }
        if pd.dma_buf.extension {
            exts.push(DMA_BUF_EXT_NAME.as_ptr());
        }
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(pd.queue_family)
            .queue_priorities(&priorities)];
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&exts);
        // SAFETY: the physical device belongs to our instance; info and what it points to live
        // across the call.
        let device = unsafe { self.instance.create_device(pd.handle, &info, None) }
            .map_err(|r| vk_error("vkCreateDevice", r))?;
        let memory_fd = pd
            .opaque_fd
            .extension
            .then(|| ash::khr::external_memory_fd::Device::new(&self.instance, &device));
        let d = Arc::new(LogicalDevice {
            index,
            device,
            memory_fd,
            memory: pd.memory,
        });
        map.insert(index, Arc::clone(&d));
        Ok(d)
    }
}

fn describe_physical(
    instance: &ash::Instance,
    handle: vk::PhysicalDevice,
    instance_version: u32,
) -> PhysicalDevice {
    // SAFETY: handle comes from this instance.
    let props = unsafe { instance.get_physical_device_properties(handle) };
    let effective = props.api_version.min(instance_version);
    let mut id = vk::PhysicalDeviceIDProperties::default();
    let mut driver_props = vk::PhysicalDeviceDriverProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
    // Driver properties are core in 1.2; chained only where the device speaks 1.2.
    if effective >= vk::API_VERSION_1_2 {
        props2 = props2.push_next(&mut driver_props);
    }
    // SAFETY: props2's chain holds only structures of versions the device supports.
    unsafe { instance.get_physical_device_properties2(handle, &mut props2) };
    let driver = if effective >= vk::API_VERSION_1_2 {
        let info = c_array_string(&driver_props.driver_info);
        format!(
            "{}{}",
            c_array_string(&driver_props.driver_name),
            if info.is_empty() {
                String::new()
            } else {
                format!(" {info}")
            }
        )
    } else {
        format!(
            "vendor 0x{:04x}, version 0x{:x}",
            props.vendor_id, props.driver_version
        )
    };
    // SAFETY: handle comes from this instance.
    let extensions: Vec<String> = unsafe { instance.enumerate_device_extension_properties(handle) }
        .unwrap_or_default()
        .iter()
        .map(|e| c_array_string(&e.extension_name))
        .collect();
    let has = |n: &CStr| extensions.iter().any(|e| e.as_bytes() == n.to_bytes());
    let support = |t: vk::ExternalMemoryHandleTypeFlags, extension: bool| {
        let mut out = vk::ExternalBufferProperties::default();
        if extension {
            let info = vk::PhysicalDeviceExternalBufferInfo::default()
                .usage(USAGE)
                .handle_type(t);
            // SAFETY: a physical-device query (Vulkan 1.1 core) writing into out.
            unsafe {
                instance.get_physical_device_external_buffer_properties(handle, &info, &mut out)
            };
        }
        let p = out.external_memory_properties;
        HandleSupport {
            handle_type: t,
            extension,
            features: p.external_memory_features,
            compatible: p.compatible_handle_types,
        }
    };
    let fd_ext = has(MEMORY_FD_EXT_NAME);
    // SAFETY: handle comes from this instance.
    let memory = unsafe { instance.get_physical_device_memory_properties(handle) };
    // SAFETY: as above.
    let families = unsafe { instance.get_physical_device_queue_family_properties(handle) };
    let queue_family = families.iter().position(|f| f.queue_count > 0).unwrap_or(0) as u32;
    PhysicalDevice {
        handle,
        name: c_array_string(&props.device_name),
        driver,
        api_version: props.api_version,
        uuid: id.device_uuid,
        opaque_fd: support(OPAQUE_FD, fd_ext),
        dma_buf: support(DMA_BUF, fd_ext && has(DMA_BUF_EXT_NAME)),
        memory,
        queue_family,
    }
}

/// A logical device (kept for the process once created).
pub struct LogicalDevice {
    pub index: usize,
    device: ash::Device,
    memory_fd: Option<ash::khr::external_memory_fd::Device>,
    memory: vk::PhysicalDeviceMemoryProperties,
}

// SAFETY: the calls made on the device (allocate/free memory, create/destroy buffers, map,
// get fd) are externally synchronized per object, and each object belongs to one Allocation.
unsafe impl Send for LogicalDevice {}
// SAFETY: as above.
unsafe impl Sync for LogicalDevice {}

/// How to allocate.
#[derive(Clone, Copy)]
pub struct AllocSpec {
    pub size: u64,
    /// Handle types the memory must be exportable as (empty: plain memory).
    pub export: vk::ExternalMemoryHandleTypeFlags,
    /// Map the memory for the CPU (a HOST_VISIBLE|HOST_COHERENT type is required then);
    /// otherwise a DEVICE_LOCAL type is preferred.
    pub host_mapped: bool,
}

impl std::fmt::Debug for AllocSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AllocSpec({} bytes, export {}, host_mapped {})",
            self.size,
            names_of(self.export),
            self.host_mapped
        )
    }
}

/// One dedicated buffer allocation.
pub struct VkAllocation {
    dev: Arc<LogicalDevice>,
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    /// The VkDeviceMemory size (≥ the requested size).
    pub alloc_size: u64,
    pub export: vk::ExternalMemoryHandleTypeFlags,
    /// The CPU address of byte 0 when host-mapped.
    pub host_ptr: Option<u64>,
    pub memory_type: u32,
}

// SAFETY: the handles are owned by this value; Vulkan objects may be used from any thread with
// external synchronization, which ownership provides.
unsafe impl Send for VkAllocation {}
// SAFETY: shared access only reads fields or calls vkGetMemoryFdKHR, which does not need the
// memory object externally synchronized.
unsafe impl Sync for VkAllocation {}

impl LogicalDevice {
    pub fn allocate(self: &Arc<Self>, spec: AllocSpec) -> Result<VkAllocation> {
        let d = &self.device;
        let mut ext_info = vk::ExternalMemoryBufferCreateInfo::default().handle_types(spec.export);
        let mut info = vk::BufferCreateInfo::default()
            .size(spec.size)
            .usage(USAGE)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        if !spec.export.is_empty() {
            info = info.push_next(&mut ext_info);
        }
        // SAFETY: info (and its chain) live across the call.
        let buffer =
            unsafe { d.create_buffer(&info, None) }.map_err(|r| vk_error("vkCreateBuffer", r))?;
        let mut alloc = VkAllocation {
            dev: Arc::clone(self),
            buffer,
            memory: vk::DeviceMemory::null(),
            alloc_size: 0,
            export: spec.export,
            host_ptr: None,
            memory_type: 0,
        };
        // SAFETY: the buffer was just created on this device.
        let req = unsafe { d.get_buffer_memory_requirements(buffer) };
        let types = self.memory.memory_types_as_slice();
        let pick = |want: vk::MemoryPropertyFlags| {
            (0..types.len() as u32).find(|&i| {
                req.memory_type_bits & (1 << i) != 0
                    && types[i as usize].property_flags.contains(want)
            })
        };
        let memory_type = if spec.host_mapped {
            pick(HOST_MEMORY).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotSupported,
                    "no HOST_VISIBLE|HOST_COHERENT memory type can back an exportable buffer on \
                     this device",
                )
            })?
        } else {
            pick(vk::MemoryPropertyFlags::DEVICE_LOCAL)
                .or_else(|| pick(vk::MemoryPropertyFlags::empty()))
                .ok_or_else(|| Error::backend("no memory type can back the buffer"))?
        };
        let mut export_info = vk::ExportMemoryAllocateInfo::default().handle_types(spec.export);
        let mut dedicated = vk::MemoryDedicatedAllocateInfo::default().buffer(buffer);
        let mut ainfo = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(memory_type)
            .push_next(&mut dedicated);
        if !spec.export.is_empty() {
            ainfo = ainfo.push_next(&mut export_info);
        }
        // SAFETY: ainfo and its chain live across the call; the dedicated buffer is unbound.
        alloc.memory = unsafe { d.allocate_memory(&ainfo, None) }
            .map_err(|r| vk_error(&format!("vkAllocateMemory({} bytes)", req.size), r))?;
        alloc.alloc_size = req.size;
        alloc.memory_type = memory_type;
        // SAFETY: buffer and memory belong to this device; the memory is dedicated to it.
        unsafe { d.bind_buffer_memory(buffer, alloc.memory, 0) }
            .map_err(|r| vk_error("vkBindBufferMemory", r))?;
        if spec.host_mapped {
            // SAFETY: the memory is host visible and not mapped yet; unmapped in Drop.
            let p = unsafe {
                d.map_memory(alloc.memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
            }
            .map_err(|r| vk_error("vkMapMemory", r))?;
            alloc.host_ptr = Some(p as u64);
        }
        Ok(alloc)
    }
}

impl VkAllocation {
    /// A new fd for the whole memory object as `handle_type` (each call makes a new fd).
    pub fn export_fd(&self, handle_type: vk::ExternalMemoryHandleTypeFlags) -> Result<OwnedFd> {
        if !self.export.contains(handle_type) {
            return Err(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "the Vulkan memory was allocated exportable as {} only, not {}",
                    names_of(self.export),
                    handle_type_name(handle_type)
                ),
            ));
        }
        let ext = self.dev.memory_fd.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::NotSupported,
                "the device lacks VK_KHR_external_memory_fd",
            )
        })?;
        let info = vk::MemoryGetFdInfoKHR::default()
            .memory(self.memory)
            .handle_type(handle_type);
        // SAFETY: the memory belongs to the device and was allocated exportable as handle_type.
        let fd = unsafe { ext.get_memory_fd(&info) }.map_err(|r| {
            vk_error(
                &format!("vkGetMemoryFdKHR({})", handle_type_name(handle_type)),
                r,
            )
        })?;
        // SAFETY: the driver returned a new fd that we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub fn device_index(&self) -> usize {
        self.dev.index
    }
}

impl Drop for VkAllocation {
    fn drop(&mut self) {
        let d = &self.dev.device;
        // SAFETY: the objects were created by allocate() and are destroyed once, after every
        // user (the CUDA import, the registry) let go; unmap before free, buffer before memory.
        unsafe {
            if self.host_ptr.is_some() {
                d.unmap_memory(self.memory);
            }
            d.destroy_buffer(self.buffer, None);
            if self.memory != vk::DeviceMemory::null() {
                d.free_memory(self.memory, None);
            }
        }
    }
}
