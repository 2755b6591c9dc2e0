//! Raw HSA declarations and the run-time loader of `libhsa-runtime64.so.1`.
//!
//! Hand-written from ROCR-Runtime's `hsa.h` / `hsa_ext_amd.h` (only what the provider calls), so
//! the default build needs no ROCm headers and links nothing: the library is opened at run time
//! through `gpu::loader` and each entry point resolved by name. Required symbols missing = the library is refused
//! with the symbol named; the DMA-BUF calls are optional (`hsa_amd_portable_export_dmabuf` came
//! with later ROCm releases than 5.2, `_v2` with ROCm 7.1), so an older runtime still serves
//! the staging path.
//!
//! Raw declarations live only here; `unsafe` calls through these pointers happen in the
//! provider's thin wrappers, each with its SAFETY note.

use std::ffi::{c_char, c_int, c_void, CStr};

use super::status::{self, HsaStatus};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::loader::{CFunction, Library};

/// `hsa_agent_t`: an opaque 64-bit handle (passed by value like a u64 in the C ABI).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Agent {
    pub handle: u64,
}

/// `hsa_signal_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    pub handle: u64,
}

/// `hsa_signal_value_t` (large machine model).
pub type SignalValue = i64;

/// `hsa_system_info_t` values.
pub const SYSTEM_INFO_VERSION_MAJOR: u32 = 0;
pub const SYSTEM_INFO_VERSION_MINOR: u32 = 1;
pub const AMD_SYSTEM_INFO_BUILD_VERSION: u32 = 0x200;
/// bool: the driver (KFD interface 1.12+) supports the DMA-BUF APIs.
pub const AMD_SYSTEM_INFO_DMABUF_SUPPORTED: u32 = 0x204;

/// `hsa_agent_info_t` values.
pub const AGENT_INFO_NAME: u32 = 0; // char[64]
pub const AGENT_INFO_DEVICE: u32 = 17; // hsa_device_type_t
pub const AMD_AGENT_INFO_PRODUCT_NAME: u32 = 0xA009; // char[64]

/// `hsa_device_type_t` values.
pub const DEVICE_TYPE_CPU: u32 = 0;
pub const DEVICE_TYPE_GPU: u32 = 1;

/// `hsa_signal_condition_t::HSA_SIGNAL_CONDITION_LT` and `hsa_wait_state_t::BLOCKED`.
pub const SIGNAL_CONDITION_LT: u32 = 2;
pub const WAIT_STATE_BLOCKED: u32 = 0;

/// `hsa_amd_pointer_type_t` values.
pub const POINTER_TYPE_UNKNOWN: u32 = 0;
pub const POINTER_TYPE_HSA: u32 = 1;
pub const POINTER_TYPE_LOCKED: u32 = 2;
pub const POINTER_TYPE_GRAPHICS: u32 = 3;
pub const POINTER_TYPE_IPC: u32 = 4;
pub const POINTER_TYPE_RESERVED_ADDR: u32 = 5;
pub const POINTER_TYPE_HSA_VMEM: u32 = 6;

/// `hsa_amd_pointer_info_t` up to `global_flags`. The runtime fills only as many bytes as `size`
/// says (the struct may only grow within a ROCr major version), so this prefix stays valid.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PointerInfo {
    pub size: u32,
    pub kind: u32,
    pub agent_base: *mut c_void,
    pub host_base: *mut c_void,
    pub size_in_bytes: usize,
    pub user_data: *mut c_void,
    pub agent_owner: Agent,
    pub global_flags: u32,
}
const _: () = assert!(std::mem::size_of::<PointerInfo>() == 56);

impl Default for PointerInfo {
    /// An empty query whose `size` covers this struct.
    fn default() -> PointerInfo {
        PointerInfo {
            size: std::mem::size_of::<PointerInfo>() as u32,
            kind: POINTER_TYPE_UNKNOWN,
            agent_base: std::ptr::null_mut(),
            host_base: std::ptr::null_mut(),
            size_in_bytes: 0,
            user_data: std::ptr::null_mut(),
            agent_owner: Agent { handle: 0 },
            global_flags: 0,
        }
    }
}

