//! What a caller's `grpc-timeout` says, read the one way every service
//! reads it: strictly (eight digits at most, as the gRPC specification
//! writes it), so that no peer's header overflows a deadline.

use std::time::Duration;

use crate::protocol::client;

/// Until when a capture may wait for capture memory: a little before the
/// client's own deadline (`grpc-timeout`), so that it hears why rather than
/// its own timeout; without one, as long as a client would wait for a
/// capture of the longest window.
pub fn memory_wait_deadline(metadata: &tonic::metadata::MetadataMap) -> std::time::Instant {
    let timeout = caller_timeout(metadata)
        .map_or(client::capture_deadline(Duration::from_secs(600)), |t| {
            t.mul_f64(0.9)
        });
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .unwrap_or(now + Duration::from_secs(86_400))
}

/// How long the caller waits for its reply (its `grpc-timeout`), when it
/// says.
pub fn caller_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    metadata
        .get("grpc-timeout")
        .and_then(|value| value.to_str().ok())
        .and_then(parse_grpc_timeout)
}

/// A `grpc-timeout` header: one to eight digits and a unit (H, M, S, m, u,
/// n), as the gRPC specification writes it; anything else is no timeout.
pub fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read() {
        assert_eq!(
            parse_grpc_timeout("1500m"),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("2x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
        // Past eight digits (a peer's choice) it is no timeout, not a panic.
        assert_eq!(parse_grpc_timeout("18446744073709551615S"), None);
        assert_eq!(
            parse_grpc_timeout("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("grpc-timeout", "99999999H".parse().unwrap());
        assert!(memory_wait_deadline(&metadata) > std::time::Instant::now());
    }
}
