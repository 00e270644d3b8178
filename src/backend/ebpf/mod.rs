//! The eBPF backend: kernel hooks that see every process on the host with
//! no change to any workload. Scheduler tracepoints give a `/host:CPUs`
//! plane (which thread ran on which CPU, and each thread's off-CPU time);
//! uprobes on the CUDA driver library give every driver call of every
//! process that loaded it, with its arguments, on that process's thread lines
//! in `/host:CPU`, and its allocations for the memory profile.
//!
//! The programs are loaded (and checked by the verifier) when the backend
//! starts, so a kernel that refuses them is reported at once; they are
//! attached while a capture runs, or always with [`AttachMode::Always`].

mod coverage;
pub(crate) mod cuda;
#[cfg(devtrace_bpf)]
mod programs;
#[cfg(devtrace_bpf)]
mod reaper;
pub(crate) mod records;
pub(crate) mod sched;
#[cfg(devtrace_bpf)]
mod uprobes;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::worker::Worker;
use super::{Backend, BackendContext, BackendError, Capabilities, Health, Loss};

pub use cuda::{find_driver_libraries, CudaReturns, DriverLibrary, CUDA_PROBES};

/// When the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// Only while a capture (or continuous session) runs: no cost otherwise,
    /// but the first few milliseconds of a window may be missed.
    Capture,
    /// From agent start, so snapshots of the past include kernel events.
    Always,
}

#[derive(Clone, Debug)]
pub struct EbpfConfig {
    /// Trace scheduler switches, wakeups, exec and exit.
    pub sched: bool,
    /// Probe the CUDA driver library's entry points.
    pub cuda: bool,
    /// Which probed driver calls also get a return probe.
    pub cuda_returns: CudaReturns,
    pub attach: AttachMode,
    /// Only these processes (none = all).
    pub pids: Vec<u32>,
    /// Only this cgroup v2 (its id, the inode of its directory).
    pub cgroup_id: Option<u64>,
    /// Only threads whose command name starts with this (15 bytes at most).
    pub comm: Option<String>,
    /// Driver libraries to probe besides those found in processes' maps.
    pub cuda_libraries: Vec<PathBuf>,
    /// Processes a driver library is probed in one by one at most, beside
    /// those the injection library records (`None`: by how this kernel
    /// links probes).
    pub probe_alone_max: Option<usize>,
    /// Where processes are listed (`/proc`).
    pub proc_root: PathBuf,
    /// How often processes' maps are searched for new driver libraries.
    pub rescan_interval: Duration,
    /// How often open CPU slices and off-CPU spans are cut and sent.
    pub split_interval: Duration,
    /// Bytes of each BPF ring buffer (a power of two, at least a page).
    pub ring_bytes: u32,
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            sched: true,
            cuda: true,
            cuda_returns: CudaReturns::Needed,
            attach: AttachMode::Capture,
            pids: Vec::new(),
            cgroup_id: None,
            comm: None,
            cuda_libraries: Vec::new(),
            probe_alone_max: None,
            proc_root: PathBuf::from("/proc"),
            rescan_interval: Duration::from_secs(1),
            split_interval: Duration::from_millis(250),
            ring_bytes: 4 << 20,
        }
    }
}

impl EbpfConfig {
    /// Whether some thread of process `pid`, as listed under `proc_root`
    /// now, passes the process and command-name filters the programs
    /// apply (the cgroup filter is left to them): a process none of whose
    /// threads would be recorded need not be probed on its own. A thread
    /// renamed later is seen at the next look; a process whose threads
    /// cannot be listed is taken to pass.
    pub(crate) fn may_record(&self, pid: u32) -> bool {
        if !self.pids.is_empty() && !self.pids.contains(&pid) {
            return false;
        }
        let Some(prefix) = &self.comm else {
            return true;
        };
        let prefix = &prefix.as_bytes()[..prefix.len().min(15)];
        let Ok(threads) = std::fs::read_dir(self.proc_root.join(pid.to_string()).join("task"))
        else {
            return true;
        };
        threads.flatten().any(|thread| {
            std::fs::read(thread.path().join("comm")).is_ok_and(|comm| comm.starts_with(prefix))
        })
    }
}

/// The cgroup id the kernel reports for the cgroup v2 directory `path`.
pub fn cgroup_id(path: &std::path::Path) -> std::io::Result<u64> {
    use crate::model::filesystem::Filesystem;
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)?;
    // Any other directory's inode is no cgroup's id: the filter would
    // match nothing, and the backend record nothing, without a word.
    let cgroup2 = meta.is_dir() && Filesystem::of(path).is_ok_and(|fs| fs == Filesystem::Cgroup2);
    if !cgroup2 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} is not a cgroup v2 directory (such as /sys/fs/cgroup/<slice>)",
                path.display()
            ),
        ));
    }
    Ok(meta.ino())
}

