//! Turns scheduler records into timelines: per CPU, which thread ran when;
//! per thread, when it was off its CPU, in which state, and who woke it.
//!
//! A slice is only known once it ends, so [`SchedTimeline::split`] cuts the
//! slices still open at a tick, keeping the delay between an event and its
//! arrival bounded for threads that run or sleep for a long time.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::records::{
    c_str, SchedRecord, COMM_LEN, MATCH_NEXT, MATCH_PREV, SCHED_EXEC, SCHED_EXIT, SCHED_SWITCH,
    SCHED_WAKEUP,
};
use crate::event::{Device, Event, NameId, Payload};
use crate::model::registry::Registry;
use crate::model::timeline::{cpu_line_name, THREAD_LINE_BIT};
use crate::model::timeline::{task_state_label, OFF_CPU_PREFIX, STILL_RUNNING};

/// Task states of a thread that has exited (EXIT_DEAD, EXIT_ZOMBIE,
/// TASK_DEAD).
const EXITED: u32 = 0x10 | 0x20 | 0x80;

struct Running {
    tid: u32,
    pid: u32,
    name: NameId,
    since_ns: u64,
}

struct OffCpu {
    pid: u32,
    since_ns: u64,
    state: u32,
    waker_tid: u32,
}

struct Thread {
    comm: [u8; COMM_LEN],
    pid: u32,
}

/// See the module documentation. Times given to it are already converted
/// to the agent's clock.
pub struct SchedTimeline {
    registry: Arc<Registry>,
    /// When recording (re)started; a CPU's first slice starts no earlier.
    attached_ns: u64,
    running: HashMap<u32, Running>,
    /// CPUs that have had a switch since recording started.
    cpus_seen: HashSet<u32>,
    off_cpu: HashMap<u32, OffCpu>,
    threads: HashMap<u32, Thread>,
    comm_names: HashMap<[u8; COMM_LEN], NameId>,
    state_names: HashMap<u32, NameId>,
    exec_name: NameId,
    exit_name: NameId,
}

impl SchedTimeline {
    pub fn new(registry: Arc<Registry>) -> SchedTimeline {
        SchedTimeline {
            exec_name: registry.intern("exec"),
            exit_name: registry.intern("exit"),
            registry,
            attached_ns: 0,
            running: HashMap::new(),
            cpus_seen: HashSet::new(),
            off_cpu: HashMap::new(),
            threads: HashMap::new(),
            comm_names: HashMap::new(),
            state_names: HashMap::new(),
        }
    }

    /// Forgets what was running: records start again at `now_ns`.
    pub fn restart(&mut self, now_ns: u64) {
        self.attached_ns = now_ns;
        self.running.clear();
        self.cpus_seen.clear();
        self.off_cpu.clear();
    }

    /// Threads currently tracked (running, off-CPU or named); bounded by the
    /// live threads because exits remove them.
    pub fn tracked_threads(&self) -> usize {
        self.threads.len()
    }

    pub fn record(&mut self, record: &SchedRecord, time_ns: u64, out: &mut Vec<Event>) {
        match record.kind {
            SCHED_SWITCH => self.switch(record, time_ns, out),
            SCHED_WAKEUP => {
                if let Some(off) = self.off_cpu.get_mut(&record.next_tid) {
                    off.waker_tid = record.prev_tid;
                }
            }
            SCHED_EXEC => {
                self.name_thread(record.prev_tid, record.prev_pid, &record.prev_comm);
                self.instant(record.prev_tid, time_ns, self.exec_name, out);
            }
            SCHED_EXIT => {
                self.instant(record.prev_tid, time_ns, self.exit_name, out);
                self.off_cpu.remove(&record.prev_tid);
                self.threads.remove(&record.prev_tid);
            }
            _ => {}
        }
    }

