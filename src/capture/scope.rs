//! What a capture scoped to one user keeps of the flight recorder's window:
//! the events of that user's processes and of the GPUs they use, nothing of
//! other users' processes or of the host as a whole.
//!
//! An event is that user's when it is on a line a backend gave one of the
//! user's processes ([`ProcessLines`]: CUDA streams and host lines of
//! injected workloads) while that process was attached, or when it carries
//! a pid (scheduler slices, driver calls) of a process whose real,
//! effective and saved uids are all the user's (the kernel's test for who
//! may trace a process) and that had started by the event's time (so that
//! a pid reused since is not taken for the one that ran then). A GPU's
//! counters and errors are the user's when one of their processes used
//! that GPU in the window. Everything else (other users' processes,
//! host-wide counters, the tap's RPCs, threads of
//! processes that ended before the trace was built, whose owner can no
//! longer be checked) is left out, and the trace says so.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

use crate::backend::{ProcessLines, Scope};
use crate::event::{Device, Event, Payload};
use crate::model::host_process;
use crate::model::timeline::{COUNTER_TRACK, STREAM_BITS, XID_TRACK};

/// How far a process's recorded start may lie after an event of its pid
/// and still be that process: the kernel counts starts in 10 ms ticks.
const START_SLACK_NS: u64 = 10_000_000;

/// A process's user and start, as `/proc` tells them; none when it has
/// ended (or its pid is not one).
type Owner = Option<(u32, u64)>;

/// See the module documentation. One per scoped build; not shared between
/// threads.
pub struct Visibility {
    uid: u32,
    /// The user's processes' GPU slots and when each was theirs.
    gpu_slots: Vec<(u64, u64, u64)>,
    /// The user's processes' host lines and when each was theirs.
    host_lines: HashMap<u64, Vec<(u64, u64)>>,
    /// GPUs the user's processes used.
    gpus: HashSet<u16>,
    owners: RefCell<HashMap<u32, Owner>>,
    /// When this machine booted, Unix nanoseconds.
    boot_ns: u64,
    kept: Cell<u64>,
    /// Events of pids whose process had ended: not checkable.
    unchecked: Cell<u64>,
}

impl Visibility {
    /// The filter of a capture of `scope`, given the processes backends gave
    /// lines of their own; none for a capture of the whole host.
    pub fn of(scope: Scope, processes: &[ProcessLines]) -> Option<Visibility> {
        let uid = scope.user()?;
        let mut visibility = Visibility {
            uid,
            gpu_slots: Vec::new(),
            host_lines: HashMap::new(),
            gpus: HashSet::new(),
            owners: RefCell::default(),
            boot_ns: boot_ns(),
            kept: Cell::new(0),
            unchecked: Cell::new(0),
        };
        for process in processes.iter().filter(|p| p.uid == uid) {
            let span = (process.from_ns, process.until_ns.unwrap_or(u64::MAX));
            if let Some(slot) = process.gpu_slot {
                visibility.gpu_slots.push((slot, span.0, span.1));
            }
            for line in &process.host_lines {
                visibility.host_lines.entry(*line).or_default().push(span);
            }
            visibility.gpus.extend(process.gpus.iter().copied());
        }
        // A thread id another user's process has used too (reused, or
        // named in advance by a workload's ring) is no one's to see.
        for process in processes.iter().filter(|p| p.uid != uid) {
            for line in &process.host_lines {
                visibility.host_lines.remove(line);
            }
        }
        Some(visibility)
    }

    /// Whether the scope's user may see `event`.
    pub fn keeps(&self, event: &Event) -> bool {
        let kept = self.decide(event);
        if kept {
            self.kept.set(self.kept.get() + 1);
        }
        kept
    }

    /// What the trace should say of what was left out.
    pub fn summary(&self) -> String {
        let mut text = format!(
            "this trace is scoped to the processes of uid {}: other users' processes, the \
             host's own counters, the tap's RPCs, upstream servers and libtpu are left out \
             ({} events kept)",
            self.uid,
            self.kept.get()
        );
        let unchecked = self.unchecked.get();
        if unchecked > 0 {
            text.push_str(&format!(
                "; {unchecked} events of processes that ended before the trace was built are \
                 left out too, as whose they were can no longer be checked"
            ));
        }
        text
    }

