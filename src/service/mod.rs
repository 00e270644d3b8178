//! The gRPC services: requests are validated here, turned into captures on
//! the [`crate::agent::Agent`], and the results turned into replies or files.

pub mod access;
pub mod deadline;
pub mod framed_reply;
pub mod profile_analysis;
pub mod profiler;
pub mod request_bodies;
pub mod session_bytes;
pub mod session_hosts;
pub mod trigger;
pub mod validate;

use std::sync::Arc;

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::transport::ServerTlsConfig;
use tower_layer::{Identity, Stack};
use tracing::info;

use crate::proto::devtrace::trigger_server::TriggerServer;
use crate::proto::tensorflow::profile_analysis_server::ProfileAnalysisServer;
use crate::proto::tensorflow::profiler_service_server::ProfilerServiceServer;
use crate::protocol::listen::{self, Gate, Limits};
use crate::telemetry::rpc::CountRpcsLayer;
use crate::telemetry::Telemetry;
use framed_reply::FramedRepliesLayer;
use request_bodies::{BodyBudget, BoundedBodiesLayer, BODY_DEADLINE};

pub use crate::protocol::{MAX_REPLY_BYTES, MAX_REQUEST_BYTES};

/// Connections a gRPC listener serves at once, and from one address (or,
/// on the UNIX socket, one uid); one past either is closed at once. A
/// client needs one connection (TensorFlow's client, XProf, `devtrace
/// capture`, a session's coordinator each open one per call at most).
pub const CONNECTION_LIMITS: Limits = Limits {
    total: 1024,
    per_peer: 64,
};

/// Calls one connection may have open at once
/// (`SETTINGS_MAX_CONCURRENT_STREAMS`): a client's captures of many
/// windows, a dashboard polling, with room to spare.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;

/// A connection whose peer answers no HTTP/2 ping for
/// [`KEEPALIVE_TIMEOUT`] after [`KEEPALIVE_INTERVAL`] of silence is closed:
/// a peer that vanished does not hold its place forever.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);

/// How long a stopping agent waits for connections once no call is in
/// progress: for the last replies to be read (a call ends once its last
/// bytes are handed to HTTP/2, which may still hold up to a window of
/// them) and the peers to close.
const DRAIN_GRACE: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a connection is served before the agent asks its client to
/// move to a new one (an HTTP/2 GOAWAY, which gRPC clients follow without
/// failing a call): no idle connection keeps its place for good. Calls in
/// progress then finish; the connection closes after the last.
pub const DEFAULT_MAX_CONNECTION_AGE: Duration = Duration::from_secs(15 * 60);

/// Where the services listen: a TCP listener, with TLS or without, and
/// optionally a UNIX socket (plaintext, guarded by its file permissions).
pub struct Listeners {
    /// None with `--listen off`: only the UNIX socket serves.
    pub tcp: Option<tokio::net::TcpListener>,
    pub tls: Option<ServerTlsConfig>,
    pub unix: Option<tokio::net::UnixListener>,
    /// `--max-connection-age`.
    pub max_connection_age: Duration,
}

impl From<tokio::net::TcpListener> for Listeners {
    fn from(tcp: tokio::net::TcpListener) -> Listeners {
        Listeners {
            tcp: Some(tcp),
            tls: None,
            unix: None,
            max_connection_age: DEFAULT_MAX_CONNECTION_AGE,
        }
    }
}

