//! Reading the backend parameters: each declared in the manifest, read by its entry in
//! `READERS` from the value the application passed or the manifest's default, and refused with
//! a message naming it when malformed.

use super::{CallerReads, CufileApiChoice, DramDmabuf, EngineParams, FixedBuffers, VramPath};
use crate::error::{Error, Result};
use crate::ffi::manifest;
use crate::gpu::{PackedCopy, ProviderChoice};
use crate::uring::{
    default_page_cache_threads, default_page_cache_writers, usable_cpus, MAX_FIXED_BUFFER,
};

const RING_ENTRIES_RANGE: (u32, u32) = (16, 32768);

impl EngineParams {
    /// Parses `(key, value)` pairs; returns the params and the keys that were ignored. Every
    /// manifest parameter is read by its entry in `READERS`, from its value or the manifest's
    /// default.
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
        let mut params = EngineParams::unread();
        for (name, read) in READERS {
            let value = values
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .expect("every reader's parameter is in the manifest");
            read(&mut params, value)?;
        }
        Ok((params, ignored))
    }

    /// The params before any parameter is read (every field is set by its reader).
    fn unread() -> EngineParams {
        EngineParams {
            ring_entries: 0,
            fixed_buffers: FixedBuffers::Auto,
            fixed_files: false,
            max_io_size: 0,
            inline_write_max: 0,
            punt_buffered_min: 0,
            page_cache_threads: 0,
            page_cache_file_writers: 0,
            page_cache_writers: 0,
            page_cache_caller_reads: CallerReads::Auto,
            progress_thread: false,
            prep_threads: 0,
            vram_path: VramPath::Auto,
            dram_dmabuf: DramDmabuf::Auto,
            gpu_provider: ProviderChoice::Auto,
            verify_dma: false,
            staging_buffer_size: 0,
            staging_buffers: 0,
            staging_pack_max: 0,
            staging_copy: PackedCopy::Auto,
            staging_kernel_streams: 0,
            staged_write_piece_max: 0,
            page_cache_spin_us: 0,
            staged_read_piece_max: 0,
            staged_write_window: 0,
            cufile_threads: 0,
            cufile_api: CufileApiChoice::Auto,
            record: String::new(),
        }
    }
}

/// Reads one parameter's value into the params (or refuses it, naming the parameter).
type Reader = fn(&mut EngineParams, &str) -> Result<()>;

