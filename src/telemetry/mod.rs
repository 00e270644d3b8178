//! Health and metrics of a running agent, for the operator's probes and
//! monitoring: the standard gRPC health service on every gRPC listener
//! (`health.rs`), and an HTTP server on a separate address
//! (`--metrics-listen`, `http.rs`) with `/metrics` in Prometheus's
//! (OpenMetrics) text format, `/healthz` and `/readyz`.
//!
//! [`Telemetry`] is what they share: the serving phase (starting, serving,
//! stopping), the agent once its backends have started, the metrics of gRPC
//! calls (`rpc.rs`, counted as they end), the listeners' connection bounds
//! (`connections.rs`, read at scrape time) and the registry `/metrics`
//! encodes. Everything the agent itself knows (events, drops, the flight
//! recorder, backends, GPUs) is read at scrape time (`agent_metrics.rs`),
//! so no hot path updates a metric.

mod agent_metrics;
mod budgets;
mod connections;
pub mod health;
pub mod http;
pub mod rpc;

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::agent::Agent;
use crate::protocol::listen::Gate;
pub use budgets::BudgetUse;

/// Where the gRPC server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Backends starting, listeners not yet served.
    Starting = 0,
    /// The gRPC server accepts calls.
    Serving = 1,
    /// Shutting down: no new calls, captures in flight finishing.
    Stopping = 2,
}

/// How often one trigger rule fired, was held back, and saved: kept by
/// the rule, read by the metrics.
#[derive(Debug, Default)]
pub struct RuleCounts {
    pub fired: AtomicU64,
    pub held_cooldown: AtomicU64,
    pub held_hourly_cap: AtomicU64,
    pub saved: AtomicU64,
    pub failed: AtomicU64,
    /// Saves an earlier agent was killed in the middle of, found when this
    /// one started.
    pub lost: AtomicU64,
}

impl RuleCounts {
    /// A copy of the counts as they are now.
    pub fn read(&self) -> RuleCounts {
        let copy = |value: &AtomicU64| AtomicU64::new(value.load(Ordering::Relaxed));
        RuleCounts {
            fired: copy(&self.fired),
            held_cooldown: copy(&self.held_cooldown),
            held_hourly_cap: copy(&self.held_hourly_cap),
            saved: copy(&self.saved),
            failed: copy(&self.failed),
            lost: copy(&self.lost),
        }
    }
}

/// The armed trigger rules as telemetry reads them (the trigger service,
/// a layer above, implements it).
pub trait ArmedRules: Send + Sync {
    /// Calls `each` with every rule's name and counts.
    fn each_rule(&self, each: &mut dyn FnMut(&str, &RuleCounts));
    /// One line per rule with its counts, as Monitor shows them.
    fn summary(&self) -> String;
}

