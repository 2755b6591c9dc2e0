//! One PASS/FAIL/SKIP line per test, and the final `LAB RESULT:` line run-lab.sh parses.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// What a test found. The string is the reason printed after the test's name.
pub enum Outcome {
    Pass(String),
    Fail(String),
    Skip(String),
}

/// Tests return `Err(reason)` for a failure; `?` on anything that formats as a reason.
pub type TestResult = Result<Outcome, String>;

#[derive(Default)]
pub struct Report {
    pub passed: u32,
    pub failed: u32,
    pub skipped: u32,
}

impl Report {
    /// Runs one test; a panic inside it is a FAIL with the panic message, never a crash of /init.
    pub fn run(&mut self, name: &str, test: impl FnOnce() -> TestResult) {
        let t0 = Instant::now();
        let outcome = match catch_unwind(AssertUnwindSafe(test)) {
            Ok(Ok(o)) => o,
            Ok(Err(reason)) => Outcome::Fail(reason),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "non-string panic payload".to_owned());
                Outcome::Fail(format!("panicked: {msg}"))
            }
        };
        let ms = t0.elapsed().as_millis();
        let (tag, reason) = match outcome {
            Outcome::Pass(r) => {
                self.passed += 1;
                ("PASS", r)
            }
            Outcome::Fail(r) => {
                self.failed += 1;
                ("FAIL", r)
            }
            Outcome::Skip(r) => {
                self.skipped += 1;
                ("SKIP", r)
            }
        };
        println!("{tag} {name}: {reason} [{ms} ms]");
        let _ = std::io::stdout().flush();
    }

    pub fn summary_line(&self) -> String {
        format!(
            "LAB RESULT: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.skipped
        )
    }
}

/// An informational line (not a test).
pub fn info(msg: impl AsRef<str>) {
    println!("INFO {}", msg.as_ref());
    let _ = std::io::stdout().flush();
}
