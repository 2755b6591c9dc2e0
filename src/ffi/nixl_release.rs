//! Which NIXL release loaded the plugin, and whether the plugin serves it.
//!
//! NIXL checks only `api_version == 1` when it loads a plugin, and that number stayed 1 while the
//! engine vtable changed (0.10.1 has 31 slots, 1.3-1.5 have 27): a plugin built for one layout is
//! called through the wrong slots by another. So the plugin reads the runtime's version itself:
//! the string libnixl_common.so embeds after "NIXL version: " (nixl_log.cpp logs it at start-up),
//! found in that library's mapped read-only segments, once, at the first `nixl_plugin_init`.
//!
//! Policy (docs/nixl-releases.md): a release of a line in `NIXL_ABI_LINES` loads, with a warning
//! when it is not one of `NIXL_VERSIONS_TESTED`; a release of any other line is refused (the plugin
//! returns no plugin struct, NIXL reports the backend as not found) unless
//! `IO_URING_DMABUF_ALLOW_UNTESTED_NIXL=1`; a libnixl_common.so without a readable version string
//! loads with a warning that the release could not be checked; a process with no NIXL library
//! (the project's C++ test driver) loads with an info line: there is nothing to compare, and
//! refusing would only break hosts that are not NIXL.

use std::ffi::{c_int, c_void, CStr};

use once_cell::sync::Lazy;

use super::manifest::{NIXL_ABI_LINES, NIXL_VERSIONS_TESTED, PLUGIN_NAME};

/// The environment variable that loads the plugin under a release line it was not verified for.
pub const ALLOW_UNTESTED: &str = "IO_URING_DMABUF_ALLOW_UNTESTED_NIXL";

const MARKER: &[u8] = b"NIXL version: \0";

/// The NIXL runtime found in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    pub version: String,
    /// The loaded object the version was read from.
    pub library: String,
}

/// What the plugin makes of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// One of the releases CI runs the plugin on.
    Tested,
    /// Another release of a line whose ABI was verified.
    LineVerified,
    /// A release of a line whose ABI was not verified.
    Unverified,
}

/// The release line ("1.5") of a version ("1.5.1", "1.5.2rc1").
pub fn release_line(version: &str) -> Option<String> {
    let mut parts = version.splitn(3, '.');
    let major = parts
        .next()
        .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))?;
    let minor = parts
        .next()
        .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))?;
    Some(format!("{major}.{minor}"))
}

pub fn classify(version: &str) -> Verdict {
    if NIXL_VERSIONS_TESTED.contains(&version) {
        Verdict::Tested
    } else if release_line(version).is_some_and(|l| NIXL_ABI_LINES.contains(&l.as_str())) {
        Verdict::LineVerified
    } else {
        Verdict::Unverified
    }
}

/// The first version string that follows a marker in `bytes` and looks like one
/// (`<digits>.<digits>.<digits>` and an optional suffix such as `rc1`).
pub fn version_after_marker(bytes: &[u8]) -> Option<&str> {
    let mut from = 0;
    while let Some(k) = bytes[from..]
        .windows(MARKER.len())
        .position(|w| w == MARKER)
    {
        let at = from + k + MARKER.len();
        if let Some(v) = version_at(&bytes[at..bytes.len().min(at + 64)]) {
            return Some(v);
        }
        from = at;
    }
    None
}

fn version_at(rest: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(&rest[..rest.iter().position(|&b| b == 0)?]).ok()?;
    let numeric: Vec<&str> = text.splitn(3, '.').collect();
    let ok = numeric.len() == 3
        && numeric[..2]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        && numeric[2]
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_digit())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-._".contains(&b));
    ok.then_some(text)
}

struct Search<'a> {
    wanted: &'a dyn Fn(&str) -> bool,
    found: Option<Runtime>,
    /// The first wanted object, whether or not it held a version string.
    seen: Option<String>,
}

