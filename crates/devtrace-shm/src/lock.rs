//! The lock a workload holds on its ring and metadata files while it lives,
//! by which the agent finds them in use (`host_process` in the agent).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Takes a shared lock on `file`, held until every descriptor of this open
/// file is closed: the file is then in use ([`in_use`]) while this process
/// (or a child that inherited the descriptor) lives.
pub fn hold_shared(file: &File) -> io::Result<()> {
    // Blocking: only a momentary exclusive lock of `in_use` can be in the way,
    // and only on a file others can open.
    // SAFETY: flock on a descriptor this process owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether some process holds a lock on `file` (opened by the caller for
/// this question alone; its own locks would not count).
pub fn in_use(file: &File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor this process owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        // SAFETY: as above; closing the file would release it too.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        return Ok(false);
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(true),
        _ => Err(error),
    }
}

/// Opens `path` to ask whether it is in use ([`in_use`]): read-only, without
/// following a link or blocking on a FIFO.
pub fn open_to_ask(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()
}

/// Whether the file at `path` is a regular file, older than `grace`, that no
/// process holds: one left by a process that died. Links are not followed
/// and a FIFO does not block.
pub fn abandoned(path: &Path, grace: std::time::Duration) -> bool {
    let Some(file) = open_to_ask(path) else {
        return false;
    };
    let old = file.metadata().ok().is_some_and(|meta| {
        meta.file_type().is_file()
            && meta
                .modified()
                .ok()
                .and_then(|modified| modified.elapsed().ok())
                .is_some_and(|age| age > grace)
    });
    old && matches!(in_use(&file), Ok(false))
}
