//! What the CUDA backend tells the captures about the processes it traces:
//! the processes attached in a window, their libraries' lasting states, the
//! notices of the moment, and the spans of a process's GPU activity that
//! are missing (another CUPTI user had the stream, or CUPTI was starting),
//! or of its launch calls (the library's subscriber stopped timing them).

use std::collections::VecDeque;

use tracing::info;

use super::*;

/// Something a capture overlapping `at_ns` should be told.
#[derive(Clone, Debug)]
pub(super) struct Notice {
    pub(super) at_ns: u64,
    /// The user of the process or ring it is about: only that user's
    /// scoped captures are told.
    pub(super) uid: u32,
    pub(super) text: String,
}

pub(super) const MAX_NOTICES: usize = 256;

/// Why a span of a process's GPU activity is missing from the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LossCause {
    /// Another CUPTI user had the activity stream; `seen` when its calls
    /// passed through the library (else it was found out after the fact).
    OtherUser { seen: bool },
    /// The library was asked to capture and CUPTI was not recording yet.
    Starting,
    /// The capture ended with CUPTI still not recording: the library was
    /// slow to act (its thread not scheduled, CUPTI's first enable longer
    /// than the window) or stopped tracing (its states say why).
    NeverStarted,
    /// The timeline's API calls were not recorded: the library's subscriber
    /// that timed them stopped, for that reason (its GPU activity is there,
    /// without the calls that launched it).
    ApiCalls(UntimedCause),
    /// The GPU work of this many of the process's launch calls never came
    /// back from CUPTI, nor that of any later launch, up to the capture's
    /// end.
    Unanswered { launches: u64 },
    /// CUPTI's records were forced back (at the span's end) while this
    /// much of the process's GPU work was still running, or waiting to
    /// run: its records came back unfinished. `started` when some of it
    /// had started (at the span's start).
    Unfinished {
        kernels: u64,
        other: u64,
        started: bool,
    },
}

/// A span of one process's GPU activity that is missing from the trace.
#[derive(Clone, Debug)]
pub(super) struct LostSpan {
    pub(super) pid: u32,
    pub(super) label: String,
    pub(super) from_ns: u64,
    /// Open while the cause lasts.
    pub(super) to_ns: Option<u64>,
    pub(super) cause: LossCause,
}

