//! Where a thread of the target may be borrowed to run `dlopen`: the
//! thread, and the moment. `dlopen` takes the C library's locks: a thread
//! stopped while it holds malloc's would wait on itself for ever, and the
//! job with it; one inside the loader would re-enter it in the middle of
//! an update. So the thread is taken either blocked in a wait (which
//! holds none of them), or running code outside the libraries those locks
//! live in ([`RuntimeCode`]) and outside a restartable sequence (whose
//! per-CPU update would go on unguarded after the detour: the kernel
//! drops a sequence's guard when it finds the thread outside it).

use std::time::{Duration, Instant};

use super::ptrace::{RseqArea, Stopped};
use super::target::{base_name, Mapping};

/// System calls a thread blocks in that hold no lock of the C library's
/// (waits, sleeps, polls, reads): a thread stopped in one is at a point
/// where it may call `dlopen`.
const BLOCKING_CALLS: [u64; 14] = [
    0,   // read
    7,   // poll
    23,  // select
    35,  // nanosleep
    61,  // wait4
    202, // futex
    230, // clock_nanosleep
    232, // epoll_wait
    270, // pselect6
    271, // ppoll
    281, // epoll_pwait
    288, // accept4
    43,  // accept
    16,  // ioctl (a CUDA driver wait)
];

/// How long a thread blocked in a wait is looked for before the main
/// thread is borrowed instead: a job's threads wait often (a synchronize,
/// a queue), if only for moments.
const LOOK_FOR_A_WAIT: Duration = Duration::from_millis(250);

/// Waits the kernel fails with `EINTR` when their thread is stopped, even
/// with no signal handler to run (signal(7), "Interruption of system
/// calls and library functions by stop signals"), where the others are
/// left to be made again: epoll_wait and epoll_pwait, and reads and
/// accepts on a socket with a receive timeout.
const FAILED_BY_A_STOP: [u64; 5] = [232, 281, 0, 43, 288];

/// `-ERESTART*`: a system call the stop interrupted, to be made again.
const ERESTARTSYS: i64 = -512;
const ERESTARTNOINTR: i64 = -513;
const ERESTARTNOHAND: i64 = -514;
const ERESTART_RESTARTBLOCK: i64 = -516;
const RESTART_SYSCALL: u64 = 219;
const EINTR: i64 = -(libc::EINTR as i64);

/// The system call to make again for a thread stopped with `regs` in one
/// the stop interrupted (its own, or `restart_syscall` for a sleep with
/// time left), as the kernel would with no signal handler to run; `None`
/// when the thread was not in a system call, or it returned.
///
/// A wait of [`FAILED_BY_A_STOP`] is made again too, rather than answer
/// the program an `EINTR` that only the attach caused.
fn interrupted_call(regs: &libc::user_regs_struct) -> Option<u64> {
    if (regs.orig_rax as i64) < 0 {
        return None;
    }
    match regs.rax as i64 {
        ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND => Some(regs.orig_rax),
        ERESTART_RESTARTBLOCK => Some(RESTART_SYSCALL),
        EINTR if FAILED_BY_A_STOP.contains(&regs.orig_rax) => Some(regs.orig_rax),
        _ => None,
    }
}

/// The registers to let a stopped thread run on with, its own: a wait of
/// [`FAILED_BY_A_STOP`] that the stop failed is given the
/// `-ERESTARTNOHAND` the kernel leaves a wait it restarts, so that the
/// kernel decides as for any interrupted call: made again, or ended with
/// `EINTR` when a signal's handler runs first.
pub fn given_back(regs: &libc::user_regs_struct) -> libc::user_regs_struct {
    let mut back = *regs;
    // EINTR is an interrupted call only for a wait a stop fails.
    if regs.rax as i64 == EINTR && interrupted_call(regs).is_some() {
        back.rax = ERESTARTNOHAND as u64;
    }
    back
}

/// `regs` with the system call the stop interrupted to be made again as
/// the thread runs from them: at the call's instruction (`syscall` is two
/// bytes), with its number. Where the thread goes elsewhere first (the
/// trampoline), the kernel cannot decide at its return as it does for
/// [`given_back`]: a signal whose handler runs during the detour does not
/// end the wait it would have ended with `EINTR`.
pub fn made_again(regs: &libc::user_regs_struct) -> libc::user_regs_struct {
    let mut again = *regs;
    if let Some(call) = interrupted_call(regs) {
        again.rip = regs.rip - 2;
        again.rax = call;
    }
    // Not in a system call any more: the kernel leaves these alone.
    again.orig_rax = u64::MAX;
    again
}

