//! Putting the CUDA driver probes on a library, in every process or in one
//! process alone, and how this kernel lets them be linked.
//!
//! Letting go of a uprobe waits until the kernel is sure no CPU still runs
//! its program, on the thread that lets go (the backend's, which drains
//! nothing meanwhile). Attached one at a time (a perf event each), a
//! library's 54 probes wait 54 times: about 3 s here for one process, and
//! as long again at the end of every capture. Where the kernel links many
//! uprobes to one BPF link (Linux 6.6 and later), each program's probes on
//! a library form one link, let go of with one wait. Linked for one
//! process alone, such a link ran its program only for calls of the
//! process's first thread before Linux 6.12 (the kernel compared threads,
//! not address spaces), so one process alone is linked that way from 6.12
//! on, and probe by probe before.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{mpsc, Arc};

use parking_lot::{Condvar, Mutex};

use libbpf_rs::libbpf_sys;
use libbpf_rs::{Link, UprobeMultiOpts, UprobeOpts};
use tracing::{debug, warn};

use super::cuda::{CudaReturns, MappingProcess, CUDA_PROBES};
use super::programs::cuda_skel::CudaSkel;
use crate::elf;

/// How the probes on a library are linked on this kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Linking {
    /// One link of many probes for every process.
    pub many_in_all: bool,
    /// One link of many probes for a single process.
    pub many_in_one: bool,
}

impl Linking {
    /// What the running kernel supports, found by asking it (as libbpf
    /// does) and, for one process alone, by its release.
    pub fn of_this_kernel() -> Linking {
        let many = kernel_links_many_uprobes();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        Linking {
            many_in_all: many,
            many_in_one: many && release_at_least(&release, (6, 12)),
        }
    }

    fn many(self, process: Option<MappingProcess>) -> bool {
        if process.is_some() {
            self.many_in_one
        } else {
            self.many_in_all
        }
    }

    /// How it reads in a status line.
    pub fn describe(self) -> &'static str {
        match (self.many_in_all, self.many_in_one) {
            (true, true) => "one link per program and process (Linux 6.12 and later)",
            (true, false) => {
                "one link per program for every process, probe by probe for one process alone \
                 (Linux before 6.12)"
            }
            _ => "probe by probe, each a perf event (Linux before 6.6)",
        }
    }
}

/// Whether a kernel release (`6.18.44-foo`) is at least `(major, minor)`.
fn release_at_least(release: &str, wanted: (u32, u32)) -> bool {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= wanted,
        _ => false,
    }
}

/// libbpf's own test for multi-uprobe links: a program of that attach
/// type loads, and a link asked for on `/` (no executable) is refused with
/// `EBADF`, which only a kernel that has such links gets that far to say.
fn kernel_links_many_uprobes() -> bool {
    // r0 = 0; exit
    let mut set_zero = libbpf_sys::bpf_insn {
        code: 0xb7,
        ..Default::default()
    };
    set_zero.imm = 0;
    let exit = libbpf_sys::bpf_insn {
        code: 0x95,
        ..Default::default()
    };
    let program = [set_zero, exit];
    let mut load = libbpf_sys::bpf_prog_load_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_prog_load_opts>() as _,
        expected_attach_type: libbpf_sys::BPF_TRACE_UPROBE_MULTI,
        ..Default::default()
    };
    // SAFETY: the instructions and options outlive the call; the name may
    // be null.
    let program_fd = unsafe {
        libbpf_sys::bpf_prog_load(
            libbpf_sys::BPF_PROG_TYPE_KPROBE,
            std::ptr::null(),
            c"GPL".as_ptr(),
            program.as_ptr(),
            program.len() as _,
            &mut load,
        )
    };
    if program_fd < 0 {
        return false;
    }
    let offset: std::os::raw::c_ulong = 0;
    let mut link = libbpf_sys::bpf_link_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _,
        ..Default::default()
    };
    link.__bindgen_anon_1.uprobe_multi =
        libbpf_sys::bpf_link_create_opts__bindgen_ty_1__bindgen_ty_3 {
            path: c"/".as_ptr(),
            offsets: &offset,
            cnt: 1,
            ..Default::default()
        };
    // SAFETY: the path, the offset and the options outlive the call.
    let link_fd = unsafe {
        libbpf_sys::bpf_link_create(program_fd, 0, libbpf_sys::BPF_TRACE_UPROBE_MULTI, &link)
    };
    // SAFETY: both descriptors are ours, closed once.
    unsafe {
        if link_fd >= 0 {
            libc::close(link_fd);
        }
        libc::close(program_fd);
    }
    link_fd == -libc::EBADF
}

