//! Backend parameters: the values of the manifest's parameters for one engine.
//!
//! Parameters the manifest does not declare are ignored with one debug line (LMCache passes its
//! own keys such as `file_path` and `use_direct_io` straight into create_backend). A declared
//! parameter with a malformed value fails engine creation with a message naming it.

use crate::error::{Error, Result};
use crate::gpu::{PackedCopy, ProviderChoice};
use crate::manifest;
use crate::uring::{
    default_page_cache_threads, default_page_cache_writers, usable_cpus, MAX_FIXED_BUFFER,
};

/// Whether DRAM registrations become io_uring fixed buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FixedBuffers {
    Auto,
    Off,
}

/// Whether the thread that posts or polls a request runs reads queued for the page-cache
/// workers (`page_cache_caller_reads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallerReads {
    /// Yes, except while VRAM moves through the staging buffers: that thread starts their
    /// device copies, and a read it runs meanwhile holds them back (on the H200, contiguous
    /// and large VRAM READs 8-21 % faster without it, small scattered ones level; host-memory
    /// READs 1.09-1.17x with it: bench/results/2026-12-04-per-request-h200-afternoon.md).
    Auto,
    Always,
    Never,
}

impl CallerReads {
    /// Whether a posting or polling thread runs queued reads now.
    pub fn helps(self, staging_in_use: bool) -> bool {
        match self {
            CallerReads::Always => true,
            CallerReads::Never => false,
            CallerReads::Auto => !staging_in_use,
        }
    }
}

/// How VRAM is moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VramPath {
    Auto,
    Dmabuf,
    Cufile,
    Staging,
}

/// How requests reach cuFile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CufileApiChoice {
    Auto,
    Threads,
    Batch,
}

/// Whether DRAM registrations are exported as DMA-BUFs through udmabuf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DramDmabuf {
    Auto,
    On,
    Off,
}

/// Parsed backend parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineParams {
    pub ring_entries: u32,
    pub fixed_buffers: FixedBuffers,
    pub fixed_files: bool,
    pub max_io_size: u64,
    pub inline_write_max: u64,
    pub punt_buffered_min: u64,
    /// Page-cache worker threads the engine starts.
    pub page_cache_threads: usize,
    /// Page-cache workers that may write one file at once (0 = no limit).
    pub page_cache_file_writers: u32,
    /// Page-cache workers that may write at once, all files together (0 = no limit).
    pub page_cache_writers: u32,
    /// Posting and polling threads run reads queued for the page-cache workers.
    pub page_cache_caller_reads: CallerReads,
    /// A thread of the engine moves running requests on while nobody polls them.
    pub progress_thread: bool,
    /// Threads that plan one large prepXfer (the caller and `prep_threads - 1` helpers).
    pub prep_threads: usize,
    pub vram_path: VramPath,
    pub dram_dmabuf: DramDmabuf,
    pub gpu_provider: ProviderChoice,
    pub verify_dma: bool,
    pub staging_buffer_size: u64,
    pub staging_buffers: u32,
    /// Staged pieces up to this size share a staging buffer (one batched copy per buffer).
    pub staging_pack_max: u64,
    /// How packed staging buffers reach the GPU.
    pub staging_copy: PackedCopy,
    /// Device streams the packed buffers' scatter kernels take in turn.
    pub staging_kernel_streams: u32,
    /// Largest staged piece of a page-cache WRITE.
    pub staged_write_piece_max: u64,
    /// Microseconds an idle page-cache worker watches for a job before it sleeps.
    pub page_cache_spin_us: u32,
    /// Largest staged piece of a page-cache READ read by the workers (0 = no limit of its own).
    pub staged_read_piece_max: u64,
    /// Staging bytes that page-cache WRITEs may fill at once (0 = no limit).
    pub staged_write_window: u64,
    pub cufile_threads: u32,
    pub cufile_api: CufileApiChoice,
    /// Recording-mode output file (empty = off).
    pub record: String,
}

const RING_ENTRIES_RANGE: (u32, u32) = (16, 32768);

impl EngineParams {
    /// The piece staged page-cache READs are cut at, or 0 (none of its own) when pieces of
    /// `staged_read_piece_max` would not be packed (`staging_pack_max`): each would hold a whole
    /// staging buffer, and the pool would carry a fraction of its bytes.
    pub fn staged_read_piece(&self) -> u64 {
        if self.staged_read_piece_max <= self.staging_pack_max {
            self.staged_read_piece_max
        } else {
            0
        }
    }

