//! One agent per runtime directory. Two agents on one directory would
//! split its workloads between them (each ring takes one consumer), and a
//! capture from either would silently lack the other's processes; so the
//! CUDA backend holds an exclusive lock on a file of its own in the
//! directory while it runs, and a second agent's CUDA backend refuses to
//! start, naming the first as the kernel lists its lock (`/proc/locks`).
//!
//! The directory is writable by every user, so the lock file must be one
//! no one else can hold: the agent's own (mode 0600, which others cannot
//! open, so cannot lock), with one link. Another user's agent sees root's
//! (or its own user's) file held and stands back; a file of any other user
//! is removed where the agent may (root, or the directory's owner, in the
//! sticky directory), and otherwise the agent runs unguarded and says so:
//! no other user's file keeps the agent from starting. So a root agent
//! takes a directory a user's agent holds, never the other way round.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::model::host_process;

/// The lock file's name (no workload file looks like it).
pub const LOCK_FILE: &str = ".agent.lock";

/// How long a held lock is tried again: an agent stopping as this one
/// starts lets go within it.
const WAIT_FOR_HOLDER: Duration = Duration::from_secs(1);

/// The lock, held until dropped (or the process ends).
#[derive(Debug)]
pub struct AgentLock {
    _file: File,
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LockError {
    /// Another agent holds it: its pid as the kernel tells it, where this
    /// process can see that process.
    #[error(
        "another devtrace agent{} serves the runtime directory {dir}: the workloads' rings would be \
         split between the two, each capture missing the other's processes; stop it, or give this \
         agent its own --runtime-dir (and its workloads the same DEVTRACE_RUNTIME_DIR)",
        holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
    )]
    Held { dir: String, holder: Option<u32> },
    /// The lock file is not the agent's and could not be replaced: the
    /// agent runs without the guard.
    #[error("{0}")]
    Unguarded(String),
}

/// Why the lock file was not opened as the agent's own.
enum Refusal {
    /// Another user's file, a link, a directory: not the agent's.
    NotOurs(String),
    /// Opening failed for a reason of this process's (no descriptors, ...).
    Failed(String),
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
    let held = |holder| LockError::Held {
        dir: dir.display().to_string(),
        holder,
    };
    let give_up = Instant::now() + WAIT_FOR_HOLDER;
    let mut replaced = false;
    loop {
        let refusal = match open_own(&path) {
            Ok(mut file) => match lock(&file) {
                // The file locked must still be the one at the path: an
                // agent replacing a stranger's file may have replaced it.
                Ok(()) if same_file(&file, &path) => {
                    let written = file
                        .set_len(0)
                        .and_then(|()| file.rewind())
                        .and_then(|()| writeln!(file, "{}", std::process::id()));
                    if let Err(error) = written {
                        tracing::debug!(%error, "the agent's pid was not written to its lock file");
                    }
                    return Ok(AgentLock { _file: file });
                }
                // Replaced again and again: only another agent replacing
                // the file could, and it serves the directory then.
                Ok(()) if Instant::now() >= give_up => {
                    let holder = std::fs::symlink_metadata(&path)
                        .ok()
                        .and_then(|meta| flock_holder(&meta));
                    return Err(held(holder.flatten()));
                }
                Ok(()) => continue,
                Err(error) if error.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                    if Instant::now() < give_up {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    let holder = file.metadata().ok().and_then(|meta| flock_holder(&meta));
                    return Err(held(holder.flatten()));
                }
                Err(error) => {
                    return Err(unguarded(format!("locking {}: {error}", path.display())))
                }
            },
            Err(Refusal::Failed(why)) => return Err(unguarded(why)),
            Err(Refusal::NotOurs(why)) => why,
        };
        // Another agent's file that this one may not open (root's, seen by
        // an agent of another user), held: that agent serves the directory.
        if let Some(holder) = std::fs::symlink_metadata(&path)
            .ok()
            .filter(trusted)
            .and_then(|meta| flock_holder(&meta))
        {
            if Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            return Err(held(holder));
        }
        // A stranger's: removed where this agent may, then made anew.
        if replaced {
            return Err(unguarded(refusal));
        }
        replaced = true;
        if let Err(error) = std::fs::remove_file(&path) {
            return Err(unguarded(format!(
                "{refusal}, and removing it failed: {error}"
            )));
        }
    }
}

fn lock(file: &File) -> std::io::Result<()> {
    // SAFETY: flock on a descriptor this process owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(open), Ok(named)) => (open.dev(), open.ino()) == (named.dev(), named.ino()),
        _ => false,
    }
}

