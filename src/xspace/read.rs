//! Reading an XSpace back: decoding a `.xplane.pb` or `.xplane.riegeli`
//! file and summarising it (planes, lines, event counts, time span,
//! heaviest events).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use prost::Message;

use crate::model::printable::printable;
use crate::model::timeline::OFF_CPU_PREFIX;
use crate::proto::tensorflow::profiler::{x_event, x_stat, XEvent, XPlane, XSpace};

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not an XSpace (.xplane.pb): {source}")]
    Decode {
        path: String,
        source: prost::DecodeError,
    },
    #[error("{path} is not a chunked trace (.xplane.riegeli): {source}")]
    Chunked {
        path: String,
        source: super::chunks::ChunkError,
    },
    #[error("{path} is not an XSpace (.xplane.pb): {source}")]
    Malformed { path: String, source: Malformed },
    /// Zero bytes decode as an XSpace with nothing in it; no writer of
    /// traces leaves one (a write cut short, a file truncated).
    #[error("{path} is empty (0 bytes): not a trace")]
    Empty { path: String },
    #[error("{path} decodes to {bytes} bytes, more than may be held: {why}")]
    Refused {
        path: String,
        bytes: u64,
        why: String,
    },
}

/// A trace file as read: its XSpace, and how many chunks it was stored in
/// (1 for `.xplane.pb`).
pub struct TraceFile {
    pub space: XSpace,
    pub chunks: usize,
}

/// Reads a trace file a local user named (`devtrace inspect`): an
/// `.xplane.riegeli` file has its chunks merged, any other is decoded as
/// one XSpace. Files a client names are read beneath their allowed root
/// and decoded with [`decode_xspace`].
pub fn read_trace(path: &Path) -> Result<TraceFile, ReadError> {
    read_trace_within(path, &mut super::Unlimited)
}

/// As [`read_trace`], what decoding takes drawn from `grant`
/// ([`decode_trace_within`]).
pub fn read_trace_within<G>(path: &Path, grant: &mut G) -> Result<TraceFile, ReadError>
where
    G: super::Grant,
    G::Refusal: std::fmt::Display,
{
    // A regular file only: `/dev/zero` grew the reader until the kernel
    // killed it (and others), a FIFO hung it. Its size is the user's.
    let bytes = crate::model::small_file::read(path, u64::MAX).map_err(|source| ReadError::Io {
        path: path.display().to_string(),
        source,
    })?;
    decode_trace_within(&bytes, path, grant)
}

/// Decodes the bytes of the trace file at `path` (named in errors), by its
/// suffix: Riegeli chunks merged for `.xplane.riegeli`, one XSpace otherwise.
pub fn decode_trace(bytes: &[u8], path: &Path) -> Result<TraceFile, ReadError> {
    decode_trace_within(bytes, path, &mut super::Unlimited)
}

/// As [`decode_trace`], drawing from `grant` what decoding takes before it
/// is taken ([`super::footprint`]): for traces read for others, whose size
/// says little of what decoding them takes.
pub fn decode_trace_within<G>(
    bytes: &[u8],
    path: &Path,
    grant: &mut G,
) -> Result<TraceFile, ReadError>
where
    G: super::Grant,
    G::Refusal: std::fmt::Display,
{
    if bytes.is_empty() {
        return Err(ReadError::Empty {
            path: path.display().to_string(),
        });
    }
    let chunked = path
        .file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.ends_with(super::chunks::RIEGELI_SUFFIX));
    if !chunked {
        let decoded =
            super::footprint::decoded_bytes(bytes).map_err(|source| ReadError::Malformed {
                path: path.display().to_string(),
                source,
            })?;
        grant
            .take(usize::try_from(decoded).unwrap_or(usize::MAX))
            .map_err(|refusal| ReadError::Refused {
                path: path.display().to_string(),
                bytes: decoded,
                why: refusal.to_string(),
            })?;
        let space = decode_xspace(bytes, path)?;
        return Ok(TraceFile { space, chunks: 1 });
    }
    let (space, chunks) = super::chunks::decode_within(bytes, &mut super::grant::Said(grant))
        .map_err(|source| ReadError::Chunked {
            path: path.display().to_string(),
            source,
        })?;
    Ok(TraceFile { space, chunks })
}

