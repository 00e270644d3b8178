//! Putting the CUDA driver probes on a library, in every process or in one
//! process alone, and how this kernel lets them be linked.
//!
//! Letting go of a uprobe waits until the kernel is sure no CPU still runs
//! its program. Attached one at a time (a perf event each), a library's 54
//! probes wait 54 times. Where the kernel links many uprobes to one BPF
//! link (Linux 6.6 and later), each program's probes on a library form one
//! link, let go of with one wait; either way the waiting is done by the
//! [`Reaper`]'s thread. Linked for one process alone, such a link ran its
//! program only for calls of the process's first thread before Linux 6.12
//! (the kernel compared threads, not address spaces), so one process alone
//! is linked that way from 6.12 on, and probe by probe before.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use libbpf_rs::libbpf_sys;
use libbpf_rs::{Link, UprobeMultiOpts, UprobeOpts};
use tracing::debug;

use super::cuda::{CudaReturns, MappingProcess, CUDA_PROBES};
use super::programs::cuda_skel::CudaSkel;
use super::reaper::{LibraryFile, ProbeKey, Reaper};
use crate::elf;

/// How the probes on a library are linked on this kernel (by default,
/// one by one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Linking {
    /// One link of many probes for every process.
    pub many_in_all: bool,
    /// One link of many probes for a single process.
    pub many_in_one: bool,
    /// Why not many to a link: the error the kernel gave (an errno), where
    /// it refused for another reason than not knowing such links.
    refused: Option<i32>,
}

