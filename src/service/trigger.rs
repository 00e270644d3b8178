//! `devtrace.Trigger`: fires one of the agent's trigger rules on request
//! (`devtrace trigger NAME`), behind the same listeners, TLS and client
//! certificates as the profiler service.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use tracing::info;

use super::access::Access;
use super::validate::{check_characters, invalid};
use crate::backend::Scope;
use crate::proto::devtrace::trigger_server;
use crate::proto::devtrace::{FireRequest, FireResponse};
use crate::protocol::listen::caller_of_request;
use crate::trigger::rule::MAX_NAME;
use crate::trigger::{FireError, Triggers, MAX_REASON};

/// See the module documentation; without rules every name is NOT_FOUND.
/// A rule saves the whole host's window, so only a caller whose captures
/// hold the whole host may fire one.
pub struct TriggerService {
    triggers: Option<Arc<Triggers>>,
    access: Access,
}

impl TriggerService {
    pub fn new(triggers: Option<Arc<Triggers>>, access: Access) -> TriggerService {
        TriggerService { triggers, access }
    }
}

/// What keeps a save from landing in the repository, looked at on a
/// thread of its own and for a bounded time (a stalled mount must not hold
/// the reply).
async fn repository_warnings(triggers: &Arc<Triggers>, repository: &str) -> Vec<String> {
    const LOOK_FOR: Duration = Duration::from_secs(2);
    let triggers = Arc::clone(triggers);
    let looked = tokio::task::spawn_blocking(move || triggers.unwritable_repository());
    match tokio::time::timeout(LOOK_FOR, looked).await {
        Ok(Ok(warning)) => warning.into_iter().collect(),
        Ok(Err(_)) => Vec::new(),
        Err(_) => vec![format!(
            "whether {repository} is writable could not be told in {} s (a stalled mount?)",
            LOOK_FOR.as_secs()
        )],
    }
}

#[tonic::async_trait]
impl trigger_server::Trigger for TriggerService {
    async fn fire(&self, request: Request<FireRequest>) -> Result<Response<FireResponse>, Status> {
        let caller = caller_of_request(&request)?;
        if self.access.scope_of(&caller) != Ok(Scope::Host) {
            info!(%caller, "trigger firing refused");
            return Err(Status::permission_denied(format!(
                "{caller} may not fire a trigger: its saved session holds the whole host's \
                 window, which only admins (--admin-group, --admin-client) capture"
            )));
        }
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
        // It goes into logs and traces.
        check_characters("reason", &request.reason)?;
        let Some(triggers) = &self.triggers else {
            return Err(Status::not_found(format!(
                "no trigger rule is named {:?}: this agent has no rules (devtrace serve --trigger)",
                request.name
            )));
        };
        match triggers.fire(&request.name, &request.reason) {
            Ok(fired) => {
                info!(%caller, rule = %request.name, "trigger fired on request");
                Ok(Response::new(FireResponse {
                    fired_at_ns: fired.at_ns,
                    window_start_ns: fired.window.start_ns,
                    window_stop_ns: fired.window.stop_ns,
                    warnings: repository_warnings(triggers, &fired.repository).await,
                    repository: fired.repository,
                }))
            }
            Err(error @ FireError::NotFound { .. }) => Err(Status::not_found(error.to_string())),
            Err(error @ FireError::Held { .. }) => {
                Err(Status::resource_exhausted(error.to_string()))
            }
        }
    }
}
