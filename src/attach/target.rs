//! What an attach needs to know of its target before touching it, all read
//! from `/proc`: that it may be attached (a 64-bit glibc process that maps
//! the CUDA driver, neither traced nor injected already, with ptrace
//! allowed), where its `dlopen` is, and a `syscall` instruction it maps.

use std::path::{Path, PathBuf};

use super::AttachError;
use crate::backend::ebpf::cuda::is_driver_library;
use crate::elf;
use crate::model::host_process;
use crate::repository::acting::Credentials;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    pub path: String,
}

pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.to_string();
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let path = fields.nth(2).unwrap_or("").to_string();
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                perms,
                offset,
                path,
            })
        })
        .collect()
}

/// The file name of a path in the maps.
pub fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The dynamic loader: `ld-linux-x86-64.so.2`, or `ld-2.31.so` as maps
/// name it before glibc 2.34.
fn is_loader(path: &str) -> bool {
    let name = base_name(path);
    name.starts_with("ld-") && name.contains(".so")
}

fn is_libc(path: &str) -> bool {
    let name = base_name(path);
    name == "libc.so.6" || (name.starts_with("libc-") && name.ends_with(".so"))
}

/// The refusal of a caller the kernel does not let trace the target.
pub const NOT_PERMITTED: &str = "not permitted to trace it: attach as root or with \
     CAP_SYS_PTRACE (with kernel.yama.ptrace_scope 1 or 2, CAP_SYS_PTRACE is needed whoever \
     owns it)";

/// The name every copy of the injection library is mapped under.
pub const LIBRARY_STEM: &str = "libdevtrace_inject";

/// What an attach uses of the target's libc, as addresses in the target.
pub struct Libc {
    pub dlopen: u64,
    /// Where the loader's `__rseq_offset` and `__rseq_size` are (glibc 2.35
    /// and later): a thread's `struct rseq` lies that far from its thread
    /// pointer, when the size is not 0.
    pub rseq: Option<(u64, u64)>,
}

/// What the target is, as far as an attach cares.
pub struct Target {
    pub pid: i32,
    pub maps: Vec<Mapping>,
    /// When it started (clock ticks since boot): with the pid, the process.
    started: u64,
    /// Its real uid and gid, which staging acts with.
    uid: u32,
    gid: u32,
}

