//! A transparent gRPC tap for TensorFlow's distributed runtime.
//!
//! The tap is an HTTP/2 reverse proxy: every request to its listen address is
//! forwarded to the upstream (a `tf.distribute.Server`, or any gRPC server)
//! with its headers, metadata and `grpc-timeout` as they came, and the body's
//! frames passed on one by one as they arrive, in both directions, so unary
//! and streaming calls (`EagerService/StreamingEnqueue`) behave as without
//! it. Response headers, data and trailers (status, message, metadata) come
//! back unchanged. On the forwarding path the data frames themselves
//! (shared, not copied) are only framed into gRPC messages ([`decode`]);
//! the messages a call's record needs go to a bounded decode queue whose
//! thread parses them with partial protos, and [`record`] turns the calls
//! into events in the agent's ring. Methods nothing is recorded from
//! (`RecvTensor`'s payloads) are counted, never held or parsed.
//!
//! What the tap says itself: `UNAVAILABLE` when the upstream cannot be reached
//! or resets a call before its end. A client that cancels resets the upstream
//! call. Payloads are never changed.

pub mod decode;
mod fields;
mod queue;
pub mod record;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tracing::{debug, info};

use crate::protocol::listen::{self, Gate, Limits};
use crate::protocol::via;

use record::{Call, Direction, Observer, CANCELLED, FAILED_PRECONDITION, UNAVAILABLE, UNKNOWN};
pub use record::{Recorder, TapStats};

/// HTTP/2 flow-control windows and frame size on both sides of the tap:
/// large enough that a hop never stalls a multi-MiB tensor on window updates.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
const MAX_FRAME: u32 = 1 << 20;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TapBody = BoxBody<Bytes, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: String,
        source: std::io::Error,
    },
    #[error("upstream {0:?} is not HOST:PORT")]
    Upstream(String),
}

/// Connections a tap serves at once, and from one address: a TensorFlow
/// cluster's workers each keep a few channels to a server, and many may
/// come from one address (a NAT, one host's workers); one past either is
/// closed at once and counted. No first-bytes deadline: a gRPC channel may
/// stay idle between steps.
pub const TAP_CONNECTION_LIMITS: Limits = Limits {
    total: 4096,
    per_peer: 1024,
};

/// A bound tap, ready to [`Tap::run`].
pub struct Tap {
    listener: tokio::net::TcpListener,
    upstream: Arc<Upstream>,
    gate: Arc<Gate>,
}

struct Upstream {
    authority: String,
    client: Client<HttpConnector, TapBody>,
    recorder: Arc<Recorder>,
    /// This tap's own id in the chains of calls it forwards
    /// ([`crate::protocol::via`]): not the agent's, so that an agent that
    /// reaches its upstream through its own tap is no loop.
    id: u64,
}

impl Tap {
    /// Binds `listen` and prepares the client for `upstream` (`HOST:PORT`,
    /// an optional `grpc://` or `http://` is accepted). Connects lazily.
    pub async fn bind(
        listen: &str,
        upstream: &str,
        recorder: Arc<Recorder>,
    ) -> Result<Tap, TapError> {
        let authority = upstream
            .trim_start_matches("grpc://")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        if authority.parse::<http::uri::Authority>().is_err() || !authority.contains(':') {
            return Err(TapError::Upstream(upstream.to_owned()));
        }
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| TapError::Listen {
                address: listen.to_owned(),
                source,
            })?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .http2_initial_stream_window_size(Some(STREAM_WINDOW))
            .http2_initial_connection_window_size(Some(CONNECTION_WINDOW))
            .http2_max_frame_size(Some(MAX_FRAME))
            .build(connector);
        Ok(Tap {
            listener,
            gate: Gate::new(TAP_CONNECTION_LIMITS),
            upstream: Arc::new(Upstream {
                authority,
                client,
                recorder,
                id: via::new_id(),
            }),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The bounds of its connections, for metrics.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// The same tap, its connections bounded by `limits`.
    pub fn with_limits(mut self, limits: Limits) -> Tap {
        self.gate = Gate::new(limits);
        self
    }

    /// Accepts client connections until `shutdown` resolves; then tells
    /// each open connection to go away (HTTP/2 GOAWAY: no new call on it),
    /// and the calls in flight go on to their end on their own tasks.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let stopping = tokio_util::sync::CancellationToken::new();
        loop {
            // Accept errors (out of descriptors among them) are waited out
            // by the gate, as on the agent's own listeners.
            let (stream, admission) = tokio::select! {
                _ = &mut shutdown => break,
                admitted = listen::accept_tcp(&self.listener, &self.gate, "tap", None) => admitted.into_parts(),
            };
            let Ok(peer) = stream.peer_addr() else {
                continue;
            };
            let upstream = Arc::clone(&self.upstream);
            let line = upstream.recorder.connection(peer, &upstream.authority);
            debug!(%peer, line, "tap: client connected");
            let stopping = stopping.clone();
            tokio::spawn(async move {
                // Its place in the gate, until the connection ends.
                let _admission = admission;
                let service = hyper::service::service_fn(move |request| {
                    let upstream = Arc::clone(&upstream);
                    async move { Ok::<_, Infallible>(upstream.forward(line, request).await) }
                });
                let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .initial_stream_window_size(STREAM_WINDOW)
                    .initial_connection_window_size(CONNECTION_WINDOW)
                    .max_frame_size(MAX_FRAME)
                    .max_header_list_size(1 << 20)
                    .serve_connection(TokioIo::new(stream), service);
                tokio::pin!(connection);
                let served = tokio::select! {
                    served = connection.as_mut() => served,
                    _ = stopping.cancelled() => {
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                };
                if let Err(error) = served {
                    debug!(%peer, %error, "tap: client connection ended");
                }
            });
        }
        stopping.cancel();
        info!("tap: stopped accepting connections");
    }
}

impl Upstream {
    async fn forward(&self, line: u64, request: Request<Incoming>) -> Response<TapBody> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().to_owned();
        let (call, request_observer, response_observer) = self.recorder.call(line, &path);
        // A client that gives up before the upstream answers drops this
        // future: the call ends then, cancelled, rather than stay open.
        let mut unanswered = Unanswered(Some(Arc::clone(&call)));
        let passed = via::of_request(&parts.headers);
        if passed.contains(&self.id) {
            call.finish(FAILED_PRECONDITION);
            return status_only(
                FAILED_PRECONDITION,
                "devtrace tap: this call came back to the tap that forwarded it (its --upstream \
                 leads back to it): not forwarded again",
            );
        }
        if let Some(onwards) = via::header_value(&via::onwards(&passed, self.id)) {
            parts.headers.insert(via::VIA_HEADER, onwards);
        }
        let path_and_query = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = match Uri::builder()
            .scheme("http")
            .authority(self.authority.as_str())
            .path_and_query(path_and_query)
            .build()
        {
            Ok(uri) => uri,
            Err(error) => {
                call.finish(UNKNOWN);
                return status_only(UNKNOWN, &format!("devtrace tap: bad path: {error}"));
            }
        };
        let body = Tapped::new(body, request_observer).boxed();
        match self.client.request(Request::from_parts(parts, body)).await {
            Ok(response) => {
                let (parts, body) = response.into_parts();
                if let Some(status) = grpc_status(&parts.headers) {
                    call.set_status(status);
                }
                let body = Tapped::new(body, response_observer).boxed();
                // Its body ends it from here on.
                unanswered.0 = None;
                Response::from_parts(parts, body)
            }
            Err(error) => {
                let message = format!(
                    "devtrace tap: upstream {} unavailable: {}",
                    self.authority,
                    error_chain(&error)
                );
                debug!(%message, "tap");
                call.finish(UNAVAILABLE);
                status_only(UNAVAILABLE, &message)
            }
        }
    }
}

/// A call not yet answered by the upstream: ended as cancelled if dropped
/// so (ending is idempotent: one ended already stays as it ended).
struct Unanswered(Option<Arc<Call>>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(call) = self.0.take() {
            call.finish(CANCELLED);
        }
    }
}

