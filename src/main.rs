//! The `devtrace` command: parses the command line (over its environment
//! and configuration file) and hands over to the library.

fn main() -> std::process::ExitCode {
    let cli = devtrace::cli::parse();
    match devtrace::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("devtrace: {}", devtrace::cli::failure_text(&error));
            std::process::ExitCode::FAILURE
        }
    }
}