    /// Parses `(key, value)` pairs; returns the params and the keys that were ignored.
    pub fn parse<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<(Self, Vec<String>)> {
        let mut values: Vec<(&'static str, String)> = manifest::PARAMS
            .iter()
            .map(|p| (p.name, p.default.to_owned()))
            .collect();
        let mut ignored = Vec::new();
        for (key, value) in pairs {
            match values.iter_mut().find(|(name, _)| *name == key) {
                Some(slot) => slot.1 = value.trim().to_owned(),
                None => ignored.push(key.to_owned()),
            }
        }
        let get = |name: &str| -> &str {
            values
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
                .expect("manifest param")
        };
        let ring_entries = parse_u64("ring_entries", get("ring_entries"))?;
        let (lo, hi) = RING_ENTRIES_RANGE;
        if ring_entries < lo as u64 || ring_entries > hi as u64 {
            return Err(Error::invalid(format!(
                "backend parameter ring_entries={ring_entries} is outside {lo}..{hi}"
            )));
        }
        let fixed_buffers = match get("fixed_buffers").to_ascii_lowercase().as_str() {
            "auto" | "on" | "true" => FixedBuffers::Auto,
            "off" | "false" => FixedBuffers::Off,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter fixed_buffers={other:?} must be auto or off"
                )))
            }
        };
        let fixed_files = parse_bool("fixed_files", get("fixed_files"))?;
        let max_io_size = parse_u64("max_io_size", get("max_io_size"))?;
        if max_io_size != 0 && max_io_size < 4096 {
            return Err(Error::invalid(format!(
                "backend parameter max_io_size={max_io_size} must be 0 (no split) or at least 4096"
            )));
        }
        let inline_write_max = match get("inline_write_max") {
            // With few CPUs, and those often busy, a hand-off to io_uring's workers loses to
            // copying in the calling thread (POSIX AIO's buffered io_submit copies synchronously):
            // the posting thread writes the whole request (bench/results/2026-12-01-cpu-kv-cache.md).
            "auto" => {
                if usable_cpus() >= 8 {
                    1 << 20
                } else {
                    u64::MAX
                }
            }
            v => parse_u64("inline_write_max", v)?,
        };
        let punt_buffered_min = match get("punt_buffered_min") {
            // Buffered reads go to the page-cache workers, and the posting/polling thread runs
            // queued ones itself (uring/workers.rs `QueueHelper`), so a busy machine loses no
            // more than the hand-off. Every size on 2 or more CPUs (small pieces are grouped
            // into 256 KiB jobs); one CPU: never (no second core to gain). On 16
            // CPUs, with the caller helping, 8192 scattered 16 KiB DRAM reads ran 23.5 GB/s
            // spread against 3.1 from 256 KiB up (POSIX 3.6; 4 KiB 11.7 against 2.3, 64 KiB 26.1
            // against 3.9: bench/results/2026-12-02-gpu-h200-session21.md).
            "auto" => match usable_cpus() {
                n if n >= 2 => 4096,
                _ => 0,
            },
            v => parse_u64("punt_buffered_min", v)?,
        };
        let page_cache_file_writers = match get("page_cache_file_writers") {
            // Two: a file's buffered writes serialize on its inode lock, so more writers only spin
            // on it (io_uring's io-wq serializes buffered writes per inode the same way); two beat
            // one (one is ready when the other lets go) in the same H200 run, 1.03-1.19x, and
            // unlimited spent 2-4x the CPU for less (bench/results/2026-12-01-gpu-h200-issue13.md).
            "auto" => 2,
            v => parse_u64("page_cache_file_writers", v)?,
        };
        if page_cache_file_writers > 64 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_file_writers={page_cache_file_writers} must be within 0..64 (0 = no limit)"
            )));
        }
        let page_cache_writers = match get("page_cache_writers") {
            "auto" => default_page_cache_writers() as u64,
            v => parse_u64("page_cache_writers", v)?,
        };
        if page_cache_writers > 64 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_writers={page_cache_writers} must be within 0..64 (0 = no limit, or auto)"
            )));
        }
        let page_cache_threads = match get("page_cache_threads") {
            "auto" => default_page_cache_threads(),
            v => match parse_u64("page_cache_threads", v)? {
                n @ 1..=64 => n as usize,
                n => {
                    return Err(Error::invalid(format!(
                        "backend parameter page_cache_threads={n} must be within 1..64 (or auto)"
                    )))
                }
            },
        };
        let page_cache_caller_reads = match get("page_cache_caller_reads") {
            "auto" => CallerReads::Auto,
            v => match parse_bool("page_cache_caller_reads", v) {
                Ok(true) => CallerReads::Always,
                Ok(false) => CallerReads::Never,
                Err(_) => {
                    return Err(Error::invalid(format!(
                    "backend parameter page_cache_caller_reads={v:?} must be auto, true or false"
                )))
                }
            },
        };
        let progress_thread = match get("progress_thread") {
            // On 2 CPUs the posting thread does most of a request's work inline and a third
            // thread's wake-ups cost the others: no gain with a 1 ms-sleeping poller (0.91-1.07x)
            // and 2-10 % less READ with a spinning one (bench/results/2026-12-01-cpu-progress-thread.md);
            // on the 16-CPU H200, 1.13x at 16 KiB with a sleeping poller and no loss spinning.
            "auto" => usable_cpus() >= 8,
            v => parse_bool("progress_thread", v)?,
        };
        let prep_threads = match get("prep_threads") {
            // A 2-CPU machine has no core for a helper while the client runs (the same reason
            // as progress_thread; two threads gained nothing there at 8192 descriptors). On the
            // 16-CPU H200 four threads planned 8192 descriptors in 242-250 us against 298-311
            // whole (bench/results/2026-12-05-per-request-h200-midday.md).
            "auto" => {
                if usable_cpus() >= 8 {
                    4
                } else {
                    1
                }
            }
            v => match parse_u64("prep_threads", v)? {
                n @ 1..=16 => n as usize,
                n => {
                    return Err(Error::invalid(format!(
                        "backend parameter prep_threads={n} must be within 1..16 (or auto)"
                    )))
                }
            },
        };
        let vram_path = match get("vram_path").to_ascii_lowercase().as_str() {
            "auto" => VramPath::Auto,
            "dmabuf" => VramPath::Dmabuf,
            "cufile" => VramPath::Cufile,
            "staging" => VramPath::Staging,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter vram_path={other:?} must be auto, dmabuf, cufile or staging"
                )))
            }
        };
        let cufile_api = match get("cufile_api").to_ascii_lowercase().as_str() {
            "auto" => CufileApiChoice::Auto,
            "threads" => CufileApiChoice::Threads,
            "batch" => CufileApiChoice::Batch,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter cufile_api={other:?} must be auto, threads or batch"
                )))
            }
        };
        let dram_dmabuf = match get("dram_dmabuf").to_ascii_lowercase().as_str() {
            "auto" => DramDmabuf::Auto,
            "on" | "true" => DramDmabuf::On,
            "off" | "false" => DramDmabuf::Off,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter dram_dmabuf={other:?} must be auto, on or off"
                )))
            }
        };
        let gpu_provider = ProviderChoice::parse(get("gpu_provider")).ok_or_else(|| {
            Error::invalid(format!(
                "backend parameter gpu_provider={:?} must be cuda, rocm, vulkan or auto",
                get("gpu_provider")
            ))
        })?;
        let verify_dma = parse_bool("verify_dma", get("verify_dma"))?;
        let staging_buffer_size = parse_u64("staging_buffer_size", get("staging_buffer_size"))?;
        if staging_buffer_size < 65536
            || staging_buffer_size % 4096 != 0
            || staging_buffer_size > MAX_FIXED_BUFFER
        {
            return Err(Error::invalid(format!(
                "backend parameter staging_buffer_size={staging_buffer_size} must be a multiple of 4096 between 65536 and 1 GiB"
            )));
        }
        let staged_write_piece_max =
            parse_u64("staged_write_piece_max", get("staged_write_piece_max"))?;
        if staged_write_piece_max < 4096
            || staged_write_piece_max % 4096 != 0
            || staged_write_piece_max > MAX_FIXED_BUFFER
        {
            return Err(Error::invalid(format!(
                "backend parameter staged_write_piece_max={staged_write_piece_max} must be a multiple of 4096 between 4096 and 1 GiB"
            )));
        }
        let page_cache_spin_us = parse_u64("page_cache_spin_us", get("page_cache_spin_us"))?;
        if page_cache_spin_us > 10_000 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_spin_us={page_cache_spin_us} must be at most 10000"
            )));
        }
        let staged_read_piece_max =
            parse_u64("staged_read_piece_max", get("staged_read_piece_max"))?;
        if staged_read_piece_max % 4096 != 0 || staged_read_piece_max > MAX_FIXED_BUFFER {
            return Err(Error::invalid(format!(
                "backend parameter staged_read_piece_max={staged_read_piece_max} must be 0 or a multiple of 4096 up to 1 GiB"
            )));
        }
        let staged_write_window = parse_u64("staged_write_window", get("staged_write_window"))?;
        if staged_write_window % 4096 != 0 {
            return Err(Error::invalid(format!(
                "backend parameter staged_write_window={staged_write_window} must be a multiple of 4096 (0 = no limit)"
            )));
        }
        let staging_pack_max = match get("staging_pack_max") {
            // Half a buffer: two pieces or more share one. On the H200 2048 scattered 256 KiB
            // reads ran 41-43 GB/s packed (4 or 8 to a 2 MiB buffer) against 26 a buffer each
            // (the buffer count, not the bytes, capped what was in flight); 512 KiB and 1 MiB
            // gained 1.0-1.1x, 128 KiB stayed equal (bench/results/2026-12-02-gpu-h200-session21.md).
            "auto" => staging_buffer_size / 2 / 4096 * 4096,
            v => parse_u64("staging_pack_max", v)?,
        };
        if staging_pack_max % 4096 != 0 || staging_pack_max > staging_buffer_size {
            return Err(Error::invalid(format!(
                "backend parameter staging_pack_max={staging_pack_max} must be a multiple of 4096 no larger than staging_buffer_size ({staging_buffer_size})"
            )));
        }
        let staging_copy = match get("staging_copy").to_ascii_lowercase().as_str() {
            "auto" => PackedCopy::Auto,
            "batch" => PackedCopy::Batch,
            "kernel" => PackedCopy::Kernel,
            "dma-kernel" => PackedCopy::DmaKernel,
            other => return Err(Error::invalid(format!("backend parameter staging_copy={other:?} must be auto, batch, kernel or dma-kernel"))),
        };
        let staging_kernel_streams =
            parse_u64("staging_kernel_streams", get("staging_kernel_streams"))?;
        if !(1..=4).contains(&staging_kernel_streams) {
            return Err(Error::invalid(format!("backend parameter staging_kernel_streams={staging_kernel_streams} must be within 1..4")));
        }
        let staging_buffers = parse_u64("staging_buffers", get("staging_buffers"))?;
        if !(2..=256).contains(&staging_buffers) {
            return Err(Error::invalid(format!(
                "backend parameter staging_buffers={staging_buffers} must be within 2..256"
            )));
        }
        let cufile_threads = parse_u64("cufile_threads", get("cufile_threads"))?;
        if !(1..=64).contains(&cufile_threads) {
            return Err(Error::invalid(format!(
                "backend parameter cufile_threads={cufile_threads} must be within 1..64"
            )));
        }
        let params = EngineParams {
            ring_entries: ring_entries as u32,
            fixed_buffers,
            fixed_files,
            max_io_size,
            inline_write_max,
            punt_buffered_min,
            page_cache_threads,
            prep_threads,
            progress_thread,
            page_cache_file_writers: page_cache_file_writers as u32,
            page_cache_writers: page_cache_writers as u32,
            page_cache_caller_reads,
            vram_path,
            dram_dmabuf,
            gpu_provider,
            verify_dma,
            staging_buffer_size,
            staging_buffers: staging_buffers as u32,
            staging_pack_max,
            staging_copy,
            staging_kernel_streams: staging_kernel_streams as u32,
            staged_write_piece_max,
            staged_read_piece_max,
            page_cache_spin_us: page_cache_spin_us as u32,
            staged_write_window,
            cufile_threads: cufile_threads as u32,
            cufile_api,
            record: get("record").to_owned(),
        };
        Ok((params, ignored))
    }
}

