//! Finding workload rings in the runtime directory, deciding whether each
//! may be attached (it is a hostile directory), reading each process's
//! metadata, setting its control word, draining its ring and letting go of
//! it when it exits or breaks.

use super::slots::Slots;
use super::status::{remember_switch, LossCause, Refusal, Status, Traced, MAX_TRACED};
use super::translate::translate;
use super::*;
use crate::backend::Scope;

/// One workload process whose ring is attached.
pub(super) struct Process {
    /// Its pid on the host (in the agent's pid namespace).
    pub(super) pid: u32,
    /// When it started ([`host_process::start_ticks`]), so that a later
    /// process given its pid is not taken for it; `None` when unreadable.
    pub(super) started: Option<u64>,
    /// Its pid in a pid namespace of its own, when it runs in one.
    pub(super) own_pid: Option<u32>,
    /// Host ids of its threads, when it runs in a namespace of its own.
    pub(super) threads: Threads,
    pub(super) files: WorkloadFiles,
    pub(super) slot: u64,
    /// The uid that owns its ring file.
    pub(super) owner: u32,
    /// Its metadata file was refused (reported once).
    pub(super) meta_refused: bool,
    pub(super) ring: Arc<Ring>,
    pub(super) consumer: Consumer,
    pub(super) meta: MetaReader,
    /// Its name ids to the registry's.
    pub(super) names: HashMap<u32, NameId>,
    /// Lines already named, per device.
    pub(super) named_lines: HashSet<(Device, u64)>,
    /// The host line of each thread id its events carried; `None` for one
    /// that is not its own.
    pub(super) host_lines: HashMap<u64, Option<u64>>,
    pub(super) command: String,
    pub(super) control: u32,
    pub(super) cupti_dropped: u64,
    /// Its CUDA ordinals to GPU planes (physical GPUs, by UUID).
    pub(super) planes: HashMap<u16, u16>,
    pub(super) cupti: Option<String>,
    /// It is in the backends' [`LibraryProcesses`]: CUPTI loaded, and the
    /// library has not stopped tracing since.
    pub(super) told_recorded: bool,
    /// API record sets read before the process was remembered in
    /// `Status::traced`.
    pub(super) api_records: VecDeque<(u64, ApiRecordSet)>,
    /// States read before the process was remembered in `Status::traced`.
    pub(super) states: Vec<String>,
}

impl Process {
    /// What the process is called in line names: its program's file name.
    pub(super) fn short_name(&self) -> &str {
        let program = self.command.split(' ').next().unwrap_or("");
        program
            .rsplit('/')
            .next()
            .filter(|p| !p.is_empty())
            .unwrap_or("process")
    }

