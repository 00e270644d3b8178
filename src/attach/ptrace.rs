//! The tracer side of an attach: one thread of the target seized and
//! stopped (`PTRACE_SEIZE` and `PTRACE_INTERRUPT`, which send no signal the
//! target could see), its registers read and set, one instruction stepped,
//! its memory read and written through `/proc/PID/mem`, and let go. Every
//! wait but a step's is bounded. A tracer thread that ends lets the kernel
//! detach its tracee, which then runs on with whatever registers it was
//! last given: each attach runs on a thread of its own for that reason.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// What went wrong with the tracee.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{call} failed: {error}")]
    Call {
        call: &'static str,
        error: std::io::Error,
    },
    #[error("it did not stop within {0:?} (a thread in uninterruptible sleep, or frozen)")]
    NoStop(Duration),
    #[error("it exited during the attach")]
    Exited,
    #[error("a step stopped for signal {0} instead of its trap (the signal is delivered)")]
    Signalled(i32),
    #[error("it is stopped (signal {0}, as by SIGSTOP or a debugger's job control): attach once it runs")]
    GroupStopped(i32),
}

fn call(name: &'static str, result: libc::c_long) -> Result<libc::c_long, TraceError> {
    if result == -1 {
        return Err(TraceError::Call {
            call: name,
            error: std::io::Error::last_os_error(),
        });
    }
    Ok(result)
}

/// Where a thread's `struct rseq` is.
pub enum RseqArea {
    Registered(u64),
    /// The thread registered none.
    None,
    /// The kernel does not say (before Linux 5.13).
    Unknown,
}

/// A seized, stopped thread of the target. Dropped, it is let go (with
/// whatever registers it has then).
pub struct Stopped {
    tid: i32,
    memory: File,
    detached: bool,
    /// A signal that arrived instead of a step's trap, delivered when the
    /// thread is let go.
    pending_signal: i32,
}

/// How long a step is waited for: as good as forever.
const STEP_PATIENCE: Duration = Duration::from_secs(24 * 3600);

/// `PTRACE_EVENT_STOP`: the stop `PTRACE_INTERRUPT` asks for.
const EVENT_STOP: i32 = 128;

