//! `devtrace attach`: loading the injection library into a CUDA process
//! that was started without it. One thread of the target is stopped
//! briefly, makes one page of memory (an `mmap` it runs one instruction
//! of), and is set to enter the code in that page ([`trampoline`]), which
//! calls the target's own `dlopen` on a copy of the library staged where
//! the target can reach it and then returns the thread to exactly where it
//! was, every register as it was (a system call it was blocked in is made
//! again). From then on the library works as if the process had been
//! started with it: it joins the runtime directory its staging names, and
//! captures switch CUPTI on and off in it mid-run.
//!
//! The target is stopped only for the setup (milliseconds, reported), and
//! never left stopped or broken by an agent that dies: the kernel lets a
//! dead tracer's tracee go, and every point where the tracer may die leaves
//! the thread either as it was or at the trampoline's entry, which needs
//! no tracer. The one exception is the single instruction of the `mmap`
//! (microseconds), during which the thread runs with borrowed registers.
//! What stays behind: the page (4 KiB, readable, writable and executable)
//! and the library itself, which detaches CUPTI after each capture.

mod ptrace;
pub mod rules;
mod safe_point;
mod stage;
mod target;
pub mod trampoline;
mod watch;

pub use watch::Watcher;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ptrace::{Stopped, TraceError};
use target::Target;

/// How an attach is made.
#[derive(Clone, Debug)]
pub struct AttachConfig {
    /// The injection library to load (copied for the target).
    pub library: PathBuf,
    /// The agent's runtime directory, which the library joins.
    pub runtime_dir: PathBuf,
    /// Where the copy is staged, as the target sees its filesystem.
    pub stage_dir: PathBuf,
    /// How long the thread may take to stop, and each step to run.
    pub stop_limit: Duration,
    /// How long the library may take to load once the thread runs again.
    pub load_limit: Duration,
}

impl AttachConfig {
    /// An attach of the library beside this program (else the image's)
    /// for the agent of `runtime_dir`, staged in `/tmp`, with the limits
    /// of `devtrace attach`'s defaults.
    pub fn for_runtime(runtime_dir: PathBuf, library: Option<PathBuf>) -> AttachConfig {
        AttachConfig {
            library: library.unwrap_or_else(default_library),
            runtime_dir,
            stage_dir: PathBuf::from("/tmp"),
            stop_limit: Duration::from_secs(2),
            load_limit: Duration::from_secs(30),
        }
    }
}

/// The injection library beside this program, else the image's.
pub fn default_library() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("libdevtrace_inject.so")))
        .filter(|beside| beside.is_file())
        .unwrap_or_else(|| PathBuf::from("/opt/devtrace/lib/libdevtrace_inject.so"))
}

/// An attach that loaded the library.
#[derive(Clone, Debug)]
pub struct Attached {
    /// The thread borrowed, and why that one.
    pub thread: String,
    /// How long that thread was stopped.
    pub stopped_for: Duration,
    /// From letting it go to `dlopen` returning.
    pub loaded_in: Duration,
}

/// Why a process was not attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("no such process")]
    NoProcess,
    #[error("the injection library is loaded in it already: nothing to do")]
    AlreadyInjected,
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Trace(#[from] TraceError),
    #[error("staging the library failed: {0}")]
    Stage(String),
    #[error(
        "its dlopen of the library returned NULL (a filesystem mounted noexec where it was \
         staged, or a library built for another glibc); --stage-dir chooses where"
    )]
    NotLoaded,
    #[error("the library had not loaded {0:?} after the thread was let go (the thread may be stopped or very busy); its staged copy was removed, so the load will fail if it still comes")]
    Slow(Duration),
}

/// How often the borrowed thread is let run and stopped again until it is
/// at a point where it may be borrowed ([`safe_point`]).
const SAFE_POINT_TRIES: u32 = 200;

/// The `mmap` the borrowed thread makes: one page, readable, writable and
/// executable, private and anonymous.
const MMAP: u64 = 9;
const PROT_RWX: u64 = 7;
const MAP_PRIVATE_ANONYMOUS: u64 = 0x22;

