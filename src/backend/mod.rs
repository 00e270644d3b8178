//! The backend contract: a backend knows one source of truth (a device, the
//! kernel, a library), turns what it sees into [`Event`]s and pushes them into
//! the ring it is given. It never knows about gRPC, files or XSpace.
//!
//! [`Event`]: crate::event::Event

pub mod cuda;
pub mod ebpf;
pub mod mock;
pub mod nvml;
pub mod perf;
pub mod tpu;
pub mod worker;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::model::registry::Registry;
pub use crate::model::scope::Scope;
use crate::ring::{Producer, Ring, RingError};

/// What a backend can observe.
#[derive(Clone, Debug, PartialEq)]
pub struct Capabilities {
    /// Human-readable list of what it records ("GPU kernels", ...).
    pub records: Vec<&'static str>,
    /// Longest time between an event happening and it being in the ring; a
    /// capture waits this long after its window closes before it collects.
    pub max_delay: Duration,
    /// How long after a trace ends the backend's sources may still be
    /// handing over events they held until asked (a workload recording its
    /// GPU's past holds its latest kernels in CUPTI's buffers): a capture
    /// of the past waits this long after it was asked for.
    pub held_until_asked: Duration,
}

/// How a backend is doing, for `Monitor` and the `serve` log.
#[derive(Clone, Debug, PartialEq)]
pub enum Health {
    Stopped,
    Running { detail: String },
    Failed { reason: String },
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Health::Stopped => write!(f, "stopped"),
            Health::Running { detail } => write!(f, "running ({detail})"),
            Health::Failed { reason } => write!(f, "failed: {reason}"),
        }
    }
}

/// What a backend gets when it starts.
#[derive(Clone)]
pub struct BackendContext {
    pub registry: Arc<Registry>,
    pub ring: Arc<Ring>,
    /// Captures (and continuous sessions) in progress: backends whose
    /// sampling costs something sample faster while it is non-zero.
    pub captures: Arc<std::sync::atomic::AtomicUsize>,
    /// Captures and continuous sessions alone (not Monitor calls), and
    /// whose each is: backends that trace (kernel hooks, CUPTI in
    /// workloads) switch on while there are any, CUPTI only in the
    /// processes one of them covers.
    pub traces: Arc<TraceDemand>,
    /// Those of `traces` that asked for device-specific detail
    /// (`ProfileOptions.device_tracer_level` 2 or more): CUPTI in workloads
    /// then records every API call, not only the timeline's.
    pub detailed_traces: Arc<std::sync::atomic::AtomicUsize>,
    /// The processes whose CUDA work the injection library records.
    pub library_processes: Arc<LibraryProcesses>,
    /// The backend's name, under which its events are counted.
    pub source: &'static str,
}

impl BackendContext {
    /// Claims a lane of the ring whose events count as this backend's.
    pub fn producer(&self) -> Result<Producer, RingError> {
        self.ring.producer_for(self.source)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{backend} is not available here: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("{backend} failed to start: {reason}")]
    Start {
        backend: &'static str,
        reason: String,
    },
}

/// A set of ids each counted as often as it was added, and in it until it
/// was removed as often.
#[derive(Debug, Default)]
pub struct CountedSet {
    counts: parking_lot::Mutex<std::collections::HashMap<u32, usize>>,
}

impl CountedSet {
    pub fn insert(&self, id: u32) {
        *self.counts.lock().entry(id).or_default() += 1;
    }

    pub fn remove(&self, id: u32) {
        let mut counts = self.counts.lock();
        if let Some(count) = counts.get_mut(&id) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&id);
            }
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        self.counts.lock().contains_key(&id)
    }
}

/// The processes whose kernels and CUDA calls the injection library
/// records: the CUDA backend has their ring and they loaded CUPTI. The eBPF
/// backend leaves their driver library unprobed, since a uprobe traps on
/// every driver call for what the library already has: on an H200 the
/// probes cost a launch-bound PyTorch loop 5.2 us a kernel during a capture,
/// on top of the library's 3.1 us.
/// Counted per pid: an old ring of a process that ran `exec` may still be
/// attached beside its new one.
pub type LibraryProcesses = CountedSet;

/// The traces in progress and whose they are (see [`Scope`]). A trace
/// beginning or ending wakes the backends waiting in
/// [`TraceDemand::wait_for_change`], so that tracers switch on as a window
/// opens rather than at their next pass.
#[derive(Debug, Default)]
pub struct TraceDemand {
    /// Every trace in progress, whatever its scope.
    all: AtomicUsize,
    /// Those of the whole host.
    host: AtomicUsize,
    /// Those scoped to one user, counted per uid.
    users: CountedSet,
    /// How many times a trace began or ended (or asked for held events).
    changes: parking_lot::Mutex<u64>,
    changed: parking_lot::Condvar,
    /// Traces that asked for what sources hold until asked
    /// ([`Capabilities::held_until_asked`]), by scope.
    held: parking_lot::Mutex<HeldAsks>,
}

