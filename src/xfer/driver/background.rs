//! The progress thread's round (`xfer::progress`): the driver's `progress`, run when requests
//! are running, no caller was in post/check lately and the lock is free.

use std::sync::atomic::Ordering;
use std::sync::TryLockError;
use std::time::Duration;

use super::{Driver, Staging, Table};

/// A caller in post/check this recently is driving the requests itself: the progress thread
/// keeps out of its way (a spinning poller is back within microseconds).
const CALLER_ACTIVE: Duration = Duration::from_micros(100);

/// What the progress thread should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    /// Requests are running and this round handled completions: come back soon.
    Busy,
    /// Requests are running but nothing had completed: come back a little later each time.
    Waiting,
    /// A caller is polling: come back later.
    Polled,
    /// Nothing is running (or the engine failed): sleep until a post.
    Idle,
}

impl Driver {
    /// One round of the progress thread (`xfer::progress`): runs `progress` if requests are
    /// running, no caller was in post/check within `CALLER_ACTIVE` and the lock is free (it never
    /// waits for it). An error is left for the next caller, which meets it too.
    pub fn background_progress(&self) -> Background {
        let since = (self.epoch.elapsed().as_nanos() as u64).saturating_sub(self.last_call.load(Ordering::Relaxed));
        if since < CALLER_ACTIVE.as_nanos() as u64 {
            return Background::Polled;
        }
        let mut t = match self.table.try_lock() {
            Ok(t) => t,
            Err(TryLockError::WouldBlock) => return Background::Polled,
            Err(TryLockError::Poisoned(_)) => return Background::Idle,
        };
        if !t.has_work() {
            return Background::Idle;
        }
        match t.progress(&self.ring) {
            Ok(0) => Background::Waiting,
            Ok(_) => Background::Busy,
            Err(e) => {
                tracing::debug!("progress thread: {} (left for the next caller)", e.message);
                Background::Idle
            }
        }
    }
}

impl Table {
    /// Whether any request has ops waiting, in flight or in a device copy.
    fn has_work(&self) -> bool {
        !self.queue.is_empty() || !self.retry.is_empty() || !self.owners.is_empty() || self.staging.as_ref().is_some_and(Staging::copying)
    }
}
