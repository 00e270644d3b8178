//! The HTTP endpoint of `--metrics-listen` (HTTP/1.1, plaintext):
//!
//! - `/metrics`: Prometheus's scrape, in the OpenMetrics text format;
//! - `/healthz`: 200 while the process answers (liveness);
//! - `/readyz`: 200 once the backends have started (or said why not) and
//!   the gRPC server serves, 503 with the reason before and while it shuts
//!   down (readiness).
//!
//! Nothing here changes the agent, and nothing it serves is secret, so it
//! may listen beyond loopback; it is kept cheap to abuse all the same: a
//! bounded number of connections, and of connections from one address, past
//! which a connection is closed at once rather than left to wait (so that
//! silent connections cannot make the probes queue behind them), and a
//! deadline on each request's headers.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use super::Telemetry;
use crate::protocol::listen::{self, Gate, Limits};

/// Where `--metrics-listen` puts the endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricsListen {
    /// No HTTP endpoint.
    Off,
    /// A `host:port` to bind.
    At(String),
}

impl std::str::FromStr for MetricsListen {
    type Err = String;

    fn from_str(text: &str) -> Result<MetricsListen, String> {
        match text {
            "off" => Ok(MetricsListen::Off),
            "" => Err("an address such as 127.0.0.1:6010, or off".into()),
            address => crate::protocol::listen::check_listen_address(address)
                .map(|()| MetricsListen::At(address.to_string())),
        }
    }
}

/// Where the endpoint listens when `--metrics-listen` is not given.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:6010";

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// Connections served at once, and from one address; one past either is
/// closed at once.
pub const LIMITS: Limits = Limits {
    total: 256,
    per_peer: 32,
};

/// A client must send its request's headers within this.
const HEADER_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address} for --metrics-listen: {source}")]
pub struct BindError {
    address: String,
    source: std::io::Error,
}

/// Binds the endpoint and serves it until the runtime stops; its address,
/// or `None` when it is off. With no address given, the default one is
/// taken only when free (another agent on this host may hold it) and a
/// warning says so otherwise; an address given must be free.
pub async fn start(
    choice: Option<&MetricsListen>,
    telemetry: &Arc<Telemetry>,
) -> Result<Option<std::net::SocketAddr>, BindError> {
    let (address, given) = match choice {
        Some(MetricsListen::Off) => return Ok(None),
        Some(MetricsListen::At(address)) => (address.as_str(), true),
        None => (DEFAULT_ADDRESS, false),
    };
    let bound = TcpListener::bind(address)
        .await
        .and_then(|listener| Ok((listener.local_addr()?, listener)));
    match bound {
        Ok((bound, listener)) => {
            spawn(listener, Arc::clone(telemetry));
            Ok(Some(bound))
        }
        Err(error) if !given => {
            warn!(
                address,
                %error,
                "metrics endpoint not started: its default address is taken \
                 (give --metrics-listen ADDR, or off)"
            );
            Ok(None)
        }
        Err(source) => Err(BindError {
            address: address.to_string(),
            source,
        }),
    }
}

/// Serves the endpoint on `listener` until the runtime stops.
fn spawn(listener: TcpListener, telemetry: Arc<Telemetry>) {
    let gate = Gate::new(LIMITS);
    telemetry.watch_connections("metrics", &gate);
    tokio::spawn(async move {
        loop {
            // hyper's header deadline closes silent connections here.
            let (stream, admission) = listen::accept_tcp(&listener, &gate, "metrics", None)
                .await
                .into_parts();
            let peer = stream.peer_addr().ok();
            let telemetry = Arc::clone(&telemetry);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let telemetry = Arc::clone(&telemetry);
                    async move { Ok::<_, Infallible>(respond(&telemetry, request).await) }
                });
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_DEADLINE)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                if let Err(error) = served {
                    debug!(?peer, %error, "metrics endpoint: connection ended");
                }
                drop(admission);
            });
        }
    });
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

async fn respond<B>(telemetry: &Arc<Telemetry>, request: Request<B>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "only GET and HEAD\n".into(),
        );
        response
            .headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match request.uri().path() {
        "/metrics" => {
            // Reading the agent takes locks its threads take briefly; off
            // the async workers, a slow moment there delays no gRPC call.
            let telemetry = Arc::clone(telemetry);
            match tokio::task::spawn_blocking(move || telemetry.encode_metrics()).await {
                Ok(Ok(text)) => reply(StatusCode::OK, OPENMETRICS, text),
                Ok(Err(_)) | Err(_) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    TEXT,
                    "encoding the metrics failed\n".into(),
                ),
            }
        }
        "/healthz" => reply(StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => match telemetry.readiness() {
            Ok(text) => reply(StatusCode::OK, TEXT, text),
            Err(reason) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{reason}\n")),
        },
        _ => reply(
            StatusCode::NOT_FOUND,
            TEXT,
            "not found; this endpoint serves /metrics, /healthz and /readyz\n".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_or_an_address() {
        assert_eq!("off".parse(), Ok(MetricsListen::Off));
        assert_eq!(
            "0.0.0.0:6010".parse(),
            Ok(MetricsListen::At("0.0.0.0:6010".into()))
        );
        assert!("".parse::<MetricsListen>().is_err());
    }
}