/// The latest asks for held events: each ask's number and scope.
#[derive(Debug, Default)]
struct HeldAsks {
    /// Asks made so far.
    made: u64,
    /// The latest [`MAX_HELD_ASKS`] of them, oldest first.
    latest: std::collections::VecDeque<(u64, Scope)>,
}

/// Asks for held events remembered; a reader further behind is answered
/// as if the whole host had asked.
const MAX_HELD_ASKS: usize = 64;

impl TraceDemand {
    /// Counts a trace of `scope` until [`Self::end`] is called for it.
    pub fn begin(&self, scope: Scope) {
        self.all.fetch_add(1, Ordering::Relaxed);
        match scope {
            Scope::Host => {
                self.host.fetch_add(1, Ordering::Relaxed);
            }
            Scope::User { uid } => self.users.insert(uid),
        }
        self.tell_change();
    }

    pub fn end(&self, scope: Scope) {
        match scope {
            Scope::Host => {
                self.host.fetch_sub(1, Ordering::Relaxed);
            }
            Scope::User { uid } => self.users.remove(uid),
        }
        self.all.fetch_sub(1, Ordering::Relaxed);
        self.tell_change();
    }

    fn tell_change(&self) {
        *self.changes.lock() += 1;
        self.changed.notify_all();
    }

    /// How many times a trace began or ended so far: what
    /// [`Self::wait_for_change`] compares with.
    pub fn changes(&self) -> u64 {
        *self.changes.lock()
    }

    /// Waits until a trace begins or ends after `seen` (a value of
    /// [`Self::changes`]) or `timeout` passes; answers whether one did.
    pub fn wait_for_change(&self, seen: u64, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut changes = self.changes.lock();
        while *changes == seen {
            if self.changed.wait_until(&mut changes, deadline).timed_out() {
                return *changes != seen;
            }
        }
        true
    }

    /// A trace of `scope` is about to read a window whose events some
    /// sources hold until asked: they are asked (and backends waiting in
    /// [`Self::wait_for_change`] woken).
    pub fn ask_for_held(&self, scope: Scope) {
        {
            let mut held = self.held.lock();
            held.made += 1;
            let ask = (held.made, scope);
            if held.latest.len() == MAX_HELD_ASKS {
                held.latest.pop_front();
            }
            held.latest.push_back(ask);
        }
        self.tell_change();
    }

    /// The scopes of the asks for held events made after ask `seen` (0:
    /// none seen), and the number of the latest ask to pass next time. A
    /// reader too far behind gets [`Scope::Host`].
    pub fn held_asked_since(&self, seen: u64) -> (Vec<Scope>, u64) {
        let held = self.held.lock();
        let missed = held.made.saturating_sub(seen) as usize;
        let scopes = if missed > held.latest.len() {
            vec![Scope::Host]
        } else {
            held.latest
                .iter()
                .filter(|(made, _)| *made > seen)
                .map(|(_, scope)| *scope)
                .collect()
        };
        (scopes, held.made)
    }

    /// Whether any trace is in progress.
    pub fn any(&self) -> bool {
        self.all.load(Ordering::Relaxed) > 0
    }

    /// Whether a trace in progress covers the processes of user `uid`.
    pub fn covers_user(&self, uid: u32) -> bool {
        self.host.load(Ordering::Relaxed) > 0 || self.users.contains(uid)
    }
}

/// A process whose events a backend put on lines of its own (GPU streams,
/// host lines it names), with whose it is, so that a capture scoped to a
/// user keeps its events and no one else's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessLines {
    pub pid: u32,
    /// The user the process runs as.
    pub uid: u32,
    /// When the backend took it up and let it go (Unix nanoseconds).
    pub from_ns: u64,
    pub until_ns: Option<u64>,
    /// Its lines on GPU planes: line ids whose bits above
    /// [`crate::model::timeline::STREAM_BITS`] are this.
    pub gpu_slot: Option<u64>,
    /// Its lines on the host plane.
    pub host_lines: Vec<u64>,
    /// The GPU planes it used.
    pub gpus: Vec<u16>,
}

/// A source of events.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;
    /// Starts producing into `context.ring`. Must return promptly.
    fn start(&mut self, context: BackendContext) -> Result<(), BackendError>;
    /// Stops producing; idempotent.
    fn stop(&mut self);
    fn health(&self) -> Health;
    /// For backends that record per capture instead of continuously (libtpu's
    /// profiler): the source a capture asks for its window's trace.
    fn session_source(&self) -> Option<Arc<dyn SessionSource>> {
        None
    }
    /// Events lost before they reached the ring (in the kernel, in a
    /// library's buffers), as running totals; captures report what grew
    /// during their window.
    fn losses(&self) -> Vec<Loss> {
        Vec::new()
    }
    /// Things a capture of `window` should be told (a traced process that
    /// exited during it, ...), for its warnings; of a scoped capture, only
    /// what concerns its processes.
    fn notices(&self, _window: crate::recorder::Window, _scope: Scope) -> Vec<String> {
        Vec::new()
    }
    /// Facts about what a capture of `window` covers, as (name, value)
    /// pairs for the trace's Task Environment plane; of a scoped capture,
    /// only what concerns its processes.
    fn properties(&self, _window: crate::recorder::Window, _scope: Scope) -> Vec<(String, String)> {
        Vec::new()
    }
    /// The processes with lines of their own among this backend's events
    /// of `window`.
    fn process_lines(&self, _window: crate::recorder::Window) -> Vec<ProcessLines> {
        Vec::new()
    }
    /// The latest reading of each GPU a sampling backend (NVML) watches,
    /// for the metrics endpoint.
    fn gpu_readings(&self) -> Vec<GpuReading> {
        Vec::new()
    }
}