    fn decide(&self, event: &Event) -> bool {
        let at = event.start_ns;
        match (event.device(), event.payload()) {
            (_, Payload::CpuSlice { pid, .. } | Payload::OffCpu { pid, .. }) => {
                self.owns_pid(pid, at)
            }
            (_, Payload::DriverCall(call)) => self.owns_pid(call.pid, at),
            (Device::Gpu(gpu), _) if event.line == COUNTER_TRACK || event.line == XID_TRACK => {
                self.gpus.contains(&gpu)
            }
            (Device::Gpu(_), _) => {
                let slot = event.line >> STREAM_BITS;
                self.gpu_slots
                    .iter()
                    .any(|(s, from, until)| *s == slot && (*from..=*until).contains(&at))
            }
            (Device::Host, _) => {
                self.host_lines.get(&event.line).is_some_and(|spans| {
                    spans
                        .iter()
                        .any(|(from, until)| (*from..=*until).contains(&at))
                }) && !self.another_users_thread(event.line)
            }
            (Device::HostCpus, _) => false,
        }
    }

    /// Whether host line `line` is a thread that lives now and is another
    /// user's (one that ended cannot be told, and its line stands).
    fn another_users_thread(&self, line: u64) -> bool {
        let Ok(tid) = u32::try_from(line) else {
            return false;
        };
        let owner = *self
            .owners
            .borrow_mut()
            .entry(tid)
            .or_insert_with(|| owner_of(tid, self.boot_ns));
        owner.is_some_and(|(uid, _)| uid != self.uid)
    }

    /// Whether `pid`, at `at_ns`, was a process of the scope's user.
    fn owns_pid(&self, pid: u32, at_ns: u64) -> bool {
        let owner = *self
            .owners
            .borrow_mut()
            .entry(pid)
            .or_insert_with(|| owner_of(pid, self.boot_ns));
        match owner {
            Some((uid, started_ns)) => {
                uid == self.uid && started_ns <= at_ns.saturating_add(START_SLACK_NS)
            }
            None => {
                self.unchecked.set(self.unchecked.get() + 1);
                false
            }
        }
    }
}

/// The user of process `pid` (when its real, effective and saved uids are
/// one) and its start in Unix nanoseconds. A process whose uids differ (a
/// set-user-ID program) is owned by no one but root: `u32::MAX` stands for
/// that.
fn owner_of(pid: u32, boot_ns: u64) -> Owner {
    if pid == 0 {
        return None;
    }
    // A process between two users (set-user-ID) is no one's.
    let uid = host_process::sole_uid(host_process::uids(pid)?).unwrap_or(u32::MAX);
    let ticks = host_process::start_ticks(pid)?;
    Some((uid, boot_ns.saturating_add(ticks.saturating_mul(TICK_NS))))
}

/// `/proc/<pid>/stat` counts in USER_HZ ticks, 100 a second on Linux.
const TICK_NS: u64 = 10_000_000;