/// Loads the injection library into process `pid`.
pub fn attach(pid: i32, config: &AttachConfig) -> Result<Attached, AttachError> {
    attach_as(pid, config, None)
}

/// As [`attach`], refusing unless the process is `owner`'s when it is
/// stopped (so that a pid reused meanwhile is not taken for it).
pub fn attach_as(
    pid: i32,
    config: &AttachConfig,
    owner: Option<u32>,
) -> Result<Attached, AttachError> {
    static UNDER_WAY: Mutex<Vec<i32>> = Mutex::new(Vec::new());
    {
        let mut under_way = UNDER_WAY.lock().unwrap_or_else(|e| e.into_inner());
        if under_way.contains(&pid) {
            return Err(AttachError::Refused(
                "another attach of it is under way".into(),
            ));
        }
        under_way.push(pid);
    }
    // On a thread of its own, which ends with it: the kernel then lets go
    // of a tracee an error left behind (a stop that never came), rather
    // than leave it to stop for a tracer that no longer waits.
    let outcome = std::thread::scope(|scope| {
        scope
            .spawn(|| attach_here(pid, config, owner))
            .join()
            .unwrap_or_else(|_| Err(AttachError::Refused("the attach panicked".into())))
    });
    UNDER_WAY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|p| *p != pid);
    outcome
}

fn attach_here(
    pid: i32,
    config: &AttachConfig,
    owner: Option<u32>,
) -> Result<Attached, AttachError> {
    let target = Target::read(pid)?;
    target.check()?;
    let libc = target.libc()?;
    let code_region = target
        .libc_code()
        .cloned()
        .ok_or_else(|| AttachError::Refused("its libc has no executable mapping".into()))?;
    let xsave = trampoline::xsave_bytes()
        .ok_or_else(|| AttachError::Refused("this CPU or kernel has no XSAVE".into()))?;
    let staged = stage::Staged::new(pid, config, target.credentials())?;
    pause_at("staged");
    let borrowed = safe_point::pick_thread(pid);
    let tid = borrowed.tid;
    let runtime = safe_point::RuntimeCode::of(&target.maps);
    let started = Instant::now();
    let mut stopped = Stopped::seize(pid, tid, config.stop_limit).map_err(permission)?;
    target.still_the_same(tid, owner)?;
    pause_at("stopped");
    // Out of any restartable sequence before its instruction pointer is
    // borrowed for the `mmap`: the kernel would drop the sequence's guard.
    let mut tries = 0;
    let saved = settle(
        &mut stopped,
        &borrowed,
        config,
        &mut tries,
        |stopped, regs| {
            safe_point::in_restartable_sequence(stopped, regs, libc.rseq)
                .then_some("inside a restartable sequence")
        },
    )?;
    let gadget = find_syscall(&stopped, &code_region)?;
    let page = make_page(&mut stopped, &saved, gadget)?;
    // Stopped anew, at wherever its own code took it meanwhile, and let
    // run a little and stopped again until that is a point where it may
    // call `dlopen` (see `safe_point`).
    stopped.resume_and_stop(config.stop_limit)?;
    let saved = settle(
        &mut stopped,
        &borrowed,
        config,
        &mut tries,
        |stopped, regs| safe_point::unsafe_here(stopped, regs, &borrowed, &runtime, libc.rseq),
    )?;
    // Stopped once as seized, once after the mmap, and once per try.
    let thread = borrowed.describe(tries + 2);
    target.still_the_same(tid, owner)?;
    pause_at("mapped");
    let (entry, resume) = entry_registers(&saved, page);
    let code = trampoline::page(libc.dlopen, resume, staged.target_path(), xsave)
        .ok_or_else(|| AttachError::Stage("the staged path is too long".into()))?;
    stopped.write(page, &code)?;
    pause_at("written");
    stopped.set_registers(&entry)?;
    pause_at("switched");
    stopped.detach();
    let stopped_for = started.elapsed();
    pause_at("detached");
    let let_go = Instant::now();
    let loaded = wait_loaded(pid, page, config.load_limit);
    drop(staged);
    loaded?;
    Ok(Attached {
        thread,
        stopped_for,
        loaded_in: let_go.elapsed(),
    })
}

