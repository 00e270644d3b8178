//! Sorted runs of events merged into one stream in timeline order: start
//! ascending, the longer of two that start together first, and events alike
//! in both in the order of their runs. The flight recorder keeps each chunk
//! sorted, and chunks overlap only where events arrived late, so a window's
//! chunks merged this way reach each line in the order XProf reads it,
//! without the window's events ever being held at once.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::event::Event;

/// The next event of one run, ordered by where it goes in the merge.
struct Head {
    event: Event,
    run: usize,
}

impl Head {
    fn key(&self) -> (u64, Reverse<u64>, usize) {
        (
            self.event.start_ns,
            Reverse(self.event.duration_ns),
            self.run,
        )
    }
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Head {}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

/// See the module documentation. A run is read for the first time only when
/// the merge reaches the earliest start it may hold, and dropped as soon as
/// it is spent, so that only the runs overlapping the current instant are
/// open at once.
pub struct MergedRuns<I> {
    runs: Vec<Option<I>>,
    /// Runs not yet opened, latest first, with the earliest start each may
    /// hold.
    unopened: Vec<(u64, usize)>,
    /// The head that comes first, when known, kept out of the heap: most of
    /// a window is one run open at a time, whose events then go from the run
    /// to the caller without a heap operation each.
    front: Option<Head>,
    /// The other heads; none comes before `front`.
    heads: BinaryHeap<Reverse<Head>>,
}

impl<I: Iterator<Item = Event>> MergedRuns<I> {
    /// Merges `runs`, each sorted in timeline order and holding nothing
    /// that starts before the start paired with it.
    pub fn new(runs: Vec<(u64, I)>) -> MergedRuns<I> {
        let mut unopened: Vec<(u64, usize)> = runs
            .iter()
            .enumerate()
            .map(|(index, (first, _))| (*first, index))
            .collect();
        unopened.sort_by_key(|&(first, index)| Reverse((first, index)));
        MergedRuns {
            runs: runs.into_iter().map(|(_, run)| Some(run)).collect(),
            unopened,
            front: None,
            heads: BinaryHeap::new(),
        }
    }

    /// Reads run `index`'s next event into the heads, dropping the run once
    /// it is spent.
    fn advance(&mut self, index: usize) {
        let next = self.runs[index].as_mut().and_then(Iterator::next);
        match next {
            Some(event) => self.insert(Head { event, run: index }),
            None => self.runs[index] = None,
        }
    }

    fn insert(&mut self, head: Head) {
        match &self.front {
            Some(front) if head < *front => {
                let was = self.front.replace(head);
                self.heads.extend(was.map(Reverse));
            }
            Some(_) => self.heads.push(Reverse(head)),
            None => match self.heads.peek() {
                Some(Reverse(top)) if *top < head => self.heads.push(Reverse(head)),
                _ => self.front = Some(head),
            },
        }
    }

    fn earliest_start(&self) -> Option<u64> {
        match &self.front {
            Some(front) => Some(front.event.start_ns),
            None => self.heads.peek().map(|Reverse(head)| head.event.start_ns),
        }
    }

    fn pop(&mut self) -> Option<Head> {
        self.front
            .take()
            .or_else(|| self.heads.pop().map(|Reverse(head)| head))
    }
}

impl<I: Iterator<Item = Event>> Iterator for MergedRuns<I> {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        // A run that may start at or before the earliest head could hold
        // what comes first: open it before choosing.
        while let Some(&(first, index)) = self.unopened.last() {
            if self
                .earliest_start()
                .is_some_and(|earliest| first > earliest)
            {
                break;
            }
            self.unopened.pop();
            self.advance(index);
        }
        let head = self.pop()?;
        self.advance(head.run);
        Some(head.event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Device, NameId, Payload};

    fn event(start_ns: u64, duration_ns: u64, line: u64) -> Event {
        Event::new(
            start_ns,
            duration_ns,
            Device::Host,
            line,
            NameId(1),
            Payload::Plain,
        )
    }

    fn keys(events: impl Iterator<Item = Event>) -> Vec<(u64, u64, u64)> {
        events
            .map(|e| (e.start_ns, e.duration_ns, e.line))
            .collect()
    }

    #[test]
    fn overlapping_runs_merge_in_timeline_order_ties_in_run_order() {
        let first = vec![event(1, 5, 0), event(4, 1, 0), event(9, 1, 0)];
        let second = vec![event(2, 1, 1), event(4, 3, 1), event(4, 1, 1)];
        let third = vec![event(20, 1, 2)];
        let merged = MergedRuns::new(vec![
            (1, first.into_iter()),
            (2, second.into_iter()),
            (20, third.into_iter()),
        ]);
        assert_eq!(
            keys(merged),
            vec![
                (1, 5, 0),
                (2, 1, 1),
                (4, 3, 1),
                (4, 1, 0),
                (4, 1, 1),
                (9, 1, 0),
                (20, 1, 2)
            ]
        );
    }

    #[test]
    fn a_run_is_not_read_before_the_merge_reaches_it_and_is_dropped_when_spent() {
        use std::cell::Cell;
        use std::rc::Rc;
        let opened = Rc::new(Cell::new(0));
        let run = |events: Vec<Event>| {
            let opened = Rc::clone(&opened);
            let mut events = Some(events.into_iter());
            let mut counted = false;
            std::iter::from_fn(move || {
                if !counted {
                    counted = true;
                    opened.set(opened.get() + 1);
                }
                events.as_mut()?.next()
            })
        };
        let mut merged = MergedRuns::new(vec![
            (1, run(vec![event(1, 1, 0), event(2, 1, 0)])),
            (10, run(vec![event(10, 1, 0)])),
        ]);
        assert_eq!(merged.next().map(|e| e.start_ns), Some(1));
        assert_eq!(opened.get(), 1);
        assert_eq!(merged.next().map(|e| e.start_ns), Some(2));
        assert_eq!(merged.next().map(|e| e.start_ns), Some(10));
        assert_eq!(opened.get(), 2);
        assert!(merged.runs[0].is_none());
        assert!(merged.next().is_none());
    }

    #[test]
    fn empty_runs_and_no_runs_yield_nothing() {
        let none: Vec<(u64, std::vec::IntoIter<Event>)> = Vec::new();
        assert_eq!(MergedRuns::new(none).count(), 0);
        let empty = MergedRuns::new(vec![
            (5, Vec::new().into_iter()),
            (1, Vec::new().into_iter()),
        ]);
        assert_eq!(empty.count(), 0);
    }

    /// Many runs of many shapes (overlapping, nested, alone, starting
    /// together): the merge is the stable sort of all their events by
    /// timeline order, runs in order.
    #[test]
    fn any_runs_merge_to_the_stable_sort_of_their_events() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        for case in 0..300 {
            let run_count = 1 + next(6) as usize;
            let mut runs = Vec::new();
            let mut all = Vec::new();
            for run in 0..run_count {
                let first = next(50);
                let mut events: Vec<Event> = (0..next(40))
                    .map(|_| event(first + next(60), next(5), run as u64))
                    .collect();
                events.sort_by_key(|e| (e.start_ns, Reverse(e.duration_ns)));
                all.extend(events.iter().map(|e| (run, *e)));
                runs.push((first, events.into_iter()));
            }
            all.sort_by_key(|(run, e)| (e.start_ns, Reverse(e.duration_ns), *run));
            let wanted = keys(all.into_iter().map(|(_, e)| e));
            assert_eq!(keys(MergedRuns::new(runs)), wanted, "case {case}");
        }
    }
}
