//! The ROCm provider (`gpu_provider = rocm`): AMD GPU memory through the HSA runtime (ROCr).
//!
//! `libhsa-runtime64.so.1` is loaded at run time (`sys`), so the default build needs no ROCm and
//! runs anywhere; a missing library is an absent capability with a message. `IUD_HSA_LIBRARY`
//! names another library file instead (the tests' double in tests/rocm_double, or a ROCm outside
//! the loader path).
//!
//! - Devices: the GPU agents of `hsa_iterate_agents`, in that order; VRAM `devId` n is the n-th.
//!   With `--features rocm`, HIP (hip-runtime-sys) also answers device count and pointer
//!   attributes, and its device ordinal is the one a registration's `devId` must match.
//! - Registration: `hsa_amd_pointer_info` gives the allocation (base, size, owning agent); host
//!   memory and ranges that leave their allocation are refused (`device`).
//! - DMA-BUF: `hsa_amd_portable_export_dmabuf_v2` (flags 0) when present, else v1. The DMA-BUF may
//!   describe the whole allocation; the returned offset is where the slab starts inside it and
//!   travels in `DmabufExport::offset` to every I/O address (`device`).
//! - Staging: host buffers pinned with `hsa_amd_memory_lock`; copies are
//!   `hsa_amd_memory_async_copy` with a completion signal as the ticket (`copy`).
//! - Errors: every HSA status is named and mapped to an engine error kind in one place (`status`).

mod copy;
mod device;
#[cfg(feature = "rocm")]
mod hip;
mod runtime;
pub mod status;
pub mod sys;

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::gpu::provider::{CopyTicket, DeviceRange, DmabufExport, GpuProvider};
pub use runtime::{DmabufQuery, GpuAgent, Rocm};
use status::check;
use sys::{Agent, Lib};

static ROCM: OnceCell<std::result::Result<Arc<Rocm>, Error>> = OnceCell::new();
/// The process-wide HSA library: it stays loaded for the process (the runtime is never shut
/// down), so it lives in a static, also when its hsa_init failed.
static LIB: OnceCell<std::result::Result<Lib, Error>> = OnceCell::new();

/// Loads the provider once per process (the library of `IUD_HSA_LIBRARY`, else the soname), or
/// says why it is unavailable.
pub fn load() -> Result<Arc<dyn GpuProvider>> {
    load_rocm().map(|r| r as Arc<dyn GpuProvider>)
}

fn load_rocm() -> Result<Arc<Rocm>> {
    ROCM.get_or_init(|| {
        LIB.get_or_init(Lib::open_default)
            .as_ref()
            .map_err(Clone::clone)
            .and_then(Rocm::init)
    })
    .clone()
}

impl Rocm {
    /// Opens the HSA library at `path` and initializes it: a provider of its own, not the
    /// process-wide one (`load`). For tests and tools that pick the library explicitly.
    pub fn open(path: &str) -> Result<Arc<Rocm>> {
        Rocm::init(Box::leak(Box::new(Lib::open(path)?)))
    }

    fn init(lib: &'static Lib) -> Result<Arc<Rocm>> {
        // SAFETY: hsa_init takes no arguments; it is reference-counted, and the provider never
        // calls hsa_shut_down (the runtime stays up for the process, like the library).
        check("hsa_init", unsafe { (lib.init)() }).map_err(|e| {
            // ROCr fails hsa_init with OUT_OF_RESOURCES when there is no KFD device node at all.
            let hint = if std::path::Path::new("/dev/kfd").exists() {
                ""
            } else {
                "; /dev/kfd does not exist: no amdgpu/KFD driver (no AMD GPU) on this machine"
            };
            Error::new(e.kind, format!("{} ({}){hint}", e.message, lib.path))
        })?;
        let agents = list_agents(lib)?;
        let mut gpus = Vec::new();
        let mut cpu = None;
        for a in agents {
            match agent_u32(lib, a, sys::AGENT_INFO_DEVICE)? {
                sys::DEVICE_TYPE_GPU => gpus.push(GpuAgent {
                    agent: a,
                    name: agent_name(lib, a),
                }),
                sys::DEVICE_TYPE_CPU if cpu.is_none() => cpu = Some(a),
                _ => {}
            }
        }
        let dmabuf = query_dmabuf(lib);
        let version = (
            system_u16(lib, sys::SYSTEM_INFO_VERSION_MAJOR),
            system_u16(lib, sys::SYSTEM_INFO_VERSION_MINOR),
        );
        let build = system_string(lib, sys::AMD_SYSTEM_INFO_BUILD_VERSION);
        Ok(Arc::new(Rocm {
            lib,
            gpus,
            cpu,
            dmabuf,
            version,
            build,
            locked: Mutex::new(Vec::new()),
            #[cfg(feature = "rocm")]
            hip: hip::HipView::query(),
        }))
    }