impl Target {
    pub fn read(pid: i32) -> Result<Target, AttachError> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|_| AttachError::NoProcess)?;
        if let Some(tracer) = field(&status, "TracerPid:").filter(|t| *t != "0") {
            return Err(AttachError::Refused(format!(
                "it is being traced already (by process {tracer}, a debugger or strace)"
            )));
        }
        let maps =
            std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied => AttachError::Refused(NOT_PERMITTED.into()),
                _ => AttachError::Refused(format!("its memory map cannot be read: {e}")),
            })?;
        let number = |name: &str| -> Option<u32> {
            field(&status, name)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        let (Some(uid), Some(gid)) = (number("Uid:"), number("Gid:")) else {
            return Err(AttachError::NoProcess);
        };
        let started = u32::try_from(pid)
            .ok()
            .and_then(host_process::start_ticks)
            .ok_or(AttachError::NoProcess)?;
        Ok(Target {
            pid,
            maps: parse_maps(&maps),
            started,
            uid,
            gid,
        })
    }

    /// The credentials staging acts with: the process's own user's, so
    /// that the agent can do there nothing its owner could not.
    pub fn credentials(&self) -> Credentials {
        Credentials {
            uid: self.uid,
            gid: self.gid,
            groups: Vec::new(),
        }
    }

    /// Refuses when, with thread `tid` stopped, the process is no longer
    /// the one checked (it ended and its pid was reused, the thread is not
    /// its, or its user changed), or is not `owner`'s.
    pub fn still_the_same(&self, tid: i32, owner: Option<u32>) -> Result<(), AttachError> {
        let pid = self.pid;
        let same = u32::try_from(pid).ok().and_then(host_process::start_ticks)
            == Some(self.started)
            && Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
            && owner.is_none_or(|owner| super::attachable_by(pid, owner).is_ok());
        if same {
            Ok(())
        } else {
            Err(AttachError::Refused(
                "the process changed during the attach (it ended and its pid was reused, or its \
                 user changed): nothing was changed in it"
                    .into(),
            ))
        }
    }

    /// Refuses a target the library cannot, or need not, be loaded into.
    pub fn check(&self) -> Result<(), AttachError> {
        if self
            .maps
            .iter()
            .any(|m| base_name(&m.path).starts_with(LIBRARY_STEM))
        {
            return Err(AttachError::AlreadyInjected);
        }
        // Started with the library named: the driver loads it at cuInit.
        let environ = std::fs::read(format!("/proc/{}/environ", self.pid)).unwrap_or_default();
        let named = environ.split(|b| *b == 0).any(|entry| {
            (entry.starts_with(b"CUDA_INJECTION64_PATH=") || entry.starts_with(b"LD_PRELOAD="))
                && entry
                    .windows(LIBRARY_STEM.len())
                    .any(|w| w == LIBRARY_STEM.as_bytes())
        });
        if named {
            return Err(AttachError::AlreadyInjected);
        }
        if !self.maps.iter().any(|m| is_driver_library(&m.path)) {
            return Err(AttachError::Refused(
                "it does not map libcuda.so: not a CUDA process (or one that has not loaded the \
                 driver yet; attach again once it has)"
                    .into(),
            ));
        }
        if self.libc_base().is_none() {
            return Err(AttachError::Refused(
                "it maps no glibc (libc.so.6): a statically linked or musl program, whose \
                 loader cannot be asked to load the library"
                    .into(),
            ));
        }
        let mut class = [0u8; 5];
        let read = std::fs::File::open(format!("/proc/{}/exe", self.pid))
            .and_then(|mut exe| std::io::Read::read_exact(&mut exe, &mut class));
        if read.is_ok() && class[4] == 1 {
            return Err(AttachError::Refused(
                "it is a 32-bit program; only 64-bit ones can be attached".into(),
            ));
        }
        if let Ok(scope) = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            if scope.trim() == "3" {
                return Err(AttachError::Refused(
                    "kernel.yama.ptrace_scope is 3: this kernel lets no process be traced until \
                     it reboots"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Where glibc is loaded: its first mapping's start, and its file as
    /// the target maps it.
    fn libc_base(&self) -> Option<(u64, &Mapping)> {
        let first = self
            .maps
            .iter()
            .find(|m| is_libc(&m.path) && m.offset == 0)?;
        Some((first.start, first))
    }

    /// Where the target's libc has `dlopen`, and where its loader keeps
    /// the variables that say where each thread's restartable-sequence
    /// area is, read from the files it maps (through
    /// `/proc/PID/map_files`, so the very files mapped).
    pub fn libc(&self) -> Result<Libc, AttachError> {
        let (base, mapping) = self
            .libc_base()
            .ok_or(AttachError::Refused("it maps no glibc (libc.so.6)".into()))?;
        let bytes = self.mapped_file(mapping).map_err(|e| {
            AttachError::Refused(format!("its libc ({}) cannot be read: {e}", mapping.path))
        })?;
        let offset = elf::function_offset(&bytes, "dlopen")
            .or_else(|_| elf::function_offset(&bytes, "__libc_dlopen_mode"))
            .map_err(|e| AttachError::Refused(format!("its libc ({}): {e}", mapping.path)))?;
        let dlopen = base.checked_add(offset).ok_or_else(|| {
            AttachError::Refused("its libc's dlopen lies past the address space".into())
        })?;
        Ok(Libc {
            dlopen,
            rseq: self.rseq_variables(),
        })
    }

    /// `__rseq_offset` and `__rseq_size` in the target, which its loader
    /// exports from glibc 2.35 on.
    fn rseq_variables(&self) -> Option<(u64, u64)> {
        let loader = self
            .maps
            .iter()
            .find(|m| is_loader(&m.path) && m.offset == 0)?;
        let bytes = self.mapped_file(loader).ok()?;
        let variable = |name| {
            elf::variable_offset(&bytes, name)
                .ok()
                .and_then(|offset| loader.start.checked_add(offset))
        };
        variable("__rseq_offset").zip(variable("__rseq_size"))
    }

    /// The file behind `mapping`, as mapped, up to [`MAX_LIBC_BYTES`].
    fn mapped_file(&self, mapping: &Mapping) -> std::io::Result<Vec<u8>> {
        let file = PathBuf::from(format!(
            "/proc/{}/map_files/{:x}-{:x}",
            self.pid, mapping.start, mapping.end
        ));
        read_bounded(&file, MAX_LIBC_BYTES)
    }

    /// An executable mapping of libc, to find a `syscall` instruction in.
    pub fn libc_code(&self) -> Option<&Mapping> {
        self.maps
            .iter()
            .find(|m| is_libc(&m.path) && m.perms.starts_with("r-x"))
    }
}

/// The most of a libc file read to find `dlopen` in.
const MAX_LIBC_BYTES: u64 = 64 << 20;

fn read_bounded(path: &std::path::Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

fn field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_are_read_with_and_without_paths() {
        let maps = parse_maps(
            "7f0000000000-7f0000001000 r-xp 00002000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
             7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 \n\
             garbage\n",
        );
        assert_eq!(maps.len(), 2);
        assert_eq!(maps[0].offset, 0x2000);
        assert!(is_libc(&maps[0].path));
        assert_eq!(maps[1].path, "");
        assert!(!is_libc("/lib/libcuda.so.1"));
        assert!(is_libc("/lib/x86_64-linux-gnu/libc-2.31.so"));
    }

    #[test]
    fn this_test_process_is_refused_for_want_of_the_driver() {
        let target = Target::read(std::process::id() as i32).unwrap();
        assert!(target.libc_base().is_some());
        let libc = target.libc().unwrap();
        // SAFETY: a lookup of a symbol name in the loaded objects.
        let offset_at = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr()) };
        if !offset_at.is_null() {
            // glibc 2.35 or later: found where this process has it.
            assert_eq!(libc.rseq.map(|(offset, _)| offset), Some(offset_at as u64));
        }
        match target.check() {
            Err(AttachError::Refused(why)) => assert!(why.contains("libcuda.so"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
