//! The copy of the library an attach loads, staged where the target can
//! reach it (its own filesystem, which may be a container's): a new
//! directory of the agent's user, mode 0755, under `--stage-dir` as the
//! target sees it, holding the library and a `runtime-dir` file that names
//! the agent's runtime directory (a running process's environment cannot
//! be given one). Paths are resolved inside the target's root
//! (`RESOLVE_IN_ROOT` from `/proc/PID/root`), so that a link the target's
//! owner planted cannot send the agent's writes elsewhere. Removed when
//! dropped: a library already loaded stays mapped.

use std::io::Write;
use std::os::fd::OwnedFd;

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};

use super::{AttachConfig, AttachError};
use crate::workload::ATTACH_RUNTIME_DIR_FILE;

/// The library's name in its staging directory.
const LIBRARY_NAME: &str = "libdevtrace_inject.so";

/// See the module documentation.
pub struct Staged {
    dir: OwnedFd,
    parent: OwnedFd,
    name: String,
    /// The library's path as the target sees it.
    target_path: Vec<u8>,
}

fn stage_error(what: &str, error: impl std::fmt::Display) -> AttachError {
    AttachError::Stage(format!("{what}: {error}"))
}

impl Staged {
    pub fn new(pid: i32, config: &AttachConfig) -> Result<Staged, AttachError> {
        let library = std::fs::read(&config.library)
            .map_err(|e| stage_error(&format!("reading {}", config.library.display()), e))?;
        let runtime = config.runtime_dir.to_str().ok_or_else(|| {
            AttachError::Stage("the runtime directory's path is not UTF-8".into())
        })?;
        let relative = config.stage_dir.strip_prefix("/").map_err(|_| {
            AttachError::Stage(format!(
                "--stage-dir {} is not an absolute path",
                config.stage_dir.display()
            ))
        })?;
        let root = rfs::open(
            format!("/proc/{pid}/root"),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| stage_error("opening the target's root", e))?;
        let parent = rfs::openat2(
            &root,
            relative,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| stage_error(&format!("{} in the target", config.stage_dir.display()), e))?;
        remove_stale(&parent);
        let nanos = crate::clock::now_ns();
        let name = format!("devtrace-attach-{pid}-{nanos:x}");
        rfs::mkdirat(&parent, name.as_str(), Mode::from_raw_mode(0o755))
            .map_err(|e| stage_error("making the staging directory", e))?;
        let dir = rfs::openat(
            &parent,
            name.as_str(),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| stage_error("opening the staging directory", e))?;
        let staged = Staged {
            target_path: config
                .stage_dir
                .join(&name)
                .join(LIBRARY_NAME)
                .as_os_str()
                .as_encoded_bytes()
                .to_vec(),
            dir,
            parent,
            name,
        };
        staged.write(LIBRARY_NAME, &library, 0o644)?;
        staged.write(ATTACH_RUNTIME_DIR_FILE, runtime.as_bytes(), 0o644)?;
        Ok(staged)
    }

    fn write(&self, name: &str, bytes: &[u8], mode: u32) -> Result<(), AttachError> {
        let fd = rfs::openat(
            &self.dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| stage_error(&format!("creating {name}"), e))?;
        std::fs::File::from(fd)
            .write_all(bytes)
            .map_err(|e| stage_error(&format!("writing {name}"), e))
    }

    /// The library's path as the target sees it.
    pub fn target_path(&self) -> &[u8] {
        &self.target_path
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        remove(&self.parent, &self.dir, &self.name);
    }
}

/// Removes the staging directory `name` in `parent` and what it holds.
fn remove(parent: &OwnedFd, dir: &OwnedFd, name: &str) {
    for file in [LIBRARY_NAME, ATTACH_RUNTIME_DIR_FILE] {
        let _ = rfs::unlinkat(dir, file, AtFlags::empty());
    }
    let _ = rfs::unlinkat(parent, name, AtFlags::REMOVEDIR);
}

/// Removes staging directories that attaches killed before they could
/// left behind: this user's, of processes that no longer exist.
fn remove_stale(parent: &OwnedFd) {
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    let Ok(listing) = rfs::openat(
        parent,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(entries) = rfs::Dir::read_from(&listing) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix("devtrace-attach-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if crate::ring::pid_alive(pid) {
            continue;
        }
        let Ok(dir) = rfs::openat(
            parent,
            name.as_str(),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        if rfs::fstat(&dir).is_ok_and(|stat| stat.st_uid == own) {
            remove(parent, &dir, &name);
        }
    }
}
