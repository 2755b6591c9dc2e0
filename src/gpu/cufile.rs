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

use std::ffi::{c_void, CString};

use once_cell::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};

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

/// The loaded library with the driver open (once per process; never closed, since cuFile's
/// driver is process-wide and other users in the process may share it).
pub struct CuFile {
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    buf_register: BufRegister,
    buf_deregister: BufDeregister,
    read: ReadFn,
    write: WriteFn,
    pub path: &'static str,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for CuFile {}
// SAFETY: as above; cuFile's API is thread-safe.
unsafe impl Sync for CuFile {}

static CUFILE: OnceCell<std::result::Result<CuFile, Error>> = OnceCell::new();

/// The names a cuFile install answers to, most specific first.
const CANDIDATES: [&str; 3] = ["libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0"];

/// Human-readable cuFile status (the codes NIXL users meet most).
pub fn status_name(code: i32) -> String {
    let name = match code {
        5001 => "DRIVER_NOT_INITIALIZED (nvidia-fs not loaded and compatibility mode off)",
        5007 => "PLATFORM_NOT_SUPPORTED",
        5011 => "CUDA_DRIVER_ERROR",
        5012 => "CUDA_POINTER_INVALID",
        5018 => "INVALID_FILE_TYPE",
        5019 => "INVALID_FILE_OPEN_FLAG",
        5020 => "DIO_NOT_SET",
        5022 => "INVALID_VALUE",
        5023 => "MEMORY_ALREADY_REGISTERED",
        5027 => "HANDLE_NOT_REGISTERED (on machines without udevd cuFile finds no ID_FS_USAGE for the disk; see ci/gpu/udev-shim.sh)",
        5028 => "HANDLE_ALREADY_REGISTERED",
        5030 => "INTERNAL_ERROR",
        _ => return format!("cuFile error {code}"),
    };
    format!("{code} {name}")
}

impl CuFile {
    /// Loads libcufile and opens the driver, once per process.
    pub fn load() -> Result<&'static CuFile> {
        CUFILE.get_or_init(Self::open).as_ref().map_err(Clone::clone)
    }