/// The XSpace of a trace file, as [`read_trace`] reads it.
pub fn read_xspace(path: &Path) -> Result<XSpace, ReadError> {
    Ok(read_trace(path)?.space)
}

/// Decodes the bytes of the `.xplane.pb` file at `path` (named in errors).
pub fn decode_xspace(bytes: &[u8], path: &Path) -> Result<XSpace, ReadError> {
    XSpace::decode(bytes).map_err(|source| ReadError::Decode {
        path: path.display().to_string(),
        source,
    })
}

/// Name of an event's metadata, or "" when the id is unknown.
pub fn event_name<'p>(plane: &'p XPlane, event: &XEvent) -> &'p str {
    plane
        .event_metadata
        .get(&event.metadata_id)
        .map_or("", |m| m.name.as_str())
}

/// A stat value as found, with references resolved to their strings.
#[derive(Clone, Debug, PartialEq)]
pub enum StatValue {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
    Bytes(Vec<u8>),
}

/// Looks up the stat called `name` among `stats` of `plane`.
pub fn find_stat(
    plane: &XPlane,
    stats: &[crate::proto::tensorflow::profiler::XStat],
    name: &str,
) -> Option<StatValue> {
    let stat = stats.iter().find(|s| {
        plane
            .stat_metadata
            .get(&s.metadata_id)
            .is_some_and(|m| m.name == name)
    })?;
    Some(match stat.value.as_ref()? {
        x_stat::Value::Int64Value(v) => StatValue::Int(*v),
        x_stat::Value::Uint64Value(v) => StatValue::Uint(*v),
        x_stat::Value::DoubleValue(v) => StatValue::Double(*v),
        x_stat::Value::StrValue(v) => StatValue::Str(v.clone()),
        x_stat::Value::BytesValue(v) => StatValue::Bytes(v.clone()),
        x_stat::Value::RefValue(id) => StatValue::Str(
            plane
                .stat_metadata
                .get(&(*id as i64))
                .map_or_else(String::new, |m| m.name.clone()),
        ),
    })
}

/// Start of an event in picoseconds since the capture start.
pub fn event_start_ps(line_timestamp_ns: i64, event: &XEvent) -> i64 {
    let offset = match event.data {
        Some(x_event::Data::OffsetPs(ps)) => ps,
        _ => 0,
    };
    line_timestamp_ns
        .saturating_mul(1000)
        .saturating_add(offset)
}

#[derive(Debug)]
pub struct LineSummary {
    pub id: i64,
    pub name: String,
    pub events: usize,
}

#[derive(Debug)]
pub struct PlaneSummary {
    pub id: i64,
    pub name: String,
    pub lines: Vec<LineSummary>,
    pub events: usize,
    /// The plane's own stats (device facts, the process, the source), by
    /// name, in the order written.
    pub stats: Vec<(String, StatValue)>,
}

#[derive(Debug)]
pub struct EventTotal {
    pub name: String,
    pub count: u64,
    pub total_ps: i64,
}

/// What `devtrace inspect` prints.
#[derive(Debug)]
pub struct Summary {
    pub hostnames: Vec<String>,
    pub planes: Vec<PlaneSummary>,
    pub events: usize,
    /// First start and last end over all events, picoseconds.
    pub span_ps: Option<(i64, i64)>,
    pub top: Vec<EventTotal>,
    /// Threads' off-CPU spans (the eBPF backend's), left out of `top`.
    pub off_cpu: Option<EventTotal>,
    pub warnings: Vec<String>,
    pub errors: Vec<String>,
}

