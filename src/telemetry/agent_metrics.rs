//! What the agent knows, read at scrape time: events each backend put into
//! the ring, events lost and where, the flight recorder's contents, each
//! backend's state, and the latest NVML reading of every GPU (named after
//! dcgm-exporter's fields, with its `gpu` label and the GPU's `uuid`);
//! and how often each trigger rule fired, was held back, and saved.
//!
//! Every figure is a running total or a current value the agent keeps
//! anyway; a scrape only reads them (short locks the backends also take
//! briefly), so scraping never slows the event path.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::{ArmedRules, RuleCounts};
use crate::agent::Agent;
use crate::backend::{GpuReading, Health};

/// See the module documentation.
pub(super) struct AgentMetrics {
    agent: Arc<OnceLock<Arc<Agent>>>,
}

impl AgentMetrics {
    pub(super) fn new(agent: Arc<OnceLock<Arc<Agent>>>) -> AgentMetrics {
        AgentMetrics { agent }
    }
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

/// The trigger rules' counts, once the rules are armed and while they run.
pub(super) struct TriggerMetrics {
    triggers: Arc<OnceLock<Weak<dyn ArmedRules>>>,
}

impl TriggerMetrics {
    pub(super) fn new(triggers: Arc<OnceLock<Weak<dyn ArmedRules>>>) -> TriggerMetrics {
        TriggerMetrics { triggers }
    }
}

impl std::fmt::Debug for TriggerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TriggerMetrics").finish_non_exhaustive()
    }
}

/// One of a rule's counts: the label value that names it, and where it is.
type Kind = (&'static str, fn(&RuleCounts) -> &AtomicU64);

impl Collector for TriggerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(triggers) = self.triggers.get().and_then(Weak::upgrade) else {
            return Ok(());
        };
        // One reading of every rule's counts, by name.
        let mut rules: Vec<(String, RuleCounts)> = Vec::new();
        triggers.each_rule(&mut |rule, counts| rules.push((rule.to_string(), counts.read())));
        let counter = |value: &AtomicU64| ConstCounter::new(value.load(Relaxed));
        // A series per rule and kind, told apart by `label`.
        let by = |label: &'static str, kinds: &[Kind]| {
            rules
                .iter()
                .flat_map(|(rule, counts)| {
                    kinds.iter().map(move |(kind, value)| {
                        (
                            [("rule", rule.as_str()), (label, kind)],
                            counter(value(counts)),
                        )
                    })
                })
                .collect::<Series<_, _>>()
        };
        family(
            &mut encoder,
            "devtrace_trigger_firings",
            "Firings of each trigger rule that passed its cool-down and hourly cap",
            rules
                .iter()
                .map(|(rule, counts)| ([("rule", rule.as_str())], counter(&counts.fired)))
                .collect(),
        )?;
        family(
            &mut encoder,
            "devtrace_trigger_suppressed",
            "Firings of each trigger rule held back, by reason (cooldown, max_per_hour)",
            by(
                "reason",
                &[
                    ("cooldown", |counts| &counts.held_cooldown),
                    ("max_per_hour", |counts| &counts.held_hourly_cap),
                ],
            ),
        )?;
        family(
            &mut encoder,
            "devtrace_trigger_saves",
            "Traces of trigger firings, by outcome (saved, failed, lost: an earlier agent was \
             killed while saving them)",
            by(
                "outcome",
                &[
                    ("saved", |counts| &counts.saved),
                    ("failed", |counts| &counts.failed),
                    ("lost", |counts| &counts.lost),
                ],
            ),
        )
    }
}

/// One series of a family: its labels and value.
pub(super) type Series<L, V> = Vec<(L, V)>;

/// A family's HELP and TYPE lines. The help gets the closing period
/// prometheus-client gives the metrics registered with it.
fn describe<'e>(
    encoder: &'e mut DescriptorEncoder,
    name: &'e str,
    help: &str,
    kind: MetricType,
) -> Result<MetricEncoder<'e>, std::fmt::Error> {
    encoder.encode_descriptor(name, &format!("{help}."), None, kind)
}

