//! The path-mode FILE metaInfo used across NIXL's file backends:
//! `"<ro|rw>[,direct][,sync][,noatime][,create]:<path>"`.
//!
//! Anything that does not start with a valid mode list means fd mode (the devId is an open fd and
//! metaInfo is a free-form label), exactly as NIXL's own file backends read it.

use crate::error::{Error, Result};

/// How the plugin opens a path-mode file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathMeta {
    pub path: String,
    pub writable: bool,
    pub direct: bool,
    pub sync: bool,
    pub noatime: bool,
    pub create: bool,
}

impl PathMeta {
    /// Parses metaInfo; None means fd mode. A valid mode list with an empty path is an error.
    pub fn parse(meta: &str) -> Result<Option<PathMeta>> {
        let Some((modes, path)) = meta.split_once(':') else {
            return Ok(None);
        };
        let mut access = None;
        let mut m = PathMeta {
            path: String::new(),
            writable: false,
            direct: false,
            sync: false,
            noatime: false,
            create: false,
        };
        for token in modes.split(',') {
            match token.trim() {
                "ro" if access.is_none() => access = Some(false),
                "rw" if access.is_none() => access = Some(true),
                "direct" => m.direct = true,
                "sync" => m.sync = true,
                "noatime" => m.noatime = true,
                "create" => m.create = true,
                _ => return Ok(None),
            }
        }
        let Some(writable) = access else {
            return Ok(None);
        };
        if path.is_empty() {
            return Err(Error::invalid(format!(
                "path-mode metaInfo {meta:?} names no file after ':'"
            )));
        }
        m.writable = writable;
        m.path = path.to_owned();
        Ok(Some(m))
    }

    /// open(2) flags for this mode.
    pub fn open_flags(&self) -> libc::c_int {
        let mut flags = libc::O_CLOEXEC
            | if self.writable {
                libc::O_RDWR
            } else {
                libc::O_RDONLY
            };
        if self.direct {
            flags |= libc::O_DIRECT;
        }
        if self.sync {
            flags |= libc::O_SYNC;
        }
        if self.noatime {
            flags |= libc::O_NOATIME;
        }
        if self.create {
            flags |= libc::O_CREAT;
        }
        flags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_mode_list_is_parsed() {
        let m = PathMeta::parse("rw,direct,sync,noatime,create:/tmp/a:b")
            .unwrap()
            .unwrap();
        assert_eq!(m.path, "/tmp/a:b");
        assert!(m.writable && m.direct && m.sync && m.noatime && m.create);
        let f = m.open_flags();
        assert_eq!(f & libc::O_ACCMODE, libc::O_RDWR);
        assert!(f & libc::O_DIRECT != 0 && f & libc::O_CREAT != 0);
    }

    #[test]
    fn read_only_is_the_default_access_of_ro() {
        let m = PathMeta::parse("ro:/data/x").unwrap().unwrap();
        assert!(!m.writable);
        assert_eq!(m.open_flags() & libc::O_ACCMODE, libc::O_RDONLY);
    }

    #[test]
    fn labels_and_empty_meta_mean_fd_mode() {
        for meta in [
            "",
            "kv-cache",
            "label:with colon",
            "direct:/x",
            "ro,rw:/x",
            "rw,bogus:/x",
        ] {
            assert_eq!(PathMeta::parse(meta), Ok(None), "{meta:?}");
        }
    }

    #[test]
    fn empty_path_is_an_error() {
        assert!(PathMeta::parse("rw,create:").is_err());
    }
}