    fn switch(&mut self, r: &SchedRecord, now: u64, out: &mut Vec<Event>) {
        let first_on_cpu = self.cpus_seen.insert(r.cpu);
        if first_on_cpu {
            self.registry.name_line(
                Device::HostCpus,
                u64::from(r.cpu),
                &cpu_line_name(u64::from(r.cpu)),
            );
        }
        if r.matched & MATCH_PREV != 0 {
            let name = self.name_thread(r.prev_tid, r.prev_pid, &r.prev_comm);
            let since = match self.running.remove(&r.cpu) {
                Some(running) if running.tid == r.prev_tid => Some(running.since_ns),
                // Running since before recording began.
                None if first_on_cpu => Some(self.attached_ns),
                // A record was lost or filtered out: the start is unknown.
                _ => None,
            };
            if let Some(since) = since.filter(|since| *since < now) {
                out.push(Event::new(
                    since,
                    now - since,
                    Device::HostCpus,
                    u64::from(r.cpu),
                    name,
                    Payload::CpuSlice {
                        pid: r.prev_pid,
                        tid: r.prev_tid,
                        cpu: r.cpu,
                        end_state: r.prev_state,
                    },
                ));
            }
            if r.prev_state & EXITED != 0 {
                // Its last switch: the thread is gone, not waiting.
                self.threads.remove(&r.prev_tid);
            } else {
                self.off_cpu.insert(
                    r.prev_tid,
                    OffCpu {
                        pid: r.prev_pid,
                        since_ns: now,
                        state: r.prev_state,
                        waker_tid: 0,
                    },
                );
            }
        } else {
            self.running.remove(&r.cpu);
        }
        if r.matched & MATCH_NEXT != 0 {
            let name = self.name_thread(r.next_tid, r.next_pid, &r.next_comm);
            self.running.insert(
                r.cpu,
                Running {
                    tid: r.next_tid,
                    pid: r.next_pid,
                    name,
                    since_ns: now,
                },
            );
            if let Some(off) = self.off_cpu.remove(&r.next_tid) {
                self.push_off_cpu(r.next_tid, &off, now, out);
            }
        }
    }

    /// Emits what is open up to `now_ns` and continues it from there.
    pub fn split(&mut self, now_ns: u64, out: &mut Vec<Event>) {
        for (cpu, running) in self.running.iter_mut() {
            if running.since_ns < now_ns {
                out.push(Event::new(
                    running.since_ns,
                    now_ns - running.since_ns,
                    Device::HostCpus,
                    u64::from(*cpu),
                    running.name,
                    Payload::CpuSlice {
                        pid: running.pid,
                        tid: running.tid,
                        cpu: *cpu,
                        end_state: STILL_RUNNING,
                    },
                ));
                running.since_ns = now_ns;
            }
        }
        let open: Vec<u32> = self.off_cpu.keys().copied().collect();
        for tid in open {
            if let Some(off) = self.off_cpu.get(&tid) {
                if off.since_ns < now_ns {
                    let piece = OffCpu { ..*off };
                    self.push_off_cpu(tid, &piece, now_ns, out);
                    if let Some(off) = self.off_cpu.get_mut(&tid) {
                        off.since_ns = now_ns;
                    }
                }
            }
        }
    }

    fn push_off_cpu(&mut self, tid: u32, off: &OffCpu, until: u64, out: &mut Vec<Event>) {
        if off.since_ns >= until {
            return;
        }
        let name = *self.state_names.entry(off.state).or_insert_with(|| {
            self.registry
                .intern(&format!("{OFF_CPU_PREFIX}{}", task_state_label(off.state)))
        });
        out.push(Event::new(
            off.since_ns,
            until - off.since_ns,
            Device::HostCpus,
            THREAD_LINE_BIT | u64::from(tid),
            name,
            Payload::OffCpu {
                pid: off.pid,
                tid,
                state: off.state,
                waker_tid: off.waker_tid,
            },
        ));
    }

    fn instant(&self, tid: u32, now: u64, name: NameId, out: &mut Vec<Event>) {
        out.push(Event::new(
            now,
            0,
            Device::HostCpus,
            THREAD_LINE_BIT | u64::from(tid),
            name,
            Payload::Plain,
        ));
    }

