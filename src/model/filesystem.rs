//! The kind of filesystem a path is on, from `statfs(2)`'s magic number:
//! the few kinds the agent treats differently. Files kept in memory make a
//! poor spill directory; files the kernel makes up take no trace (root's
//! `mkdir` and `open(O_CREAT)` fail there though `access(2)` says
//! writable); a cgroup v2 directory is what an eBPF cgroup filter needs.

use std::path::Path;

/// See the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filesystem {
    Tmpfs,
    Ramfs,
    Proc,
    Sysfs,
    /// A cgroup v1 hierarchy.
    Cgroup,
    Cgroup2,
    Debugfs,
    Tracefs,
    /// Any other: a disk's, a network's, an overlay.
    Other,
}

// From linux/magic.h.
const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;
const PROC_SUPER_MAGIC: u64 = 0x9fa0;
const SYSFS_MAGIC: u64 = 0x6265_6572;
const CGROUP_SUPER_MAGIC: u64 = 0x0027_e0eb;
const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;
const DEBUGFS_MAGIC: u64 = 0x6462_6720;
const TRACEFS_MAGIC: u64 = 0x7472_6163;

impl Filesystem {
    /// The filesystem `path` is on.
    pub fn of(path: &Path) -> std::io::Result<Filesystem> {
        let fs = rustix::fs::statfs(path)?;
        #[allow(clippy::unnecessary_cast)] // its type differs between targets
        Ok(Filesystem::from_magic(fs.f_type as u64))
    }

    fn from_magic(magic: u64) -> Filesystem {
        match magic {
            TMPFS_MAGIC => Filesystem::Tmpfs,
            RAMFS_MAGIC => Filesystem::Ramfs,
            PROC_SUPER_MAGIC => Filesystem::Proc,
            SYSFS_MAGIC => Filesystem::Sysfs,
            CGROUP_SUPER_MAGIC => Filesystem::Cgroup,
            CGROUP2_SUPER_MAGIC => Filesystem::Cgroup2,
            DEBUGFS_MAGIC => Filesystem::Debugfs,
            TRACEFS_MAGIC => Filesystem::Tracefs,
            _ => Filesystem::Other,
        }
    }

    /// Whether its files are kept in memory.
    pub fn keeps_files_in_memory(self) -> bool {
        matches!(self, Filesystem::Tmpfs | Filesystem::Ramfs)
    }

    /// Its name for people when the kernel makes its files up, so that no
    /// trace file can be made there, root's neither.
    pub fn made_up_by_the_kernel(self) -> Option<&'static str> {
        match self {
            Filesystem::Proc => Some("procfs"),
            Filesystem::Sysfs => Some("sysfs"),
            Filesystem::Cgroup | Filesystem::Cgroup2 => Some("a cgroup filesystem"),
            Filesystem::Debugfs => Some("debugfs"),
            Filesystem::Tracefs => Some("tracefs"),
            _ => None,
        }
    }
}

/// Where no file can be made at or below `path`, root's neither: the
/// nearest part of it that exists (`path` itself, or its closest existing
/// ancestor) and the name of the filesystem the kernel makes up that it is
/// on. `None` on any other filesystem, or when nothing of it can be looked
/// at.
pub fn made_up_part(path: &Path) -> Option<(&Path, &'static str)> {
    let existing = path.ancestors().find(|dir| dir.exists())?;
    let name = Filesystem::of(existing).ok()?.made_up_by_the_kernel()?;
    Some((existing, name))
}

/// The nearest part of `path` that exists (`path` itself, or its closest
/// existing ancestor; `/` when none is found) and whether this process may
/// write there (`faccessat(AT_EACCESS)`, as the process's effective user
/// and capabilities, which its writes use: a read-only mount or another
/// user's directory says no; a filesystem the kernel makes up may say yes,
/// see [`made_up_part`]).
pub fn writable_part(path: &Path) -> (&Path, bool) {
    use rustix::fs::{accessat, Access, AtFlags, CWD};
    let existing = path
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or(Path::new("/"));
    let writable = accessat(CWD, existing, Access::WRITE_OK, AtFlags::EACCESS).is_ok();
    (existing, writable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_own_filesystems_are_told_apart() {
        assert_eq!(
            Filesystem::of(Path::new("/proc")).unwrap(),
            Filesystem::Proc
        );
        assert_eq!(
            Filesystem::of(Path::new("/sys")).unwrap(),
            Filesystem::Sysfs
        );
        assert_eq!(
            Filesystem::of(Path::new("/proc/self"))
                .unwrap()
                .made_up_by_the_kernel(),
            Some("procfs")
        );
        // /dev/shm is tmpfs on every Linux this runs on.
        assert!(Filesystem::of(Path::new("/dev/shm"))
            .unwrap()
            .keeps_files_in_memory());
        let here = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        assert_eq!(
            Filesystem::of(here.path()).unwrap().made_up_by_the_kernel(),
            None
        );
        assert!(Filesystem::of(Path::new("/no/such/directory")).is_err());
        let missing = Path::new("/proc/devtrace/never");
        assert_eq!(made_up_part(missing), Some((Path::new("/proc"), "procfs")));
        assert_eq!(made_up_part(here.path()), None);
    }
}
