//! When the eBPF hooks were attached. With `--ebpf-attach capture` they are
//! off between captures, so a window reaching back before its capture (a
//! look-back, a trigger's `before`, a continuous snapshot) has no scheduler
//! slices and no probed driver calls there: a capture of such a window is
//! told which part, rather than shown CPUs that look idle.

use std::collections::VecDeque;

use crate::recorder::Window;

/// Spans kept; older ones are forgotten, and nothing is said of their time.
const MOST_SPANS: usize = 1024;

/// Less than this off in a window is not told: the hooks go on a few
/// milliseconds after the window of the capture that attaches them opens.
const SLACK_NS: u64 = 50_000_000;

/// The times the hooks were attached, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Coverage {
    /// (attached, detached); the last may still be open.
    spans: VecDeque<(u64, Option<u64>)>,
    /// Nothing is said of the time before this: before the backend started
    /// (the flight recorder tells that), or spans forgotten.
    known_from_ns: u64,
}

impl Coverage {
    /// Nothing attached yet, from `now_ns` on.
    pub fn since(now_ns: u64) -> Coverage {
        Coverage {
            spans: VecDeque::new(),
            known_from_ns: now_ns,
        }
    }

    pub fn attached(&mut self, at_ns: u64) {
        if self.spans.back().is_some_and(|(_, end)| end.is_none()) {
            return;
        }
        if self.spans.len() == MOST_SPANS {
            if let Some((_, end)) = self.spans.pop_front() {
                self.known_from_ns = self.known_from_ns.max(end.unwrap_or(at_ns));
            }
        }
        self.spans.push_back((at_ns, None));
    }

    pub fn detached(&mut self, at_ns: u64) {
        if let Some((start, end @ None)) = self.spans.back_mut() {
            *end = Some(at_ns.max(*start));
        }
    }

    /// The parts of `window` the hooks were off for, when they add up to
    /// more than the slack of an attach.
    pub fn gaps(&self, window: Window) -> Vec<(u64, u64)> {
        let until = window.stop_ns;
        let mut cursor = window.start_ns.max(self.known_from_ns);
        let mut gaps = Vec::new();
        for &(start, end) in &self.spans {
            if cursor >= until {
                break;
            }
            let end = end.unwrap_or(u64::MAX);
            if end <= cursor {
                continue;
            }
            if start > cursor {
                gaps.push((cursor, start.min(until)));
            }
            cursor = cursor.max(end);
        }
        if cursor < until {
            gaps.push((cursor, until));
        }
        let off: u64 = gaps.iter().map(|(from, to)| to - from).sum();
        if off < SLACK_NS {
            return Vec::new();
        }
        gaps
    }

    /// The warning for a capture of `window`, if the hooks were off for
    /// part of it. `missing` names what the backend records;
    /// `between_captures` is whether they are off between captures by
    /// choice (the flag that changes it is named then).
    pub fn describe(
        &self,
        window: Window,
        missing: &str,
        between_captures: bool,
    ) -> Option<String> {
        const MOST_TOLD: usize = 3;
        let gaps = self.gaps(window);
        if gaps.is_empty() {
            return None;
        }
        let seconds = |ns: u64| (ns - window.start_ns) as f64 / 1e9;
        let mut spans: Vec<String> = gaps
            .iter()
            .take(MOST_TOLD)
            .map(|&(from, to)| format!("from {:.3} s to {:.3} s", seconds(from), seconds(to)))
            .collect();
        if gaps.len() > MOST_TOLD {
            spans.push(format!("{} more spans", gaps.len() - MOST_TOLD));
        }
        let why = if between_captures {
            " (they are attached during captures only; --ebpf-attach always records between \
             them too)"
        } else {
            ""
        };
        Some(format!(
            "the eBPF backend's hooks were off {} of this window{why}: it holds no {missing} \
             for that time",
            spans.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn window(start_s: u64, stop_s: u64) -> Window {
        Window {
            start_ns: start_s * S,
            stop_ns: stop_s * S,
        }
    }

    #[test]
    fn the_parts_of_a_window_before_between_and_after_attached_spans_are_gaps() {
        let mut coverage = Coverage::since(S);
        coverage.attached(10 * S);
        coverage.detached(12 * S);
        coverage.attached(15 * S);
        // Before the backend started nothing is said; then off until 10 s,
        // on to 12 s, off to 15 s, on since.
        assert_eq!(
            coverage.gaps(window(0, 20)),
            [(S, 10 * S), (12 * S, 15 * S)]
        );
        // A window within one attached span is whole.
        assert!(coverage.gaps(window(16, 20)).is_empty());
        assert!(coverage.gaps(window(10, 12)).is_empty());
        coverage.detached(18 * S);
        assert_eq!(coverage.gaps(window(16, 20)), [(18 * S, 20 * S)]);
        let told = coverage
            .describe(window(11, 16), "scheduler slices", true)
            .expect("a gap");
        assert!(
            told.contains("off from 1.000 s to 4.000 s of this window")
                && told.contains("--ebpf-attach always")
                && told.contains("it holds no scheduler slices for that time"),
            "{told}"
        );
    }

    #[test]
    fn an_attach_a_few_milliseconds_into_a_window_is_not_told() {
        let mut coverage = Coverage::since(0);
        coverage.attached(10 * S + 20_000_000);
        assert!(coverage.describe(window(10, 12), "x", true).is_none());
        coverage.detached(11 * S);
        assert!(coverage.describe(window(10, 12), "x", true).is_some());
    }

    #[test]
    fn forgotten_spans_move_what_is_known_forward() {
        let mut coverage = Coverage::since(0);
        for i in 0..MOST_SPANS as u64 + 1 {
            coverage.attached(i * 10 * S);
            coverage.detached(i * 10 * S + S);
        }
        // The first span (0..1 s) is forgotten: nothing is said before 1 s.
        assert_eq!(coverage.gaps(window(0, 10)), [(S, 10 * S)]);
    }
}
