//! Loading, attaching and draining the BPF programs. Everything libbpf hands
//! out borrows the loaded object, so all of it lives on the backend's one
//! thread: [`run`] loads, reports whether that worked, then attaches and
//! detaches as captures come and go and turns ring-buffer records into
//! events until it is told to stop.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject, RingBufferBuilder};
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::cuda::{find_driver_libraries, DriverCalls, MappingProcess};
use super::reaper::{LibraryFile, ProbeKey};
use super::records::{
    CudaCall, Record, SchedRecord, LOSS_CUDA_INFLIGHT, LOSS_CUDA_RING, LOSS_KINDS, LOSS_SCHED_RING,
};
use super::sched::SchedTimeline;
use super::uprobes::{probe_library, EntryPoints, Linking, NotProbed, ProbedLibrary};
use super::{AttachMode, EbpfConfig, Status};
use crate::backend::worker::StopFlag;
use crate::backend::{BackendContext, LibraryProcesses};
use crate::clock;
use crate::event::{Device, Event, Payload};
use crate::model::timeline::COUNTER_TRACK;

mod sched_skel {
    #![allow(clippy::all, clippy::pedantic, dead_code, non_camel_case_types)]
    include!(concat!(env!("OUT_DIR"), "/sched.skel.rs"));
}
pub(super) mod cuda_skel {
    #![allow(clippy::all, clippy::pedantic, dead_code, non_camel_case_types)]
    include!(concat!(env!("OUT_DIR"), "/cuda.skel.rs"));
}
use cuda_skel::{CudaSkel, CudaSkelBuilder};
use sched_skel::{SchedSkel, SchedSkelBuilder};

/// Names of the loss counters, by `enum loss_kind`.
const LOSS_NAMES: [&str; LOSS_KINDS as usize] = [
    "BPF scheduler records lost (ring buffer full)",
    "BPF CUDA call records lost (ring buffer full)",
    "CUDA calls lost (in-flight table full)",
];

/// libbpf's own messages go to the log instead of stderr.
fn log_libbpf(level: libbpf_rs::PrintLevel, message: String) {
    let message = message.trim_end();
    match level {
        libbpf_rs::PrintLevel::Warn => debug!(target: "libbpf", "{message}"),
        _ => tracing::trace!(target: "libbpf", "{message}"),
    }
}

/// `CLOCK_MONOTONIC` (what `bpf_ktime_get_ns` reads) to the agent's clock.
#[derive(Clone, Copy)]
struct ClockMap {
    offset: i128,
}

impl ClockMap {
    fn measure() -> ClockMap {
        let read = |clock: libc::clockid_t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes one timespec we own.
            unsafe { libc::clock_gettime(clock, &mut ts) };
            ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
        };
        let before = read(libc::CLOCK_REALTIME);
        let monotonic = read(libc::CLOCK_MONOTONIC);
        let after = read(libc::CLOCK_REALTIME);
        ClockMap {
            offset: (before + after) / 2 - monotonic,
        }
    }

    fn realtime(self, monotonic_ns: u64) -> u64 {
        (monotonic_ns as i128 + self.offset).clamp(0, u64::MAX as i128) as u64
    }
}

/// What the ring-buffer callbacks fill; shared with the loop on the same
/// thread.
struct Decoder {
    sched: SchedTimeline,
    cuda: DriverCalls,
    clock: ClockMap,
    pending: Vec<Event>,
    malformed: u64,
}

impl Decoder {
    fn sched_sample(&mut self, sample: &[u8]) {
        match SchedRecord::read(sample) {
            Some(record) => {
                let at = self.clock.realtime(record.time_ns);
                self.sched.record(&record, at, &mut self.pending);
            }
            None => self.malformed += 1,
        }
    }

    fn cuda_sample(&mut self, sample: &[u8]) {
        match CudaCall::read(sample) {
            Some(call) => {
                let start = self.clock.realtime(call.start_ns);
                // A call probed at entry only has no end.
                let end = self.clock.realtime(call.end_ns.max(call.start_ns));
                self.cuda.record(&call, start, end, &mut self.pending);
            }
            None => self.malformed += 1,
        }
    }
}