/// Summarises `space`, keeping the `top` heaviest event names by total time.
pub fn summarize(space: &XSpace, top: usize) -> Summary {
    let mut totals: HashMap<String, (u64, i64)> = HashMap::new();
    let mut off_cpu: (u64, i64) = (0, 0);
    let mut span: Option<(i64, i64)> = None;
    let mut planes = Vec::new();
    let mut all_events = 0;
    for plane in &space.planes {
        let mut lines = Vec::new();
        let mut plane_events = 0;
        for line in &plane.lines {
            for event in &line.events {
                let start = event_start_ps(line.timestamp_ns, event);
                let end = start.saturating_add(event.duration_ps);
                span = Some(span.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
                let name = event_name(plane, event);
                // Threads waiting are no work: totalled apart, so that the
                // top events are what ran.
                let total = if name.starts_with(OFF_CPU_PREFIX) {
                    &mut off_cpu
                } else {
                    totals.entry(name.to_string()).or_default()
                };
                total.0 += 1;
                total.1 = total.1.saturating_add(event.duration_ps);
            }
            plane_events += line.events.len();
            lines.push(LineSummary {
                id: line.id,
                name: if line.display_name.is_empty() {
                    line.name.clone()
                } else {
                    line.display_name.clone()
                },
                events: line.events.len(),
            });
        }
        all_events += plane_events;
        let stats = plane
            .stats
            .iter()
            .filter_map(|stat| {
                let name = plane.stat_metadata.get(&stat.metadata_id)?.name.clone();
                let value = find_stat(plane, std::slice::from_ref(stat), &name)?;
                Some((name, value))
            })
            .collect();
        planes.push(PlaneSummary {
            id: plane.id,
            name: plane.name.clone(),
            lines,
            events: plane_events,
            stats,
        });
    }
    let mut top_events: Vec<EventTotal> = totals
        .into_iter()
        .map(|(name, (count, total_ps))| EventTotal {
            name,
            count,
            total_ps,
        })
        .collect();
    top_events.sort_by(|a, b| b.total_ps.cmp(&a.total_ps).then(a.name.cmp(&b.name)));
    top_events.truncate(top);
    Summary {
        off_cpu: (off_cpu.0 > 0).then(|| EventTotal {
            name: "off-CPU".into(),
            count: off_cpu.0,
            total_ps: off_cpu.1,
        }),
        hostnames: space.hostnames.clone(),
        planes,
        events: all_events,
        span_ps: span,
        top: top_events,
        warnings: space.warnings.clone(),
        errors: space.errors.clone(),
    }
}

fn ms(ps: i64) -> f64 {
    ps as f64 / 1e9
}

/// Names and messages come from the file, whoever wrote it: printed
/// escaped ([`crate::model::printable`]).
impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "hosts: {}", printable(&self.hostnames.join(", ")))?;
        match self.span_ps {
            Some((start, end)) => writeln!(
                f,
                "events: {} from {:.3} ms to {:.3} ms ({:.3} ms)",
                self.events,
                ms(start),
                ms(end),
                ms(end - start)
            )?,
            None => writeln!(f, "events: 0")?,
        }
        for plane in &self.planes {
            writeln!(
                f,
                "plane {} (id {}): {} lines, {} events",
                printable(&plane.name),
                plane.id,
                plane.lines.len(),
                plane.events
            )?;
            for line in &plane.lines {
                writeln!(
                    f,
                    "  line {} (id {}): {} events",
                    printable(&line.name),
                    line.id,
                    line.events
                )?;
            }
        }
        if !self.top.is_empty() {
            writeln!(f, "top events by total time:")?;
            for total in &self.top {
                writeln!(
                    f,
                    "  {:>12.3} ms {:>9}x  {}",
                    ms(total.total_ps),
                    total.count,
                    printable(&total.name)
                )?;
            }
        }
        if let Some(off) = &self.off_cpu {
            writeln!(
                f,
                "off-CPU (threads waiting, not among the top events): {:.3} ms in {} spans",
                ms(off.total_ps),
                off.count
            )?;
        }
        for warning in &self.warnings {
            writeln!(f, "warning: {}", printable(warning))?;
        }
        for error in &self.errors {
            writeln!(f, "error: {}", printable(error))?;
        }
        Ok(())
    }
}