/// The stopped thread's registers once `not_here` finds nothing wrong
/// with where it is, letting it run 2 ms between stops; refused after
/// [`SAFE_POINT_TRIES`] stops in all (counted in `tries`).
fn settle(
    stopped: &mut Stopped,
    borrowed: &safe_point::Borrowed,
    config: &AttachConfig,
    tries: &mut u32,
    not_here: impl Fn(&Stopped, &libc::user_regs_struct) -> Option<&'static str>,
) -> Result<libc::user_regs_struct, AttachError> {
    loop {
        let regs = stopped.registers()?;
        let Some(why) = not_here(stopped, &regs) else {
            return Ok(regs);
        };
        *tries += 1;
        if *tries > SAFE_POINT_TRIES {
            return Err(AttachError::Refused(format!(
                "its thread {} was {why} at each of {SAFE_POINT_TRIES} stops; nothing was \
                 changed in it but at most one page of memory: attach again",
                borrowed.tid
            )));
        }
        stopped.run_for(Duration::from_millis(2), config.stop_limit)?;
    }
}

/// Whether a local caller who is `uid` may have process `pid` attached:
/// only a process it could trace itself (its own, in one group, with no
/// capabilities, dumpable), since the agent traces it with root's rights
/// on the caller's behalf. The refusal says why.
pub fn attachable_by(pid: i32, uid: u32) -> Result<(), String> {
    use crate::model::host_process;
    let only_admins = "only an admin may have it attached";
    let pid = u32::try_from(pid).map_err(|_| "it is not a process".to_string())?;
    let credentials = host_process::credentials(pid).ok_or("it does not exist")?;
    match host_process::sole_uid(credentials.uids) {
        Some(owner) if owner == uid => {}
        Some(owner) => return Err(format!("it is uid {owner}'s, not yours")),
        None => {
            return Err(format!(
                "it runs between users (set-user-ID): {only_admins}"
            ))
        }
    }
    let [real, effective, saved] = credentials.gids;
    if real != effective || effective != saved {
        return Err(format!(
            "it runs between groups (set-group-ID): {only_admins}"
        ));
    }
    if credentials.capabilities != 0 {
        return Err(format!("it holds capabilities: {only_admins}"));
    }
    if !host_process::dumpable(pid, uid) {
        return Err(format!(
            "it is not dumpable (it asked not to be inspected, or changed credentials): \
             {only_admins}"
        ));
    }
    Ok(())
}

/// A refusal to trace, said as what to do about it.
fn permission(error: TraceError) -> AttachError {
    match &error {
        TraceError::Call { call, error: io }
            if *call == "PTRACE_SEIZE" && io.raw_os_error() == Some(libc::EPERM) =>
        {
            AttachError::Refused(target::NOT_PERMITTED.into())
        }
        _ => AttachError::Trace(error),
    }
}

/// The address of a `syscall` instruction (0F 05) in `region`.
fn find_syscall(stopped: &Stopped, region: &target::Mapping) -> Result<u64, AttachError> {
    const CHUNK: usize = 64 << 10;
    let mut buffer = vec![0u8; CHUNK + 1];
    let mut at = region.start;
    while at < region.end {
        let len = ((region.end - at) as usize).min(CHUNK + 1);
        stopped.read(at, &mut buffer[..len])?;
        if let Some(i) = buffer[..len].windows(2).position(|w| w == [0x0F, 0x05]) {
            return Ok(at + i as u64);
        }
        at += CHUNK as u64;
    }
    Err(AttachError::Refused(
        "its libc's code holds no syscall instruction".into(),
    ))
}

