//! The `devtrace` command: parses the command line (over its environment
//! and configuration file) and hands over to the library.

fn main() -> std::process::ExitCode {
    let cli = devtrace::cli::parse();
    match devtrace::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // What a shell reports for a command a closed pipe ended.
        Err(error) if devtrace::cli::output_closed(&error) => std::process::ExitCode::from(141),
        Err(error) => {
            devtrace::cli::say_failure(&error);
            std::process::ExitCode::from(devtrace::cli::exit_status(&error))
        }
    }
}