impl StatValue {
    /// As JSON: numbers and strings as they are, bytes by their length.
    fn to_json(&self) -> serde_json::Value {
        match self {
            StatValue::Int(v) => (*v).into(),
            StatValue::Uint(v) => (*v).into(),
            StatValue::Double(v) => (*v).into(),
            StatValue::Str(v) => v.clone().into(),
            StatValue::Bytes(v) => format!("<{} bytes>", v.len()).into(),
        }
    }
}

impl Summary {
    /// The summary as one JSON document (`devtrace inspect --json`), for
    /// scripts: what the text form shows, plus each plane's stats.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let planes: Vec<serde_json::Value> = self
            .planes
            .iter()
            .map(|plane| {
                let stats: serde_json::Map<String, serde_json::Value> = plane
                    .stats
                    .iter()
                    .map(|(name, value)| (name.clone(), value.to_json()))
                    .collect();
                json!({
                    "id": plane.id,
                    "name": plane.name,
                    "events": plane.events,
                    "lines": plane.lines.iter().map(|line| json!({
                        "id": line.id,
                        "name": line.name,
                        "events": line.events,
                    })).collect::<Vec<_>>(),
                    "stats": stats,
                })
            })
            .collect();
        json!({
            "hosts": self.hostnames,
            "events": self.events,
            "span_ps": self.span_ps.map(|(start, end)| [start, end]),
            "planes": planes,
            "top": self.top.iter().map(|total| json!({
                "name": total.name,
                "count": total.count,
                "total_ps": total.total_ps,
            })).collect::<Vec<_>>(),
            "off_cpu": self.off_cpu.as_ref().map(|off| json!({
                "count": off.count,
                "total_ps": off.total_ps,
            })),
            "warnings": self.warnings,
            "errors": self.errors,
        })
    }
}

/// Bytes that are not a well-formed protobuf message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed XSpace: {0}")]
pub struct Malformed(String);

impl Malformed {
    pub(super) fn new(what: &str) -> Malformed {
        Malformed(what.to_string())
    }
}

/// The plane names of an encoded XSpace, read without decoding its events:
/// enough to tell which tools a file supports, cheaply, for many files.
pub fn plane_names(bytes: &[u8]) -> Result<Vec<String>, Malformed> {
    let mut names = Vec::new();
    let mut space = WireReader(bytes);
    while let Some((field, value)) = space.next_field()? {
        if let (1, WireValue::Bytes(plane)) = (field, value) {
            names.extend(plane_name(plane)?.map(|n| String::from_utf8_lossy(n).into_owned()));
        }
    }
    Ok(names)
}

/// The name of an encoded XPlane (its field 2), read without decoding the
/// rest. A field that occurs twice takes its last value, as in protobuf.
fn plane_name(plane: &[u8]) -> Result<Option<&[u8]>, Malformed> {
    let mut fields = WireReader(plane);
    let mut name = None;
    while let Some((field, value)) = fields.next_field()? {
        if let (2, WireValue::Bytes(text)) = (field, value) {
            name = Some(text);
        }
    }
    Ok(name)
}

/// Bytes of a trace [`check_trace_head`] looks at.
pub const TRACE_HEAD_BYTES: usize = 64;

