//! Backend parameters: the values of the manifest's parameters for one engine.
//!
//! Parameters the manifest does not declare are ignored with one debug line (LMCache passes its
//! own keys such as `file_path` and `use_direct_io` straight into create_backend). A declared
//! parameter with a malformed value fails engine creation with a message naming it.

use crate::gpu::{PackedCopy, ProviderChoice};

mod readers;

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
}

impl Default for EngineParams {
    fn default() -> Self {
        Self::parse(std::iter::empty())
            .expect("manifest defaults parse")
            .0
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
