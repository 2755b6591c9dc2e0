//! The engine's progress thread: moves running requests on while nobody polls them.
//!
//! The staging pipeline (storage read -> device copy -> buffer reused for the next group) and a
//! request larger than the ring advance only inside `Driver::post` / `check`. A client that
//! sleeps between checkXfer calls (LMCache sleeps 1 ms) would leave the pipeline idle in
//! between: staged KV READs run 0-41 % slower on the H200 without this thread
//! (bench/results/2026-12-01-gpu-h200-session20.md).
//! This thread runs the same `progress` while requests are running and no caller has been in
//! the driver for a while; it never waits for the driver's lock (a busy caller is driving).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use super::driver::background::Background;
use super::driver::Driver;

/// Pause between rounds while requests run (timer slack makes it about 50-100 us); it doubles,
/// up to `WAIT_MAX`, while rounds find nothing completed (long disk I/O, a worker's long copy).
const TICK: Duration = Duration::from_micros(50);
const WAIT_MAX: Duration = Duration::from_micros(800);
/// Pause while a caller polls (it drives the requests; this thread only watches for it to
/// stop), doubling up to `POLLED_MAX` while it goes on: each wake-up costs the others a little
/// on a small machine.
const POLLED: Duration = Duration::from_micros(200);
const POLLED_MAX: Duration = Duration::from_millis(2);
/// Longest sleep with nothing running (a post unparks the thread sooner).
const IDLE: Duration = Duration::from_millis(100);

/// The thread and its stop flag; dropping it stops and joins the thread.
pub struct ProgressThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl ProgressThread {
    /// Starts the thread for `driver`; None (logged) if the system refuses a thread, in which
    /// case requests advance only when polled, as before.
    pub fn start(driver: Weak<Driver>) -> Option<ProgressThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        match std::thread::Builder::new()
            .name("iud-progress".into())
            .spawn(move || run(&driver, &flag))
        {
            Ok(handle) => Some(ProgressThread {
                stop,
                handle: Some(handle),
            }),
            Err(e) => {
                tracing::info!(
                    "progress thread not started ({e}); requests advance only when polled"
                );
                None
            }
        }
    }

    /// Wakes the thread (a request was posted).
    pub fn wake(&self) {
        if let Some(h) = &self.handle {
            h.thread().unpark();
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

fn run(driver: &Weak<Driver>, stop: &AtomicBool) {
    let (mut wait, mut polled) = (TICK, POLLED);
    while !stop.load(Ordering::Acquire) {
        // The driver is held only for one round, so the engine can always drop it after joining.
        let next = match driver.upgrade() {
            Some(d) => d.background_progress(),
            None => return,
        };
        match next {
            Background::Waiting => {
                wait = (wait * 2).min(WAIT_MAX);
                polled = POLLED;
                std::thread::sleep(wait);
                continue;
            }
            Background::Polled => {
                polled = (polled * 2).min(POLLED_MAX);
                wait = TICK;
                std::thread::sleep(polled);
                continue;
            }
            Background::Busy => std::thread::sleep(TICK),
            Background::Idle => std::thread::park_timeout(IDLE),
        }
        (wait, polled) = (TICK, POLLED);
    }
}
