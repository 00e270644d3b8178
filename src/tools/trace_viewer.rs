//! Trace viewer: the XSpace as Chrome trace-event JSON, which Perfetto and
//! `chrome://tracing` open.
//!
//! - One process per plane that has lines with events: `/host:CPU` is pid
//!   701 (XProf's host pid), `/device:GPU:<n>` and `/device:TPU:<n>` planes
//!   are `1 + plane id`, `/device:CUSTOM:` planes `501 + id`, any other plane
//!   gets a pid from 1001 on; each has `process_name` (`<host> <plane>`) and
//!   `process_sort_index` metadata.
//! - One thread per line with events: tid = `display_id`, else `id` (as
//!   uint32), named by `display_name`, else `name`.
//! - Each event is a complete event (`"ph":"X"`) with `ts` and `dur` in
//!   microseconds in the XSpace's time base (0 = capture start). Its name is
//!   the metadata's `display_name` (then `long_name` holds the name) or
//!   `name`; step roots (`_r` with `step_num` or `iter_num`) are named
//!   `<name> <step>` as XProf names them. Args are the metadata's stats, then
//!   the event's, by stat name; XProf's internal stats (`_r`, `_p`, `_c`,
//!   `group_id`, `flow`, ...) and bytes values are left out, and so are
//!   XProf's internal events (`MemoryAllocation`, `MemoryDeallocation`,
//!   tf.data produce/consume markers). Events of a `_counters_` line become
//!   counter samples (`"ph":"C"`).
//!
//! [`TraceViewerOptions`] selects a window (milliseconds from the capture
//! start; events overlapping it are kept whole) and a resolution: the most
//! events to return. Past it the window is cut into buckets by start time
//! and each bucket gives up its shortest events first, round-robin over the
//! buckets, so a huge trace answers with its longest events spread over the
//! whole window. The choice is deterministic.

use std::collections::HashSet;

use crate::proto::tensorflow::profiler::{x_event, XEvent, XLine, XPlane, XSpace};

use super::json::{self, Array, Object};
use super::stats::{get, int_value, stat_name, value, Value};
use super::{ToolError, HOST_PLANE};

/// Default cap on returned events.
pub const DEFAULT_RESOLUTION: usize = 100_000;
/// Most buckets the window is cut into when events must be dropped.
const MAX_BUCKETS: usize = 1000;

/// The window and size of a trace-viewer answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceViewerOptions {
    /// Window start, milliseconds from the capture start; `None`: the start.
    pub start_time_ms: Option<f64>,
    /// Window end, milliseconds from the capture start; `None`: the end.
    pub end_time_ms: Option<f64>,
    /// Most events (complete events plus counter samples) to return; 0: all.
    pub resolution: usize,
}

impl Default for TraceViewerOptions {
    fn default() -> Self {
        TraceViewerOptions {
            start_time_ms: None,
            end_time_ms: None,
            resolution: DEFAULT_RESOLUTION,
        }
    }
}

/// A stat value as an event argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
}

/// A process (plane).
#[derive(Clone, Debug, PartialEq)]
pub struct Process {
    pub pid: u32,
    pub name: String,
}

/// A thread (line) of a process.
#[derive(Clone, Debug, PartialEq)]
pub struct Thread {
    pub pid: u32,
    pub tid: u32,
    pub name: String,
    /// Position of the line in its plane.
    pub sort_index: usize,
}

/// What a trace event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `"X"`: a span (or instant, with zero duration) on a thread.
    Complete,
    /// `"C"`: a counter sample; args are the counter values.
    Counter,
}

/// One trace event.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub phase: Phase,
    pub pid: u32,
    pub tid: u32,
    pub name: String,
    /// Start, picoseconds in the XSpace's time base.
    pub ts_ps: i64,
    pub dur_ps: i64,
    pub args: Vec<(String, Arg)>,
}

/// A trace-viewer answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub processes: Vec<Process>,
    pub threads: Vec<Thread>,
    /// Sorted by start, then process and thread.
    pub events: Vec<TraceEvent>,
    /// Displayable events in the whole trace.
    pub total_events: usize,
    /// Of those, the ones overlapping the window.
    pub events_in_window: usize,
    /// The window, picoseconds (`i64::MIN` / `i64::MAX` when open).
    pub window_ps: (i64, i64),
}