impl Linking {
    /// What the running kernel supports, found by asking it (as libbpf
    /// does) and, for one process alone, by its release.
    pub fn of_this_kernel() -> Linking {
        let refused = kernel_links_many_uprobes().err();
        let many = refused.is_none();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        Linking {
            many_in_all: many,
            many_in_one: many && release_at_least(&release, (6, 12)),
            refused: refused.filter(|errno| *errno != libc::EINVAL && *errno != 0),
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
    pub fn describe(self) -> String {
        match (self.many_in_all, self.many_in_one, self.refused) {
            (true, true, _) => "one link per program and process (Linux 6.12 and later)".into(),
            (true, false, _) => "one link per program for every process, probe by probe for one \
                                 process alone (Linux before 6.12)"
                .into(),
            (false, _, Some(errno)) => format!(
                "probe by probe, each a perf event: asked for a link of many, the kernel said {}",
                std::io::Error::from_raw_os_error(errno)
            ),
            (false, _, None) => "probe by probe, each a perf event (Linux before 6.6)".into(),
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
/// Otherwise the error the kernel gave (`EINVAL`: it has no such links).
fn kernel_links_many_uprobes() -> Result<(), i32> {
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
        return Err(-program_fd);
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
    match link_fd {
        fd if fd == -libc::EBADF => Ok(()),
        fd if fd < 0 => Err(-fd),
        // A link on `/`: not the kernel libbpf knows.
        _ => Err(libc::EINVAL),
    }
}

/// One driver library file, kept open (so that its inode cannot go to
/// another file while its offsets are remembered), with where the probed
/// entry points begin in it (by `CUDA_PROBES` index), read from its symbol
/// table once. Probes are attached through the open file, never by a path
/// a process could swap for another file in between.
pub(super) struct EntryPoints {
    file: File,
    offsets: Vec<Option<u64>>,
}

/// Why a library's entry points were not read, and whether looking again
/// could change that.
pub(super) struct Unread {
    pub reason: String,
    pub lasting: bool,
}

impl EntryPoints {
    /// Reads them from `library`, which must still be the file `file`.
    pub fn read(library: &Path, file: LibraryFile) -> Result<EntryPoints, Unread> {
        let passing = |reason: String| Unread {
            reason,
            lasting: false,
        };
        // Not blocking on a FIFO put where the library was.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(library)
            .map_err(|error| passing(error.to_string()))?;
        let meta = opened
            .metadata()
            .map_err(|error| passing(error.to_string()))?;
        if !meta.is_file() || (meta.dev(), meta.ino()) != file {
            return Err(passing(
                "the file was replaced while it was looked at".into(),
            ));
        }
        let names: Vec<&str> = CUDA_PROBES.iter().map(|probe| probe.symbol).collect();
        let offsets = elf::exported_function_offsets(&opened, &names).map_err(|error| Unread {
            reason: error.to_string(),
            lasting: true,
        })?;
        if offsets.iter().all(Option::is_none) {
            return Err(Unread {
                reason: "it exports none of the driver entry points".into(),
                lasting: true,
            });
        }
        Ok(EntryPoints {
            file: opened,
            offsets,
        })
    }

    /// A path to the open file that the kernel and libbpf resolve to it.
    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
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
}

impl Drop for ProbedLibrary {
    fn drop(&mut self) {
        Reaper::global().release(self.key, Box::new(std::mem::take(&mut self.links)));
    }
}

/// How long attaching waits for probes still being let go of that would
/// fire on the same calls; past it, the next look tries again.
const WAIT_FOR_OVERLAP: Duration = Duration::from_millis(200);

/// Probes could not go on yet, or at all.
pub(super) enum NotProbed {
    /// Probes that would fire on the same calls are still being let go of.
    Overlapping,
    Failed(String),
}

/// Probes `library` (a path valid in the process probed, used where its
/// `entry_points` could not be read): per driver function it exports, an
/// entry probe, and a return probe where `returns` asks for one. Linked
/// many to a link where `linking` says so and the entry points were read,
/// else one by one by name. Waits a little for overlapping probes still
/// being let go of. Answers the probes and the functions missing.
pub(super) fn probe_library(
    skel: &CudaSkel<'_>,
    library: &Path,
    key: ProbeKey,
    entry_points: Option<&EntryPoints>,
    returns: CudaReturns,
    linking: Linking,
) -> Result<(ProbedLibrary, Vec<&'static str>), NotProbed> {
    let process = key.1;
    // -1: every process.
    let pid = match process {
        Some(process) => i32::try_from(process.pid)
            .map_err(|_| NotProbed::Failed(format!("pid {} out of range", process.pid)))?,
        None => -1,
    };
    if !Reaper::global().wait_clear_of(&key, WAIT_FOR_OVERLAP) {
        return Err(NotProbed::Overlapping);
    }
    let probed = |(links, missing)| (ProbedLibrary { key, links }, missing);
    let through = entry_points.map(EntryPoints::path);
    let path = through.as_deref().unwrap_or(library);
    if let Some(entry_points) = entry_points.filter(|_| linking.many(process)) {
        match link_many(skel, path, pid, entry_points, returns) {
            Ok(links) => return Ok(probed(links)),
            // Probe by probe instead, which says for itself what fails.
            Err(reason) => debug!(library = %library.display(), pid, %reason,
                "the driver's probes could not be linked together; probing one by one"),
        }
    }
    link_one_by_one(skel, path, library, process, pid, returns)
        .map(probed)
        .map_err(NotProbed::Failed)
}

/// One link per program, at the entry points' offsets in the file at
/// `path`: entry-only probes, entries of calls with a return probe, their
/// returns.
fn link_many(
    skel: &CudaSkel<'_>,
    path: &Path,
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
                    .attach_uprobe_multi_with_opts(pid, path, "", opts.clone())
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

/// A perf event per probe, each placed by name in the file at `path`
/// (`library` names it in messages).
fn link_one_by_one(
    skel: &CudaSkel<'_>,
    path: &Path,
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
            let entry = skel
                .progs
                .on_cuda_entry
                .attach_uprobe_with_opts(pid, path, 0, opts(false));
            let exit = skel
                .progs
                .on_cuda_return
                .attach_uprobe_with_opts(pid, path, 0, opts(true));
            entry.and_then(|entry| Ok(vec![entry, exit?]))
        } else {
            skel.progs
                .on_cuda_call
                .attach_uprobe_with_opts(pid, path, 0, opts(false))
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
    use super::*;

    fn identity(path: &Path) -> LibraryFile {
        let meta = std::fs::metadata(path).unwrap();
        (meta.dev(), meta.ino())
    }

    #[test]
    fn entry_points_are_read_only_from_the_regular_file_that_was_found() {
        let dir = tempfile::tempdir().unwrap();
        // A FIFO where the library was: refused at once, not waited on.
        let fifo = dir.path().join("libcuda.so.1");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let unread = EntryPoints::read(&fifo, identity(&fifo)).err().unwrap();
        assert!(!unread.lasting, "{}", unread.reason);
        // Another file than the one found: looked at again later.
        let other = dir.path().join("other.so");
        std::fs::write(&other, b"\x7fELF").unwrap();
        let unread = EntryPoints::read(&other, identity(&fifo)).err().unwrap();
        assert!(unread.reason.contains("replaced"), "{}", unread.reason);
        assert!(!unread.lasting);
        // A shared object without the driver's functions: not looked at
        // again.
        let libc = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5).map(PathBuf::from))
            .find(|path| path.to_string_lossy().contains("/libc.so.6"))
            .expect("this test links libc");
        let unread = EntryPoints::read(&libc, identity(&libc)).err().unwrap();
        assert!(unread.lasting, "{}", unread.reason);
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
