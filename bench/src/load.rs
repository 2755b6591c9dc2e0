//! --background_load: CPU-bound busy-loop child processes that make the machine busy for the
//! whole run, started before any thread exists and killed (and reaped) when dropped.

/// The running busy processes.
pub struct BackgroundLoad {
    pids: Vec<libc::pid_t>,
    /// The nice value the children inherited.
    nice: i32,
}

impl BackgroundLoad {
    /// Forks `n` busy processes. Call before any thread is started (fork copies only the caller).
    pub fn start(n: usize) -> Result<Self, String> {
        // SAFETY: plain syscall; -1 is a valid nice value, so errno is not checked (never fails for self).
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let mut load = Self {
            pids: Vec::new(),
            nice,
        };
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        for _ in 0..n {
            // SAFETY: single-threaded here (see above); the child only spins and _exits.
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(format!(
                    "fork for --background_load: {}",
                    std::io::Error::last_os_error()
                ));
            }
            if pid == 0 {
                busy_child(parent);
            }
            load.pids.push(pid);
        }
        Ok(load)
    }

    pub fn describe(&self) -> String {
        if self.pids.is_empty() {
            return "none".into();
        }
        let pids: Vec<String> = self.pids.iter().map(|p| p.to_string()).collect();
        format!(
            "{} CPU-bound busy-loop process(es) (pids {}, nice {} like the benchmark), running from before setup to the end",
            self.pids.len(),
            pids.join(" "),
            self.nice
        )
    }
}

/// Spins until killed: by the parent's Drop, or by the kernel when the parent dies.
fn busy_child(parent: libc::pid_t) -> ! {
    // SAFETY: prctl/getppid/_exit are async-signal-safe, so fine after fork.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        if libc::getppid() != parent {
            libc::_exit(0);
        }
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    loop {
        for _ in 0..1_000_000 {
            x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ 1);
        }
    }
}

impl Drop for BackgroundLoad {
    fn drop(&mut self) {
        for &pid in &self.pids {
            // SAFETY: our own children; SIGKILL then reap so none is left as a zombie.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// /proc/loadavg's first three fields.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
