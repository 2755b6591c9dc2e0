//! Serving under another backend's name: which name an engine serves, the parameters that
//! name's callers pass mapped onto ours, and the memory kinds that name reports.
//!
//! NIXL keys plugins by file name, so this library installed as `libplugin_GDS_MT.so` is what
//! `create_backend("GDS_MT")` instantiates (NIXL src/core/nixl_plugin_manager.cpp,
//! composePluginPath). The name an engine serves is the backend type NIXL hands to the engine
//! (nixlBackendInitParams::type); before any engine exists (get_plugin_params /
//! get_plugin_mems) it is read off the library's own file name through dladdr. Copies of the
//! library are separate instances (the installer copies); a symlink to an already loaded copy
//! shares that copy's instance, and with it the plugin-level answer of the first name.
//!
//! Callers of an aliased name keep their routing: the engine reports the memory kinds NIXL's
//! own backend of that name reports (1.5.1: POSIX DRAM+FILE, GDS and GDS_MT DRAM+VRAM+FILE),
//! so an agent that holds other backends too sends the same requests to it as before.

use std::collections::HashSet;
use std::ffi::CStr;
use std::sync::Mutex;

use once_cell::sync::Lazy;

use super::manifest;

/// nixl_mem_t numbers (nixl-headers/nixl_abi.h).
const DRAM: i32 = 0;
const VRAM: i32 = 1;
const FILE: i32 = 4;

/// How one of the aliased backend's parameters becomes one of ours.
#[derive(Debug, Clone, Copy)]
enum Map {
    /// Same meaning: an unsigned count, clamped into our parameter's valid range
    /// (params/readers.rs: ring_entries 16..32768, cufile_threads 1..64, max_io_size 0 or >= 4096);
    /// 0 means "that backend's default" and leaves ours alone.
    Count { to: &'static str, lo: u64, hi: u64 },
    /// No meaning here (queue choice, request pools, cuFile batch sizes).
    Ignore,
}

struct Alias {
    name: &'static str,
    mems: &'static [i32],
    params: &'static [(&'static str, Map)],
}

/// The names clients hard-code, with their 1.5.1 parameters (POSIX posix_backend.cpp
/// getIoQueueType/ios_pool_size/kernel_queue_size; GDS_MT thread_count; GDS batch_pool_size,
/// batch_limit, max_request_size).
const ALIASES: &[Alias] = &[
    Alias {
        name: "POSIX",
        mems: &[DRAM, FILE],
        params: &[
            ("use_uring", Map::Ignore),
            ("use_aio", Map::Ignore),
            ("use_posix_aio", Map::Ignore),
            ("ios_pool_size", Map::Ignore),
            (
                "kernel_queue_size",
                Map::Count {
                    to: "ring_entries",
                    lo: 16,
                    hi: 32768,
                },
            ),
        ],
    },
    Alias {
        name: "GDS_MT",
        mems: &[DRAM, VRAM, FILE],
        params: &[(
            "thread_count",
            Map::Count {
                to: "cufile_threads",
                lo: 1,
                hi: 64,
            },
        )],
    },
    Alias {
        name: "GDS",
        mems: &[DRAM, VRAM, FILE],
        params: &[
            ("batch_pool_size", Map::Ignore),
            ("batch_limit", Map::Ignore),
            (
                "max_request_size",
                Map::Count {
                    to: "max_io_size",
                    lo: 4096,
                    hi: u64::MAX,
                },
            ),
        ],
    },
];

fn alias(name: &str) -> Option<&'static Alias> {
    ALIASES.iter().find(|a| a.name == name)
}

/// Memory kinds an engine serving `name` reports.
pub fn mems_for(name: &str) -> &'static [i32] {
    alias(name).map_or(&manifest::MEMS[..], |a| a.mems)
}

/// The name NIXL gives a library file: `libplugin_<NAME>.so`; None for any other file name
/// (e.g. cargo's libio_uring_dmabuf.so loaded directly).
pub fn name_from_library_path(path: &str) -> Option<&str> {
    let file = path.rsplit('/').next()?;
    file.strip_prefix("libplugin_")?
        .strip_suffix(".so")
        .filter(|n| !n.is_empty())
}

