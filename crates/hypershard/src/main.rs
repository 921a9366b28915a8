//! The `hypershard` command line: `launch`, `train`, `sample`, `export`.

mod cli;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Before anything large is allocated: memory a step frees goes back to the kernel, so a
    // rank's resident peak follows its live tensors (see the module's docs).
    hypershard::allocator::return_large_blocks_to_the_kernel();
    let args = cli::Cli::parse();
    cli::init_logging();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One clear line, then a non-zero status that says what happened where it can.
            // The line goes out in one `write` so a rank killed by the launcher while it
            // reports never leaves half a line for the launcher's own line to run into.
            let line = format!("hypershard: error: {error}\n");
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
            ExitCode::from(cli::exit_code(&error))
        }
    }
}
