//! PID-1 duties when the lab binary is the initramfs's /init: mount devtmpfs/proc/sysfs, make
//! sure stdio is the console, load the modules run-lab.sh packed (udmabuf, nvme, ... where the
//! kernel has them as modules), wait for the NVMe namespace, and power the VM off at the end.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::report::info;

/// Modules to load, one path per line, dependencies first (written by run-lab.sh).
pub const MODULE_LIST: &str = "/lab/modules.list";

pub fn is_pid1() -> bool {
    std::process::id() == 1
}

fn mount(src: &str, target: &str, fstype: &str, data: &str) -> io::Result<()> {
    let _ = std::fs::create_dir_all(target);
    let c = |s: &str| CString::new(s).expect("no NUL in mount arguments");
    let (src, target_c, fstype, data) = (c(src), c(target), c(fstype), c(data));
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target_c.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
    }
    Ok(())
}

/// Points fds 0-2 at /dev/console if the kernel could not open it for us.
fn ensure_console() {
    if crate::util::fd_is_open(1) {
        return;
    }
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors; f stays open until after the loop.
            unsafe { libc::dup2(f.as_raw_fd(), fd) };
        }
    }
}

/// Mounts, console, modules, and a wait (up to 60 s) for `device` to appear.
pub fn setup(device: &str) {
    let _ = mount("devtmpfs", "/dev", "devtmpfs", "mode=0755");
    ensure_console();
    // Start on a fresh line after the firmware's terminal escapes.
    println!();
    for (src, target, fstype) in [
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("tmpfs", "/tmp", "tmpfs"),
    ] {
        if let Err(e) = mount(src, target, fstype, "") {
            info(format!("mount {fstype} on {target}: {e}"));
        }
    }
    load_modules();
    let t0 = Instant::now();
    while std::fs::metadata(device).is_err() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    match std::fs::metadata(device) {
        Ok(_) => info(format!(
            "{device} present after {} ms of waiting",
            t0.elapsed().as_millis()
        )),
        Err(e) => info(format!("{device} did not appear within 60 s: {e}")),
    }
}

fn load_modules() {
    let Ok(list) = std::fs::read_to_string(MODULE_LIST) else {
        info("no modules packed (everything the lab needs is built into this kernel, or absent)");
        return;
    };
    for path in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) => {
                info(format!("module {path}: open: {e}"));
                continue;
            }
        };
        let params = CString::default();
        // SAFETY: finit_module reads the module from our open fd; params is an empty string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        let what = if r == 0 {
            "loaded".to_owned()
        } else {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => "already loaded".to_owned(),
                Some(e) => format!("FAILED: {}", crate::util::errno_str(e)),
                None => "FAILED".to_owned(),
            }
        };
        info(format!("module {path}: {what}"));
    }
}

/// Flushes and powers the VM off (never returns).
pub fn power_off() -> ! {
    // SAFETY: sync and reboot take no pointers; as PID 1 we may power off.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}
