//! Workload processes as the host sees them, whichever pid namespace they
//! run in.
//!
//! A workload in a container knows itself by the pid its namespace gives it
//! (often 1), and so does everything it writes. The agent runs in the host's
//! namespace (`hostPID` for a DaemonSet) and needs the host's pid to watch
//! the process and the host's thread ids to put its calls on the lines the
//! other backends use. The link between the two is a file lock: a process
//! holds a shared `flock` on each file it shares with the agent for as long
//! as it lives, the host's `/proc/locks` names each lock's holder by its pid
//! in the reader's namespace (and leaves out holders the reader's namespace
//! cannot see), and the holder's `NSpid` line says which pid its own
//! namespace gives it. The same lock tells whether a file is still in use
//! without knowing any pid at all, which is what stale-file cleanup needs.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// `/proc/locks` is read up to this size: one line per lock on the host.
const MAX_LOCKS_BYTES: u64 = 16 << 20;

/// Threads of one process looked up by their namespace's ids, at most.
const MAX_THREADS: usize = 1 << 16;

pub use devtrace_shm::lock::{abandoned, hold_shared, in_use, open_to_ask};

/// The pids (in this process's namespace) of the processes holding `flock`
/// locks on the file `(dev, ino)`; a 0 stands for a holder in a pid
/// namespace this process cannot see.
pub fn lock_holders(dev: u64, ino: u64) -> io::Result<Vec<u32>> {
    let mut text = String::new();
    File::open("/proc/locks")?
        .take(MAX_LOCKS_BYTES)
        .read_to_string(&mut text)?;
    Ok(holders_in(&text, dev, ino))
}

/// The holders of `(dev, ino)` in the text of `/proc/locks`: lines like
/// `1: FLOCK  ADVISORY  READ 4242 fe:00:10010655 0 EOF`, where the device
/// is `major:minor` in hex. Waiters (`1: -> FLOCK ...`) hold nothing.
fn holders_in(text: &str, dev: u64, ino: u64) -> Vec<u32> {
    let file = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    let mut holders = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, kind, _, _, pid, at, ..] = fields.as_slice() else {
            continue;
        };
        if *kind != "FLOCK" || *at != file {
            continue;
        }
        if let Ok(pid) = pid.parse::<u32>() {
            if !holders.contains(&pid) {
                holders.push(pid);
            }
        }
    }
    holders
}

/// What `/proc/<pid>/status` says of a process's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessStatus {
    /// Real and effective uid, as the reader's user namespace maps them.
    pub uids: [u32; 2],
    /// Its pid in each pid namespace from the reader's down to its own.
    pub nspids: Vec<u32>,
}

impl ProcessStatus {
    pub fn read(pid: u32) -> Option<ProcessStatus> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        ProcessStatus::parse(&text)
    }

    pub fn parse(text: &str) -> Option<ProcessStatus> {
        let field = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(|rest| rest.split_whitespace().map(|v| v.parse::<u32>().ok()))
        };
        let mut uids = field("Uid")?;
        let uids = [uids.next()??, uids.next()??];
        // Kernels before 4.1 have no NSpid line: one namespace then.
        let nspids = match field("NSpid") {
            Some(ids) => ids.collect::<Option<Vec<u32>>>()?,
            None => vec![field("Pid")?.next()??],
        };
        (!nspids.is_empty()).then_some(ProcessStatus { uids, nspids })
    }

    /// The pid the process's own namespace gives it.
    pub fn own_pid(&self) -> u32 {
        self.nspids.last().copied().unwrap_or(0)
    }

    /// Whether it runs in the reader's pid namespace.
    pub fn in_readers_namespace(&self) -> bool {
        self.nspids.len() == 1
    }
}

