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