    /// The interned command name; names the thread's line when it is new or
    /// renamed.
    fn name_thread(&mut self, tid: u32, pid: u32, comm: &[u8; COMM_LEN]) -> NameId {
        let known = self
            .threads
            .get(&tid)
            .is_some_and(|t| t.comm == *comm && t.pid == pid);
        if !known {
            let text = c_str(comm);
            self.registry.name_line(
                Device::HostCpus,
                THREAD_LINE_BIT | u64::from(tid),
                &format!("{text} {tid} (pid {pid})"),
            );
            self.threads.insert(tid, Thread { comm: *comm, pid });
        }
        *self
            .comm_names
            .entry(*comm)
            .or_insert_with(|| self.registry.intern(&c_str(comm)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(name: &str) -> [u8; COMM_LEN] {
        let mut out = [0u8; COMM_LEN];
        out[..name.len()].copy_from_slice(name.as_bytes());
        out
    }

    fn switch(cpu: u32, prev: (u32, &str), state: u32, next: (u32, &str)) -> SchedRecord {
        SchedRecord {
            time_ns: 0,
            kind: SCHED_SWITCH,
            cpu,
            prev_tid: prev.0,
            prev_pid: prev.0,
            next_tid: next.0,
            next_pid: next.0,
            prev_state: state,
            matched: (if prev.0 != 0 { MATCH_PREV } else { 0 })
                | (if next.0 != 0 { MATCH_NEXT } else { 0 }),
            prev_comm: comm(prev.1),
            next_comm: comm(next.1),
        }
    }

    fn slices(events: &[Event], registry: &Registry) -> Vec<(u64, u64, u64, String)> {
        let snapshot = registry.snapshot();
        events
            .iter()
            .map(|e| {
                (
                    e.line,
                    e.start_ns,
                    e.duration_ns,
                    snapshot.name(e.name()).to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn switches_become_cpu_slices_and_off_cpu_spans() {
        let registry = Registry::new();
        let mut timeline = SchedTimeline::new(Arc::clone(&registry));
        timeline.restart(1_000);
        let mut out = Vec::new();
        // CPU 0: "a" ran since before recording, sleeps at 1500; "b" runs
        // until 1800 and is preempted; "a", woken by "b", runs again.
        timeline.record(&switch(0, (10, "a"), 1, (20, "b")), 1_500, &mut out);
        let mut wakeup = switch(0, (20, "b"), 0, (10, "a"));
        wakeup.kind = SCHED_WAKEUP;
        timeline.record(&wakeup, 1_700, &mut out);
        timeline.record(&switch(0, (20, "b"), 0, (10, "a")), 1_800, &mut out);
        let got = slices(&out, &registry);
        assert_eq!(
            got,
            vec![
                (0, 1_000, 500, "a".into()),
                (0, 1_500, 300, "b".into()),
                (
                    THREAD_LINE_BIT | 10,
                    1_500,
                    300,
                    "off-CPU: S (sleeping)".into()
                ),
            ]
        );
        assert_eq!(
            out[2].payload(),
            Payload::OffCpu {
                pid: 10,
                tid: 10,
                state: 1,
                waker_tid: 20
            }
        );
        let snapshot = registry.snapshot();
        assert_eq!(snapshot.line_name(Device::HostCpus, 0), Some("CPU 0"));
        assert_eq!(
            snapshot.line_name(Device::HostCpus, THREAD_LINE_BIT | 20),
            Some("b 20 (pid 20)")
        );
    }

    #[test]
    fn open_slices_are_cut_at_ticks_and_unknown_starts_are_skipped() {
        let registry = Registry::new();
        let mut timeline = SchedTimeline::new(Arc::clone(&registry));
        timeline.restart(0);
        let mut out = Vec::new();
        timeline.record(&switch(1, (0, "swapper/1"), 0, (30, "spin")), 100, &mut out);
        timeline.split(400, &mut out);
        timeline.record(&switch(1, (30, "spin"), 0, (0, "swapper/1")), 700, &mut out);
        let got = slices(&out, &registry);
        assert_eq!(
            got,
            vec![(1, 100, 300, "spin".into()), (1, 400, 300, "spin".into())]
        );
        assert_eq!(
            out[0].payload(),
            Payload::CpuSlice {
                pid: 30,
                tid: 30,
                cpu: 1,
                end_state: STILL_RUNNING
            }
        );
        // CPU 1 is known now: a thread switching out that nobody saw switch
        // in (its record lost) gives no slice rather than a wrong one.
        out.clear();
        timeline.record(
            &switch(1, (31, "other"), 1, (0, "swapper/1")),
            900,
            &mut out,
        );
        assert!(out.iter().all(|e| e.line != 1), "{out:?}");
        // Exit forgets the thread.
        let mut exit = switch(1, (30, "spin"), 0, (30, "spin"));
        exit.kind = SCHED_EXIT;
        timeline.record(&exit, 1_000, &mut out);
        assert!(!timeline.threads.contains_key(&30));
        assert!(!timeline.off_cpu.contains_key(&30));
    }
}