fn load_error(what: &str, error: libbpf_rs::Error) -> String {
    let denied = matches!(error.kind(), libbpf_rs::ErrorKind::PermissionDenied);
    if denied {
        let lockdown = std::fs::read_to_string("/sys/kernel/security/lockdown")
            .ok()
            .filter(|mode| mode.contains("[confidentiality]"))
            .map(|_| "; the kernel is locked down (confidentiality), which forbids reading kernel memory from BPF")
            .unwrap_or("");
        format!(
            "loading the {what} BPF programs was refused: run devtrace as root, or grant it \
             CAP_BPF and CAP_PERFMON{lockdown}"
        )
    } else {
        format!("loading the {what} BPF programs failed: {error}")
    }
}

/// Sets the filters an object's programs read; before load for the
/// read-only part.
macro_rules! configure_filters {
    ($open:expr, $config:expr) => {{
        if let Some(rodata) = $open.maps.rodata_data.as_deref_mut() {
            rodata.filter_pids = !$config.pids.is_empty();
            rodata.filter_cgroup = $config.cgroup_id.unwrap_or(0);
            if let Some(comm) = &$config.comm {
                let bytes = comm.as_bytes();
                let len = bytes.len().min(15);
                rodata.filter_comm_len = len as u32;
                for (slot, byte) in rodata.filter_comm.iter_mut().zip(&bytes[..len]) {
                    *slot = *byte as _;
                }
            }
        }
    }};
}

/// Opens, configures and loads one skeleton when `$wanted`: filters, the
/// ring-buffer size and whatever `$prepare` sets before load, the pid table
/// after. Evaluates to `Result<Option<Skel>, String>`.
macro_rules! load {
    ($config:expr, $wanted:ident, $builder:ident, $object:ident, $ring:ident, $what:literal,
     $prepare:expr) => {{
        let config = &$config;
        if !config.$wanted {
            Ok(None)
        } else {
            $builder::default()
                .open(&mut $object)
                .map_err(|e| load_error($what, e))
                .and_then(|mut open| {
                    configure_filters!(open, *config);
                    open.maps
                        .$ring
                        .set_max_entries(config.ring_bytes)
                        .map_err(|e| format!("sizing the {} ring buffer: {e}", $what))?;
                    $prepare(&mut open);
                    open.load().map_err(|e| load_error($what, e))
                })
                .and_then(|skel| {
                    fill_pid_filter(&skel.maps.pid_filter, &config.pids)?;
                    Ok(Some(skel))
                })
        }
    }};
}

fn fill_pid_filter(map: &dyn MapCore, pids: &[u32]) -> Result<(), String> {
    for pid in pids {
        map.update(&pid.to_ne_bytes(), &[1], MapFlags::ANY)
            .map_err(|e| format!("setting the pid filter ({pid}): {e}"))?;
    }
    Ok(())
}

fn read_losses(map: &dyn MapCore, into: &mut [u64; LOSS_KINDS as usize], kinds: &[u32]) {
    for &kind in kinds {
        if let Ok(Some(per_cpu)) = map.lookup_percpu(&kind.to_ne_bytes(), MapFlags::ANY) {
            into[kind as usize] = per_cpu
                .iter()
                .filter_map(|v| v.get(..8).and_then(|b| b.try_into().ok()))
                .map(u64::from_ne_bytes)
                .sum();
        }
    }
}

/// Attaches every scheduler program; dropping the links detaches them.
fn attach_sched(skel: &SchedSkel<'_>) -> Result<Vec<Link>, libbpf_rs::Error> {
    let progs = &skel.progs;
    Ok(vec![
        progs.on_sched_switch.attach()?,
        progs.on_sched_wakeup.attach()?,
        progs.on_sched_process_exec.attach()?,
        progs.on_sched_process_exit.attach()?,
    ])
}

/// Processes a driver library is probed in one by one at most, unless the
/// operator says; beyond, it is probed in every process, those the
/// injection library records too, and `Monitor` says so. Where each probe
/// is a perf event of its own, a process's 54 cost file descriptors and,
/// when a process needs probes that would fire with others still being let
/// go of, a wait of seconds (about 3 s here); linked together, three links
/// and milliseconds.
fn max_probed_alone(config: &EbpfConfig, linking: Linking) -> usize {
    config
        .probe_alone_max
        .unwrap_or(if linking.many_in_one { 64 } else { 4 })
}

