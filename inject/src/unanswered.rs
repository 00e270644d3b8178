//! Launches whose GPU work never came back from CUPTI in a capture.
//!
//! The library times the launch calls itself ([`crate::timed_calls`]), on
//! the job's threads, whoever has CUPTI's activity stream; their kernels
//! reach it only in CUPTI's records, through the buffer callbacks that are
//! registered when CUPTI hands a buffer back, and only while the kernels
//! are switched on. A CUPTI user that this library cannot see (one that
//! looked CUPTI's functions up before the library loaded) takes both away
//! unseen: its registration sends the library's buffers to it, and its
//! disable at its end switches the kernels off for the rest of the capture.
//! The launch calls are the evidence: a capture whose timed launches have
//! no kernel record, while no kernel of any later launch came back either,
//! lost those kernels, and its trace says from which launch on.
//!
//! CUPTI numbers every API call in the process in order (one correlation
//! id, which the kernels a launch or a graph launch makes carry), so a
//! launch counts as unanswered only when its id is newer than every kernel
//! record's that came back: a launch that a later launch's kernel overtook
//! (another stream, a kernel still running) is never counted. Copies and
//! memsets do not answer: a user that switched the kernels off may leave
//! the copies on. A capture whose kernels kept coming back until its last
//! second is not told of (its GPU may simply run behind its launches), nor
//! one whose first unanswered launch came in its last second. Launches made
//! while a stream capture was under way are not counted (they may have
//! been recorded into a CUDA graph, running no kernel), nor launches that
//! failed.
//!
//! The same launches tell the end of a capture when the GPU has finished
//! the work launched in it ([`InFlight`]): CUPTI hands a record of work
//! still running back only when forced, unfinished, so the library waits
//! for the work's own records first.

use std::collections::{HashMap, HashSet, VecDeque};

/// Launches remembered at most, in each of the tracker's lists (16 bytes
/// a launch in the list of those to tell, about as much in the sets the end
/// of a capture waits on): beyond that a capture only counts them. A
/// capture keeps the launches whose kernels have not come back yet, about
/// one 100 ms flush's worth while records flow.
pub const MAX_KEPT: usize = 1 << 16;

/// How long before a capture's end its kernels must have stopped coming
/// back, and its first unanswered launch been made, for the loss to be
/// told.
pub const SETTLE_NS: u64 = 1_000_000_000;

/// Whether correlation id `a` is newer than `b` (ids wrap at 2^32).
fn newer(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Whether a launch with this id was overtaken by the newest kernel record
/// that came back (its own, or a later launch's).
fn overtaken(correlation_id: u32, newest_answered: Option<u32>) -> bool {
    newest_answered.is_some_and(|newest| !newer(correlation_id, newest))
}

/// The launches of one capture whose kernels have not come back.
#[derive(Debug, Default)]
pub struct Unanswered {
    /// Launches made before this (host clock) are not counted: the kernels
    /// were not switched on yet.
    counting_from_ns: u64,
    /// Launches whose id was newer than every kernel record's when they
    /// were taken, roughly oldest first: (correlation id, start on the
    /// host clock).
    pending: VecDeque<(u32, u64)>,
    /// Launches past [`MAX_KEPT`], only counted.
    overflow: Option<Overflow>,
    /// The newest correlation id a kernel record carried.
    newest_answered: Option<u32>,
    /// The latest end of a kernel that came back (host clock).
    latest_kernel_end_ns: u64,
    /// The newest launch counted.
    newest_launched: Option<u32>,
    /// What the end of the capture waits for.
    in_flight: InFlight,
}

/// The launches counted whose own work has not come back: what the end of
/// a capture waits for ([`Unanswered::launches_settled`]).
#[derive(Debug, Default)]
struct InFlight {
    /// By correlation id, when each was made (host clock); at most
    /// [`MAX_KEPT`], past that `overflowed`.
    launches: HashMap<u32, u64>,
    overflowed: bool,
    /// When the newest launch delivered was made.
    newest_ns: u64,
    /// Work that came back for no launch in flight, since the last two
    /// deliveries of the launches timed: a launch is delivered at the first
    /// delivery after it was made, so its work cannot have come back before
    /// the one before.
    came_back_lately: [HashSet<u32>; 2],
}

impl InFlight {
    fn launched(&mut self, correlation_id: u32, at_ns: u64) {
        self.newest_ns = self.newest_ns.max(at_ns);
        if self
            .came_back_lately
            .iter()
            .any(|ids| ids.contains(&correlation_id))
        {
            return;
        }
        if self.launches.len() < MAX_KEPT {
            self.launches.insert(correlation_id, at_ns);
        } else {
            self.overflowed = true;
        }
    }

    fn came_back(&mut self, correlation_id: u32) {
        let lately = &mut self.came_back_lately[0];
        if self.launches.remove(&correlation_id).is_none() && lately.len() < MAX_KEPT {
            lately.insert(correlation_id);
        }
    }

    /// Launches a second older than the newest that `overtaken` says a
    /// later launch's kernel overtook are let go.
    fn delivered(&mut self, overtaken: impl Fn(u32) -> bool) {
        let [now, before] = &mut self.came_back_lately;
        *before = std::mem::take(now);
        let let_go_before = self.newest_ns.saturating_sub(SETTLE_NS);
        self.launches
            .retain(|id, at_ns| *at_ns >= let_go_before || !overtaken(*id));
    }
}

/// Launches counted without being kept.
#[derive(Debug)]
struct Overflow {
    launches: u64,
    first_id: u32,
    first_ns: u64,
}

/// What a capture lost: the kernels of `launches` launch calls made from
/// `from_ns` on (host clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lost {
    pub from_ns: u64,
    pub launches: u64,
}

