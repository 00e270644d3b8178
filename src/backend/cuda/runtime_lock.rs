//! One agent per runtime directory. Two agents on one directory would
//! split its workloads between them (each ring takes one consumer), and a
//! capture from either would silently lack the other's processes; so the
//! CUDA backend holds an exclusive lock on a file of its own in the
//! directory while it runs, and a second agent's CUDA backend refuses to
//! start, naming the first.
//!
//! The directory is writable by every user, so the lock file must be one
//! no one else can hold: the agent's own (mode 0600, which others cannot
//! open, so cannot lock), with one link. A file of that name that is not
//! the agent's is removed where the agent may (root, in the sticky
//! directory), and otherwise the agent runs unguarded and says so: another
//! user's file must not keep the agent from starting.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The lock file's name (no workload file looks like it).
pub const LOCK_FILE: &str = ".agent.lock";

/// The lock, held until dropped (or the process ends).
#[derive(Debug)]
pub struct AgentLock {
    _file: File,
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LockError {
    /// Another agent holds it: its pid, as it wrote it.
    #[error(
        "another devtrace agent{} serves the runtime directory {dir}: the workloads' rings would be \
         split between the two, each capture missing the other's processes; stop it, or give this \
         agent its own --runtime-dir (and its workloads the same DEVTRACE_RUNTIME_DIR)",
        holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
    )]
    Held { dir: String, holder: Option<u32> },
    /// The lock file is not the agent's and could not be removed: the
    /// agent runs without the guard.
    #[error("{0}")]
    Unguarded(String),
}

/// Takes the lock on `dir`.
pub fn take(dir: &Path) -> Result<AgentLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let unguarded = |why: String| {
        LockError::Unguarded(format!(
            "a second agent on {} would not be noticed: {why}",
            dir.display()
        ))
    };
    let mut removed = false;
    let mut file = loop {
        match open_own(&path) {
            Ok(file) => break file,
            Err(why) if !removed => {
                // Not the agent's: removed where it may be, then made anew.
                removed = true;
                if let Err(error) = std::fs::remove_file(&path) {
                    return Err(unguarded(format!("{why}, and removing it failed: {error}")));
                }
            }
            Err(why) => return Err(unguarded(why)),
        }
    };
    // SAFETY: flock on a descriptor this process owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(unguarded(format!("locking {}: {error}", path.display())));
        }
        let mut text = String::new();
        let holder = (&file)
            .take(32)
            .read_to_string(&mut text)
            .ok()
            .and_then(|_| text.trim().parse().ok());
        return Err(LockError::Held {
            dir: dir.display().to_string(),
            holder,
        });
    }
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    if let Err(error) = written {
        tracing::debug!(%error, "the agent's pid was not written to its lock file");
    }
    Ok(AgentLock { _file: file })
}

/// Opens (or makes) the lock file, if it is the agent's own: a regular
/// file of this user, one link, that others cannot open.
fn open_own(path: &Path) -> Result<File, String> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|error| format!("opening {}: {error}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|error| format!("reading {}: {error}", path.display()))?;
    // SAFETY: geteuid has no preconditions.
    let agent = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != agent || meta.nlink() != 1 || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} is not this agent's (owner uid {}, mode {:o}, {} links)",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777,
            meta.nlink()
        ));
    }
    Ok(file)
}

/// The pid of the agent holding `dir`'s lock now, if one does (for
/// `devtrace doctor`; a lock file it cannot open counts as none).
pub fn holder(dir: &Path) -> Option<Option<u32>> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    // SAFETY: flock on a descriptor this process owns, released at once.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        return None;
    }
    let mut text = String::new();
    Some(
        (&file)
            .take(32)
            .read_to_string(&mut text)
            .ok()
            .and_then(|_| text.trim().parse().ok()),
    )
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn runtime() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        dir
    }

    #[test]
    fn a_second_agent_is_refused_until_the_first_lets_go() {
        let dir = runtime();
        let first = take(dir.path()).unwrap();
        assert_eq!(holder(dir.path()), Some(Some(std::process::id())));
        // flock locks belong to the open file: a second open is a second
        // agent, even in one process.
        match take(dir.path()) {
            Err(LockError::Held { holder, .. }) => assert_eq!(holder, Some(std::process::id())),
            other => panic!("a second agent was let in: {other:?}"),
        }
        drop(first);
        assert_eq!(holder(dir.path()), None);
        let again = take(dir.path()).unwrap();
        drop(again);
    }

    #[test]
    fn a_lock_file_that_is_not_the_agents_is_replaced_or_reported() {
        let dir = runtime();
        let path = dir.path().join(LOCK_FILE);
        // Readable by others: anyone could hold a lock on it.
        std::fs::write(&path, b"1\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let lock = take(dir.path()).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        drop(lock);
        // A symbolic link is never followed, and replaced.
        std::fs::remove_file(&path).unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let lock = take(dir.path()).unwrap();
        assert!(!std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"");
        drop(lock);
        // One that cannot be removed: the agent runs, unguarded, and says why.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("x"), b"").unwrap();
        match take(dir.path()) {
            Err(LockError::Unguarded(why)) => {
                assert!(why.contains("would not be noticed"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }
}
