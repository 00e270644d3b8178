//! Durations and sizes as people write them on command lines, in rule files
//! and in environment variables (`2s`, `500ms`, `512MiB`), parsed in one
//! place for every layer, with an error that says what was wrong.

use std::time::Duration;

/// Why a duration or size could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("{0:?} is not a duration (try 2s, 500ms, 10m)")]
    NotADuration(String),
    #[error("{0:?} is negative: a duration is 0 or more")]
    Negative(String),
    #[error("{0:?} is not a size (try 512MiB)")]
    NotASize(String),
    #[error("unknown unit {unit:?} in {text:?} (use {expected})")]
    UnknownUnit {
        unit: String,
        text: String,
        expected: &'static str,
    },
    #[error("{0:?} has no unit: write {0}s or {0}ms")]
    NoUnit(String),
    #[error("{0:?} is out of range: a duration is at most 1000000000s (about 31 years)")]
    OutOfRange(String),
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Parses durations such as `2s`, `500ms`, `1.5s`, `10m`, `1h`; a bare number
/// is milliseconds (as configuration files and rules have written them).
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let text = text.trim();
    // `-1s`; `--duration` is a flag taken for the value.
    let negative = text
        .strip_prefix('-')
        .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit() || c == '.'));
    if negative {
        return Err(UnitError::Negative(text.to_string()));
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| UnitError::NotADuration(text.to_string()))?;
    let seconds = match unit.trim() {
        "" | "ms" => value / 1e3,
        "us" => value / 1e6,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(UnitError::UnknownUnit {
                unit: other.to_string(),
                text: text.to_string(),
                expected: "us, ms, s, m or h",
            })
        }
    };
    if !seconds.is_finite() || !(0.0..=1e9).contains(&seconds) {
        return Err(UnitError::OutOfRange(text.to_string()));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// As [`parse_duration`], refusing a number without a unit (but 0): for
/// the windows a capture asks for on a command line, where `--duration 5`
/// would be 5 ms to the parser and 5 s to many a reader, and the wrong
/// window would be captured without a word.
pub fn parse_duration_with_unit(text: &str) -> Result<Duration, UnitError> {
    let duration = parse_duration(text)?;
    let trimmed = text.trim();
    if duration != Duration::ZERO && trimmed.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(UnitError::NoUnit(trimmed.to_string()));
    }
    Ok(duration)
}

/// Parses sizes such as `512MiB`, `2GiB`, `64M`; a bare number is bytes.
pub fn parse_size(text: &str) -> Result<usize, UnitError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: usize = number
        .parse()
        .map_err(|_| UnitError::NotASize(text.to_string()))?;
    let multiplier: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        _ => {
            // Named as written.
            return Err(UnitError::UnknownUnit {
                unit: unit.trim().to_string(),
                text: text.to_string(),
                expected: "KiB, MiB, GiB or TiB",
            });
        }
    };
    value
        .checked_mul(multiplier)
        .ok_or_else(|| UnitError::TooLarge(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_parse_with_units() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1500"), Ok(Duration::from_millis(1500)));
        assert_eq!(
            parse_duration_with_unit("1500"),
            Err(UnitError::NoUnit("1500".into()))
        );
        assert_eq!(parse_duration_with_unit("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_with_unit("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(
            parse_duration("two"),
            Err(UnitError::NotADuration("two".into()))
        );
        assert_eq!(
            parse_duration_with_unit("-1s"),
            Err(UnitError::Negative("-1s".into()))
        );
        assert_eq!(
            parse_duration("--duration"),
            Err(UnitError::NotADuration("--duration".into()))
        );
        assert!(matches!(
            parse_duration("3 weeks"),
            Err(UnitError::UnknownUnit { .. })
        ));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(
            parse_size("1PiB").unwrap_err().to_string(),
            "unknown unit \"PiB\" in \"1PiB\" (use KiB, MiB, GiB or TiB)"
        );
        assert_eq!(
            parse_duration("1000000h").unwrap_err().to_string(),
            "\"1000000h\" is out of range: a duration is at most 1000000000s (about 31 years)"
        );
    }
}
