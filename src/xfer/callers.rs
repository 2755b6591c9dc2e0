//! Whether a caller is driving the requests: threads inside postXfer/checkXfer, and when the
//! last one left. The progress thread keeps out of their way (`driver/background.rs`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A caller that left this recently is taken as still polling (a spinning poller is back within
/// microseconds).
const RECENT: Duration = Duration::from_micros(100);

/// Counts the callers inside the driver and remembers the last exit.
pub struct CallerClock {
    inside: AtomicUsize,
    /// Nanoseconds since `epoch` of the last exit.
    last_exit: AtomicU64,
    epoch: Instant,
}

/// One caller inside; leaving is its drop.
pub struct Inside<'a>(&'a CallerClock);

impl Default for CallerClock {
    fn default() -> Self {
        CallerClock {
            inside: AtomicUsize::new(0),
            last_exit: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl CallerClock {
    pub fn enter(&self) -> Inside<'_> {
        self.inside.fetch_add(1, Ordering::AcqRel);
        Inside(self)
    }

    /// A caller is inside, or left within `RECENT`.
    pub fn driving(&self) -> bool {
        if self.inside.load(Ordering::Acquire) > 0 {
            return true;
        }
        let now = self.epoch.elapsed().as_nanos() as u64;
        now.saturating_sub(self.last_exit.load(Ordering::Acquire)) < RECENT.as_nanos() as u64
    }
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0
            .last_exit
            .store(self.0.epoch.elapsed().as_nanos() as u64, Ordering::Release);
        self.0.inside.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_drives_while_inside_and_not_once_it_is_long_gone() {
        let c = CallerClock::default();
        std::thread::sleep(RECENT * 2);
        assert!(!c.driving(), "nobody has been inside");
        let inside = c.enter();
        std::thread::sleep(RECENT * 2);
        assert!(c.driving(), "inside for longer than RECENT still drives");
        drop(inside);
        std::thread::sleep(RECENT * 2);
        assert!(!c.driving(), "left longer than RECENT ago");
    }
}