impl LostSpan {
    /// The warning for a window this span overlaps. A start still awaited
    /// is not told: its capture has not ended (then it is closed as
    /// [`LossCause::NeverStarted`]), or the process is gone, which its
    /// states say.
    pub(super) fn describe(&self, window: Window) -> Option<String> {
        if self.cause == LossCause::Starting && self.to_ns.is_none() {
            return None;
        }
        let to_ns = self.to_ns.unwrap_or(u64::MAX);
        if self.from_ns > window.stop_ns || to_ns <= window.start_ns || to_ns == self.from_ns {
            return None;
        }
        let from = self.from_ns.max(window.start_ns);
        let to = to_ns.min(window.stop_ns);
        // A start within the millisecond the warning would print is no
        // loss worth a line ("0 ms later").
        if self.cause == LossCause::Starting && to_ns - self.from_ns < SUB_MILLISECOND_NS {
            return None;
        }
        let seconds = |ns: u64| (ns - window.start_ns) as f64 / 1e9;
        let span = format!(
            "from {:.3} s to {:.3} s of this window: that process's GPU activity in those \
             {:.0} ms is missing",
            seconds(from),
            seconds(to),
            (to - from) as f64 / 1e6,
        );
        Some(match self.cause {
            LossCause::OtherUser { seen } => {
                let how = if seen {
                    ""
                } else {
                    " (found out after the fact, as that profiler reached CUPTI without passing \
                     through the library: the span starts when the library last knew it had the \
                     stream, it takes the stream back at the next capture, and the other \
                     profiler may have lost records it wrote into the library's buffers)"
                };
                format!(
                    "another CUPTI user in {} (a framework profiler such as torch.profiler) had \
                     the activity stream {span}{how}",
                    self.label
                )
            }
            LossCause::Starting => format!(
                "the injection library in {} was asked to record and CUPTI started recording \
                 {:.0} ms later, {span} (CUPTI is started for each capture and detached after \
                 it, so that the job runs at full speed between captures)",
                self.label,
                (to_ns - self.from_ns) as f64 / 1e6,
            ),
            LossCause::NeverStarted => format!(
                "the injection library in {} was asked to record and CUPTI had not started \
                 recording when the capture ended, {span}",
                self.label,
            ),
            LossCause::Unanswered { launches } => format!(
                "CUPTI handed the injection library in {} no kernel record of its last \
                 {launches} launch calls, made from {:.3} s to {:.3} s of this window, and its \
                 kernels stopped coming back a second or more before the capture ended: the \
                 kernels of those launches are missing (a profiler that reached CUPTI without \
                 passing through the injection library took the activity stream or switched \
                 the kernels off, CUPTI dropped their records, which the trace then counts, or \
                 the launches were recorded into a CUDA graph rather than run)",
                self.label,
                seconds(from),
                seconds(to),
            ),
            LossCause::Unfinished {
                kernels,
                other,
                started,
            } => {
                let began = if started {
                    format!(
                        ", the earliest of it running from {:.3} s",
                        seconds(self.from_ns.max(window.start_ns))
                    )
                } else {
                    String::new()
                };
                let counted = |n: u64, one: &str, many: &str| {
                    format!("{n} {}", if n == 1 { one } else { many })
                };
                format!(
                    "CUPTI handed the injection library in {} the records of {} and {} \
                     unfinished, without their end: that work \
                     was still running or waiting to run on the GPU when the library took \
                     CUPTI's records back, {:.3} s from this window's start and after waiting \
                     for it to end, and CUPTI never completes such a record, so that work is \
                     missing from the trace{began} (some of it may have run after this window: \
                     the GPU ran far behind the launches)",
                    self.label,
                    counted(kernels, "kernel", "kernels"),
                    counted(other, "copy or memset", "copies or memsets"),
                    (to_ns - window.start_ns.min(to_ns)) as f64 / 1e9,
                )
            }
            LossCause::ApiCalls(cause) => format!(
                "the launch, copy and memset calls of {} from {:.3} s to {:.3} s of this window \
                 are missing (its kernels, copies and memsets are there, without the calls that \
                 made them): {}",
                self.label,
                seconds(from),
                seconds(to),
                match cause {
                    UntimedCause::Taken => {
                        "a profiler in that process took the injection library's Callback API \
                         subscriber, which timed them, and CUPTI's API records or that profiler \
                         took over"
                    }
                    UntimedCause::Silent => {
                        "CUPTI did not call the injection library's Callback API subscriber, \
                         which was to time them, while it recorded kernels, so CUPTI's API \
                         records took over"
                    }
                    UntimedCause::Unselected => {
                        "CUPTI wrote no record of the calls selected one by one for it to \
                         record (cuptiActivityEnableDriverApi and RuntimeApi) while it recorded \
                         kernels, so from then on, whenever CUPTI records that process's calls, \
                         it records every driver and runtime API call, at its cost on each"
                    }
                },
            ),
        })
    }
}

pub(super) const MAX_LOST_SPANS: usize = 256;

/// A CUPTI start quicker than this is not told.
const SUB_MILLISECOND_NS: u64 = 1_000_000;

/// A workload process and when it was attached.
#[derive(Clone, Debug)]
pub(super) struct Traced {
    pub(super) pid: u32,
    /// The user it runs as (its ring file's owner).
    pub(super) uid: u32,
    /// The bits above `STREAM_BITS` of its GPU lines.
    pub(super) slot: u64,
    /// The lines its events were put on, as drained so far.
    pub(super) lines: Vec<(Device, u64)>,
    pub(super) command: String,
    /// The libcupti it loaded, as `API version from origin`.
    pub(super) cupti: Option<String>,
    /// The API records it switched to, and when.
    pub(super) api_records: VecDeque<(u64, ApiRecordSet)>,
    /// What its library said about itself (it stopped, its CUPTI has known
    /// bugs): true for every capture while it runs.
    pub(super) states: Vec<String>,
    pub(super) attached_ns: u64,
    pub(super) detached_ns: Option<u64>,
}