/// A family of series; nothing when it has none.
pub(super) fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: Series<L, M>,
) -> std::fmt::Result {
    let Some((_, first)) = series.first() else {
        return Ok(());
    };
    let mut family = describe(encoder, name, help, first.metric_type())?;
    for (labels, metric) in &series {
        metric.encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

pub(super) fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> std::fmt::Result {
    let family = describe(encoder, name, help, MetricType::Gauge)?;
    ConstGauge::new(value).encode(family)
}

type Labels = Vec<(&'static str, String)>;

impl Collector for AgentMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(agent) = self.agent.get() else {
            return Ok(());
        };
        let ring = agent.ring_sources();
        family(
            &mut encoder,
            "devtrace_events_ingested",
            "Events each backend (and the tap) put into the agent's ring",
            ring.iter()
                .map(|(source, counts)| ([("backend", *source)], ConstCounter::new(counts.pushed)))
                .collect(),
        )?;
        let mut dropped: Series<[(&str, &str); 2], u64> = ring
            .iter()
            .map(|(source, counts)| {
                (
                    [("backend", *source), ("place", "agent_ring")],
                    counts.dropped_newest + counts.dropped_oldest,
                )
            })
            .collect();
        dropped.extend(
            agent
                .losses()
                .into_iter()
                .map(|(backend, loss)| ([("backend", backend), ("place", loss.place)], loss.count)),
        );
        family(
            &mut encoder,
            "devtrace_events_dropped",
            "Events lost, by backend and place: the agent's ring (full), a BPF ring buffer, \
             CUPTI, a workload's ring, the flight recorder (misdated), the name table",
            dropped
                .into_iter()
                .map(|(labels, count)| (labels, ConstCounter::new(count)))
                .collect(),
        )?;
        flight_recorder(&mut encoder, agent)?;
        backend_health(&mut encoder, &agent.backend_health())?;
        gpus(&mut encoder, &agent.gpu_readings())
    }
}

fn flight_recorder(encoder: &mut DescriptorEncoder, agent: &Agent) -> std::fmt::Result {
    let stats = agent.store_stats();
    let config = agent.store_config();
    gauge(
        encoder,
        "devtrace_flight_recorder_bytes",
        "Bytes of events the flight recorder holds",
        stats.bytes as f64,
    )?;
    gauge(
        encoder,
        "devtrace_flight_recorder_events",
        "Events the flight recorder holds",
        stats.events as f64,
    )?;
    gauge(
        encoder,
        "devtrace_flight_recorder_seconds",
        "Time from the earliest to the latest event the flight recorder holds",
        stats.span_ns as f64 / 1e9,
    )?;
    gauge(
        encoder,
        "devtrace_flight_recorder_limit_bytes",
        "The flight recorder's memory bound (--store-size)",
        config.max_bytes as f64,
    )?;
    gauge(
        encoder,
        "devtrace_flight_recorder_retention_seconds",
        "How much history the flight recorder keeps (--store-retention)",
        config.retention.as_secs_f64(),
    )
}

const STATES: [&str; 3] = ["running", "stopped", "failed"];

fn state_of(health: &Health) -> &'static str {
    match health {
        Health::Running { .. } => "running",
        Health::Stopped => "stopped",
        Health::Failed { .. } => "failed",
    }
}

fn backend_health(
    encoder: &mut DescriptorEncoder,
    backends: &[(&'static str, Health)],
) -> std::fmt::Result {
    let series = backends
        .iter()
        .flat_map(|(name, health)| {
            let current = state_of(health);
            STATES.map(|state| {
                (
                    [("backend", *name), ("state", state)],
                    ConstGauge::new(if state == current { 1.0 } else { 0.0 }),
                )
            })
        })
        .collect();
    family(
        encoder,
        "devtrace_backend_health",
        "1 for each backend's current state (running, stopped, failed), 0 for the others",
        series,
    )
}

/// The GPU gauges: name, help, and the reading's value.
type GpuGauge = (&'static str, &'static str, fn(&GpuReading) -> Option<f64>);

const GPU_GAUGES: [GpuGauge; 8] = [
    (
        "devtrace_gpu_utilization_percent",
        "Percent of the last sample period a kernel ran on the GPU (DCGM_FI_DEV_GPU_UTIL)",
        |r| r.sm_utilization_percent,
    ),
    (
        "devtrace_gpu_memory_copy_utilization_percent",
        "Percent of the last sample period device memory was read or written \
         (DCGM_FI_DEV_MEM_COPY_UTIL)",
        |r| r.memory_utilization_percent,
    ),
    (
        "devtrace_gpu_memory_used_bytes",
        "Device memory in use (DCGM_FI_DEV_FB_USED, in bytes rather than MiB)",
        |r| r.memory_used_bytes,
    ),
    (
        "devtrace_gpu_memory_total_bytes",
        "Device memory in all (DCGM_FI_DEV_FB_TOTAL, in bytes rather than MiB)",
        |r| r.memory_total_bytes,
    ),
    (
        "devtrace_gpu_power_usage_watts",
        "Power drawn by the GPU (DCGM_FI_DEV_POWER_USAGE)",
        |r| r.power_watts,
    ),
    (
        "devtrace_gpu_temperature_celsius",
        "GPU temperature (DCGM_FI_DEV_GPU_TEMP)",
        |r| r.temperature_celsius,
    ),
    (
        "devtrace_gpu_sm_clock_hertz",
        "SM clock (DCGM_FI_DEV_SM_CLOCK, in hertz rather than MHz)",
        |r| r.sm_clock_mhz.map(|mhz| mhz * 1e6),
    ),
    (
        "devtrace_gpu_memory_clock_hertz",
        "Memory clock (DCGM_FI_DEV_MEM_CLOCK, in hertz rather than MHz)",
        |r| r.memory_clock_mhz.map(|mhz| mhz * 1e6),
    ),
];

fn gpus(encoder: &mut DescriptorEncoder, readings: &[GpuReading]) -> std::fmt::Result {
    for (name, help, value_of) in GPU_GAUGES {
        let series: Series<Labels, ConstGauge<f64>> = readings
            .iter()
            .filter_map(|reading| {
                let labels = vec![
                    ("gpu", reading.index.to_string()),
                    ("uuid", reading.uuid.clone()),
                ];
                value_of(reading).map(|value| (labels, ConstGauge::new(value)))
            })
            .collect();
        family(encoder, name, help, series)?;
    }
    Ok(())
}
