//! Helper threads that plan one large prepXfer's descriptor lists in parts at once.
//!
//! A client prepares a request per job, and NIXL calls prepXfer on the client's thread each
//! time: 8192 scattered KV blocks cost the plugin about 0.3 ms on the H200, spent evenly over
//! validating and cutting the descriptors. The parts are independent, so a few threads kept for
//! it cut that time: four plan them in 242-250 us against 298-311 us for one
//! (bench/results/2026-12-05-per-request-h200-midday.md). Waking the helpers and joining their
//! ops is most of what is left (bench/results/2026-12-05-prep-parts-cpu.md).
//!
//! The caller always plans part 0 itself and takes further parts as long as any are left, so a
//! helper that wakes late (a busy machine) costs nothing but the parts it did not take. One job
//! runs at a time; a prepXfer that finds the pool busy plans alone (its caller's thread is
//! already one of several preparing at once).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the caller watches for the helpers' last parts before it sleeps: a part takes
/// 0.05-0.2 ms, and a sleeping caller woke 30-40 us after the last one ended (2-CPU VM).
const CALLER_SPIN: Duration = Duration::from_micros(300);

/// The work of one job: called once with each part index.
type Work<'a> = dyn Fn(usize) + Sync + 'a;

/// A job's work with its lifetime erased. `PrepPool::run` does not return while a helper may
/// still call it (see there), which is what makes the erasure sound.
#[derive(Clone, Copy)]
struct WorkRef(*const Work<'static>);

// SAFETY: the pointee is `Sync` (shared calls from several threads are allowed), and it outlives
// every use: `run` waits until no helper holds a part before it returns.
unsafe impl Send for WorkRef {}

#[derive(Default)]
struct State {
    work: Option<WorkRef>,
    /// The next part to take, and how many the job has.
    next: usize,
    parts: usize,
    /// A helper's part panicked; `run` re-raises it on the caller's thread.
    panicked: Option<Box<dyn std::any::Any + Send>>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Parts taken by helpers and not yet finished. Changed only under `state`'s lock (the
    /// condvars' predicate), read without it by the caller's spin.
    helping: AtomicUsize,
    /// Helpers wait here for a job.
    wake: Condvar,
    /// The caller waits here for the helpers' last parts.
    done: Condvar,
}

impl Shared {
    /// The state; the lock guards only plain counters, so a poisoned one is still consistent.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Threads that take parts of a prepXfer beside the thread that called it.
pub struct PrepPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl PrepPool {
    /// Starts `helpers` threads; None when none could start (prepXfer then plans alone).
    pub fn start(helpers: usize) -> Option<PrepPool> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            helping: AtomicUsize::new(0),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let mut threads = Vec::new();
        for k in 0..helpers {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name(format!("iud-prep-{k}"))
                .spawn(move || help(&s))
            {
                Ok(t) => threads.push(t),
                Err(e) => {
                    tracing::warn!(
                        "prepXfer helper thread {k} did not start ({e}); {} of {helpers} run",
                        threads.len()
                    );
                    break;
                }
            }
        }
        if threads.is_empty() {
            return None;
        }
        Some(PrepPool { shared, threads })
    }

    /// Threads that may work on one job: the helpers and the caller.
    pub fn width(&self) -> usize {
        self.threads.len() + 1
    }

    /// Calls `work(p)` once for every part `p` in `0..parts`, part 0 on this thread, the others
    /// on whichever thread takes them first, and returns when all are done. Returns false, having
    /// called nothing, when another job is running (the caller then does the work itself).
    pub fn run(&self, parts: usize, work: &Work<'_>) -> bool {
        {
            let mut st = self.shared.lock();
            if st.work.is_some() || st.stop {
                return false;
            }
            // SAFETY: only the lifetime is erased; see `WorkRef` and the wait below.
            let erased: *const Work<'static> =
                unsafe { std::mem::transmute(work as *const Work<'_>) };
            *st = State {
                work: Some(WorkRef(erased)),
                next: 1,
                parts,
                panicked: None,
                stop: false,
            };
        }
        self.shared.wake.notify_all();
        let mut failed = catch_unwind(AssertUnwindSafe(|| work(0))).err();
        let mut st = self.shared.lock();
        while st.next < st.parts {
            let p = st.next;
            st.next += 1;
            drop(st);
            if let Err(e) = catch_unwind(AssertUnwindSafe(|| work(p))) {
                failed.get_or_insert(e);
            }
            st = self.shared.lock();
        }
        // Every part is taken; wait for those the helpers hold. After this no helper can reach
        // `work` again: none holds a part and none is left to take.
        let helping = || self.shared.helping.load(Ordering::Acquire) > 0;
        if helping() {
            drop(st);
            let since = Instant::now();
            while helping() && since.elapsed() < CALLER_SPIN {
                std::hint::spin_loop();
            }
            st = self.shared.lock();
        }
        while helping() {
            st = self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.work = None;
        let helper_panic = st.panicked.take();
        drop(st);
        if let Some(e) = failed.or(helper_panic) {
            resume_unwind(e);
        }
        true
    }
}

/// A helper's loop: take parts of the running job until told to stop.
fn help(shared: &Shared) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        match st.work {
            Some(work) if st.next < st.parts => {
                let p = st.next;
                st.next += 1;
                shared.helping.fetch_add(1, Ordering::AcqRel);
                drop(st);
                // SAFETY: `run` keeps the work alive while `Shared::helping` counts this part.
                let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*work.0)(p) }));
                st = shared.lock();
                if let Err(e) = result {
                    st.panicked.get_or_insert(e);
                }
                let still = shared.helping.fetch_sub(1, Ordering::AcqRel) - 1;
                if still == 0 && st.next >= st.parts {
                    shared.done.notify_all();
                }
            }
            _ => st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

impl Drop for PrepPool {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_exactly_once_and_part_0_on_the_caller() {
        let pool = PrepPool::start(3).expect("helpers");
        for parts in [1, 2, 4, 7, 32] {
            let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            let caller = std::thread::current().id();
            let part0_here = AtomicUsize::new(0);
            assert!(pool.run(parts, &|p| {
                counts[p].fetch_add(1, Ordering::Relaxed);
                if p == 0 && std::thread::current().id() == caller {
                    part0_here.fetch_add(1, Ordering::Relaxed);
                }
            }));
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "{parts} parts: each once"
            );
            assert_eq!(part0_here.load(Ordering::Relaxed), 1);
        }
    }

    #[test]
    fn run_returns_only_after_the_helpers_parts_are_done() {
        let pool = PrepPool::start(2).expect("helpers");
        for _ in 0..50 {
            let finished = AtomicUsize::new(0);
            assert!(pool.run(6, &|p| {
                if p % 2 == 1 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                finished.fetch_add(1, Ordering::SeqCst);
            }));
            assert_eq!(finished.load(Ordering::SeqCst), 6);
        }
    }

    #[test]
    fn a_second_job_while_one_runs_is_refused_and_the_first_completes() {
        let pool = Arc::new(PrepPool::start(1).expect("helpers"));
        let (entered, release) = (
            Arc::new(std::sync::Barrier::new(2)),
            Arc::new(std::sync::Barrier::new(2)),
        );
        let first = {
            let (pool, entered, release) = (
                Arc::clone(&pool),
                Arc::clone(&entered),
                Arc::clone(&release),
            );
            std::thread::spawn(move || {
                pool.run(1, &|_| {
                    entered.wait();
                    release.wait();
                })
            })
        };
        entered.wait();
        assert!(!pool.run(2, &|_| panic!("a refused job must not run")));
        release.wait();
        assert!(first.join().unwrap());
        assert!(
            pool.run(2, &|_| {}),
            "free again once the first job returned"
        );
    }

    #[test]
    fn a_panicking_part_reaches_the_caller_after_every_part_ended() {
        let pool = PrepPool::start(2).expect("helpers");
        let finished = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|p| {
                if p == 5 {
                    panic!("part 5");
                }
                finished.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::SeqCst), 7);
        assert!(pool.run(3, &|_| {}), "the pool works after a panic");
    }
}
