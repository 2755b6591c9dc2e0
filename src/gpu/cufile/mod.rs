//! cuFile (GPUDirect Storage), loaded at run time under its real soname `libcufile.so.0`.
//!
//! Written by hand rather than through cudarc's cufile bindings: cudarc's loader does not look for
//! `libcufile.so.0` (wheel and CUDA installs ship only that name) and panics when it finds nothing.
//! Only the handful of entry points the plugin uses are resolved; a missing library or symbol is an
//! absent capability with a message.
//!
//! cuFile runs in compatibility mode (POSIX reads into its own bounce buffers) unless nvidia-fs or
//! kernel P2PDMA is set up, and a successful call does not tell which. `mode()` reports what the
//! machine offers; `vram_path=auto` uses cuFile only when it is really direct.

use std::ffi::c_void;

use once_cell::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};
use crate::gpu::loader::Library;
pub use status::status_name;

pub mod batch;
pub mod status;

/// `CUfileError_t`: cuFile status plus the CUDA driver status (returned by value).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CuFileError {
    err: i32,
    cu_err: i32,
}

/// `CUfileDescr_t` with the OPAQUE_FD handle type.
#[repr(C)]
struct CuFileDescr {
    kind: i32,
    _pad: i32,
    fd: i64,
    fs_ops: *const c_void,
}
const _: () = assert!(std::mem::size_of::<CuFileDescr>() == 24);
const CU_FILE_HANDLE_TYPE_OPAQUE_FD: i32 = 1;

type HandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut CuFileDescr) -> CuFileError;
type HandleDeregister = unsafe extern "C" fn(*mut c_void);
type BufRegister = unsafe extern "C" fn(*const c_void, usize, i32) -> CuFileError;
type BufDeregister = unsafe extern "C" fn(*const c_void) -> CuFileError;
type ReadFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;
type WriteFn = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i64, i64) -> isize;
type DriverOpen = unsafe extern "C" fn() -> CuFileError;
type GetProperties = unsafe extern "C" fn(*mut u8) -> CuFileError;
type GetVersion = unsafe extern "C" fn(*mut i32) -> CuFileError;

/// A failed cuFile call: the message names the call and the status; the status travels as
/// ("cufile", code).
fn cufile_error(call: &str, st: CuFileError) -> Error {
    Error::backend(format!("{call} failed: {}", status_name(st.err)))
        .with_vendor("cufile", st.err as i64)
}

/// The loaded library with the driver open (once per process; never closed, since cuFile's
/// driver is process-wide and other users in the process may share it: see `gpu::loader`).
pub struct CuFile {
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    buf_register: BufRegister,
    buf_deregister: BufDeregister,
    read: ReadFn,
    write: WriteFn,
    pub path: &'static str,
    /// The driver's properties (Err: cuFileDriverGetProperties is missing or failed; says why).
    pub props: Result<DriverProps>,
    /// cuFileGetVersion, when the library has it.
    pub version: Option<i32>,
    /// The batch API, when the library has all of it.
    pub batch: Option<batch::BatchFns>,
}

static CUFILE: OnceCell<std::result::Result<CuFile, Error>> = OnceCell::new();

/// The names a cuFile install answers to, most specific first.
const CANDIDATES: [&str; 3] = [
    "libcufile.so.0",
    "libcufile.so",
    "/usr/local/cuda/lib64/libcufile.so.0",
];

/// The leading, stable part of `CUfileDrvProps_t` (cufile.h): the nvfs block, then the feature
/// flags and limits. Newer releases may append fields, so the call writes into a larger zeroed
/// buffer and only this prefix is read.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DriverProps {
    pub nvfs_major_version: u32,
    pub nvfs_minor_version: u32,
    pub poll_thresh_size: usize,
    pub max_direct_io_size: usize,
    pub dstatusflags: u32,
    pub dcontrolflags: u32,
    pub fflags: u32,
    pub max_device_cache_size: u32,
    pub per_buffer_cache_size: u32,
    pub max_device_pinned_mem_size: u32,
    pub max_batch_io_size: u32,
    pub max_batch_io_timeout_msecs: u32,
}
const _: () = assert!(std::mem::size_of::<DriverProps>() == 56);
const _: () = assert!(std::mem::offset_of!(DriverProps, dstatusflags) == 24);
const _: () = assert!(std::mem::offset_of!(DriverProps, fflags) == 32);