/// What the backend thread reports about itself.
#[derive(Debug, Default)]
pub(crate) struct Status {
    attached: bool,
    /// When the hooks were attached, for the windows they missed.
    coverage: coverage::Coverage,
    /// Probed driver libraries and the functions missing from each.
    /// By (device, inode), with the path each was first probed through.
    libraries: Vec<((u64, u64), String, Vec<&'static str>)>,
    /// Processes mapping a driver library that the injection library
    /// records, so not probed.
    library_processes: usize,
    /// More processes to probe one by one than [`programs`] does (how
    /// many): a library is probed in every process then.
    crowded: Option<usize>,
    losses: [u64; 3],
    events: u64,
    malformed: u64,
    threads: usize,
    error: Option<String>,
}

pub struct EbpfBackend {
    config: EbpfConfig,
    status: Arc<Mutex<Status>>,
    worker: Option<Worker>,
}

impl EbpfBackend {
    pub fn new(config: EbpfConfig) -> EbpfBackend {
        EbpfBackend {
            config,
            status: Arc::default(),
            worker: None,
        }
    }

    fn unavailable(reason: impl Into<String>) -> BackendError {
        BackendError::Unavailable {
            backend: "ebpf",
            reason: reason.into(),
        }
    }

    fn preflight(&self) -> Result<(), BackendError> {
        preflight(self.config.sched, self.config.cuda).map_err(Self::unavailable)
    }
}

/// Reasons the kernel cannot run the programs, found before trying (also
/// `devtrace doctor`'s check).
pub(crate) fn preflight(sched: bool, cuda: bool) -> Result<(), &'static str> {
    if !cfg!(devtrace_bpf) {
        return Err(
            "this devtrace was built without its BPF programs (clang was not found at build \
             time); install clang and rebuild",
        );
    }
    if !sched && !cuda {
        return Err("both scheduler tracing and CUDA probes are off");
    }
    if !std::path::Path::new(BTF).exists() {
        return Err(
            "the kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing; it needs \
             CONFIG_DEBUG_INFO_BTF=y)",
        );
    }
    Ok(())
}

/// How this kernel links the CUDA driver's probes, in words (for `devtrace
/// doctor`); `None` in a build without the BPF programs.
pub(crate) fn probe_linking() -> Option<String> {
    #[cfg(devtrace_bpf)]
    {
        Some(uprobes::Linking::of_this_kernel().describe())
    }
    #[cfg(not(devtrace_bpf))]
    {
        None
    }
}

/// Where the kernel's BTF is read from.
pub(crate) const BTF: &str = "/sys/kernel/btf/vmlinux";

impl Backend for EbpfBackend {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn capabilities(&self) -> Capabilities {
        let mut records = Vec::new();
        if self.config.sched {
            records.push("CPU scheduling");
        }
        if self.config.cuda {
            records.push("CUDA driver calls");
        }
        Capabilities {
            records,
            // Open slices are cut every split interval; one poll on top.
            max_delay: self.config.split_interval + Duration::from_millis(100),
            held_until_asked: std::time::Duration::ZERO,
        }
    }

    #[cfg(devtrace_bpf)]
    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        self.preflight()?;
        self.status.lock().coverage = coverage::Coverage::since(crate::clock::now_ns());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let config = self.config.clone();
        let status = Arc::clone(&self.status);
        let worker = Worker::spawn("ebpf", move |stop| {
            programs::run(config, context, status, ready_tx, stop)
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {
                self.worker = Some(worker);
                Ok(())
            }
            Ok(Err(reason)) => {
                worker.stop();
                Err(Self::unavailable(reason))
            }
            Err(_) => {
                worker.stop();
                Err(BackendError::Start {
                    backend: "ebpf",
                    reason: "the backend thread ended while loading".into(),
                })
            }
        }
    }

    #[cfg(not(devtrace_bpf))]
    fn start(&mut self, _context: BackendContext) -> Result<(), BackendError> {
        self.preflight()
    }

