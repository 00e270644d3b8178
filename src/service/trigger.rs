//! `devtrace.Trigger`: fires one of the agent's trigger rules on request
//! (`devtrace trigger NAME`), behind the same listeners, TLS and client
//! certificates as the profiler service.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::validate::invalid;
use crate::proto::devtrace::trigger_server;
use crate::proto::devtrace::{FireRequest, FireResponse};
use crate::trigger::rule::MAX_NAME;
use crate::trigger::{FireError, Triggers, MAX_REASON};

/// See the module documentation; without rules every name is NOT_FOUND.
pub struct TriggerService {
    triggers: Option<Arc<Triggers>>,
}

impl TriggerService {
    pub fn new(triggers: Option<Arc<Triggers>>) -> TriggerService {
        TriggerService { triggers }
    }
}

#[tonic::async_trait]
impl trigger_server::Trigger for TriggerService {
    async fn fire(&self, request: Request<FireRequest>) -> Result<Response<FireResponse>, Status> {
        let request = request.into_inner();
        if request.name.is_empty() || request.name.len() > MAX_NAME {
            return Err(invalid(
                "name",
                format!("the name of a trigger rule, 1 to {MAX_NAME} bytes"),
            ));
        }
        if request.reason.len() > MAX_REASON {
            return Err(invalid("reason", format!("at most {MAX_REASON} bytes")));
        }
        let Some(triggers) = &self.triggers else {
            return Err(Status::not_found(format!(
                "no trigger rule is named {:?}: this agent has no rules (devtrace serve --trigger)",
                request.name
            )));
        };
        match triggers.fire(&request.name, &request.reason) {
            Ok(fired) => Ok(Response::new(FireResponse {
                fired_at_ns: fired.at_ns,
                window_start_ns: fired.window.start_ns,
                window_stop_ns: fired.window.stop_ns,
            })),
            Err(error @ FireError::NotFound { .. }) => Err(Status::not_found(error.to_string())),
            Err(error @ FireError::Held { .. }) => {
                Err(Status::resource_exhausted(error.to_string()))
            }
        }
    }
}
