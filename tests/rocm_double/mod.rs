//! Builds and drives the fake HSA runtime (fake_hsa.c) for the ROCm provider tests.
//!
//! Each variant is compiled once per test process with the system C compiler ($CC, else cc)
//! into Cargo's per-test scratch directory. `instance` copies it to a file name of its own: the
//! dynamic loader gives each distinct path its own copy of the library, so tests that inject
//! faults never see each other's state even when they run in parallel.
#![allow(dead_code)]

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Build variants of the double (see the header of fake_hsa.c).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Variant {
    /// Every entry point, including hsa_amd_portable_export_dmabuf_v2.
    Full,
    /// No _v2 export symbol (ROCm before 7.1).
    NoV2,
    /// No export/close symbols and no DMA-BUF support attribute (old ROCm).
    NoExport,
}

impl Variant {
    fn flag(self) -> Option<&'static str> {
        match self {
            Variant::Full => None,
            Variant::NoV2 => Some("-DFAKE_HSA_NO_V2"),
            Variant::NoExport => Some("-DFAKE_HSA_NO_EXPORT"),
        }
    }
}

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rocm-double");
    std::fs::create_dir_all(&d).expect("create the double's directory");
    d
}

static BUILT: Mutex<Vec<Variant>> = Mutex::new(Vec::new());

/// Compiles `variant` (once per process) and returns the library's path.
pub fn build(variant: Variant) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rocm_double/fake_hsa.c");
    let out = out_dir().join(format!("libfake_hsa_{variant:?}.so"));
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if built.is_empty() {
        // Private copies left by earlier runs (one per test and process) go first.
        for e in std::fs::read_dir(out_dir()).into_iter().flatten().flatten() {
            if !e.file_name().to_string_lossy().starts_with("libfake_hsa_") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    if !built.contains(&variant) {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let tmp = out.with_extension(format!("so.{}", std::process::id()));
        let mut cmd = Command::new(&cc);
        cmd.args([
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fvisibility=hidden",
            "-pthread",
        ]);
        cmd.args(variant.flag());
        cmd.arg("-o").arg(&tmp).arg(&src);
        let o = cmd
            .output()
            .unwrap_or_else(|e| panic!("running {cc} to build the HSA double: {e}"));
        assert!(
            o.status.success(),
            "{cc} failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::rename(&tmp, &out).expect("move the double into place");
        built.push(variant);
    }
    out
}

/// A private copy of `variant` named after `name` (unique per test).
pub fn instance(variant: Variant, name: &str) -> String {
    let lib = build(variant);
    let path = out_dir().join(format!("{name}-{}.so", std::process::id()));
    std::fs::copy(&lib, &path).expect("copy the double");
    path.to_str().expect("utf-8 path").to_owned()
}

/// The double's control functions, resolved from the same loaded copy the provider uses.
pub struct Ctl {
    handle: *mut c_void,
}

impl Ctl {
    pub fn open(path: &str) -> Ctl {
        let c = CString::new(path).unwrap();
        // SAFETY: dlopen of the double; the provider's dlopen of the same path gets this copy.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {path}");
        Ctl { handle }
    }

    fn sym(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).unwrap();
        // SAFETY: dlsym on a handle this struct keeps open.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        assert!(!p.is_null(), "the double lacks {name}");
        p
    }

    /// Makes entry point `func` return `status` from now on (0 clears).
    pub fn fail(&self, func: &str, status: u32) {
        let c = CString::new(func).unwrap();
        // SAFETY: fake_hsa_fail(const char*, uint32_t).
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const std::ffi::c_char, u32)>(
                self.sym("fake_hsa_fail"),
            )(c.as_ptr(), status)
        }
    }

    pub fn set_dmabuf_supported(&self, yes: bool) {
        // SAFETY: fake_hsa_set_dmabuf_supported(int).
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i32)>(
                self.sym("fake_hsa_set_dmabuf_supported"),
            )(yes as i32)
        }
    }

    pub fn set_copy_error(&self, yes: bool) {
        // SAFETY: fake_hsa_set_copy_error(int).
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i32)>(
                self.sym("fake_hsa_set_copy_error"),
            )(yes as i32)
        }
    }

    /// A fake VRAM allocation of `size` bytes (zero-filled).
    pub fn alloc_vram(&self, size: usize) -> u64 {
        // SAFETY: fake_hsa_alloc_vram(size_t) -> void*.
        let p = unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(usize) -> *mut c_void>(
                self.sym("fake_hsa_alloc_vram"),
            )(size)
        };
        assert!(!p.is_null(), "fake_hsa_alloc_vram({size})");
        p as u64
    }

    pub fn free_vram(&self, addr: u64) {
        // SAFETY: fake_hsa_free_vram(void*) -> int.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void) -> i32>(
                self.sym("fake_hsa_free_vram"),
            )(addr as *mut c_void)
        };
        assert_eq!(rc, 0, "free_vram(0x{addr:x})");
    }

    fn count(&self, name: &str) -> i32 {
        // SAFETY: the counters are `int f(void)`.
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> i32>(self.sym(name))()
        }
    }

    /// DMA-BUF fds exported and not yet given back through hsa_amd_portable_close_dmabuf.
    pub fn open_exports(&self) -> i32 {
        self.count("fake_hsa_open_exports")
    }

    /// Host ranges currently locked.
    pub fn locked_ranges(&self) -> i32 {
        self.count("fake_hsa_locked_ranges")
    }

    pub fn refcount(&self) -> i32 {
        self.count("fake_hsa_refcount")
    }
}
