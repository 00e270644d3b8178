//! The overview: what a first look at a trace needs.
//!
//! - **Steps**: events on `/host:CPU` with a root stat (`_r`) and a
//!   `step_num` (int64), in start order, with count and average / min / max
//!   duration.
//! - **Device busy time**: per `/device:GPU:<n>` plane, the union of its
//!   events' intervals (positive duration, lines outside XProf's derived
//!   range) within the trace span, as a percentage of the span. The span is
//!   the capture window from the `Task Environment` plane
//!   (`profile_start_time`, `profile_stop_time`; time 0 of the lines), or
//!   else first event start to last event end.
//! - **Heaviest host ops**: events on `/host:CPU` named like framework ops
//!   (`name:Type`), by total time.
//! - **Heaviest kernels**: GPU events with `kernel_details`, by total time.

use std::collections::HashMap;

use crate::proto::tensorflow::profiler::XSpace;
use crate::xspace::read::{event_name, event_start_ps};

use super::json::{Array, Object};
use super::stats::{get, int_value, str_or_ref_value, uint_value};
use super::{find_plane, is_derived_line, parse_tf_op, planes_with_prefix, ToolError};
use super::{GPU_PLANE_PREFIX, HOST_PLANE};

/// One training step.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub step_num: i64,
    /// Name of the step event (`train`, ...).
    pub name: String,
    pub start_ps: i64,
    pub duration_ps: i64,
}

/// How busy one device was.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceBusy {
    pub device: String,
    /// Time with at least one event running, within the span.
    pub busy_ps: i64,
    pub busy_percent: f64,
}

/// An event name with its count and total duration.
#[derive(Clone, Debug, PartialEq)]
pub struct NameTotal {
    pub name: String,
    pub count: u64,
    pub total_ps: i64,
}

/// See the module documentation.
#[derive(Clone, Debug, PartialEq)]
pub struct Overview {
    pub steps: Vec<Step>,
    /// Trace span, picoseconds in the XSpace's time base.
    pub span_ps: (i64, i64),
    pub devices: Vec<DeviceBusy>,
    pub top_host_ops: Vec<NameTotal>,
    pub top_kernels: Vec<NameTotal>,
}

impl Overview {
    /// (mean, min, max) step time in milliseconds, if there were steps.
    pub fn step_time_ms(&self) -> Option<(f64, f64, f64)> {
        let durations = self.steps.iter().map(|s| s.duration_ps);
        let min = durations.clone().min()?;
        let max = durations.clone().max()?;
        let total: i64 = durations.sum();
        Some((ms(total) / self.steps.len() as f64, ms(min), ms(max)))
    }

    /// `{"span_ms", "step_count", "step_time_ms": {"avg","min","max"} | null,
    /// "steps": [{"step_num","name","start_ms","duration_ms"}],
    /// "devices": [{"device","busy_ms","busy_percent"}],
    /// "top_host_ops" / "top_kernels": [{"name","count","total_ms","avg_ms"}]}`.
    pub fn to_json(&self) -> String {
        let mut out = String::new();
        let mut o = Object::new(&mut out);
        o.num("span_ms", ms(self.span_ps.1.saturating_sub(self.span_ps.0)));
        o.raw("step_count", self.steps.len());
        match self.step_time_ms() {
            Some((avg, min, max)) => {
                let mut t = Object::new(o.key("step_time_ms"));
                t.num("avg", avg);
                t.num("min", min);
                t.num("max", max);
                t.end();
            }
            None => o.raw("step_time_ms", "null"),
        }
        {
            let mut steps = Array::new(o.key("steps"));
            for step in &self.steps {
                let mut s = Object::new(steps.item());
                s.raw("step_num", step.step_num);
                s.str("name", &step.name);
                s.num("start_ms", ms(step.start_ps));
                s.num("duration_ms", ms(step.duration_ps));
                s.end();
            }
            steps.end();
        }
        {
            let mut devices = Array::new(o.key("devices"));
            for device in &self.devices {
                let mut d = Object::new(devices.item());
                d.str("device", &device.device);
                d.num("busy_ms", ms(device.busy_ps));
                d.num("busy_percent", device.busy_percent);
                d.end();
            }
            devices.end();
        }
        for (key, totals) in [
            ("top_host_ops", &self.top_host_ops),
            ("top_kernels", &self.top_kernels),
        ] {
            let mut list = Array::new(o.key(key));
            for total in totals {
                let mut t = Object::new(list.item());
                t.str("name", &total.name);
                t.raw("count", total.count);
                t.num("total_ms", ms(total.total_ps));
                t.num("avg_ms", ms(total.total_ps) / total.count.max(1) as f64);
                t.end();
            }
            list.end();
        }
        o.end();
        out
    }
}

fn ms(ps: i64) -> f64 {
    ps as f64 / 1e9
}

