//! Metrics of the listeners' connection bounds ([`crate::protocol::listen`]):
//! connections open, accepted and closed at once past a bound, and accept
//! errors, per listener.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::protocol::listen::{Gate, GateCounts};

/// The gates of the listeners serving, by listener name.
#[derive(Debug, Default)]
pub struct Gates {
    gates: Mutex<Vec<(&'static str, Arc<Gate>)>>,
}

impl Gates {
    pub fn watch(&self, listener: &'static str, gate: &Arc<Gate>) {
        let mut gates = self.gates.lock();
        gates.retain(|(name, _)| *name != listener);
        gates.push((listener, Arc::clone(gate)));
    }

    fn counts(&self) -> Vec<(&'static str, GateCounts)> {
        self.gates
            .lock()
            .iter()
            .map(|(name, gate)| (*name, gate.counts()))
            .collect()
    }
}

/// Reads the gates at scrape time.
#[derive(Debug)]
pub struct ConnectionMetrics(pub Arc<Gates>);

impl Collector for ConnectionMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let counts = self.0.counts();
        if counts.is_empty() {
            return Ok(());
        }
        let mut open = encoder.encode_descriptor(
            "devtrace_connections_open",
            "Connections open, by listener.",
            None,
            MetricType::Gauge,
        )?;
        for (listener, count) in &counts {
            ConstGauge::new(count.open as i64)
                .encode(open.encode_family(&[("listener", *listener)])?)?;
        }
        let mut accepted = encoder.encode_descriptor(
            "devtrace_connections_accepted",
            "Connections accepted, by listener.",
            None,
            MetricType::Counter,
        )?;
        for (listener, count) in &counts {
            ConstCounter::new(count.accepted)
                .encode(accepted.encode_family(&[("listener", *listener)])?)?;
        }
        let mut refused = encoder.encode_descriptor(
            "devtrace_connections_refused",
            "Connections closed at once, by listener and bound: the listener's (full) or one \
             peer's (peer).",
            None,
            MetricType::Counter,
        )?;
        for (listener, count) in &counts {
            for (bound, value) in [("full", count.refused_full), ("peer", count.refused_peer)] {
                ConstCounter::new(value)
                    .encode(refused.encode_family(&[("listener", *listener), ("bound", bound)])?)?;
            }
        }
        let mut errors = encoder.encode_descriptor(
            "devtrace_accept_errors",
            "Accept errors (out of file descriptors, say), by listener; accepting pauses after \
             each.",
            None,
            MetricType::Counter,
        )?;
        for (listener, count) in &counts {
            ConstCounter::new(count.accept_errors)
                .encode(errors.encode_family(&[("listener", *listener)])?)?;
        }
        Ok(())
    }
}
