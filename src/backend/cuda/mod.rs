//! The CUDA backend: GPU kernel timelines of any CUDA process that loads
//! devtrace's injection library (`inject/`). CUPTI sees only the process it
//! runs in, so the library streams that process's activity into a
//! shared-memory ring in the runtime directory; this backend finds those
//! rings, tells their libraries when a capture runs (the ring's control
//! word), drains them, and moves their events into the agent: names from
//! the process's metadata file become registry names, stream lines get the
//! process's slot so two processes' streams stay apart, and host lines are
//! named after the process.
//!
//! A process that exits is drained one last time and its files removed; the
//! captures that overlap say so. Rings of a previous agent are picked up
//! where it left them.
//!
//! Workloads may run in pid namespaces of their own (containers) while the
//! agent runs in the host's: a ring's process is found through the lock its
//! library holds on the file (`crate::model::host_process`), and its thread ids are
//! turned into the host's, so that its lines are those the other backends
//! draw for the same threads.
//!
//! The runtime directory is writable by every user, so nothing in it is
//! trusted. A ring is known by its file's owner and inode, not by the pid in
//! its name, and is attached only when it is a regular file with one link
//! owned by the user of the process that holds it and created it; each user
//! may have [`MAX_RINGS_PER_UID`] rings attached. A ring's peer cannot
//! make the agent map more than one lane of the library's largest capacity,
//! read forever (each pass drains a bounded number of events) or crash it by
//! shrinking the file: a ring whose counters no library writes is detached
//! with a warning. Its events may only be the kinds the library makes, on its
//! own threads, GPUs and lines; names, devices and lines it declares cannot
//! replace what others declared.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::warn;

use super::worker::Worker;
use super::{
    Backend, BackendContext, BackendError, Capabilities, Health, LibraryProcesses, Loss,
    ProcessLines, Scope, TraceDemand,
};
use crate::clock;
use crate::event::Payload;
use crate::event::{Device, Event, NameId};
use crate::model::host_process::{self, Threads};
use crate::model::registry::Registry;
use crate::model::timeline::STREAM_BITS;
use crate::recorder::Window;
use crate::ring::{
    pid_alive, remove_stale_rings, Consumer, FileIdentity, OpenLimits, Ring,
    CONTROL_ALL_API_RECORDS, CONTROL_CAPTURE, CONTROL_CUPTI_API_RECORDS, CONTROL_RECORD_ALWAYS,
};
use crate::workload::{
    self, ApiRecordSet, FileName, MetaReader, MetaRecord, UntimedCause, WorkloadFiles,
    SYNTHETIC_LINE_BASE,
};

#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// Where workload libraries put their rings (`DEVTRACE_RUNTIME_DIR` for
    /// both sides; `/run/devtrace` by default).
    pub runtime_dir: PathBuf,
    /// How often the directory is searched for new rings.
    pub scan_interval: Duration,
    /// How often rings are drained while a capture runs (ten times less
    /// often otherwise).
    pub drain_interval: Duration,
    /// Which API calls workloads record for captures that do not ask for
    /// detail (`device_tracer_level` 2 asks for every call).
    pub api_records: ApiRecords,
    /// Whether workloads record only for captures, or the GPU's work
    /// between them too.
    pub record: Recording,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            runtime_dir: workload::runtime_dir(),
            scan_interval: Duration::from_millis(250),
            drain_interval: Duration::from_millis(10),
            api_records: ApiRecords::Timeline,
            record: Recording::Capture,
        }
    }
}

/// When workloads record their GPU's work (`--cuda-record`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Recording {
    /// During captures alone: CUPTI is switched on for each capture and
    /// detached after it, so that the job runs at full speed between them.
    Capture,
    /// Always: kernels, copies and memsets (no API calls) are recorded
    /// between captures too, so that look-back captures, snapshots and
    /// triggers hold the GPU's past; a capture adds the rest for its
    /// window. The job pays CUPTI's cost on its kernels all the time.
    Always,
}

