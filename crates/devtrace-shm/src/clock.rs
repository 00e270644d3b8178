//! The one clock every event is stamped with: `CLOCK_REALTIME` in nanoseconds
//! since the Unix epoch, the same base as `ProfileOptions.start_timestamp_ns`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Converts a duration to nanoseconds, saturating instead of overflowing.
pub fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// How far `target_ns` lies ahead of now; zero when it is already past.
pub fn until(target_ns: u64) -> Duration {
    Duration::from_nanos(target_ns.saturating_sub(now_ns()))
}
