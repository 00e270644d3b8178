//! Metrics of the profiler's gRPC calls: a tower layer in front of every
//! gRPC listener's routes counts each call of `ProfilerService`,
//! `ProfileAnalysis` and devtrace's `Trigger` by method and gRPC status and
//! times it, from its arrival to its status (the trailers, or the headers
//! of an error); a call whose client goes away first counts as CANCELLED.
//! The services add how long after its window each capture's reply was
//! ready.
//!
//! Labels come from a fixed table of methods, never from the request
//! itself, so that no caller can grow the number of series.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::Code;

use crate::proto::devtrace::trigger_server;
use crate::proto::tensorflow::{profile_analysis_server, profiler_service_server};

/// Every method counted, as (service, method).
const METHODS: [(&str, &str); 10] = [
    (profiler_service_server::SERVICE_NAME, "Profile"),
    (profiler_service_server::SERVICE_NAME, "Terminate"),
    (profiler_service_server::SERVICE_NAME, "Monitor"),
    (
        profiler_service_server::SERVICE_NAME,
        "StartContinuousProfiling",
    ),
    (profiler_service_server::SERVICE_NAME, "GetSnapshot"),
    (
        profiler_service_server::SERVICE_NAME,
        "StopContinuousProfiling",
    ),
    (profile_analysis_server::SERVICE_NAME, "NewSession"),
    (profile_analysis_server::SERVICE_NAME, "EnumSessions"),
    (profile_analysis_server::SERVICE_NAME, "GetSessionToolData"),
    (trigger_server::SERVICE_NAME, "Fire"),
];

/// The method a request path (`/tensorflow.ProfilerService/Profile`)
/// calls, when it is one of ours.
fn method_of(path: &str) -> Option<&'static str> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    METHODS
        .iter()
        .find(|(s, m)| *s == service && *m == method)
        .map(|(_, m)| *m)
}

/// A status's canonical name, as the gRPC specification spells it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

type RpcLabels = [(&'static str, &'static str); 2];
type MethodLabel = [(&'static str, &'static str); 1];
type Histograms = Family<MethodLabel, Histogram, fn() -> Histogram>;

/// Call durations: a Monitor or capture lasts its window, up to
/// `--max-duration` (by default a little under `--store-retention`).
fn call_durations() -> Histogram {
    Histogram::new([
        0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ])
}

