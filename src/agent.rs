//! The agent: one registry, one ring, one collector, one store, and the
//! backends that feed them. Services hold an `Arc<Agent>` and ask it for
//! captures; nothing else about the event path is visible to them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{info, warn};

use crate::backend::cuda::{CudaBackend, CudaConfig};
use crate::backend::ebpf::{EbpfBackend, EbpfConfig};
use crate::backend::mock::{MockBackend, MockConfig};
use crate::backend::nvml::{NvmlBackend, NvmlConfig};
use crate::backend::perf::{PerfBackend, PerfConfig};
use crate::backend::tpu::{TpuBackend, TpuConfig};
use crate::backend::{Backend, BackendContext, BackendError, GpuReading, Health, Loss};
use crate::backend::{ProcessLines, Scope, SessionSource, TraceDemand};
use crate::clock;
use crate::model::registry::{Registry, RegistrySnapshot};
use crate::recorder::collect::{Collector, CollectorError};
use crate::recorder::{ArrivalTap, Store, StoreConfig, StoreStats, Window, WindowData};
use crate::ring::{DropPolicy, Ring, RingError};

/// Which backends `serve` starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// Every backend that works on this machine (the device backends, the
    /// eBPF kernel hooks, injected CUDA processes); the mock when no device
    /// backend works.
    Auto,
    /// The deterministic mock backend.
    Mock,
    /// NVIDIA GPU health through NVML (utilisation, memory, power, ...).
    Nvml,
    /// TPU activity through libtpu's PJRT profiler extension.
    Tpu,
    /// Linux perf counters per CPU (and per process with --perf-pid).
    /// Not part of `auto`: it needs root and adds a counter track per CPU.
    Perf,
    /// Kernel hooks through eBPF: CPU scheduling of every thread and the
    /// CUDA driver calls of every process. Needs root (or CAP_BPF and
    /// CAP_PERFMON) and a kernel with BTF.
    Ebpf,
    /// GPU kernels, copies and memory of CUDA processes that load devtrace's
    /// injection library (CUDA_INJECTION64_PATH), through shared-memory
    /// rings in the runtime directory.
    Cuda,
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub backends: Vec<BackendChoice>,
    pub mock: MockConfig,
    pub nvml: NvmlConfig,
    pub tpu: TpuConfig,
    pub perf: PerfConfig,
    pub ebpf: EbpfConfig,
    pub cuda: CudaConfig,
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
            nvml: NvmlConfig::default(),
            tpu: TpuConfig::default(),
            perf: PerfConfig::default(),
            ebpf: EbpfConfig::default(),
            cuda: CudaConfig::default(),
            store: StoreConfig::default(),
            ring_lanes: 16,
            ring_capacity: 1 << 16,
            drop_policy: DropPolicy::DropNewest,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(transparent)]
    Collector(#[from] CollectorError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("no backend could start: {0}")]
    NoBackend(String),
}