pub type AgentCallback = unsafe extern "C" fn(Agent, *mut c_void) -> HsaStatus;

type InitFn = unsafe extern "C" fn() -> HsaStatus;
type SystemGetInfoFn = unsafe extern "C" fn(u32, *mut c_void) -> HsaStatus;
type IterateAgentsFn = unsafe extern "C" fn(AgentCallback, *mut c_void) -> HsaStatus;
type AgentGetInfoFn = unsafe extern "C" fn(Agent, u32, *mut c_void) -> HsaStatus;
type StatusStringFn = unsafe extern "C" fn(HsaStatus, *mut *const c_char) -> HsaStatus;
type PointerInfoFn = unsafe extern "C" fn(
    *const c_void,
    *mut PointerInfo,
    Option<unsafe extern "C" fn(usize) -> *mut c_void>,
    *mut u32,
    *mut *mut Agent,
) -> HsaStatus;
type ExportV1Fn = unsafe extern "C" fn(*const c_void, usize, *mut c_int, *mut u64) -> HsaStatus;
type ExportV2Fn =
    unsafe extern "C" fn(*const c_void, usize, *mut c_int, *mut u64, u64) -> HsaStatus;
type CloseDmabufFn = unsafe extern "C" fn(c_int) -> HsaStatus;
type MemoryLockFn =
    unsafe extern "C" fn(*mut c_void, usize, *mut Agent, c_int, *mut *mut c_void) -> HsaStatus;
type MemoryUnlockFn = unsafe extern "C" fn(*mut c_void) -> HsaStatus;
type AsyncCopyFn = unsafe extern "C" fn(
    *mut c_void,
    Agent,
    *const c_void,
    Agent,
    usize,
    u32,
    *const Signal,
    Signal,
) -> HsaStatus;
type SignalCreateFn =
    unsafe extern "C" fn(SignalValue, u32, *const Agent, *mut Signal) -> HsaStatus;
type SignalDestroyFn = unsafe extern "C" fn(Signal) -> HsaStatus;
type SignalLoadFn = unsafe extern "C" fn(Signal) -> SignalValue;
type SignalWaitFn = unsafe extern "C" fn(Signal, u32, SignalValue, u64, u32) -> SignalValue;

/// The DMA-BUF export entry point the library offers.
#[derive(Clone, Copy)]
pub enum Export {
    /// `hsa_amd_portable_export_dmabuf_v2` (ROCm 7.1+), called with flags 0
    /// (`HSA_AMD_DMABUF_MAPPING_TYPE_NONE`, the same mapping as v1).
    V2(ExportV2Fn),
    /// `hsa_amd_portable_export_dmabuf` (absent from ROCm 5.2, e.g. Debian bookworm's).
    V1(ExportV1Fn),
}

/// Entry points of one loaded HSA library. Never unloaded: HSA keeps process-wide state (its
/// threads, the KFD fd) that must outlive every pointer handed out.
pub struct Lib {
    /// The name or path that was opened.
    pub path: String,
    pub init: InitFn,
    pub system_get_info: SystemGetInfoFn,
    pub iterate_agents: IterateAgentsFn,
    pub agent_get_info: AgentGetInfoFn,
    pub status_string: Option<StatusStringFn>,
    pub pointer_info: PointerInfoFn,
    pub export: Option<Export>,
    pub close_dmabuf: Option<CloseDmabufFn>,
    pub memory_lock: MemoryLockFn,
    pub memory_unlock: MemoryUnlockFn,
    pub async_copy: AsyncCopyFn,
    pub signal_create: SignalCreateFn,
    pub signal_destroy: SignalDestroyFn,
    pub signal_load_scacquire: SignalLoadFn,
    pub signal_wait_scacquire: SignalWaitFn,
    /// The library the pointers point into (never closed: see `gpu::loader`).
    _library: Library,
}

/// The environment variable that replaces the soname search with one library path (the tests'
/// double, or a ROCm install outside the loader's path).
pub const LIBRARY_ENV: &str = "IUD_HSA_LIBRARY";

/// An entry point the provider cannot do without.
fn required<F: CFunction>(library: &Library, symbol: &str) -> Result<F> {
    library.symbol(symbol).map_err(|e| {
        Error::new(
            e.kind,
            format!("{} (not an HSA runtime, or too old)", e.message),
        )
    })
}