/// Whether the programs for links of many probes are loaded (only where
/// the kernel has such links).
fn load_links_of_many(open: &mut cuda_skel::OpenCudaSkel<'_>, load: bool) {
    let progs = &mut open.progs;
    progs.on_cuda_call_multi.set_autoload(load);
    progs.on_cuda_entry_multi.set_autoload(load);
    progs.on_cuda_return_multi.set_autoload(load);
}

/// The backend thread; see the module documentation.
pub(super) fn run(
    config: EbpfConfig,
    context: BackendContext,
    status: Arc<Mutex<Status>>,
    ready: mpsc::Sender<Result<(), String>>,
    stop: StopFlag,
) {
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, log_libbpf)));
    let mut sched_object = MaybeUninit::<OpenObject>::uninit();
    let mut cuda_object = MaybeUninit::<OpenObject>::uninit();
    let mut cuda_object_again = MaybeUninit::<OpenObject>::uninit();
    let mut linking = if config.cuda {
        Linking::of_this_kernel()
    } else {
        Linking::default()
    };

    let sched = match load!(
        config,
        sched,
        SchedSkelBuilder,
        sched_object,
        sched_events,
        "scheduler",
        |_: &mut _| {}
    ) {
        Ok(skel) => skel,
        Err(reason) => {
            let _ = ready.send(Err(reason));
            return;
        }
    };
    let many = linking.many_in_all;
    let loaded = match load!(
        config,
        cuda,
        CudaSkelBuilder,
        cuda_object,
        cuda_events,
        "CUDA uprobe",
        |open: &mut cuda_skel::OpenCudaSkel<'_>| load_links_of_many(open, many)
    ) {
        // Programs the feature test did not show the verifier: without
        // them, one by one.
        Err(reason) if many => {
            warn!(%reason, "the programs for links of many CUDA probes were refused; probing one by one");
            linking = Linking::default();
            load!(
                config,
                cuda,
                CudaSkelBuilder,
                cuda_object_again,
                cuda_events,
                "CUDA uprobe",
                |open: &mut cuda_skel::OpenCudaSkel<'_>| load_links_of_many(open, false)
            )
        }
        loaded => loaded,
    };
    let cuda = match loaded {
        Ok(skel) => skel,
        Err(reason) => {
            let _ = ready.send(Err(reason));
            return;
        }
    };
    let producer = match context.producer() {
        Ok(producer) => producer,
        Err(error) => {
            let _ = ready.send(Err(format!("no ring lane for the eBPF backend: {error}")));
            return;
        }
    };

    let decoder = Rc::new(RefCell::new(Decoder {
        sched: SchedTimeline::new(Arc::clone(&context.registry)),
        cuda: DriverCalls::new(Arc::clone(&context.registry)),
        clock: ClockMap::measure(),
        pending: Vec::new(),
        malformed: 0,
    }));
    let mut builder = RingBufferBuilder::new();
    let ring_setup = (|| {
        if let Some(skel) = &sched {
            let decoder = Rc::clone(&decoder);
            builder.add(&skel.maps.sched_events, move |sample: &[u8]| {
                decoder.borrow_mut().sched_sample(sample);
                0
            })?;
        }
        if let Some(skel) = &cuda {
            let decoder = Rc::clone(&decoder);
            builder.add(&skel.maps.cuda_events, move |sample: &[u8]| {
                decoder.borrow_mut().cuda_sample(sample);
                0
            })?;
        }
        builder.build()
    })();
    let rings = match ring_setup {
        Ok(rings) => rings,
        Err(error) => {
            let _ = ready.send(Err(format!("opening the BPF ring buffers failed: {error}")));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    if cuda.is_some() {
        info!(linking = linking.describe(), "CUDA driver probes ready");
    }

    let mut tracer = Tracer {
        config: &config,
        status: &status,
        sched: sched.as_ref(),
        cuda: cuda.as_ref(),
        linking,
        rings,
        decoder,
        producer,
        sched_links: Vec::new(),
        library_processes: Arc::clone(&context.library_processes),
        probes: HashMap::new(),
        entry_points: HashMap::new(),
        recordable: HashSet::new(),
        refused: HashSet::new(),
        failed: HashSet::new(),
        attached: false,
        last_scan: None,
        last_split: Instant::now(),
        last_losses: Instant::now(),
        losses: [0; LOSS_KINDS as usize],
        reported_losses: [0; LOSS_KINDS as usize],
        loss_names: LOSS_NAMES
            .iter()
            .map(|name| context.registry.intern(name))
            .collect(),
    };
    while !stop.is_set() {
        let demand = context.traces.changes();
        let wanted = config.attach == AttachMode::Always || context.traces.any();
        if wanted && !tracer.attached {
            tracer.attach();
        } else if !wanted && tracer.attached {
            tracer.detach();
        }
        if tracer.attached {
            tracer.probe_processes();
            tracer.drain();
        } else {
            // Nothing is recorded while detached: a capture starting is
            // waited for, so that the hooks go on as its window opens.
            context.traces.wait_for_change(demand, IDLE_TICK);
            tracer.drain_left();
        }
        tracer.report_losses();
        tracer.push_pending();
    }
}

/// How often the loop looks around while no hook is attached.
const IDLE_TICK: Duration = Duration::from_millis(100);

/// The loop's state once everything is loaded: what is attached, the ring
/// buffers and what their records became, and the loss counters.
struct Tracer<'a> {
    config: &'a EbpfConfig,
    status: &'a Mutex<Status>,
    sched: Option<&'a SchedSkel<'a>>,
    cuda: Option<&'a CudaSkel<'a>>,
    /// How the driver's probes are linked on this kernel.
    linking: Linking,
    rings: libbpf_rs::RingBuffer<'a>,
    decoder: Rc<RefCell<Decoder>>,
    producer: crate::ring::Producer,
    // Links are kept here, not in the skeleton: libbpf's skeleton attach
    // skips programs whose link slot is set, so links dropped from it would
    // be handed back (freed) on the next attach.
    sched_links: Vec<Link>,
    /// Processes whose calls the injection library records: not probed.
    library_processes: Arc<LibraryProcesses>,
    probes: HashMap<ProbeKey, ProbedLibrary>,
    /// Each library file mapped at the last look, open, with its entry
    /// points (`None`: the file is no shared object with them, so it is
    /// probed by name, one by one).
    entry_points: HashMap<LibraryFile, Option<EntryPoints>>,
    /// Processes mapping a driver library that passed the filters.
    recordable: HashSet<MappingProcess>,
    /// Libraries no entry point of which could be probed in every process.
    refused: HashSet<LibraryFile>,
    /// Processes a library could not be probed in (until the next attach).
    failed: HashSet<ProbeKey>,
    attached: bool,
    last_scan: Option<Instant>,
    last_split: Instant,
    last_losses: Instant,
    losses: [u64; LOSS_KINDS as usize],
    reported_losses: [u64; LOSS_KINDS as usize],
    loss_names: Vec<crate::event::NameId>,
}