/// A body forwarded frame by frame while its call observes its data.
struct Tapped {
    inner: Incoming,
    observer: Observer,
    done: bool,
}

impl Tapped {
    fn new(inner: Incoming, observer: Observer) -> Tapped {
        Tapped {
            inner,
            observer,
            done: false,
        }
    }

    fn call(&self) -> &Call {
        self.observer.call()
    }

    fn is_response(&self) -> bool {
        self.observer.direction() == Direction::Response
    }
}

impl Body for Tapped {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.observer.observe(data);
                } else if let Some(trailers) = frame.trailers_ref() {
                    if self.is_response() {
                        if let Some(status) = grpc_status(trailers) {
                            self.call().set_status(status);
                        }
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                self.done = true;
                if !self.is_response() {
                    return Poll::Ready(Some(Err(error.into())));
                }
                // The upstream reset the call or dropped the connection: end
                // it with a status the client reads.
                let message = format!(
                    "devtrace tap: upstream ended the call: {}",
                    error_chain(&error)
                );
                self.call().set_status(UNAVAILABLE);
                self.call().finish(UNAVAILABLE);
                Poll::Ready(Some(Ok(Frame::trailers(status_headers(
                    UNAVAILABLE,
                    &message,
                )))))
            }
            Poll::Ready(None) => {
                self.done = true;
                if self.is_response() {
                    // No status anywhere is a protocol error of the upstream.
                    self.call().finish(UNKNOWN);
                }
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tapped {
    fn drop(&mut self) {
        // A response dropped before its end: the client went away. A
        // trailers-only response ends here too, with its status already set.
        if self.is_response() {
            self.call().finish(CANCELLED);
        }
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

fn status_headers(code: u32, message: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(value) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", value);
    }
    headers
}

/// A trailers-only gRPC response carrying `code` and `message`.
fn status_only(code: u32, message: &str) -> Response<TapBody> {
    let mut response = Response::new(
        Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed(),
    );
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.extend(status_headers(code, message));
    response
}

/// `grpc-message` is percent-encoded outside printable ASCII.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection past the tap's bound from one address is closed as
    /// soon as it is accepted, and counted; one within it is served.
    #[tokio::test]
    async fn connections_past_the_taps_bound_are_closed_and_counted() {
        use tokio::io::AsyncReadExt;
        let registry = crate::model::registry::Registry::new();
        let ring = crate::ring::Ring::new(1, 4, crate::ring::DropPolicy::DropNewest).unwrap();
        let recorder = Recorder::new(registry, ring.producer().unwrap());
        let tap = Tap::bind("127.0.0.1:0", "127.0.0.1:9", recorder)
            .await
            .unwrap()
            .with_limits(Limits {
                total: 4,
                per_peer: 1,
            });
        let address = tap.local_addr().unwrap();
        let gate = Arc::clone(tap.gate());
        tokio::spawn(tap.run(std::future::pending()));
        let _held = tokio::net::TcpStream::connect(address).await.unwrap();
        let mut refused = tokio::net::TcpStream::connect(address).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), refused.read(&mut byte))
            .await
            .expect("closed at once");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        let counts = gate.counts();
        assert_eq!((counts.open, counts.refused_peer), (1, 1));
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\n"), "a b%25c%0A");
        assert_eq!(percent_encode("é"), "%C3%A9");
    }
}
