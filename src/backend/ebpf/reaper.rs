//! Letting go of uprobes away from the backend's thread. The kernel lets
//! go of a probe only once it is sure no CPU still runs its program, a wait
//! of tens of milliseconds each; on the backend's thread those waits kept
//! it from draining for seconds. Probes still being let go of keep firing
//! until they are gone, so new probes that would fire on the same calls
//! wait for them (or for a later look), or each call would be recorded
//! twice. One reaper serves the whole process, so that a backend started
//! again waits for the probes of the one before.

use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tracing::warn;

use super::cuda::MappingProcess;

/// A driver library file, by device and inode.
pub(super) type LibraryFile = (u64, u64);

/// A driver library probed in one process, or in every process (`None`).
pub(super) type ProbeKey = (LibraryFile, Option<MappingProcess>);

/// Whether two sets of probes would both fire on some call: the same file,
/// and a process they share.
fn overlap(a: &ProbeKey, b: &ProbeKey) -> bool {
    a.0 == b.0 && (a.1.is_none() || b.1.is_none() || a.1 == b.1)
}

/// The keys of the probes handed over and not yet let go of, and the
/// signal that one went.
#[derive(Default)]
struct Held {
    keys: Mutex<Vec<ProbeKey>>,
    gone: Condvar,
}

impl Held {
    fn forget(&self, key: ProbeKey) {
        let mut keys = self.keys.lock();
        if let Some(at) = keys.iter().position(|k| *k == key) {
            keys.swap_remove(at);
        }
        self.gone.notify_all();
    }
}

/// Takes its key off the list when dropped, whether the probes were let
/// go of or dropping them unwound.
struct Forget<'a> {
    held: &'a Held,
    key: ProbeKey,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.held.forget(self.key);
    }
}

/// Probes handed over to be let go of, with their key.
type Handed = (ProbeKey, Box<dyn Send>);

pub(super) struct Reaper {
    sender: Option<Mutex<mpsc::Sender<Handed>>>,
    held: &'static Held,
}

impl Reaper {
    /// The process's reaper, its thread started on first use.
    pub fn global() -> &'static Reaper {
        static REAPER: OnceLock<Reaper> = OnceLock::new();
        REAPER.get_or_init(|| Reaper::start(Box::leak(Box::default())))
    }

    fn start(held: &'static Held) -> Reaper {
        let (sender, receiver) = mpsc::channel::<Handed>();
        let spawned = std::thread::Builder::new()
            .name("devtrace-unprobe".into())
            .spawn(move || {
                for (key, probes) in receiver {
                    let _forget = Forget { held, key };
                    drop(probes);
                }
            });
        match spawned {
            Ok(_) => Reaper {
                sender: Some(Mutex::new(sender)),
                held,
            },
            Err(error) => {
                warn!(%error, "no thread to let go of probes on; the backend's thread does");
                Reaper { sender: None, held }
            }
        }
    }

    /// Lets go of `probes` (those of `key`) once the thread gets to them.
    pub fn release(&self, key: ProbeKey, probes: Box<dyn Send>) {
        let Some(sender) = &self.sender else { return };
        self.held.keys.lock().push(key);
        if let Err(mpsc::SendError((key, probes))) = sender.lock().send((key, probes)) {
            let _forget = Forget {
                held: self.held,
                key,
            };
            drop(probes);
        }
    }

    /// Waits at most `limit` until no probes that would fire with those of
    /// `key` are still held; answers whether none are.
    pub fn wait_clear_of(&self, key: &ProbeKey, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut keys = self.held.keys.lock();
        while keys.iter().any(|pending| overlap(pending, key)) {
            if self.held.gone.wait_until(&mut keys, deadline).timed_out() {
                return !keys.iter().any(|pending| overlap(pending, key));
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// Probes that take until `open` is set to let go of (the kernel's
    /// wait), and say on which thread they were let go of.
    struct Gated {
        open: Arc<AtomicBool>,
        dropped_on: Arc<Mutex<Option<std::thread::ThreadId>>>,
    }

    impl Drop for Gated {
        fn drop(&mut self) {
            let give_up = Instant::now() + Duration::from_secs(10);
            while !self.open.load(Ordering::SeqCst) && Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(1));
            }
            *self.dropped_on.lock() = Some(std::thread::current().id());
        }
    }

    const LIBRARY: LibraryFile = (1, 2);

    fn alone(pid: u32) -> ProbeKey {
        (LIBRARY, Some(MappingProcess { pid, started: 7 }))
    }

    #[test]
    fn probes_are_let_go_of_elsewhere_and_waited_for_only_where_they_would_overlap() {
        let reaper = Reaper::start(Box::leak(Box::default()));
        let open = Arc::new(AtomicBool::new(false));
        let dropped_on = Arc::new(Mutex::new(None));
        let gated = Gated {
            open: Arc::clone(&open),
            dropped_on: Arc::clone(&dropped_on),
        };
        reaper.release(alone(10), Box::new(gated));
        // Neither another process nor another file waits for them.
        let long = Duration::from_secs(30);
        assert!(reaper.wait_clear_of(&alone(11), long));
        assert!(reaper.wait_clear_of(&((3, 4), None), long));
        assert_eq!(
            *dropped_on.lock(),
            None,
            "waited for probes that do not overlap"
        );
        // Every process of the same file overlaps them: a short wait gives
        // up, a long one sees them go.
        assert!(!reaper.wait_clear_of(&(LIBRARY, None), Duration::from_millis(1)));
        let opener = std::thread::spawn({
            let open = Arc::clone(&open);
            move || {
                std::thread::sleep(Duration::from_millis(50));
                open.store(true, Ordering::SeqCst);
            }
        });
        assert!(reaper.wait_clear_of(&(LIBRARY, None), long));
        let dropped = *dropped_on.lock();
        assert!(dropped.is_some(), "did not wait for overlapping probes");
        assert_ne!(
            dropped,
            Some(std::thread::current().id()),
            "let go of inline"
        );
        opener.join().unwrap();
    }

    #[test]
    fn probe_sets_overlap_where_they_share_a_file_and_a_process() {
        assert!(overlap(&alone(1), &alone(1)));
        assert!(!overlap(&alone(1), &alone(2)));
        assert!(overlap(&alone(1), &(LIBRARY, None)));
        assert!(overlap(&(LIBRARY, None), &alone(2)));
        assert!(!overlap(&((9, 9), None), &(LIBRARY, None)));
        // The same pid, a later process: no shared calls.
        let later = (LIBRARY, Some(MappingProcess { pid: 1, started: 8 }));
        assert!(!overlap(&alone(1), &later));
    }
}