/// The driver and runtime API calls CUPTI records in workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiRecords {
    /// Launches (kernels, cooperative kernels, graphs, host functions),
    /// copies, memsets, allocations and frees: what draws the timeline and
    /// its flows. Other calls (synchronizations, queries, module loads, ...)
    /// get no API record. The injection library times them with its own
    /// Callback API subscriber (CUPTI's records of them when it has none).
    Timeline,
    /// The same calls, recorded by CUPTI's API activity records.
    TimelineCupti,
    /// Every call, as CUPTI's DRIVER and RUNTIME kinds record them.
    All,
}

/// The control word for a capture (or none) and the API calls to record.
fn control_flags(capturing: bool, api_records: ApiRecords) -> u32 {
    if !capturing {
        return 0;
    }
    CONTROL_CAPTURE
        | match api_records {
            ApiRecords::Timeline => 0,
            ApiRecords::TimelineCupti => CONTROL_CUPTI_API_RECORDS,
            ApiRecords::All => CONTROL_ALL_API_RECORDS,
        }
}

mod attach;
pub mod runtime_dir;
pub(crate) mod runtime_lock;
mod slots;
mod status;
mod translate;

use attach::Attachments;
use status::Status;

/// The largest ring a workload can make the agent map: the library's one
/// lane, with up to the 2^24 slots `DEVTRACE_INJECT_RING_CAPACITY` allows
/// (136 bytes each).
pub(crate) const WORKLOAD_RING_LIMITS: OpenLimits = OpenLimits {
    lanes: 1,
    bytes: 5 << 29,
};

/// Rings one user may have attached at once, so that no user takes every
/// stream slot.
pub const MAX_RINGS_PER_UID: usize = 32;

/// Events read from one ring per pass, so that a ring that never empties
/// cannot starve the others or the worker's stop.
const MAX_EVENTS_PER_PASS: usize = 1 << 18;

/// Names and lines one process may declare.
const MAX_NAMES_PER_PROCESS: usize = 1 << 18;
const MAX_LINES_PER_PROCESS: usize = 1 << 12;

/// GPU ordinals a process may use (CUDA numbers its visible GPUs from 0).
const MAX_GPU_ORDINAL: u16 = 255;

/// Rings refused once, remembered so they are not reopened at every scan.
const MAX_REFUSED: usize = 1024;

/// How long a metadata file without its ring may lie unheld before it is
/// taken to be left by a process that died while making its files.
const ABANDONED_GRACE: Duration = Duration::from_secs(60);

/// How long after a capture the rings are drained as often as during one:
/// the libraries hand over the window's last records as they stop.
const SETTLE_AFTER_CAPTURE: Duration = Duration::from_secs(1);

/// The synthetic host line (in a process's range) of calls from threads of
/// a namespaced process that ended before the host's id for them was read.
const LINE_ENDED_THREADS: u64 = 4;

pub struct CudaBackend {
    config: CudaConfig,
    status: Arc<Mutex<Status>>,
    worker: Option<Worker>,
    /// This agent's hold on the runtime directory, while it runs.
    lock: Option<runtime_lock::AgentLock>,
}

