//! Waiting for the control word to change, across processes: a producer
//! (the injection library) sleeps on a futex at the word's generation half,
//! which every [`Ring::set_control`] bumps, and the consumer wakes it after
//! each change. Both map the ring `MAP_SHARED`, so the futex is a shared
//! one (keyed by the mapped file, not by the address). Waits are bounded by
//! their timeout: a consumer that never wakes (an older agent, a dead one)
//! costs the waiter its poll interval, as before, and a stray wake one more
//! look at the word.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use super::{Control, Ring};

impl Ring {
    /// The 32 bits of the control word that hold its generation.
    fn control_generation(&self) -> &AtomicU32 {
        let word: &AtomicU64 = &self.header().control.0;
        let halves = (word as *const AtomicU64).cast::<AtomicU32>();
        let high = if cfg!(target_endian = "little") { 1 } else { 0 };
        // SAFETY: an AtomicU64 is 8-byte aligned, so each of its halves is
        // an aligned AtomicU32 inside it, for as long as the ring is mapped
        // (the borrow of `self`); the word is only ever accessed atomically.
        unsafe { &*halves.add(high) }
    }

    /// Waits until the control word's generation differs from `seen`'s, a
    /// consumer's wake arrives, or `timeout` passes; answers the word then.
    pub fn wait_for_control(&self, seen: Control, timeout: Duration) -> Control {
        let now = self.control();
        if now.generation != seen.generation || timeout.is_zero() {
            return now;
        }
        let generation = self.control_generation();
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: FUTEX_WAIT on an aligned u32 in memory mapped for as long
        // as `self` lives, with a relative timeout; it sleeps only while
        // the word still holds `seen`'s generation. Its outcome (woken,
        // timed out, interrupted, changed already) is read from the word.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                generation.as_ptr(),
                libc::FUTEX_WAIT,
                seen.generation,
                &timeout as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
        self.control()
    }

    /// Wakes every producer waiting in [`Ring::wait_for_control`]: called
    /// by [`Ring::set_control`] after the word changed.
    pub(super) fn wake_control_waiters(&self) {
        let generation = self.control_generation();
        // SAFETY: FUTEX_WAKE on an aligned u32 of the mapped ring; it only
        // wakes waiters on that word.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                generation.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{DropPolicy, Ring, CONTROL_CAPTURE};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_producer_waiting_for_the_control_word_is_woken_when_it_is_set() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("ring");
        // The library makes the ring; the agent maps the same file again.
        let library = Ring::create_shared(&path, 1, 8, DropPolicy::DropNewest).expect("a ring");
        let agent = Ring::open_shared(&path).expect("the ring, mapped again");
        let seen = library.control();
        // Nothing changes: the wait ends at its timeout, with the same word.
        let same = library.wait_for_control(seen, Duration::from_millis(5));
        assert_eq!(same, seen);
        let (answered, answer) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let word = library.wait_for_control(seen, Duration::from_secs(600));
            let _ = answered.send(word);
        });
        // Let the waiter fall asleep first (were it not yet, it would see
        // the new word before sleeping, which proves nothing but fails
        // nothing either).
        std::thread::sleep(Duration::from_millis(100));
        let set = agent.set_control(CONTROL_CAPTURE);
        // Its own timeout is ten minutes: only the wake answers in one.
        let word = answer
            .recv_timeout(Duration::from_secs(60))
            .expect("the waiter was not woken by the set");
        assert_eq!(word, set);
        assert!(word.capture());
        waiter.join().expect("the waiter");
    }
}