impl Traced {
    pub(super) fn overlaps(&self, window: Window) -> bool {
        self.attached_ns <= window.stop_ns
            && self.detached_ns.is_none_or(|gone| gone >= window.start_ns)
    }

    /// The API record sets in force during `window`, in order: those
    /// switched to inside it, else the last before it.
    pub(super) fn api_records_during(&self, window: Window) -> Vec<ApiRecordSet> {
        let inside: Vec<ApiRecordSet> = self
            .api_records
            .iter()
            .filter(|(at, _)| (window.start_ns..=window.stop_ns).contains(at))
            .map(|(_, set)| *set)
            .collect();
        let mut sets = if inside.is_empty() {
            self.api_records
                .iter()
                .rev()
                .find(|(at, _)| *at < window.start_ns)
                .map(|(_, set)| *set)
                .into_iter()
                .collect()
        } else {
            inside
        };
        sets.dedup();
        sets
    }
}

/// Switches of API record sets remembered per process.
pub(super) const MAX_API_RECORD_SWITCHES: usize = 64;

pub(super) fn remember_switch(
    switches: &mut VecDeque<(u64, ApiRecordSet)>,
    at_ns: u64,
    set: ApiRecordSet,
) {
    if switches.len() == MAX_API_RECORD_SWITCHES {
        switches.pop_front();
    }
    switches.push_back((at_ns, set));
}

/// Processes remembered for the properties of captures.
pub(super) const MAX_TRACED: usize = 1024;

/// Why a ring that opened cleanly is not attached.
pub(super) enum Refusal {
    /// It is not the process's, or the process is gone: for good.
    Lasting(String),
    /// Its user has [`MAX_RINGS_PER_UID`] attached: until one goes.
    OverQuota(String),
}

#[derive(Default)]
pub(super) struct Status {
    pub(super) traced: VecDeque<Traced>,
    pub(super) attached: usize,
    /// Of those, the ones whose library loaded CUPTI (and has not stopped).
    pub(super) recorded: usize,
    pub(super) seen: u64,
    pub(super) events: u64,
    pub(super) cupti_dropped: u64,
    pub(super) ring_dropped: u64,
    /// Events refused as no CUDA workload makes them.
    pub(super) foreign: u64,
    pub(super) notices: VecDeque<Notice>,
    pub(super) lost_spans: VecDeque<LostSpan>,
    pub(super) last_error: Option<String>,
}

impl Status {
    pub(super) fn lost_from(&mut self, pid: u32, label: String, from_ns: u64, cause: LossCause) {
        if self.lost_spans.len() == MAX_LOST_SPANS {
            self.lost_spans.pop_front();
        }
        if let LossCause::OtherUser { .. } = cause {
            info!("{label}: another CUPTI user took the activity stream");
        }
        self.lost_spans.push_back(LostSpan {
            pid,
            label,
            from_ns,
            to_ns: None,
            cause,
        });
    }

    /// A span of `pid` known whole when told: from `from_ns` to `to_ns`.
    pub(super) fn lost_between(
        &mut self,
        pid: u32,
        label: String,
        from_ns: u64,
        to_ns: u64,
        cause: LossCause,
    ) {
        self.lost_from(pid, label, from_ns, cause);
        if let Some(span) = self.lost_spans.back_mut() {
            span.to_ns = Some(to_ns.max(from_ns));
        }
    }

    /// Closes the open spans of `pid` for causes `which` picks; answers
    /// whether there were any.
    pub(super) fn lost_until(
        &mut self,
        pid: u32,
        to_ns: u64,
        which: impl Fn(LossCause) -> bool,
    ) -> bool {
        let mut closed = false;
        for span in self.lost_spans.iter_mut().rev() {
            if span.pid == pid && span.to_ns.is_none() && which(span.cause) {
                span.to_ns = Some(to_ns.max(span.from_ns));
                closed = true;
            }
        }
        closed
    }