/// See the module documentation.
pub struct Telemetry {
    phase: AtomicU8,
    agent: Arc<OnceLock<Arc<Agent>>>,
    /// Weak: the triggers hold the profiler service, which holds this;
    /// a strong reference would keep them (and their watcher) alive forever.
    triggers: Arc<OnceLock<Weak<dyn ArmedRules>>>,
    health: health::ServingHealth,
    rpcs: Arc<rpc::RpcMetrics>,
    gates: Arc<connections::Gates>,
    memory_limit: Gauge,
    capture_budget: Gauge,
    /// Weak: the captures hold this; they are read while they live.
    capture_use: Arc<OnceLock<Weak<dyn BudgetUse>>>,
    registry: Registry,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("phase", &self.phase())
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    pub fn new() -> Arc<Telemetry> {
        let agent = Arc::new(OnceLock::new());
        let rpcs = Arc::new(rpc::RpcMetrics::default());
        let mut registry = Registry::default();
        rpcs.register(&mut registry);
        registry.register_collector(Box::new(agent_metrics::AgentMetrics::new(Arc::clone(
            &agent,
        ))));
        let triggers = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(agent_metrics::TriggerMetrics::new(Arc::clone(
            &triggers,
        ))));
        let memory_limit = Gauge::default();
        registry.register(
            "devtrace_memory_limit_bytes",
            "Memory the agent may use: its cgroup's limit, else the machine's memory",
            memory_limit.clone(),
        );
        let capture_budget = Gauge::default();
        registry.register(
            "devtrace_capture_memory_budget_bytes",
            "The budget of traces being built and sent (--capture-memory, as sized at start)",
            capture_budget.clone(),
        );
        let capture_use = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(budgets::CaptureBudgetUse(Arc::clone(
            &capture_use,
        ))));
        let gates = Arc::new(connections::Gates::default());
        registry.register_collector(Box::new(connections::ConnectionMetrics(Arc::clone(&gates))));
        Arc::new(Telemetry {
            phase: AtomicU8::new(Phase::Starting as u8),
            agent,
            triggers,
            health: health::ServingHealth::default(),
            rpcs,
            gates,
            memory_limit,
            capture_budget,
            capture_use,
            registry,
        })
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Starting,
            1 => Phase::Serving,
            _ => Phase::Stopping,
        }
    }

    /// Every backend asked for has started or said why not.
    pub fn agent_started(&self, agent: &Arc<Agent>) {
        let _ = self.agent.set(Arc::clone(agent));
    }

    /// The trigger rules are armed: their counts are reported from now on.
    pub fn triggers_started<R: ArmedRules + 'static>(&self, triggers: &Arc<R>) {
        let triggers: Weak<R> = Arc::downgrade(triggers);
        let _ = self.triggers.set(triggers);
    }

    /// The armed trigger rules, if any and still running.
    pub fn triggers(&self) -> Option<Arc<dyn ArmedRules>> {
        self.triggers.get().and_then(Weak::upgrade)
    }

    /// The gRPC server accepts calls: health SERVING.
    pub async fn serving(&self) {
        self.health.serving().await;
        self.phase.store(Phase::Serving as u8, Ordering::Release);
    }

    /// The gRPC server stops accepting calls: health NOT_SERVING, and
    /// readiness fails, while the captures in flight finish.
    pub async fn stopping(&self) {
        self.phase.store(Phase::Stopping as u8, Ordering::Release);
        self.health.not_serving().await;
    }

    /// Resolves once no gRPC call of the profiler's services is in
    /// progress (health checks are not counted): every reply sent, or
    /// dropped with its connection.
    pub async fn calls_ended(&self) {
        self.rpcs.calls_ended().await;
    }

    /// What `/readyz` answers: the backends' states when ready, else why not.
    pub fn readiness(&self) -> Result<String, String> {
        let agent = self.agent.get();
        match (self.phase(), agent) {
            (Phase::Stopping, _) => {
                Err("shutting down: the gRPC server accepts no new calls".into())
            }
            (_, None) => Err("starting: the backends are starting".into()),
            (Phase::Starting, Some(_)) => {
                Err("starting: the gRPC server is not serving yet".into())
            }
            (Phase::Serving, Some(agent)) => {
                let mut text = String::from("ready\n");
                for (name, health) in agent.backend_health() {
                    text.push_str(&format!("backend {name}: {health}\n"));
                }
                Ok(text)
            }
        }
    }

    /// The grpc.health.v1 service, for one gRPC listener.
    pub fn health_service(&self) -> health::HealthServer {
        self.health.service()
    }

    /// The memory the agent may use and its capture budget, as sized at
    /// start.
    pub fn memory_budgets(&self, limit: u64, capture: usize) {
        self.memory_limit
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
        self.capture_budget
            .set(i64::try_from(capture).unwrap_or(i64::MAX));
    }

    /// The captures have started: their budget's use is reported from now
    /// on.
    pub fn captures_started<B: BudgetUse + 'static>(&self, captures: &Arc<B>) {
        let captures: Weak<B> = Arc::downgrade(captures);
        let _ = self.capture_use.set(captures);
    }

    /// Reports `listener`'s connections and what its bounds refused.
    pub fn watch_connections(&self, listener: &'static str, gate: &Arc<Gate>) {
        self.gates.watch(listener, gate);
    }

    /// Counts and times the gRPC calls of the router it wraps.
    pub fn rpc_layer(&self) -> rpc::CountRpcsLayer {
        rpc::CountRpcsLayer::new(Arc::clone(&self.rpcs))
    }

    /// A capture's reply was ready `latency` after its window closed.
    pub fn capture_ready(&self, rpc: &'static str, latency: std::time::Duration) {
        self.rpcs.capture_ready(rpc, latency);
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode_metrics(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn readiness_names_what_is_missing_until_serving_and_while_stopping() {
        let telemetry = Telemetry::new();
        let reason = telemetry.readiness().unwrap_err();
        assert!(reason.contains("backends are starting"), "{reason}");

        let agent = Agent::start(&crate::agent::AgentConfig {
            backends: vec![crate::agent::BackendChoice::Mock],
            mock: crate::backend::mock::MockConfig {
                events_per_second: 0,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        telemetry.agent_started(&agent);
        let reason = telemetry.readiness().unwrap_err();
        assert!(reason.contains("not serving yet"), "{reason}");

        telemetry.serving().await;
        let ready = telemetry.readiness().unwrap();
        assert!(ready.starts_with("ready\nbackend mock: running"), "{ready}");

        telemetry.stopping().await;
        let reason = telemetry.readiness().unwrap_err();
        assert!(reason.contains("shutting down"), "{reason}");
    }
}