/// The latest sampled values of one GPU; a value not read (unsupported, or
/// not sampled yet) is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuReading {
    /// The backend's index of the GPU (NVML's, nvidia-smi's order).
    pub index: u32,
    /// `GPU-...`, or empty when the driver did not say.
    pub uuid: String,
    pub sm_utilization_percent: Option<f64>,
    pub memory_utilization_percent: Option<f64>,
    pub memory_used_bytes: Option<f64>,
    pub memory_total_bytes: Option<f64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub memory_clock_mhz: Option<f64>,
}

/// A running total of events a backend lost, and what they were.
#[derive(Clone, Debug, PartialEq)]
pub struct Loss {
    /// Where they were lost, as a short metric label (`bpf_ring_sched`).
    pub place: &'static str,
    pub what: &'static str,
    pub count: u64,
}

/// A source that records only while a capture runs and hands back a whole
/// XSpace, which the agent merges into its trace.
pub trait SessionSource: Send + Sync {
    fn name(&self) -> &'static str;
    /// Records `window` from its start (called at once, it waits for a
    /// start that lies ahead) until `end` says it is over, and returns
    /// encoded XSpace bytes, or why it could not.
    fn capture(
        &self,
        window: crate::recorder::Window,
        options: &[u8],
        end: &CaptureEnd,
    ) -> Result<Vec<u8>, String>;
}

/// When one capture's recording ends: its window's stop, or earlier when it
/// is terminated or its client goes away. Shared by the threads that record
/// for it.
#[derive(Clone, Debug)]
pub struct CaptureEnd {
    stop_ns: Arc<std::sync::atomic::AtomicU64>,
}

impl CaptureEnd {
    pub fn at(stop_ns: u64) -> CaptureEnd {
        CaptureEnd {
            stop_ns: Arc::new(std::sync::atomic::AtomicU64::new(stop_ns)),
        }
    }

    /// Ends the recording now (a later stop is moved forward, never back).
    pub fn now(&self) {
        self.stop_ns
            .fetch_min(crate::clock::now_ns(), std::sync::atomic::Ordering::AcqRel);
    }

    pub fn stop_ns(&self) -> u64 {
        self.stop_ns.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sleeps until `at_ns` or the end, whichever comes first; true when
    /// the end came first.
    pub fn sleep_until(&self, at_ns: u64) -> bool {
        loop {
            let stop = self.stop_ns();
            let now = crate::clock::now_ns();
            if now >= stop {
                return true;
            }
            if now >= at_ns {
                return false;
            }
            // Short naps, so that an early end is seen within 10 ms.
            let nap = (at_ns.min(stop) - now).min(10_000_000);
            std::thread::sleep(std::time::Duration::from_nanos(nap));
        }
    }

    /// Sleeps until the end.
    pub fn wait(&self) {
        while !self.sleep_until(u64::MAX) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_for_held_events_are_read_once_by_scope_and_summed_up_when_missed() {
        let demand = TraceDemand::default();
        assert_eq!(demand.held_asked_since(0), (vec![], 0));
        let seen = demand.changes();
        demand.ask_for_held(Scope::User { uid: 7 });
        assert!(
            demand.wait_for_change(seen, Duration::ZERO),
            "wakes backends"
        );
        demand.ask_for_held(Scope::Host);
        let (scopes, seen) = demand.held_asked_since(0);
        assert_eq!(scopes, vec![Scope::User { uid: 7 }, Scope::Host]);
        assert_eq!(demand.held_asked_since(seen), (vec![], 2));
        for _ in 0..=MAX_HELD_ASKS {
            demand.ask_for_held(Scope::User { uid: 8 });
        }
        assert_eq!(demand.held_asked_since(seen).0, vec![Scope::Host]);
    }

    #[test]
    fn a_trace_beginning_or_ending_wakes_a_waiting_backend() {
        let demand = Arc::new(TraceDemand::default());
        let seen = demand.changes();
        assert!(!demand.wait_for_change(seen, Duration::from_millis(1)));
        let waiter = {
            let demand = Arc::clone(&demand);
            std::thread::spawn(move || demand.wait_for_change(seen, Duration::from_secs(600)))
        };
        demand.begin(Scope::User { uid: 7 });
        assert!(waiter.join().expect("the waiter"));
        assert!(demand.covers_user(7) && !demand.covers_user(8));
        // A change made before the wait began is not missed.
        let seen = demand.changes();
        demand.end(Scope::User { uid: 7 });
        assert!(demand.wait_for_change(seen, Duration::from_secs(600)));
        assert!(!demand.any());
    }
}