/// Whether `head`, the first bytes of a trace of `length` bytes, begins as
/// a trace does: a Riegeli/records file's signature when `chunked`, else a
/// protobuf field that fits the message (an XSpace's first). Cheap, for
/// bytes a peer sends before they are stored; why not, when not.
pub fn check_trace_head(head: &[u8], length: u64, chunked: bool) -> Result<(), String> {
    if chunked {
        return if super::riegeli::begins_with_signature(head) {
            Ok(())
        } else {
            Err(
                "is said to be Riegeli chunks (xplane.riegeli) but does not begin with that \
                 format's signature"
                    .into(),
            )
        };
    }
    if length == 0 {
        return Ok(());
    }
    let mut fields = WireReader(head);
    let malformed =
        || "(xplane.pb) does not begin with a protobuf field: not an XSpace".to_string();
    let key = fields.varint().map_err(|_| malformed())?;
    match (key >> 3, key & 7) {
        (0, _) => Err(malformed()),
        (_, 0 | 1 | 5) => Ok(()),
        (_, 2) => match fields.varint() {
            Ok(field) if field <= length.saturating_sub((head.len() - fields.0.len()) as u64) => {
                Ok(())
            }
            Ok(_) => Err(format!(
                "(xplane.pb) begins with a field longer than its {length} bytes"
            )),
            // The length's varint may run past a short head.
            Err(_) if (head.len() as u64) < length => Ok(()),
            Err(_) => Err(malformed()),
        },
        _ => Err(malformed()),
    }
}

/// How late a server may begin recording and still count as having
/// recorded the window asked for: a call's own latency.
pub const RECORDING_START_SLACK_NS: u64 = 50_000_000;

/// The `profile_start_time` of an encoded XSpace's Task Environment
/// plane (when its server began recording; TensorFlow's servers record it
/// too), decoding that plane alone.
pub fn recording_start_ns(bytes: &[u8]) -> Option<u64> {
    let mut space = WireReader(bytes);
    while let Ok(Some((field, value))) = space.next_field() {
        let (1, WireValue::Bytes(plane)) = (field, value) else {
            continue;
        };
        let name = plane_name(plane).ok().flatten();
        if name != Some(crate::model::timeline::TASK_ENVIRONMENT_PLANE.as_bytes()) {
            continue;
        }
        let space = XSpace {
            planes: vec![XPlane::decode(plane).ok()?],
            ..XSpace::default()
        };
        return super::merge::profile_start_ns(&space);
    }
    None
}

/// The errors (what failed: an upstream that did not answer, say) and
/// warnings of an encoded XSpace (its fields 2 and 3), read in one walk
/// without decoding its planes: what a client shows of a trace it has just
/// received.
pub fn errors_and_warnings(bytes: &[u8]) -> Result<(Vec<String>, Vec<String>), Malformed> {
    let (mut errors, mut warnings) = (Vec::new(), Vec::new());
    let mut space = WireReader(bytes);
    while let Some((field, value)) = space.next_field()? {
        let text = match value {
            WireValue::Bytes(text) => String::from_utf8_lossy(text).into_owned(),
            WireValue::Scalar => continue,
        };
        match field {
            2 => errors.push(text),
            3 => warnings.push(text),
            _ => {}
        }
    }
    Ok((errors, warnings))
}

pub(super) enum WireValue<'b> {
    Scalar,
    Bytes(&'b [u8]),
}

/// Walks the top-level fields of one protobuf message.
pub(super) struct WireReader<'b>(pub(super) &'b [u8]);

