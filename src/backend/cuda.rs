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
//! library holds on the file (`crate::host_process`), and its thread ids are
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
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{info, warn};

use super::worker::Worker;
use super::{Backend, BackendContext, BackendError, Capabilities, Health, Loss};
use crate::clock;
use crate::event::Payload;
use crate::event::{Device, Event, NameId};
use crate::host_process::{self, Threads};
use crate::registry::Registry;
use crate::ring::{
    pid_alive, remove_stale_rings, Consumer, FileIdentity, OpenLimits, Ring,
    CONTROL_ALL_API_RECORDS, CONTROL_CAPTURE,
};
use crate::store::Window;
use crate::timeline::STREAM_BITS;
use crate::workload::{
    self, ApiRecordSet, FileName, MetaReader, MetaRecord, WorkloadFiles, SYNTHETIC_LINE_BASE,
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
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            runtime_dir: workload::runtime_dir(),
            scan_interval: Duration::from_millis(250),
            drain_interval: Duration::from_millis(10),
            api_records: ApiRecords::Timeline,
        }
    }
}

/// The driver and runtime API calls CUPTI records in workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiRecords {
    /// Launches (kernels, cooperative kernels, graphs, host functions),
    /// copies, memsets, allocations and frees: what draws the timeline and
    /// its flows. Other calls (synchronizations, queries, module loads, ...)
    /// get no API record.
    Timeline,
    /// Every call, as CUPTI's DRIVER and RUNTIME kinds record them.
    All,
}

/// The control word for a capture (or none) and the API calls to record.
fn control_flags(capturing: bool, all_api_records: bool) -> u32 {
    match (capturing, all_api_records) {
        (false, _) => 0,
        (true, false) => CONTROL_CAPTURE,
        (true, true) => CONTROL_CAPTURE | CONTROL_ALL_API_RECORDS,
    }
}

/// Something a capture overlapping `at_ns` should be told.
#[derive(Clone, Debug)]
struct Notice {
    at_ns: u64,
    text: String,
}

const MAX_NOTICES: usize = 256;

/// Why a span of a process's GPU activity is missing from the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LossCause {
    /// Another CUPTI user had the activity stream; `seen` when its calls
    /// passed through the library (else it was found out after the fact).
    OtherUser { seen: bool },
    /// The library was asked to capture and CUPTI was not recording yet.
    Starting,
}

/// A span of one process's GPU activity that is missing from the trace.
#[derive(Clone, Debug)]
struct LostSpan {
    pid: u32,
    label: String,
    from_ns: u64,
    /// Open while the cause lasts.
    to_ns: Option<u64>,
    cause: LossCause,
}

impl LostSpan {
    /// The warning for a window this span overlaps. A start that never
    /// ended is not told: the process stopped tracing, which its states say.
    fn describe(&self, window: Window) -> Option<String> {
        if self.cause == LossCause::Starting && self.to_ns.is_none() {
            return None;
        }
        let to_ns = self.to_ns.unwrap_or(u64::MAX);
        if self.from_ns > window.stop_ns || to_ns <= window.start_ns || to_ns == self.from_ns {
            return None;
        }
        let from = self.from_ns.max(window.start_ns);
        let to = to_ns.min(window.stop_ns);
        let seconds = |ns: u64| (ns - window.start_ns) as f64 / 1e9;
        let span = format!(
            "from {:.3} s to {:.3} s of this window: that process's GPU activity in those \
             {:.0} ms is missing",
            seconds(from),
            seconds(to),
            (to - from) as f64 / 1e6,
        );
        Some(match self.cause {
            LossCause::OtherUser { seen } => {
                let how = if seen {
                    ""
                } else {
                    " (found out after the fact, as that profiler reached CUPTI without passing \
                     through the library: the span starts when the library last knew it had the \
                     stream, it takes the stream back at the next capture, and the other \
                     profiler may have lost records it wrote into the library's buffers)"
                };
                format!(
                    "another CUPTI user in {} (a framework profiler such as torch.profiler) had \
                     the activity stream {span}{how}",
                    self.label
                )
            }
            LossCause::Starting => format!(
                "the injection library in {} was asked to record and CUPTI started recording \
                 {:.0} ms later, {span} (CUPTI is started for each capture and detached after \
                 it, so that the job runs at full speed between captures)",
                self.label,
                (to_ns - self.from_ns) as f64 / 1e6,
            ),
        })
    }
}

