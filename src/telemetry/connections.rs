//! Metrics of the listeners' connection bounds ([`crate::protocol::listen`]):
//! connections open, accepted and closed at once past a bound, and accept
//! errors, per listener.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::agent_metrics::{family, Series};

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
        let each = |value: fn(&GateCounts) -> u64| -> Series<[(&str, &str); 1], ConstCounter> {
            counts
                .iter()
                .map(|(listener, count)| {
                    ([("listener", *listener)], ConstCounter::new(value(count)))
                })
                .collect()
        };
        family(
            &mut encoder,
            "devtrace_connections_open",
            "Connections open, by listener",
            counts
                .iter()
                .map(|(listener, count)| {
                    (
                        [("listener", *listener)],
                        ConstGauge::new(count.open as i64),
                    )
                })
                .collect(),
        )?;
        family(
            &mut encoder,
            "devtrace_connections_accepted",
            "Connections accepted, by listener",
            each(|count| count.accepted),
        )?;
        family(
            &mut encoder,
            "devtrace_connections_refused",
            "Connections closed at once, by listener and bound: the listener's (full) or one \
             peer's (peer)",
            counts
                .iter()
                .flat_map(|(listener, count)| {
                    [("full", count.refused_full), ("peer", count.refused_peer)].map(
                        |(bound, value)| {
                            (
                                [("listener", *listener), ("bound", bound)],
                                ConstCounter::new(value),
                            )
                        },
                    )
                })
                .collect(),
        )?;
        family(
            &mut encoder,
            "devtrace_accept_errors",
            "Accept errors (out of file descriptors, say), by listener; accepting pauses after \
             each",
            each(|count| count.accept_errors),
        )
    }
}
