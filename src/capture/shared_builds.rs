//! Captures of one window share one encoded trace: a `client.trace` fanned
//! out, a dashboard polling, several users asking at once. The first capture
//! of a window (and of the options and losses that shape its bytes) builds;
//! the others wait for that build and reply from the same bytes. What differs
//! per request (its own warnings, where the trace is written) is applied to
//! the reply afterwards.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::sync::OnceCell;

use crate::backend::Scope;
use crate::recorder::Window;
use crate::xspace::Encoded;

/// What makes two captures' traces the same bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct BuildKey {
    window: (u64, u64),
    /// The encoded `ProfileOptions`, recorded in the trace.
    options: Vec<u8>,
    /// Backends' loss totals when the capture arrived: the trace counts what
    /// was lost since.
    losses: Vec<(&'static str, &'static str, u64)>,
    /// Whose the trace is: a user's scoped trace is theirs alone.
    scope: Scope,
}

impl BuildKey {
    pub fn new(
        window: Window,
        options: &[u8],
        losses: &[(&'static str, crate::backend::Loss)],
        scope: Scope,
    ) -> BuildKey {
        BuildKey {
            scope,
            window: (window.start_ns, window.stop_ns),
            options: options.to_vec(),
            losses: losses
                .iter()
                .map(|(backend, loss)| (*backend, loss.what, loss.count))
                .collect(),
        }
    }
}

/// One shared build: its trace once its first capture has built it (and
/// with it, the trace's share of capture memory). Held by every capture
/// using it; gone when the last one has replied.
#[derive(Default)]
pub struct Slot {
    trace: OnceCell<Arc<Encoded>>,
}

/// The builds in progress or being replied from, by key.
#[derive(Default)]
pub struct SharedBuilds {
    slots: Mutex<HashMap<BuildKey, Weak<Slot>>>,
    builds: AtomicU64,
    reuses: AtomicU64,
}

impl SharedBuilds {
    /// The slot of `key`, shared with every capture that holds it now.
    pub fn join(&self, key: BuildKey) -> Arc<Slot> {
        let mut slots = self.slots.lock();
        slots.retain(|_, slot| slot.strong_count() > 0);
        if let Some(slot) = slots.get(&key).and_then(Weak::upgrade) {
            return slot;
        }
        let slot = Arc::new(Slot::default());
        slots.insert(key, Arc::downgrade(&slot));
        slot
    }

    /// The slot's trace: built by `build` when no other capture has built it
    /// (or is building it), else theirs. A build that fails or is abandoned
    /// leaves the slot empty for the next capture to try.
    pub async fn get_or_build<E, F>(&self, slot: &Slot, build: F) -> Result<Arc<Encoded>, E>
    where
        F: Future<Output = Result<Encoded, E>>,
    {
        let mut built = false;
        let encoded = slot
            .trace
            .get_or_try_init(|| async {
                built = true;
                build.await.map(Arc::new)
            })
            .await?;
        let counter = if built { &self.builds } else { &self.reuses };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::clone(encoded))
    }

    /// Traces built, and captures that replied from another's build.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.builds.load(Ordering::Relaxed),
            self.reuses.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(start_ns: u64) -> BuildKey {
        scoped_key(start_ns, Scope::Host)
    }

    fn scoped_key(start_ns: u64, scope: Scope) -> BuildKey {
        let window = Window {
            start_ns,
            stop_ns: start_ns + 10,
        };
        BuildKey::new(window, b"options", &[], scope)
    }

    fn trace(byte: u8) -> Encoded {
        Encoded::whole(vec![byte; 4], 1)
    }

    #[tokio::test]
    async fn one_key_builds_once_and_other_keys_build_their_own() {
        let shared = SharedBuilds::default();
        let first = shared.join(key(1));
        let second = shared.join(key(1));
        let other = shared.join(key(2));
        let a = shared
            .get_or_build(&first, async { Ok::<_, ()>(trace(1)) })
            .await
            .unwrap();
        let b = shared
            .get_or_build(&second, async { Ok::<_, ()>(trace(9)) })
            .await
            .unwrap();
        let c = shared
            .get_or_build(&other, async { Ok::<_, ()>(trace(2)) })
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(c.contiguous(), vec![2; 4]);
        assert_eq!(shared.counts(), (2, 1));
    }

    #[test]
    fn captures_of_one_window_for_different_users_never_share_a_trace() {
        let shared = SharedBuilds::default();
        let host = shared.join(key(1));
        let theirs = shared.join(scoped_key(1, Scope::User { uid: 1001 }));
        let mine = shared.join(scoped_key(1, Scope::User { uid: 65_534 }));
        let mine_again = shared.join(scoped_key(1, Scope::User { uid: 65_534 }));
        assert!(!Arc::ptr_eq(&host, &theirs));
        assert!(!Arc::ptr_eq(&theirs, &mine));
        assert!(Arc::ptr_eq(&mine, &mine_again));
    }

    #[tokio::test]
    async fn a_failed_build_leaves_the_slot_to_the_next_capture() {
        let shared = SharedBuilds::default();
        let slot = shared.join(key(1));
        assert!(shared
            .get_or_build(&slot, async { Err::<Encoded, _>("gone") })
            .await
            .is_err());
        let encoded = shared
            .get_or_build(&slot, async { Ok::<_, &str>(trace(3)) })
            .await
            .unwrap();
        assert_eq!(encoded.contiguous(), vec![3; 4]);
    }

    #[test]
    fn a_slot_nobody_holds_is_forgotten() {
        let shared = SharedBuilds::default();
        let first = shared.join(key(1));
        drop(first);
        shared.join(key(2));
        assert_eq!(shared.slots.lock().len(), 1);
    }
}
