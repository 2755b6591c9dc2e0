//! Integration test: drives the built IO_URING_DMABUF plugin through the real NIXL runtime
//! (nixl-sys 1.5.2 with `stub-api`, which dlopens the wheel's libnixl_capi.so).
//!
//! Run after `bash ci/build.sh`:
//! ```text
//! source ci/env.sh
//! LD_LIBRARY_PATH=$(iud_nixl_libs) NIXL_PLUGIN_DIR=$(iud_plugin_dir) \
//!     cargo test --release --test nixl_sys_roundtrip
//! ```
//! Without NIXL_PLUGIN_DIR, without the plugin file in it, or without a loadable
//! libnixl_capi.so every test fails with a message saying what is missing: none passes silently.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, OptArgs, Params,
    ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

const PLUGIN: &str = "IO_URING_DMABUF";
const XFER_TIMEOUT: Duration = Duration::from_secs(60);

/// One test at a time: the NIXL plugin manager is a process singleton and the nixl-sys README
/// asks for serial tests.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Preconditions: fail loudly, never skip.

fn preflight() {
    let dir = std::env::var_os("NIXL_PLUGIN_DIR").unwrap_or_else(|| {
        panic!(
            "NIXL_PLUGIN_DIR is not set. This test needs the built plugin: run `bash ci/build.sh`, \
             then `source ci/env.sh` and run the test with \
             LD_LIBRARY_PATH=$(iud_nixl_libs) NIXL_PLUGIN_DIR=$(iud_plugin_dir)"
        )
    });
    let so = Path::new(&dir).join(format!("libplugin_{PLUGIN}.so"));
    assert!(
        so.is_file(),
        "plugin file {} does not exist (NIXL_PLUGIN_DIR={}); run `bash ci/build.sh` first",
        so.display(),
        Path::new(&dir).display()
    );
    let name = CString::new("libnixl_capi.so").unwrap();
    // SAFETY: dlopen/dlerror with valid C strings; the handle is kept (nixl-sys loads the same).
    unsafe {
        if libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL).is_null() {
            let e = libc::dlerror();
            let msg = if e.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            };
            panic!(
                "cannot load libnixl_capi.so ({msg}); set LD_LIBRARY_PATH to the NIXL wheel's \
                 library dir: `source ci/env.sh; export LD_LIBRARY_PATH=$(iud_nixl_libs)`"
            );
        }
    }
}

/// `[[param]]` name/default pairs and `[plugin] mems` of the plugin manifest (a tiny reader for
/// this flat file; the build script owns the real parser).
fn manifest() -> (Vec<(String, String)>, Vec<String>) {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("plugin-manifest")
        .join(format!("{PLUGIN}.toml"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let unquote = |v: &str| v.trim().trim_matches('"').to_string();
    let (mut params, mut mems) = (Vec::new(), Vec::new());
    let (mut section, mut name) = (String::new(), None::<String>);
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            name = None;
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match (section.as_str(), k.trim()) {
            ("[[param]]", "name") => name = Some(unquote(v)),
            ("[[param]]", "default") => {
                params.push((name.clone().expect("param default before name"), unquote(v)))
            }
            ("[plugin]", "mems") => {
                mems = v
                    .trim()
                    .trim_matches(['[', ']'])
                    .split(',')
                    .map(unquote)
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            _ => {}
        }
    }
    assert!(!params.is_empty(), "no [[param]] in {}", p.display());
    (params, mems)
}

// ---------------------------------------------------------------------------------------------
// Memory, files, patterns.

#[derive(Debug, Clone, Copy)]
struct Region {
    addr: usize,
    len: usize,
    dev_id: u64,
    kind: MemType,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.kind
    }
    fn device_id(&self) -> u64 {
        self.dev_id
    }
}

/// Page-aligned DRAM that NIXL may write behind Rust's back: accessed only through short-lived
/// slices taken while no transfer is in flight.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory; the tests never touch a range while a transfer uses it.
unsafe impl Send for Buf {}
// SAFETY: as above.
unsafe impl Sync for Buf {}

impl Buf {
    fn new(len: usize) -> Self {
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign fills p on success.
        let rc = unsafe { libc::posix_memalign(&mut p, 4096, len.max(1)) };
        assert_eq!(rc, 0, "posix_memalign({len})");
        Self { ptr: p.cast(), len }
    }
    fn addr(&self) -> usize {
        self.ptr as usize
    }
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: whole allocation; callers only use it between transfers.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: from posix_memalign, freed once.
        unsafe { libc::free(self.ptr.cast()) }
    }
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            let n = c.len();
            c.copy_from_slice(&v[..n]);
        }
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A test file: `fd` is what NIXL gets (O_DIRECT if asked), `view` a buffered fd of the same
/// file for setup and verification. Removed on drop.
struct TestFile {
    path: PathBuf,
    fd: i32,
    view: i32,
}

