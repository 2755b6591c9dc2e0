//! Machine / environment description printed at the top of every run, so a saved output is a
//! self-contained record.

use std::ffi::{CStr, CString};
use std::fs;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

fn first_line_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

pub fn cpu_model() -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    first_line_value(&info, "model name").unwrap_or_else(|| "unknown".into())
}

pub fn cpu_count() -> (usize, usize) {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let listed = info.lines().filter(|l| l.starts_with("processor")).count();
    let usable = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    (listed, usable)
}

pub fn mem_total() -> String {
    let info = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    first_line_value(&info, "MemTotal").unwrap_or_else(|| "unknown".into())
}

pub fn kernel() -> String {
    // SAFETY: utsname is plain old data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    let f = |a: &[libc::c_char]| {
        // SAFETY: uname NUL-terminates every field.
        unsafe { CStr::from_ptr(a.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    };
    format!(
        "{} {} {} {}",
        f(&u.sysname),
        f(&u.release),
        f(&u.version),
        f(&u.machine)
    )
}

/// UTC time as `YYYY-MM-DD HH:MM:SS UTC` (days-from-civil inverse, no date crate needed).
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

fn fs_magic_name(magic: i64) -> &'static str {
    match magic as u64 & 0xffff_ffff {
        0xEF53 => "ext2/3/4",
        0x5846_5342 => "xfs",
        0x0102_1994 => "tmpfs",
        0x9123_683E => "btrfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        0xF2F5_2010 => "f2fs",
        0x5346_544E => "ntfs",
        0x0000_4d44 => "vfat",
        0x6462_6720 => "debugfs",
        0x0027_e0eb => "cgroup",
        0x5345_4c46 => "selinuxfs",
        _ => "other",
    }
}

/// Filesystem of `path`: statfs type plus the /proc/self/mounts entry that holds it, and the
/// backing block device's queue properties when there is one.
pub fn filesystem_of(path: &Path) -> String {
    let mut out = String::new();
    if let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) {
        // SAFETY: statfs is plain old data.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid C string and out pointer.
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 {
            out.push_str(&format!(
                "statfs type 0x{:x} ({}), block size {}",
                st.f_type as u64,
                fs_magic_name(st.f_type as i64),
                st.f_bsize
            ));
        }
    }
    let canon = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut best: Option<(usize, String, String, String)> = None;
    for l in mounts.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let mp = f[1].replace("\\040", " ");
        if canon.starts_with(&mp) && best.as_ref().map_or(true, |b| mp.len() >= b.0) {
            best = Some((
                mp.len(),
                format!("{} on {}", f[0], mp),
                f[2].to_string(),
                f[3].to_string(),
            ));
        }
    }
    if let Some((_, dev_mp, fstype, opts)) = best {
        out.push_str(&format!("; mount: {dev_mp} type {fstype} ({opts})"));
        if let Some(dev) = dev_mp
            .split_whitespace()
            .next()
            .and_then(|d| d.strip_prefix("/dev/"))
        {
            let q = Path::new("/sys/class/block").join(dev).join("queue");
            // Partitions have no queue dir of their own: use the parent disk's.
            let q = if q.exists() {
                q
            } else {
                Path::new("/sys/class/block")
                    .join(dev)
                    .join("..")
                    .join("queue")
            };
            let rd = |n: &str| {
                fs::read_to_string(q.join(n))
                    .ok()
                    .map(|s| s.trim().to_string())
            };
            if let Some(rot) = rd("rotational") {
                out.push_str(&format!(
                    "; /dev/{dev}: rotational={rot} scheduler={} max_sectors_kb={} logical_block_size={}",
                    rd("scheduler").unwrap_or_default(),
                    rd("max_sectors_kb").unwrap_or_default(),
                    rd("logical_block_size").unwrap_or_default()
                ));
            }
        }
    }
    out
}

/// The command line, shell-quoted so it can be pasted back.
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Describes a file (plugin .so): resolved path, size, modification time.
pub fn file_desc(p: &Path) -> String {
    match fs::metadata(p) {
        Ok(m) => {
            let target = fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let link = if target != p {
                format!(" -> {}", target.display())
            } else {
                String::new()
            };
            format!(
                "{}{} ({} bytes, mtime {} s since epoch)",
                p.display(),
                link,
                m.len(),
                mtime
            )
        }
        Err(e) => format!("{}: {e}", p.display()),
    }
}

/// Loads libnixl_capi.so the way nixl-sys's stubs will (so a missing library is reported with
/// a clear message instead of the stubs' abort) and returns the path it was found at.
pub fn locate_capi() -> Result<String, String> {
    let name = CString::new("libnixl_capi.so").unwrap();
    // SAFETY: dlopen with a valid C string.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a C string or NULL.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: non-null C string from dlerror.
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(format!(
            "cannot load libnixl_capi.so ({msg}); set LD_LIBRARY_PATH to the NIXL wheel's \
             library dir (source ci/env.sh; iud_nixl_libs)"
        ));
    }
    let sym = CString::new("nixl_capi_create_agent").unwrap();
    // SAFETY: valid handle and symbol name.
    let p = unsafe { libc::dlsym(h, sym.as_ptr()) };
    // SAFETY: Dl_info is plain old data.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr on a symbol address from this library.
    if !p.is_null() && unsafe { libc::dladdr(p, &mut info) } != 0 && !info.dli_fname.is_null() {
        // SAFETY: dli_fname is a C string owned by the loader.
        let f = unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned();
        return Ok(fs::canonicalize(&f)
            .map(|p| p.display().to_string())
            .unwrap_or(f));
    }
    Ok("libnixl_capi.so (path unknown)".into())
}

/// Fraction of the pages of `[0, len)` of `fd` that are in the page cache (mincore).
pub fn page_cache_residency(fd: i32, len: usize) -> Option<f64> {
    if len == 0 {
        return None;
    }
    // SAFETY: read-only shared mapping of a range of an open file.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let page = 4096usize;
    let n = len.div_ceil(page);
    let mut vec = vec![0u8; n];
    // SAFETY: p is a mapping of len bytes; vec has one byte per page.
    let rc = unsafe { libc::mincore(p, len, vec.as_mut_ptr()) };
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, len) };
    if rc != 0 {
        return None;
    }
    Some(vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / n as f64)
}

/// Queue facts of a block device from sysfs (logical block size, max I/O, scheduler, and for
/// loop devices the backing file and whether it is opened with direct I/O).
pub fn block_queue_info(path: &Path) -> String {
    let canon = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let Some(name) = canon
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
    else {
        return "(no sysfs name)".into();
    };
    let base = Path::new("/sys/class/block").join(&name);
    let rd = |rel: &str| {
        fs::read_to_string(base.join(rel))
            .map(|s| s.trim().to_owned())
            .ok()
    };
    let mut parts = vec![name.clone()];
    for (label, rel) in [
        ("logical_block_size", "queue/logical_block_size"),
        ("max_sectors_kb", "queue/max_sectors_kb"),
        ("nr_requests", "queue/nr_requests"),
        ("scheduler", "queue/scheduler"),
        ("loop backing_file", "loop/backing_file"),
        ("loop dio", "loop/dio"),
    ] {
        if let Some(v) = rd(rel) {
            parts.push(format!("{label} {v}"));
        }
    }
    parts.join(", ")
}

/// The machine's host name (uname nodename).
pub fn hostname() -> String {
    // SAFETY: utsname is plain old data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    // SAFETY: uname NUL-terminates every field.
    unsafe { CStr::from_ptr(u.nodename.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}
