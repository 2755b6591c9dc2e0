//! The structured context of engine errors (`error::Context`): the code that raises an error
//! fills the descriptor index, fd, offset and errno it knows, so callers and tests read them as
//! fields instead of parsing the message.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::error::ErrorKind;

mod common;
use common::*;

fn engine() -> Engine {
    Engine::new(AGENT, std::iter::empty()).expect("engine")
}

/// A file under /var/tmp (a disk file system, where O_DIRECT works), removed at the end.
struct TempFile {
    path: std::path::PathBuf,
    file: File,
}

impl TempFile {
    fn new(name: &str, direct: bool) -> TempFile {
        let path = std::path::PathBuf::from(format!(
            "/var/tmp/iud-error-context-{}-{name}",
            std::process::id()
        ));
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true).truncate(true);
        if direct {
            std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, libc::O_DIRECT);
        }
        // A number of its own: a test that closes it must not see another test's file under it.
        let file = lone_file(opts.open(&path).expect("open temp file"));
        TempFile { path, file }
    }
    fn fd(&self) -> u64 {
        self.file.as_raw_fd() as u64
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[test]
fn an_invalid_descriptor_is_named_in_the_context() {
    let e = engine();
    let buf = Buf::new(1 << 16, 1);
    let f = TempFile::new("invalid", false);
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, f.fd(), "").unwrap();
    let mut l: Vec<_> = (0..5)
        .map(|i| desc(buf.addr() + i * 4096, 4096, 0, m))
        .collect();
    let r: Vec<_> = (0..5).map(|i| desc(i * 4096, 4096, f.fd(), mf)).collect();
    // Descriptor 3 runs past the end of its memory registration.
    l[3] = desc(buf.addr() + (1 << 16) - 100, 4096, 0, m);
    let err = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    assert_eq!(err.context.descriptor, Some(3), "{err:?}");
    // Descriptor 2 with unequal lengths: the first invalid one is reported.
    l[2] = desc(buf.addr(), 512, 0, m);
    let err = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap_err();
    assert_eq!(
        (err.kind, err.context.descriptor),
        (ErrorKind::Mismatch, Some(2))
    );
}

#[test]
fn a_misaligned_direct_descriptor_names_descriptor_fd_and_offset() {
    let e = engine();
    let buf = Buf::new(1 << 16, 2);
    let f = TempFile::new("misaligned", true);
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, f.fd(), "").unwrap();
    let l = [
        desc(buf.addr(), 4096, 0, m),
        desc(buf.addr() + 4096, 4096, 0, m),
    ];
    let r = [desc(0, 4096, f.fd(), mf), desc(4196, 4096, f.fd(), mf)];
    let err = e.prep(WRITE, DRAM, &l, FILE, &r, AGENT).unwrap_err();
    assert!(err.message.contains("O_DIRECT"), "{}", err.message);
    let c = err.context;
    assert_eq!(
        (c.descriptor, c.fd, c.offset),
        (Some(1), Some(f.fd() as i32), Some(4196))
    );
}

#[test]
fn a_failed_read_carries_descriptor_fd_offset_and_no_errno_at_end_of_file() {
    let e = engine();
    let buf = Buf::new(1 << 16, 3);
    let f = TempFile::new("eof", false);
    f.file.set_len(6000).unwrap();
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, f.fd(), "").unwrap();
    // A gap in memory keeps the two descriptors from merging into one op.
    let l = [
        desc(buf.addr(), 4096, 0, m),
        desc(buf.addr() + 8192, 8192, 0, m),
    ];
    let r = [desc(0, 4096, f.fd(), mf), desc(4096, 8192, f.fd(), mf)];
    let err = run_kind(&e, READ, FILE, &l, &r).unwrap_err();
    assert!(
        err.message.contains("read past end of file"),
        "{}",
        err.message
    );
    let c = err.context;
    assert_eq!(
        (c.descriptor, c.fd, c.offset, c.errno),
        (Some(1), Some(f.fd() as i32), Some(6000), None)
    );
}

#[test]
fn a_closed_fd_at_post_carries_the_fd_and_ebadf() {
    let e = engine();
    let buf = Buf::new(1 << 16, 4);
    let f = TempFile::new("closed", false);
    let fd = f.fd();
    let m = e.register(DRAM, buf.addr(), 1 << 16, 0, "").unwrap();
    let mf = e.register(FILE, 0, 1 << 16, fd, "").unwrap();
    drop(f);
    let err = run_kind(
        &e,
        WRITE,
        FILE,
        &[desc(buf.addr(), 4096, 0, m)],
        &[desc(0, 4096, fd, mf)],
    )
    .unwrap_err();
    assert!(err.message.contains("no longer open"), "{}", err.message);
    assert_eq!(
        (err.context.fd, err.context.errno),
        (Some(fd as i32), Some(libc::EBADF))
    );
}

#[test]
fn registering_a_closed_fd_carries_the_fd_and_errno() {
    let e = engine();
    let f = TempFile::new("register", false);
    let fd = f.fd();
    drop(f);
    let err = e.register(FILE, 0, 4096, fd, "").unwrap_err();
    assert_eq!(
        (err.context.fd, err.context.errno),
        (Some(fd as i32), Some(libc::EBADF)),
        "{err:?}"
    );
    assert!(
        std::error::Error::source(&err).is_some(),
        "the OS error is the source"
    );
}
