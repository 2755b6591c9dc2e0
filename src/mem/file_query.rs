//! queryMem for FILE descriptors: does the file named by metaInfo exist, and its size.
//!
//! Answered the way NIXL's own file backends answer it (NIXL src/utils/file/file_utils.cpp,
//! queryFileInfo, used by POSIX, GDS, GDS_MT and HF3FS queryMem): metaInfo is the file name;
//! stat() it; no such file (or an empty name) is "not found" (std::nullopt), else the answer
//! holds "size", "mode" and "mtime" as decimal strings. In addition a path-mode metaInfo
//! ("rw,create:/p") that names no file as it stands is looked up by its path, so a client can
//! query with the same metaInfo it registers with.

use std::os::unix::fs::MetadataExt;

use crate::mem::path_meta::PathMeta;

/// What stat() says about a file (st_size, st_mode, st_mtime).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    pub size: u64,
    pub mode: u32,
    pub mtime: i64,
}

/// The answer for one descriptor's metaInfo; None = not found.
pub fn query(meta_info: &str) -> Option<FileInfo> {
    if meta_info.is_empty() {
        return None;
    }
    stat(meta_info).or_else(|| match PathMeta::parse(meta_info) {
        Ok(Some(pm)) => stat(&pm.path),
        _ => None,
    })
}

fn stat(path: &str) -> Option<FileInfo> {
    std::fs::metadata(path).ok().map(|m| FileInfo {
        size: m.size(),
        mode: m.mode(),
        mtime: m.mtime(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_missing_empty_and_path_mode() {
        let dir = std::env::temp_dir().join(format!("iud-query-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("kv.bin");
        std::fs::write(&f, vec![7u8; 12345]).unwrap();
        let p = f.to_str().unwrap();
        let info = query(p).expect("exists");
        assert_eq!(info.size, 12345);
        assert_eq!(info.mode & 0o170000, 0o100000, "a regular file");
        assert_eq!(
            query(&format!("rw,create:{p}")).map(|i| i.size),
            Some(12345)
        );
        assert_eq!(query(dir.join("absent").to_str().unwrap()), None);
        assert_eq!(query(""), None);
        assert_eq!(query("ro:"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