/// Event names XProf treats as internal and never displays.
const INTERNAL_EVENTS: [&str; 13] = [
    "MemoryAllocation",
    "MemoryDeallocation",
    "PrefetchProduce",
    "PrefetchConsume",
    "ParallelInterleaveProduce",
    "ParallelInterleaveConsume",
    "ParallelInterleaveInitializeInput",
    "ParallelMapProduce",
    "ParallelMapConsume",
    "MapAndBatchProduce",
    "MapAndBatchConsume",
    "ParseExampleProduce",
    "ParseExampleConsume",
];

/// Stats XProf does not show as arguments.
const HIDDEN_STATS: [&str; 11] = [
    "_pt",
    "_p",
    "_ct",
    "_c",
    "_r",
    "flops",
    "program_id",
    "symbol_id",
    "group_id",
    "flow",
    "_a",
];

const COUNTERS_LINE: &str = "_counters_";

/// A displayable event before it is materialised.
#[derive(Clone, Copy)]
struct Candidate {
    plane: usize,
    line: usize,
    event: usize,
    start: i64,
    duration: i64,
}

fn offset_ps(event: &XEvent) -> i64 {
    match event.data {
        Some(x_event::Data::OffsetPs(ps)) => ps,
        _ => 0,
    }
}

fn start_ps(line: &XLine, event: &XEvent) -> i64 {
    line.timestamp_ns
        .saturating_mul(1000)
        .saturating_add(offset_ps(event))
}

fn metadata_name<'p>(plane: &'p XPlane, event: &XEvent) -> &'p str {
    plane
        .event_metadata
        .get(&event.metadata_id)
        .map_or("", |m| m.name.as_str())
}

fn window_bound(name: &'static str, ms: Option<f64>) -> Result<Option<i64>, ToolError> {
    // Picoseconds in an i64: no trace reaches further.
    const LATEST_MS: f64 = i64::MAX as f64 / 1e9;
    match ms {
        None => Ok(None),
        Some(ms) if ms.is_finite() && (0.0..=LATEST_MS).contains(&ms) => {
            Ok(Some((ms * 1e9).round() as i64))
        }
        Some(ms) => Err(ToolError::InvalidParameter {
            name,
            reason: format!(
                "{ms} is not a time in milliseconds from the capture start (0 to {})",
                LATEST_MS.floor()
            ),
        }),
    }
}

impl TraceViewerOptions {
    /// The window in picoseconds from the capture start, each end open
    /// when not given; its bounds checked.
    pub fn window_ps(&self) -> Result<(Option<i64>, Option<i64>), ToolError> {
        let start = window_bound("start_time_ms", self.start_time_ms)?;
        let end = window_bound("end_time_ms", self.end_time_ms)?;
        if let (Some(s), Some(e)) = (start, end) {
            if e <= s {
                return Err(ToolError::InvalidParameter {
                    name: "end_time_ms",
                    reason: "must be after start_time_ms".into(),
                });
            }
        }
        Ok((start, end))
    }
}

/// The trace of `space` in the window and at the resolution of `options`.
pub fn trace_viewer(space: &XSpace, options: &TraceViewerOptions) -> Result<Trace, ToolError> {
    let (start, end) = options.window_ps()?;
    let window = (start.unwrap_or(i64::MIN), end.unwrap_or(i64::MAX));

    let mut candidates = Vec::new();
    let mut total_events = 0;
    for (p, plane) in space.planes.iter().enumerate() {
        for (l, line) in plane.lines.iter().enumerate() {
            for (e, event) in line.events.iter().enumerate() {
                if INTERNAL_EVENTS.contains(&metadata_name(plane, event)) {
                    continue;
                }
                total_events += 1;
                let start = start_ps(line, event);
                let duration = event.duration_ps.max(0);
                if start <= window.1 && start.saturating_add(duration) >= window.0 {
                    candidates.push(Candidate {
                        plane: p,
                        line: l,
                        event: e,
                        start,
                        duration,
                    });
                }
            }
        }
    }
    let events_in_window = candidates.len();
    if options.resolution > 0 && candidates.len() > options.resolution {
        candidates = downsample(candidates, options.resolution, window);
    }

    let pids = assign_pids(space);
    let hostname = space.hostnames.first().map_or("", String::as_str);
    let mut processes = Vec::new();
    let mut threads = Vec::new();
    for (p, plane) in space.planes.iter().enumerate() {
        let Some(pid) = pids[p] else { continue };
        processes.push(Process {
            pid,
            name: if hostname.is_empty() {
                plane.name.clone()
            } else {
                format!("{hostname} {}", plane.name)
            },
        });
        for (l, line) in plane.lines.iter().enumerate() {
            if line.events.is_empty() {
                continue;
            }
            threads.push(Thread {
                pid,
                tid: tid(line),
                name: if line.display_name.is_empty() {
                    line.name.clone()
                } else {
                    line.display_name.clone()
                },
                sort_index: l,
            });
        }
    }

    let mut events: Vec<TraceEvent> = candidates
        .iter()
        .filter_map(|c| {
            let plane = &space.planes[c.plane];
            let line = &plane.lines[c.line];
            let pid = pids[c.plane]?;
            Some(materialise(plane, line, &line.events[c.event], pid, c))
        })
        .collect();
    events.sort_by(|a, b| {
        (a.ts_ps, a.pid, a.tid)
            .cmp(&(b.ts_ps, b.pid, b.tid))
            .then(b.dur_ps.cmp(&a.dur_ps))
    });
    Ok(Trace {
        processes,
        threads,
        events,
        total_events,
        events_in_window,
        window_ps: window,
    })
}