/// The overview of `space`, keeping the `top_n` heaviest host ops and
/// kernels. Fails when there is no `/host:CPU` plane.
pub fn overview(space: &XSpace, top_n: usize) -> Result<Overview, ToolError> {
    let host =
        find_plane(space, HOST_PLANE).ok_or_else(|| ToolError::MissingPlane(HOST_PLANE.into()))?;
    let span_ps = capture_span(space).unwrap_or_else(|| event_span(space));

    let mut steps = Vec::new();
    let mut host_ops: HashMap<&str, (u64, i64)> = HashMap::new();
    for line in &host.lines {
        for event in &line.events {
            let name = event_name(host, event);
            let start = event_start_ps(line.timestamp_ns, event);
            if get(host, &event.stats, "_r").is_some() {
                if let Some(step_num) = get(host, &event.stats, "step_num").map(int_value) {
                    steps.push(Step {
                        step_num,
                        name: name.to_string(),
                        start_ps: start,
                        duration_ps: event.duration_ps,
                    });
                }
            }
            if parse_tf_op(name).is_some() {
                let total = host_ops.entry(name).or_default();
                total.0 += 1;
                total.1 = total.1.saturating_add(event.duration_ps);
            }
        }
    }
    steps.sort_by_key(|s| (s.start_ps, s.step_num));

    let mut devices = Vec::new();
    let mut kernels: HashMap<&str, (u64, i64)> = HashMap::new();
    let span_length = span_ps.1.saturating_sub(span_ps.0);
    for plane in planes_with_prefix(space, GPU_PLANE_PREFIX) {
        let mut intervals = Vec::new();
        for line in plane.lines.iter().filter(|l| !is_derived_line(l.id)) {
            for event in line.events.iter().filter(|e| e.duration_ps > 0) {
                let start = event_start_ps(line.timestamp_ns, event);
                let end = start.saturating_add(event.duration_ps);
                let (s, e) = (start.max(span_ps.0), end.min(span_ps.1));
                if s < e {
                    intervals.push((s, e));
                }
                let is_kernel = get(plane, &event.stats, "kernel_details")
                    .is_some_and(|s| !str_or_ref_value(plane, s).is_empty());
                if is_kernel {
                    let total = kernels.entry(event_name(plane, event)).or_default();
                    total.0 += 1;
                    total.1 = total.1.saturating_add(event.duration_ps);
                }
            }
        }
        let busy_ps = union_length(&mut intervals);
        devices.push(DeviceBusy {
            device: plane.name.clone(),
            busy_ps,
            busy_percent: if span_length > 0 {
                100.0 * busy_ps as f64 / span_length as f64
            } else {
                0.0
            },
        });
    }
    Ok(Overview {
        steps,
        span_ps,
        devices,
        top_host_ops: top(host_ops, top_n),
        top_kernels: top(kernels, top_n),
    })
}

fn top(totals: HashMap<&str, (u64, i64)>, n: usize) -> Vec<NameTotal> {
    let mut list: Vec<NameTotal> = totals
        .into_iter()
        .map(|(name, (count, total_ps))| NameTotal {
            name: name.to_string(),
            count,
            total_ps,
        })
        .collect();
    list.sort_by(|a, b| {
        b.total_ps
            .cmp(&a.total_ps)
            .then_with(|| a.name.cmp(&b.name))
    });
    list.truncate(n);
    list
}

/// The capture window from the `Task Environment` plane, in the lines' time
/// base (0 = capture start).
fn capture_span(space: &XSpace) -> Option<(i64, i64)> {
    let env = find_plane(space, "Task Environment")?;
    let start = uint_value(get(env, &env.stats, "profile_start_time")?);
    let stop = uint_value(get(env, &env.stats, "profile_stop_time")?);
    let length = i64::try_from(stop.checked_sub(start)?).ok()?;
    (length > 0).then(|| (0, length.saturating_mul(1000)))
}

/// First start to last end over every event.
fn event_span(space: &XSpace) -> (i64, i64) {
    let mut span: Option<(i64, i64)> = None;
    for plane in &space.planes {
        for line in &plane.lines {
            for event in &line.events {
                let start = event_start_ps(line.timestamp_ns, event);
                let end = start.saturating_add(event.duration_ps);
                span = Some(span.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
            }
        }
    }
    span.unwrap_or((0, 0))
}

/// Total length covered by possibly overlapping intervals.
fn union_length(spans: &mut [(i64, i64)]) -> i64 {
    spans.sort_unstable();
    let mut total = 0i64;
    let mut current: Option<(i64, i64)> = None;
    for &(start, end) in spans.iter() {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total = total.saturating_add(e - s);
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total.saturating_add(current.map_or(0, |(s, e)| e - s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_counts_overlaps_once() {
        let mut spans = [(0, 10), (5, 20), (30, 40), (35, 36)];
        assert_eq!(union_length(&mut spans), 30);
        assert_eq!(union_length(&mut []), 0);
    }

    #[test]
    fn no_host_plane_is_an_error() {
        assert_eq!(
            overview(&XSpace::default(), 5),
            Err(ToolError::MissingPlane(HOST_PLANE.into()))
        );
    }
}