unsafe extern "C" fn visit(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the `Search` scan_loaded passed to dl_iterate_phdr, alive for the call.
    let search = unsafe { &mut *(data as *mut Search) };
    // SAFETY: the dynamic linker passes a valid dl_phdr_info for the duration of the callback.
    let info = unsafe { &*info };
    let name = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: dlpi_name is a C string owned by the dynamic linker.
        unsafe { CStr::from_ptr(info.dlpi_name) }
            .to_string_lossy()
            .into_owned()
    };
    if !(search.wanted)(&name) {
        return 0;
    }
    search.seen.get_or_insert_with(|| name.clone());
    for i in 0..info.dlpi_phnum as usize {
        // SAFETY: dlpi_phdr points at dlpi_phnum program headers.
        let ph = unsafe { &*info.dlpi_phdr.add(i) };
        if ph.p_type != libc::PT_LOAD
            || ph.p_flags & libc::PF_R == 0
            || ph.p_flags & libc::PF_W != 0
        {
            continue;
        }
        let start = (info.dlpi_addr + ph.p_vaddr) as *const u8;
        // SAFETY: a loaded, readable, non-writable segment stays mapped while its object is
        // loaded (NIXL's libraries are never unloaded while a plugin of theirs runs), and
        // p_filesz bytes of it come from the file.
        let bytes = unsafe { std::slice::from_raw_parts(start, ph.p_filesz as usize) };
        if let Some(v) = version_after_marker(bytes) {
            search.found = Some(Runtime {
                version: v.to_owned(),
                library: name,
            });
            return 1;
        }
    }
    0
}

/// The first loaded object `wanted` accepts (by path; "" is the main program) that embeds a
/// NIXL version string, and that version.
pub fn scan_loaded(wanted: &dyn Fn(&str) -> bool) -> Option<Runtime> {
    scan(wanted).0
}

/// The version found, and the first wanted object seen (with or without a version).
fn scan(wanted: &dyn Fn(&str) -> bool) -> (Option<Runtime>, Option<String>) {
    let mut search = Search {
        wanted,
        found: None,
        seen: None,
    };
    // SAFETY: visit only reads the headers and segments the dynamic linker reports.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search as *mut c_void) };
    (search.found, search.seen)
}

/// What this process holds of NIXL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Release(Runtime),
    /// libnixl_common.so is loaded, but no version string could be read from it.
    Unreadable(String),
    /// No NIXL library (a host that is not NIXL, or NIXL linked statically without the string).
    Nothing,
}

/// The NIXL runtime of this process: the wheel's (or a source build's) libnixl_common.so, else a
/// program NIXL is linked into statically.
pub fn find_runtime() -> Found {
    let common = |p: &str| {
        p.rsplit('/')
            .next()
            .is_some_and(|f| f.starts_with("libnixl_common"))
    };
    match scan(&common) {
        (Some(rt), _) => Found::Release(rt),
        (None, Some(lib)) => Found::Unreadable(lib),
        (None, None) => scan_loaded(&|p: &str| p.is_empty()).map_or(Found::Nothing, Found::Release),
    }
}

/// Whether the plugin may hand NIXL its plugin struct. Decided and logged once per process.
pub fn admit() -> bool {
    static ADMIT: Lazy<bool> = Lazy::new(|| {
        decide(
            find_runtime(),
            std::env::var(ALLOW_UNTESTED).is_ok_and(|v| v == "1"),
        )
    });
    *ADMIT
}