fn tid(line: &XLine) -> u32 {
    let id = if line.display_id != 0 {
        line.display_id
    } else {
        line.id
    };
    id as u32
}

/// A pid per plane that has a line with events; `None` for the others.
fn assign_pids(space: &XSpace) -> Vec<Option<u32>> {
    let mut used = HashSet::new();
    let mut pids: Vec<Option<u32>> = space
        .planes
        .iter()
        .map(|plane| {
            if plane.lines.iter().all(|l| l.events.is_empty()) {
                return None;
            }
            let id = u32::try_from(plane.id).ok();
            let is_ordinal = |prefix: &str| {
                plane
                    .name
                    .strip_prefix(prefix)
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            };
            let preferred = if plane.name == HOST_PLANE {
                Some(701)
            } else if is_ordinal("/device:GPU:") || is_ordinal("/device:TPU:") {
                id.filter(|id| *id < 500).map(|id| id + 1)
            } else if plane.name.starts_with("/device:CUSTOM:") {
                id.filter(|id| *id < 199).map(|id| id + 501)
            } else {
                None
            };
            preferred.filter(|pid| used.insert(*pid))
        })
        .collect();
    let mut next = 1001u32;
    for (pid, plane) in pids.iter_mut().zip(&space.planes) {
        if pid.is_none() && plane.lines.iter().any(|l| !l.events.is_empty()) {
            while !used.insert(next) {
                next += 1;
            }
            *pid = Some(next);
        }
    }
    pids
}

/// Keeps `limit` candidates: the window is cut into buckets by start, each
/// bucket's events are ranked longest first, and buckets take turns.
fn downsample(mut candidates: Vec<Candidate>, limit: usize, window: (i64, i64)) -> Vec<Candidate> {
    let first = candidates.iter().map(|c| c.start).min().unwrap_or(0);
    let last = candidates.iter().map(|c| c.start).max().unwrap_or(0);
    let lo = window.0.max(first);
    let hi = window.1.min(last).max(lo);
    let buckets = limit.clamp(1, MAX_BUCKETS);
    // In i128: a window from i64::MIN to i64::MAX spans more than an i64.
    let span = (i128::from(hi) - i128::from(lo)) as u128;
    let width = (span / buckets as u128 + 1) as i128;
    let bucket_of = |c: &Candidate| -> usize {
        let offset = (i128::from(c.start) - i128::from(lo)).max(0);
        ((offset / width) as usize).min(buckets - 1)
    };
    candidates.sort_by(|a, b| {
        bucket_of(a)
            .cmp(&bucket_of(b))
            .then(b.duration.cmp(&a.duration))
            .then(a.start.cmp(&b.start))
            .then((a.plane, a.line, a.event).cmp(&(b.plane, b.line, b.event)))
    });
    // Rank of each candidate within its bucket.
    let mut ranked: Vec<(usize, usize, usize)> = Vec::with_capacity(candidates.len());
    let mut previous = usize::MAX;
    let mut rank = 0;
    for (i, c) in candidates.iter().enumerate() {
        let b = bucket_of(c);
        rank = if b == previous { rank + 1 } else { 0 };
        previous = b;
        ranked.push((rank, b, i));
    }
    ranked.sort_unstable();
    ranked.truncate(limit);
    ranked.into_iter().map(|(_, _, i)| candidates[i]).collect()
}

