//! Checks that load a vendor library (NVML, the CUDA driver, libcupti,
//! libtpu) run in a child process: a library whose initialisers hang or
//! crash (a GPU fallen off the bus hangs NVML as it hangs `nvidia-smi`)
//! then costs doctor that one check, with the reason, instead of its run.
//! Doctor is single-threaded when it checks, so the child, a fork, has all
//! of it; it closes every descriptor but its pipe (it must not hold the
//! parent's sockets), sends its finding back with its length first and
//! exits at once. A child stuck in the kernel is left behind, not waited
//! for.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::{Area, Finding, Status};

/// How long a check may take before it is taken for hung.
pub const CHECK_LIMIT: Duration = Duration::from_secs(20);

/// `check`'s finding, from a child process; `area` and `item` name it
/// when the child hangs past `limit` or dies without answering.
pub fn isolated(
    area: Area,
    item: &str,
    limit: Duration,
    check: impl FnOnce() -> Finding,
) -> Finding {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return check();
    }
    // SAFETY: both were just opened and are owned here alone.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: doctor forks while single-threaded; the child only runs the
    // check, writes to the pipe and leaves with _exit (no exit handlers,
    // no buffers of the parent's flushed twice).
    let child = unsafe { libc::fork() };
    if child < 0 {
        return check();
    }
    if child == 0 {
        drop(reader);
        close_all_but(writer.as_raw_fd());
        // A panic must not unwind into the parent's code in this child.
        let finding = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check));
        let Ok(finding) = finding else {
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(1) };
        };
        let body = encode(&finding);
        let mut answer = (body.len() as u32).to_le_bytes().to_vec();
        answer.extend_from_slice(&body);
        let mut written = 0;
        while written < answer.len() {
            // SAFETY: writes from a live buffer to the pipe's write end.
            let n = unsafe {
                libc::write(
                    writer.as_raw_fd(),
                    answer[written..].as_ptr().cast(),
                    answer.len() - written,
                )
            };
            if n <= 0 {
                break;
            }
            written += n as usize;
        }
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    drop(writer);
    let answer = read_until(reader, Instant::now() + limit);
    let finished = answer.is_some();
    if !finished {
        // SAFETY: the child is ours and not yet reaped.
        unsafe { libc::kill(child, libc::SIGKILL) };
    }
    let status = reap(child, Duration::from_secs(1));
    if let Some(finding) = answer.as_deref().and_then(decode) {
        return finding;
    }
    let detail = match status {
        _ if !finished => format!(
            "did not finish within {} s (a library that hangs as it loads or initialises: a \
             device in a bad state hangs its driver's library, as a GPU's hangs NVML and \
             nvidia-smi alike)",
            limit.as_secs()
        ),
        Some(status) if libc::WIFSIGNALED(status) => format!(
            "crashed (signal {}) loading or asking its library",
            libc::WTERMSIG(status)
        ),
        _ => "ended without an answer".to_string(),
    };
    Finding::new(area, item, Status::Fail, detail)
        .hint("see whether the device vendor's own tool (nvidia-smi, say) answers on this host")
}

/// Closes every descriptor of the child but stdio and `keep`: it must not
/// hold the parent's sockets and files (a listener doctor let go of, say)
/// while its check runs.
fn close_all_but(keep: libc::c_int) {
    let keep = keep as libc::c_uint;
    // SAFETY: close_range only closes descriptors of this process.
    let closed = unsafe {
        (keep <= 3 || libc::syscall(libc::SYS_close_range, 3u32, keep - 1, 0u32) == 0)
            && libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0u32) == 0
    };
    if !closed {
        for fd in (3..4096).filter(|fd| *fd != keep as libc::c_int) {
            // SAFETY: closing a descriptor that may not be open is harmless.
            unsafe { libc::close(fd) };
        }
    }
}

/// The child's wait status, waiting at most `grace` for it: one stuck in
/// the kernel (a driver call that never returns) cannot be killed until it
/// returns, and is left behind rather than waited for.
fn reap(child: libc::pid_t, grace: Duration) -> Option<libc::c_int> {
    let deadline = Instant::now() + grace;
    loop {
        let mut status = 0;
        // SAFETY: asks about our own child without blocking.
        let reaped = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if reaped == child {
            return Some(status);
        }
        let interrupted =
            reaped < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
        if (reaped < 0 && !interrupted) || Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The child's answer (after its length), once all of it came, unless
/// `deadline` comes first; not waiting for the pipe's end, which a thread
/// or child the library left behind may hold open.
fn read_until(reader: OwnedFd, deadline: Instant) -> Option<Vec<u8>> {
    let mut file = std::fs::File::from(reader);
    let mut answer = Vec::new();
    loop {
        if let Some(length) = answer.get(..4) {
            let length = u32::from_le_bytes(length.try_into().ok()?) as usize;
            if answer.len() >= 4 + length {
                return Some(answer[4..4 + length].to_vec());
            }
        }
        let left = deadline.checked_duration_since(Instant::now())?;
        let mut poll = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: polls one descriptor we own.
        if unsafe { libc::poll(&mut poll, 1, ms) } < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
        if poll.revents == 0 {
            continue;
        }
        let mut chunk = [0u8; 4096];
        match file.read(&mut chunk) {
            // Ended before the whole answer: the child died.
            Ok(0) => return Some(Vec::new()),
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// A finding as the child sends it: as `--json` prints it.
fn encode(finding: &Finding) -> Vec<u8> {
    finding.json().to_string().into_bytes()
}

fn decode(bytes: &[u8]) -> Option<Finding> {
    Finding::from_json(&serde_json::from_slice(bytes).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_check_answers_from_a_child_and_one_that_hangs_or_crashes_is_named() {
        let found = isolated(Area::Cuda, "CUDA driver", CHECK_LIMIT, || {
            Finding::new(Area::Cuda, "CUDA driver", Status::Warn, "from the child").hint("a hint")
        });
        assert_eq!(
            (found.status, found.detail.as_str(), found.hint.as_deref()),
            (Status::Warn, "from the child", Some("a hint"))
        );
        assert_ne!(found.item, "", "the child's item comes back: {found:?}");
        let hung = isolated(Area::Nvml, "NVML", Duration::from_millis(200), || {
            std::thread::sleep(Duration::from_secs(600));
            Finding::new(Area::Nvml, "NVML", Status::Ok, "never")
        });
        assert_eq!(hung.status, Status::Fail);
        assert!(hung.detail.starts_with("did not finish within"), "{hung:?}");
        let crashed = isolated(Area::Tpu, "libtpu", CHECK_LIMIT, || {
            std::process::abort();
        });
        assert_eq!(crashed.status, Status::Fail);
        assert_eq!(crashed.item, "libtpu");
        assert!(
            crashed
                .detail
                .starts_with(&format!("crashed (signal {})", libc::SIGABRT)),
            "{crashed:?}"
        );
    }
}