/// `dstatusflags` bits (CUfileDriverStatusFlags_t).
const STATUS_NVME_SUPPORTED: u32 = 1 << 4;
const STATUS_NVME_P2P_SUPPORTED: u32 = 1 << 11;
/// `dcontrolflags` bit CU_FILE_ALLOW_COMPAT_MODE.
const CONTROL_ALLOW_COMPAT: u32 = 1 << 1;
/// `fflags` bit CU_FILE_BATCH_IO_SUPPORTED.
const FEATURE_BATCH_IO: u32 = 1 << 1;

/// The I/O mode cuFile runs in, as its driver properties say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// nvidia-fs is loaded: GPUDirect DMA on supported file systems.
    NvidiaFs,
    /// Upstream PCI P2PDMA (no nvidia-fs) on local NVMe.
    P2pdma,
    /// POSIX I/O through cuFile's own bounce buffers.
    Compatibility,
    /// The driver reported neither a direct mode nor compatibility mode.
    Unavailable,
}

impl DriverProps {
    /// Decides the mode: nvidia-fs reports its version; P2PDMA sets the NVMe-P2P status bit;
    /// otherwise only compatibility mode (if allowed) moves bytes.
    pub fn mode(&self) -> Mode {
        if self.nvfs_major_version != 0 {
            Mode::NvidiaFs
        } else if self.dstatusflags & STATUS_NVME_P2P_SUPPORTED != 0 {
            Mode::P2pdma
        } else if self.dcontrolflags & CONTROL_ALLOW_COMPAT != 0 {
            Mode::Compatibility
        } else {
            Mode::Unavailable
        }
    }

    pub fn describe(&self) -> String {
        let mode = match self.mode() {
            Mode::NvidiaFs => format!(
                "nvidia-fs {}.{} (direct)",
                self.nvfs_major_version, self.nvfs_minor_version
            ),
            Mode::P2pdma => "P2PDMA (direct, upstream kernel PCI P2PDMA)".to_owned(),
            Mode::Compatibility => {
                "compatibility (no nvidia-fs, no P2PDMA: cuFile bounces through host memory)"
                    .to_owned()
            }
            Mode::Unavailable => {
                "none (no nvidia-fs, no P2PDMA, compatibility mode off)".to_owned()
            }
        };
        format!(
            "{mode}; dstatusflags 0x{:x} (NVMe {}), dcontrolflags 0x{:x}, fflags 0x{:x} (batch \
             {}), max_direct_io {} KiB, max_batch_io_size {}",
            self.dstatusflags,
            if self.dstatusflags & STATUS_NVME_SUPPORTED != 0 {
                "yes"
            } else {
                "no"
            },
            self.dcontrolflags,
            self.fflags,
            if self.fflags & FEATURE_BATCH_IO != 0 {
                "yes"
            } else {
                "no"
            },
            self.max_direct_io_size,
            self.max_batch_io_size
        )
    }
}