/// Path this library was loaded from, as the dynamic linker recorded it.
pub fn own_library_path() -> Option<String> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the address (a function of this library) and fills `info`.
    let ok = unsafe { libc::dladdr(own_library_path as *const libc::c_void, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialised; dli_fname is null or a C string owned
    // by the dynamic linker for as long as the library is loaded.
    let fname = unsafe { info.assume_init() }.dli_fname;
    (!fname.is_null()).then(|| {
        // SAFETY: checked non-null; see above.
        unsafe { CStr::from_ptr(fname) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The name this library instance answers to before any engine exists.
pub fn library_name() -> &'static str {
    static NAME: Lazy<String> = Lazy::new(|| {
        own_library_path()
            .and_then(|p| name_from_library_path(&p).map(str::to_owned))
            .unwrap_or_else(|| manifest::PLUGIN_NAME.to_owned())
    });
    &NAME
}

/// Logs once per process and name that this plugin serves `name` (a warning: the real backend
/// of that name is not used in this process, which its user should be able to see).
pub fn announce(name: &str) {
    static SEEN: Lazy<Mutex<HashSet<String>>> = Lazy::new(|| Mutex::new(HashSet::new()));
    if name == manifest::PLUGIN_NAME {
        return;
    }
    let first = SEEN
        .lock()
        .map(|mut s| s.insert(name.to_owned()))
        .unwrap_or(false);
    if first {
        let file = own_library_path().unwrap_or_else(|| "?".into());
        tracing::warn!(
            "{} serving as {name} (NIXL loaded {file} for create_backend({name:?}); NIXL's own \
             {name} is not used in this process)",
            manifest::PLUGIN_NAME
        );
    }
}

/// The parameters for our engine from what a caller of `name` passed: our own keys as they are
/// (they win), the aliased backend's keys mapped where they mean something here, the rest of
/// that backend's keys dropped with one debug line. Keys nobody knows pass through, so the
/// parameter parser reports them as it always does.
pub fn translate(name: &str, pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    let Some(a) = alias(name) else { return pairs };
    let own = |k: &str| manifest::param(k).is_some();
    let mut out: Vec<(String, String)> = Vec::with_capacity(pairs.len());
    let (mut mapped, mut dropped) = (Vec::new(), Vec::new());
    for (k, v) in &pairs {
        match a.params.iter().find(|(p, _)| p == k).map(|(_, m)| *m) {
            None => out.push((k.clone(), v.clone())),
            Some(Map::Ignore) => dropped.push(format!("{k}={v}")),
            Some(Map::Count { to, lo, hi }) => match v.trim().parse::<u64>() {
                Ok(0) => dropped.push(format!("{k}=0 (that backend's default)")),
                Ok(n) if !pairs.iter().any(|(o, _)| o == to) && own(to) => {
                    let c = n.clamp(lo, hi);
                    mapped.push(format!("{k}={n} -> {to}={c}"));
                    out.push((to.to_owned(), c.to_string()));
                }
                Ok(_) => dropped.push(format!("{k}={v} ({to} given explicitly)")),
                Err(_) => dropped.push(format!("{k}={v:?} (not a count)")),
            },
        }
    }
    if !mapped.is_empty() {
        tracing::debug!("{name} parameters mapped: {}", mapped.join(", "));
    }
    if !dropped.is_empty() {
        tracing::debug!(
            "{name} parameters without a meaning for {}, ignored: {}",
            manifest::PLUGIN_NAME,
            dropped.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn names_come_from_nixl_plugin_file_names() {
        assert_eq!(
            name_from_library_path("/x/plugins/libplugin_GDS_MT.so"),
            Some("GDS_MT")
        );
        assert_eq!(name_from_library_path("libplugin_POSIX.so"), Some("POSIX"));
        assert_eq!(
            name_from_library_path("/t/release/libio_uring_dmabuf.so"),
            None
        );
        assert_eq!(name_from_library_path("/x/libplugin_.so"), None);
    }

    #[test]
    fn nixlbench_posix_parameters_map_onto_the_ring() {
        let out = translate(
            "POSIX",
            kv(&[
                ("use_aio", "false"),
                ("use_uring", "true"),
                ("use_posix_aio", "false"),
                ("ios_pool_size", "65536"),
                ("kernel_queue_size", "256"),
            ]),
        );
        assert_eq!(out, kv(&[("ring_entries", "256")]));
        assert_eq!(
            translate("POSIX", kv(&[("kernel_queue_size", "4")])),
            kv(&[("ring_entries", "16")])
        );
    }

    #[test]
    fn own_keys_win_and_unknown_keys_pass_through() {
        let out = translate(
            "POSIX",
            kv(&[
                ("kernel_queue_size", "64"),
                ("ring_entries", "1024"),
                ("file_path", "/x"),
            ]),
        );
        assert_eq!(out, kv(&[("ring_entries", "1024"), ("file_path", "/x")]));
        assert_eq!(
            translate("IO_URING_DMABUF", kv(&[("thread_count", "8")])),
            kv(&[("thread_count", "8")])
        );
    }

    #[test]
    fn gds_mt_threads_and_gds_request_size() {
        assert_eq!(
            translate("GDS_MT", kv(&[("thread_count", "8")])),
            kv(&[("cufile_threads", "8")])
        );
        assert_eq!(
            translate("GDS_MT", kv(&[("thread_count", "500")])),
            kv(&[("cufile_threads", "64")])
        );
        assert_eq!(translate("GDS_MT", kv(&[("thread_count", "0")])), kv(&[]));
        assert_eq!(
            translate("GDS_MT", kv(&[("thread_count", "many")])),
            kv(&[])
        );
        let gds = translate(
            "GDS",
            kv(&[
                ("batch_pool_size", "32"),
                ("batch_limit", "128"),
                ("max_request_size", "16777216"),
            ]),
        );
        assert_eq!(gds, kv(&[("max_io_size", "16777216")]));
    }

    #[test]
    fn aliases_report_the_kinds_of_the_backend_they_stand_in_for() {
        assert_eq!(mems_for("POSIX"), &[DRAM, FILE]);
        assert_eq!(mems_for("GDS_MT"), &[DRAM, VRAM, FILE]);
        assert_eq!(mems_for("IO_URING_DMABUF"), &manifest::MEMS[..]);
        assert_eq!(mems_for("SOMETHING_ELSE"), &manifest::MEMS[..]);
        for a in ALIASES {
            assert!(
                a.mems.iter().all(|m| manifest::MEMS.contains(m)),
                "{} reports a kind we lack",
                a.name
            );
        }
    }
}
