//! The copy of the library an attach loads, staged where the target can
//! reach it (its own filesystem, which may be a container's): a new
//! directory, mode 0755, under `--stage-dir` as the target sees it,
//! holding the library and a `runtime-dir` file that names the agent's
//! runtime directory (a running process's environment cannot be given
//! one). Every file operation is made with the target's owner's rights
//! (`crate::repository::acting`) and resolved inside the target's root
//! (`RESOLVE_IN_ROOT` from `/proc/PID/root`), so that neither a link nor a
//! mount its owner made can have the agent write or remove anything its
//! owner could not. Removed when dropped (only what was made here): a
//! library already loaded stays mapped.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};

use super::{AttachConfig, AttachError};
use crate::repository::acting::Credentials;
use crate::workload::ATTACH_RUNTIME_DIR_FILE;

/// The library's name in its staging directory.
const LIBRARY_NAME: &str = "libdevtrace_inject.so";

/// See the module documentation.
pub struct Staged {
    dir: OwnedFd,
    parent: OwnedFd,
    name: String,
    /// The files made in it.
    made: Vec<&'static str>,
    /// The target's owner's, which every file operation acts with.
    credentials: Credentials,
    /// The library's path as the target sees it.
    target_path: Vec<u8>,
}

fn stage_error(what: &str, error: impl std::fmt::Display) -> AttachError {
    AttachError::Stage(format!("{what}: {error}"))
}

fn acting_error(error: std::io::Error) -> AttachError {
    stage_error("acting as the target's owner", error)
}

impl Staged {
    pub fn new(
        pid: i32,
        config: &AttachConfig,
        credentials: Credentials,
    ) -> Result<Staged, AttachError> {
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
        // Opened as the agent (reaching another process's root needs it);
        // everything beneath, as the target's owner.
        let root = rfs::open(
            format!("/proc/{pid}/root"),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| stage_error("opening the target's root", e))?;
        let uid = credentials.uid;
        let (parent, dir, name) = credentials
            .run(|| -> Result<(OwnedFd, OwnedFd, String), AttachError> {
                let parent = rfs::openat2(
                    &root,
                    relative,
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
                )
                .map_err(|e| {
                    stage_error(&format!("{} in the target", config.stage_dir.display()), e)
                })?;
                remove_stale(&parent, uid);
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
                Ok((parent, dir, name))
            })
            .map_err(acting_error)??;
        let mut staged = Staged {
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
            made: Vec::new(),
            credentials,
        };
        staged.write(LIBRARY_NAME, &library, 0o644)?;
        staged.write(ATTACH_RUNTIME_DIR_FILE, runtime.as_bytes(), 0o644)?;
        Ok(staged)
    }

    fn write(&mut self, name: &'static str, bytes: &[u8], mode: u32) -> Result<(), AttachError> {
        let dir = &self.dir;
        let created = AtomicBool::new(false);
        let written = self
            .credentials
            .run(|| {
                let fd = rfs::openat(
                    dir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(mode),
                )
                .map_err(|e| stage_error(&format!("creating {name}"), e))?;
                created.store(true, Ordering::Relaxed);
                std::fs::File::from(fd)
                    .write_all(bytes)
                    .map_err(|e| stage_error(&format!("writing {name}"), e))
            })
            .map_err(acting_error)?;
        // Only what was made here is removed.
        if created.load(Ordering::Relaxed) {
            self.made.push(name);
        }
        written
    }

    /// The library's path as the target sees it.
    pub fn target_path(&self) -> &[u8] {
        &self.target_path
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let (parent, dir, name, made) = (&self.parent, &self.dir, &self.name, &self.made);
        let _ = self.credentials.run(|| remove(parent, dir, name, made));
    }
}

/// Removes `files` of the staging directory `name` in `parent`, then the
/// directory (which fails, leaving it, when anything else is in it).
fn remove(parent: &OwnedFd, dir: &OwnedFd, name: &str, files: &[&str]) {
    for file in files {
        let _ = rfs::unlinkat(dir, *file, AtFlags::empty());
    }
    let _ = rfs::unlinkat(parent, name, AtFlags::REMOVEDIR);
}

/// Removes staging directories that attaches killed before they could
/// left behind: those of user `own` (the target's owner, acting), of
/// processes that no longer exist.
fn remove_stale(parent: &OwnedFd, own: u32) {
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
            remove(
                parent,
                &dir,
                &name,
                &[LIBRARY_NAME, ATTACH_RUNTIME_DIR_FILE],
            );
        }
    }
}