    pub(super) fn label(&self) -> String {
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
pub(super) struct Attachments {
    pub(super) config: CudaConfig,
    pub(super) registry: Arc<Registry>,
    /// Told which processes the library records (those with CUPTI).
    pub(super) library_processes: Arc<LibraryProcesses>,
    pub(super) status: Arc<Mutex<Status>>,
    pub(super) processes: BTreeMap<FileIdentity, Process>,
    pub(super) slots: Slots,
    /// Ring files refused, by owner and inode.
    pub(super) refused: HashSet<FileIdentity>,
    /// Rings waiting for their user to have fewer attached (reported once).
    pub(super) over_quota: HashSet<FileIdentity>,
    pub(super) producer: crate::ring::Producer,
    /// Events as drained from a workload's ring, and as translated.
    pub(super) drained: Vec<Event>,
    pub(super) scratch: Vec<Event>,
}

impl Attachments {
    /// Attaches rings that appeared and removes files of dead processes no
    /// one attached, in one pass over the directory.
    pub(super) fn scan(&mut self) {
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
                            "ignoring {}: it was made by an injection library older than this agent; restart the workload with this agent's library",
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

    /// Attaches the ring at `path`, whose name gives the pid its process has
    /// in its own namespace.
    pub(super) fn attach(&mut self, own_pid: u32, path: &Path) {
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
                    self.status.lock().notice(identity.uid, text);
                }
                return;
            }
        };
        self.over_quota.remove(&identity);
        // The slot first: a consumer taken and then dropped for want of one
        // would be let go of, but there is no need to take it at all.
        let Some(slot) = self.slots.take() else {
            self.status.lock().last_error = Some("too many CUDA processes attached".into());
            return;
        };
        let consumer = match ring.consumer() {
            Ok(consumer) => consumer,
            Err(error) => {
                self.slots.unused(slot);
                self.status.lock().last_error = Some(format!(
                    "{}: {error} (another agent drains it)",
                    path.display()
                ));
                return;
            }
        };
        let process = Process {
            pid,
            started: host_process::start_ticks(pid),
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
            told_recorded: false,
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
                uid: process.owner,
                slot: process.slot,
                lines: Vec::new(),
                command: process.command.clone(),
                cupti: process.cupti.clone(),
                api_records: std::mem::take(&mut process.api_records),
                states: std::mem::take(&mut process.states),
                attached_ns: clock::now_ns(),
                detached_ns: None,
            });
            status.notice(process.owner, text);
        }
    }

    /// Whether a ring that opened cleanly may be attached: made by the
    /// process its name gives, which holds it, in a file of that process's
    /// user, who has room for another. Returns the process's host pid.
    pub(super) fn admissible(
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
    pub(super) fn refuse(&mut self, identity: FileIdentity, text: String) {
        if self.refused.len() >= MAX_REFUSED {
            self.refused.clear();
        }
        self.refused.insert(identity);
        warn!("{text}");
        let mut status = self.status.lock();
        status.last_error = Some(text.clone());
        status.notice(identity.uid, text);
    }

    /// Reads what the process appended to its metadata file.
    pub(super) fn read_meta(&mut self, key: FileIdentity) {
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
                    let mut status = self.status.lock();
                    tell_recorded(&self.library_processes, &mut status, process, false);
                    drop(status);
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
                    tell_recorded(&self.library_processes, &mut status, process, true);
                }
                MetaRecord::Displaced { at_ns, seen } => {
                    let label = process.label();
                    let cause = LossCause::OtherUser { seen };
                    self.status.lock().lost_from(pid, label, at_ns, cause);
                }
                MetaRecord::Recording { at_ns } => {
                    self.status.lock().recording_began(pid, at_ns);
                }
                MetaRecord::Detached { .. } => {
                    tracing::info!(
                        "{}: the injection library detached CUPTI; the process's CUDA calls \
                         cost what they did before the capture",
                        process.label()
                    );
                }
                MetaRecord::ApiRecords { at_ns, set } => {
                    let mut status = self.status.lock();
                    match status.traced_mut(pid) {
                        Some(traced) => remember_switch(&mut traced.api_records, at_ns, set),
                        None => remember_switch(&mut process.api_records, at_ns, set),
                    }
                }
                MetaRecord::Untimed {
                    from_ns,
                    to_ns,
                    cause,
                } => {
                    let lost = LossCause::ApiCalls(cause);
                    let mut status = self.status.lock();
                    status.lost_between(pid, process.label(), from_ns, to_ns, lost);
                }
                MetaRecord::Unanswered {
                    from_ns,
                    to_ns,
                    launches,
                } => {
                    let lost = LossCause::Unanswered { launches };
                    let mut status = self.status.lock();
                    status.lost_between(pid, process.label(), from_ns, to_ns, lost);
                }
                MetaRecord::Unfinished {
                    from_ns,
                    at_ns,
                    kernels,
                    other,
                } => {
                    let lost = LossCause::Unfinished {
                        kernels,
                        other,
                        started: from_ns < at_ns,
                    };
                    // Work that had not started is told at the moment it
                    // was forced back (a span of its own).
                    let to_ns = at_ns.max(from_ns.saturating_add(1));
                    let mut status = self.status.lock();
                    status.lost_between(pid, process.label(), from_ns, to_ns, lost);
                }
                MetaRecord::Resumed { at_ns } => {
                    let other_user = |cause| matches!(cause, LossCause::OtherUser { .. });
                    let text = format!(
                        "the injection library in {} has the CUPTI activity stream again",
                        process.label()
                    );
                    let mut status = self.status.lock();
                    // The span it closed says when, in the trace; a word
                    // without one (its span forgotten) is told as it is.
                    if status.lost_until(pid, at_ns, other_user) {
                        tracing::info!("{text}");
                    } else {
                        status.notice(process.owner, text);
                    }
                }
            }
        }
    }

    /// Sets the control word of each process whose user a trace in
    /// progress covers to `flags`, with `background` (the GPU's past asked
    /// for) for every process; drains every ring, and lets go of processes
    /// that exited or broke their ring. A process recording its past
    /// whose user one of `held_asked` covers, and whose word stays as it
    /// was, is asked for the records its CUPTI holds (the word is set
    /// again, to the same flags: a new generation); one whose word changes
    /// hands them over as it stops or narrows recording.
    pub(super) fn service(
        &mut self,
        flags: u32,
        background: u32,
        held_asked: &[Scope],
        traces: &TraceDemand,
    ) {
        let keys: Vec<FileIdentity> = self.processes.keys().copied().collect();
        for key in keys {
            let Some((pid, started)) = self.processes.get(&key).map(|p| (p.pid, p.started)) else {
                continue;
            };
            // Whether it is alive is asked before the last drain, so that
            // nothing it pushed before exiting is missed. By its start too:
            // a pid reused between two passes is another process.
            let alive = match started {
                Some(started) => host_process::still_runs(pid, started),
                None => pid_alive(pid),
            };
            self.read_meta(key);
            if let Some(process) = self.processes.get_mut(&key) {
                let flags = background
                    | if traces.covers_user(process.owner) {
                        flags
                    } else {
                        0
                    };
                if process.control != flags {
                    // Asked to record from now; its library says when it
                    // does (`Recording`). One recording its GPU's past
                    // already has the kernels of the moments between.
                    let started = process.control & CONTROL_CAPTURE == 0
                        && flags & CONTROL_CAPTURE != 0
                        && process.control & CONTROL_RECORD_ALWAYS == 0;
                    if started {
                        let label = process.label();
                        let cause = LossCause::Starting;
                        self.status
                            .lock()
                            .lost_from(pid, label, clock::now_ns(), cause);
                    }
                    if flags & CONTROL_CAPTURE == 0 {
                        self.status.lock().never_started(pid, clock::now_ns());
                    }
                    process.ring.set_control(flags);
                    process.control = flags;
                } else if flags & CONTROL_RECORD_ALWAYS != 0
                    && held_asked
                        .iter()
                        .any(|scope| scope.covers_user(process.owner))
                {
                    process.ring.set_control(flags);
                }
                // The library stops following a control word whose agent
                // stopped beating (it died without clearing it). After the
                // word is set: a restarted agent's first beat must not make
                // the dead one's word followed again.
                process.ring.beat();
            }
            match self.drain(key) {
                Err(corruption) => self.detach(key, Some(corruption)),
                Ok(()) if !alive => self.detach(key, None),
                Ok(()) => {}
            }
        }
    }

    /// Moves what the ring holds into the agent, up to a pass's worth.
    pub(super) fn drain(&mut self, key: FileIdentity) -> Result<(), crate::ring::Corruption> {
        let mut budget = MAX_EVENTS_PER_PASS;
        while budget > 0 {
            let Some(process) = self.processes.get_mut(&key) else {
                return Ok(());
            };
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
            // The library writes a name's record before it pushes an event
            // with that name, but maybe after this pass read its metadata
            // file (its converter and its control thread both write): what
            // the drained events name is read now, before they are named.
            self.read_meta(key);
            let Some(process) = self.processes.get_mut(&key) else {
                return Ok(());
            };
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
            // Its lines, for captures scoped to its user.
            if let Some(traced) = status.traced_mut(process.pid) {
                if traced.lines.len() != process.named_lines.len() {
                    traced.lines = process.named_lines.iter().copied().collect();
                }
            }
        }
        Ok(())
    }

    /// Lets go of a process that exited, or whose ring broke.
    pub(super) fn detach(
        &mut self,
        key: FileIdentity,
        corruption: Option<crate::ring::Corruption>,
    ) {
        let Some(mut process) = self.processes.remove(&key) else {
            return;
        };
        let pid = process.pid;
        self.slots.free(process.slot);
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
        tell_recorded(&self.library_processes, &mut status, &mut process, false);
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
                "{} exited; the GPU events its library handed over up to then are in the trace",
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
        status.notice(process.owner, text);
    }
}