    /// The capture ended at `at_ns`: a start of `pid` still awaited is a
    /// span that never started, closed there (and no loss of a later
    /// capture).
    pub(super) fn never_started(&mut self, pid: u32, at_ns: u64) {
        for span in self.lost_spans.iter_mut().rev() {
            if span.pid == pid && span.to_ns.is_none() && span.cause == LossCause::Starting {
                span.cause = LossCause::NeverStarted;
                span.to_ns = Some(at_ns.max(span.from_ns));
            }
        }
    }

    /// The library of `pid` says CUPTI began recording at `at_ns`: closes
    /// the start it was asked for, also one taken for never started because
    /// the capture ended between the library's word and the agent reading
    /// it.
    pub(super) fn recording_began(&mut self, pid: u32, at_ns: u64) {
        for span in self.lost_spans.iter_mut().rev() {
            if span.pid != pid {
                continue;
            }
            match (span.cause, span.to_ns) {
                // A word from before this start (a late one of the last
                // capture's) closes nothing.
                (LossCause::Starting, None) if at_ns >= span.from_ns => span.to_ns = Some(at_ns),
                (LossCause::NeverStarted, Some(to_ns))
                    if (span.from_ns..to_ns).contains(&at_ns) =>
                {
                    span.cause = LossCause::Starting;
                    span.to_ns = Some(at_ns);
                }
                _ => {}
            }
        }
    }

    /// The remembered process `pid` (the latest of that pid).
    pub(super) fn traced_mut(&mut self, pid: u32) -> Option<&mut Traced> {
        self.traced.iter_mut().rev().find(|t| t.pid == pid)
    }

    /// A lasting state of process `pid`, reported in every capture that
    /// overlaps its life; `early` keeps it until the process is remembered.
    pub(super) fn state(&mut self, pid: u32, early: &mut Vec<String>, text: String) {
        info!("{text}");
        const MAX_STATES: usize = 8;
        let states = match self.traced_mut(pid) {
            Some(traced) => &mut traced.states,
            None => early,
        };
        if states.len() < MAX_STATES && !states.contains(&text) {
            states.push(text);
        }
    }

    /// Something to tell the captures running now that cover user `uid`.
    pub(super) fn notice(&mut self, uid: u32, text: String) {
        info!("{text}");
        if self.notices.len() == MAX_NOTICES {
            self.notices.pop_front();
        }
        self.notices.push_back(Notice {
            at_ns: clock::now_ns(),
            uid,
            text,
        });
    }