fn arg_of(v: Value<'_>) -> Option<Arg> {
    Some(match v {
        Value::Int(i) => Arg::Int(i),
        Value::Uint(u) => Arg::Uint(u),
        Value::Double(d) => Arg::Double(d),
        Value::Str(s) => Arg::Str(s.to_string()),
        Value::Bytes(_) => return None,
    })
}

fn materialise(
    plane: &XPlane,
    line: &XLine,
    event: &XEvent,
    pid: u32,
    c: &Candidate,
) -> TraceEvent {
    let metadata = plane.event_metadata.get(&event.metadata_id);
    let name = metadata.map_or("", |m| m.name.as_str());
    let mut args = Vec::new();
    let mut display = match metadata {
        Some(m) if !m.display_name.is_empty() => {
            args.push(("long_name".to_string(), Arg::Str(m.name.clone())));
            m.display_name.clone()
        }
        _ => name.to_string(),
    };
    let metadata_stats = metadata.map_or(&[][..], |m| m.stats.as_slice());
    for stat in metadata_stats.iter().chain(&event.stats) {
        let key = stat_name(plane, stat);
        if key.is_empty() || HIDDEN_STATS.contains(&key) {
            continue;
        }
        if key == "step_name" {
            if let Some(Value::Str(s)) = value(plane, stat) {
                display = s.to_string();
            }
            continue;
        }
        if let Some(arg) = value(plane, stat).and_then(arg_of) {
            args.push((key.to_string(), arg));
        }
    }
    if get(plane, &event.stats, "_r").is_some() && get(plane, &event.stats, "step_name").is_none() {
        let step = get(plane, &event.stats, "iter_num")
            .or_else(|| get(plane, &event.stats, "step_num"))
            .map(int_value);
        if let Some(step) = step {
            display = format!("{display} {step}");
        }
    }
    let counter = line.name == COUNTERS_LINE;
    TraceEvent {
        phase: if counter {
            Phase::Counter
        } else {
            Phase::Complete
        },
        pid,
        tid: tid(line),
        name: display,
        ts_ps: c.start,
        dur_ps: c.duration,
        args,
    }
}

fn write_arg(out: &mut String, arg: &Arg) {
    match arg {
        Arg::Int(i) => out.push_str(&i.to_string()),
        Arg::Uint(u) => out.push_str(&u.to_string()),
        Arg::Double(d) => json::number(out, *d),
        Arg::Str(s) => json::string(out, s),
    }
}

