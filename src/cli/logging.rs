//! The log every subcommand writes to standard error: readable text, or one
//! JSON object per line for log collectors.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people: time, level, message, fields.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `message`, the
    /// event's fields, `target`), for Fluent Bit, Vector, Loki and the like.
    Json,
}

/// A `--log-level`: checked as a filter, so that a mistyped one is a usage
/// error rather than a log quietly at another level.
pub fn parse_filter(text: &str) -> Result<String, String> {
    EnvFilter::try_new(text)
        .map(|_| text.to_string())
        .map_err(|error| format!("not a log filter: {error}"))
}

/// Installs the subscriber: `level` as the filter unless RUST_LOG says
/// otherwise. A RUST_LOG that is not a filter is an error, not ignored.
pub fn init(level: &str, format: LogFormat) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(text) if !text.is_empty() => EnvFilter::try_new(&text)
            .map_err(|error| anyhow::anyhow!("RUST_LOG={text:?} is not a log filter: {error}"))?,
        _ => EnvFilter::try_new(level)
            .map_err(|error| anyhow::anyhow!("--log-level {level:?}: {error}"))?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log that can no longer be written (a closed pipe) must not take
        // the agent down: by default a failed write is reported with
        // eprintln!, which panics when stderr itself is the problem.
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
    Ok(())
}