impl Tracer<'_> {
    fn attach(&mut self) {
        {
            let mut decoder = self.decoder.borrow_mut();
            decoder.clock = ClockMap::measure();
            decoder.sched.restart(clock::now_ns());
        }
        if let Some(skel) = self.sched {
            match attach_sched(skel) {
                Ok(links) => self.sched_links = links,
                Err(error) => {
                    warn!(%error, "attaching the scheduler programs failed");
                    self.status.lock().error =
                        Some(format!("attaching the scheduler programs: {error}"));
                }
            }
        }
        self.attached = true;
        self.last_scan = None;
        let mut status = self.status.lock();
        status.attached = true;
        status.coverage.attached(clock::now_ns());
        drop(status);
        debug!("eBPF programs attached");
    }

    fn detach(&mut self) {
        self.status.lock().coverage.detached(clock::now_ns());
        let _ = self.rings.consume();
        self.decoder
            .borrow_mut()
            .sched
            .split(clock::now_ns(), &mut Vec::new());
        self.sched_links.clear();
        self.probes.clear();
        self.entry_points.clear();
        self.failed.clear();
        self.attached = false;
        let mut status = self.status.lock();
        status.attached = false;
        status.libraries.clear();
        status.library_processes = 0;
        status.crowded = None;
        debug!("eBPF programs detached");
    }

    /// Probes driver libraries that appeared in processes' maps since the
    /// last look (once per rescan interval): in every process that maps one,
    /// or, where the injection library records some of them, in each of the
    /// others alone; lets go of probes no longer wanted (their process
    /// ended, or the injection library records it now).
    fn probe_processes(&mut self) {
        let Some(skel) = self.cuda else { return };
        if self
            .last_scan
            .is_some_and(|at| at.elapsed() < self.config.rescan_interval)
        {
            return;
        }
        self.last_scan = Some(Instant::now());
        // Attached always, the probes keep the past's driver calls, which
        // the injection library does not record between captures.
        let spare = self.config.attach == AttachMode::Capture;
        let mut wanted: Vec<(ProbeKey, PathBuf)> = Vec::new();
        let mut left_to_library = 0;
        let mut crowded = None;
        let recordable = std::mem::take(&mut self.recordable);
        let mut seen_recordable = HashSet::new();
        for mapped in find_driver_libraries(&self.config.proc_root, &self.config.cuda_libraries) {
            let file = (mapped.library.dev, mapped.library.inode);
            if self.refused.contains(&file) {
                continue;
            }
            let (recorded, others): (Vec<_>, Vec<_>) = mapped
                .mappers
                .into_iter()
                .partition(|mapper| spare && self.library_processes.contains(mapper.process.pid));
            if recorded.is_empty() {
                wanted.push(((file, None), mapped.library.path));
                continue;
            }
            // Probed alone only where something may be recorded (once a
            // thread passed, the process is not looked at again).
            let others: Vec<_> = others
                .into_iter()
                .filter(|mapper| {
                    let process = mapper.process;
                    recordable.contains(&process) || self.config.may_record(process.pid)
                })
                .collect();
            seen_recordable.extend(others.iter().map(|mapper| mapper.process));
            if others.len() > max_probed_alone(self.config, self.linking) {
                crowded = Some(others.len());
                wanted.push(((file, None), mapped.library.path));
            } else {
                left_to_library += recorded.len();
                wanted.extend(
                    others
                        .into_iter()
                        .map(|mapper| ((file, Some(mapper.process)), mapper.path)),
                );
            }
        }
        self.recordable = seen_recordable;
        // Dropped before any is attached: a process probed both in all and
        // alone would have each call recorded twice.
        let is_wanted = |key: &ProbeKey| wanted.iter().any(|(wanted, _)| wanted == key);
        self.probes.retain(|key, _| is_wanted(key));
        self.failed.retain(is_wanted);
        // Files no longer mapped are let go of (and their inodes with them).
        self.entry_points
            .retain(|file, _| wanted.iter().any(|((wanted, _), _)| wanted == file));
        for (key, path) in wanted {
            if self.probes.contains_key(&key) || self.failed.contains(&key) {
                continue;
            }
            let (file, process) = key;
            if let Entry::Vacant(vacant) = self.entry_points.entry(file) {
                match EntryPoints::read(&path, file) {
                    Ok(read) => {
                        vacant.insert(Some(read));
                    }
                    Err(unread) => {
                        debug!(library = %path.display(), reason = %unread.reason,
                            "driver entry points not read; probing by name, one by one");
                        // Looked at again next time, unless the file itself
                        // is at fault.
                        if unread.lasting {
                            vacant.insert(None);
                        }
                    }
                }
            }
            let entry_points = self.entry_points.get(&file).and_then(Option::as_ref);
            match probe_library(
                skel,
                &path,
                key,
                entry_points,
                self.config.cuda_returns,
                self.linking,
            ) {
                Ok((probes, missing)) => {
                    let pid = process.map(|p| p.pid);
                    debug!(library = %path.display(), ?pid, ?missing, "CUDA driver probed");
                    self.probes.insert(key, probes);
                    // Listed once, by the path it was first probed through.
                    let mut status = self.status.lock();
                    if !status.libraries.iter().any(|(known, _, _)| *known == file) {
                        let path = path.display().to_string();
                        info!(library = %path, ?missing, "CUDA driver probed");
                        status.libraries.push((file, path, missing));
                    }
                }
                Err(NotProbed::Overlapping) => {
                    debug!(library = %path.display(), "probes being let go of would fire on the same calls; trying again next time");
                }
                // It ended while we looked.
                Err(NotProbed::Failed(_))
                    if process.is_some_and(|p| {
                        MappingProcess::at(&self.config.proc_root, p.pid) != Some(p)
                    }) => {}
                // One process refused: the others are still probed.
                Err(NotProbed::Failed(reason)) if process.is_some() => {
                    warn!(%reason, "CUDA driver library not probed in a process");
                    self.failed.insert(key);
                    self.status.lock().error = Some(reason);
                }
                Err(NotProbed::Failed(reason)) => {
                    warn!(%reason, "CUDA driver library not probed");
                    self.refused.insert(file);
                    self.status.lock().error = Some(reason);
                }
            }
        }
        let mut status = self.status.lock();
        status.library_processes = left_to_library;
        status.crowded = crowded;
    }

    /// Waits for the next tick and decodes what the BPF ring buffers hold;
    /// cuts open slices at their interval.
    fn drain(&mut self) {
        // Records do not wake this thread (see the BPF programs); it drains
        // on this timer, which also bounds how late a capture's end is
        // noticed.
        if let Err(error) = self.rings.poll(Duration::from_millis(50)) {
            if error.kind() != libbpf_rs::ErrorKind::Interrupted {
                warn!(%error, "polling the BPF ring buffers failed");
            }
        }
        self.drain_left();
    }

    /// Reads what the ring buffers hold without waiting (a poll that timed
    /// out consumed nothing; records arrive without a wakeup), and splits
    /// the scheduler's spans on their interval while attached.
    fn drain_left(&mut self) {
        if let Err(error) = self.rings.consume() {
            warn!(%error, "reading the BPF ring buffers failed");
        }
        if self.attached && self.last_split.elapsed() >= self.config.split_interval {
            self.last_split = Instant::now();
            let mut decoder = self.decoder.borrow_mut();
            let decoder = &mut *decoder;
            decoder.sched.split(clock::now_ns(), &mut decoder.pending);
        }
    }

    /// Reads the kernel-side loss counters (each second, and on every tick
    /// while detached) into counter samples and the status; refreshes the
    /// clock mapping.
    fn report_losses(&mut self) {
        if self.attached && self.last_losses.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_losses = Instant::now();
        if let Some(skel) = self.sched {
            read_losses(&skel.maps.losses, &mut self.losses, &[LOSS_SCHED_RING]);
        }
        if let Some(skel) = self.cuda {
            read_losses(
                &skel.maps.losses,
                &mut self.losses,
                &[LOSS_CUDA_RING, LOSS_CUDA_INFLIGHT],
            );
        }
        let mut decoder = self.decoder.borrow_mut();
        if self.losses != self.reported_losses {
            let now = clock::now_ns();
            for (kind, count) in self.losses.iter().enumerate() {
                if *count != self.reported_losses[kind] {
                    decoder.pending.push(Event::new(
                        now,
                        0,
                        Device::HostCpus,
                        COUNTER_TRACK,
                        self.loss_names[kind],
                        Payload::Counter {
                            value: *count as f64,
                        },
                    ));
                }
            }
            self.reported_losses = self.losses;
            self.status.lock().losses = self.losses;
        }
        decoder.clock = ClockMap::measure();
    }

    /// Moves decoded events into the agent's ring, which counts what it
    /// refuses (those drops reach the trace).
    fn push_pending(&mut self) {
        let mut decoder = self.decoder.borrow_mut();
        if decoder.pending.is_empty() {
            return;
        }
        let accepted = self.producer.push_batch(&decoder.pending);
        let mut status = self.status.lock();
        status.events += accepted as u64;
        status.malformed = decoder.malformed;
        status.threads = decoder.sched.tracked_threads();
        decoder.pending.clear();
    }
}