/// A driver library file, by device and inode.
pub(super) type LibraryFile = (u64, u64);

/// A driver library probed in one process, or in every process (`None`).
pub(super) type ProbeKey = (LibraryFile, Option<MappingProcess>);

/// Whether two sets of probes would both fire on some call: the same file,
/// and a process they share.
fn overlap(a: &ProbeKey, b: &ProbeKey) -> bool {
    a.0 == b.0 && (a.1.is_none() || b.1.is_none() || a.1 == b.1)
}

/// Where the probed entry points begin in one driver library file (by
/// `CUDA_PROBES` index), read from its symbol table once per file.
pub(super) struct EntryPoints {
    offsets: Vec<Option<u64>>,
}

impl EntryPoints {
    /// Reads them from `library`, which must still be the file `file`.
    pub fn read(library: &Path, file: LibraryFile) -> Result<EntryPoints, String> {
        let opened = File::open(library).map_err(|error| error.to_string())?;
        let meta = opened.metadata().map_err(|error| error.to_string())?;
        if (meta.dev(), meta.ino()) != file {
            return Err("the file was replaced while it was looked at".to_string());
        }
        let names: Vec<&str> = CUDA_PROBES.iter().map(|probe| probe.symbol).collect();
        let offsets =
            elf::exported_function_offsets(&opened, &names).map_err(|error| error.to_string())?;
        if offsets.iter().all(Option::is_none) {
            return Err("it exports none of the driver entry points".to_string());
        }
        Ok(EntryPoints { offsets })
    }
}

/// A library's probes, in every process that maps it (those that map it
/// later too, from their first call) or in one process alone; dropping it
/// hands them to the [`Reaper`]. The kernel puts a probe's breakpoints in
/// the mappings of the processes it is for, and every call through one
/// traps.
pub(super) struct ProbedLibrary {
    key: ProbeKey,
    links: Vec<Link>,
    reaper: Reaper,
}

impl Drop for ProbedLibrary {
    fn drop(&mut self) {
        self.reaper
            .release(self.key, Box::new(std::mem::take(&mut self.links)));
    }
}

/// Lets go of probes on a thread of its own, so that the backend's thread
/// goes on draining while the kernel waits for each; keeps count of what
/// it still holds, so that probes that would fire on the same calls are
/// not attached before those are gone (each call would be recorded twice).
#[derive(Clone)]
pub(super) struct Reaper {
    sender: Option<mpsc::Sender<(ProbeKey, Box<dyn Send>)>>,
    held: Arc<(Mutex<Vec<ProbeKey>>, Condvar)>,
}

impl Reaper {
    pub fn start() -> Reaper {
        let held: Arc<(Mutex<Vec<ProbeKey>>, Condvar)> = Arc::default();
        let (sender, receiver) = mpsc::channel::<(ProbeKey, Box<dyn Send>)>();
        let shared = Arc::clone(&held);
        let spawned = std::thread::Builder::new()
            .name("devtrace-unprobe".into())
            .spawn(move || {
                for (key, probes) in receiver {
                    drop(probes);
                    forget(&shared, key);
                }
            });
        match spawned {
            Ok(_) => Reaper {
                sender: Some(sender),
                held,
            },
            Err(error) => {
                warn!(%error, "no thread to let go of probes on; the backend's thread does");
                Reaper { sender: None, held }
            }
        }
    }

    /// Lets go of `probes` (those of `key`) once the thread gets to them.
    fn release(&self, key: ProbeKey, probes: Box<dyn Send>) {
        let Some(sender) = &self.sender else { return };
        self.held.0.lock().push(key);
        if let Err(mpsc::SendError((key, probes))) = sender.send((key, probes)) {
            drop(probes);
            forget(&self.held, key);
        }
    }

    /// Waits until no probes that would fire with those of `key` are
    /// still held.
    pub fn wait_clear_of(&self, key: &ProbeKey) {
        let (held, gone) = &*self.held;
        let mut held = held.lock();
        while held.iter().any(|pending| overlap(pending, key)) {
            gone.wait(&mut held);
        }
    }
}

