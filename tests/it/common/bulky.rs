//! A profiler server that speaks the protocol but answers with a trace as
//! large as a test asks for, the reply a test gives, or fails with the
//! message a test gives (or answers `Monitor` with the text a test gives),
//! from inside the test process.

use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::profiler_service_server::{
    ProfilerService, ProfilerServiceServer,
};
use devtrace::proto::tensorflow::{
    ContinuousProfilingResponse, GetSnapshotRequest, MonitorRequest, MonitorResponse,
    ProfileRequest, ProfileResponse, StopContinuousProfilingRequest,
    StopContinuousProfilingResponse, TerminateRequest, TerminateResponse,
};
use prost::Message;
use tonic::{Request, Response, Status};

/// A profiler server that answers every `Profile` with an XSpace of about
/// `bytes` bytes, carried twice (as `xplane.pb` tool data and as `xspace`,
/// as some servers do): a hostile one when that is more than its callers
/// accept, a busy host's otherwise.
struct Bulky {
    answer: Answer,
}

/// What every `Profile` gets.
enum Answer {
    /// An XSpace of about this many bytes.
    Trace(usize),
    /// INTERNAL, with this message.
    Failure(String),
    /// This reply.
    Reply(ProfileResponse),
    /// UNIMPLEMENTED; every `Monitor` gets this text.
    Monitoring(String),
}

#[tonic::async_trait]
impl ProfilerService for Bulky {
    async fn profile(
        &self,
        _: Request<ProfileRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let bytes = match &self.answer {
            Answer::Trace(bytes) => *bytes,
            Answer::Failure(message) => return Err(Status::internal(message.clone())),
            Answer::Reply(reply) => return Ok(Response::new(reply.clone())),
            Answer::Monitoring(_) => return Err(Status::unimplemented("monitoring only")),
        };
        let space = XSpace {
            hostnames: vec!["h".repeat(bytes)],
            ..XSpace::default()
        };
        Ok(Response::new(ProfileResponse {
            tool_data: vec![devtrace::proto::tensorflow::ProfileToolData {
                name: "xplane.pb".into(),
                data: space.encode_to_vec().into(),
            }],
            empty_trace: false,
            xspace: Some(space),
        }))
    }
    async fn terminate(
        &self,
        _: Request<TerminateRequest>,
    ) -> Result<Response<TerminateResponse>, Status> {
        Ok(Response::new(TerminateResponse {}))
    }
    async fn monitor(
        &self,
        _: Request<MonitorRequest>,
    ) -> Result<Response<MonitorResponse>, Status> {
        match &self.answer {
            Answer::Monitoring(data) => Ok(Response::new(MonitorResponse {
                data: data.clone(),
                monitor_result: None,
            })),
            _ => Err(Status::unimplemented("bulky")),
        }
    }
    async fn start_continuous_profiling(
        &self,
        _: Request<ProfileRequest>,
    ) -> Result<Response<ContinuousProfilingResponse>, Status> {
        Err(Status::unimplemented("bulky"))
    }
    async fn stop_continuous_profiling(
        &self,
        _: Request<StopContinuousProfilingRequest>,
    ) -> Result<Response<StopContinuousProfilingResponse>, Status> {
        Err(Status::unimplemented("bulky"))
    }
    async fn get_snapshot(
        &self,
        _: Request<GetSnapshotRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        Err(Status::unimplemented("bulky"))
    }
}

/// Starts a [`Bulky`] server on loopback; its address.
pub async fn bulky_host(bytes: usize) -> String {
    serve(Bulky {
        answer: Answer::Trace(bytes),
    })
    .await
}

/// Starts a server whose every `Profile` fails with INTERNAL and
/// `message`; its address.
pub async fn failing_host(message: &str) -> String {
    serve(Bulky {
        answer: Answer::Failure(message.to_string()),
    })
    .await
}

/// Starts a server whose every `Profile` gets `reply`; its address.
pub async fn replying_host(reply: ProfileResponse) -> String {
    serve(Bulky {
        answer: Answer::Reply(reply),
    })
    .await
}

/// Starts a server whose every `Monitor` is answered `data`; its address.
pub async fn monitoring_host(data: &str) -> String {
    serve(Bulky {
        answer: Answer::Monitoring(data.to_string()),
    })
    .await
}

async fn serve(server: Bulky) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let service = ProfilerServiceServer::new(server);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    address
}