/// From a window's end to its reply: collecting, building, encoding.
fn capture_latencies() -> Histogram {
    Histogram::new([
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

/// The families the layer and the services update.
#[derive(Debug)]
pub struct RpcMetrics {
    calls: Family<RpcLabels, Counter>,
    durations: Histograms,
    capture_latency: Histograms,
    /// Calls from their arrival until their reply is sent or dropped.
    in_progress: tokio::sync::watch::Sender<usize>,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics {
            calls: Family::default(),
            durations: Family::new_with_constructor(call_durations),
            capture_latency: Family::new_with_constructor(capture_latencies),
            in_progress: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl RpcMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "devtrace_rpcs",
            "Calls of the profiler's gRPC methods (the captures among them) by method and gRPC status",
            self.calls.clone(),
        );
        registry.register(
            "devtrace_rpc_duration_seconds",
            "Time from a gRPC call's arrival to its status, by method",
            self.durations.clone(),
        );
        registry.register(
            "devtrace_capture_latency_seconds",
            "Time from the end of a capture's window (or its request, for a window that ended before) to its reply being ready, by method",
            self.capture_latency.clone(),
        );
    }

    fn finished(&self, method: &'static str, code: Code, took: Duration) {
        self.calls
            .get_or_create(&[("rpc", method), ("code", code_name(code))])
            .inc();
        self.durations
            .get_or_create(&[("rpc", method)])
            .observe(took.as_secs_f64());
    }

    /// Resolves once no counted call is in progress.
    pub(super) async fn calls_ended(&self) {
        let mut in_progress = self.in_progress.subscribe();
        // The sender lives in `self`: the wait cannot fail.
        let _ = in_progress.wait_for(|calls| *calls == 0).await;
    }

    pub(super) fn capture_ready(&self, method: &'static str, latency: Duration) {
        self.capture_latency
            .get_or_create(&[("rpc", method)])
            .observe(latency.as_secs_f64());
    }
}

/// Wraps a router's routes in [`CountRpcs`].
#[derive(Clone)]
pub struct CountRpcsLayer {
    metrics: Arc<RpcMetrics>,
}

impl CountRpcsLayer {
    pub(super) fn new(metrics: Arc<RpcMetrics>) -> CountRpcsLayer {
        CountRpcsLayer { metrics }
    }
}

impl<S> tower_layer::Layer<S> for CountRpcsLayer {
    type Service = CountRpcs<S>;

    fn layer(&self, inner: S) -> CountRpcs<S> {
        CountRpcs {
            inner,
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct CountRpcs<S> {
    inner: S,
    metrics: Arc<RpcMetrics>,
}

impl<S, B> tower_service::Service<http::Request<B>> for CountRpcs<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<CountedBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let call = method_of(request.uri().path()).map(|method| Call::new(&self.metrics, method));
        let response = self.inner.call(request);
        Box::pin(async move {
            // Dropped here (the client went away): `call` counts CANCELLED.
            let response = response.await?;
            let mut call = call;
            // An error answered in the headers alone ("trailers-only").
            if let Some(code) = response.headers().get("grpc-status") {
                if let Some(call) = call.as_mut() {
                    call.finish(Code::from_bytes(code.as_bytes()));
                }
            }
            Ok(response.map(|body| CountedBody { body, call }))
        })
    }
}

/// One call being counted; counts as CANCELLED when dropped unfinished.
struct Call {
    metrics: Arc<RpcMetrics>,
    method: &'static str,
    started: Instant,
    done: bool,
}

impl Call {
    fn new(metrics: &Arc<RpcMetrics>, method: &'static str) -> Call {
        metrics.in_progress.send_modify(|calls| *calls += 1);
        Call {
            metrics: Arc::clone(metrics),
            method,
            started: Instant::now(),
            done: false,
        }
    }

    fn finish(&mut self, code: Code) {
        if !self.done {
            self.done = true;
            self.metrics
                .finished(self.method, code, self.started.elapsed());
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.finish(Code::Cancelled);
        self.metrics.in_progress.send_modify(|calls| *calls -= 1);
    }
}

/// A reply's body, watched for the status in its trailers.
pub struct CountedBody {
    body: tonic::body::Body,
    call: Option<Call>,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.body).poll_frame(cx));
        let code = match &frame {
            Some(Ok(frame)) => frame
                .trailers_ref()
                .and_then(|trailers| trailers.get("grpc-status"))
                .map(|code| Code::from_bytes(code.as_bytes())),
            Some(Err(status)) => Some(status.code()),
            // The body ended without a status: not a gRPC reply.
            None => Some(Code::Unknown),
        };
        if let (Some(code), Some(call)) = (code, self.call.as_mut()) {
            call.finish(code);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_methods_are_labels() {
        assert_eq!(
            method_of("/tensorflow.ProfilerService/Profile"),
            Some("Profile")
        );
        assert_eq!(
            method_of("/tensorflow.ProfileAnalysis/NewSession"),
            Some("NewSession")
        );
        assert_eq!(method_of("/devtrace.Trigger/Fire"), Some("Fire"));
        for path in [
            "/grpc.health.v1.Health/Check",
            "/tensorflow.ProfilerService/Profile/extra",
            "/tensorflow.ProfilerService/NewSession",
            "/made.up/Method",
            "Profile",
            "",
        ] {
            assert_eq!(method_of(path), None, "{path}");
        }
    }
}
