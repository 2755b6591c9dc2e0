//! How many page-cache workers, and writers among them, an engine starts by default.

/// Page-cache workers for punted ops by default: at most this many (16 on the H200 already read
/// a cached file faster than the host-to-GPU copy takes it; `page_cache_threads` sets another).
const PAGE_CACHE_WORKERS_DEFAULT_MAX: usize = 16;

/// Writers among them by default: at most this many (see `default_page_cache_writers`).
const PAGE_CACHE_WRITERS_DEFAULT_MAX: usize = 8;

/// How many page-cache worker threads an engine starts by default: the CPUs less two (one for
/// the thread that posts and polls, which runs queued reads and starts device copies, one for the
/// rest of the application), 1 to 16. On the 16-CPU H200, 12 or 14 workers read scattered
/// 32-256 KiB blocks into VRAM 1.1-1.3x faster per request than 8, and 16 lost at 16 KiB
/// (bench/results/2026-12-04-per-request-h200.md). 2 CPUs get one worker beside the caller.
/// Asked once per process (the answer reads cgroup files).
pub fn default_page_cache_threads() -> usize {
    static THREADS: once_cell::sync::OnceCell<usize> = once_cell::sync::OnceCell::new();
    *THREADS
        .get_or_init(|| (usable_cpus().saturating_sub(2)).clamp(1, PAGE_CACHE_WORKERS_DEFAULT_MAX))
}

/// How many page-cache workers may write at once by default, all files together: half the CPUs,
/// 1 to 8, so that a burst of stores spread over many files leaves the other workers, and their
/// cores, to reads.
pub fn default_page_cache_writers() -> usize {
    (usable_cpus() / 2).clamp(1, PAGE_CACHE_WRITERS_DEFAULT_MAX)
}

/// The CPUs this process may run on (cgroup and affinity limits included; 1 if unknown).
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