impl CuFile {
    /// Loads libcufile and opens the driver, once per process.
    pub fn load() -> Result<&'static CuFile> {
        CUFILE
            .get_or_init(Self::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open() -> Result<CuFile> {
        let (path, library) = CANDIDATES
            .into_iter()
            .find_map(|name| Library::open(name).ok().map(|l| (name, l)))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotSupported,
                    "libcufile.so.0 could not be loaded (GPUDirect Storage not installed)",
                )
            })?;
        // Each pointer's type alias spells the C signature of its function in cufile.h.
        let driver_open: DriverOpen = library.symbol("cuFileDriverOpen")?;
        let mut lib = CuFile {
            handle_register: library.symbol("cuFileHandleRegister")?,
            handle_deregister: library.symbol("cuFileHandleDeregister")?,
            buf_register: library.symbol("cuFileBufRegister")?,
            buf_deregister: library.symbol("cuFileBufDeregister")?,
            read: library.symbol("cuFileRead")?,
            write: library.symbol("cuFileWrite")?,
            path,
            props: Err(Error::backend("not read yet")),
            version: None,
            batch: None,
        };
        let opening = std::time::Instant::now();
        // SAFETY: no arguments; opens cuFile's process-wide driver state.
        let st = unsafe { driver_open() };
        if st.err != 0 {
            return Err(cufile_error("cuFileDriverOpen", st));
        }
        tracing::info!(
            "cuFile driver opened ({path}) in {} ms",
            opening.elapsed().as_millis()
        );
        lib.props = library
            .symbol::<GetProperties>("cuFileDriverGetProperties")
            .and_then(|get| {
                // Room for fields newer releases append; the known prefix is read back.
                let mut raw = [0u64; 64];
                // SAFETY: the buffer is larger than any CUfileDrvProps_t.
                let st = unsafe { get(raw.as_mut_ptr().cast()) };
                if st.err != 0 {
                    Err(cufile_error("cuFileDriverGetProperties", st))
                } else {
                    // SAFETY: raw is 8-aligned, larger than DriverProps, and DriverProps is plain data.
                    Ok(unsafe { std::ptr::read(raw.as_ptr().cast::<DriverProps>()) })
                }
            });
        lib.version = library
            .optional::<GetVersion>("cuFileGetVersion")
            .and_then(|f| {
                let mut v = 0;
                // SAFETY: writes one int.
                (unsafe { f(&mut v) }.err == 0).then_some(v)
            });
        lib.batch = batch::BatchFns::resolve(&library);
        Ok(lib)
    }

    /// Registers an open fd; the handle must be deregistered before the fd is closed.
    pub fn register_handle(&'static self, fd: i32) -> Result<CuFileHandle> {
        let mut descr = CuFileDescr {
            kind: CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            _pad: 0,
            fd: fd as i64,
            fs_ops: std::ptr::null(),
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: handle and descr are valid for the call.
        let st = unsafe { (self.handle_register)(&mut handle, &mut descr) };
        if st.err != 0 {
            return Err(cufile_error(&format!("cuFileHandleRegister(fd {fd})"), st).with_fd(fd));
        }
        Ok(CuFileHandle { handle, lib: self })
    }

    /// Registers GPU memory with cuFile (optional: compatibility mode works without it).
    pub fn register_buffer(&'static self, addr: u64, len: u64) -> Result<CuFileBuffer> {
        // SAFETY: the range is registered VRAM that outlives the returned guard.
        let st = unsafe { (self.buf_register)(addr as *const c_void, len as usize, 0) };
        if st.err != 0 {
            return Err(cufile_error(
                &format!("cuFileBufRegister(0x{addr:x}+{len})"),
                st,
            ));
        }
        Ok(CuFileBuffer { addr, lib: self })
    }
}

/// A cuFile file handle.
pub struct CuFileHandle {
    handle: *mut c_void,
    lib: &'static CuFile,
}

// SAFETY: cuFile handles may be used from any thread.
unsafe impl Send for CuFileHandle {}
// SAFETY: as above.
unsafe impl Sync for CuFileHandle {}