/// See the module documentation.
pub struct Agent {
    registry: Arc<Registry>,
    store: Arc<Store>,
    ring: Arc<Ring>,
    collector: Collector,
    backends: Mutex<Vec<Box<dyn Backend>>>,
    /// Backends that were asked for but could not start, and why.
    unavailable: Vec<(&'static str, String)>,
    captures: Arc<AtomicUsize>,
    traces: Arc<TraceDemand>,
    detailed_traces: Arc<AtomicUsize>,
    max_delay: Duration,
    /// The longest [`crate::backend::Capabilities::held_until_asked`] of the backends.
    held_until_asked: Duration,
}

/// Marks a capture (or a Monitor) in progress for as long as it lives.
pub struct CaptureActivity {
    counters: Vec<Arc<AtomicUsize>>,
    /// A capture's trace and its scope; none for a Monitor.
    trace: Option<(Arc<TraceDemand>, Scope)>,
}

impl CaptureActivity {
    /// The capture's window is over: the tracers it switched on (CUPTI in
    /// the workloads, eBPF hooks) may switch off now, and hand over what
    /// they hold of the window's last moments (the injection library's
    /// partly filled CUPTI buffers come back only when it stops recording)
    /// while the agent waits for late events, rather than after the trace
    /// was built. Samplers stay fast until it is dropped.
    pub fn end_recording(&mut self) {
        if let Some((traces, scope)) = self.trace.take() {
            traces.end(scope);
        }
    }
}

impl Drop for CaptureActivity {
    fn drop(&mut self) {
        for counter in &self.counters {
            counter.fetch_sub(1, Ordering::Relaxed);
        }
        self.end_recording();
    }
}

impl Agent {
    pub fn start(config: &AgentConfig) -> Result<Arc<Agent>, AgentError> {
        let registry = Registry::new();
        let store = Arc::new(Store::new(config.store));
        let ring = Ring::new(config.ring_lanes, config.ring_capacity, config.drop_policy)?;
        let collector = Collector::start(Arc::clone(&store))?;
        collector.attach(&ring)?;
        let captures = Arc::new(AtomicUsize::new(0));
        let traces = Arc::new(TraceDemand::default());
        let detailed_traces = Arc::new(AtomicUsize::new(0));
        let context = BackendContext {
            registry: Arc::clone(&registry),
            ring: Arc::clone(&ring),
            captures: Arc::clone(&captures),
            traces: Arc::clone(&traces),
            detailed_traces: Arc::clone(&detailed_traces),
            library_processes: Arc::default(),
            source: "",
        };
        let (backends, unavailable) = start_backends(config, &context)?;
        let max_delay = backends
            .iter()
            .map(|b| b.capabilities().max_delay)
            .max()
            .unwrap_or_default();
        let held_until_asked = backends
            .iter()
            .map(|b| b.capabilities().held_until_asked)
            .max()
            .unwrap_or_default();
        Ok(Arc::new(Agent {
            registry,
            store,
            ring,
            collector,
            backends: Mutex::new(backends),
            unavailable,
            captures,
            traces,
            detailed_traces,
            max_delay,
            held_until_asked,
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
    /// them. For a trace of `scope` (`held_for`), the sources that hold some
    /// of their events until asked are asked once the window is over, and
    /// waited for ([`crate::backend::Capabilities::held_until_asked`]): a
    /// window of the past gets them too. Dropping the future abandons the
    /// capture and frees everything.
    pub async fn collect(
        &self,
        window: Window,
        held_for: Option<Scope>,
    ) -> Result<(WindowData, RegistrySnapshot), CollectorError> {
        tokio::time::sleep(clock::until(window.stop_ns)).await;
        let mut ready_at = window
            .stop_ns
            .saturating_add(clock::duration_ns(self.max_delay));
        if let Some(scope) = held_for.filter(|_| !self.held_until_asked.is_zero()) {
            self.traces.ask_for_held(scope);
            let held_ns = clock::duration_ns(self.held_until_asked);
            ready_at = ready_at.max(clock::now_ns().saturating_add(held_ns));
        }
        tokio::time::sleep(clock::until(ready_at)).await;
        self.flush().await?;
        Ok((self.store.query(window), self.registry.snapshot()))
    }

    /// Shows each chunk reaching the flight recorder to `tap`, for readers
    /// that watch events as they arrive rather than by window (one per
    /// agent; false when one is set already).
    pub fn tap_arrivals(&self, tap: ArrivalTap) -> bool {
        self.store.tap_arrivals(tap)
    }

    /// Events lost anywhere since the agent started: in its ring, before
    /// it (each backend's losses) and in the agent itself.
    pub fn dropped_total(&self) -> u64 {
        let ring: u64 = self
            .ring_sources()
            .iter()
            .map(|(_, counts)| counts.dropped_newest + counts.dropped_oldest)
            .sum();
        let elsewhere: u64 = self.losses().iter().map(|(_, loss)| loss.count).sum();
        ring + elsewhere
    }

    /// Backends that were asked for but could not start, with the reason.
    pub fn unavailable_backends(&self) -> &[(&'static str, String)] {
        &self.unavailable
    }

    /// Tells the backends a capture of `scope` is running until the guard
    /// is dropped: samplers sample faster and tracers (eBPF hooks, CUPTI in
    /// the workloads the scope covers) switch on; `detailed` when it asked
    /// for device-specific detail (`ProfileOptions.device_tracer_level` 2 or
    /// more).
    pub fn capture_activity(&self, detailed: bool, scope: Scope) -> CaptureActivity {
        let mut counters = vec![Arc::clone(&self.captures)];
        if detailed {
            counters.push(Arc::clone(&self.detailed_traces));
        }
        for counter in &counters {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.traces.begin(scope);
        CaptureActivity {
            counters,
            trace: Some((Arc::clone(&self.traces), scope)),
        }
    }

    /// Captures and Monitors under way now.
    pub fn captures_in_progress(&self) -> usize {
        self.captures.load(Ordering::Relaxed)
    }

    /// As [`Agent::capture_activity`] for a Monitor: samplers sample faster,
    /// but nothing starts tracing for it.
    pub fn monitor_activity(&self) -> CaptureActivity {
        self.captures.fetch_add(1, Ordering::Relaxed);
        CaptureActivity {
            counters: vec![Arc::clone(&self.captures)],
            trace: None,
        }
    }

    /// Sources that record per capture (libtpu), to be asked for each window.
    pub fn session_sources(&self) -> Vec<Arc<dyn SessionSource>> {
        self.backends
            .lock()
            .iter()
            .filter_map(|b| b.session_source())
            .collect()
    }

    /// Every backend asked for: the running ones and those that could not start.
    pub fn backend_health(&self) -> Vec<(&'static str, Health)> {
        let mut health: Vec<(&'static str, Health)> = self
            .backends
            .lock()
            .iter()
            .map(|b| (b.name(), b.health()))
            .collect();
        health.extend(self.unavailable.iter().map(|(name, reason)| {
            (
                *name,
                Health::Failed {
                    reason: reason.clone(),
                },
            )
        }));
        health
    }

    /// What backends have to say about a capture of `window` and `scope`.
    pub fn notices(&self, window: Window, scope: Scope) -> Vec<(&'static str, String)> {
        self.backends
            .lock()
            .iter()
            .flat_map(|b| {
                let name = b.name();
                b.notices(window, scope)
                    .into_iter()
                    .map(move |text| (name, text))
            })
            .collect()
    }

    /// Facts the backends record about a capture of `window` and `scope`.
    pub fn properties(&self, window: Window, scope: Scope) -> Vec<(String, String)> {
        self.backends
            .lock()
            .iter()
            .flat_map(|b| b.properties(window, scope))
            .collect()
    }

    /// The processes with lines of their own in `window`, from every
    /// backend: what a capture scoped to a user keeps of theirs.
    pub fn process_lines(&self, window: Window) -> Vec<ProcessLines> {
        self.backends
            .lock()
            .iter()
            .flat_map(|b| b.process_lines(window))
            .collect()
    }

    /// Running totals of what each backend lost before its events reached
    /// the ring, and of what the agent itself refused to keep.
    pub fn losses(&self) -> Vec<(&'static str, Loss)> {
        let own = [
            Loss {
                place: "misdated",
                what:
                    "events dropped for times outside what the flight recorder holds \
                       (more than a minute ahead of the agent's clock, or older than its retention)",
                count: self.store.misdated(),
            },
            Loss {
                place: "name_table",
                what: "names shown as a placeholder because the agent's name table was full",
                count: self.registry.names_refused(),
            },
        ];
        let mut losses: Vec<_> = own.into_iter().map(|loss| ("agent", loss)).collect();
        losses.extend(self.backends.lock().iter().flat_map(|b| {
            let name = b.name();
            b.losses().into_iter().map(move |loss| (name, loss))
        }));
        losses
    }

    pub fn store_stats(&self) -> StoreStats {
        self.store.stats()
    }

    pub fn ring_stats(&self) -> crate::ring::RingStats {
        self.ring.stats()
    }

    /// Events each backend (and the tap) put into the ring and lost there,
    /// since the agent started.
    pub fn ring_sources(&self) -> Vec<(&'static str, crate::ring::SourceCounts)> {
        self.ring.source_counts()
    }

    /// The latest reading of every GPU a sampling backend watches.
    pub fn gpu_readings(&self) -> Vec<GpuReading> {
        self.backends
            .lock()
            .iter()
            .flat_map(|b| b.gpu_readings())
            .collect()
    }

    /// Claims a ring lane for a producer outside the backends (the tap).
    pub fn producer(&self) -> Result<crate::ring::Producer, RingError> {
        self.ring.producer_for("tap")
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

type Started = (Vec<Box<dyn Backend>>, Vec<(&'static str, String)>);

/// Says in the log which backend is still starting, every
/// [`StartWatch::EVERY`], so that a driver or library that hangs as it is
/// loaded or initialised is named rather than taken for a hung agent.
struct StartWatch {
    state: Arc<(std::sync::Mutex<InStart>, std::sync::Condvar)>,
}

/// The backend starting (empty between backends), since when; `None` once
/// every backend is done.
type InStart = Option<(&'static str, std::time::Instant)>;

impl StartWatch {
    const EVERY: Duration = Duration::from_secs(10);

    fn new() -> StartWatch {
        let state = Arc::new((
            std::sync::Mutex::new(Some(("", std::time::Instant::now()))),
            std::sync::Condvar::new(),
        ));
        let watched = Arc::clone(&state);
        let spawned = std::thread::Builder::new()
            .name("devtrace-start-watch".into())
            .spawn(move || {
                let (lock, changed) = &*watched;
                let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                while let Some((name, since)) = *guard {
                    let (next, timeout) = changed
                        .wait_timeout(guard, Self::EVERY)
                        .unwrap_or_else(|e| e.into_inner());
                    guard = next;
                    if timeout.timed_out() && *guard == Some((name, since)) && !name.is_empty() {
                        warn!(
                            backend = name,
                            seconds = since.elapsed().as_secs(),
                            "backend still starting: its driver or library has not returned"
                        );
                    }
                }
            });
        if let Err(error) = spawned {
            warn!(%error, "cannot watch the backends start");
        }
        StartWatch { state }
    }

    /// `name` starts now ("": none).
    fn starting(&self, name: &'static str) {
        let (lock, changed) = &*self.state;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = Some((name, std::time::Instant::now()));
        changed.notify_one();
    }
}

impl Drop for StartWatch {
    fn drop(&mut self) {
        let (lock, changed) = &*self.state;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = None;
        changed.notify_one();
    }
}

/// Starts the chosen backends. `auto` starts every hardware backend that
/// works here and falls back to the mock when no device is here; a device
/// whose backend fails to start is reported, never stood in for by made-up
/// events. A backend named explicitly that cannot start is reported, and
/// the agent fails only when nothing starts at all.
fn start_backends(config: &AgentConfig, context: &BackendContext) -> Result<Started, AgentError> {
    let mut starting = BackendStarts {
        context,
        watch: StartWatch::new(),
        started: Vec::new(),
        unavailable: Vec::new(),
        failed: Vec::new(),
    };
    let named = |device: &str| match device {
        "nvml" => config.backends.contains(&BackendChoice::Nvml),
        "tpu" => config.backends.contains(&BackendChoice::Tpu),
        _ => false,
    };
    for choice in &config.backends {
        if let Some(backend) = backend_of(config, *choice) {
            starting.try_start(backend);
        }
    }
    if config.backends.contains(&BackendChoice::Auto) {
        starting.try_start(Box::new(NvmlBackend::new(config.nvml.clone())));
        starting.try_start(Box::new(TpuBackend::new(config.tpu.clone())));
        let devices = ["nvml", "tpu"];
        if starting.failed.iter().any(|name| devices.contains(name)) {
            warn!(
                "backend auto: a device backend failed to start on a host with the device; no mock \
                 backend stands in for it"
            );
        } else if starting.started.is_empty() {
            info!("backend auto: no device here; using the mock backend");
            // A device that is merely absent is not a failure under auto,
            // unless it was named too.
            starting
                .unavailable
                .retain(|(name, _)| !devices.contains(name) || named(name));
            starting.try_start(Box::new(MockBackend::new(config.mock)));
        }
        // Kernel hooks complement whatever device backend runs. When they
        // cannot run (not root, no BTF), the reason stays in `unavailable`
        // so that serve's log, Monitor and every trace say so.
        starting.try_start(Box::new(EbpfBackend::new(config.ebpf.clone())));
        starting.try_start(Box::new(CudaBackend::new(config.cuda.clone())));
    }
    let BackendStarts {
        started,
        unavailable,
        ..
    } = starting;
    // None asked for is an agent fed only from outside (a standalone tap).
    if started.is_empty() && !config.backends.is_empty() {
        let reasons: Vec<String> = unavailable.iter().map(|(_, r)| r.clone()).collect();
        return Err(AgentError::NoBackend(reasons.join("; ")));
    }
    Ok((started, unavailable))
}

/// The backend `choice` names; `None` for `auto`, which stands for several.
fn backend_of(config: &AgentConfig, choice: BackendChoice) -> Option<Box<dyn Backend>> {
    Some(match choice {
        BackendChoice::Auto => return None,
        BackendChoice::Mock => Box::new(MockBackend::new(config.mock)),
        BackendChoice::Nvml => Box::new(NvmlBackend::new(config.nvml.clone())),
        BackendChoice::Tpu => Box::new(TpuBackend::new(config.tpu.clone())),
        BackendChoice::Perf => Box::new(PerfBackend::new(config.perf.clone())),
        BackendChoice::Ebpf => Box::new(EbpfBackend::new(config.ebpf.clone())),
        BackendChoice::Cuda => Box::new(CudaBackend::new(config.cuda.clone())),
    })
}

/// The backends as they are started, each at most once.
struct BackendStarts<'a> {
    context: &'a BackendContext,
    watch: StartWatch,
    started: Vec<Box<dyn Backend>>,
    /// Those that did not start, with why.
    unavailable: Vec<(&'static str, String)>,
    /// Those among them whose device is here and could not be used.
    failed: Vec<&'static str>,
}

impl BackendStarts<'_> {
    fn try_start(&mut self, mut backend: Box<dyn Backend>) {
        let name = backend.name();
        let tried = self.started.iter().any(|b| b.name() == name)
            || self.unavailable.iter().any(|(n, _)| *n == name);
        if tried {
            return;
        }
        let context = BackendContext {
            source: name,
            ..self.context.clone()
        };
        self.watch.starting(name);
        let result = backend.start(context);
        self.watch.starting("");
        match result {
            Ok(()) => {
                info!(backend = name, records = %backend.capabilities().records.join(", "), "backend started");
                self.started.push(backend);
            }
            Err(error) => {
                warn!(backend = name, %error, "backend not started");
                if matches!(error, BackendError::Start { .. }) {
                    self.failed.push(name);
                }
                self.unavailable.push((name, error.to_string()));
            }
        }
    }
}