    /// The user of process `pid` as last attached; none when it never was.
    pub(super) fn uid_of(&self, pid: u32) -> Option<u32> {
        self.traced
            .iter()
            .rev()
            .find(|t| t.pid == pid)
            .map(|t| t.uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;
    const WINDOW: Window = Window {
        start_ns: 100 * SECOND,
        stop_ns: 110 * SECOND,
    };

    fn span(from_s: u64, to_s: Option<u64>, cause: LossCause) -> LostSpan {
        LostSpan {
            pid: 7,
            label: "process 7 (train.py)".to_string(),
            from_ns: from_s * SECOND,
            to_ns: to_s.map(|s| s * SECOND),
            cause,
        }
    }

    #[test]
    fn a_lost_span_is_told_clipped_to_the_window() {
        let other = LossCause::OtherUser { seen: true };
        let told = span(95, Some(103), other)
            .describe(WINDOW)
            .expect("overlaps");
        assert!(
            told.contains("from 0.000 s to 3.000 s of this window")
                && told.contains("those 3000 ms"),
            "{told}"
        );
        // Still open: to the window's end.
        let told = span(108, None, other).describe(WINDOW).expect("overlaps");
        assert!(told.contains("from 8.000 s to 10.000 s"), "{told}");
        // Outside the window, or empty: nothing.
        assert!(span(90, Some(100), other).describe(WINDOW).is_none());
        assert!(span(111, None, other).describe(WINDOW).is_none());
        assert!(span(104, Some(104), other).describe(WINDOW).is_none());
    }

    #[test]
    fn an_unseen_user_is_said_to_be_found_out_after_the_fact() {
        let seen = span(101, Some(102), LossCause::OtherUser { seen: true });
        let unseen = span(101, Some(102), LossCause::OtherUser { seen: false });
        assert!(!seen
            .describe(WINDOW)
            .unwrap()
            .contains("found out after the fact"));
        assert!(unseen
            .describe(WINDOW)
            .unwrap()
            .contains("found out after the fact"));
    }

    #[test]
    fn a_start_is_told_with_its_delay_once_recording_began() {
        let started = span(101, Some(102), LossCause::Starting);
        let told = started.describe(WINDOW).expect("overlaps");
        assert!(
            told.contains("CUPTI started recording 1000 ms later"),
            "{told}"
        );
        // Nor one within the millisecond.
        let quick = span(101, None, LossCause::Starting);
        let quick = LostSpan {
            to_ns: Some(quick.from_ns + 400_000),
            ..quick
        };
        assert!(quick.describe(WINDOW).is_none());
        // A start still awaited is not told before the capture ends.
        assert!(span(101, None, LossCause::Starting)
            .describe(WINDOW)
            .is_none());
    }

    /// What the trace of [`WINDOW`] says of the spans `status` holds.
    fn warnings_of(status: &Status) -> Vec<String> {
        status
            .lost_spans
            .iter()
            .filter_map(|span| span.describe(WINDOW))
            .collect()
    }

    #[test]
    fn a_start_awaited_when_the_capture_ended_is_told_as_never_started() {
        let mut status = Status::default();
        let starting = LossCause::Starting;
        status.lost_from(7, "process 7 (train.py)".into(), 101 * SECOND, starting);
        status.lost_from(8, "process 8".into(), 101 * SECOND, starting);
        status.lost_until(8, 102 * SECOND, |cause| cause == starting);
        status.never_started(7, 103 * SECOND);
        status.never_started(8, 103 * SECOND);
        let told = warnings_of(&status);
        assert_eq!(told.len(), 2, "{told:?}");
        assert!(
            told[0].starts_with(
                "the injection library in process 7 (train.py) was asked to record and CUPTI \
                 had not started recording when the capture ended, from 1.000 s to 3.000 s"
            ),
            "{told:?}"
        );
        assert!(
            told[1].contains("CUPTI started recording 1000 ms later"),
            "{told:?}"
        );
        // The library's word that it began, read only after the capture
        // ended, makes it a start again; one from after the capture does
        // not, nor one from before the start.
        status.recording_began(7, 104 * SECOND);
        status.recording_began(7, 100 * SECOND);
        let still = warnings_of(&status);
        assert!(
            still[0].contains("had not started recording when the capture ended"),
            "{still:?}"
        );
        status.recording_began(7, 102 * SECOND);
        status.recording_began(8, 104 * SECOND);
        let told = warnings_of(&status);
        assert!(
            told.len() == 2
                && told
                    .iter()
                    .all(|t| t.contains("CUPTI started recording 1000 ms later")),
            "{told:?}"
        );
    }

    #[test]
    fn a_span_told_whole_is_closed_and_leaves_open_ones_open() {
        let mut status = Status::default();
        let other = LossCause::OtherUser { seen: true };
        status.lost_from(7, "process 7".into(), 101 * SECOND, other);
        let lost = LossCause::Unanswered { launches: 3 };
        status.lost_between(7, "process 7".into(), 102 * SECOND, 104 * SECOND, lost);
        let spans: Vec<(LossCause, Option<u64>)> = status
            .lost_spans
            .iter()
            .map(|span| (span.cause, span.to_ns))
            .collect();
        assert_eq!(spans, [(other, None), (lost, Some(104 * SECOND))]);
    }

    #[test]
    fn unanswered_launches_are_told_with_their_count_and_span() {
        let told = span(102, Some(105), LossCause::Unanswered { launches: 250 })
            .describe(WINDOW)
            .expect("overlaps");
        assert!(
            told.contains(
                "no kernel record of its last 250 launch calls, made from 2.000 s to 5.000 s"
            ),
            "{told}"
        );
        // Not taken for the warnings of a profiler seen in the process.
        assert!(!told.contains("another CUPTI user"), "{told}");
    }

    #[test]
    fn work_handed_back_unfinished_is_told_with_its_count_and_start() {
        let cause = |started| LossCause::Unfinished {
            kernels: 2,
            other: 1,
            started,
        };
        let told = span(104, Some(106), cause(true))
            .describe(WINDOW)
            .expect("overlaps");
        assert!(
            told.contains("the records of 2 kernels and 1 copy or memset unfinished")
                && told.contains("back, 6.000 s from this window's start")
                && told.contains("the earliest of it running from 4.000 s"),
            "{told}"
        );
        // Work that had not started when forced back after the window ran
        // after it: not this window's loss.
        let after = LostSpan {
            to_ns: Some(111 * SECOND + 1),
            ..span(111, None, cause(false))
        };
        assert!(after.describe(WINDOW).is_none());
    }

    #[test]
    fn untimed_calls_are_told_as_calls_missing_beside_their_kernels() {
        let told = span(102, Some(103), LossCause::ApiCalls(UntimedCause::Taken))
            .describe(WINDOW)
            .expect("overlaps");
        assert!(
            told.starts_with(
                "the launch, copy and memset calls of process 7 (train.py) from \
                              2.000 s to 3.000 s of this window are missing"
            ) && told.contains("kernels, copies and memsets are there")
                && told.contains("Callback API subscriber"),
            "{told}"
        );
        assert!(span(90, Some(95), LossCause::ApiCalls(UntimedCause::Taken))
            .describe(WINDOW)
            .is_none());
        let silent = span(102, Some(103), LossCause::ApiCalls(UntimedCause::Silent))
            .describe(WINDOW)
            .expect("overlaps");
        assert!(silent.contains("CUPTI did not call"), "{silent}");
    }

    #[test]
    fn closing_spans_closes_only_the_causes_asked_for_and_never_before_their_start() {
        let mut status = Status::default();
        status.lost_from(7, "p".into(), 5, LossCause::Starting);
        status.lost_from(7, "p".into(), 6, LossCause::OtherUser { seen: true });
        status.lost_from(8, "q".into(), 6, LossCause::Starting);
        status.lost_until(7, 3, |cause| cause == LossCause::Starting);
        let ends: Vec<(u32, Option<u64>)> =
            status.lost_spans.iter().map(|s| (s.pid, s.to_ns)).collect();
        assert_eq!(ends, [(7, Some(5)), (7, None), (8, None)]);
    }

    #[test]
    fn the_remembered_spans_and_switches_are_bounded() {
        let mut status = Status::default();
        for at in 0..(MAX_LOST_SPANS as u64 + 10) {
            status.lost_from(1, "p".into(), at, LossCause::Starting);
        }
        assert_eq!(status.lost_spans.len(), MAX_LOST_SPANS);
        assert_eq!(status.lost_spans.front().map(|s| s.from_ns), Some(10));
        let mut switches = VecDeque::new();
        for at in 0..(MAX_API_RECORD_SWITCHES as u64 * 2) {
            remember_switch(&mut switches, at, ApiRecordSet::All);
        }
        assert_eq!(switches.len(), MAX_API_RECORD_SWITCHES);
    }

    #[test]
    fn a_window_names_the_api_records_switched_to_in_it_else_the_last_before() {
        let traced = Traced {
            pid: 7,
            uid: 0,
            slot: 1,
            lines: Vec::new(),
            command: String::new(),
            cupti: None,
            api_records: [
                (10, ApiRecordSet::Timeline),
                (100, ApiRecordSet::All),
                (150, ApiRecordSet::All),
                (200, ApiRecordSet::Timeline),
            ]
            .into_iter()
            .collect(),
            states: Vec::new(),
            attached_ns: 0,
            detached_ns: None,
        };
        let during = |start_ns, stop_ns| traced.api_records_during(Window { start_ns, stop_ns });
        assert_eq!(during(20, 90), [ApiRecordSet::Timeline]);
        assert_eq!(during(90, 160), [ApiRecordSet::All]);
        assert_eq!(during(90, 250), [ApiRecordSet::All, ApiRecordSet::Timeline]);
        assert_eq!(during(0, 5), []);
    }
}
