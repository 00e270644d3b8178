//! Which range of line ids (a slot) each attached process's events go on.
//! A slot's lines keep the names of the process that had it, and the
//! flight recorder keeps that process's events for a while after it ends:
//! a look-back capture of its time shows them under those names. So a
//! freed slot is taken again last, the one freed longest ago first, once
//! every slot never used is taken; it takes that many processes ending
//! before another's lines are renamed.

use std::collections::VecDeque;

use crate::model::timeline::STREAM_BITS;

/// Slots there are: line ids have 32 bits, the stream's take the low
/// [`STREAM_BITS`], and slot 0 is no process's.
const SLOTS: u64 = 1 << (32 - STREAM_BITS);

#[derive(Debug)]
pub(super) struct Slots {
    /// The next slot never taken.
    unused: u64,
    /// Freed slots, the one freed longest ago first.
    freed: VecDeque<u64>,
    in_use: Vec<u64>,
}

impl Default for Slots {
    fn default() -> Slots {
        Slots {
            unused: 1,
            freed: VecDeque::new(),
            in_use: Vec::new(),
        }
    }
}

impl Slots {
    /// A slot for a process: one never used, else the one freed longest
    /// ago; none while every slot is in use.
    pub(super) fn take(&mut self) -> Option<u64> {
        let slot = if self.unused < SLOTS {
            self.unused += 1;
            self.unused - 1
        } else {
            self.freed.pop_front()?
        };
        self.in_use.push(slot);
        Some(slot)
    }

    /// The process that had `slot` is gone; its lines keep their names
    /// until the slot is taken again.
    pub(super) fn free(&mut self, slot: u64) {
        self.release(slot, false);
    }

    /// `slot` was taken for a process that never had events: it is the
    /// first taken again.
    pub(super) fn unused(&mut self, slot: u64) {
        self.release(slot, true);
    }

    fn release(&mut self, slot: u64, first: bool) {
        let Some(at) = self.in_use.iter().position(|s| *s == slot) else {
            return;
        };
        self.in_use.swap_remove(at);
        if first {
            self.freed.push_front(slot);
        } else {
            self.freed.push_back(slot);
        }
    }

    /// Slots held by attached processes.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> &[u64] {
        &self.in_use
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_slot_is_taken_again_only_after_every_other() {
        let mut slots = Slots::default();
        let (a, b) = (slots.take(), slots.take());
        assert_eq!((a, b), (Some(1), Some(2)));
        slots.free(1);
        // Not 1 again: the lines of its process keep their names.
        assert_eq!(slots.take(), Some(3));
        for _ in 4..SLOTS {
            assert!(slots.take().is_some());
        }
        assert_eq!(slots.in_use().len() as u64, SLOTS - 2);
        slots.free(7);
        // Taken for a process that had no events: first in line.
        let c = slots.take();
        slots.unused(c.expect("slot 1, freed longest ago"));
        assert_eq!(c, Some(1));
        assert_eq!(slots.take(), Some(1));
        assert_eq!(slots.take(), Some(7));
        assert_eq!(slots.take(), None);
        // Freeing what is not held changes nothing.
        slots.free(9_999);
        assert_eq!(slots.take(), None);
    }
}