/// Serves ProfilerService, ProfileAnalysis, devtrace's Trigger and the gRPC
/// health service on every listener until `shutdown` resolves. The profiler service's
/// telemetry learns when serving starts and stops, and counts the calls.
pub async fn serve(
    listeners: impl Into<Listeners>,
    profiler: Arc<profiler::ProfilerService>,
    analysis: Arc<profile_analysis::ProfileAnalysisService>,
    triggers: Arc<trigger::TriggerService>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let listeners = listeners.into();
    let telemetry = Arc::clone(profiler.telemetry());
    telemetry.serving().await;
    let stop = CancellationToken::new();
    let trigger = stop.clone();
    let stopping = Arc::clone(&telemetry);
    tokio::spawn(async move {
        shutdown.await;
        stopping.stopping().await;
        trigger.cancel();
    });
    // One budget for the bodies arriving on every listener.
    let bodies = BoundedBodiesLayer::new(Arc::new(BodyBudget::new()), BODY_DEADLINE);
    let age = listeners.max_connection_age;
    let tcp = match listeners.tcp {
        Some(tcp) => {
            let tcp_gate = Gate::new(CONNECTION_LIMITS);
            telemetry.watch_connections("grpc", &tcp_gate);
            let tcp = listen::tcp_incoming(tcp, tcp_gate, "grpc");
            let served = router(
                &profiler,
                &analysis,
                &triggers,
                &telemetry,
                &bodies,
                age,
                listeners.tls,
            )?
            .serve_with_incoming_shutdown(tcp, stop.clone().cancelled_owned());
            Some(served)
        }
        None => None,
    };
    let unix = match listeners.unix {
        Some(unix) => {
            let unix_gate = Gate::new(CONNECTION_LIMITS);
            telemetry.watch_connections("grpc_unix", &unix_gate);
            let served = router(
                &profiler, &analysis, &triggers, &telemetry, &bodies, age, None,
            )?
            .serve_with_incoming_shutdown(
                listen::unix_incoming(unix, unix_gate, "grpc_unix"),
                stop.clone().cancelled_owned(),
            );
            Some(served)
        }
        None => None,
    };
    let served = async {
        match (tcp, unix) {
            (Some(tcp), Some(unix)) => tokio::try_join!(tcp, unix).map(|_| ()),
            (Some(tcp), None) => tcp.await,
            (None, Some(unix)) => unix.await,
            // The command line refuses to start without a listener.
            (None, None) => Ok(()),
        }
    };
    // A stop lets the calls in progress end; connections still open
    // [`DRAIN_GRACE`] after that (a peer that does not answer the goodbye,
    // which HTTP/2 waits for) are not waited for: they close as the agent
    // exits.
    let drained = async {
        stop.cancelled().await;
        telemetry.calls_ended().await;
        tokio::time::sleep(DRAIN_GRACE).await;
    };
    let result = tokio::select! {
        result = served => result,
        () = drained => {
            info!(
                "not waiting for the connections still open {} s after the last call ended; \
                 they close as the agent exits",
                DRAIN_GRACE.as_secs()
            );
            Ok(())
        }
    };
    // One listener failing ends the other too.
    stop.cancel();
    result
}

/// What every route passes through, innermost first: request bodies are
/// bounded and replies framed inside the RPC counter, which reads their
/// status.
type Layers = Stack<
    BoundedBodiesLayer,
    Stack<FramedRepliesLayer, Stack<deadline::DeadlineLayer, Stack<CountRpcsLayer, Identity>>>,
>;

fn router(
    profiler: &Arc<profiler::ProfilerService>,
    analysis: &Arc<profile_analysis::ProfileAnalysisService>,
    triggers: &Arc<trigger::TriggerService>,
    telemetry: &Telemetry,
    bodies: &BoundedBodiesLayer,
    max_connection_age: Duration,
    tls: Option<ServerTlsConfig>,
) -> Result<Router<Layers>, tonic::transport::Error> {
    let mut server = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        // No grace: tonic's grace replaces the graceful GOAWAY with a forced
        // close at age + grace, which would cut a long capture short.
        .max_connection_age(max_connection_age)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT));
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    Ok(server
        .layer(telemetry.rpc_layer())
        .layer(deadline::DeadlineLayer)
        .layer(FramedRepliesLayer)
        .layer(bodies.clone())
        .add_service(telemetry.health_service())
        .add_service(
            ProfilerServiceServer::from_arc(Arc::clone(profiler))
                .max_decoding_message_size(MAX_REQUEST_BYTES)
                .max_encoding_message_size(MAX_REPLY_BYTES),
        )
        .add_service(
            ProfileAnalysisServer::from_arc(Arc::clone(analysis))
                .max_decoding_message_size(MAX_REQUEST_BYTES)
                .max_encoding_message_size(MAX_REPLY_BYTES),
        )
        .add_service(
            TriggerServer::from_arc(Arc::clone(triggers))
                .max_decoding_message_size(MAX_REQUEST_BYTES),
        ))
}
