//! Moments as people read them: session names (`YYYY_MM_DD_HH_MM_SS`,
//! the form TensorFlow's clients give session directories) and ISO 8601
//! times in logs and traces, in UTC, from Unix nanoseconds.

use crate::clock;

/// `YYYY_MM_DD_HH_MM_SS` in UTC, as session directories are named.
pub fn session_timestamp() -> String {
    session_timestamp_at(clock::now_ns())
}

/// [`session_timestamp`] of the moment `ns` (Unix nanoseconds).
pub fn session_timestamp_at(ns: u64) -> String {
    let (year, month, day, hour, minute, second) = utc_fields(ns);
    format!("{year:04}_{month:02}_{day:02}_{hour:02}_{minute:02}_{second:02}")
}

/// The moment `ns` (Unix nanoseconds) as ISO 8601 UTC with milliseconds,
/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn utc_text(ns: u64) -> String {
    let (year, month, day, hour, minute, second) = utc_fields(ns);
    let millis = ns % 1_000_000_000 / 1_000_000;
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}

/// Year, month, day, hour, minute and second (UTC) of the moment `ns`.
fn utc_fields(ns: u64) -> (i64, u32, u32, i64, i64, i64) {
    let secs = (ns / 1_000_000_000) as i64;
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    (year, month, day, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Proleptic Gregorian date of a day count since 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_are_right() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            utc_text(1_763_731_845_123_456_789),
            "2025-11-21T13:30:45.123Z"
        );
        assert_eq!(civil_from_days(20_413), (2025, 11, 21));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn session_names_sort_as_time_does() {
        assert_eq!(
            session_timestamp_at(1_763_731_845_999_999_999),
            "2025_11_21_13_30_45"
        );
        assert!(session_timestamp_at(9_000_000_000) > session_timestamp_at(8_999_999_999));
    }
}