const MAX_LOST_SPANS: usize = 256;

/// A workload process and when it was attached.
#[derive(Clone, Debug)]
struct Traced {
    pid: u32,
    command: String,
    /// The libcupti it loaded, as `API version from origin`.
    cupti: Option<String>,
    /// The API records it switched to, and when.
    api_records: VecDeque<(u64, ApiRecordSet)>,
    /// What its library said about itself (it stopped, its CUPTI has known
    /// bugs): true for every capture while it runs.
    states: Vec<String>,
    attached_ns: u64,
    detached_ns: Option<u64>,
}

impl Traced {
    fn overlaps(&self, window: Window) -> bool {
        self.attached_ns <= window.stop_ns
            && self.detached_ns.is_none_or(|gone| gone >= window.start_ns)
    }

    /// The API record sets in force during `window`, in order: those
    /// switched to inside it, else the last before it.
    fn api_records_during(&self, window: Window) -> Vec<ApiRecordSet> {
        let inside: Vec<ApiRecordSet> = self
            .api_records
            .iter()
            .filter(|(at, _)| (window.start_ns..=window.stop_ns).contains(at))
            .map(|(_, set)| *set)
            .collect();
        let mut sets = if inside.is_empty() {
            self.api_records
                .iter()
                .rev()
                .find(|(at, _)| *at < window.start_ns)
                .map(|(_, set)| *set)
                .into_iter()
                .collect()
        } else {
            inside
        };
        sets.dedup();
        sets
    }
}

/// Switches of API record sets remembered per process.
const MAX_API_RECORD_SWITCHES: usize = 64;

fn remember_switch(switches: &mut VecDeque<(u64, ApiRecordSet)>, at_ns: u64, set: ApiRecordSet) {
    if switches.len() == MAX_API_RECORD_SWITCHES {
        switches.pop_front();
    }
    switches.push_back((at_ns, set));
}

/// Processes remembered for the properties of captures.
const MAX_TRACED: usize = 1024;

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

/// The synthetic host line (in a process's range) of calls from threads of
/// a namespaced process that ended before the host's id for them was read.
const LINE_ENDED_THREADS: u64 = 4;

/// Why a ring that opened cleanly is not attached.
enum Refusal {
    /// It is not the process's, or the process is gone: for good.
    Lasting(String),
    /// Its user has [`MAX_RINGS_PER_UID`] attached: until one goes.
    OverQuota(String),
}

#[derive(Default)]
struct Status {
    traced: VecDeque<Traced>,
    attached: usize,
    seen: u64,
    events: u64,
    cupti_dropped: u64,
    ring_dropped: u64,
    /// Events refused as no CUDA workload makes them.
    foreign: u64,
    notices: VecDeque<Notice>,
    lost_spans: VecDeque<LostSpan>,
    last_error: Option<String>,
}

impl Status {
    fn lost_from(&mut self, pid: u32, label: String, from_ns: u64, cause: LossCause) {
        if self.lost_spans.len() == MAX_LOST_SPANS {
            self.lost_spans.pop_front();
        }
        if let LossCause::OtherUser { .. } = cause {
            info!("{label}: another CUPTI user took the activity stream");
        }
        self.lost_spans.push_back(LostSpan {
            pid,
            label,
            from_ns,
            to_ns: None,
            cause,
        });
    }

    /// Closes the open spans of `pid` for causes `which` picks.
    fn lost_until(&mut self, pid: u32, to_ns: u64, which: impl Fn(LossCause) -> bool) {
        for span in self.lost_spans.iter_mut().rev() {
            if span.pid == pid && span.to_ns.is_none() && which(span.cause) {
                span.to_ns = Some(to_ns.max(span.from_ns));
            }
        }
    }

    /// The remembered process `pid` (the latest of that pid).
    fn traced_mut(&mut self, pid: u32) -> Option<&mut Traced> {
        self.traced.iter_mut().rev().find(|t| t.pid == pid)
    }

    /// A lasting state of process `pid`, reported in every capture that
    /// overlaps its life; `early` keeps it until the process is remembered.
    fn state(&mut self, pid: u32, early: &mut Vec<String>, text: String) {
        info!("{text}");
        const MAX_STATES: usize = 8;
        let states = match self.traced_mut(pid) {
            Some(traced) => &mut traced.states,
            None => early,
        };
        if states.len() < MAX_STATES && !states.contains(&text) {
            states.push(text);
        }
    }

