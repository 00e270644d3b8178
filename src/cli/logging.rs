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
    // A bare word is a target to tracing (all of `debgu`'s logs), so a
    // mistyped level would log nothing at all: one a typo away from a level
    // is refused, naming it.
    for directive in text.split(',').map(str::trim) {
        let word = directive.to_ascii_lowercase();
        if word.contains(['=', ':', '[']) || LEVELS.contains(&word.as_str()) {
            continue;
        }
        let near = |level: &str| {
            strsim::damerau_levenshtein(&word, level) <= 2
                || (word.len() >= 3 && (word.starts_with(level) || level.starts_with(&word)))
        };
        let other_tools = OTHER_TOOLS_LEVELS
            .iter()
            .find(|(said, _)| *said == word)
            .map(|(_, level)| *level);
        if let Some(level) = other_tools.or_else(|| LEVELS.into_iter().find(|level| near(level))) {
            return Err(format!(
                "{directive:?} is not a level (did you mean {level}?); a target's logs are \
                 asked for as TARGET=LEVEL"
            ));
        }
    }
    EnvFilter::try_new(text)
        .map(|_| text.to_string())
        .map_err(|error| format!("not a log filter: {error}"))
}

/// The levels a filter names.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Level names of other tools, which to tracing would be targets logging
/// nothing, with the level meant.
const OTHER_TOOLS_LEVELS: [(&str, &str); 8] = [
    ("verbose", "debug"),
    ("all", "trace"),
    ("fatal", "error"),
    ("critical", "error"),
    ("notice", "info"),
    ("none", "off"),
    ("quiet", "off"),
    ("silent", "off"),
];

/// Whether the log is JSON, so that the command's last word is too.
static JSON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`say_failure`] write JSON, for a failure found before the log is
/// set up (a command line or configuration that does not parse) when JSON
/// was asked for.
pub fn failures_as_json() {
    JSON.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Says why the command failed, on standard error: `devtrace: TEXT`, or
/// under `--log-format json` one object with the log's fields, so that a
/// collector that parses every line gets this one (whatever the filter).
/// A standard error that cannot be written is left be.
pub fn say_failure(text: &str) {
    use std::io::Write;
    let line = if JSON.load(std::sync::atomic::Ordering::Relaxed) {
        serde_json::json!({
            "timestamp": crate::model::calendar::utc_text(crate::clock::now_ns()),
            "level": "ERROR",
            "message": text,
            "target": "devtrace",
        })
        .to_string()
    } else {
        format!(
            "devtrace: {}",
            crate::model::printable::printable_lines(text)
        )
    };
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// RUST_LOG, when set, and the filter it says: it overrides `--log-level`.
/// One that is not a filter is a usage error, not ignored.
pub fn rust_log() -> Result<Option<(String, EnvFilter)>, super::UsageError> {
    match std::env::var("RUST_LOG") {
        Ok(text) if !text.is_empty() => match EnvFilter::try_new(&text) {
            Ok(filter) => Ok(Some((text, filter))),
            Err(error) => Err(super::UsageError(format!(
                "RUST_LOG={text:?} is not a log filter: {error}"
            ))),
        },
        _ => Ok(None),
    }
}

/// Installs the subscriber: `level` as the filter unless RUST_LOG says
/// otherwise. A RUST_LOG that is not a filter is an error, not ignored.
pub fn init(level: &str, format: LogFormat) -> anyhow::Result<()> {
    JSON.store(
        matches!(format, LogFormat::Json),
        std::sync::atomic::Ordering::Relaxed,
    );
    let filter = match rust_log()? {
        Some((_, filter)) => filter,
        None => EnvFilter::try_new(level)
            .map_err(|error| anyhow::anyhow!("--log-level {level:?}: {error}"))?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // A log that can no longer be written (a closed pipe) must not take
        // the agent down: by default a failed write is reported with
        // eprintln!, which panics when stderr itself is the problem.
        .log_internal_errors(false);
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = match format {
        // Lines read by a journal or a collector, one record each: text a
        // peer sent (a host's error, a file's name) must not forge one.
        LogFormat::Text if !terminal => builder
            .with_ansi(false)
            .with_writer(|| OneLineRecords(std::io::stderr()))
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(true)
            .with_writer(std::io::stderr)
            .try_init(),
        // JSON strings escape control characters themselves.
        LogFormat::Json => builder
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
    Ok(())
}

/// A writer of log records, one formatted record a write: its control
/// characters but the line's end are escapes
/// ([`crate::model::printable`]).
struct OneLineRecords<W>(W);

impl<W: std::io::Write> std::io::Write for OneLineRecords<W> {
    fn write(&mut self, record: &[u8]) -> std::io::Result<usize> {
        let body = record.strip_suffix(b"\n").unwrap_or(record);
        let text = String::from_utf8_lossy(body);
        let mut line = crate::model::printable::printable(&text).into_owned();
        line.push('\n');
        self.0.write_all(line.as_bytes())?;
        Ok(record.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_targets_and_directives_pass_and_a_mistyped_level_is_named() {
        for good in [
            "info",
            "DEBUG",
            "devtrace=debug",
            "h2",
            "devtrace::agent=trace,warn",
            "off",
        ] {
            assert_eq!(parse_filter(good).as_deref(), Ok(good), "{good}");
        }
        for (typo, level) in [
            ("debgu", "debug"),
            ("inof", "info"),
            ("warning", "warn"),
            ("trce", "trace"),
            ("verbose", "debug"),
            ("fatal", "error"),
        ] {
            let refused = parse_filter(typo).unwrap_err();
            assert!(
                refused.contains(&format!("did you mean {level}?")),
                "{typo}: {refused}"
            );
        }
    }
}
