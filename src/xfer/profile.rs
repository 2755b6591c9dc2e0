//! Opt-in per-request timing breakdown (IO_URING_DMABUF_PROFILE=1): time in storage I/O, in
//! starting device copies and in waiting for them, with counts, logged once per request at INFO;
//! and each prepXfer's own time (=1, or =prep for that alone: timing every I/O slows requests).
//!
//! Storage time is the sum of each I/O's time from hand-over to reaped result (queueing on the
//! workers included, so it exceeds the wall time when I/Os overlap); copy wait is the sum of each
//! copy's time from start to the poll that saw it end. Off by default: nothing is timed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use once_cell::sync::Lazy;

/// (requests, prepXfer) profiled, from IO_URING_DMABUF_PROFILE (read once).
static ENABLED: Lazy<(bool, bool)> =
    Lazy::new(
        || match std::env::var("IO_URING_DMABUF_PROFILE").as_deref() {
            Ok("1") => (true, true),
            Ok("prep") => (false, true),
            _ => (false, false),
        },
    );

/// Whether each prepXfer's time is logged.
pub fn prep_enabled() -> bool {
    ENABLED.1
}

/// Logs one prepXfer's own time (NIXL's work around it is not in it), when profiling.
pub fn prep_done(since: Option<Instant>, descriptors: usize, ops: usize) {
    if let Some(t0) = since {
        tracing::info!(
            "profile: prepXfer of {descriptors} descriptors into {ops} ops in {:.1} us",
            t0.elapsed().as_secs_f64() * 1e6
        );
    }
}

#[derive(Default)]
struct Profile {
    start: Option<Instant>,
    io: Duration,
    ios: u64,
    copy_submit: Duration,
    copy_wait: Duration,
    copies: u64,
    groups: u64,
    pieces: u64,
    /// Since `start`: the first and the last storage I/O reaped, the first device copy started,
    /// the last one seen done (where a request's fixed latency goes: the pipeline's fill, drain).
    first_io: Option<Duration>,
    last_io: Duration,
    first_copy: Option<Duration>,
    last_copy: Duration,
}

impl Profile {
    fn since_start(&self) -> Duration {
        self.start.map_or(Duration::ZERO, |s| s.elapsed())
    }
}

/// The profiles of running requests, by driver key; empty and inert unless enabled.
#[derive(Default)]
pub struct Profiles {
    on: bool,
    running: HashMap<usize, Profile>,
}

impl Profiles {
    pub fn from_env() -> Profiles {
        Profiles {
            on: ENABLED.0,
            running: HashMap::new(),
        }
    }

    pub fn on(&self) -> bool {
        self.on
    }

    /// Now, when profiling (a cheap None otherwise).
    pub fn now(&self) -> Option<Instant> {
        self.on.then(Instant::now)
    }

    fn get(&mut self, key: usize) -> Option<&mut Profile> {
        if !self.on {
            return None;
        }
        Some(self.running.entry(key).or_default())
    }

    pub fn start(&mut self, key: usize) {
        if let Some(p) = self.get(key) {
            *p = Profile {
                start: Some(Instant::now()),
                ..Profile::default()
            };
        }
    }

    pub fn io_done(&mut self, key: usize, since: Instant) {
        if let Some(p) = self.get(key) {
            p.io += since.elapsed();
            p.ios += 1;
            let at = p.since_start();
            p.first_io.get_or_insert(at);
            p.last_io = at;
        }
    }

    /// A staging buffer was filled with `pieces` pieces.
    pub fn group(&mut self, key: usize, pieces: usize) {
        if let Some(p) = self.get(key) {
            p.groups += 1;
            p.pieces += pieces as u64;
        }
    }

    pub fn copy_submitted(&mut self, key: usize, t0: Option<Instant>) {
        if let (Some(t0), Some(p)) = (t0, self.get(key)) {
            p.copy_submit += t0.elapsed();
            p.copies += 1;
            let at = p.since_start();
            p.first_copy.get_or_insert(at);
        }
    }

    pub fn copy_waited(&mut self, key: usize, started: Instant) {
        if let Some(p) = self.get(key) {
            p.copy_wait += started.elapsed();
            p.last_copy = p.since_start();
        }
    }

    /// Logs and forgets the request's profile.
    pub fn finish(&mut self, key: usize, ok: bool) {
        if !self.on {
            return;
        }
        let Some(p) = self.running.remove(&key) else {
            return;
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::info!(
            "profile: request {} in {:.3} ms: storage I/O {:.3} ms summed over {} I/Os; device \
             copies: {} started in {:.3} ms, waited {:.3} ms summed; {} staging buffers holding \
             {} pieces; first / last I/O reaped at {:.3} / {:.3} ms, first copy started at {:.3} \
             ms, last seen done at {:.3} ms",
            if ok { "done" } else { "failed" },
            p.start.map_or(0.0, |s| ms(s.elapsed())),
            ms(p.io),
            p.ios,
            p.copies,
            ms(p.copy_submit),
            ms(p.copy_wait),
            p.groups,
            p.pieces,
            ms(p.first_io.unwrap_or_default()),
            ms(p.last_io),
            ms(p.first_copy.unwrap_or_default()),
            ms(p.last_copy)
        );
    }
}