    pub fn gpus(&self) -> &[GpuAgent] {
        &self.gpus
    }

    pub fn dmabuf_query(&self) -> &DmabufQuery {
        &self.dmabuf
    }

    pub fn library(&self) -> &str {
        &self.lib.path
    }

    /// Which export entry point the library offers ("v2", "v1" or None).
    pub fn export_entry(&self) -> Option<&'static str> {
        self.lib.export.map(|e| match e {
            sys::Export::V2(_) => "hsa_amd_portable_export_dmabuf_v2",
            sys::Export::V1(_) => "hsa_amd_portable_export_dmabuf",
        })
    }

    fn gpu(&self, device: i32) -> Result<&GpuAgent> {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.gpus.get(i))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "ROCm device {device} does not exist ({} HSA GPU agent(s) visible)",
                    self.gpus.len()
                ))
            })
    }

    /// See `Lib::check`.
    fn check(&self, call: &str, code: status::HsaStatus) -> Result<()> {
        self.lib.check(call, code)
    }
}

unsafe extern "C" fn push_agent(agent: Agent, data: *mut c_void) -> status::HsaStatus {
    // SAFETY: `data` is the &mut Vec<Agent> passed by list_agents, alive for the whole call of
    // hsa_iterate_agents. No panic can cross: push only aborts on allocation failure.
    let out = unsafe { &mut *data.cast::<Vec<Agent>>() };
    out.push(agent);
    status::SUCCESS
}

fn list_agents(lib: &Lib) -> Result<Vec<Agent>> {
    let mut agents: Vec<Agent> = Vec::new();
    // SAFETY: the callback only pushes into `agents`, which outlives the call.
    let st = unsafe { (lib.iterate_agents)(push_agent, (&mut agents as *mut Vec<Agent>).cast()) };
    check("hsa_iterate_agents", st)?;
    Ok(agents)
}

fn agent_u32(lib: &Lib, agent: Agent, attr: u32) -> Result<u32> {
    let mut v: u32 = 0;
    let what = format!("hsa_agent_get_info(0x{:x}, {attr})", agent.handle);
    // SAFETY: the attributes asked for are 32-bit enums/integers.
    let status = unsafe { (lib.agent_get_info)(agent, attr, (&mut v as *mut u32).cast()) };
    check(&what, status)?;
    Ok(v)
}

fn agent_string(lib: &Lib, agent: Agent, attr: u32) -> Option<String> {
    let mut buf = [0 as c_char; 64];
    // SAFETY: NAME and PRODUCT_NAME are char[64]; the buffer is 64 bytes.
    let st = unsafe { (lib.agent_get_info)(agent, attr, buf.as_mut_ptr().cast()) };
    if st != status::SUCCESS {
        return None;
    }
    buf[63] = 0;
    // SAFETY: NUL-terminated within the buffer (forced above).
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .trim()
        .to_owned();
    Some(s).filter(|s| !s.is_empty())
}

fn agent_name(lib: &Lib, agent: Agent) -> String {
    match (
        agent_string(lib, agent, sys::AGENT_INFO_NAME),
        agent_string(lib, agent, sys::AMD_AGENT_INFO_PRODUCT_NAME),
    ) {
        (Some(isa), Some(product)) => format!("{product} ({isa})"),
        (Some(n), None) | (None, Some(n)) => n,
        (None, None) => format!("agent 0x{:x}", agent.handle),
    }
}

fn system_u16(lib: &Lib, attr: u32) -> u16 {
    let mut v: u16 = 0;
    // SAFETY: the version attributes are uint16_t.
    let _ = unsafe { (lib.system_get_info)(attr, (&mut v as *mut u16).cast()) };
    v
}

fn system_string(lib: &Lib, attr: u32) -> Option<String> {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: BUILD_VERSION is a `const char*` written into p.
    let st = unsafe { (lib.system_get_info)(attr, (&mut p as *mut *const c_char).cast()) };
    if st != status::SUCCESS || p.is_null() {
        return None;
    }
    // SAFETY: the runtime returns a NUL-terminated static string.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn query_dmabuf(lib: &Lib) -> DmabufQuery {
    // A C bool is one byte; read it as u8 so that no value the runtime writes is invalid here.
    let mut v: u8 = 0;
    // SAFETY: the attribute's type is bool (one byte).
    let st = unsafe {
        (lib.system_get_info)(
            sys::AMD_SYSTEM_INFO_DMABUF_SUPPORTED,
            (&mut v as *mut u8).cast(),
        )
    };
    match st {
        status::SUCCESS if v != 0 => DmabufQuery::Supported,
        status::SUCCESS => DmabufQuery::NotSupported,
        status::ERROR_INVALID_ARGUMENT => DmabufQuery::Unknown(format!(
            "the runtime does not know HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED ({})",
            status::name(st)
        )),
        _ => DmabufQuery::Unknown(
            status::error(
                "hsa_system_get_info(HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED)",
                st,
            )
            .message,
        ),
    }
}

