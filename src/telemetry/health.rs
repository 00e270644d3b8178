//! The standard gRPC health service (`grpc.health.v1.Health`, from
//! tonic-health) on every gRPC listener: the whole server (`""`) and each
//! profiler service answer SERVING while the agent serves and NOT_SERVING
//! once it shuts down.
//!
//! A `Watch` stream ends right after it has sent NOT_SERVING: an open
//! stream would otherwise keep the server's graceful shutdown waiting
//! forever, and a watcher has nothing more to learn from a server that is
//! going away.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus as WireStatus;
use tonic_health::pb::health_server::{self, Health};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::proto::tensorflow::{profile_analysis_server, profiler_service_server};

/// The health service one listener serves.
pub type HealthServer = health_server::HealthServer<EndingWatch>;

/// The names whose health is reported: the server as a whole, and each
/// service it offers.
pub const SERVICES: [&str; 3] = [
    "",
    profiler_service_server::SERVICE_NAME,
    profile_analysis_server::SERVICE_NAME,
];

/// The statuses every listener's health service reads.
#[derive(Clone, Debug, Default)]
pub struct ServingHealth {
    reporter: HealthReporter,
}

impl ServingHealth {
    pub async fn serving(&self) {
        self.set(ServingStatus::Serving).await;
    }

    pub async fn not_serving(&self) {
        self.set(ServingStatus::NotServing).await;
    }

    async fn set(&self, status: ServingStatus) {
        for service in SERVICES {
            self.reporter.set_service_status(service, status).await;
        }
    }

    pub fn service(&self) -> HealthServer {
        health_server::HealthServer::new(EndingWatch(HealthService::from_health_reporter(
            self.reporter.clone(),
        )))
    }
}

/// tonic-health's service, with `Watch` streams that end after NOT_SERVING
/// (see the module documentation).
pub struct EndingWatch(HealthService);

#[tonic::async_trait]
impl Health for EndingWatch {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.0.check(request).await
    }

    type WatchStream = UntilNotServing<<HealthService as Health>::WatchStream>;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let statuses = self.0.watch(request).await?.into_inner();
        Ok(Response::new(UntilNotServing {
            statuses: Some(statuses),
        }))
    }
}

/// Passes statuses on, and ends after the first NOT_SERVING.
pub struct UntilNotServing<S> {
    statuses: Option<S>,
}

impl<S> Stream for UntilNotServing<S>
where
    S: Stream<Item = Result<HealthCheckResponse, Status>> + Unpin,
{
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(statuses) = self.statuses.as_mut() else {
            return Poll::Ready(None);
        };
        let next = std::task::ready!(Pin::new(statuses).poll_next(cx));
        let ends = match &next {
            Some(Ok(response)) => response.status == WireStatus::NotServing as i32,
            Some(Err(_)) | None => true,
        };
        if ends {
            self.statuses = None;
        }
        Poll::Ready(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn asking(service: &str) -> Request<HealthCheckRequest> {
        Request::new(HealthCheckRequest {
            service: service.into(),
        })
    }

    #[tokio::test]
    async fn every_service_turns_not_serving_and_watches_then_end() {
        let health = ServingHealth::default();
        health.serving().await;
        let server = EndingWatch(HealthService::from_health_reporter(health.reporter.clone()));
        for service in SERVICES {
            let reply = server.check(asking(service)).await.unwrap().into_inner();
            assert_eq!(reply.status, WireStatus::Serving as i32, "{service:?}");
        }
        let mut watch = server.watch(asking("")).await.unwrap().into_inner();
        let first = watch.next().await.unwrap().unwrap();
        assert_eq!(first.status, WireStatus::Serving as i32);

        health.not_serving().await;
        let last = watch.next().await.unwrap().unwrap();
        assert_eq!(last.status, WireStatus::NotServing as i32);
        assert!(watch.next().await.is_none(), "the stream ends");
        for service in SERVICES {
            let reply = server.check(asking(service)).await.unwrap().into_inner();
            assert_eq!(reply.status, WireStatus::NotServing as i32, "{service:?}");
        }
    }
}