impl Default for EngineParams {
    fn default() -> Self {
        Self::parse(std::iter::empty())
            .expect("manifest defaults parse")
            .0
    }
}

fn parse_u64(name: &str, value: &str) -> Result<u64> {
    value.parse::<u64>().map_err(|_| {
        Error::invalid(format!(
            "backend parameter {name}={value:?} is not a non-negative integer"
        ))
    })
}

fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(Error::invalid(format!(
            "backend parameter {name}={value:?} must be true or false"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn manifest_defaults_give_a_working_configuration() {
        let p = EngineParams::default();
        assert!(p.ring_entries >= 16);
        assert_eq!(p.fixed_buffers, FixedBuffers::Auto);
    }

    #[test]
    fn caller_reads_auto_steps_aside_while_staging_buffers_are_in_use() {
        assert_eq!(
            EngineParams::default().page_cache_caller_reads,
            CallerReads::Auto
        );
        for (v, want) in [
            ("auto", CallerReads::Auto),
            ("true", CallerReads::Always),
            ("off", CallerReads::Never),
        ] {
            assert_eq!(
                EngineParams::parse([("page_cache_caller_reads", v)])
                    .unwrap()
                    .0
                    .page_cache_caller_reads,
                want,
                "{v}"
            );
        }
        assert!(CallerReads::Auto.helps(false));
        assert!(!CallerReads::Auto.helps(true));
        assert!(CallerReads::Always.helps(true));
        assert!(!CallerReads::Never.helps(false));
        let e = EngineParams::parse([("page_cache_caller_reads", "sometimes")]).unwrap_err();
        assert!(e.message.contains("auto, true or false"), "{}", e.message);
    }

    #[test]
    fn staged_reads_are_cut_for_the_workers_only_when_the_pieces_pack() {
        assert_eq!(EngineParams::default().staged_read_piece(), 262144);
        let piece = |pairs: &[(&str, &str)]| {
            EngineParams::parse(pairs.iter().copied())
                .unwrap()
                .0
                .staged_read_piece()
        };
        assert_eq!(
            piece(&[
                ("staging_pack_max", "1048576"),
                ("staged_read_piece_max", "1048576")
            ]),
            1 << 20
        );
        // Pieces larger than the pack limit would each hold a whole staging buffer.
        assert_eq!(piece(&[("staging_pack_max", "131072")]), 0);
        assert_eq!(piece(&[("staging_pack_max", "0")]), 0);
        assert_eq!(piece(&[("staged_read_piece_max", "0")]), 0);
    }

    #[test]
    fn unknown_keys_are_reported_not_rejected() {
        let (p, ignored) = EngineParams::parse([
            ("file_path", "/x"),
            ("use_direct_io", "True"),
            ("ring_entries", "64"),
        ])
        .unwrap();
        assert_eq!(p.ring_entries, 64);
        assert_eq!(
            ignored,
            vec!["file_path".to_owned(), "use_direct_io".to_owned()]
        );
    }

    #[test]
    fn malformed_values_name_the_parameter() {
        for (k, v) in [
            ("ring_entries", "lots"),
            ("ring_entries", "8"),
            ("fixed_buffers", "maybe"),
            ("fixed_files", "2"),
            ("max_io_size", "100"),
            ("vram_path", "gds"),
            ("cufile_api", "stream"),
            ("dram_dmabuf", "sometimes"),
            ("gpu_provider", "metal"),
            ("verify_dma", "perhaps"),
            ("staging_buffer_size", "1000"),
            ("staging_buffers", "1"),
            ("staged_write_piece_max", "1000"),
            ("staged_read_piece_max", "1000"),
            ("page_cache_spin_us", "20000"),
            ("staged_write_window", "1000"),
            ("staged_write_window", "lots"),
            ("staging_pack_max", "5000"),
            ("staging_copy", "memcpy"),
            ("staging_kernel_streams", "0"),
            ("staging_kernel_streams", "5"),
            ("staging_pack_max", "4194304"),
            ("page_cache_file_writers", "65"),
            ("page_cache_writers", "65"),
            ("page_cache_writers", "some"),
            ("page_cache_threads", "0"),
            ("page_cache_threads", "65"),
            ("prep_threads", "0"),
            ("prep_threads", "17"),
            ("page_cache_caller_reads", "sometimes"),
            ("progress_thread", "maybe"),
        ] {
            let e = EngineParams::parse([(k, v)]).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidParam);
            assert!(e.message.contains(k), "{}", e.message);
        }
    }
}
