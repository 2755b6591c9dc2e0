//! The progress thread's round (`xfer::progress`): the driver's `progress`, run when requests
//! are running, no caller is in post/check or just left it, and the lock is free.

use std::sync::TryLockError;

use super::{Driver, Staging, Table};

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
    /// running, no caller is in post/check or just left it (`CallerClock::driving`) and the
    /// lock is free (it never waits for it). An error is left for the next caller, which meets
    /// it too.
    pub fn background_progress(&self) -> Background {
        if self.callers.driving() {
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
        !self.queue.is_empty()
            || !self.retry.is_empty()
            || !self.owners.is_empty()
            || self.staging.as_ref().is_some_and(Staging::copying)
    }
}
