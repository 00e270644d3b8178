//! The gRPC services: requests are validated here, turned into captures on
//! the [`crate::agent::Agent`], and the results turned into replies or files.

pub mod framed_reply;
pub mod profile_analysis;
pub mod profiler;
pub mod session_hosts;
pub mod trigger;
pub mod validate;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Router, TcpIncoming};
use tonic::transport::ServerTlsConfig;
use tower_layer::{Identity, Stack};

use crate::proto::devtrace::trigger_server::TriggerServer;
use crate::proto::tensorflow::profile_analysis_server::ProfileAnalysisServer;
use crate::proto::tensorflow::profiler_service_server::ProfilerServiceServer;
use crate::telemetry::rpc::CountRpcsLayer;
use crate::telemetry::Telemetry;
use framed_reply::FramedRepliesLayer;

pub use crate::protocol::{MAX_REPLY_BYTES, MAX_REQUEST_BYTES};

/// Where the services listen: a TCP listener, with TLS or without, and
/// optionally a UNIX socket (plaintext, guarded by its file permissions).
pub struct Listeners {
    pub tcp: tokio::net::TcpListener,
    pub tls: Option<ServerTlsConfig>,
    pub unix: Option<tokio::net::UnixListener>,
}

impl From<tokio::net::TcpListener> for Listeners {
    fn from(tcp: tokio::net::TcpListener) -> Listeners {
        Listeners {
            tcp,
            tls: None,
            unix: None,
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
    // Server::tcp_nodelay does not reach sockets from a caller's listener;
    // without it small replies wait on Nagle's algorithm.
    let tcp = TcpIncoming::from(listeners.tcp).with_nodelay(Some(true));
    let tcp = router(&profiler, &analysis, &triggers, &telemetry, listeners.tls)?
        .serve_with_incoming_shutdown(tcp, stop.clone().cancelled_owned());
    let Some(unix) = listeners.unix else {
        return tcp.await;
    };
    let unix = router(&profiler, &analysis, &triggers, &telemetry, None)?
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(unix),
            stop.clone().cancelled_owned(),
        );
    let result = tokio::try_join!(tcp, unix).map(|_| ());
    // One listener failing ends the other too.
    stop.cancel();
    result
}

/// What every route passes through, innermost first: replies are framed
/// inside the RPC counter, which reads their status.
type Layers = Stack<FramedRepliesLayer, Stack<CountRpcsLayer, Identity>>;

fn router(
    profiler: &Arc<profiler::ProfilerService>,
    analysis: &Arc<profile_analysis::ProfileAnalysisService>,
    triggers: &Arc<trigger::TriggerService>,
    telemetry: &Telemetry,
    tls: Option<ServerTlsConfig>,
) -> Result<Router<Layers>, tonic::transport::Error> {
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    Ok(server
        .layer(telemetry.rpc_layer())
        .layer(FramedRepliesLayer)
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
