//! What a caller's `grpc-timeout` says, read the one way every service
//! reads it: strictly (eight digits at most, as the gRPC specification
//! writes it), so that no peer's header overflows a deadline; and the layer
//! that answers a call whose deadline passed.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;
use tracing::info;

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

/// Refuses a window that ends after the time a call has left to be
/// answered (by its `grpc-timeout`, [`caller_timeout`]): its reply could
/// never arrive, and recording it would be work for no one. `field` names
/// what set the window, for the message.
pub fn refuse_window_past_deadline(
    time_left: Option<Duration>,
    field: &str,
    window_stop_ns: u64,
) -> Result<(), Status> {
    let Some(left) = time_left else {
        return Ok(());
    };
    let ends_in = Duration::from_nanos(window_stop_ns.saturating_sub(crate::clock::now_ns()));
    if ends_in < left {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "{field}: the window ends {:.1} s from now, after this call's deadline ({:.1} s from \
         now, by its grpc-timeout): its reply could never arrive; ask for an earlier or shorter \
         window, or give the call longer",
        ends_in.as_secs_f64(),
        left.as_secs_f64()
    )))
}

/// Answers a call whose `grpc-timeout` passed before its reply with
/// DEADLINE_EXCEEDED, as the gRPC specification has a server do, and logs
/// it. (tonic's own timeout, which fires with it, answers CANCELLED, which
/// says the client went away, and the call was counted so.)
#[derive(Clone, Copy, Debug, Default)]
pub struct DeadlineLayer;

impl<S> tower_layer::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline { inner }
    }
}

/// See [`DeadlineLayer`].
#[derive(Clone, Debug)]
pub struct Deadline<S> {
    inner: S,
}

impl<S, B> tower_service::Service<http::Request<B>> for Deadline<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let timeout = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(parse_grpc_timeout);
        let rpc = request.uri().path().to_string();
        // Its timer starts here, before tonic's (which starts once this call
        // returns), and its future is polled first: it fires first.
        let expiry = timeout.map(|timeout| (timeout, tokio::time::sleep(timeout)));
        let response = self.inner.call(request);
        Box::pin(async move {
            let Some((timeout, expiry)) = expiry else {
                return response.await;
            };
            tokio::select! {
                biased;
                answered = response => answered,
                () = expiry => {
                    info!(%rpc, ?timeout, "the caller's deadline passed before the reply");
                    Ok(Status::deadline_exceeded(format!(
                        "the call's deadline (grpc-timeout, {timeout:?}) passed before it was \
                         answered"
                    ))
                    .into_http())
                }
            }
        })
    }
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