    fn open() -> Result<CuFile> {
        let mut found = None;
        for name in CANDIDATES {
            let c = CString::new(name).expect("no NUL");
            // SAFETY: dlopen of a library name; RTLD_LOCAL keeps its symbols private.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !h.is_null() {
                found = Some((name, h));
                break;
            }
        }
        let (path, h) = found.ok_or_else(|| Error::new(ErrorKind::NotSupported, "libcufile.so.0 could not be loaded (GPUDirect Storage not installed)"))?;
        let sym = |s: &str| -> Result<*mut c_void> {
            let c = CString::new(s).expect("no NUL");
            // SAFETY: dlsym on a handle that stays open.
            let p = unsafe { libc::dlsym(h, c.as_ptr()) };
            if p.is_null() {
                Err(Error::new(ErrorKind::NotSupported, format!("{path} lacks {s}")))
            } else {
                Ok(p)
            }
        };
        // SAFETY: cuFileDriverOpen has this C signature in cufile.h.
        let driver_open: unsafe extern "C" fn() -> CuFileError = unsafe { std::mem::transmute(sym("cuFileDriverOpen")?) };
        // SAFETY: each symbol has the C signature named by its type alias, as in cufile.h.
        let lib = unsafe {
            CuFile {
                handle_register: std::mem::transmute::<*mut c_void, HandleRegister>(sym("cuFileHandleRegister")?),
                handle_deregister: std::mem::transmute::<*mut c_void, HandleDeregister>(sym("cuFileHandleDeregister")?),
                buf_register: std::mem::transmute::<*mut c_void, BufRegister>(sym("cuFileBufRegister")?),
                buf_deregister: std::mem::transmute::<*mut c_void, BufDeregister>(sym("cuFileBufDeregister")?),
                read: std::mem::transmute::<*mut c_void, ReadFn>(sym("cuFileRead")?),
                write: std::mem::transmute::<*mut c_void, WriteFn>(sym("cuFileWrite")?),
                path,
            }
        };
        // SAFETY: no arguments; opens cuFile's process-wide driver state.
        let st = unsafe { driver_open() };
        if st.err != 0 {
            return Err(Error::backend(format!("cuFileDriverOpen failed: {}", status_name(st.err))));
        }
        Ok(lib)
    }

    /// Registers an open fd; the handle must be deregistered before the fd is closed.
    pub fn register_handle(&'static self, fd: i32) -> Result<CuFileHandle> {
        let mut descr = CuFileDescr { kind: CU_FILE_HANDLE_TYPE_OPAQUE_FD, _pad: 0, fd: fd as i64, fs_ops: std::ptr::null() };
        let mut handle = std::ptr::null_mut();
        // SAFETY: handle and descr are valid for the call.
        let st = unsafe { (self.handle_register)(&mut handle, &mut descr) };
        if st.err != 0 {
            return Err(Error::backend(format!("cuFileHandleRegister(fd {fd}) failed: {}", status_name(st.err))));
        }
        Ok(CuFileHandle { handle, lib: self })
    }

    /// Registers GPU memory with cuFile (optional: compatibility mode works without it).
    pub fn register_buffer(&'static self, addr: u64, len: u64) -> Result<CuFileBuffer> {
        // SAFETY: the range is registered VRAM that outlives the returned guard.
        let st = unsafe { (self.buf_register)(addr as *const c_void, len as usize, 0) };
        if st.err != 0 {
            return Err(Error::backend(format!("cuFileBufRegister(0x{addr:x}+{len}) failed: {}", status_name(st.err))));
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
    /// One synchronous transfer: `len` bytes between `base + buf_offset` and `file_offset`.
    /// Returns the bytes moved (may be short) or the error.
    pub fn io(&self, write: bool, base: u64, buf_offset: u64, len: u64, file_offset: u64) -> std::result::Result<u64, String> {
        // SAFETY: base+buf_offset..+len is registered VRAM kept alive by the request; the handle
        // is live until this struct drops.
        let n = unsafe {
            if write {
                (self.lib.write)(self.handle, base as *const c_void, len as usize, file_offset as i64, buf_offset as i64)
            } else {
                (self.lib.read)(self.handle, base as *mut c_void, len as usize, file_offset as i64, buf_offset as i64)
            }
        };
        match n {
            n if n >= 0 => Ok(n as u64),
            -1 => Err(crate::error::describe_os_error(&std::io::Error::last_os_error())),
            n => Err(status_name(-n as i32)),
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

/// What mode cuFile would run in on this machine, and whether that is really direct.
pub fn mode() -> (bool, &'static str) {
    if std::path::Path::new("/proc/driver/nvidia-fs").exists() {
        return (true, "nvidia-fs (direct)");
    }
    let p2pdma = std::fs::read_to_string("/proc/kallsyms").map(|k| k.contains("p2pdma_pgmap_ops")).unwrap_or(false);
    if p2pdma {
        (false, "P2PDMA kernel support present; direct only if cufile.json enables use_pci_p2pdma on local NVMe")
    } else {
        (false, "compatibility (no nvidia-fs, no kernel P2PDMA): cuFile bounces through host memory")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libcufile_is_an_absent_capability_with_a_message() {
        let present = CANDIDATES.iter().any(|n| {
            let c = CString::new(*n).unwrap();
            // SAFETY: dlopen/dlclose of a library name, only to see whether it exists.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !h.is_null() {
                // SAFETY: closing the handle opened above.
                unsafe { libc::dlclose(h) };
            }
            !h.is_null()
        });
        if present {
            println!("SKIP missing-libcufile: this machine has libcufile (the GPU tests cover cuFile)");
            return;
        }
        let err = CuFile::load().err().expect("no libcufile here");
        assert_eq!(err.kind, ErrorKind::NotSupported);
        assert!(err.message.contains("libcufile.so.0 could not be loaded"), "{}", err.message);
    }

    #[test]
    fn cufile_statuses_are_named() {
        assert!(status_name(5027).contains("HANDLE_NOT_REGISTERED"));
        assert_eq!(status_name(4242), "cuFile error 4242");
    }
}