impl Stopped {
    /// Seizes thread `tid` of process `pid` and waits until it stops, at
    /// most `limit`.
    pub fn seize(pid: i32, tid: i32, limit: Duration) -> Result<Stopped, TraceError> {
        let memory = File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .map_err(|error| TraceError::Call {
                call: "opening /proc/PID/mem",
                error,
            })?;
        // SAFETY: plain ptrace requests on a thread id; no pointers.
        call("PTRACE_SEIZE", unsafe {
            libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0)
        })?;
        let mut stopped = Stopped {
            tid,
            memory,
            detached: false,
            pending_signal: 0,
        };
        stopped.stop_now(limit)?;
        Ok(stopped)
    }

    /// Stops the running tracee (`PTRACE_INTERRUPT`) and waits for that
    /// stop, at most `limit`. A signal that arrives first is passed on to
    /// it, as if no one were tracing, and the wait goes on.
    fn stop_now(&mut self, limit: Duration) -> Result<(), TraceError> {
        // SAFETY: a plain ptrace request on our tracee.
        call("PTRACE_INTERRUPT", unsafe {
            libc::ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0)
        })?;
        let deadline = Instant::now() + limit;
        loop {
            let status = self.wait(deadline.saturating_duration_since(Instant::now()))?;
            if (status >> 16) == EVENT_STOP {
                // A group-stop (SIGSTOP and the like) reads as the same event,
                // with its signal: the process was stopped, not by us.
                return match libc::WSTOPSIG(status) {
                    libc::SIGTRAP => Ok(()),
                    signal => Err(TraceError::GroupStopped(signal)),
                };
            }
            let signal = libc::WSTOPSIG(status);
            // SAFETY: our tracee, in a signal-delivery-stop for `signal`.
            call("PTRACE_CONT", unsafe {
                libc::ptrace(libc::PTRACE_CONT, self.tid, 0, signal as libc::c_long)
            })?;
        }
    }

    /// Lets the tracee run from the registers it has and stops it again:
    /// from a stop after a step (which a dying tracer would leave with a
    /// SIGTRAP to deliver) to one a dying tracer leaves harmless.
    pub fn resume_and_stop(&mut self, limit: Duration) -> Result<(), TraceError> {
        self.run_for(Duration::ZERO, limit)
    }

    /// As [`Self::resume_and_stop`], letting it run `pause` first.
    pub fn run_for(&mut self, pause: Duration, limit: Duration) -> Result<(), TraceError> {
        // SAFETY: our stopped tracee; no signal is delivered.
        call("PTRACE_CONT", unsafe {
            libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0)
        })?;
        std::thread::sleep(pause);
        self.stop_now(limit)
    }

    /// Waits for the tracee's next stop, at most `limit`; its status.
    fn wait(&mut self, limit: Duration) -> Result<i32, TraceError> {
        let deadline = Instant::now() + limit;
        loop {
            let mut status = 0;
            // SAFETY: `status` is a valid out pointer.
            let got = unsafe { libc::waitpid(self.tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if got == self.tid {
                if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                    self.detached = true;
                    return Err(TraceError::Exited);
                }
                if libc::WIFSTOPPED(status) {
                    return Ok(status);
                }
            }
            if got == -1 {
                return Err(TraceError::Call {
                    call: "waitpid",
                    error: std::io::Error::last_os_error(),
                });
            }
            if Instant::now() >= deadline {
                return Err(TraceError::NoStop(limit));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn registers(&self) -> Result<libc::user_regs_struct, TraceError> {
        // SAFETY: all-zero is a valid user_regs_struct, which the kernel
        // fills.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: a stopped tracee and a valid out pointer.
        call("PTRACE_GETREGS", unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGS,
                self.tid,
                0,
                &mut regs as *mut libc::user_regs_struct,
            )
        })?;
        Ok(regs)
    }

    pub fn set_registers(&self, regs: &libc::user_regs_struct) -> Result<(), TraceError> {
        // SAFETY: a stopped tracee and a valid pointer.
        call("PTRACE_SETREGS", unsafe {
            libc::ptrace(
                libc::PTRACE_SETREGS,
                self.tid,
                0,
                regs as *const libc::user_regs_struct,
            )
        })?;
        Ok(())
    }

    /// Runs one instruction and waits for the stop after it, however long
    /// that takes: a thread running borrowed registers must not be let go
    /// before it is back (a system call stepped over blocks at most as
    /// long as the kernel makes it).
    pub fn step(&mut self) -> Result<(), TraceError> {
        // SAFETY: a stopped tracee; no signal is delivered.
        call("PTRACE_SINGLESTEP", unsafe {
            libc::ptrace(libc::PTRACE_SINGLESTEP, self.tid, 0, 0)
        })?;
        let status = self.wait(STEP_PATIENCE)?;
        match libc::WSTOPSIG(status) {
            libc::SIGTRAP => Ok(()),
            other => {
                self.pending_signal = other;
                Err(TraceError::Signalled(other))
            }
        }
    }

    /// Where the thread's `struct rseq` is, as the kernel says
    /// (`PTRACE_GET_RSEQ_CONFIGURATION`, Linux 5.13).
    pub fn rseq_area(&self) -> RseqArea {
        /// `struct ptrace_rseq_configuration`.
        #[repr(C)]
        struct RseqConfiguration {
            area: u64,
            size: u32,
            signature: u32,
            flags: u32,
            pad: u32,
        }
        const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;
        let mut configuration = RseqConfiguration {
            area: 0,
            size: 0,
            signature: 0,
            flags: 0,
            pad: 0,
        };
        // SAFETY: a stopped tracee; the kernel writes at most the size
        // given into `configuration`.
        let written = unsafe {
            libc::ptrace(
                PTRACE_GET_RSEQ_CONFIGURATION,
                self.tid,
                std::mem::size_of::<RseqConfiguration>(),
                &mut configuration as *mut RseqConfiguration,
            )
        };
        match (written > 0, configuration.area) {
            (false, _) => RseqArea::Unknown,
            (true, 0) => RseqArea::None,
            (true, area) => RseqArea::Registered(area),
        }
    }

    pub fn read(&self, address: u64, into: &mut [u8]) -> Result<(), TraceError> {
        self.memory
            .read_exact_at(into, address)
            .map_err(|error| TraceError::Call {
                call: "reading /proc/PID/mem",
                error,
            })
    }

    pub fn write(&self, address: u64, bytes: &[u8]) -> Result<(), TraceError> {
        self.memory
            .write_all_at(bytes, address)
            .map_err(|error| TraceError::Call {
                call: "writing /proc/PID/mem",
                error,
            })
    }

    /// Lets the thread go, to run from the registers it has now.
    pub fn detach(mut self) {
        self.detach_with(self.pending_signal);
    }

    fn detach_with(&mut self, signal: i32) {
        if std::mem::replace(&mut self.detached, true) {
            return;
        }
        // SAFETY: our tracee; `signal` is 0 or the one it stopped for.
        unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0, signal as libc::c_long) };
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // A thread still running (its stop never came) cannot be detached
        // here; the attach's own thread ends right after, and the kernel
        // lets go of a dead tracer's tracees, pending stop and all.
        self.detach_with(self.pending_signal);
    }
}