/// Takes one `key` off the list of those held, and says so to waiters.
fn forget(held: &(Mutex<Vec<ProbeKey>>, Condvar), key: ProbeKey) {
    let (list, gone) = held;
    let mut list = list.lock();
    if let Some(at) = list.iter().position(|k| *k == key) {
        list.swap_remove(at);
    }
    gone.notify_all();
}

/// Probes `library` (through a path valid in the process probed): per
/// driver function it exports, an entry probe, and a return probe where
/// `returns` asks for one. Linked many to a link where `linking` says so
/// and `entry_points` were read, else one by one by name. Answers the
/// probes and the functions missing.
pub(super) fn probe_library(
    skel: &CudaSkel<'_>,
    library: &Path,
    key: ProbeKey,
    entry_points: Option<&EntryPoints>,
    returns: CudaReturns,
    linking: Linking,
    reaper: &Reaper,
) -> Result<(ProbedLibrary, Vec<&'static str>), String> {
    let process = key.1;
    // -1: every process.
    let pid = match process {
        Some(process) => {
            i32::try_from(process.pid).map_err(|_| format!("pid {} out of range", process.pid))?
        }
        None => -1,
    };
    reaper.wait_clear_of(&key);
    let probed = |(links, missing)| {
        let probed = ProbedLibrary {
            key,
            links,
            reaper: reaper.clone(),
        };
        (probed, missing)
    };
    if let Some(entry_points) = entry_points.filter(|_| linking.many(process)) {
        match link_many(skel, library, pid, entry_points, returns) {
            Ok(links) => return Ok(probed(links)),
            // Probe by probe instead, which says for itself what fails.
            Err(reason) => debug!(library = %library.display(), pid, %reason,
                "the driver's probes could not be linked together; probing one by one"),
        }
    }
    link_one_by_one(skel, library, process, pid, returns).map(probed)
}

/// One link per program: entry-only probes, entries of calls with a
/// return probe, their returns.
fn link_many(
    skel: &CudaSkel<'_>,
    library: &Path,
    pid: i32,
    entry_points: &EntryPoints,
    returns: CudaReturns,
) -> Result<(Vec<Link>, Vec<&'static str>), String> {
    let mut entry_only = UprobeMultiOpts::default();
    let mut with_return = UprobeMultiOpts::default();
    let mut missing = Vec::new();
    for (index, probe) in CUDA_PROBES.iter().enumerate() {
        let Some(offset) = entry_points.offsets[index].and_then(|o| usize::try_from(o).ok()) else {
            missing.push(probe.symbol);
            continue;
        };
        let group = if probe.has_return(returns) {
            &mut with_return
        } else {
            &mut entry_only
        };
        group.offsets.push(offset);
        group.cookies.push(probe.cookie(index, returns));
    }
    let progs = &skel.progs;
    let mut links = Vec::new();
    let mut attach = |program: &libbpf_rs::ProgramMut<'_>, opts: &UprobeMultiOpts| {
        if !opts.offsets.is_empty() {
            links.push(
                program
                    .attach_uprobe_multi_with_opts(pid, library, "", opts.clone())
                    .map_err(|error| error.to_string())?,
            );
        }
        Ok::<_, String>(())
    };
    attach(&progs.on_cuda_call_multi, &entry_only)?;
    attach(&progs.on_cuda_entry_multi, &with_return)?;
    with_return.retprobe = true;
    attach(&progs.on_cuda_return_multi, &with_return)?;
    Ok((links, missing))
}

