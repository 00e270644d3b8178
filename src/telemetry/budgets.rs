//! Metrics of the agent's memory budgets: what it may use and the capture
//! budget as sized at start, and what the capture budget holds now (read
//! at scrape time from the captures, a layer above, through
//! [`BudgetUse`]).

use std::sync::{Arc, OnceLock, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::agent_metrics::gauge;

/// A budget as telemetry reads it.
pub trait BudgetUse: Send + Sync {
    /// Bytes reserved from it now.
    fn held_bytes(&self) -> u64;

    /// Bytes spilled traces take now and may take at once
    /// (`--spill-size`), when spilling is on.
    fn spill_bytes(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The capture budget's use, once the captures have started.
pub(super) struct CaptureBudgetUse(pub(super) Arc<OnceLock<Weak<dyn BudgetUse>>>);

impl std::fmt::Debug for CaptureBudgetUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureBudgetUse").finish_non_exhaustive()
    }
}

impl Collector for CaptureBudgetUse {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(budget) = self.0.get().and_then(Weak::upgrade) else {
            return Ok(());
        };
        gauge(
            &mut encoder,
            "devtrace_capture_memory_held_bytes",
            "Bytes of --capture-memory reserved now by traces being built and sent",
            budget.held_bytes() as f64,
        )?;
        if let Some((used, limit)) = budget.spill_bytes() {
            gauge(
                &mut encoder,
                "devtrace_spill_bytes",
                "Bytes of --spill-dir taken now by traces that outgrew their share of --capture-memory",
                used as f64,
            )?;
            gauge(
                &mut encoder,
                "devtrace_spill_limit_bytes",
                "--spill-size: bytes spilled traces may take at once",
                limit as f64,
            )?;
        }
        Ok(())
    }
}
