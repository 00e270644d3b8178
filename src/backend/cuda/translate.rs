//! Turning a workload's events into the agent's: only the kinds the
//! injection library makes, on the process's own threads (as the host
//! numbers them), GPUs and lines, with its names read from its metadata.

use super::attach::Process;
use super::*;

/// Whether a host line `tid` may carry process `pid`'s events: one of its
/// threads, or a thread no process has now (one that ended before it was
/// first drained); never a live thread of another process.
pub(super) fn may_be_thread_of(pid: u32, tid: u64) -> bool {
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
pub(super) fn host_line_of(process: &mut Process, tid: u64) -> Option<u64> {
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
pub(super) fn is_workload_kind(event: &Event) -> bool {
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
pub(super) fn translate(
    registry: &Registry,
    process: &mut Process,
    event: &Event,
) -> Option<Event> {
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
pub(super) const UNKNOWN_NAME: &str =
    "<name unknown: its record in the metadata file was not read>";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::DropPolicy;
    use devtrace_shm::event::KernelInfo;

    /// A process as attached, this test's own (so that its threads exist),
    /// in slot 3, whose library numbered one name (local id 7).
    fn process(registry: &Registry) -> Process {
        let ring = Ring::new(1, 64, DropPolicy::DropNewest).expect("a ring");
        let consumer = ring.consumer().expect("its consumer");
        Process {
            pid: std::process::id(),
            started: None,
            own_pid: None,
            threads: Default::default(),
            files: WorkloadFiles::of_ring(Path::new("/nonexistent/cuda-1-0.ring")),
            slot: 3,
            owner: 0,
            meta_refused: false,
            ring,
            consumer,
            meta: MetaReader::default(),
            names: [(7, registry.intern("vector_add"))].into_iter().collect(),
            named_lines: HashSet::new(),
            host_lines: HashMap::new(),
            command: "/opt/train/python3 train.py".to_string(),
            control: 0,
            cupti_dropped: 0,
            planes: [(1, 5)].into_iter().collect(),
            cupti: None,
            told_recorded: false,
            api_records: VecDeque::new(),
            states: Vec::new(),
        }
    }

    fn kernel(device: Device, line: u64, name: u32) -> Event {
        Event::new(
            1_000,
            10,
            device,
            line,
            NameId(name),
            Payload::Kernel(KernelInfo::default()),
        )
    }

    #[test]
    fn a_kernel_goes_to_its_gpus_plane_on_a_stream_line_of_the_processs_slot() {
        let registry = Registry::new();
        let mut process = process(&registry);
        let ours = translate(&registry, &mut process, &kernel(Device::Gpu(1), 13, 7))
            .expect("a kernel is a workload's event");
        assert_eq!(ours.device(), Device::Gpu(5));
        assert_eq!(ours.line, (3 << STREAM_BITS) | 13);
        assert_eq!(registry.snapshot().name(ours.name()), "vector_add");
        assert_eq!(
            registry.snapshot().line_name(Device::Gpu(5), ours.line),
            Some(format!("(pid {}: python3)", process.pid).as_str())
        );
    }

    #[test]
    fn a_stream_id_cannot_reach_another_processs_lines() {
        let registry = Registry::new();
        let mut process = process(&registry);
        let ours = translate(
            &registry,
            &mut process,
            &kernel(Device::Gpu(0), u64::MAX, 7),
        )
        .expect("a kernel");
        assert_eq!(ours.line >> STREAM_BITS, 3);
    }

    #[test]
    fn a_name_the_metadata_never_gave_is_said_to_be_unknown() {
        let registry = Registry::new();
        let mut process = process(&registry);
        let ours =
            translate(&registry, &mut process, &kernel(Device::Gpu(0), 1, 99)).expect("a kernel");
        assert_eq!(registry.snapshot().name(ours.name()), UNKNOWN_NAME);
    }

    #[test]
    fn events_no_workload_makes_are_refused() {
        let registry = Registry::new();
        let mut process = process(&registry);
        let counter = Event::new(
            0,
            0,
            Device::Gpu(0),
            1,
            NameId(7),
            Payload::Counter { value: 1.0 },
        );
        assert!(translate(&registry, &mut process, &counter).is_none());
        let on_cpus = kernel(Device::HostCpus, 1, 7);
        assert!(translate(&registry, &mut process, &on_cpus).is_none());
        let past_the_last_gpu = kernel(Device::Gpu(MAX_GPU_ORDINAL + 1), 1, 7);
        assert!(translate(&registry, &mut process, &past_the_last_gpu).is_none());
    }

    #[test]
    fn a_host_event_lands_only_on_a_thread_of_its_own_process() {
        let registry = Registry::new();
        let mut process = process(&registry);
        let pid = process.pid;
        let call = |line| {
            Event::new(
                0,
                5,
                Device::Host,
                line,
                NameId(7),
                Payload::ApiCall {
                    correlation_id: 1,
                    device_ordinal: 0,
                },
            )
        };
        // Its main thread: the line keeps the host's thread id.
        let own = translate(&registry, &mut process, &call(u64::from(pid))).expect("own thread");
        assert_eq!(own.line, u64::from(pid));
        // pid 1's thread is another live process's: refused.
        assert!(translate(&registry, &mut process, &call(1)).is_none());
        assert!(translate(&registry, &mut process, &call(0)).is_none());
        // A line past the thread ids is one of the process's own synthetic
        // lines (memory, synchronization), whatever else it says.
        let synthetic = translate(&registry, &mut process, &call(u64::MAX)).expect("synthetic");
        assert_eq!(synthetic.line, SYNTHETIC_LINE_BASE | (3 << 8) | 0xff);
    }

    #[test]
    fn threads_are_told_apart_by_the_hosts_thread_table() {
        let pid = std::process::id();
        assert!(may_be_thread_of(pid, u64::from(pid)));
        assert!(!may_be_thread_of(pid, 1));
        assert!(!may_be_thread_of(pid, 0));
        // A thread no process has now (ended before it was drained).
        assert!(may_be_thread_of(pid, u64::from(u32::MAX - 1)));
    }
}