/// Every manifest parameter and its reader, in the order they are read: a reader may use a
/// parameter read before it (`staging_pack_max`'s auto is half of `staging_buffer_size`).
/// `every_manifest_parameter_has_one_reader` keeps this table and the manifest in step.
const READERS: &[(&str, Reader)] = &[
    ("ring_entries", |p, v| {
        let n = parse_u64("ring_entries", v)?;
        let (lo, hi) = RING_ENTRIES_RANGE;
        if n < lo as u64 || n > hi as u64 {
            return Err(Error::invalid(format!(
                "backend parameter ring_entries={n} is outside {lo}..{hi}"
            )));
        }
        p.ring_entries = n as u32;
        Ok(())
    }),
    ("fixed_buffers", |p, v| {
        p.fixed_buffers = match v.to_ascii_lowercase().as_str() {
            "auto" | "on" | "true" => FixedBuffers::Auto,
            "off" | "false" => FixedBuffers::Off,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter fixed_buffers={other:?} must be auto or off"
                )))
            }
        };
        Ok(())
    }),
    ("fixed_files", |p, v| {
        p.fixed_files = parse_bool("fixed_files", v)?;
        Ok(())
    }),
    ("max_io_size", |p, v| {
        let n = parse_u64("max_io_size", v)?;
        if n != 0 && n < 4096 {
            return Err(Error::invalid(format!(
                "backend parameter max_io_size={n} must be 0 (no split) or at least 4096"
            )));
        }
        p.max_io_size = n;
        Ok(())
    }),
    ("inline_write_max", |p, v| {
        p.inline_write_max = match v {
            // With few CPUs, and those often busy, a hand-off to io_uring's workers loses to
            // copying in the calling thread (POSIX AIO's buffered io_submit copies
            // synchronously): the posting thread writes the whole request
            // (bench/results/2026-12-01-cpu-kv-cache.md).
            "auto" => {
                if usable_cpus() >= 8 {
                    1 << 20
                } else {
                    u64::MAX
                }
            }
            v => parse_u64("inline_write_max", v)?,
        };
        Ok(())
    }),
    ("punt_buffered_min", |p, v| {
        p.punt_buffered_min = match v {
            // Buffered reads go to the page-cache workers, and the posting/polling thread runs
            // queued ones itself (uring/workers.rs `QueueHelper`), so a busy machine loses no
            // more than the hand-off. Every size on 2 or more CPUs (small pieces are grouped
            // into 256 KiB jobs); one CPU: never (no second core to gain). On 16 CPUs, with the
            // caller helping, 8192 scattered 16 KiB DRAM reads ran 23.5 GB/s spread against 3.1
            // from 256 KiB up (POSIX 3.6; 4 KiB 11.7 against 2.3, 64 KiB 26.1 against 3.9:
            // bench/results/2026-12-02-gpu-h200-session21.md).
            "auto" => match usable_cpus() {
                n if n >= 2 => 4096,
                _ => 0,
            },
            v => parse_u64("punt_buffered_min", v)?,
        };
        Ok(())
    }),
    ("page_cache_file_writers", |p, v| {
        let n = match v {
            // Two: a file's buffered writes serialize on its inode lock, so more writers only
            // spin on it (io_uring's io-wq serializes buffered writes per inode the same way);
            // two beat one (one is ready when the other lets go) on the H200, 1.03-1.19x,
            // and no limit spends 2-4x the CPU for less
            // (bench/results/2026-12-01-gpu-h200-issue13.md).
            "auto" => 2,
            v => parse_u64("page_cache_file_writers", v)?,
        };
        if n > 64 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_file_writers={n} must be within 0..64 (0 = no \
                 limit)"
            )));
        }
        p.page_cache_file_writers = n as u32;
        Ok(())
    }),
    ("page_cache_writers", |p, v| {
        let n = match v {
            "auto" => default_page_cache_writers() as u64,
            v => parse_u64("page_cache_writers", v)?,
        };
        if n > 64 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_writers={n} must be within 0..64 (0 = no limit, or \
                 auto)"
            )));
        }
        p.page_cache_writers = n as u32;
        Ok(())
    }),
    ("page_cache_threads", |p, v| {
        p.page_cache_threads = match v {
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
        Ok(())
    }),
    ("page_cache_caller_reads", |p, v| {
        p.page_cache_caller_reads = match v {
            "auto" => CallerReads::Auto,
            v => match parse_bool("page_cache_caller_reads", v) {
                Ok(true) => CallerReads::Always,
                Ok(false) => CallerReads::Never,
                Err(_) => {
                    return Err(Error::invalid(format!(
                        "backend parameter page_cache_caller_reads={v:?} must be auto, true or \
                         false"
                    )))
                }
            },
        };
        Ok(())
    }),
    ("progress_thread", |p, v| {
        p.progress_thread = match v {
            // On 2 CPUs the posting thread does most of a request's work inline and a third
            // thread's wake-ups cost the others: no gain with a 1 ms-sleeping poller
            // (0.91-1.07x) and 2-10 % less READ with a spinning one
            // (bench/results/2026-12-01-cpu-progress-thread.md); on the 16-CPU H200, 1.13x at
            // 16 KiB with a sleeping poller and no loss spinning.
            "auto" => usable_cpus() >= 8,
            v => parse_bool("progress_thread", v)?,
        };
        Ok(())
    }),
    ("prep_threads", |p, v| {
        p.prep_threads = match v {
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
        Ok(())
    }),
    ("vram_path", |p, v| {
        p.vram_path = match v.to_ascii_lowercase().as_str() {
            "auto" => VramPath::Auto,
            "dmabuf" => VramPath::Dmabuf,
            "cufile" => VramPath::Cufile,
            "staging" => VramPath::Staging,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter vram_path={other:?} must be auto, dmabuf, cufile or \
                     staging"
                )))
            }
        };
        Ok(())
    }),
    ("cufile_api", |p, v| {
        p.cufile_api = match v.to_ascii_lowercase().as_str() {
            "auto" => CufileApiChoice::Auto,
            "threads" => CufileApiChoice::Threads,
            "batch" => CufileApiChoice::Batch,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter cufile_api={other:?} must be auto, threads or batch"
                )))
            }
        };
        Ok(())
    }),
    ("dram_dmabuf", |p, v| {
        p.dram_dmabuf = match v.to_ascii_lowercase().as_str() {
            "auto" => DramDmabuf::Auto,
            "on" | "true" => DramDmabuf::On,
            "off" | "false" => DramDmabuf::Off,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter dram_dmabuf={other:?} must be auto, on or off"
                )))
            }
        };
        Ok(())
    }),
    ("gpu_provider", |p, v| {
        p.gpu_provider = ProviderChoice::parse(v).ok_or_else(|| {
            Error::invalid(format!(
                "backend parameter gpu_provider={v:?} must be cuda, rocm, vulkan or auto"
            ))
        })?;
        Ok(())
    }),
    ("verify_dma", |p, v| {
        p.verify_dma = parse_bool("verify_dma", v)?;
        Ok(())
    }),
    ("staging_buffer_size", |p, v| {
        let n = parse_u64("staging_buffer_size", v)?;
        if n < 65536 || n % 4096 != 0 || n > MAX_FIXED_BUFFER {
            return Err(Error::invalid(format!(
                "backend parameter staging_buffer_size={n} must be a multiple of 4096 between \
                 65536 and 1 GiB"
            )));
        }
        p.staging_buffer_size = n;
        Ok(())
    }),
    ("staged_write_piece_max", |p, v| {
        let n = parse_u64("staged_write_piece_max", v)?;
        if n < 4096 || n % 4096 != 0 || n > MAX_FIXED_BUFFER {
            return Err(Error::invalid(format!(
                "backend parameter staged_write_piece_max={n} must be a multiple of 4096 between \
                 4096 and 1 GiB"
            )));
        }
        p.staged_write_piece_max = n;
        Ok(())
    }),
    ("page_cache_spin_us", |p, v| {
        let n = parse_u64("page_cache_spin_us", v)?;
        if n > 10_000 {
            return Err(Error::invalid(format!(
                "backend parameter page_cache_spin_us={n} must be at most 10000"
            )));
        }
        p.page_cache_spin_us = n as u32;
        Ok(())
    }),
    ("staged_read_piece_max", |p, v| {
        let n = parse_u64("staged_read_piece_max", v)?;
        if n % 4096 != 0 || n > MAX_FIXED_BUFFER {
            return Err(Error::invalid(format!(
                "backend parameter staged_read_piece_max={n} must be 0 or a multiple of 4096 up \
                 to 1 GiB"
            )));
        }
        p.staged_read_piece_max = n;
        Ok(())
    }),
    ("staged_write_window", |p, v| {
        let n = parse_u64("staged_write_window", v)?;
        if n % 4096 != 0 {
            return Err(Error::invalid(format!(
                "backend parameter staged_write_window={n} must be a multiple of 4096 (0 = no \
                 limit)"
            )));
        }
        p.staged_write_window = n;
        Ok(())
    }),
    ("staging_pack_max", |p, v| {
        let n = match v {
            // Half a buffer: two pieces or more share one. On the H200 2048 scattered 256 KiB
            // reads ran 41-43 GB/s packed (4 or 8 to a 2 MiB buffer) against 26 a buffer each
            // (the buffer count, not the bytes, capped what was in flight); 512 KiB and 1 MiB
            // gained 1.0-1.1x, 128 KiB stayed equal
            // (bench/results/2026-12-02-gpu-h200-session21.md).
            "auto" => p.staging_buffer_size / 2 / 4096 * 4096,
            v => parse_u64("staging_pack_max", v)?,
        };
        if n % 4096 != 0 || n > p.staging_buffer_size {
            return Err(Error::invalid(format!(
                "backend parameter staging_pack_max={n} must be a multiple of 4096 no larger \
                 than staging_buffer_size ({})",
                p.staging_buffer_size
            )));
        }
        p.staging_pack_max = n;
        Ok(())
    }),
    ("staging_copy", |p, v| {
        p.staging_copy = match v.to_ascii_lowercase().as_str() {
            "auto" => PackedCopy::Auto,
            "batch" => PackedCopy::Batch,
            "kernel" => PackedCopy::Kernel,
            "dma-kernel" => PackedCopy::DmaKernel,
            other => {
                return Err(Error::invalid(format!(
                    "backend parameter staging_copy={other:?} must be auto, batch, kernel or \
                     dma-kernel"
                )))
            }
        };
        Ok(())
    }),
    ("staging_kernel_streams", |p, v| {
        let n = parse_u64("staging_kernel_streams", v)?;
        if !(1..=4).contains(&n) {
            return Err(Error::invalid(format!(
                "backend parameter staging_kernel_streams={n} must be within 1..4"
            )));
        }
        p.staging_kernel_streams = n as u32;
        Ok(())
    }),
    ("staging_buffers", |p, v| {
        let n = parse_u64("staging_buffers", v)?;
        if !(2..=256).contains(&n) {
            return Err(Error::invalid(format!(
                "backend parameter staging_buffers={n} must be within 2..256"
            )));
        }
        p.staging_buffers = n as u32;
        Ok(())
    }),
    ("cufile_threads", |p, v| {
        let n = parse_u64("cufile_threads", v)?;
        if !(1..=64).contains(&n) {
            return Err(Error::invalid(format!(
                "backend parameter cufile_threads={n} must be within 1..64"
            )));
        }
        p.cufile_threads = n as u32;
        Ok(())
    }),
    ("record", |p, v| {
        p.record = v.to_owned();
        Ok(())
    }),
];

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

    #[test]
    fn every_manifest_parameter_has_one_reader() {
        let mut read: Vec<&str> = READERS.iter().map(|(name, _)| *name).collect();
        let mut declared: Vec<&str> = manifest::PARAMS.iter().map(|p| p.name).collect();
        read.sort_unstable();
        declared.sort_unstable();
        assert_eq!(read, declared);
    }
}
