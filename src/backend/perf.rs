//! The perf backend: Linux perf event counters, read at an interval and
//! recorded as counter tracks on the `/host:CPU` plane: per CPU the software
//! counters (CPU clock, context switches, page faults, migrations) and, where
//! the machine exposes them, hardware cycles and instructions; optionally the
//! same for chosen processes.
//!
//! Counting every CPU needs root or `kernel.perf_event_paranoid` <= 0; when
//! the kernel refuses, the backend says why and stays off. Hardware counters
//! are often absent in virtual machines; then only the software ones run and
//! the health report says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use perf_event::events::{Event as PerfEvent, Hardware, Software};
use perf_event::{Builder, Counter};

use super::worker::{pace, Worker};
use super::{Backend, BackendContext, BackendError, Capabilities, Health};
use crate::clock;
use crate::event::{Device, Event, NameId, Payload};
use crate::model::timeline::COUNTER_TRACK;

#[derive(Clone, Debug)]
pub struct PerfConfig {
    /// Reading interval while a capture runs.
    pub interval: Duration,
    /// Reading interval otherwise.
    pub idle_interval: Duration,
    /// Processes to count on their own, besides every CPU.
    pub pids: Vec<i32>,
}

impl Default for PerfConfig {
    fn default() -> Self {
        PerfConfig {
            interval: Duration::from_millis(10),
            idle_interval: Duration::from_secs(1),
            pids: Vec::new(),
        }
    }
}

const SOFTWARE: [(Software, &str); 4] = [
    (Software::CPU_CLOCK, "CPU clock (ms/s)"),
    (Software::CONTEXT_SWITCHES, "context switches/s"),
    (Software::PAGE_FAULTS, "page faults/s"),
    (Software::CPU_MIGRATIONS, "migrations/s"),
];
const HARDWARE: [(Hardware, &str); 2] = [
    (Hardware::CPU_CYCLES, "cycles/s"),
    (Hardware::INSTRUCTIONS, "instructions/s"),
];

/// One open counter and what its track is called.
struct Track {
    counter: Counter,
    name: NameId,
    /// CPU clock counts nanoseconds; shown as busy milliseconds per second.
    scale: f64,
    last: u64,
}

/// Opens one counter as the backend does (also `devtrace doctor`'s check).
pub(crate) fn open(
    kind: PerfEvent,
    cpu: Option<usize>,
    pid: Option<i32>,
) -> std::io::Result<Counter> {
    let mut builder = Builder::new().kind(kind);
    builder = match (cpu, pid) {
        (Some(cpu), _) => builder.one_cpu(cpu).any_pid(),
        (None, Some(pid)) => builder.observe_pid(pid).any_cpu(),
        (None, None) => builder.observe_self(),
    };
    builder.include_kernel();
    let mut counter = builder.build()?;
    counter.enable()?;
    Ok(counter)
}

fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let count = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(count).unwrap_or(1).max(1)
}

#[derive(Default)]
struct Status {
    tracks: usize,
    hardware: Option<String>,
    failed_reads: u64,
}

/// See the module documentation.
pub struct PerfBackend {
    config: PerfConfig,
    running: Option<Worker>,
    status: Arc<Mutex<Status>>,
}

impl PerfBackend {
    pub fn new(config: PerfConfig) -> PerfBackend {
        PerfBackend {
            config,
            running: None,
            status: Arc::default(),
        }
    }
}

fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable {
        backend: "perf",
        reason,
    }
}

impl Backend for PerfBackend {
    fn name(&self) -> &'static str {
        "perf"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: vec!["per-CPU and per-process perf counters"],
            max_delay: self.config.interval * 2,
            held_until_asked: std::time::Duration::ZERO,
        }
    }

    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        if self.running.is_some() {
            return Ok(());
        }
        let registry = &context.registry;
        let mut tracks = Vec::new();
        let mut hardware_error = None;
        let mut scopes: Vec<(String, Option<usize>, Option<i32>)> = (0..online_cpus())
            .map(|cpu| (format!("cpu{cpu}"), Some(cpu), None))
            .collect();
        scopes.extend(
            self.config
                .pids
                .iter()
                .map(|pid| (format!("pid {pid}"), None, Some(*pid))),
        );
        for (scope, cpu, pid) in &scopes {
            for (kind, label) in SOFTWARE {
                let counter = open(kind.into(), *cpu, *pid).map_err(|e| {
                    let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
                        .map(|s| s.trim().to_string())
                        .unwrap_or_else(|_| "unknown".into());
                    unavailable(format!(
                        "cannot open the {label} counter for {scope}: {e} (perf_event_paranoid is {paranoid}; \
                         run as root or lower it)"
                    ))
                })?;
                let scale = if kind == Software::CPU_CLOCK {
                    1e-6
                } else {
                    1.0
                };
                tracks.push(Track {
                    counter,
                    name: registry.intern(&format!("{scope} {label}")),
                    scale,
                    last: 0,
                });
            }
            for (kind, label) in HARDWARE {
                if hardware_error.is_some() {
                    break;
                }
                match open(kind.into(), *cpu, *pid) {
                    Ok(counter) => tracks.push(Track {
                        counter,
                        name: registry.intern(&format!("{scope} {label}")),
                        scale: 1.0,
                        last: 0,
                    }),
                    Err(e) => hardware_error = Some(format!("hardware counters unavailable: {e}")),
                }
            }
        }
        {
            let mut status = self.status.lock();
            status.tracks = tracks.len();
            status.hardware = hardware_error;
        }
        let mut producer = context.producer().map_err(|e| BackendError::Start {
            backend: "perf",
            reason: e.to_string(),
        })?;
        let status = Arc::clone(&self.status);
        let captures = Arc::clone(&context.captures);
        let (interval, idle_interval) = (self.config.interval, self.config.idle_interval);
        let worker = Worker::spawn("perf", move |stop| {
            let mut batch = Vec::with_capacity(tracks.len());
            for track in &mut tracks {
                track.last = track.counter.read().unwrap_or(0);
            }
            let mut last_read = Instant::now();
            while !stop.is_set() {
                pace(&stop, &captures, interval, idle_interval);
                let elapsed = last_read.elapsed().as_secs_f64().max(1e-9);
                last_read = Instant::now();
                let now = clock::now_ns();
                for track in &mut tracks {
                    match track.counter.read() {
                        Ok(value) => {
                            let delta = value.saturating_sub(track.last) as f64;
                            track.last = value;
                            batch.push(Event::new(
                                now,
                                0,
                                Device::Host,
                                COUNTER_TRACK,
                                track.name,
                                Payload::Counter {
                                    value: delta * track.scale / elapsed,
                                },
                            ));
                        }
                        Err(_) => status.lock().failed_reads += 1,
                    }
                }
                producer.push_batch(&batch);
                batch.clear();
            }
        })?;
        self.running = Some(worker);
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(worker) = self.running.take() {
            worker.stop();
        }
    }

    fn health(&self) -> Health {
        if let Some(health) = Worker::not_running(self.running.as_ref(), "reading") {
            return health;
        }
        let status = self.status.lock();
        let mut detail = format!("{} counters", status.tracks);
        if let Some(hardware) = &status.hardware {
            detail.push_str(&format!(", {hardware}"));
        }
        if status.failed_reads > 0 {
            detail.push_str(&format!(", {} failed reads", status.failed_reads));
        }
        Health::Running { detail }
    }
}

impl Drop for PerfBackend {
    fn drop(&mut self) {
        self.stop();
    }
}
