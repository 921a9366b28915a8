//! The harness of the device test binaries (`harness = false`, their own `main`): the CUDA and
//! NCCL tests of tensor, nn, fsdp and collectives.
//!
//! Those binaries cannot use libtest's `#[test]`: whether a device test runs depends on the
//! machine and on [`GPU_ENV`], and a test asked for on a machine without a GPU must fail the
//! binary rather than pass by skipping. Each binary therefore counts its own outcomes in a
//! [`Tally`] and turns it into the exit code.

use std::fmt;
use std::process::ExitCode;

/// Set to `1` to ask for the device tests: a binary that cannot then open a device fails.
pub const GPU_ENV: &str = "HYPERSHARD_TEST_GPU";

/// One test's result: `Err` holds the reason it failed.
pub type Outcome = Result<(), String>;

/// An error's message, for `map_err` inside a test.
pub fn fail(error: impl fmt::Display) -> String {
    error.to_string()
}

/// Whether [`GPU_ENV`] asks for the device tests.
pub fn gpu_asked() -> bool {
    std::env::var(GPU_ENV).is_ok_and(|v| v == "1")
}

/// Runs one test, turning a panic (one inside cudarc, say a symbol missing from a newer CUDA
/// library) into a failure of that test, so the tests after it still run and report.
pub fn contained(test: impl FnOnce() -> Outcome) -> Outcome {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(test)) {
        Ok(outcome) => outcome,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a non-string panic".to_string());
            Err(format!("panicked: {message}"))
        }
    }
}

/// The passed and failed counts of one test binary, printed as libtest prints them.
#[derive(Debug, Default)]
pub struct Tally {
    /// Tests that returned `Ok`.
    pub passed: usize,
    /// Tests that returned `Err` (or panicked, through [`contained`]).
    pub failed: usize,
}

impl Tally {
    /// Records and prints one test's outcome.
    pub fn check(&mut self, name: &str, outcome: Outcome) {
        match outcome {
            Ok(()) => {
                self.passed += 1;
                println!("test {name} ... ok");
            }
            Err(message) => {
                self.failed += 1;
                println!("test {name} ... FAILED: {message}");
            }
        }
    }

    /// Prints the counts and gives the binary's exit code: failure if any test failed.
    pub fn finish(self) -> ExitCode {
        println!("{} passed, {} failed", self.passed, self.failed);
        if self.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_a_failure_with_its_message() {
        assert_eq!(contained(|| Ok(())), Ok(()));
        assert_eq!(contained(|| Err("no".into())), Err("no".to_string()));
        assert_eq!(
            contained(|| panic!("boom {}", 7)),
            Err("panicked: boom 7".to_string())
        );
    }

    #[test]
    fn the_tally_counts_and_fails_on_any_failure() {
        let mut tally = Tally::default();
        tally.check("a", Ok(()));
        tally.check("b", Err(fail("bad")));
        assert_eq!((tally.passed, tally.failed), (1, 1));
        assert_eq!(tally.finish(), ExitCode::FAILURE);
        assert_eq!(Tally::default().finish(), ExitCode::SUCCESS);
    }
}