impl Unanswered {
    /// A capture's kernels are switched on at `at_ns`: a fresh start.
    pub fn begin(&mut self, at_ns: u64) {
        *self = Unanswered {
            counting_from_ns: at_ns,
            ..Unanswered::default()
        };
    }

    /// A launch call the library timed, made at `at_ns`.
    pub fn launched(&mut self, correlation_id: u32, at_ns: u64) {
        if at_ns < self.counting_from_ns {
            return;
        }
        if self
            .newest_launched
            .is_none_or(|newest| newer(correlation_id, newest))
        {
            self.newest_launched = Some(correlation_id);
        }
        self.in_flight.launched(correlation_id, at_ns);
        // Lost only if no later launch's kernel came back either.
        if self.is_answered(correlation_id) {
            return;
        }
        self.prune();
        if self.pending.len() < MAX_KEPT {
            self.pending.push_back((correlation_id, at_ns));
            return;
        }
        let overflow = self.overflow.get_or_insert(Overflow {
            launches: 0,
            first_id: correlation_id,
            first_ns: at_ns,
        });
        overflow.launches += 1;
        overflow.first_ns = overflow.first_ns.min(at_ns);
    }

    /// A kernel record with this id came back, of a kernel that ended at
    /// `end_ns` (host clock).
    pub fn answered(&mut self, correlation_id: u32, end_ns: u64) {
        if !self.is_answered(correlation_id) {
            self.newest_answered = Some(correlation_id);
        }
        self.latest_kernel_end_ns = self.latest_kernel_end_ns.max(end_ns);
        self.work_came_back(correlation_id);
    }

    /// GPU work with this id came back (a kernel, or a graph's copy or
    /// memset): its launch no longer holds up the end of the capture.
    pub fn work_came_back(&mut self, correlation_id: u32) {
        self.in_flight.came_back(correlation_id);
    }

    /// The launches timed so far were all handed over (counted). Launches
    /// made a second before the newest whose work never came back while a
    /// later launch's did (a graph that runs nothing, records CUPTI dropped)
    /// stop holding up the end of the capture, so that they do not pile up.
    pub fn delivered(&mut self) {
        let newest_answered = self.newest_answered;
        self.in_flight
            .delivered(|id| overtaken(id, newest_answered));
    }

    /// Whether the kernel record of every launch counted so far came back
    /// (a graph's first kernel answers for it); none when no launch was
    /// counted. Past [`MAX_KEPT`] launches waiting, a later launch's record
    /// answers for the earlier ones.
    pub fn launches_settled(&self) -> Option<bool> {
        let newest = self.newest_launched?;
        Some(if self.in_flight.overflowed {
            self.is_answered(newest)
        } else {
            self.in_flight.launches.is_empty()
        })
    }

    /// The launches so far belong to another CUPTI user's span, which the
    /// trace names: they are not this capture's to tell.
    pub fn forget(&mut self) {
        self.begin(self.counting_from_ns);
    }