impl GpuProvider for Rocm {
    fn name(&self) -> &'static str {
        "rocm"
    }

    fn device_count(&self) -> i32 {
        self.gpus.len() as i32
    }

    fn check_device_range(&self, device: i32, addr: u64, len: u64) -> Result<DeviceRange> {
        device::check_range(self, device, addr, len)
    }

    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport> {
        device::export(self, device, addr, len)
    }

    unsafe fn pin_host(&self, addr: u64, len: u64) -> Result<()> {
        // SAFETY: forwarded contract (the memory stays mapped until unpin_host).
        unsafe { copy::pin(self, addr, len) }
    }

    fn unpin_host(&self, addr: u64) {
        copy::unpin(self, addr)
    }

    unsafe fn copy_to_host(
        &self,
        device: i32,
        host: u64,
        dev: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: forwarded contract (both ranges valid until the ticket completes).
        unsafe { copy::start(self, device, host, dev, len, true) }
    }

    unsafe fn copy_to_device(
        &self,
        device: i32,
        dev: u64,
        host: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>> {
        // SAFETY: forwarded contract (both ranges valid until the ticket completes).
        unsafe { copy::start(self, device, host, dev, len, false) }
    }

    fn make_current(&self, device: i32) -> Result<()> {
        // HSA has no per-thread context: any thread may use any agent.
        self.gpu(device).map(drop)
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.gpus.iter().map(|g| g.name.as_str()).collect();
        let export = match (self.export_entry(), &self.dmabuf) {
            (None, _) => "no DMA-BUF export entry point".to_owned(),
            (Some(e), DmabufQuery::Supported) => format!("DMA-BUF export via {e}"),
            (Some(e), DmabufQuery::NotSupported) => {
                format!("{e} present but the driver lacks DMA-BUF support")
            }
            (Some(e), DmabufQuery::Unknown(why)) => format!("{e} present, support unknown: {why}"),
        };
        #[allow(unused_mut)]
        let mut line = format!(
            "HSA {}.{} ({}, {}), {} GPU agent(s): {}; {export}",
            self.version.0,
            self.version.1,
            self.build.as_deref().unwrap_or("build unknown"),
            self.lib.path,
            self.gpus.len(),
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            },
        );
        #[cfg(feature = "rocm")]
        line.push_str(&format!("; HIP: {}", self.hip.describe()));
        line
    }
}

/// Lines for iud-doctor: whether (and which) HSA library loads or why not, the DMA-BUF support
/// query, and the GPU agents.
pub fn doctor_report() -> Vec<String> {
    let rocm = match load_rocm() {
        Ok(r) => r,
        Err(e) => return vec![format!("rocm: unavailable: {}", e.message)],
    };
    let mut out = vec![format!(
        "rocm: HSA runtime {} loaded (HSA {}.{}, {})",
        rocm.library(),
        rocm.version.0,
        rocm.version.1,
        rocm.build.as_deref().unwrap_or("build unknown")
    )];
    out.push(match rocm.dmabuf_query() {
        DmabufQuery::Supported => "rocm: HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED = true".to_owned(),
        DmabufQuery::NotSupported => "rocm: HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED = false (the \
                                       amdgpu/KFD driver lacks DMA-BUF export; KFD interface \
                                       1.12+ needed)"
            .to_owned(),
        DmabufQuery::Unknown(why) => format!("rocm: DMA-BUF support unknown: {why}"),
    });
    out.push(format!(
        "rocm: DMA-BUF export entry point: {}",
        rocm.export_entry()
            .unwrap_or("none (an older ROCm, e.g. 5.2; VRAM moves through staging)")
    ));
    if rocm.gpus.is_empty() {
        out.push("rocm: no GPU agents".to_owned());
    }
    for (i, g) in rocm.gpus.iter().enumerate() {
        out.push(format!("rocm: GPU {i}: {}", g.name));
    }
    #[cfg(feature = "rocm")]
    out.push(format!("rocm: HIP: {}", rocm.hip.describe()));
    out
}