/// Why no process could be found for a shared file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotFound {
    #[error("no process holds its lock: the process that made it has exited")]
    Unheld,
    #[error(
        "the process holding it is in a pid namespace this agent cannot see; run the agent in \
         the host's pid namespace (hostPID: true in Kubernetes, --pid=host for a container)"
    )]
    Hidden,
    #[error("it names process {pid} as its maker, but {holders}")]
    Others { pid: u32, holders: String },
    #[error("/proc/locks cannot be read: {0}")]
    Unreadable(String),
}

/// The host pid of the process that holds a lock on the file at `path`,
/// `(dev, ino)`, owned by `owner`, and that its own namespace calls `own_pid`.
pub fn holder_of(
    path: &Path,
    (dev, ino): (u64, u64),
    owner: u32,
    own_pid: u32,
) -> Result<u32, NotFound> {
    let holders =
        lock_holders(dev, ino).map_err(|error| NotFound::Unreadable(error.to_string()))?;
    let mut others = Vec::new();
    for &pid in &holders {
        if pid == 0 {
            continue;
        }
        let Some(status) = ProcessStatus::read(pid) else {
            continue;
        };
        if status.own_pid() == own_pid && status.uids.contains(&owner) {
            return Ok(pid);
        }
        others.push(format!(
            "process {pid} (pid {} in its namespace, uid {}) holds it",
            status.own_pid(),
            status.uids[0]
        ));
    }
    if !others.is_empty() {
        return Err(NotFound::Others {
            pid: own_pid,
            holders: others.join(", "),
        });
    }
    // Holders this namespace cannot see are left out of /proc/locks (or, on
    // kernels before 4.15, listed as pid 0); the lock itself still shows.
    let hidden = holders.contains(&0) || held_at(path, (dev, ino));
    Err(if hidden {
        NotFound::Hidden
    } else {
        NotFound::Unheld
    })
}

/// Whether the file at `path` is still `(dev, ino)` and some process holds
/// a lock on it.
fn held_at(path: &Path, (dev, ino): (u64, u64)) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(file) = open_to_ask(path) else {
        return false;
    };
    let same = file
        .metadata()
        .is_ok_and(|meta| (meta.dev(), meta.ino()) == (dev, ino));
    same && matches!(in_use(&file), Ok(true))
}

/// The host's ids of one process's threads, looked up by the ids its own
/// namespace gives them.
#[derive(Debug, Default)]
pub struct Threads {
    host_of: HashMap<u32, u32>,
}

impl Threads {
    /// The threads of `host_pid`, which its namespace calls `own_pid`, as
    /// they are now: read while the process runs, for the calls of threads
    /// that end before their events are read. Its main thread's ids are
    /// its pids, whatever happens to it.
    pub fn of(host_pid: u32, own_pid: u32) -> Threads {
        let mut threads = Threads::default();
        threads.refresh(host_pid);
        threads.host_of.insert(own_pid, host_pid);
        threads
    }

    /// The host's id of the thread of `host_pid` that its namespace calls
    /// `own_tid`, reading the process's threads again when it is not known
    /// (a thread started since); `None` for a thread it does not have.
    pub fn host_tid(&mut self, host_pid: u32, own_tid: u32) -> Option<u32> {
        if let Some(tid) = self.host_of.get(&own_tid) {
            return Some(*tid);
        }
        self.refresh(host_pid);
        self.host_of.get(&own_tid).copied()
    }

    fn refresh(&mut self, host_pid: u32) {
        // What was learnt stays: ids of threads that ended are not reused
        // until the namespace's pids wrap.
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{host_pid}/task")) else {
            return;
        };
        for task in tasks.flatten().take(MAX_THREADS) {
            if self.host_of.len() >= MAX_THREADS {
                break;
            }
            let status = Path::new(&task.path()).join("status");
            let Some(status) = std::fs::read_to_string(status)
                .ok()
                .and_then(|text| ProcessStatus::parse(&text))
            else {
                continue;
            };
            if let (Some(host), Some(own)) = (status.nspids.first(), status.nspids.last()) {
                self.host_of.insert(*own, *host);
            }
        }
    }
}