    fn stop(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop();
        }
    }

    fn health(&self) -> Health {
        if let Some(health) = Worker::not_running(self.worker.as_ref(), "eBPF backend") {
            return health;
        }
        let status = self.status.lock();
        let mut parts = Vec::new();
        parts.push(if status.attached {
            "attached".to_string()
        } else {
            format!(
                "loaded, attaching {}",
                match self.config.attach {
                    AttachMode::Capture => "during captures",
                    AttachMode::Always => "now",
                }
            )
        });
        if self.config.sched {
            parts.push("scheduler".into());
        }
        if self.config.cuda {
            let libraries: Vec<String> = status
                .libraries
                .iter()
                .map(|(_, path, missing)| {
                    format!(
                        "{path} ({} of {} entry points)",
                        CUDA_PROBES.len() - missing.len(),
                        CUDA_PROBES.len()
                    )
                })
                .collect();
            parts.push(if libraries.is_empty() {
                "CUDA probes: no driver library mapped yet".into()
            } else {
                format!("CUDA probes on {}", libraries.join(", "))
            });
            if status.library_processes > 0 {
                let count = status.library_processes;
                let plural = if count == 1 { "" } else { "es" };
                parts.push(format!(
                    "{count} process{plural} left unprobed to the injection library"
                ));
            }
            if let Some(count) = status.crowded {
                parts.push(format!(
                    "{count} processes to probe one by one, too many: their driver library is \
                     probed in every process, those the injection library records too"
                ));
            }
        }
        parts.push(format!("{} events", status.events));
        let lost: u64 = status.losses.iter().sum();
        if lost > 0 {
            parts.push(format!("{lost} records lost"));
        }
        if status.malformed > 0 {
            parts.push(format!("{} malformed records", status.malformed));
        }
        if let Some(error) = &status.error {
            parts.push(format!("last error: {error}"));
        }
        Health::Running {
            detail: parts.join("; "),
        }
    }

    /// Which CUDA calls have a duration and result, so that a trace whose
    /// launches are instants says why.
    fn properties(
        &self,
        _window: crate::recorder::Window,
        _scope: crate::backend::Scope,
    ) -> Vec<(String, String)> {
        if !self.config.cuda {
            return Vec::new();
        }
        let returns = match self.config.cuda_returns {
            CudaReturns::Needed => {
                "needed: launches and asynchronous copies are instants at their entry, \
                 without API duration or result (--ebpf-cuda-returns all records them)"
            }
            CudaReturns::All => "all: every probed call has its duration and result",
        };
        vec![
            ("devtrace_ebpf_cuda_returns".into(), returns.into()),
            (
                "devtrace_ebpf_cuda_probes".into(),
                match self.config.attach {
                    AttachMode::Capture => {
                        "the driver calls of processes the injection library does not record; \
                         those it records (with CUPTI loaded) are not probed, and their calls \
                         come from it"
                    }
                    AttachMode::Always => {
                        "the driver calls of every process that maps a driver library, those the \
                         injection library records too (--ebpf-attach always keeps the past's \
                         calls, which the library does not record between captures)"
                    }
                }
                .into(),
            ),
        ]
    }

    /// The part of the window the hooks were off for, when they were.
    fn notices(
        &self,
        window: crate::recorder::Window,
        _scope: crate::backend::Scope,
    ) -> Vec<String> {
        let missing = match (self.config.sched, self.config.cuda) {
            (true, true) => "scheduler slices (the /host:CPUs plane) or probed driver calls",
            (true, false) => "scheduler slices (the /host:CPUs plane)",
            (false, _) => "probed driver calls",
        };
        let between_captures = self.config.attach == AttachMode::Capture;
        self.status
            .lock()
            .coverage
            .describe(window, missing, between_captures)
            .into_iter()
            .collect()
    }

    fn losses(&self) -> Vec<Loss> {
        let status = self.status.lock();
        let [sched_ring, cuda_ring, inflight] = status.losses;
        vec![
            Loss {
                place: "bpf_ring_sched",
                what: "scheduler records lost because the BPF ring buffer was full",
                count: sched_ring,
            },
            Loss {
                place: "bpf_ring_cuda",
                what: "CUDA call records lost because the BPF ring buffer was full",
                count: cuda_ring,
            },
            Loss {
                place: "bpf_inflight_table",
                what: "CUDA calls lost because the in-flight call table was full",
                count: inflight,
            },
        ]
    }
}

impl Drop for EbpfBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process as `proc_root/PID/task/TID/comm` lists it.
    fn process(root: &std::path::Path, pid: u32, threads: &[(u32, &str)]) {
        for (tid, comm) in threads {
            let dir = root.join(format!("{pid}/task/{tid}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        }
    }

    #[test]
    fn a_process_may_be_recorded_when_one_of_its_threads_passes_the_filters() {
        let root = tempfile::tempdir().unwrap();
        process(root.path(), 10, &[(10, "python"), (11, "pt_autograd_0")]);
        process(root.path(), 20, &[(20, "bash")]);
        let config = EbpfConfig {
            comm: Some("pt_auto".into()),
            proc_root: root.path().to_path_buf(),
            ..EbpfConfig::default()
        };
        assert!(config.may_record(10), "a thread of its passes");
        assert!(!config.may_record(20));
        // One whose threads cannot be listed is not left out.
        assert!(config.may_record(30));
        let config = EbpfConfig {
            pids: vec![20],
            ..config
        };
        assert!(!config.may_record(10), "not among --ebpf-pid");
        assert!(!config.may_record(30));
    }
}