fn decide(found: Found, allow_untested: bool) -> bool {
    let lines = NIXL_ABI_LINES.join(", ");
    let tested = NIXL_VERSIONS_TESTED.join(", ");
    let rt = match found {
        Found::Release(rt) => rt,
        Found::Nothing => {
            tracing::info!(
                "{PLUGIN_NAME}: no NIXL library in this process; loading with the NIXL {lines} \
                 plugin ABI"
            );
            return true;
        }
        // A warning, not a refusal: the string is the plugin's only way to tell releases apart,
        // and a build that merged or dropped it is not evidence of another ABI.
        Found::Unreadable(lib) => {
            tracing::warn!(
                "{PLUGIN_NAME}: no NIXL version string found in {lib}, so the release cannot be \
                 checked; loading with the NIXL {lines} plugin ABI (tested: {tested})"
            );
            return true;
        }
    };
    let (v, lib) = (&rt.version, &rt.library);
    match classify(v) {
        Verdict::Tested => {
            tracing::debug!("{PLUGIN_NAME}: NIXL {v} ({lib}), a tested release");
            true
        }
        Verdict::LineVerified => {
            tracing::warn!(
                "{PLUGIN_NAME}: NIXL {v} ({lib}) is not one of the releases tested ({tested}); \
                 its release line has the plugin ABI this plugin is built for, so it loads"
            );
            true
        }
        Verdict::Unverified if allow_untested => {
            tracing::warn!(
                "{PLUGIN_NAME}: NIXL {v} ({lib}) is not of a release line this plugin was \
                 verified for ({lines}); loading anyway because {ALLOW_UNTESTED}=1: a changed \
                 plugin ABI would corrupt memory"
            );
            true
        }
        Verdict::Unverified => {
            tracing::error!(
                "{PLUGIN_NAME}: NIXL {v} ({lib}) is not of a release line this plugin was \
                 verified for ({lines}); NIXL does not check a plugin's vtable, so the plugin \
                 refuses to load (create_backend reports it not found). Use NIXL {tested}, or set \
                 {ALLOW_UNTESTED}=1 to load it anyway"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_after_the_marker_only_when_they_look_like_versions() {
        assert_eq!(
            version_after_marker(b"xx\0NIXL version: \x001.5.1\0 (git: \x001d2a52eb\0"),
            Some("1.5.1")
        );
        assert_eq!(
            version_after_marker(b"NIXL version: \x001.5.2rc1\0"),
            Some("1.5.2rc1")
        );
        assert_eq!(version_after_marker(b"NIXL version: \0 (git: \0"), None);
        assert_eq!(version_after_marker(b"NIXL version: \x001.5\0"), None);
        assert_eq!(
            version_after_marker(b"NIXL version: \x001.5.1"),
            None,
            "no terminating NUL"
        );
        assert_eq!(
            version_after_marker(b"NIXL version: 1.5.1\0"),
            None,
            "marker without its NUL"
        );
        assert_eq!(
            version_after_marker(b"NIXL version: \0%s\0NIXL version: \x001.3.2\0"),
            Some("1.3.2"),
            "a later marker"
        );
    }

    #[test]
    fn releases_are_classified_by_the_manifest() {
        for v in NIXL_VERSIONS_TESTED {
            assert_eq!(classify(v), Verdict::Tested, "{v}");
        }
        assert_eq!(classify("1.3.0"), Verdict::LineVerified);
        assert_eq!(classify("1.5.2"), Verdict::LineVerified);
        assert_eq!(classify("1.6.0"), Verdict::Unverified);
        assert_eq!(classify("0.10.1"), Verdict::Unverified);
        assert_eq!(classify("junk"), Verdict::Unverified);
        assert_eq!(release_line("1.15.0"), Some("1.15".into()));
        assert_eq!(release_line("1"), None);
    }

    #[test]
    fn only_unverified_lines_are_refused_and_the_override_admits_them() {
        let rt = |v: &str| {
            Found::Release(Runtime {
                version: v.into(),
                library: "/x/libnixl_common.so".into(),
            })
        };
        assert!(decide(rt("1.5.1"), false));
        assert!(decide(rt("1.4.0"), false));
        assert!(!decide(rt("0.10.1"), false));
        assert!(decide(rt("0.10.1"), true));
        assert!(decide(Found::Nothing, false));
        assert!(decide(
            Found::Unreadable("/x/libnixl_common.so".into()),
            false
        ));
    }

    // A version string in this test program's own read-only data, found the way the plugin finds
    // NIXL's: through the loaded objects' program headers.
    #[used]
    static EMBEDDED: [u8; 30] = *b"NIXL version: \09.8.7\0 (git: \0\0";

    #[test]
    fn the_loaded_objects_are_scanned() {
        // The first valid string in this program's read-only segments: EMBEDDED, or one of the
        // literals of the test above (the linker decides their order).
        let found =
            scan_loaded(&|p: &str| p.is_empty()).expect("this program's own version string");
        assert!(
            ["9.8.7", "1.5.1", "1.5.2rc1", "1.3.2"].contains(&found.version.as_str()),
            "{found:?}"
        );
        assert_eq!(found.library, "");
        assert_eq!(
            scan_loaded(&|p: &str| p.ends_with("/no-such-object.so")),
            None
        );
    }
}
