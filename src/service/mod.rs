//! The gRPC services: requests are validated here, turned into captures on
//! the [`crate::agent::Agent`], and the results turned into replies or files.

pub mod profile_analysis;
pub mod profiler;
pub mod repository;
pub mod validate;

use std::sync::Arc;

use tonic::transport::server::TcpIncoming;

use crate::proto::tensorflow::profile_analysis_server::ProfileAnalysisServer;
use crate::proto::tensorflow::profiler_service_server::ProfilerServiceServer;

/// Largest message accepted or sent: real traces run to hundreds of MB and the
/// TensorFlow client accepts up to 2 GiB.
pub const MAX_MESSAGE_BYTES: usize = i32::MAX as usize;

/// Serves ProfilerService and ProfileAnalysis on `listener` until `shutdown`
/// resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    profiler: Arc<profiler::ProfilerService>,
    analysis: Arc<profile_analysis::ProfileAnalysisService>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // Server::tcp_nodelay does not reach sockets from a caller's listener;
    // without it small replies wait on Nagle's algorithm.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(
            ProfilerServiceServer::from_arc(profiler)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            ProfileAnalysisServer::from_arc(analysis)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