    /// The capture ended at `ended_ns`, every record it will get in:
    /// what it lost, if anything; the launches are forgotten.
    pub fn take_lost(&mut self, ended_ns: u64) -> Option<Lost> {
        let capture = std::mem::take(self);
        let is_lost = |id: u32| !overtaken(id, capture.newest_answered);
        let mut lost: Option<Lost> = None;
        let mut count = |from_ns: u64, launches: u64| {
            let entry = lost.get_or_insert(Lost {
                from_ns,
                launches: 0,
            });
            entry.from_ns = entry.from_ns.min(from_ns);
            entry.launches += launches;
        };
        for (id, at_ns) in &capture.pending {
            if is_lost(*id) {
                count(*at_ns, 1);
            }
        }
        // Launches only counted are told only when no kernel came back
        // after the first of them.
        if let Some(overflow) = &capture.overflow {
            if is_lost(overflow.first_id) {
                count(overflow.first_ns, overflow.launches);
            }
        }
        let settled = |at_ns: u64| at_ns.saturating_add(SETTLE_NS) <= ended_ns;
        lost.filter(|lost| settled(lost.from_ns) && settled(capture.latest_kernel_end_ns))
    }

    fn is_answered(&self, correlation_id: u32) -> bool {
        overtaken(correlation_id, self.newest_answered)
    }

