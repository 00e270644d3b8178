//! The agent's own attaching (`serve --cuda-attach`): a thread that looks
//! at the host's processes every second and attaches to each that matches
//! a rule once it maps the CUDA driver. A process is judged once per
//! program it runs (by pid, start time and executable, so that a reused
//! pid, and a process that execs another program, as a launcher script's
//! `exec python train.py` does, are judged anew); one matching a rule is
//! looked at again until it maps the driver or ends. Outcomes are
//! logged, failures once per process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::rules::{Rule, Seen};
use super::{attach, AttachConfig, AttachError};
use crate::backend::ebpf::cuda::is_driver_library;
use crate::model::host_process;

/// How often the processes are looked at.
const EVERY: Duration = Duration::from_secs(1);
/// Processes matching a rule that are waited for at once (to map the
/// driver), at most.
const MAX_WAITING: usize = 4096;

/// A process running one program: pid, start time, and the executable's
/// (device, inode).
type Key = (i32, u64, (u64, u64));

/// What became of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Judged {
    /// No rule matches it.
    Ignored,
    /// A rule matches; it has not mapped the driver yet.
    Waiting,
    /// Attached, refused or failed: not tried again.
    Done,
}

/// The watcher's thread; stopped when dropped.
pub struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    pub fn start(rules: Vec<Rule>, config: AttachConfig) -> std::io::Result<Watcher> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("cuda-attach".into())
            .spawn(move || {
                let mut judged: HashMap<Key, Judged> = HashMap::new();
                while !stopping.load(Ordering::Relaxed) {
                    look(&rules, &config, &mut judged);
                    std::thread::sleep(EVERY);
                }
            })?;
        Ok(Watcher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One look at every process.
fn look(rules: &[Rule], config: &AttachConfig, judged: &mut HashMap<Key, Judged>) {
    let own = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    let mut alive = Vec::new();
    for pid in entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()) {
        let Some(started) = start_time(pid) else {
            continue;
        };
        let key = (pid, started, executable(pid));
        alive.push(key);
        if pid == own || matches!(judged.get(&key), Some(Judged::Ignored | Judged::Done)) {
            continue;
        }
        let Some(seen) = seen(pid) else { continue };
        let Some(rule) = rules.iter().find(|rule| rule.matches(&seen)) else {
            judged.insert(key, Judged::Ignored);
            continue;
        };
        if !maps_driver(pid) {
            let waiting = judged.values().filter(|j| **j == Judged::Waiting).count();
            if waiting < MAX_WAITING || judged.contains_key(&key) {
                judged.insert(key, Judged::Waiting);
            }
            continue;
        }
        judged.insert(key, Judged::Done);
        match attach(pid, config) {
            Ok(attached) => info!(
                pid,
                comm = %seen.comm,
                %rule,
                stopped_ms = attached.stopped_for.as_secs_f64() * 1e3,
                loaded_ms = attached.loaded_in.as_secs_f64() * 1e3,
                "attached the injection library (--cuda-attach)"
            ),
            Err(AttachError::AlreadyInjected) => {}
            Err(error) => {
                warn!(pid, comm = %seen.comm, %rule, %error, "--cuda-attach: not attached")
            }
        }
    }
    alive.sort_unstable();
    judged.retain(|key, _| alive.binary_search(key).is_ok());
}

/// The (device, inode) of the program process `pid` runs; (0, 0) where it
/// cannot be read (kernel threads).
fn executable(pid: i32) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/exe")).map_or((0, 0), |exe| (exe.dev(), exe.ino()))
}

fn start_time(pid: i32) -> Option<u64> {
    host_process::start_ticks(u32::try_from(pid).ok()?)
}

/// What the rules look at of process `pid`.
fn seen(pid: i32) -> Option<Seen> {
    let [uid, _, _] = host_process::uids(u32::try_from(pid).ok()?)?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let cgroup = cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or("")
        .to_string();
    Some(Seen {
        comm: comm.trim_end().to_string(),
        cmdline: cmdline.join(" "),
        uid,
        user: crate::repository::acting::user_name(uid),
        cgroup,
    })
}

fn maps_driver(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| {
        maps.lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .any(is_driver_library)
    })
}