/// Process `pid`'s real, effective and saved uids.
pub fn uids(pid: u32) -> Option<[u32; 3]> {
    credentials(pid).map(|credentials| credentials.uids)
}

/// The user a process runs as when its real, effective and saved `uids`
/// are one (not a set-user-ID program between its users).
pub fn sole_uid(uids: [u32; 3]) -> Option<u32> {
    match uids {
        [real, effective, saved] if real == effective && effective == saved => Some(real),
        _ => None,
    }
}

/// What the kernel holds of a process's identity, from `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// Real, effective and saved uids.
    pub uids: [u32; 3],
    /// Real, effective and saved gids.
    pub gids: [u32; 3],
    /// The capabilities it may use (`CapPrm`).
    pub capabilities: u64,
    /// The capabilities in effect (`CapEff`).
    pub effective_capabilities: u64,
}

pub fn credentials(pid: u32) -> Option<Credentials> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_credentials(&status)
}

fn parse_credentials(status: &str) -> Option<Credentials> {
    let ids = |key: &str| -> Option<[u32; 3]> {
        let mut fields = status
            .lines()
            .find_map(|line| line.strip_prefix(key))?
            .split_whitespace()
            .map(|field| field.parse::<u32>().ok());
        Some([fields.next()??, fields.next()??, fields.next()??])
    };
    let mask = |key: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
    };
    Some(Credentials {
        uids: ids("Uid:")?,
        gids: ids("Gid:")?,
        capabilities: mask("CapPrm:")?,
        effective_capabilities: mask("CapEff:")?,
    })
}

/// Whether process `pid` may be inspected by its own user: the kernel hands
/// the `/proc` files of a process that is not dumpable
/// (`prctl(PR_SET_DUMPABLE, 0)`, or one that changed credentials) to root
/// (its `/proc/<pid>` directory keeps its owner).
pub fn dumpable(pid: u32, euid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/status")).is_ok_and(|file| file.uid() == euid)
}

/// When process `pid` started, in clock ticks since boot (`USER_HZ`, 100
/// a second): with the pid, it names the process even after the pid is
/// reused.
pub fn start_ticks(pid: u32) -> Option<u64> {
    parse_start_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether the process that had `pid` and started at `started` clock
/// ticks after boot ([`start_ticks`]) still runs: it has not exited, is
/// not a zombie, and its pid was not taken since by another process.
pub fn still_runs(pid: u32, started: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => parse_start_ticks(&stat) == Some(started) && crate::ring::alive_in_stat(&stat),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => false,
        // Not readable now (out of file descriptors, say): a live process
        // must not be taken for gone, so the pid alone decides.
        Err(_) => crate::ring::pid_alive(pid),
    }
}