impl TestFile {
    fn create(tag: &str, len: usize, fill: u8, direct: bool) -> Self {
        let mut last_err = String::new();
        // /tmp first; if it cannot do O_DIRECT (tmpfs), /var/tmp.
        for dir in [std::env::temp_dir(), PathBuf::from("/var/tmp")] {
            let path = dir.join(format!("iud-roundtrip-{tag}-{}.dat", std::process::id()));
            let c = CString::new(path.as_os_str().as_bytes()).unwrap();
            // SAFETY: valid C string.
            let view = unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                    0o644,
                )
            };
            assert!(
                view >= 0,
                "open {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
            let flags = libc::O_RDWR | libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 };
            // SAFETY: valid C string.
            let fd = unsafe { libc::open(c.as_ptr(), flags) };
            if fd < 0 {
                last_err = format!(
                    "open {} (O_DIRECT={direct}): {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
                // SAFETY: our fd.
                unsafe { libc::close(view) };
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let f = TestFile { path, fd, view };
            f.pwrite(&vec![fill; len], 0);
            return f;
        }
        panic!("no directory for the test file: {last_err}");
    }

    fn pwrite(&self, data: &[u8], off: u64) {
        let mut done = 0;
        while done < data.len() {
            // SAFETY: in-bounds source.
            let n = unsafe {
                libc::pwrite(
                    self.view,
                    data[done..].as_ptr().cast(),
                    data.len() - done,
                    (off + done as u64) as i64,
                )
            };
            assert!(n > 0, "pwrite: {}", std::io::Error::last_os_error());
            done += n as usize;
        }
    }

    fn pread(&self, len: usize, off: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        let mut done = 0;
        while done < len {
            // SAFETY: in-bounds destination.
            let n = unsafe {
                libc::pread(
                    self.view,
                    v[done..].as_mut_ptr().cast(),
                    len - done,
                    (off + done as u64) as i64,
                )
            };
            assert!(
                n > 0,
                "pread at {}: {}",
                off + done as u64,
                if n == 0 {
                    "EOF".to_string()
                } else {
                    std::io::Error::last_os_error().to_string()
                }
            );
            done += n as usize;
        }
        v
    }
}