    fn notice(&mut self, text: String) {
        info!("{text}");
        if self.notices.len() == MAX_NOTICES {
            self.notices.pop_front();
        }
        self.notices.push_back(Notice {
            at_ns: clock::now_ns(),
            text,
        });
    }
}

pub struct CudaBackend {
    config: CudaConfig,
    status: Arc<Mutex<Status>>,
    worker: Option<Worker>,
}

impl CudaBackend {
    pub fn new(config: CudaConfig) -> CudaBackend {
        CudaBackend {
            config,
            status: Arc::default(),
            worker: None,
        }
    }
}

/// Makes the runtime directory when it is missing: world-writable and
/// sticky like /tmp, so workloads of any user can add their rings and only
/// remove their own.
fn prepare_runtime_dir(dir: &Path) -> Result<(), String> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))
        .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: vec!["GPU kernels, copies and memory of injected CUDA processes"],
            // The library flushes CUPTI every 100 ms and polls its control
            // word every 20 ms; one drain on top.
            max_delay: Duration::from_millis(250),
        }
    }

    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        prepare_runtime_dir(&self.config.runtime_dir).map_err(|reason| {
            BackendError::Unavailable {
                backend: "cuda",
                reason,
            }
        })?;
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
                status,
                processes: BTreeMap::new(),
                slots_in_use: Vec::new(),
                refused: HashSet::new(),
                over_quota: HashSet::new(),
                producer,
                drained: Vec::new(),
                scratch: Vec::new(),
            };
            let mut last_scan: Option<Instant> = None;
            while !stop.is_set() {
                let capturing = context.traces.load(Ordering::Relaxed) > 0;
                let all_api_records = attach.config.api_records == ApiRecords::All
                    || context.detailed_traces.load(Ordering::Relaxed) > 0;
                if last_scan.is_none_or(|at| at.elapsed() >= attach.config.scan_interval) {
                    last_scan = Some(Instant::now());
                    attach.scan();
                }
                attach.service(control_flags(capturing, all_api_records));
                let pause = if capturing {
                    attach.config.drain_interval
                } else {
                    attach.config.drain_interval * 10
                };
                std::thread::sleep(pause);
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

    /// Every workload process attached during the window, with its command
    /// line (`devtrace_cuda_process_<pid>`), its libcupti
    /// (`devtrace_cuda_cupti_<pid>`) and the API calls it recorded
    /// (`devtrace_cuda_api_records_<pid>`).
    fn properties(&self, window: Window) -> Vec<(String, String)> {
        self.status
            .lock()
            .traced
            .iter()
            .filter(|t| t.overlaps(window))
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
            .collect()
    }

    fn notices(&self, window: Window) -> Vec<String> {
        let status = self.status.lock();
        status
            .notices
            .iter()
            .filter(|n| n.at_ns >= window.start_ns && n.at_ns <= window.stop_ns)
            .map(|n| n.text.clone())
            .chain(
                status
                    .traced
                    .iter()
                    .filter(|t| t.overlaps(window))
                    .flat_map(|t| t.states.iter().cloned()),
            )
            .chain(status.lost_spans.iter().filter_map(|s| s.describe(window)))
            .collect()
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One workload process whose ring is attached.
struct Process {
    /// Its pid on the host (in the agent's pid namespace).
    pid: u32,
    /// Its pid in a pid namespace of its own, when it runs in one.
    own_pid: Option<u32>,
    /// Host ids of its threads, when it runs in a namespace of its own.
    threads: Threads,
    files: WorkloadFiles,
    slot: u64,
    /// The uid that owns its ring file.
    owner: u32,
    /// Its metadata file was refused (reported once).
    meta_refused: bool,
    ring: Arc<Ring>,
    consumer: Consumer,
    meta: MetaReader,
    /// Its name ids to the registry's.
    names: HashMap<u32, NameId>,
    /// Lines already named, per device.
    named_lines: HashSet<(Device, u64)>,
    /// The host line of each thread id its events carried; `None` for one
    /// that is not its own.
    host_lines: HashMap<u64, Option<u64>>,
    command: String,
    control: u32,
    cupti_dropped: u64,
    /// Its CUDA ordinals to GPU planes (physical GPUs, by UUID).
    planes: HashMap<u16, u16>,
    cupti: Option<String>,
    /// API record sets read before the process was remembered in
    /// `Status::traced`.
    api_records: VecDeque<(u64, ApiRecordSet)>,
    /// States read before the process was remembered in `Status::traced`.
    states: Vec<String>,
}

impl Process {
    /// What the process is called in line names: its program's file name.
    fn short_name(&self) -> &str {
        let program = self.command.split(' ').next().unwrap_or("");
        program
            .rsplit('/')
            .next()
            .filter(|p| !p.is_empty())
            .unwrap_or("process")
    }

    fn label(&self) -> String {
        let mut about: Vec<String> = Vec::new();
        if let Some(own) = self.own_pid {
            about.push(format!("pid {own} in its namespace"));
        }
        if !self.command.is_empty() {
            about.push(self.command.clone());
        }
        if about.is_empty() {
            format!("process {}", self.pid)
        } else {
            format!("process {} ({})", self.pid, about.join("; "))
        }
    }
}

/// The worker's state: every attached process and where events go.
struct Attachments {
    config: CudaConfig,
    registry: Arc<Registry>,
    status: Arc<Mutex<Status>>,
    processes: BTreeMap<FileIdentity, Process>,
    slots_in_use: Vec<u64>,
    /// Ring files refused, by owner and inode.
    refused: HashSet<FileIdentity>,
    /// Rings waiting for their user to have fewer attached (reported once).
    over_quota: HashSet<FileIdentity>,
    producer: crate::ring::Producer,
    /// Events as drained from a workload's ring, and as translated.
    drained: Vec<Event>,
    scratch: Vec<Event>,
}

impl Attachments {
    /// Attaches rings that appeared and removes files of dead processes no
    /// one attached, in one pass over the directory.
    fn scan(&mut self) {
        let dir = self.config.runtime_dir.clone();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let mut metadata = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str().and_then(FileName::parse) else {
                continue;
            };
            let path = entry.path();
            match name {
                FileName::Ring { pid } | FileName::OlderRing { pid } => {
                    let identity = identity_at(&path);
                    let known = identity.is_some_and(|identity| {
                        self.processes.contains_key(&identity) || self.refused.contains(&identity)
                    });
                    if known {
                        continue;
                    }
                    if matches!(name, FileName::Ring { .. }) {
                        self.attach(pid, &path);
                    } else if let Some(identity) = identity {
                        let text = format!(
                            "ignoring {}: it was made by an injection library older than this                              agent; restart the workload with this agent's library",
                            path.display()
                        );
                        self.refuse(identity, text);
                    }
                }
                FileName::Meta { .. } => metadata.push(path),
            }
        }
        let _ = remove_stale_rings(&dir);
        // Metadata whose ring is gone and whose process has let go of it.
        for path in metadata {
            let attached = self.processes.values().any(|p| p.files.meta == path);
            if !attached
                && !path.with_extension("ring").exists()
                && host_process::abandoned(&path, ABANDONED_GRACE)
            {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    fn free_slot(&mut self) -> Option<u64> {
        let slot = (1..(1u64 << (32 - STREAM_BITS))).find(|s| !self.slots_in_use.contains(s))?;
        self.slots_in_use.push(slot);
        Some(slot)
    }

    /// Attaches the ring at `path`, whose name gives the pid its process has
    /// in its own namespace.
    fn attach(&mut self, own_pid: u32, path: &Path) {
        let (ring, identity) = match Ring::open_untrusted(path, WORKLOAD_RING_LIMITS) {
            Ok(opened) => opened,
            Err(error) => {
                // Rings appear under their name complete, so this one is
                // not one the library made: refused until it changes.
                let text = format!("ignoring {}: {error}", path.display());
                match identity_at(path) {
                    Some(identity) => self.refuse(identity, text),
                    None => self.status.lock().last_error = Some(text),
                }
                return;
            }
        };
        let pid = match self.admissible(path, own_pid, &ring, identity) {
            Ok(pid) => pid,
            Err(Refusal::Lasting(reason)) => {
                self.refuse(identity, format!("ignoring {}: {reason}", path.display()));
                return;
            }
            Err(Refusal::OverQuota(reason)) => {
                // Tried again at every scan, as the user's other rings go;
                // reported once.
                if self.over_quota.len() >= MAX_REFUSED {
                    self.over_quota.clear();
                }
                if self.over_quota.insert(identity) {
                    let text = format!("ignoring {}: {reason}", path.display());
                    self.status.lock().notice(text);
                }
                return;
            }
        };
        self.over_quota.remove(&identity);
        // The slot first: a consumer taken and then dropped for want of one
        // would be let go of, but there is no need to take it at all.
        let Some(slot) = self.free_slot() else {
            self.status.lock().last_error = Some("too many CUDA processes attached".into());
            return;
        };
        let consumer = match ring.consumer() {
            Ok(consumer) => consumer,
            Err(error) => {
                self.slots_in_use.retain(|s| *s != slot);
                self.status.lock().last_error = Some(format!(
                    "{}: {error} (another agent drains it)",
                    path.display()
                ));
                return;
            }
        };
        let process = Process {
            pid,
            own_pid: (own_pid != pid).then_some(own_pid),
            threads: if own_pid == pid {
                Threads::default()
            } else {
                Threads::of(pid, own_pid)
            },
            files: WorkloadFiles::of_ring(path),
            slot,
            owner: identity.uid,
            meta_refused: false,
            ring,
            consumer,
            meta: MetaReader::default(),
            names: HashMap::new(),
            named_lines: HashSet::new(),
            host_lines: HashMap::new(),
            command: String::new(),
            control: u32::MAX,
            cupti_dropped: 0,
            planes: HashMap::new(),
            cupti: None,
            api_records: VecDeque::new(),
            states: Vec::new(),
        };
        self.processes.insert(identity, process);
        let mut status = self.status.lock();
        status.attached = self.processes.len();
        status.seen += 1;
        drop(status);
        self.read_meta(identity);
        if let Some(process) = self.processes.get_mut(&identity) {
            let text = format!("attached {}", process.label());
            let mut status = self.status.lock();
            if status.traced.len() == MAX_TRACED {
                status.traced.pop_front();
            }
            status.traced.push_back(Traced {
                pid,
                command: process.command.clone(),
                cupti: process.cupti.clone(),
                api_records: std::mem::take(&mut process.api_records),
                states: std::mem::take(&mut process.states),
                attached_ns: clock::now_ns(),
                detached_ns: None,
            });
            status.notice(text);
        }
    }

    /// Whether a ring that opened cleanly may be attached: made by the
    /// process its name gives, which holds it, in a file of that process's
    /// user, who has room for another. Returns the process's host pid.
    fn admissible(
        &self,
        path: &Path,
        own_pid: u32,
        ring: &Ring,
        identity: FileIdentity,
    ) -> Result<u32, Refusal> {
        if ring.creator_pid() != own_pid {
            return Err(Refusal::Lasting(format!(
                "it was made by process {}, not {own_pid}",
                ring.creator_pid()
            )));
        }
        let at = (identity.dev, identity.ino);
        let pid = host_process::holder_of(path, at, identity.uid, own_pid)
            .map_err(|why| Refusal::Lasting(why.to_string()))?;
        let held = self
            .processes
            .values()
            .filter(|p| p.owner == identity.uid)
            .count();
        if held >= MAX_RINGS_PER_UID {
            return Err(Refusal::OverQuota(format!(
                "uid {} already has {held} rings attached, the most one user may have",
                identity.uid
            )));
        }
        Ok(pid)
    }

    /// Reports a ring that will not be attached, once, and remembers it.
    fn refuse(&mut self, identity: FileIdentity, text: String) {
        if self.refused.len() >= MAX_REFUSED {
            self.refused.clear();
        }
        self.refused.insert(identity);
        warn!("{text}");
        let mut status = self.status.lock();
        status.last_error = Some(text.clone());
        status.notice(text);
    }

    /// Reads what the process appended to its metadata file.
    fn read_meta(&mut self, key: FileIdentity) {
        let Some(process) = self.processes.get_mut(&key) else {
            return;
        };
        let pid = process.pid;
        let records = match process.meta.read_new(&process.files.meta, process.owner) {
            Ok(records) => records,
            // Not there yet, or gone with its process.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return,
            Err(error) => {
                if !process.meta_refused {
                    process.meta_refused = true;
                    let text = format!(
                        "ignoring {} of {}: {error}; its names, devices and errors are unknown",
                        process.files.meta.display(),
                        process.label()
                    );
                    warn!("{text}");
                    self.status.lock().state(pid, &mut process.states, text);
                }
                return;
            }
        };
        for record in records {
            match record {
                MetaRecord::Process { command, .. } => process.command = command,
                MetaRecord::Name { id, text } => {
                    if process.names.len() < MAX_NAMES_PER_PROCESS
                        || process.names.contains_key(&id)
                    {
                        process.names.insert(id, self.registry.intern(&text));
                    }
                }
                MetaRecord::Device {
                    ordinal,
                    uuid,
                    info,
                } => {
                    // Without a UUID (an older library) the ordinal is all
                    // there is.
                    if ordinal > MAX_GPU_ORDINAL {
                        continue;
                    }
                    let plane = uuid.map_or(ordinal, |uuid| self.registry.gpu_plane(&uuid));
                    process.planes.insert(ordinal, plane);
                    // What NVML or another process said first stands.
                    self.registry
                        .describe_device_if_unknown(Device::Gpu(plane), info);
                }
                MetaRecord::Dropped { total } => {
                    let grew = total.saturating_sub(process.cupti_dropped);
                    process.cupti_dropped = total;
                    self.status.lock().cupti_dropped += grew;
                }
                MetaRecord::Error { message } => {
                    let text = format!(
                        "the injection library in {} stopped tracing: {message}",
                        process.label()
                    );
                    self.status.lock().state(pid, &mut process.states, text);
                }
                MetaRecord::Warning { message } => {
                    let text = format!("the injection library in {}: {message}", process.label());
                    self.status.lock().state(pid, &mut process.states, text);
                }
                MetaRecord::Cupti { version, origin } => {
                    let text = format!("API version {version} from {origin}");
                    let mut status = self.status.lock();
                    if let Some(traced) = status.traced_mut(pid) {
                        traced.cupti = Some(text.clone());
                    }
                    process.cupti = Some(text);
                }
                MetaRecord::Displaced { at_ns, seen } => {
                    let label = process.label();
                    let cause = LossCause::OtherUser { seen };
                    self.status.lock().lost_from(pid, label, at_ns, cause);
                }
                MetaRecord::Recording { at_ns } => {
                    let starting = |cause| cause == LossCause::Starting;
                    self.status.lock().lost_until(pid, at_ns, starting);
                }
                MetaRecord::ApiRecords { at_ns, set } => {
                    let mut status = self.status.lock();
                    match status.traced_mut(pid) {
                        Some(traced) => remember_switch(&mut traced.api_records, at_ns, set),
                        None => remember_switch(&mut process.api_records, at_ns, set),
                    }
                }
                MetaRecord::Resumed { at_ns } => {
                    let other_user = |cause| matches!(cause, LossCause::OtherUser { .. });
                    self.status.lock().lost_until(pid, at_ns, other_user);
                    let text = format!(
                        "the injection library in {} has the CUPTI activity stream again",
                        process.label()
                    );
                    self.status.lock().notice(text);
                }
            }
        }
    }

    /// Sets control words to `flags`, drains every ring, and lets go of
    /// processes that exited or broke their ring.
    fn service(&mut self, flags: u32) {
        let keys: Vec<FileIdentity> = self.processes.keys().copied().collect();
        for key in keys {
            let Some(pid) = self.processes.get(&key).map(|p| p.pid) else {
                continue;
            };
            // Whether it is alive is asked before the last drain, so that
            // nothing it pushed before exiting is missed.
            let alive = pid_alive(pid);
            self.read_meta(key);
            if let Some(process) = self.processes.get_mut(&key) {
                if process.control != flags {
                    // Asked to record from now; its library says when it
                    // does (`Recording`).
                    if process.control & CONTROL_CAPTURE == 0 && flags & CONTROL_CAPTURE != 0 {
                        let label = process.label();
                        let cause = LossCause::Starting;
                        self.status
                            .lock()
                            .lost_from(pid, label, clock::now_ns(), cause);
                    }
                    if flags & CONTROL_CAPTURE == 0 {
                        // A start that never came is no loss of a later capture.
                        let starting = |cause| cause == LossCause::Starting;
                        self.status.lock().lost_until(pid, 0, starting);
                    }
                    process.ring.set_control(flags);
                    process.control = flags;
                }
            }
            match self.drain(key) {
                Err(corruption) => self.detach(key, Some(corruption)),
                Ok(()) if !alive => self.detach(key, None),
                Ok(()) => {}
            }
        }
    }

    /// Moves what the ring holds into the agent, up to a pass's worth.
    fn drain(&mut self, key: FileIdentity) -> Result<(), crate::ring::Corruption> {
        let Some(process) = self.processes.get_mut(&key) else {
            return Ok(());
        };
        let mut budget = MAX_EVENTS_PER_PASS;
        while budget > 0 {
            self.drained.clear();
            let report = process
                .consumer
                .drain(&mut self.drained, budget.min(1 << 16));
            if let Some(corruption) = report.corrupt {
                return Err(corruption);
            }
            if report.dropped_newest + report.dropped_oldest > 0 {
                self.status.lock().ring_dropped += report.dropped_newest + report.dropped_oldest;
            }
            if self.drained.is_empty() {
                break;
            }
            budget = budget.saturating_sub(self.drained.len());
            self.scratch.clear();
            let mut foreign = 0;
            for event in &self.drained {
                match translate(&self.registry, process, event) {
                    Some(event) => self.scratch.push(event),
                    None => foreign += 1,
                }
            }
            let accepted = self.producer.push_batch(&self.scratch);
            let mut status = self.status.lock();
            status.events += accepted as u64;
            status.foreign += foreign;
        }
        Ok(())
    }

    /// Lets go of a process that exited, or whose ring broke.
    fn detach(&mut self, key: FileIdentity, corruption: Option<crate::ring::Corruption>) {
        let Some(process) = self.processes.remove(&key) else {
            return;
        };
        let pid = process.pid;
        self.slots_in_use.retain(|s| *s != process.slot);
        // Only its own file: the name may be someone else's by now.
        if identity_at(&process.files.ring).is_some_and(|at| at.same_file(key)) {
            let _ = std::fs::remove_file(&process.files.ring);
            if corruption.is_none() {
                let _ = std::fs::remove_file(&process.files.meta);
            }
        }
        if corruption.is_some() {
            self.refused.insert(key);
        }
        let mut status = self.status.lock();
        status.attached = self.processes.len();
        let now = clock::now_ns();
        status.lost_until(pid, now, |_| true);
        if let Some(traced) = status
            .traced
            .iter_mut()
            .rev()
            .find(|t| t.pid == pid && t.detached_ns.is_none())
        {
            traced.detached_ns = Some(now);
        }
        let text = match corruption {
            None => format!(
                "{} exited; its GPU events up to then are in the trace",
                process.label()
            ),
            Some(corruption) => {
                let text = format!(
                    "detached {}: its ring is corrupt ({corruption}); its GPU events from then \
                     on are missing",
                    process.label()
                );
                warn!("{text}");
                text
            }
        };
        status.notice(text);
    }
}

/// The owner and inode of the file at `path`, without following a link.
fn identity_at(path: &Path) -> Option<FileIdentity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|meta| FileIdentity::of(&meta))
}

/// Whether a host line `tid` may carry process `pid`'s events: one of its
/// threads, or a thread no process has now (one that ended before it was
/// first drained); never a live thread of another process.
fn may_be_thread_of(pid: u32, tid: u64) -> bool {
    let Ok(tid) = u32::try_from(tid) else {
        return false;
    };
    tid != 0
        && (Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
            || !Path::new(&format!("/proc/{tid}")).exists())
}

/// The host line for thread `tid` as `process` numbers it: the host's id of
/// that thread, or `None` for a thread that is another process's. A thread
/// of a namespaced process that has ended has no host id left to find, and
/// shares one line of the process with others like it.
fn host_line_of(process: &mut Process, tid: u64) -> Option<u64> {
    if process.own_pid.is_none() {
        return may_be_thread_of(process.pid, tid).then_some(tid);
    }
    let tid = u32::try_from(tid).ok().filter(|tid| *tid != 0)?;
    Some(match process.threads.host_tid(process.pid, tid) {
        Some(host) => u64::from(host),
        None => SYNTHETIC_LINE_BASE | (process.slot << 8) | LINE_ENDED_THREADS,
    })
}

/// Whether a CUDA workload's library makes events like this one: its
/// kinds, on the host or a GPU it can number.
fn is_workload_kind(event: &Event) -> bool {
    let device_ok = match event.device() {
        Device::Host => true,
        Device::Gpu(ordinal) => ordinal <= MAX_GPU_ORDINAL,
        Device::HostCpus => false,
    };
    device_ok
        && matches!(
            event.payload(),
            Payload::Plain
                | Payload::ApiCall { .. }
                | Payload::Kernel(_)
                | Payload::Memcpy(_)
                | Payload::Memset(_)
                | Payload::MemoryAllocation(_)
                | Payload::MemoryDeallocation(_)
        )
}

/// An event of `process` as this agent's: registry names, its streams on
/// lines of their own, its host lines named after it; `None` for an event no
/// CUDA workload makes, or on a thread that is not its own.
fn translate(registry: &Registry, process: &mut Process, event: &Event) -> Option<Event> {
    if !is_workload_kind(event) {
        return None;
    }
    let pid = process.pid;
    let names = &process.names;
    // A name whose record was not read (the file past its size limit) says
    // so rather than showing another name; one name for all, so that ids a
    // peer makes up cannot fill the registry.
    let mut mapped = event.map_names(|local| match names.get(&local.0) {
        Some(id) => *id,
        None if local.0 == 0 => NameId(0),
        None => registry.intern(UNKNOWN_NAME),
    });
    if let Device::Gpu(ordinal) = mapped.device() {
        let plane = process.planes.get(&ordinal).copied().unwrap_or(ordinal);
        mapped.set_device(Device::Gpu(plane));
    }
    let device = mapped.device();
    let line = match device {
        Device::Gpu(_) => (process.slot << STREAM_BITS) | (mapped.line & ((1 << STREAM_BITS) - 1)),
        _ if mapped.line >= SYNTHETIC_LINE_BASE => {
            SYNTHETIC_LINE_BASE | (process.slot << 8) | (mapped.line & 0xff)
        }
        // A host line is a thread id: only the process's own threads, so
        // that it cannot write onto other processes' lines.
        _ => {
            let checked = process.host_lines.len() < MAX_LINES_PER_PROCESS;
            let host_line = match process.host_lines.get(&mapped.line) {
                Some(line) => *line,
                None if checked => {
                    let line = host_line_of(process, mapped.line);
                    process.host_lines.insert(mapped.line, line);
                    line
                }
                None => None,
            };
            host_line?
        }
    };
    mapped.line = line;
    if process.named_lines.len() < MAX_LINES_PER_PROCESS
        && process.named_lines.insert((device, line))
    {
        let name = match device {
            Device::Gpu(_) => format!("(pid {pid}: {})", process.short_name()),
            _ if line >= SYNTHETIC_LINE_BASE => {
                let what = match line & 0xff {
                    1 => "CUDA memory",
                    2 => "CUDA synchronization",
                    3 => "CUPTI overhead",
                    LINE_ENDED_THREADS => "CUDA threads that ended",
                    _ => "CUDA",
                };
                format!("{what} (pid {pid}: {})", process.short_name())
            }
            _ => format!("{} {line} (pid {pid})", process.short_name()),
        };
        registry.name_line(device, line, &name);
    }
    Some(mapped)
}

/// The name of an event whose name record was never read.
const UNKNOWN_NAME: &str = "<name unknown: its record in the metadata file was not read>";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_names_the_api_records_switched_to_in_it_else_the_last_before() {
        let traced = Traced {
            pid: 7,
            command: String::new(),
            cupti: None,
            api_records: [
                (10, ApiRecordSet::Timeline),
                (100, ApiRecordSet::All),
                (150, ApiRecordSet::All),
                (200, ApiRecordSet::Timeline),
            ]
            .into_iter()
            .collect(),
            states: Vec::new(),
            attached_ns: 0,
            detached_ns: None,
        };
        let during = |start_ns, stop_ns| traced.api_records_during(Window { start_ns, stop_ns });
        assert_eq!(during(20, 90), [ApiRecordSet::Timeline]);
        assert_eq!(during(90, 160), [ApiRecordSet::All]);
        assert_eq!(during(90, 250), [ApiRecordSet::All, ApiRecordSet::Timeline]);
        assert_eq!(during(0, 5), []);
    }
}