/// The start time in a `/proc/<pid>/stat` text.
pub fn parse_start_ticks(stat: &str) -> Option<u64> {
    // The command name may hold spaces and parentheses: fields count from
    // the last ')'.
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_runs_while_its_pid_names_it() {
        let me = std::process::id();
        let started = start_ticks(me).expect("this process's start");
        assert!(still_runs(me, started));
        // The same pid started at another moment: another process.
        assert!(!still_runs(me, started + 1));

        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let started = start_ticks(pid).expect("the child's start");
        assert!(still_runs(pid, started));
        child.kill().expect("kill");
        // Killed but not reaped: a zombie, which runs no more.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while still_runs(pid, started) {
            assert!(std::time::Instant::now() < deadline, "{pid} still runs");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().expect("reaped");
        assert!(!still_runs(pid, started));
    }

    #[test]
    fn credentials_are_read_from_the_status_text() {
        let status = "Name:\tpython3\nUid:\t1001\t1001\t1001\t1001\nGid:\t1001\t27\t1001\t1001\n\
                      CapInh:\t0000000000000000\nCapPrm:\t0000000000200000\nCapEff:\t0000000000000000\n";
        assert_eq!(
            parse_credentials(status),
            Some(Credentials {
                uids: [1001, 1001, 1001],
                gids: [1001, 27, 1001],
                capabilities: 1 << 21,
                effective_capabilities: 0,
            })
        );
        assert_eq!(parse_credentials("Uid:\t1\t1\t1\t1\n"), None);
    }

    #[test]
    fn this_process_is_dumpable_by_its_user() {
        let pid = std::process::id();
        let euid = credentials(pid).unwrap().uids[1];
        assert!(dumpable(pid, euid));
        assert!(!dumpable(pid, euid.wrapping_add(1)));
    }

    use std::os::unix::fs::MetadataExt;

    #[test]
    fn lock_lines_give_the_holders_of_one_file() {
        let text = "\
1: FLOCK  ADVISORY  READ 4242 fe:00:10010655 0 EOF
1: -> FLOCK  ADVISORY  WRITE 4343 fe:00:10010655 0 EOF
2: FLOCK  ADVISORY  READ 0 fe:00:10010655 0 EOF
3: POSIX  ADVISORY  WRITE 77 fe:00:10010655 0 EOF
4: FLOCK  ADVISORY  READ 88 fe:01:10010655 0 EOF
5: OFDLCK ADVISORY  READ -1 fe:00:10010655 0 EOF
6: FLOCK  ADVISORY  READ 4242 fe:00:10010655 0 EOF
";
        let dev = libc::makedev(0xfe, 0);
        assert_eq!(holders_in(text, dev, 10010655), vec![4242, 0]);
        assert_eq!(holders_in(text, dev, 1), Vec::<u32>::new());
    }

    #[test]
    fn status_gives_uids_and_the_pid_of_each_namespace() {
        let text = "Name:\tpython\nPid:\t4242\nUid:\t1000\t1001\t1000\t1000\nNSpid:\t4242\t7\t1\n";
        let status = ProcessStatus::parse(text).unwrap();
        assert_eq!(status.uids, [1000, 1001]);
        assert_eq!(status.nspids, vec![4242, 7, 1]);
        assert_eq!(status.own_pid(), 1);
        assert!(!status.in_readers_namespace());
        let old_kernel = ProcessStatus::parse("Pid:\t9\nUid:\t0\t0\t0\t0\n").unwrap();
        assert_eq!(old_kernel.nspids, vec![9]);
        assert_eq!(ProcessStatus::parse("Pid:\t9\nUid:\tx\n"), None);
    }

    #[test]
    fn a_held_lock_names_this_process_and_marks_the_file_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("held");
        let file = File::create(&path).unwrap();
        assert!(!in_use(&File::open(&path).unwrap()).unwrap());
        hold_shared(&file).unwrap();
        assert!(in_use(&File::open(&path).unwrap()).unwrap());
        let meta = std::fs::metadata(&path).unwrap();
        let me = std::process::id();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let own_pid = ProcessStatus::read(me).unwrap().own_pid();
        let at = (meta.dev(), meta.ino());
        assert_eq!(holder_of(&path, at, uid, own_pid), Ok(me));
        assert!(matches!(
            holder_of(&path, at, uid, own_pid + 1),
            Err(NotFound::Others { .. })
        ));
        drop(file);
        assert!(!in_use(&File::open(&path).unwrap()).unwrap());
        assert_eq!(holder_of(&path, at, uid, own_pid), Err(NotFound::Unheld));
    }

    #[test]
    fn this_process_threads_map_to_themselves_in_one_namespace() {
        let me = std::process::id();
        let mut threads = Threads::default();
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        if ProcessStatus::read(me).unwrap().in_readers_namespace() {
            assert_eq!(threads.host_tid(me, tid), Some(tid));
        }
        assert_eq!(threads.host_tid(me, u32::MAX), None);
    }
}
