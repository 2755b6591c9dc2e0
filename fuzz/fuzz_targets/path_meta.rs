//! Path-mode FILE metaInfo parser ("<ro|rw>[,direct][,sync][,noatime][,create]:<path>").
//! Oracles: never panics; a parsed path is exactly the text after the first ':' and is not
//! empty; exactly one access mode; open(2) flags agree with the parsed fields; an error only for
//! a valid mode list with an empty path; fd mode (None) otherwise.
#![no_main]

use io_uring_dmabuf::mem::path_meta::PathMeta;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(meta) = std::str::from_utf8(data) else {
        return;
    };
    match PathMeta::parse(meta) {
        Ok(Some(m)) => {
            let (modes, path) = meta.split_once(':').expect("path mode needs ':'");
            assert_eq!(m.path, path);
            assert!(!m.path.is_empty());
            let tokens: Vec<&str> = modes.split(',').map(str::trim).collect();
            assert_eq!(
                tokens.iter().filter(|t| **t == "ro" || **t == "rw").count(),
                1,
                "{meta:?}"
            );
            assert_eq!(m.writable, tokens.contains(&"rw"));
            assert_eq!(m.direct, tokens.contains(&"direct"));
            assert_eq!(m.create, tokens.contains(&"create"));
            let f = m.open_flags();
            assert_eq!(
                f & libc::O_ACCMODE,
                if m.writable {
                    libc::O_RDWR
                } else {
                    libc::O_RDONLY
                }
            );
            assert_eq!(f & libc::O_DIRECT != 0, m.direct);
            assert_eq!(f & libc::O_SYNC == libc::O_SYNC, m.sync);
            assert_eq!(f & libc::O_NOATIME != 0, m.noatime);
            assert_eq!(f & libc::O_CREAT != 0, m.create);
            assert!(f & libc::O_CLOEXEC != 0);
        }
        Ok(None) => {}
        Err(msg) => {
            assert!(
                meta.ends_with(':') || meta.split_once(':').is_some_and(|(_, p)| p.is_empty()),
                "{meta:?}: {msg}"
            );
        }
    }
});