impl CudaBackend {
    pub fn new(config: CudaConfig) -> CudaBackend {
        CudaBackend {
            config,
            status: Arc::default(),
            worker: None,
            lock: None,
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        // From the library's being asked to the records' being in the
        // agent's recorder (below).
        let asked_to_recorded = Duration::from_millis(450);
        Capabilities {
            records: vec!["GPU kernels, copies and memory of injected CUDA processes"],
            // A capture's window over, the agent clears the control word
            // within a pass (10 ms) and the library sees it within its poll
            // (20 ms). It waits up to 200 ms for the GPU to finish the work
            // launched before (CUPTI hands a record of work still running
            // back only when forced, unfinished), then forces the partly
            // filled buffers (the window's last records) out; CUDA 13's
            // per-thread buffers of the job's threads may come back only
            // when CUPTI is detached: the library waits up to 100 ms for
            // them before it detaches at the job's next CUDA call. Then a
            // drain, with room for a loaded host.
            max_delay: asked_to_recorded,
            // Recording the GPU's past, a workload's CUPTI holds the
            // records of its latest moments until a trace that ended asks
            // for them (it waits up to 200 ms for the work launched to
            // end, as at a capture's end).
            held_until_asked: match self.config.record {
                Recording::Always => asked_to_recorded,
                Recording::Capture => Duration::ZERO,
            },
        }
    }

    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        let dir = &self.config.runtime_dir;
        let concern = runtime_dir::prepare(dir).map_err(|reason| BackendError::Unavailable {
            backend: "cuda",
            reason,
        })?;
        if let Some(concern) = concern {
            warn!(
                dir = %dir.display(),
                hint = %concern.hint(dir),
                "runtime directory: {}",
                concern.text()
            );
        }
        self.lock = match runtime_lock::take(&self.config.runtime_dir) {
            Ok(lock) => Some(lock),
            Err(held @ runtime_lock::LockError::Held { .. }) => {
                return Err(BackendError::Unavailable {
                    backend: "cuda",
                    reason: held.to_string(),
                })
            }
            Err(runtime_lock::LockError::Unguarded(why)) => {
                warn!("{why}");
                None
            }
        };
        let producer = context.producer().map_err(|e| BackendError::Start {
            backend: "cuda",
            reason: format!("no ring lane: {e}"),
        })?;
        let config = self.config.clone();
        let status = Arc::clone(&self.status);
        self.worker = Some(Worker::spawn("cuda", move |stop| {
            let mut attach = Attachments {
                config,
                registry: Arc::clone(&context.registry),
                library_processes: Arc::clone(&context.library_processes),
                status,
                processes: BTreeMap::new(),
                slots: Default::default(),
                refused: HashSet::new(),
                over_quota: HashSet::new(),
                producer,
                drained: Vec::new(),
                scratch: Vec::new(),
            };
            let mut last_scan: Option<Instant> = None;
            let mut last_capturing: Option<Instant> = None;
            let (_, mut held_seen) = context.traces.held_asked_since(0);
            while !stop.is_set() {
                let demand = context.traces.changes();
                // Traces about to read the past (look-back captures,
                // triggers' saves): the workloads recording it hand over
                // the records their CUPTI holds.
                let (held_asked, seen) = context.traces.held_asked_since(held_seen);
                held_seen = seen;
                let capturing = context.traces.any();
                if capturing {
                    last_capturing = Some(Instant::now());
                }
                let api_records = if context.detailed_traces.load(Ordering::Relaxed) > 0 {
                    ApiRecords::All
                } else {
                    attach.config.api_records
                };
                if last_scan.is_none_or(|at| at.elapsed() >= attach.config.scan_interval) {
                    last_scan = Some(Instant::now());
                    attach.scan();
                }
                let background = match attach.config.record {
                    Recording::Always => CONTROL_RECORD_ALWAYS,
                    Recording::Capture => 0,
                };
                attach.service(
                    control_flags(capturing, api_records),
                    background,
                    &held_asked,
                    &context.traces,
                );
                // Workloads recording the GPU's past fill their rings
                // between captures too; a capture's last records arrive
                // after its window, while the agent waits for them.
                let settling = last_capturing.is_some_and(|at| at.elapsed() < SETTLE_AFTER_CAPTURE);
                let pause = if capturing || settling || background != 0 {
                    attach.config.drain_interval
                } else {
                    attach.config.drain_interval * 10
                };
                // A capture starting or ending is served at once: the
                // libraries start recording as its window opens, and stop
                // (handing over the window's last records) as it closes.
                context.traces.wait_for_change(demand, pause);
            }
            // Leave the libraries idle for the next agent.
            for process in attach.processes.values() {
                process.ring.set_control(0);
            }
        })?);
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop();
        }
        self.lock = None;
    }

    fn health(&self) -> Health {
        if let Some(health) = Worker::not_running(self.worker.as_ref(), "CUDA backend") {
            return health;
        }
        let status = self.status.lock();
        let mut detail = format!(
            "{} processes attached ({} seen) in {}; {} events",
            status.attached,
            status.seen,
            self.config.runtime_dir.display(),
            status.events
        );
        if status.recorded > 0 {
            detail.push_str(&format!("; {} recording with CUPTI", status.recorded));
        }
        if let Some(error) = &status.last_error {
            detail.push_str(&format!("; last error: {error}"));
        }
        Health::Running { detail }
    }

    fn losses(&self) -> Vec<Loss> {
        let status = self.status.lock();
        vec![
            Loss {
                place: "cupti",
                what: "GPU activity records CUPTI dropped in workload processes",
                count: status.cupti_dropped,
            },
            Loss {
                place: "workload_ring",
                what: "GPU events workload libraries could not queue because their ring was full",
                count: status.ring_dropped,
            },
            Loss {
                place: "workload_foreign",
                what: "events refused from workload rings: kinds, devices or threads that are \
                       not the workload's",
                count: status.foreign,
            },
        ]
    }

    /// Every workload process attached during the window (of a scoped
    /// capture: its user's), with its command line
    /// (`devtrace_cuda_process_<pid>`), its libcupti
    /// (`devtrace_cuda_cupti_<pid>`) and the API calls it recorded
    /// (`devtrace_cuda_api_records_<pid>`).
    fn properties(&self, window: Window, scope: Scope) -> Vec<(String, String)> {
        let recording = match self.config.record {
            Recording::Always => {
                "always: kernels, copies and memsets are recorded between captures too; API \
                 calls during captures alone"
            }
            Recording::Capture => "capture: GPU work is recorded during captures alone",
        };
        let mode = ("devtrace_cuda_record".to_string(), recording.to_string());
        let processes: Vec<(String, String)> = self
            .status
            .lock()
            .traced
            .iter()
            .filter(|t| t.overlaps(window) && scope.covers_user(t.uid))
            .flat_map(|t| {
                let command = (
                    format!("devtrace_cuda_process_{}", t.pid),
                    t.command.clone(),
                );
                let cupti = t
                    .cupti
                    .clone()
                    .map(|text| (format!("devtrace_cuda_cupti_{}", t.pid), text));
                let sets = t.api_records_during(window);
                let api_records = (!sets.is_empty()).then(|| {
                    let text: Vec<&str> = sets.iter().map(|set| set.describe()).collect();
                    (
                        format!("devtrace_cuda_api_records_{}", t.pid),
                        text.join("; then "),
                    )
                });
                std::iter::once(command).chain(cupti).chain(api_records)
            })
            .collect();
        std::iter::once(mode).chain(processes).collect()
    }

    fn notices(&self, window: Window, scope: Scope) -> Vec<String> {
        let status = self.status.lock();
        let covered = |pid: u32| status.uid_of(pid).is_some_and(|uid| scope.covers_user(uid));
        status
            .notices
            .iter()
            .filter(|n| n.at_ns >= window.start_ns && n.at_ns <= window.stop_ns)
            .filter(|n| scope.covers_user(n.uid))
            .map(|n| n.text.clone())
            .chain(
                status
                    .traced
                    .iter()
                    .filter(|t| t.overlaps(window) && scope.covers_user(t.uid))
                    .flat_map(|t| t.states.iter().cloned()),
            )
            .chain(
                status
                    .lost_spans
                    .iter()
                    .filter(|s| scope == Scope::Host || covered(s.pid))
                    .filter_map(|s| s.describe(window)),
            )
            .collect()
    }

    fn process_lines(&self, window: Window) -> Vec<ProcessLines> {
        let status = self.status.lock();
        status
            .traced
            .iter()
            .filter(|t| t.overlaps(window))
            .map(|t| {
                let mut gpus: Vec<u16> = t
                    .lines
                    .iter()
                    .filter_map(|(device, _)| match device {
                        Device::Gpu(ordinal) => Some(*ordinal),
                        _ => None,
                    })
                    .collect();
                gpus.sort_unstable();
                gpus.dedup();
                ProcessLines {
                    pid: t.pid,
                    uid: t.uid,
                    from_ns: t.attached_ns,
                    until_ns: t.detached_ns,
                    gpu_slot: Some(t.slot),
                    host_lines: t
                        .lines
                        .iter()
                        .filter(|(device, _)| *device == Device::Host)
                        .map(|(_, line)| *line)
                        .collect(),
                    gpus,
                }
            })
            .collect()
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.stop();
    }
}