/// Whether a thread stopped with `regs` was stopped in one of the
/// [`BLOCKING_CALLS`] (interrupted, to be made again).
pub fn in_blocking_call(regs: &libc::user_regs_struct) -> bool {
    interrupted_call(regs).is_some() && BLOCKING_CALLS.contains(&regs.orig_rax)
}

/// The thread an attach borrows.
pub struct Borrowed {
    pub tid: i32,
    /// Why that thread, for the report.
    why: String,
    /// It was picked for being blocked in a wait, and is taken only in one.
    pub waiting: bool,
}

impl Borrowed {
    /// Which thread was borrowed, why, and where, for the report: taken
    /// at stop `stop` (from 1).
    pub fn describe(&self, stop: u32) -> String {
        let tid = self.tid;
        match (self.waiting, stop) {
            (true, 1) => format!("thread {tid}, {}", self.why),
            (true, _) => format!(
                "thread {tid}, {} (back in its wait at stop {stop})",
                self.why
            ),
            (false, _) => format!(
                "the main thread {tid} ({}; taken at stop {stop}, outside the C library's code \
                 and any restartable sequence)",
                self.why
            ),
        }
    }
}

/// The thread to borrow: one blocked in a system call that holds no
/// library lock, looked for during [`LOOK_FOR_A_WAIT`], else the main
/// thread.
pub fn pick_thread(pid: i32) -> Borrowed {
    let deadline = Instant::now() + LOOK_FOR_A_WAIT;
    loop {
        if let Some((tid, number)) = blocked_thread(pid) {
            return Borrowed {
                tid,
                why: format!("blocked in system call {number}"),
                waiting: true,
            };
        }
        if Instant::now() >= deadline {
            return Borrowed {
                tid: pid,
                why: "no thread was blocked in a wait".into(),
                waiting: false,
            };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A thread of `pid` blocked in one of the [`BLOCKING_CALLS`] now, and
/// the call.
fn blocked_thread(pid: i32) -> Option<(i32, u64)> {
    let mut tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    tids.into_iter().find_map(|tid| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
        let number = text.split_whitespace().next()?.parse::<u64>().ok()?;
        BLOCKING_CALLS.contains(&number).then_some((tid, number))
    })
}

/// Libraries whose code may run with a lock `dlopen` takes held: the C
/// library and its loader (`ld-linux-x86-64.so.2`, or `ld-2.31.so` as
/// maps name it before glibc 2.34), the unwinders (which walk the loaded
/// objects under the loader's lock) and the allocators that replace
/// malloc.
const RUNTIME_LIBRARIES: [&str; 10] = [
    "libc.so",
    "libc-",
    "ld-",
    "libpthread",
    "libdl",
    "libgcc_s",
    "libunwind",
    "libjemalloc",
    "libtcmalloc",
    "libmimalloc",
];

/// The executable ranges of the target's [`RUNTIME_LIBRARIES`].
pub struct RuntimeCode(Vec<(u64, u64)>);

impl RuntimeCode {
    pub fn of(maps: &[Mapping]) -> RuntimeCode {
        RuntimeCode(
            maps.iter()
                .filter(|m| m.perms.contains('x'))
                .filter(|m| {
                    RUNTIME_LIBRARIES
                        .iter()
                        .any(|lib| base_name(&m.path).starts_with(lib))
                })
                .map(|m| (m.start, m.end))
                .collect(),
        )
    }

    fn holds(&self, address: u64) -> bool {
        self.0
            .iter()
            .any(|(start, end)| (*start..*end).contains(&address))
    }
}

/// Why the stopped thread may not be borrowed where it is now (`None`:
/// it may). `rseq` is where the target's libc keeps its
/// restartable-sequence variables ([`super::target::Libc::rseq`]).
pub fn unsafe_here(
    stopped: &Stopped,
    regs: &libc::user_regs_struct,
    borrowed: &Borrowed,
    runtime: &RuntimeCode,
    rseq: Option<(u64, u64)>,
) -> Option<&'static str> {
    if interrupted_call(regs).is_some() && !by_syscall_instruction(stopped, regs.rip) {
        // `int 0x80` from a 64-bit program: a 32-bit call, whose number
        // means another call here and is not made again as one.
        return Some("in a 32-bit system call");
    }
    if in_blocking_call(regs) {
        return None;
    }
    if borrowed.waiting {
        // Out of its wait, it may hold a lock its code took on waking.
        return Some("out of its wait");
    }
    if runtime.holds(regs.rip) {
        return Some("in the C library's code, where it may hold a lock dlopen takes");
    }
    if in_restartable_sequence(stopped, regs, rseq) {
        return Some("inside a restartable sequence");
    }
    None
}

/// Whether the system call a thread stopped at `rip` is in was made with
/// the `syscall` instruction (0F 05), just before `rip`.
fn by_syscall_instruction(stopped: &Stopped, rip: u64) -> bool {
    let mut instruction = [0u8; 2];
    rip.checked_sub(2)
        .is_some_and(|at| stopped.read(at, &mut instruction).is_ok())
        && instruction == [0x0F, 0x05]
}

/// Whether the stopped thread's instruction lies in the restartable
/// sequence it registered as under way. Its `struct rseq` is where the
/// kernel says (`PTRACE_GET_RSEQ_CONFIGURATION`, Linux 5.13), else where
/// glibc put it (`rseq`: its `__rseq_offset` from the thread pointer, when
/// its `__rseq_size` is not 0); a C library that registers none has none.
/// A sequence that cannot be read reads as inside one.
pub fn in_restartable_sequence(
    stopped: &Stopped,
    regs: &libc::user_regs_struct,
    rseq: Option<(u64, u64)>,
) -> bool {
    // Tests ask for the C library's word alone, as an older kernel gives.
    let from_kernel = if std::env::var_os("DEVTRACE_ATTACH_RSEQ_FROM_LIBC").is_some() {
        RseqArea::Unknown
    } else {
        stopped.rseq_area()
    };
    let area = match from_kernel {
        RseqArea::Registered(area) => area,
        RseqArea::None => return false,
        RseqArea::Unknown => {
            let Some((offset_at, size_at)) = rseq else {
                return false;
            };
            let (mut offset, mut size) = ([0u8; 8], [0u8; 4]);
            if stopped.read(offset_at, &mut offset).is_err()
                || stopped.read(size_at, &mut size).is_err()
            {
                return true;
            }
            if u32::from_le_bytes(size) == 0 {
                return false;
            }
            regs.fs_base.wrapping_add_signed(i64::from_le_bytes(offset))
        }
    };
    // `struct rseq`: the pointer to the sequence under way is at 8.
    let mut word = [0u8; 8];
    if stopped.read(area + 8, &mut word).is_err() {
        return true;
    }
    let descriptor = u64::from_le_bytes(word);
    if descriptor == 0 {
        return false;
    }
    // `struct rseq_cs`: version, flags, start_ip, post_commit_offset.
    let mut sequence = [0u8; 24];
    if stopped.read(descriptor, &mut sequence).is_err() {
        return true;
    }
    let field = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&sequence[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    sequence_holds(field(8), field(16), regs.rip)
}

/// Whether a sequence from `start` spanning `length` bytes holds `rip`.
fn sequence_holds(start: u64, length: u64, rip: u64) -> bool {
    rip.checked_sub(start).is_some_and(|into| into < length)
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::target::parse_maps;
    use super::*;

    /// A thread's registers at `rip` with `rax` and `orig_rax` as given,
    /// zero elsewhere.
    pub(in crate::attach) fn regs(rip: u64, rax: i64, orig_rax: i64) -> libc::user_regs_struct {
        // SAFETY: all-zero is a valid user_regs_struct.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        regs.rip = rip;
        regs.rax = rax as u64;
        regs.orig_rax = orig_rax as u64;
        regs
    }

    #[test]
    fn a_thread_is_in_a_wait_when_a_waiting_call_was_interrupted() {
        assert!(in_blocking_call(&regs(0, ERESTART_RESTARTBLOCK, 35)));
        assert!(in_blocking_call(&regs(0, ERESTARTSYS, 202)));
        assert!(in_blocking_call(&regs(0, EINTR, 232)));
        assert!(!in_blocking_call(&regs(0, 5, -1)));
        // A futex wait that failed EINTR: a signal's handler, not the stop.
        assert!(!in_blocking_call(&regs(0, EINTR, 202)));
        // mmap is no wait: a thread there may hold the memory map's lock.
        assert!(!in_blocking_call(&regs(0, ERESTARTSYS, 9)));
    }

    #[test]
    fn an_interrupted_system_call_is_made_again_as_the_kernel_would() {
        let again = |rip, rax, orig_rax| {
            let again = made_again(&regs(rip, rax, orig_rax));
            assert_eq!(again.orig_rax, u64::MAX);
            (again.rip, again.rax as i64)
        };
        // Running user code: goes on where it was, rax untouched.
        assert_eq!(again(0x1000, 5, -1), (0x1000, 5));
        // A futex wait (202) interrupted: made again.
        for restart in [ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND] {
            assert_eq!(again(0x1002, restart, 202), (0x1000, 202));
        }
        // A nanosleep with a restart block: restart_syscall.
        assert_eq!(
            again(0x1002, ERESTART_RESTARTBLOCK, 35),
            (0x1000, RESTART_SYSCALL as i64)
        );
        // An epoll_wait the stop failed with EINTR: made again.
        assert_eq!(again(0x1002, EINTR, 232), (0x1000, 232));
        assert_eq!(again(0x1002, EINTR, 281), (0x1000, 281));
        // A call that returned (its result in rax) is not made again.
        assert_eq!(again(0x1002, EINTR, 202), (0x1002, EINTR));
        assert_eq!(again(0x1002, 8, 232), (0x1002, 8));
    }

    #[test]
    fn a_thread_blocked_in_a_wait_is_picked_over_the_main_thread() {
        // Another process: in this one the thread looking would find
        // itself in a system call (reading the task files), and other
        // tests' threads wait in calls of their own. Its main thread spins;
        // a second one waits on an event (a futex, 202).
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import threading\n\
                 threading.Thread(target=threading.Event().wait, daemon=True).start()\n\
                 while True: pass",
            ])
            .spawn()
            .expect("python3 runs");
        let pid = child.id() as i32;
        // Until the waiting thread is there.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, Iterator::count) < 2
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let borrowed = pick_thread(pid);
        let call = std::fs::read_to_string(format!("/proc/{pid}/task/{}/syscall", borrowed.tid))
            .unwrap_or_default();
        let _ = child.kill();
        let _ = child.wait();
        assert!(borrowed.waiting, "{}", borrowed.describe(1));
        assert_ne!(borrowed.tid, pid, "the main thread was picked");
        assert!(call.starts_with("202 "), "{call}");
        assert!(borrowed.describe(1).contains("blocked in system call 202"));
    }

    #[test]
    fn a_wait_a_stop_failed_is_given_back_for_the_kernel_to_make_again() {
        // epoll_wait failed EINTR by the stop: restartable, as ERESTARTNOHAND.
        let back = given_back(&regs(0x1002, EINTR, 232));
        assert_eq!(
            (back.rip, back.rax as i64, back.orig_rax),
            (0x1002, ERESTARTNOHAND, 232)
        );
        // Anything else as it was: the kernel decides.
        for (rax, orig) in [
            (ERESTARTSYS, 202),
            (EINTR, 202),
            (5, -1),
            (ERESTART_RESTARTBLOCK, 35),
        ] {
            let back = given_back(&regs(0x1002, rax, orig));
            assert_eq!((back.rax as i64, back.orig_rax as i64), (rax, orig));
        }
    }

    #[test]
    fn the_runtime_code_is_the_c_library_its_loader_unwinders_and_allocators() {
        let code = RuntimeCode::of(&parse_maps(
            "1000-2000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
             2000-3000 rw-p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
             3000-4000 r-xp 00000000 08:01 2 /lib64/ld-linux-x86-64.so.2\n\
             4000-5000 r-xp 00000000 08:01 3 /usr/lib/libtcmalloc_minimal.so.4\n\
             5000-6000 r-xp 00000000 08:01 4 /usr/lib/libgcc_s.so.1\n\
             6000-7000 r-xp 00000000 08:01 5 /usr/bin/python3.11\n\
             7000-8000 r-xp 00000000 08:01 6 /usr/lib/libcuda.so.1\n\
             8000-9000 r-xp 00000000 00:00 0 \n",
        ));
        for inside in [0x1000, 0x1fff, 0x3000, 0x4800, 0x5000] {
            assert!(code.holds(inside), "{inside:#x}");
        }
        // Data, the program's own code, the driver, anonymous (JIT) code.
        for outside in [0x2000, 0x6000, 0x7000, 0x8000, 0x9000] {
            assert!(!code.holds(outside), "{outside:#x}");
        }
    }

    #[test]
    fn a_sequence_holds_from_its_start_to_before_its_commit() {
        assert!(sequence_holds(0x1000, 0x20, 0x1000));
        assert!(sequence_holds(0x1000, 0x20, 0x101f));
        assert!(!sequence_holds(0x1000, 0x20, 0x1020));
        assert!(!sequence_holds(0x1000, 0x20, 0xfff));
        assert!(!sequence_holds(0x1000, 0, 0x1000));
        assert!(!sequence_holds(u64::MAX, u64::MAX, 0));
    }
}
