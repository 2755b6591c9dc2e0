//! Process CPU time (getrusage) for the "CPU s/GB" columns, and the median of rounds.

/// User + system CPU seconds used so far by every thread of this process (RUSAGE_SELF: NIXL's,
/// the plugin's and io_uring's worker threads included; child processes such as the background
/// load are not).
pub fn process_cpu_s() -> f64 {
    // SAFETY: rusage is plain old data that getrusage fills.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer; RUSAGE_SELF cannot fail.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds per GB (1e9 bytes) moved; NaN when nothing moved.
pub fn per_gb(cpu_s: f64, bytes: f64) -> f64 {
    if bytes > 0.0 {
        cpu_s / (bytes / 1e9)
    } else {
        f64::NAN
    }
}

/// Median (the mean of the middle two for an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_rates() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(per_gb(0.5, 2e9), 0.25);
        assert!(per_gb(1.0, 0.0).is_nan());
    }

    #[test]
    fn cpu_time_grows_with_work() {
        let t0 = process_cpu_s();
        let mut x = 1u64;
        let start = std::time::Instant::now();
        while start.elapsed().as_millis() < 50 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        assert!(process_cpu_s() > t0, "50 ms of spinning used no CPU time");
    }
}
