//! The `devtrace` command: parses the command line and hands over to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = devtrace::cli::Cli::parse();
    match devtrace::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("devtrace: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