impl<'b> WireReader<'b> {
    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self
                .0
                .split_first()
                .ok_or_else(|| Malformed::new("truncated varint"))?;
            self.0 = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(value);
            }
        }
        Err(Malformed::new("varint too long"))
    }

    fn take(&mut self, n: usize) -> Result<&'b [u8], Malformed> {
        if n > self.0.len() {
            return Err(Malformed::new("truncated field"));
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    pub(super) fn next_field(&mut self) -> Result<Option<(u64, WireValue<'b>)>, Malformed> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => {
                self.varint()?;
                WireValue::Scalar
            }
            1 => {
                self.take(8)?;
                WireValue::Scalar
            }
            2 => {
                let length = usize::try_from(self.varint()?)
                    .map_err(|_| Malformed::new("length too large"))?;
                WireValue::Bytes(self.take(length)?)
            }
            5 => {
                self.take(4)?;
                WireValue::Scalar
            }
            // A group (deprecated, but valid): skipped up to its end.
            3 => {
                self.skip_group(key >> 3, 1)?;
                WireValue::Scalar
            }
            other => return Err(Malformed(format!("unsupported wire type {other}"))),
        };
        Ok(Some((key >> 3, value)))
    }

    /// Skips the fields of group `field` up to its end marker; `depth` is
    /// bounded as prost bounds it, so nested groups cannot exhaust the stack.
    fn skip_group(&mut self, field: u64, depth: u32) -> Result<(), Malformed> {
        const MAX_DEPTH: u32 = 100;
        if depth > MAX_DEPTH {
            return Err(Malformed::new("groups nested too deeply"));
        }
        loop {
            if self.0.is_empty() {
                return Err(Malformed::new("unterminated group"));
            }
            let key = self.varint()?;
            match key & 7 {
                4 if key >> 3 == field => return Ok(()),
                4 => return Err(Malformed::new("mismatched end of group")),
                3 => self.skip_group(key >> 3, depth + 1)?,
                0 => drop(self.varint()?),
                1 => drop(self.take(8)?),
                2 => {
                    let length = usize::try_from(self.varint()?)
                        .map_err(|_| Malformed::new("length too large"))?;
                    self.take(length)?;
                }
                5 => drop(self.take(4)?),
                other => return Err(Malformed(format!("unsupported wire type {other}"))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads' off-CPU spans, long as they are, are no work: the top
    /// events are what ran, and the waiting is totalled on its own.
    #[test]
    fn off_cpu_spans_are_totalled_apart_from_the_top_events() {
        use crate::proto::tensorflow::profiler::{XEventMetadata, XLine};
        let event = |id: i64, duration_ps: i64| XEvent {
            metadata_id: id,
            duration_ps,
            ..XEvent::default()
        };
        let named = |id: i64, name: &str| {
            (
                id,
                XEventMetadata {
                    id,
                    name: name.into(),
                    ..XEventMetadata::default()
                },
            )
        };
        let space = XSpace {
            planes: vec![XPlane {
                name: "/host:CPUs".into(),
                event_metadata: [named(1, "off-CPU: S (sleeping)"), named(2, "train")].into(),
                lines: vec![XLine {
                    events: vec![event(1, 9_000_000_000), event(1, i64::MAX), event(2, 1_000)],
                    ..XLine::default()
                }],
                ..XPlane::default()
            }],
            ..XSpace::default()
        };
        let summary = summarize(&space, 5);
        let top: Vec<&str> = summary.top.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(top, ["train"]);
        let off = summary.off_cpu.as_ref().expect("off-CPU totalled");
        assert_eq!((off.count, off.total_ps), (2, i64::MAX));
        assert!(summary
            .to_string()
            .contains("off-CPU (threads waiting, not among the top events)"));
        assert_eq!(summary.to_json()["off_cpu"]["count"], 2);
    }

    #[test]
    fn errors_and_warnings_are_read_past_the_planes_without_decoding_them() {
        let space = XSpace {
            planes: vec![XPlane {
                name: "/host:CPU".into(),
                ..XPlane::default()
            }],
            errors: vec!["an error".into()],
            warnings: vec!["first".into(), "second".into()],
            hostnames: vec!["h".into()],
        };
        let bytes = space.encode_to_vec();
        let (errors, warnings) = errors_and_warnings(&bytes).unwrap();
        assert_eq!(warnings, ["first", "second"]);
        assert_eq!(errors, ["an error"]);
        assert!(errors_and_warnings(&bytes[..bytes.len() - 1]).is_err());
        let (errors, warnings) = errors_and_warnings(&[]).unwrap();
        assert!(errors.is_empty() && warnings.is_empty());
    }
}