/// When the machine booted, Unix nanoseconds: the realtime clock less the
/// time since boot (what process start times count from).
fn boot_ns() -> u64 {
    let read = |clock| {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(clock, &mut now) };
        (now.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(now.tv_nsec as u64)
    };
    read(libc::CLOCK_REALTIME).saturating_sub(read(libc::CLOCK_BOOTTIME))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{DriverCallInfo, KernelInfo, NameId};

    fn own_uid() -> u32 {
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() }
    }

    fn process(uid: u32, slot: u64, host_lines: Vec<u64>, gpus: Vec<u16>) -> ProcessLines {
        ProcessLines {
            pid: 1234,
            uid,
            from_ns: 1_000,
            until_ns: Some(2_000),
            gpu_slot: Some(slot),
            host_lines,
            gpus,
        }
    }

    fn at(start_ns: u64, device: Device, line: u64, payload: Payload) -> Event {
        Event::new(start_ns, 1, device, line, NameId(0), payload)
    }

    #[test]
    fn the_whole_host_needs_no_filter() {
        assert!(Visibility::of(Scope::Host, &[]).is_none());
    }

    #[test]
    fn a_users_streams_and_host_lines_are_kept_only_while_the_process_was_theirs() {
        // Thread ids past any pid_max: no live thread has them.
        let (theirs_line, others_line, shared_line) = (4_000_000_077, 4_000_000_088, 4_000_000_099);
        let processes = [
            process(1001, 3, vec![theirs_line, shared_line], vec![0]),
            process(1002, 4, vec![others_line, shared_line], vec![1]),
        ];
        let seen = Visibility::of(Scope::User { uid: 1001 }, &processes).unwrap();
        let kernel = Payload::Kernel(KernelInfo::default());
        let theirs = (3 << STREAM_BITS) | 7;
        let others = (4 << STREAM_BITS) | 7;
        assert!(seen.keeps(&at(1_500, Device::Gpu(0), theirs, kernel)));
        assert!(!seen.keeps(&at(2_500, Device::Gpu(0), theirs, kernel)));
        assert!(!seen.keeps(&at(1_500, Device::Gpu(1), others, kernel)));
        // A stream no process of theirs was given.
        assert!(!seen.keeps(&at(1_500, Device::Gpu(0), 7, kernel)));
        assert!(seen.keeps(&at(1_500, Device::Host, theirs_line, Payload::Plain)));
        assert!(!seen.keeps(&at(1_500, Device::Host, others_line, Payload::Plain)));
        assert!(!seen.keeps(&at(500, Device::Host, theirs_line, Payload::Plain)));
        // A line both users' processes used is neither's.
        assert!(!seen.keeps(&at(1_500, Device::Host, shared_line, Payload::Plain)));
        // A line that is another user's live thread now: not theirs.
        let live = process(1001, 5, vec![1], vec![]);
        let init = Visibility::of(Scope::User { uid: 1001 }, &[live]).unwrap();
        assert!(!init.keeps(&at(1_500, Device::Host, 1, Payload::Plain)));
        // Counters of the GPU their process used, not of another.
        let counter = Payload::Counter { value: 1.0 };
        assert!(seen.keeps(&at(1_500, Device::Gpu(0), COUNTER_TRACK, counter)));
        assert!(!seen.keeps(&at(1_500, Device::Gpu(1), COUNTER_TRACK, counter)));
        assert!(!seen.keeps(&at(1_500, Device::Host, COUNTER_TRACK, counter)));
        assert!(
            seen.summary().contains("(3 events kept)"),
            "{}",
            seen.summary()
        );
    }

    #[test]
    fn a_pid_is_the_users_only_when_its_process_had_started_by_then() {
        let me = own_uid();
        let pid = std::process::id();
        let seen = Visibility::of(Scope::User { uid: me }, &[]).unwrap();
        let now = crate::clock::now_ns();
        let call = |at_ns| {
            at(
                at_ns,
                Device::Host,
                u64::from(pid),
                Payload::DriverCall(DriverCallInfo {
                    pid,
                    ..DriverCallInfo::default()
                }),
            )
        };
        assert!(seen.keeps(&call(now)));
        // Long before this process started: another that had the pid then.
        assert!(!seen.keeps(&call(now - 3_600_000_000_000 * 24 * 365)));
        let slice = Payload::CpuSlice {
            pid,
            tid: pid,
            cpu: 0,
            end_state: 0,
        };
        assert!(seen.keeps(&at(now, Device::HostCpus, 0, slice)));
        let other = Visibility::of(Scope::User { uid: me + 1 }, &[]).unwrap();
        assert!(!other.keeps(&at(now, Device::HostCpus, 0, slice)));
        // A pid no process has: not checkable, left out and counted.
        let gone = Payload::CpuSlice {
            pid: u32::MAX - 1,
            tid: 1,
            cpu: 0,
            end_state: 0,
        };
        assert!(!seen.keeps(&at(now, Device::HostCpus, 0, gone)));
        assert!(seen.summary().contains("1 events of processes that ended"));
    }
}
