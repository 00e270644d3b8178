//! Survives a peer shrinking a shared ring's file under the agent.
//!
//! A ring mapped from a file or memfd that another process created can be
//! truncated by that process at any moment; the next access past the new end
//! faults with `SIGBUS`, which would kill the whole agent. The agent cannot
//! check the size before every access (the peer can shrink it in between),
//! so it does what Wayland compositors do with client memory pools: a
//! `SIGBUS` handler that, for a fault inside a guarded mapping, replaces the
//! whole mapping with private zero pages and marks it broken. The access
//! that faulted is then retried against zeroes and the consumer, seeing the
//! mark, detaches the ring. Faults anywhere else go to the handler that was
//! installed before (the Rust runtime's, or the default action).
//!
//! The handler only reads atomics and calls `mmap`, both async-signal-safe.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// Guarded mappings one process can hold at a time.
const SLOTS: usize = 1024;

struct Slot {
    base: AtomicUsize,
    len: AtomicUsize,
    broken: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    base: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    broken: AtomicBool::new(false),
};

static GUARDED: [Slot; SLOTS] = [FREE; SLOTS];

/// The disposition of `SIGBUS` before ours, written once before ours is
/// installed and only read afterwards.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A mapping under the guard; unregisters itself when dropped, which must
/// happen before the mapping is unmapped.
pub(super) struct Guard {
    slot: usize,
}

impl Guard {
    /// Guards `len` bytes at `base`; `None` when the handler could not be
    /// installed or every slot is taken.
    pub(super) fn register(base: *mut u8, len: usize) -> Option<Guard> {
        install();
        if !INSTALLED.load(Ordering::Acquire) {
            return None;
        }
        for (index, slot) in GUARDED.iter().enumerate() {
            // The length is claimed first so that the handler never matches
            // a half-registered slot (its base is still 0).
            if slot
                .len
                .compare_exchange(0, len, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                slot.broken.store(false, Ordering::Release);
                slot.base.store(base as usize, Ordering::Release);
                return Some(Guard { slot: index });
            }
        }
        None
    }

    /// Whether the mapping faulted and now holds zeroes.
    pub(super) fn broken(&self) -> bool {
        GUARDED[self.slot].broken.load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let slot = &GUARDED[self.slot];
        slot.base.store(0, Ordering::Release);
        slot.len.store(0, Ordering::Release);
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid value to fill in; PREVIOUS is
        // written here, once, before the handler that reads it exists.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let previous = &raw mut PREVIOUS;
            if libc::sigaction(libc::SIGBUS, &action, (*previous).as_mut_ptr()) == 0 {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let address = unsafe { (*info).si_addr() } as usize;
    for slot in &GUARDED {
        let base = slot.base.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if base == 0 || address < base || address - base >= len {
            continue;
        }
        // SAFETY: replaces exactly the mapping registered here, which stays
        // mapped until its guard is dropped; zero pages are valid ring data.
        let ptr = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if ptr != libc::MAP_FAILED {
            slot.broken.store(true, Ordering::Release);
            return;
        }
    }
    // Not ours: whoever handled SIGBUS before decides.
    // SAFETY: PREVIOUS was filled in before this handler was installed.
    unsafe {
        let previous: *const libc::sigaction = (&raw const PREVIOUS).cast();
        let handler = (*previous).sa_sigaction;
        if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
            // Restore it; returning re-runs the access, which faults again
            // and takes the default action (a core dump, as without us).
            libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut());
        } else if (*previous).sa_flags & libc::SA_SIGINFO != 0 {
            let chained: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            chained(signal, info, context);
        } else {
            let chained: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            chained(signal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_truncated_mapping_reads_zeroes_and_is_marked_broken() {
        let file = tempfile::tempfile().unwrap();
        let size = 4 * 4096;
        file.set_len(size as u64).unwrap();
        // SAFETY: a fresh shared mapping of a file this test owns.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let base = base.cast::<u8>();
        let guard = Guard::register(base, size).unwrap();
        // SAFETY: inside the mapping.
        unsafe { base.add(3 * 4096).write_volatile(7) };
        assert!(!guard.broken());
        file.set_len(4096).unwrap();
        // SAFETY: inside the mapping; past the file's end now, so it faults
        // and the guard swaps in zero pages.
        let read = unsafe { base.add(3 * 4096).read_volatile() };
        assert_eq!(read, 0);
        assert!(guard.broken());
        drop(guard);
        // SAFETY: the mapping registered above.
        unsafe { libc::munmap(base.cast(), size) };
    }
}
