//! The agent: one registry, one ring, one collector, one store, and the
//! backends that feed them. Services hold an `Arc<Agent>` and ask it for
//! captures; nothing else about the event path is visible to them.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{info, warn};

use crate::backend::mock::{MockBackend, MockConfig};
use crate::backend::{Backend, BackendContext, BackendError, Health};
use crate::clock;
use crate::collect::{Collector, CollectorError};
use crate::registry::{Registry, RegistrySnapshot};
use crate::ring::{DropPolicy, Ring, RingError};
use crate::store::{Store, StoreConfig, StoreStats, Window, WindowData};

/// Which backends `serve` starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// Every backend that works on this machine; the mock when none does.
    Auto,
    /// The deterministic mock backend.
    Mock,
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub backends: Vec<BackendChoice>,
    pub mock: MockConfig,
    pub store: StoreConfig,
    pub ring_lanes: u32,
    pub ring_capacity: u64,
    pub drop_policy: DropPolicy,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            backends: vec![BackendChoice::Auto],
            mock: MockConfig::default(),
            store: StoreConfig::default(),
            ring_lanes: 16,
            ring_capacity: 1 << 16,
            drop_policy: DropPolicy::DropNewest,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    #[error("collector: {0}")]
    Collector(#[from] CollectorError),
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
}

/// See the module documentation.
pub struct Agent {
    registry: Arc<Registry>,
    store: Arc<Store>,
    ring: Arc<Ring>,
    collector: Collector,
    backends: Mutex<Vec<Box<dyn Backend>>>,
    max_delay: Duration,
}

impl Agent {
    pub fn start(config: &AgentConfig) -> Result<Arc<Agent>, AgentError> {
        let registry = Registry::new();
        let store = Arc::new(Store::new(config.store));
        let ring = Ring::new(config.ring_lanes, config.ring_capacity, config.drop_policy)?;
        let collector = Collector::start(Arc::clone(&store))?;
        collector.attach(&ring)?;
        let context = BackendContext {
            registry: Arc::clone(&registry),
            ring: Arc::clone(&ring),
        };
        let mut backends = Vec::new();
        for mut backend in select_backends(config) {
            match backend.start(context.clone()) {
                Ok(()) => {
                    info!(backend = backend.name(), records = ?backend.capabilities().records, "backend started");
                    backends.push(backend);
                }
                Err(error) => warn!(backend = backend.name(), %error, "backend not started"),
            }
        }
        if backends.is_empty() {
            return Err(BackendError::Unavailable {
                backend: "all",
                reason: "no backend could start".into(),
            }
            .into());
        }
        let max_delay = backends
            .iter()
            .map(|b| b.capabilities().max_delay)
            .max()
            .unwrap_or_default();
        Ok(Arc::new(Agent {
            registry,
            store,
            ring,
            collector,
            backends: Mutex::new(backends),
            max_delay,
        }))
    }

    /// Longest delay of any backend between an event and its arrival.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    pub fn store_config(&self) -> StoreConfig {
        self.store.config()
    }

    /// Makes every event pushed so far queryable.
    pub async fn flush(&self) -> Result<(), CollectorError> {
        self.collector.flush().await
    }

    /// Waits until `window` is over and its events have arrived, then returns
    /// them. Dropping the future abandons the capture and frees everything.
    pub async fn collect(
        &self,
        window: Window,
    ) -> Result<(WindowData, RegistrySnapshot), CollectorError> {
        let ready_at = window
            .stop_ns
            .saturating_add(clock::duration_ns(self.max_delay));
        tokio::time::sleep(clock::until(ready_at)).await;
        self.flush().await?;
        Ok((self.store.query(window), self.registry.snapshot()))
    }

    pub fn backend_health(&self) -> Vec<(&'static str, Health)> {
        self.backends
            .lock()
            .iter()
            .map(|b| (b.name(), b.health()))
            .collect()
    }

    pub fn store_stats(&self) -> StoreStats {
        self.store.stats()
    }

    pub fn ring_stats(&self) -> crate::ring::RingStats {
        self.ring.stats()
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Stops every backend; the collector drains what is left.
    pub fn shutdown(&self) {
        for backend in self.backends.lock().iter_mut() {
            backend.stop();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn select_backends(config: &AgentConfig) -> Vec<Box<dyn Backend>> {
    let mut chosen: Vec<Box<dyn Backend>> = Vec::new();
    let mut want_mock = false;
    for choice in &config.backends {
        match choice {
            // No hardware backend exists yet, so auto resolves to the mock.
            BackendChoice::Auto => {
                info!("backend auto: no hardware backend available here, using the mock backend");
                want_mock = true;
            }
            BackendChoice::Mock => want_mock = true,
        }
    }
    if want_mock {
        chosen.push(Box::new(MockBackend::new(config.mock)));
    }
    chosen
}
