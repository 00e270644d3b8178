//! Which named source (a backend, the tap) put how many events into an
//! in-process ring, for the agent's metrics.
//!
//! A lane's counters (head, refused, overwritten) are running totals over
//! every producer that ever held the lane. A producer claimed with a source
//! name has its lane's counters noted when it claims it and again when it
//! lets it go; what grew in between is that source's. The book is touched
//! only when a lane is claimed or released and when someone reads it, never
//! on a push.

use parking_lot::Mutex;

/// Events one source pushed into the ring, and lost there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceCounts {
    /// Accepted into a lane (under drop-oldest, including those later
    /// overwritten).
    pub pushed: u64,
    /// Refused by a full lane (drop-newest).
    pub dropped_newest: u64,
    /// Overwritten before the consumer read them (drop-oldest).
    pub dropped_oldest: u64,
}

impl SourceCounts {
    /// What grew from `earlier` to `self` (counters wrap).
    fn since(self, earlier: SourceCounts) -> SourceCounts {
        SourceCounts {
            pushed: self.pushed.wrapping_sub(earlier.pushed),
            dropped_newest: self.dropped_newest.wrapping_sub(earlier.dropped_newest),
            dropped_oldest: self.dropped_oldest.wrapping_sub(earlier.dropped_oldest),
        }
    }

    fn add(&mut self, other: SourceCounts) {
        self.pushed = self.pushed.wrapping_add(other.pushed);
        self.dropped_newest = self.dropped_newest.wrapping_add(other.dropped_newest);
        self.dropped_oldest = self.dropped_oldest.wrapping_add(other.dropped_oldest);
    }
}

/// A lane held by a named source: who, and the lane's counters when it was
/// claimed.
#[derive(Clone, Copy)]
struct Claim {
    source: &'static str,
    at_claim: SourceCounts,
}

#[derive(Default)]
struct Book {
    /// Per lane, the named source holding it; as long as the highest lane
    /// ever claimed by name (rings nobody names, such as the shared rings
    /// of workloads, keep it empty).
    held: Vec<Option<Claim>>,
    /// Totals of lanes their sources have let go, per source.
    released: Vec<(&'static str, SourceCounts)>,
}

/// See the module documentation.
#[derive(Default)]
pub(super) struct Sources(Mutex<Book>);

impl Sources {
    /// `source` claimed `lane`, whose counters read `now`.
    pub(super) fn claimed(&self, lane: u32, source: &'static str, now: SourceCounts) {
        let mut book = self.0.lock();
        let lane = lane as usize;
        if book.held.len() <= lane {
            book.held.resize(lane + 1, None);
        }
        book.held[lane] = Some(Claim {
            source,
            at_claim: now,
        });
    }

    /// The source holding `lane` let it go; its counters read `now`.
    pub(super) fn released(&self, lane: u32, now: SourceCounts) {
        let mut book = self.0.lock();
        let Some(claim) = book.held.get_mut(lane as usize).and_then(Option::take) else {
            return;
        };
        let grown = now.since(claim.at_claim);
        match book.released.iter_mut().find(|(s, _)| *s == claim.source) {
            Some((_, total)) => total.add(grown),
            None => book.released.push((claim.source, grown)),
        }
    }

    /// Totals per source: lanes let go plus lanes held now, whose counters
    /// `lane_now` reads.
    pub(super) fn totals(
        &self,
        lane_now: impl Fn(u32) -> SourceCounts,
    ) -> Vec<(&'static str, SourceCounts)> {
        let book = self.0.lock();
        let mut totals = book.released.clone();
        for (lane, claim) in book.held.iter().enumerate() {
            let Some(claim) = claim else { continue };
            let grown = lane_now(lane as u32).since(claim.at_claim);
            match totals.iter_mut().find(|(s, _)| *s == claim.source) {
                Some((_, total)) => total.add(grown),
                None => totals.push((claim.source, grown)),
            }
        }
        totals
    }
}