impl CuFileHandle {
    /// The raw handle, for the batch API (borrowed: valid while this handle lives).
    pub fn raw(&self) -> batch::RawHandle<'_> {
        batch::RawHandle::new(self.handle)
    }

    /// One synchronous transfer: `len` bytes between `base + buf_offset` and `file_offset`.
    /// Returns the bytes moved (may be short) or the error: the errno text (`context.errno`) or
    /// the cuFile status (`context.vendor`).
    pub fn io(
        &self,
        write: bool,
        base: u64,
        buf_offset: u64,
        len: u64,
        file_offset: u64,
    ) -> Result<u64> {
        // SAFETY: base+buf_offset..+len is registered VRAM kept alive by the request; the handle
        // is live until this struct drops.
        let n = unsafe {
            if write {
                (self.lib.write)(
                    self.handle,
                    base as *const c_void,
                    len as usize,
                    file_offset as i64,
                    buf_offset as i64,
                )
            } else {
                (self.lib.read)(
                    self.handle,
                    base as *mut c_void,
                    len as usize,
                    file_offset as i64,
                    buf_offset as i64,
                )
            }
        };
        match n {
            n if n >= 0 => Ok(n as u64),
            -1 => {
                let err = std::io::Error::last_os_error();
                let e = Error::backend(crate::error::describe_os_error(&err));
                Err(match err.raw_os_error() {
                    Some(code) => e.with_errno(code),
                    None => e,
                })
            }
            n => Err(Error::backend(status_name(-n as i32)).with_vendor("cufile", -n as i64)),
        }
    }
}

impl Drop for CuFileHandle {
    fn drop(&mut self) {
        // SAFETY: deregistering a handle we registered, once.
        unsafe { (self.lib.handle_deregister)(self.handle) }
    }
}

/// A registered GPU buffer.
pub struct CuFileBuffer {
    addr: u64,
    lib: &'static CuFile,
}

impl Drop for CuFileBuffer {
    fn drop(&mut self) {
        // SAFETY: deregistering memory we registered, once.
        let _ = unsafe { (self.lib.buf_deregister)(self.addr as *const c_void) };
    }
}

/// What mode cuFile runs in here (from its driver properties), and whether that is really direct.
/// Opens the driver if no one did yet.
pub fn mode() -> (bool, String) {
    match CuFile::load() {
        Err(e) => (false, format!("cuFile unavailable: {}", e.message)),
        Ok(lib) => match &lib.props {
            Err(why) => (
                false,
                format!("mode unknown ({why}); treated as not direct"),
            ),
            Ok(p) => (
                matches!(p.mode(), Mode::NvidiaFs | Mode::P2pdma),
                p.describe(),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libcufile_is_an_absent_capability_with_a_message() {
        let present = CANDIDATES.iter().any(|n| Library::open(n).is_ok());
        if present {
            return crate::test_support::skip(
                "this machine has libcufile (the GPU tests cover cuFile)",
            );
        }
        let err = CuFile::load().err().expect("no libcufile here");
        assert_eq!(err.kind, ErrorKind::NotSupported);
        assert!(
            err.message.contains("libcufile.so.0 could not be loaded"),
            "{}",
            err.message
        );
    }

    #[test]
    fn cufile_statuses_are_named() {
        assert!(status_name(5027).contains("HANDLE_NOT_REGISTERED"));
        assert!(status_name(5037).contains("BATCH_FULL"));
        assert_eq!(status_name(4242), "cuFile error 4242");
        // Every code of cufile.h from 5001 to 5050 has a name (5021 and 5032 are unassigned).
        for code in (5001..=5050).filter(|c| ![5021, 5032].contains(c)) {
            assert!(!status_name(code).starts_with("cuFile error"), "{code}");
        }
    }

    #[test]
    fn the_mode_comes_from_the_driver_properties() {
        let compat = DriverProps {
            dcontrolflags: CONTROL_ALLOW_COMPAT,
            ..Default::default()
        };
        assert_eq!(compat.mode(), Mode::Compatibility);
        assert!(compat.describe().starts_with("compatibility"));
        let nvfs = DriverProps {
            nvfs_major_version: 2,
            nvfs_minor_version: 17,
            dcontrolflags: CONTROL_ALLOW_COMPAT,
            ..Default::default()
        };
        assert_eq!(nvfs.mode(), Mode::NvidiaFs);
        assert!(nvfs.describe().contains("nvidia-fs 2.17"));
        let p2p = DriverProps {
            dstatusflags: STATUS_NVME_P2P_SUPPORTED | STATUS_NVME_SUPPORTED,
            ..Default::default()
        };
        assert_eq!(p2p.mode(), Mode::P2pdma);
        assert_eq!(DriverProps::default().mode(), Mode::Unavailable);
    }
}