impl Drop for TestFile {
    fn drop(&mut self) {
        // SAFETY: our fds, closed once.
        unsafe {
            libc::close(self.fd);
            libc::close(self.view);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

// ---------------------------------------------------------------------------------------------
// NIXL helpers.

fn plugin_params(agent: &Agent, overrides: &[(&str, &str)]) -> Params {
    let (_, defaults) = agent
        .get_plugin_params(PLUGIN)
        .unwrap_or_else(|e| panic!("get_plugin_params({PLUGIN}): {e:?} — is the plugin loadable?"));
    let mut kv: Vec<(String, String)> = defaults
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in overrides {
        kv.retain(|(kk, _)| kk != k);
        kv.push((k.to_string(), v.to_string()));
    }
    Params::from(kv.iter().map(|(k, v)| (k.as_str(), v.as_str()))).expect("Params::from")
}

fn backend_args(backend: &Backend) -> OptArgs {
    let mut o = OptArgs::new().expect("OptArgs::new");
    o.add_backend(backend).expect("OptArgs::add_backend");
    o
}

/// Posts `req` and polls until it completes; panics on error or after XFER_TIMEOUT.
fn run_xfer(agent: &Agent, req: &XferRequest, what: &str) {
    let in_prog = agent
        .post_xfer_req(req, None)
        .unwrap_or_else(|e| panic!("{what}: post_xfer_req: {e:?}"));
    let t = Instant::now();
    if in_prog {
        loop {
            match agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => break,
                Ok(XferStatus::InProgress) => {
                    assert!(
                        t.elapsed() < XFER_TIMEOUT,
                        "{what}: still in progress after {XFER_TIMEOUT:?}"
                    );
                    std::thread::yield_now();
                }
                Err(e) => panic!("{what}: get_xfer_status: {e:?}"),
            }
        }
    }
}

/// One transfer descriptor pairing: `len` bytes at DRAM offset `mem` and file offset `file`.
#[derive(Clone, Copy, Debug)]
struct Pair {
    mem: usize,
    file: u64,
    len: usize,
}

/// Lays `sizes` out without overlap: in the file in order with random gaps, in DRAM in a shuffled
/// order with random gaps (so memory and file order differ). Returns pairs and the extent needed
/// on each side. `align` > 1 aligns every offset (O_DIRECT).
fn layout(sizes: &[usize], rng: &mut SplitMix64, align: usize) -> (Vec<Pair>, usize, u64) {
    let up = |x: usize| x.div_ceil(align) * align;
    let gap = |rng: &mut SplitMix64| up(rng.below(3 * 4096) as usize);
    let mut file_off = Vec::with_capacity(sizes.len());
    let mut f = gap(rng);
    for &s in sizes {
        file_off.push(f as u64);
        f = up(f + s) + gap(rng);
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    rng.shuffle(&mut order);
    let mut mem_off = vec![0usize; sizes.len()];
    let mut m = gap(rng);
    for &i in &order {
        mem_off[i] = m;
        m = up(m + sizes[i]) + gap(rng);
    }
    let pairs = (0..sizes.len())
        .map(|i| Pair {
            mem: mem_off[i],
            file: file_off[i],
            len: sizes[i],
        })
        .collect();
    (pairs, m, f as u64)
}

fn lists<'a>(pairs: &[Pair], buf: &Buf, fd: i32) -> (XferDescList<'a>, XferDescList<'a>) {
    let mut local = XferDescList::new(MemType::Dram).expect("XferDescList(DRAM)");
    let mut remote = XferDescList::new(MemType::File).expect("XferDescList(FILE)");
    for p in pairs {
        local.add_desc(buf.addr() + p.mem, p.len, 0);
        remote.add_desc(p.file as usize, p.len, fd as u64);
    }
    (local, remote)
}

/// Every file range equals its DRAM range, and every file byte outside the ranges still holds
/// `fill` (nothing written out of bounds).
fn check_file(file: &TestFile, buf: &Buf, pairs: &[Pair], file_len: u64, fill: u8, what: &str) {
    let content = file.pread(file_len as usize, 0);
    let mem = buf.bytes();
    let mut covered = vec![false; file_len as usize];
    for (i, p) in pairs.iter().enumerate() {
        let f = &content[p.file as usize..p.file as usize + p.len];
        let m = &mem[p.mem..p.mem + p.len];
        if f != m {
            let at = f.iter().zip(m).position(|(a, b)| a != b).unwrap();
            panic!("{what}: descriptor {i} {p:?}: file differs from DRAM at byte {at} (file 0x{:02x}, DRAM 0x{:02x})", f[at], m[at]);
        }
        covered[p.file as usize..p.file as usize + p.len].fill(true);
    }
    if let Some(at) = (0..file_len as usize).find(|&i| !covered[i] && content[i] != fill) {
        panic!("{what}: file byte {at} outside every descriptor was modified (0x{:02x}, expected 0x{fill:02x})", content[at]);
    }
}

/// Every DRAM range equals its file range, and DRAM outside the ranges still holds `fill`.
fn check_mem(file: &TestFile, buf: &Buf, pairs: &[Pair], mem_len: usize, fill: u8, what: &str) {
    let mem = buf.bytes();
    let mut covered = vec![false; mem_len];
    for (i, p) in pairs.iter().enumerate() {
        let f = file.pread(p.len, p.file);
        let m = &mem[p.mem..p.mem + p.len];
        if f != m {
            let at = f.iter().zip(m).position(|(a, b)| a != b).unwrap();
            panic!("{what}: descriptor {i} {p:?}: DRAM differs from file at byte {at} (DRAM 0x{:02x}, file 0x{:02x})", m[at], f[at]);
        }
        covered[p.mem..p.mem + p.len].fill(true);
    }
    if let Some(at) = (0..mem_len).find(|&i| !covered[i] && mem[i] != fill) {
        panic!("{what}: DRAM byte {at} outside every descriptor was modified (0x{:02x}, expected 0x{fill:02x})", mem[at]);
    }
}

/// WRITE then READ (into a different DRAM layout) of `sizes`, each verified, then both requests
/// reposted with fresh data and verified again.
fn roundtrip(
    agent: &Agent,
    backend: &Backend,
    sizes: &[usize],
    direct: bool,
    seed: u64,
    tag: &str,
) {
    let name = agent.name();
    let mut rng = SplitMix64(seed);
    let align = if direct { 4096 } else { 1 };
    let (wpairs, wmem, flen) = layout(sizes, &mut rng, align);
    // READ side: same file ranges, another DRAM layout.
    let (rlayout, rmem, _) = layout(sizes, &mut rng, align);
    let rpairs: Vec<Pair> = wpairs
        .iter()
        .zip(&rlayout)
        .map(|(w, r)| Pair { mem: r.mem, ..*w })
        .collect();
    let mem_len = wmem.max(rmem);

    let buf = Buf::new(mem_len);
    let file = TestFile::create(tag, flen as usize, 0xEE, direct);
    let args = backend_args(backend);
    let dram = Region {
        addr: buf.addr(),
        len: mem_len,
        dev_id: 0,
        kind: MemType::Dram,
    };
    let freg = Region {
        addr: 0,
        len: flen as usize,
        dev_id: file.fd as u64,
        kind: MemType::File,
    };
    let _dram_reg = agent
        .register_memory(&dram, Some(&args))
        .unwrap_or_else(|e| panic!("register DRAM: {e:?}"));
    let _file_reg = agent
        .register_memory(&freg, Some(&args))
        .unwrap_or_else(|e| panic!("register FILE (fd mode): {e:?}"));

    // WRITE: random DRAM -> file.
    buf.bytes().fill(0x5A);
    for p in &wpairs {
        rng.fill(&mut buf.bytes()[p.mem..p.mem + p.len]);
    }
    let (wl, wr) = lists(&wpairs, &buf, file.fd);
    let wreq = agent
        .create_xfer_req(XferOp::Write, &wl, &wr, &name, Some(&args))
        .unwrap_or_else(|e| {
            panic!(
                "{tag}: create_xfer_req(WRITE, {} descriptors): {e:?}",
                wpairs.len()
            )
        });
    run_xfer(agent, &wreq, &format!("{tag} WRITE"));
    check_file(&file, &buf, &wpairs, flen, 0xEE, &format!("{tag} WRITE"));

    // READ: file -> DRAM poisoned with 0x11, at other places.
    buf.bytes().fill(0x11);
    let (rl, rr) = lists(&rpairs, &buf, file.fd);
    let rreq = agent
        .create_xfer_req(XferOp::Read, &rl, &rr, &name, Some(&args))
        .unwrap_or_else(|e| panic!("{tag}: create_xfer_req(READ): {e:?}"));
    run_xfer(agent, &rreq, &format!("{tag} READ"));
    check_mem(&file, &buf, &rpairs, mem_len, 0x11, &format!("{tag} READ"));

    // Repost the WRITE with new data, then the READ into a freshly poisoned buffer.
    buf.bytes().fill(0x5A);
    for p in &wpairs {
        rng.fill(&mut buf.bytes()[p.mem..p.mem + p.len]);
    }
    run_xfer(agent, &wreq, &format!("{tag} WRITE repost"));
    check_file(
        &file,
        &buf,
        &wpairs,
        flen,
        0xEE,
        &format!("{tag} WRITE repost"),
    );
    buf.bytes().fill(0x22);
    run_xfer(agent, &rreq, &format!("{tag} READ repost"));
    check_mem(
        &file,
        &buf,
        &rpairs,
        mem_len,
        0x22,
        &format!("{tag} READ repost"),
    );

    drop(wreq);
    drop(rreq);
}

/// Mixed sizes: tiny, odd, page-sized, larger than max_io_size (split), around 1 MiB.
fn mixed_sizes(rng: &mut SplitMix64, n: usize) -> Vec<usize> {
    const SMALL: &[usize] = &[
        1, 3, 7, 511, 512, 4095, 4096, 4097, 8192, 12345, 65536, 131071,
    ];
    let mut v: Vec<usize> = (0..n)
        .map(|_| SMALL[rng.below(SMALL.len() as u64) as usize])
        .collect();
    v.extend([1 << 20, (1 << 20) + 123, (5 << 20) + 17, 9 << 20]);
    rng.shuffle(&mut v);
    v
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn plugin_is_listed_and_advertises_manifest_params() {
    let _g = serial();
    preflight();
    let agent = Agent::new("iud-roundtrip-params").expect("Agent::new");
    let plugins = agent
        .get_available_plugins()
        .expect("get_available_plugins");
    let names: Vec<String> = (0..plugins.len().unwrap())
        .map(|i| plugins.get(i).unwrap().to_string())
        .collect();
    assert!(
        names.iter().any(|n| n == PLUGIN),
        "{PLUGIN} not among the plugins NIXL found: {names:?}"
    );

    let (mems, params) = agent.get_plugin_params(PLUGIN).expect("get_plugin_params");
    let mut got: Vec<(String, String)> = params
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (mut want, want_mems) = manifest();
    got.sort();
    want.sort();
    assert_eq!(
        got, want,
        "get_plugin_params({PLUGIN}) differs from plugin-manifest/{PLUGIN}.toml"
    );
    let mut mem_names: Vec<String> = mems.iter().map(|m| format!("{:?}", m.unwrap())).collect();
    mem_names.sort();
    let mut want_mem_names: Vec<String> = want_mems
        .iter()
        .map(|m| {
            match m.as_str() {
                "DRAM_SEG" => "Dram",
                "VRAM_SEG" => "Vram",
                "FILE_SEG" => "File",
                "BLK_SEG" => "Block",
                "OBJ_SEG" => "Object",
                other => panic!("unknown mem {other} in manifest"),
            }
            .to_string()
        })
        .collect();
    want_mem_names.sort();
    assert_eq!(mem_names, want_mem_names, "plugin mems vs manifest");

    // Created with its defaults, the backend reports them back.
    let backend = agent
        .create_backend(PLUGIN, &plugin_params(&agent, &[]))
        .expect("create_backend with defaults");
    let (_, bp) = agent
        .get_backend_params(&backend)
        .expect("get_backend_params");
    let mut bp: Vec<(String, String)> = bp
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    bp.sort();
    assert_eq!(
        bp, want,
        "get_backend_params after create_backend with the defaults"
    );
}

#[test]
fn write_read_roundtrip_buffered_mixed_sizes() {
    let _g = serial();
    preflight();
    let agent = Agent::new("iud-roundtrip-buffered").expect("Agent::new");
    // A small ring, so the 300+ descriptors cannot all be in flight at once.
    let backend = agent
        .create_backend(PLUGIN, &plugin_params(&agent, &[("ring_entries", "32")]))
        .expect("create_backend(ring_entries=32)");
    let mut rng = SplitMix64(0x1234);
    let sizes = mixed_sizes(&mut rng, 300);
    roundtrip(&agent, &backend, &sizes, false, 7, "buffered");
}

#[test]
fn write_read_roundtrip_buffered_no_fixed_resources() {
    let _g = serial();
    preflight();
    let agent = Agent::new("iud-roundtrip-plain").expect("Agent::new");
    let backend = agent
        .create_backend(
            PLUGIN,
            &plugin_params(
                &agent,
                &[
                    ("fixed_buffers", "off"),
                    ("fixed_files", "false"),
                    ("max_io_size", "0"),
                ],
            ),
        )
        .expect("create_backend(fixed_buffers=off, fixed_files=false, max_io_size=0)");
    let mut rng = SplitMix64(0x5678);
    let sizes = mixed_sizes(&mut rng, 100);
    roundtrip(&agent, &backend, &sizes, false, 8, "plain");
}

#[test]
fn write_read_roundtrip_o_direct() {
    let _g = serial();
    preflight();
    let agent = Agent::new("iud-roundtrip-direct").expect("Agent::new");
    let backend = agent
        .create_backend(PLUGIN, &plugin_params(&agent, &[]))
        .expect("create_backend");
    let mut rng = SplitMix64(0x9abc);
    const ALIGNED: &[usize] = &[4096, 8192, 12288, 65536, 1 << 20];
    let mut sizes: Vec<usize> = (0..120)
        .map(|_| ALIGNED[rng.below(ALIGNED.len() as u64) as usize])
        .collect();
    sizes.push(5 << 20);
    roundtrip(&agent, &backend, &sizes, true, 9, "direct");
}

#[test]
fn prepped_dlists_and_make_xfer_req() {
    let _g = serial();
    preflight();
    let agent = Agent::new("iud-roundtrip-prepped").expect("Agent::new");
    let name = agent.name();
    let backend = agent
        .create_backend(PLUGIN, &plugin_params(&agent, &[]))
        .expect("create_backend");
    let args = backend_args(&backend);
    // 64 contiguous 16 KiB blocks in both DRAM and file (mergeable), in a 1 MiB region.
    let (n, bs) = (64usize, 16384usize);
    let len = n * bs;
    let buf = Buf::new(len);
    let file = TestFile::create("prepped", len, 0xEE, false);
    let dram = Region {
        addr: buf.addr(),
        len,
        dev_id: 0,
        kind: MemType::Dram,
    };
    let freg = Region {
        addr: 0,
        len,
        dev_id: file.fd as u64,
        kind: MemType::File,
    };
    let _r1 = agent
        .register_memory(&dram, Some(&args))
        .expect("register DRAM");
    let _r2 = agent
        .register_memory(&freg, Some(&args))
        .expect("register FILE");
    let pairs: Vec<Pair> = (0..n)
        .map(|i| Pair {
            mem: i * bs,
            file: (i * bs) as u64,
            len: bs,
        })
        .collect();
    let (local, remote) = lists(&pairs, &buf, file.fd);
    let lh = agent
        .prepare_xfer_dlist("", &local, Some(&args))
        .expect("prep_xfer_dlist(DRAM, NIXL_INIT_AGENT)");
    let rh = agent
        .prepare_xfer_dlist(&name, &remote, Some(&args))
        .expect("prep_xfer_dlist(FILE, own name)");

    // WRITE all blocks by index, in order.
    let all: Vec<i32> = (0..n as i32).collect();
    SplitMix64(11).fill(buf.bytes());
    let w = agent
        .make_xfer_req(XferOp::Write, &lh, &all, &rh, &all, Some(&args))
        .expect("make_xfer_req(WRITE)");
    run_xfer(&agent, &w, "prepped WRITE");
    check_file(&file, &buf, &pairs, len as u64, 0xEE, "prepped WRITE");

    // READ a permutation: DRAM block i <- file block perm[i].
    let mut perm = all.clone();
    SplitMix64(12).shuffle(&mut perm);
    buf.bytes().fill(0x33);
    let r = agent
        .make_xfer_req(XferOp::Read, &lh, &all, &rh, &perm, Some(&args))
        .expect("make_xfer_req(READ)");
    run_xfer(&agent, &r, "prepped READ");
    let content = file.pread(len, 0);
    for (i, &j) in perm.iter().enumerate() {
        let (m, f) = (
            &buf.bytes()[i * bs..(i + 1) * bs],
            &content[j as usize * bs..(j as usize + 1) * bs],
        );
        assert!(m == f, "prepped READ: DRAM block {i} != file block {j}");
    }
    drop((w, r));
    drop((lh, rh));
}

#[test]
fn concurrent_threads_in_sync_mode_rw() {
    let _g = serial();
    preflight();
    let cfg = AgentConfig {
        thread_sync: ThreadSync::Rw,
        enable_prog_thread: false,
        ..AgentConfig::default()
    };
    let agent =
        Agent::new_configured("iud-roundtrip-threads", &cfg).expect("Agent::new_configured(RW)");
    let name = agent.name();
    let backend = agent
        .create_backend(PLUGIN, &plugin_params(&agent, &[("ring_entries", "64")]))
        .expect("create_backend");
    const THREADS: usize = 2;
    const PER: usize = 8 << 20;
    let buf = Buf::new(THREADS * PER);
    let file = TestFile::create("threads", THREADS * PER, 0xEE, false);
    let args = backend_args(&backend);
    let dram = Region {
        addr: buf.addr(),
        len: THREADS * PER,
        dev_id: 0,
        kind: MemType::Dram,
    };
    let freg = Region {
        addr: 0,
        len: THREADS * PER,
        dev_id: file.fd as u64,
        kind: MemType::File,
    };
    let _r1 = agent
        .register_memory(&dram, Some(&args))
        .expect("register DRAM");
    let _r2 = agent
        .register_memory(&freg, Some(&args))
        .expect("register FILE");
    SplitMix64(21).fill(buf.bytes());
    let expect = buf.bytes().to_vec();
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (agent, name, backend, buf, file, barrier) =
                (&agent, &name, &backend, &buf, &file, &barrier);
            s.spawn(move || {
                let args = backend_args(backend);
                // 256 blocks of 32 KiB per thread, written in two requests of interleaved blocks.
                let bs = 32768;
                let base = t * PER;
                for round in 0..2 {
                    let pairs: Vec<Pair> = (0..PER / bs)
                        .filter(|i| i % 2 == round)
                        .map(|i| Pair {
                            mem: base + i * bs,
                            file: (base + i * bs) as u64,
                            len: bs,
                        })
                        .collect();
                    let (l, r) = lists(&pairs, buf, file.fd);
                    barrier.wait();
                    let req = agent
                        .create_xfer_req(XferOp::Write, &l, &r, name, Some(&args))
                        .expect("create_xfer_req");
                    for _ in 0..3 {
                        run_xfer(agent, &req, &format!("thread {t} round {round}"));
                    }
                }
            });
        }
    });
    assert!(
        file.pread(THREADS * PER, 0) == expect,
        "file content after concurrent WRITEs differs from DRAM"
    );
    // And back: both threads READ their halves concurrently into a wiped buffer.
    buf.bytes().fill(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (agent, name, backend, buf, file) = (&agent, &name, &backend, &buf, &file);
            s.spawn(move || {
                let args = backend_args(backend);
                let pairs = [Pair {
                    mem: t * PER,
                    file: (t * PER) as u64,
                    len: PER,
                }];
                let (l, r) = lists(&pairs, buf, file.fd);
                let req = agent
                    .create_xfer_req(XferOp::Read, &l, &r, name, Some(&args))
                    .expect("create_xfer_req(READ)");
                run_xfer(agent, &req, &format!("thread {t} READ"));
            });
        }
    });
    assert!(
        buf.bytes() == expect.as_slice(),
        "DRAM after concurrent READs differs from what was written"
    );
}