/// Has the stopped thread map the trampoline's page (one instruction run
/// with borrowed registers), then gives it its own registers back
/// ([`safe_point::given_back`]: a wait the stop broke is made again, so
/// that the program never sees the `EINTR` some waits fail with after a
/// stop).
fn make_page(
    stopped: &mut Stopped,
    saved: &libc::user_regs_struct,
    gadget: u64,
) -> Result<u64, AttachError> {
    let mut call = *saved;
    call.rip = gadget;
    call.rax = MMAP;
    call.rdi = 0;
    call.rsi = trampoline::PAGE as u64;
    call.rdx = PROT_RWX;
    call.r10 = MAP_PRIVATE_ANONYMOUS;
    call.r8 = u64::MAX;
    call.r9 = 0;
    // Not a system call to restart: the kernel leaves these alone.
    call.orig_rax = u64::MAX;
    stopped.set_registers(&call)?;
    let stepped = stopped.step();
    let after = stopped.registers();
    stopped.set_registers(&safe_point::given_back(saved))?;
    stepped?;
    let address = after?.rax;
    if (address as i64) < 0 && (address as i64) > -4096 {
        return Err(AttachError::Refused(format!(
            "it may not map writable executable memory (errno {}: an SELinux execmem rule or \
             a seccomp policy)",
            -(address as i64)
        )));
    }
    Ok(address)
}

/// The registers the thread enters the trampoline with (its own, but the
/// instruction pointer), and where the trampoline resumes it: where it
/// was, or, when the stop interrupted a system call, at that call's
/// instruction with its number again ([`safe_point::made_again`]).
fn entry_registers(saved: &libc::user_regs_struct, page: u64) -> (libc::user_regs_struct, u64) {
    let mut entry = safe_point::made_again(saved);
    let resume = entry.rip;
    entry.rip = page;
    (entry, resume)
}

/// Waits until the trampoline says `dlopen` returned, at most `limit`.
fn wait_loaded(pid: i32, page: u64, limit: Duration) -> Result<(), AttachError> {
    use std::os::unix::fs::FileExt;
    let memory = std::fs::File::open(format!("/proc/{pid}/mem"))
        .map_err(|_| AttachError::Trace(TraceError::Exited))?;
    let deadline = Instant::now() + limit;
    let mut word = [0u8; 4];
    loop {
        if memory
            .read_exact_at(&mut word, page + trampoline::DONE_WORD as u64)
            .is_err()
        {
            return Err(AttachError::Trace(TraceError::Exited));
        }
        if u32::from_le_bytes(word) == trampoline::DONE {
            let mut result = [0u8; 8];
            memory
                .read_exact_at(&mut result, page + trampoline::RESULT as u64)
                .map_err(|_| AttachError::Trace(TraceError::Exited))?;
            return match u64::from_le_bytes(result) {
                0 => Err(AttachError::NotLoaded),
                _ => Ok(()),
            };
        }
        if Instant::now() >= deadline {
            return Err(AttachError::Slow(limit));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// For tests: stops the attach at `step` when `DEVTRACE_ATTACH_PAUSE_AT`
/// names it, so that a test can kill it there and see the target live on.
fn pause_at(step: &str) {
    if std::env::var("DEVTRACE_ATTACH_PAUSE_AT").is_ok_and(|at| at == step) {
        eprintln!("devtrace attach: paused at {step}");
        std::thread::sleep(Duration::from_secs(600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regs(rip: u64, rax: i64, orig_rax: i64) -> libc::user_regs_struct {
        let mut regs = safe_point::tests::regs(rip, rax, orig_rax);
        regs.rbx = 0xb;
        regs
    }

    #[test]
    fn the_trampoline_is_entered_with_the_threads_registers_and_resumes_it() {
        // Running user code: resumed where it was, rax untouched.
        let (entry, resume) = entry_registers(&regs(0x1000, 5, -1), 0x9000);
        assert_eq!(
            (entry.rip, resume, entry.rax, entry.rbx),
            (0x9000, 0x1000, 5, 0xb)
        );
        assert_eq!(entry.orig_rax, u64::MAX);
        // A futex wait (202) interrupted: made again.
        let (entry, resume) = entry_registers(&regs(0x1002, -512, 202), 0x9000);
        assert_eq!(
            (entry.rip, resume, entry.rax, entry.rbx),
            (0x9000, 0x1000, 202, 0xb)
        );
        assert_eq!(entry.orig_rax, u64::MAX);
    }
}