/// The owner and inode of the file at `path`, without following a link.
pub(super) fn identity_at(path: &Path) -> Option<FileIdentity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|meta| FileIdentity::of(&meta))
}

/// Tells the other backends, and the status, whether the injection library
/// records `process` now (CUPTI loaded, not stopped), when that changed.
fn tell_recorded(
    library_processes: &LibraryProcesses,
    status: &mut Status,
    process: &mut Process,
    recorded: bool,
) {
    if std::mem::replace(&mut process.told_recorded, recorded) == recorded {
        return;
    }
    if recorded {
        library_processes.insert(process.pid);
        status.recorded += 1;
    } else {
        library_processes.remove(process.pid);
        status.recorded -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::DropPolicy;
    use crate::workload::MetaWriter;
    use devtrace_shm::event::KernelInfo;

    /// An event's name record, written just before the event was pushed but
    /// after the agent's pass had read the metadata file, still names it.
    #[test]
    fn an_event_named_after_the_passs_read_of_the_metadata_keeps_its_name() {
        let dir = tempfile::tempdir().expect("a directory");
        let files = WorkloadFiles::named(dir.path(), std::process::id(), 1);
        let mut writer = MetaWriter::create(&files.meta).expect("the metadata file");
        let ring = Ring::new(1, 64, DropPolicy::DropNewest).expect("the workload's ring");
        let consumer = ring.consumer().expect("its consumer");
        let mut workload = ring.producer().expect("its producer");
        let registry = Registry::new();
        let agent_ring = Ring::new(1, 64, DropPolicy::DropNewest).expect("the agent's ring");
        let mut agent_consumer = agent_ring.consumer().expect("the agent's consumer");
        let key = identity_at(&files.meta).expect("the file's identity");
        let process = Process {
            pid: std::process::id(),
            started: None,
            own_pid: None,
            threads: Default::default(),
            files: files.clone(),
            slot: 1,
            // SAFETY: geteuid has no preconditions.
            owner: unsafe { libc::geteuid() },
            meta_refused: false,
            ring: Arc::clone(&ring),
            consumer,
            meta: MetaReader::default(),
            names: HashMap::new(),
            named_lines: HashSet::new(),
            host_lines: HashMap::new(),
            command: "train.py".to_string(),
            control: 0,
            cupti_dropped: 0,
            planes: HashMap::new(),
            cupti: None,
            told_recorded: false,
            api_records: VecDeque::new(),
            states: Vec::new(),
        };
        let mut attach = Attachments {
            config: CudaConfig::default(),
            registry: Arc::clone(&registry),
            library_processes: Arc::default(),
            status: Arc::new(Mutex::new(Status::default())),
            processes: [(key, process)].into_iter().collect(),
            slots: {
                // The process above holds slot 1.
                let mut slots = Slots::default();
                slots.take();
                slots
            },
            refused: HashSet::new(),
            over_quota: HashSet::new(),
            producer: agent_ring.producer().expect("the agent's producer"),
            drained: Vec::new(),
            scratch: Vec::new(),
        };
        // The pass reads the file before the library writes the name.
        attach.read_meta(key);
        writer
            .write(&MetaRecord::Name {
                id: 7,
                text: "matmul_tiled".into(),
            })
            .expect("the name record");
        let kernel = Event::new(
            1_000,
            10,
            Device::Gpu(0),
            13,
            NameId(7),
            Payload::Kernel(KernelInfo::default()),
        );
        assert_eq!(workload.push_batch(&[kernel]), 1);
        attach.drain(key).expect("a sound ring");
        let mut out = Vec::new();
        agent_consumer.drain(&mut out, 16);
        assert_eq!(out.len(), 1);
        assert_eq!(registry.snapshot().name(out[0].name()), "matmul_tiled");
    }
}