/// Names tried when `IUD_HSA_LIBRARY` is unset: the soname (ROCm packages and Debian's
/// libhsa-runtime64-1 put it on the loader path), then ROCm's default prefix for installs that
/// do not register /opt/rocm/lib with ld.so.
pub const CANDIDATES: [&str; 2] = [
    "libhsa-runtime64.so.1",
    "/opt/rocm/lib/libhsa-runtime64.so.1",
];

impl Lib {
    /// Opens the library named by `IUD_HSA_LIBRARY`, else the first of `CANDIDATES` that loads.
    pub fn open_default() -> Result<Lib> {
        match std::env::var(LIBRARY_ENV) {
            Ok(path) if !path.is_empty() => Lib::open(&path)
                .map_err(|e| Error::new(e.kind, format!("{} (from {LIBRARY_ENV})", e.message))),
            _ => {
                // A candidate that loads but lacks an entry point does not stop the search.
                let mut why = Vec::new();
                for name in CANDIDATES {
                    match Lib::open(name) {
                        Ok(lib) => return Ok(lib),
                        Err(e) => why.push(e.message),
                    }
                }
                Err(Error::new(
                    ErrorKind::NotSupported,
                    format!(
                        "no ROCm HSA runtime on this machine ({}); install ROCm or set \
                         {LIBRARY_ENV}",
                        why.join("; ")
                    ),
                ))
            }
        }
    }

    /// Opens one library and resolves its entry points.
    pub fn open(path: &str) -> Result<Lib> {
        if path.contains('\0') {
            return Err(Error::invalid(format!(
                "{LIBRARY_ENV}={path:?} contains a NUL byte"
            )));
        }
        Lib::resolve(Library::open(path)?)
    }

    /// Resolves the entry points of an opened library. Each pointer's type alias spells the C
    /// signature of the function of that name in hsa.h / hsa_ext_amd.h.
    fn resolve(library: Library) -> Result<Lib> {
        let export = match (
            library.optional("hsa_amd_portable_export_dmabuf_v2"),
            library.optional("hsa_amd_portable_export_dmabuf"),
        ) {
            (Some(v2), _) => Some(Export::V2(v2)),
            (None, Some(v1)) => Some(Export::V1(v1)),
            (None, None) => None,
        };
        Ok(Lib {
            path: library.name().to_owned(),
            init: required(&library, "hsa_init")?,
            system_get_info: required(&library, "hsa_system_get_info")?,
            iterate_agents: required(&library, "hsa_iterate_agents")?,
            agent_get_info: required(&library, "hsa_agent_get_info")?,
            status_string: library.optional("hsa_status_string"),
            pointer_info: required(&library, "hsa_amd_pointer_info")?,
            export,
            close_dmabuf: library.optional("hsa_amd_portable_close_dmabuf"),
            memory_lock: required(&library, "hsa_amd_memory_lock")?,
            memory_unlock: required(&library, "hsa_amd_memory_unlock")?,
            async_copy: required(&library, "hsa_amd_memory_async_copy")?,
            signal_create: required(&library, "hsa_signal_create")?,
            signal_destroy: required(&library, "hsa_signal_destroy")?,
            signal_load_scacquire: required(&library, "hsa_signal_load_scacquire")?,
            signal_wait_scacquire: required(&library, "hsa_signal_wait_scacquire")?,
            _library: library,
        })
    }

    /// Turns the status of `call` into a result: the error names the call and the status (see
    /// `status`) and adds the runtime's own text for it when the runtime has one.
    pub fn check(&self, call: &str, code: HsaStatus) -> Result<()> {
        status::check(call, code).map_err(|e| match self.status_text(code) {
            Some(text) => Error::new(e.kind, format!("{}: {text}", e.message)),
            None => e,
        })
    }

    /// The runtime's own text for a status, when it has one.
    pub fn status_text(&self, code: HsaStatus) -> Option<String> {
        let f = self.status_string?;
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: writes a pointer to a static string on success.
        let st = unsafe { f(code, &mut p) };
        if st != status::SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: the runtime returns a NUL-terminated static string.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}