impl Trace {
    /// Number of complete events.
    pub fn complete_events(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.phase == Phase::Complete)
            .count()
    }

    /// The Chrome trace-event JSON document: `{"displayTimeUnit": "ns",
    /// "otherData": {...counts...}, "traceEvents": [metadata events, then
    /// "X" and "C" events]}`.
    pub fn to_json(&self) -> String {
        let us = |ps: i64| ps as f64 / 1e6;
        let mut out = String::with_capacity(256 + self.events.len() * 160);
        let mut doc = Object::new(&mut out);
        doc.str("displayTimeUnit", "ns");
        {
            let mut other = Object::new(doc.key("otherData"));
            other.str("source", "devtrace");
            other.raw("total_events", self.total_events);
            other.raw("events_in_window", self.events_in_window);
            other.raw("events_returned", self.events.len());
            if self.window_ps.0 != i64::MIN {
                other.num("start_time_ms", self.window_ps.0 as f64 / 1e9);
            }
            if self.window_ps.1 != i64::MAX {
                other.num("end_time_ms", self.window_ps.1 as f64 / 1e9);
            }
            other.end();
        }
        let mut list = Array::new(doc.key("traceEvents"));
        let metadata = |out: &mut String,
                        pid: u32,
                        tid: Option<u32>,
                        name: &str,
                        key: &str,
                        value: &dyn Fn(&mut String)| {
            let mut o = Object::new(out);
            o.str("ph", "M");
            o.raw("pid", pid);
            if let Some(tid) = tid {
                o.raw("tid", tid);
            }
            o.str("name", name);
            let mut args = Object::new(o.key("args"));
            value(args.key(key));
            args.end();
            o.end();
        };
        for p in &self.processes {
            metadata(list.item(), p.pid, None, "process_name", "name", &|out| {
                json::string(out, &p.name)
            });
            metadata(
                list.item(),
                p.pid,
                None,
                "process_sort_index",
                "sort_index",
                &|out| out.push_str(&p.pid.to_string()),
            );
        }
        for t in &self.threads {
            metadata(
                list.item(),
                t.pid,
                Some(t.tid),
                "thread_name",
                "name",
                &|out| json::string(out, &t.name),
            );
            metadata(
                list.item(),
                t.pid,
                Some(t.tid),
                "thread_sort_index",
                "sort_index",
                &|out| out.push_str(&t.sort_index.to_string()),
            );
        }
        for e in &self.events {
            let mut o = Object::new(list.item());
            match e.phase {
                Phase::Complete => {
                    o.str("ph", "X");
                    o.raw("pid", e.pid);
                    o.raw("tid", e.tid);
                    o.str("name", &e.name);
                    o.num("ts", us(e.ts_ps));
                    o.num("dur", us(e.dur_ps));
                }
                Phase::Counter => {
                    o.str("ph", "C");
                    o.raw("pid", e.pid);
                    o.str("name", &e.name);
                    o.num("ts", us(e.ts_ps));
                }
            }
            let mut args = Object::new(o.key("args"));
            for (key, arg) in &e.args {
                if e.phase == Phase::Counter && matches!(arg, Arg::Str(_)) {
                    continue;
                }
                write_arg(args.key(key), arg);
            }
            args.end();
            o.end();
        }
        list.end();
        doc.end();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidates(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                plane: 0,
                line: 0,
                event: i,
                start: i as i64 * 10,
                duration: (i % 7) as i64,
            })
            .collect()
    }

    #[test]
    fn downsampling_caps_and_spreads() {
        let kept = downsample(candidates(10_000), 100, (i64::MIN, i64::MAX));
        assert_eq!(kept.len(), 100);
        // Spread over the whole trace, one per bucket.
        let first = kept.iter().map(|c| c.start).min().unwrap_or(0);
        let last = kept.iter().map(|c| c.start).max().unwrap_or(0);
        assert!(first < 1000 && last > 99_000 - 1000, "{first} {last}");
        // The longest of each bucket.
        assert!(kept.iter().all(|c| c.duration == 6));
        let again = downsample(candidates(10_000), 100, (i64::MIN, i64::MAX));
        let key = |v: &[Candidate]| v.iter().map(|c| c.event).collect::<Vec<_>>();
        assert_eq!(key(&kept), key(&again));
    }

    #[test]
    fn bad_windows_are_refused() {
        let space = XSpace::default();
        let bad = |start, end| {
            trace_viewer(
                &space,
                &TraceViewerOptions {
                    start_time_ms: start,
                    end_time_ms: end,
                    resolution: 0,
                },
            )
        };
        assert!(matches!(
            bad(Some(-1.0), None),
            Err(ToolError::InvalidParameter {
                name: "start_time_ms",
                ..
            })
        ));
        assert!(matches!(
            bad(Some(5.0), Some(5.0)),
            Err(ToolError::InvalidParameter {
                name: "end_time_ms",
                ..
            })
        ));
        assert!(matches!(
            bad(None, Some(f64::NAN)),
            Err(ToolError::InvalidParameter {
                name: "end_time_ms",
                ..
            })
        ));
        // Beyond any trace: named as such, not saturated into a window
        // that is then "not after" its start.
        let far = bad(Some(1e20), Some(2e20)).unwrap_err().to_string();
        assert!(
            far.starts_with("start_time_ms: 100000000000000000000 is not a time")
                && far.contains("(0 to 9223372036)"),
            "{far}"
        );
        assert!(bad(None, None).is_ok());
    }

    #[test]
    fn one_event_of_a_trace_spanning_all_of_time_is_kept() {
        use crate::proto::tensorflow::profiler::XEventMetadata;
        let mut plane = XPlane {
            name: HOST_PLANE.into(),
            ..XPlane::default()
        };
        plane.event_metadata.insert(
            1,
            XEventMetadata {
                id: 1,
                name: "step".into(),
                ..XEventMetadata::default()
            },
        );
        for (id, timestamp_ns) in [(1, i64::MIN), (2, 0), (3, i64::MAX)] {
            plane.lines.push(XLine {
                id,
                timestamp_ns,
                events: vec![XEvent {
                    metadata_id: 1,
                    duration_ps: 1,
                    ..XEvent::default()
                }],
                ..XLine::default()
            });
        }
        let space = XSpace {
            planes: vec![plane],
            ..XSpace::default()
        };
        let trace = trace_viewer(
            &space,
            &TraceViewerOptions {
                resolution: 1,
                ..TraceViewerOptions::default()
            },
        )
        .unwrap();
        assert_eq!(trace.events_in_window, 3);
        assert_eq!(trace.events.len(), 1);
    }
}