    /// Drops the oldest launches (and the uncounted ones) that a kernel
    /// record has overtaken.
    fn prune(&mut self) {
        while let Some((id, _)) = self.pending.front() {
            if !self.is_answered(*id) {
                break;
            }
            self.pending.pop_front();
        }
        if self
            .overflow
            .as_ref()
            .is_some_and(|overflow| self.is_answered(overflow.first_id))
        {
            self.overflow = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn launches_after_the_last_kernel_that_came_back_are_lost() {
        let mut launches = Unanswered::default();
        for (i, id) in (10..20).enumerate() {
            launches.launched(id, 100 * S + i as u64 * S / 10);
        }
        launches.answered(13, 100 * S + 3 * S / 10);
        assert_eq!(
            launches.take_lost(110 * S),
            Some(Lost {
                from_ns: 100 * S + 4 * S / 10,
                launches: 6
            })
        );
        // The next capture starts afresh.
        assert_eq!(launches.take_lost(120 * S), None);
    }

    #[test]
    fn a_launch_overtaken_by_a_later_kernel_is_not_counted() {
        let mut launches = Unanswered::default();
        launches.launched(5, S);
        launches.launched(6, S);
        // Another stream's kernel came back, the first one's not yet.
        launches.answered(6, S);
        assert_eq!(launches.take_lost(10 * S), None);
    }

    #[test]
    fn a_capture_s_last_second_is_left_out() {
        let mut launches = Unanswered::default();
        launches.launched(1, 10 * S);
        launches.answered(1, 10 * S);
        launches.launched(2, 10 * S + S / 2);
        assert_eq!(launches.take_lost(11 * S), None);
        launches.launched(3, 10 * S);
        assert!(launches.take_lost(11 * S).is_some());
    }

    #[test]
    fn kernels_coming_back_until_the_last_second_are_a_busy_gpu_not_a_loss() {
        let mut launches = Unanswered::default();
        launches.launched(1, 10 * S);
        launches.launched(2, 10 * S);
        // The first launch's kernel ended 0.5 s before the end; the second
        // is queued behind it.
        launches.answered(1, 12 * S);
        assert_eq!(launches.take_lost(12 * S + S / 2), None);
    }

    #[test]
    fn launches_before_the_kernels_were_switched_on_are_not_counted() {
        let mut launches = Unanswered::default();
        launches.begin(10 * S);
        launches.launched(1, 10 * S - 1);
        assert_eq!(launches.take_lost(20 * S), None);
    }

    #[test]
    fn launches_given_to_another_user_s_span_are_forgotten() {
        let mut launches = Unanswered::default();
        launches.launched(1, S);
        launches.forget();
        assert_eq!(launches.take_lost(10 * S), None);
    }

    #[test]
    fn launches_settle_once_each_has_its_own_kernel_back() {
        let mut launches = Unanswered::default();
        assert_eq!(launches.launches_settled(), None, "no launch yet");
        launches.launched(7, S);
        launches.launched(8, S);
        assert_eq!(launches.launches_settled(), Some(false));
        // A later launch's kernel (another thread's, a shorter one) does
        // not answer for a kernel still running.
        launches.answered(8, 2 * S);
        assert_eq!(launches.launches_settled(), Some(false));
        launches.answered(7, 3 * S);
        assert_eq!(launches.launches_settled(), Some(true));
        launches.launched(10, 3 * S);
        assert_eq!(launches.launches_settled(), Some(false));
        launches.forget();
        assert_eq!(launches.launches_settled(), None, "forgotten launches");
    }

    #[test]
    fn launches_whose_work_never_comes_back_stop_holding_up_a_second_on() {
        let mut launches = Unanswered::default();
        // A graph that runs nothing, then launches whose kernels come back.
        launches.launched(1, S);
        launches.launched(2, S + S / 2);
        launches.answered(2, 2 * S);
        launches.delivered();
        assert_eq!(
            launches.launches_settled(),
            Some(false),
            "within the second"
        );
        launches.launched(3, 2 * S + S / 10);
        launches.answered(3, 3 * S);
        launches.delivered();
        assert_eq!(launches.launches_settled(), Some(true));
        // A graph's copy answers for its launch as a kernel does.
        launches.launched(4, 4 * S);
        launches.work_came_back(4);
        assert_eq!(launches.launches_settled(), Some(true));
    }

    #[test]
    fn launches_in_flight_past_the_bound_are_answered_by_later_kernels() {
        let mut launches = Unanswered::default();
        let past_the_bound = MAX_KEPT as u32 + 1;
        for id in 1..=past_the_bound {
            launches.launched(id, S);
        }
        assert_eq!(launches.in_flight.launches.len(), MAX_KEPT, "bounded");
        assert_eq!(launches.launches_settled(), Some(false));
        // Every kept launch's own kernel back but the last, unkept one's:
        // past the bound, only the newest kernel answers.
        for id in 1..past_the_bound {
            launches.answered(id, 2 * S);
        }
        assert!(launches.in_flight.launches.is_empty());
        assert_eq!(launches.launches_settled(), Some(false));
        launches.answered(past_the_bound, 2 * S);
        assert_eq!(launches.launches_settled(), Some(true));
    }

    #[test]
    fn a_kernel_back_before_its_launch_was_delivered_answers_it() {
        let mut launches = Unanswered::default();
        launches.answered(3, 2 * S);
        launches.delivered();
        launches.launched(3, S);
        assert_eq!(launches.launches_settled(), Some(true));
        // Two deliveries later a kernel's early answer is forgotten: its
        // launch was delivered by then.
        launches.answered(4, 2 * S);
        launches.delivered();
        launches.delivered();
        launches.launched(5, 3 * S);
        assert_eq!(launches.launches_settled(), Some(false));
    }

    #[test]
    fn ids_compare_across_their_wrap() {
        let mut launches = Unanswered::default();
        launches.answered(u32::MAX - 1, S);
        launches.launched(u32::MAX - 2, S);
        launches.launched(3, S);
        let lost = launches
            .take_lost(10 * S)
            .expect("the launch after the wrap");
        assert_eq!(lost.launches, 1);
    }

    #[test]
    fn memory_is_bounded_and_launches_past_it_still_counted() {
        let mut launches = Unanswered::default();
        for id in 1..=(MAX_KEPT as u32 + 10) {
            launches.launched(id, S + u64::from(id));
        }
        assert_eq!(launches.pending.len(), MAX_KEPT);
        let lost = launches.take_lost(10 * S).expect("lost");
        assert_eq!(lost.launches, MAX_KEPT as u64 + 10);
        assert_eq!(lost.from_ns, S + 1);
        // A kernel that came back after the first uncounted launch leaves
        // the uncounted ones out, and a second overflow starts its count
        // afresh.
        for id in 1..=(MAX_KEPT as u32 + 10) {
            launches.launched(id, S);
        }
        launches.answered(MAX_KEPT as u32 + 5, S);
        assert_eq!(launches.take_lost(10 * S), None);
        for id in 1..=(MAX_KEPT as u32 + 10) {
            launches.launched(id, S);
        }
        launches.answered(MAX_KEPT as u32 + 5, S);
        launches.launched(MAX_KEPT as u32 + 11, S);
        for id in (MAX_KEPT as u32 + 12)..(2 * MAX_KEPT as u32 + 20) {
            launches.launched(id, S);
        }
        let lost = launches.take_lost(10 * S).expect("lost");
        assert_eq!(lost.launches, u64::from(MAX_KEPT as u32 + 20 - 11));
    }
}
