//! Anonymous host mappings for the plugin's own copy buffers (the staging pool), 2 MiB aligned
//! and advised for transparent huge pages, populated before use.
//!
//! The page-cache workers copy between these buffers and the page cache with plain
//! pread/pwrite, through the buffers' user addresses, so the kernel's copy walks their page
//! tables: 16384 entries for a 64 MiB pool of 4 KiB pages. On the 2-CPU machine, one thread
//! cycling through 64 MiB copied 5-8 % faster with huge pages at 256 KiB and 2 MiB pieces
//! (pwrite 256 KiB: 3.49 against 3.23 GB/s; pread 2 MiB: 7.74 against 7.25), and level within
//! an 8 MiB window (bench/results/2026-12-05-staging-huge-pages-cpu.md). Where THP is off
//! (`/sys/kernel/mm/transparent_hugepage/enabled` = never) the advice does nothing and the
//! mapping is plain 4 KiB pages.

use std::io;

/// The size of a PMD-mapped transparent huge page on x86-64 and arm64 with 4 KiB pages.
const HUGE_PAGE: u64 = 2 << 20;

/// Maps `len` bytes of private anonymous memory, aligned to `HUGE_PAGE` when `len` is at least
/// that, advised for huge pages and populated. The caller unmaps exactly `(base, len)`.
pub fn map_populated(len: u64) -> io::Result<u64> {
    let align = if len >= HUGE_PAGE { HUGE_PAGE } else { 0 };
    let reserve = (len + align) as usize;
    // SAFETY: a fresh anonymous private mapping; checked for MAP_FAILED below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let raw = raw as u64;
    let base = if align > 0 {
        raw.div_ceil(align) * align
    } else {
        raw
    };
    // The reserve's head and tail outside [base, base + len) go back; only our own mapping is cut.
    let (head, tail) = (base - raw, raw + reserve as u64 - (base + len));
    // SAFETY: both ranges lie inside the mapping made above and nothing uses them.
    unsafe {
        if head > 0 {
            libc::munmap(raw as *mut libc::c_void, head as usize);
        }
        if tail > 0 {
            libc::munmap((base + len) as *mut libc::c_void, tail as usize);
        }
    }
    let ptr = base as *mut libc::c_void;
    if align > 0 {
        // SAFETY: advice on our own mapping. EINVAL means no THP in this kernel: 4 KiB pages.
        if unsafe { libc::madvise(ptr, len as usize, libc::MADV_HUGEPAGE) } != 0 {
            tracing::debug!(
                "staging memory: no huge-page advice ({}); 4 KiB pages",
                io::Error::last_os_error()
            );
        }
    }
    // Populated after the advice (MAP_POPULATE would fault 4 KiB pages in first), so that the
    // faults can take huge pages. Kernels before 5.14 lack MADV_POPULATE_WRITE: touch each page.
    // SAFETY: populating our own mapping.
    if unsafe { libc::madvise(ptr, len as usize, libc::MADV_POPULATE_WRITE) } != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            // SAFETY: unmapping what we mapped; nothing else has seen it.
            unsafe { libc::munmap(ptr, len as usize) };
            return Err(err);
        }
        for off in (0..len).step_by(4096) {
            // SAFETY: inside the mapping, which is writable.
            unsafe { std::ptr::write_volatile((base + off) as *mut u8, 0) };
        }
    }
    Ok(base)
}

/// Bytes of `[base, base + len)` backed by huge pages now, from /proc/self/smaps, and whether
/// the mapping carries the advice; None if smaps cannot be read or no mapping is exactly that
/// range (without the advice, a mapping may have merged with a neighbour).
pub fn huge_backed(base: u64, len: u64) -> Option<(u64, bool)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut lines = smaps.lines();
    while let Some(line) = lines.next() {
        let Some((range, _)) = line.split_once(' ') else {
            continue;
        };
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        if start != base || end != base + len {
            continue;
        }
        let (mut huge, mut advised) = (0u64, false);
        for field in lines.by_ref() {
            if let Some(kb) = field.strip_prefix("AnonHugePages:") {
                huge = kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()?
                    << 10;
            } else if let Some(flags) = field.strip_prefix("VmFlags:") {
                advised = flags.split_whitespace().any(|f| f == "hg");
                break;
            }
        }
        return Some((huge, advised));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thp_mode() -> String {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default()
    }

    #[test]
    fn a_mapping_is_aligned_populated_advised_and_holds_what_is_written() {
        let len = 3 * HUGE_PAGE + 4096 * 3;
        let base = map_populated(len).expect("map");
        assert_eq!(base % HUGE_PAGE, 0, "2 MiB aligned");
        // Populated: every page resident before anything touched it here.
        let pages = (len / 4096) as usize;
        let mut resident = vec![0u8; pages];
        // SAFETY: mincore on our own mapping, with one byte per page.
        let rc = unsafe {
            libc::mincore(
                base as *mut libc::c_void,
                len as usize,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        assert!(resident.iter().all(|r| r & 1 == 1), "every page populated");
        // SAFETY: the mapping is ours and writable for len bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len as usize) };
        bytes
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 251) as u8);
        assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        // With THP available the advice sets the mapping apart from its neighbours (VmFlags hg);
        // without it, the mapping may merge with a neighbour and there is nothing to check.
        let thp = thp_mode();
        if thp.contains('[') && !thp.contains("[never]") {
            let (huge, advised) =
                huge_backed(base, len).expect("the advised mapping is one entry of smaps");
            assert!(
                advised,
                "the huge-page advice is on the mapping (VmFlags hg)"
            );
            assert!(huge <= len);
        } else {
            println!("transparent huge pages unavailable here ({thp:?}): advice not checked");
        }
        // SAFETY: unmapping exactly what map_populated handed out.
        let rc = unsafe { libc::munmap(base as *mut libc::c_void, len as usize) };
        assert_eq!(rc, 0);
        assert!(
            huge_backed(base, len).is_none(),
            "the mapping is gone after munmap"
        );
    }

    #[test]
    fn a_mapping_below_a_huge_page_is_populated_and_unmaps_whole() {
        let len = 64u64 << 10;
        let base = map_populated(len).expect("map");
        assert_eq!(base % 4096, 0);
        let mut resident = vec![0u8; (len / 4096) as usize];
        // SAFETY: mincore on our own mapping, with one byte per page.
        let rc = unsafe {
            libc::mincore(
                base as *mut libc::c_void,
                len as usize,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        assert!(resident.iter().all(|r| r & 1 == 1), "every page populated");
        // SAFETY: unmapping exactly what map_populated handed out.
        let rc = unsafe { libc::munmap(base as *mut libc::c_void, len as usize) };
        assert_eq!(rc, 0);
    }
}