/// Whether a lock file may be an agent's: a regular file of root or of this
/// process's user, one link, that no one else can open.
fn trusted(meta: &Metadata) -> bool {
    // SAFETY: geteuid has no preconditions.
    let agent = unsafe { libc::geteuid() };
    meta.file_type().is_file()
        && (meta.uid() == 0 || meta.uid() == agent)
        && meta.nlink() == 1
        && meta.mode() & 0o077 == 0
}

/// Opens (or makes) the lock file, if it is the agent's own.
fn open_own(path: &Path) -> Result<File, Refusal> {
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let file = match opened {
        Ok(file) => file,
        // Another user's file (or, with fs.protected_regular, one this
        // user may not open with O_CREAT), a symbolic link, a directory.
        Err(error)
            if matches!(
                error.raw_os_error(),
                Some(libc::EACCES | libc::EPERM | libc::ELOOP | libc::EISDIR | libc::ENXIO)
            ) =>
        {
            return Err(Refusal::NotOurs(format!(
                "opening {}: {error}",
                path.display()
            )))
        }
        Err(error) => {
            return Err(Refusal::Failed(format!(
                "opening {}: {error}",
                path.display()
            )))
        }
    };
    let meta = file
        .metadata()
        .map_err(|error| Refusal::Failed(format!("reading {}: {error}", path.display())))?;
    // SAFETY: geteuid has no preconditions.
    let agent = unsafe { libc::geteuid() };
    if !trusted(&meta) || meta.uid() != agent {
        return Err(Refusal::NotOurs(format!(
            "{} is not this agent's (owner uid {}, mode {:o}, {} links)",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777,
            meta.nlink()
        )));
    }
    Ok(file)
}

/// Whether some process holds a flock on the file `meta` describes, as
/// the kernel lists locks ([`host_process::lock_holders`]), and its pid
/// where this process can see it. No lock is taken to find out, so that
/// asking cannot get in the way of an agent taking it. Any flock counts:
/// only an agent can open the file, and any lock keeps the next agent
/// from its exclusive one.
fn flock_holder(meta: &Metadata) -> Option<Option<u32>> {
    let holders = host_process::lock_holders(meta.dev(), meta.ino()).ok()?;
    if holders.is_empty() {
        return None;
    }
    // 0: a holder in a pid namespace this process cannot see.
    Some(holders.into_iter().find(|pid| *pid > 0))
}

/// The agent holding `dir`'s lock now, if one does, with its pid where
/// this process can see it (for `devtrace doctor`, whatever its user).
pub fn holder(dir: &Path) -> Option<Option<u32>> {
    let meta = std::fs::symlink_metadata(dir.join(LOCK_FILE)).ok()?;
    if !trusted(&meta) {
        return None;
    }
    flock_holder(&meta)
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

    /// util-linux's flock(1) holding an exclusive lock on `path`, as
    /// another process would (its command does not inherit it: --close);
    /// returned once the kernel lists the lock.
    fn held_elsewhere(path: &Path) -> std::process::Child {
        let child = std::process::Command::new("flock")
            .args([
                "--exclusive",
                "--close",
                path.to_str().unwrap(),
                "sleep",
                "30",
            ])
            .spawn()
            .expect("flock(1)");
        let meta = std::fs::symlink_metadata(path).unwrap();
        let give_up = Instant::now() + Duration::from_secs(10);
        while flock_holder(&meta).is_none() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(10));
        }
        child
    }

    #[test]
    fn an_agent_in_another_process_is_named_by_the_kernel() {
        let dir = runtime();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, b"1\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut other = held_elsewhere(&path);
        let held_by = holder(dir.path());
        let taken = take(dir.path());
        let _ = other.kill();
        let _ = other.wait();
        // The pid is the kernel's, not the file's "1".
        assert_eq!(held_by, Some(Some(other.id())));
        match taken {
            Err(LockError::Held { holder, .. }) => assert_eq!(holder, Some(other.id())),
            other => panic!("the other agent's lock was not seen: {other:?}"),
        }
        // Once it is gone, the lock is this agent's.
        assert!(take(dir.path()).is_ok());
    }

    #[test]
    fn a_lock_file_of_another_user_is_replaced() {
        let dir = runtime();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path we own.
        if unsafe { libc::chown(name.as_ptr(), 65534, 65534) } != 0 {
            eprintln!("skipped: chown needs root");
            return;
        }
        // Another user's file is no agent's even when locked: it cannot
        // keep this agent from starting.
        let mut stranger = held_elsewhere(&path);
        let taken = take(dir.path());
        let _ = stranger.kill();
        let _ = stranger.wait();
        assert!(taken.is_ok(), "{taken:?}");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        // SAFETY: geteuid has no preconditions.
        assert_eq!(meta.uid(), unsafe { libc::geteuid() });
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