/// A perf event per probe.
fn link_one_by_one(
    skel: &CudaSkel<'_>,
    library: &Path,
    process: Option<MappingProcess>,
    pid: i32,
    returns: CudaReturns,
) -> Result<(Vec<Link>, Vec<&'static str>), String> {
    let mut links = Vec::new();
    let mut missing = Vec::new();
    let mut first_error = None;
    for (index, probe) in CUDA_PROBES.iter().enumerate() {
        let cookie = probe.cookie(index, returns);
        let opts = |retprobe| UprobeOpts {
            func_name: Some(probe.symbol.to_string()),
            retprobe,
            cookie,
            ..UprobeOpts::default()
        };
        let attached = if probe.has_return(returns) {
            let entry =
                skel.progs
                    .on_cuda_entry
                    .attach_uprobe_with_opts(pid, library, 0, opts(false));
            let exit =
                skel.progs
                    .on_cuda_return
                    .attach_uprobe_with_opts(pid, library, 0, opts(true));
            entry.and_then(|entry| Ok(vec![entry, exit?]))
        } else {
            skel.progs
                .on_cuda_call
                .attach_uprobe_with_opts(pid, library, 0, opts(false))
                .map(|entry| vec![entry])
        };
        match attached {
            Ok(probes) => links.extend(probes),
            Err(error) => {
                first_error.get_or_insert(error);
                missing.push(probe.symbol);
            }
        }
    }
    if links.is_empty() {
        let why = first_error.map_or_else(String::new, |error| {
            let denied = error.kind() == libbpf_rs::ErrorKind::PermissionDenied;
            // Since Linux 6.16 a uprobe needs CAP_SYS_ADMIN; CAP_PERFMON
            // alone gets EACCES.
            let hint = if denied {
                " (uprobes need CAP_SYS_ADMIN on Linux 6.16 and later, CAP_PERFMON before)"
            } else {
                ""
            };
            format!(": {error}{hint}")
        });
        let whose = process.map_or(String::new(), |p| format!(" in process {}", p.pid));
        return Err(format!(
            "{}{whose}: none of the driver entry points could be probed{why}",
            library.display()
        ));
    }
    Ok((links, missing))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use super::*;

    /// Probes that take until `open` is set to let go of (the kernel's
    /// wait), and say on which thread they were let go of.
    struct Gated {
        open: Arc<AtomicBool>,
        dropped_on: Arc<Mutex<Option<std::thread::ThreadId>>>,
    }

    impl Drop for Gated {
        fn drop(&mut self) {
            let give_up = Instant::now() + Duration::from_secs(10);
            while !self.open.load(Ordering::SeqCst) && Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(1));
            }
            *self.dropped_on.lock() = Some(std::thread::current().id());
        }
    }

    const LIBRARY: LibraryFile = (1, 2);

    fn alone(pid: u32) -> ProbeKey {
        (LIBRARY, Some(MappingProcess { pid, started: 7 }))
    }

    #[test]
    fn probes_are_let_go_of_elsewhere_and_waited_for_only_where_they_would_overlap() {
        let reaper = Reaper::start();
        let open = Arc::new(AtomicBool::new(false));
        let dropped_on = Arc::new(Mutex::new(None));
        let gated = Gated {
            open: Arc::clone(&open),
            dropped_on: Arc::clone(&dropped_on),
        };
        reaper.release(alone(10), Box::new(gated));
        // Neither another process nor another file waits for them.
        reaper.wait_clear_of(&alone(11));
        reaper.wait_clear_of(&((3, 4), None));
        assert_eq!(
            *dropped_on.lock(),
            None,
            "waited for probes that do not overlap"
        );
        // Every process of the same file overlaps them: that waits.
        let opener = std::thread::spawn({
            let open = Arc::clone(&open);
            move || {
                std::thread::sleep(Duration::from_millis(50));
                open.store(true, Ordering::SeqCst);
            }
        });
        reaper.wait_clear_of(&(LIBRARY, None));
        let dropped = *dropped_on.lock();
        assert!(dropped.is_some(), "did not wait for overlapping probes");
        assert_ne!(
            dropped,
            Some(std::thread::current().id()),
            "let go of inline"
        );
        opener.join().unwrap();
    }

    #[test]
    fn probe_sets_overlap_where_they_share_a_file_and_a_process() {
        assert!(overlap(&alone(1), &alone(1)));
        assert!(!overlap(&alone(1), &alone(2)));
        assert!(overlap(&alone(1), &(LIBRARY, None)));
        assert!(overlap(&(LIBRARY, None), &alone(2)));
        assert!(!overlap(&((9, 9), None), &(LIBRARY, None)));
        // The same pid, a later process: no shared calls.
        let later = (LIBRARY, Some(MappingProcess { pid: 1, started: 8 }));
        assert!(!overlap(&alone(1), &later));
    }

    #[test]
    fn kernel_releases_are_compared_by_major_and_minor() {
        assert!(release_at_least("6.18.44-fc-v669", (6, 12)));
        assert!(release_at_least("6.12.0", (6, 12)));
        assert!(!release_at_least("6.11.9-300.fc40.x86_64", (6, 12)));
        assert!(!release_at_least("5.15.0-1062-aws", (6, 6)));
        assert!(release_at_least("7.0-rc1\n", (6, 12)));
        assert!(!release_at_least("", (6, 6)));
        assert!(!release_at_least("garbage", (6, 6)));
    }
}
