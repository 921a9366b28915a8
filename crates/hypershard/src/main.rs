//! The `hypershard` command line: `launch`, `train`, `sample`, `export`.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::init_logging();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One clear line, then a non-zero status that says what happened where it can.
            eprintln!("hypershard: error: {error}");
            ExitCode::from(cli::exit_code(&error))
        }
    }
}
