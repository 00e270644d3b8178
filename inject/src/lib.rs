//! devtrace's CUDA injection library. A workload loads it with
//! `CUDA_INJECTION64_PATH` (the driver calls [`InitializeInjection`] from
//! `cuInit`) or `LD_PRELOAD`; it then streams the process's CUPTI activity
//! into a shared-memory ring that the devtrace agent drains.
//!
//! While no capture runs it costs nothing per CUDA call: CUPTI is detached,
//! and one thread waits on the ring's control word, which the agent wakes it
//! at when it changes, looking at it every `DEVTRACE_INJECT_POLL_MS` (20 ms)
//! anyway. When the agent sets the capture flag it
//! enables CUPTI's activity kinds and times the API calls that put work on
//! the GPU timeline from its own Callback API subscriber ([`timed_calls`]);
//! buffers CUPTI fills are converted to events on a second thread; when the
//! flag clears it disables them, takes its buffers back and finalizes CUPTI
//! ([`detach`]), so that the job runs as fast after a capture as before it.
//!
//! It must never crash or stall the workload: every failure (no libcupti, a
//! CUPTI error, a panic, an unwritable runtime directory) is logged once to
//! stderr and recorded in the metadata file when there is one, and the
//! library then ends what it had on, detaches CUPTI as after a capture, and
//! stays quiet for the rest of the process. Another CUPTI user
//! in the process (a framework profiler) is stepped aside for, never fought
//! ([`coexist`]).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

/// Writes one line to the job's standard error, whatever becomes of the
/// write. Never `eprintln!`, which panics when it fails (a pipe whose
/// reader is gone: Python ignores SIGPIPE), and the panic may be the second
/// in a guard already handling one, which aborts the job.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod buffers;
mod clock;
mod coexist;
mod control;
mod convert;
mod cupti;
mod detach;
mod driver;
mod ffi;
mod records;
mod runtime;
mod session;
mod sys;
mod timed_calls;
mod unanswered;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};

use devtrace_shm::workload::MetaRecord;

use session::Session;

static QUIET: AtomicBool = AtomicBool::new(false);
/// This is the child of a `fork`: only the forking thread lives on, the
/// control and converter threads do not, and any lock of the library (or of
/// libcupti) may have been held by a thread that is gone. The library stays
/// quiet there and makes no CUPTI call, at exit neither.
static FORKED: AtomicBool = AtomicBool::new(false);
/// The process is exiting: the driver and libcupti may be tearing down,
/// so the library's own threads make no driver call from then on.
static EXITING: AtomicBool = AtomicBool::new(false);
static START: Once = Once::new();
static SESSION: OnceLock<Session> = OnceLock::new();

/// Logs the first failure and silences the library.
fn fail(message: &str) {
    if !QUIET.swap(true, Ordering::SeqCst) {
        say!("devtrace-inject: {message}; tracing is off in this process");
        if let Some(session) = SESSION.get() {
            session.write_meta(&MetaRecord::Error {
                message: message.to_string(),
            });
        }
    }
}

fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

fn exiting() -> bool {
    EXITING.load(Ordering::Acquire)
}

/// Runs in the child of each `fork`.
extern "C" fn in_forked_child() {
    FORKED.store(true, Ordering::Relaxed);
    QUIET.store(true, Ordering::Relaxed);
    detach::disarm_in_child();
    timed_calls::stop();
}

/// Whether `DEVTRACE_INJECT_DEBUG` asks the library to say on stderr what
/// it does with CUPTI after each capture (read once).
fn debug_enabled() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("DEVTRACE_INJECT_DEBUG").is_some_and(|v| v != "0"))
}

/// Called by the CUDA driver from `cuInit` when `CUDA_INJECTION64_PATH`
/// names this library. Returns 1 (success) in every case: a failure here
/// must not fail the workload's `cuInit`.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> std::ffi::c_int {
    start();
    1
}

/// Runs when the library is loaded (by `LD_PRELOAD`, or by the driver just
/// before it calls [`InitializeInjection`]).
#[cfg(not(test))]
extern "C" fn on_load() {
    start();
}

// Not in this crate's unit-test binary, which is no workload.
#[cfg(not(test))]
#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

fn start() {
    ffi::guard("start-up", (), || START.call_once(start_once));
}

fn start_once() {
    // This library's panics are caught and reported once through
    // `fail`; the default hook would print each one into the
    // workload's stderr. (The hook is this library's own: the workload
    // and other Rust libraries keep theirs.)
    std::panic::set_hook(Box::new(|_| {}));
    // Before `dlopen` returns: a copy `devtrace attach` staged is removed
    // once it has.
    runtime::settle();
    sys::process::at_fork_child(in_forked_child);
    coexist::join_global_scope();
    coexist::redirect_callers();
    let spawned = std::thread::Builder::new()
        .name("devtrace-inject".into())
        .spawn(|| ffi::guard("the control thread", (), control::control_loop));
    if let Err(error) = spawned {
        fail(&format!("cannot start its thread: {error}"));
    }
}
