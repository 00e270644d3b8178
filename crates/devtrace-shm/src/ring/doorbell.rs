//! Waking a consumer that sleeps on empty lanes. The consumer marks itself
//! asleep and then looks at the lanes once more; a producer that finds the
//! mark after publishing takes it and calls the waker. A push that happens
//! while nobody sleeps costs one relaxed load of a word that is rarely
//! written.
//!
//! The producer does not fence between publishing and looking at the mark,
//! so a push racing with the consumer falling asleep can miss it; its events
//! stay in the lane (nothing is lost) until the next push, which sees the
//! mark, or the consumer's own longest sleep. Producers in other processes
//! (shared rings) never ring: their consumer must not sleep for long.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

type Waker = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub struct Doorbell {
    asleep: AtomicBool,
    waker: OnceLock<Waker>,
}

impl Doorbell {
    /// Sets what a ring calls; the first waker set stays.
    pub fn set_waker(&self, waker: impl Fn() + Send + Sync + 'static) {
        let _ = self.waker.set(Box::new(waker));
    }

    /// Marks the consumer asleep; it must look at the lanes after this.
    pub fn sleep(&self) {
        self.asleep.store(true, Ordering::SeqCst);
    }

    /// Whether the consumer is marked asleep.
    pub fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::Relaxed)
    }

    /// Clears the mark once the consumer is awake, so pushes stay cheap.
    pub fn awake(&self) {
        self.asleep.store(false, Ordering::Relaxed);
    }

    /// Called by a producer after it published: wakes a sleeping consumer
    /// once, however many producers push at the same time.
    #[inline]
    pub(super) fn ring(&self) {
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::AcqRel) {
            if let Some(waker) = self.waker.get() {
                waker();
            }
        }
    }
}
