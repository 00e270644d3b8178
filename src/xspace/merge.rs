//! Folding the XSpace of another profiler (TensorFlow's or JAX's in-process
//! server, another devtrace agent) into this agent's, on one time base.
//!
//! - Time: every line of theirs is shifted by the difference between the two
//!   sides' `profile_start_time`, so both are relative to our start. A trace
//!   without one (libtpu's plugin) whose lines carry times since the epoch
//!   has them made relative to our start.
//! - `/host:CPU`: their threads join ours in the one plane XProf reads for
//!   host activity; their metadata ids are remapped, stat names deduplicated,
//!   and their lines' display names say where they came from.
//! - Device planes (`/device:GPU:n`, `/device:TPU:n`): kept as planes; a name
//!   we already use moves to the next free ordinal, and the plane records its
//!   source and original name as stats.
//! - `Task Environment` of theirs is dropped (ours describes the capture);
//!   any other plane is kept, renamed when its name is taken.
//! - Their errors and warnings are kept, prefixed with the source.

use std::collections::HashMap;

use crate::proto::tensorflow::profiler::{x_stat, XPlane, XSpace, XStat, XStatMetadata};

use super::conventions::{self, stat};

/// Stat naming where a merged plane came from.
pub const SOURCE_STAT: &str = "devtrace_source";
/// Stat holding a moved plane's original name.
pub const ORIGINAL_NAME_STAT: &str = "devtrace_original_plane";

/// The `profile_start_time` of an XSpace's Task Environment, if recorded.
pub fn profile_start_ns(space: &XSpace) -> Option<u64> {
    let plane = space
        .planes
        .iter()
        .find(|p| p.name == conventions::TASK_ENVIRONMENT_PLANE)?;
    plane.stats.iter().find_map(|s| {
        let named = plane
            .stat_metadata
            .get(&s.metadata_id)
            .is_some_and(|m| m.name == stat::PROFILE_START_TIME);
        match (&s.value, named) {
            (Some(x_stat::Value::Uint64Value(v)), true) => Some(*v),
            (Some(x_stat::Value::Int64Value(v)), true) => u64::try_from(*v).ok(),
            _ => None,
        }
    })
}

const ONE_DAY_NS: i64 = 86_400 * 1_000_000_000;

/// Merges `theirs`, captured by `source`, into `ours`.
pub fn merge(ours: &mut XSpace, theirs: XSpace, source: &str) {
    let our_start = profile_start_ns(ours);
    let their_start = profile_start_ns(&theirs);
    let line_shift = |timestamp_ns: i64| -> i64 {
        match (their_start, our_start) {
            (Some(their), Some(our)) => their as i64 - our as i64,
            // Times since the epoch (within a day of ours) are absolute.
            (None, Some(our)) if (timestamp_ns - our as i64).abs() < ONE_DAY_NS => -(our as i64),
            _ => 0,
        }
    };
    ours.errors
        .extend(theirs.errors.iter().map(|e| format!("{source}: {e}")));
    ours.warnings
        .extend(theirs.warnings.iter().map(|w| format!("{source}: {w}")));
    for mut plane in theirs.planes {
        if plane.name == conventions::TASK_ENVIRONMENT_PLANE {
            continue;
        }
        for line in &mut plane.lines {
            line.timestamp_ns = line
                .timestamp_ns
                .saturating_add(line_shift(line.timestamp_ns));
        }
        if plane.name == conventions::HOST_PLANE {
            for line in &mut plane.lines {
                let shown = if line.display_name.is_empty() {
                    &line.name
                } else {
                    &line.display_name
                };
                line.display_name = format!("{source} {shown}");
            }
            match ours
                .planes
                .iter_mut()
                .find(|p| p.name == conventions::HOST_PLANE)
            {
                Some(host) => merge_plane(host, plane),
                None => ours.planes.push(plane),
            }
            continue;
        }
        let original = plane.name.clone();
        if ours.planes.iter().any(|p| p.name == plane.name) {
            rename_to_free(ours, &mut plane);
        }
        add_stat(&mut plane, SOURCE_STAT, source);
        if plane.name != original {
            add_stat(&mut plane, ORIGINAL_NAME_STAT, &original);
        }
        ours.planes.push(plane);
    }
}

/// Gives a colliding plane the next free ordinal of its device kind, or a
/// suffix when it is not a device plane.
fn rename_to_free(ours: &XSpace, plane: &mut XPlane) {
    let taken = |name: &str| ours.planes.iter().any(|p| p.name == name);
    for prefix in ["/device:GPU:", "/device:TPU:"] {
        if plane.name.starts_with(prefix) {
            let ordinal = (0..).find(|n| !taken(&format!("{prefix}{n}"))).unwrap_or(0);
            plane.name = format!("{prefix}{ordinal}");
            plane.id = ordinal;
            return;
        }
    }
    let base = plane.name.clone();
    let suffix = (2..).find(|n| !taken(&format!("{base} #{n}"))).unwrap_or(2);
    plane.name = format!("{base} #{suffix}");
}

fn add_stat(plane: &mut XPlane, name: &str, value: &str) {
    let id = plane.stat_metadata.keys().max().copied().unwrap_or(0) + 1;
    plane.stat_metadata.insert(
        id,
        XStatMetadata {
            id,
            name: name.to_string(),
            description: String::new(),
        },
    );
    plane.stats.push(XStat {
        metadata_id: id,
        value: Some(x_stat::Value::StrValue(value.to_string())),
    });
}

/// Moves `theirs`' lines into `ours`, remapping metadata ids. Stat metadata
/// is matched by name (names must be unique within a plane; ref values point
/// at stat metadata, so they are remapped too).
fn merge_plane(ours: &mut XPlane, theirs: XPlane) {
    let mut stat_by_name: HashMap<String, i64> = ours
        .stat_metadata
        .values()
        .map(|m| (m.name.clone(), m.id))
        .collect();
    let mut next_stat = ours.stat_metadata.keys().max().copied().unwrap_or(0) + 1;
    let mut stat_map: HashMap<i64, i64> = HashMap::new();
    for (id, metadata) in &theirs.stat_metadata {
        let mapped = *stat_by_name
            .entry(metadata.name.clone())
            .or_insert_with(|| {
                let new = next_stat;
                next_stat += 1;
                ours.stat_metadata.insert(
                    new,
                    XStatMetadata {
                        id: new,
                        ..metadata.clone()
                    },
                );
                new
            });
        stat_map.insert(*id, mapped);
    }
    let remap_stats = |stats: &mut Vec<XStat>| {
        for s in stats.iter_mut() {
            s.metadata_id = stat_map
                .get(&s.metadata_id)
                .copied()
                .unwrap_or(s.metadata_id);
            if let Some(x_stat::Value::RefValue(target)) = &mut s.value {
                if let Some(mapped) = stat_map.get(&(*target as i64)) {
                    *target = *mapped as u64;
                }
            }
        }
    };
    let offset = ours.event_metadata.keys().max().copied().unwrap_or(0);
    for (id, mut metadata) in theirs.event_metadata {
        metadata.id = id + offset;
        metadata.child_id.iter_mut().for_each(|c| *c += offset);
        remap_stats(&mut metadata.stats);
        ours.event_metadata.insert(id + offset, metadata);
    }
    for mut line in theirs.lines {
        for event in &mut line.events {
            event.metadata_id += offset;
            remap_stats(&mut event.stats);
        }
        ours.lines.push(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{x_event, XEvent, XEventMetadata, XLine};
    use crate::xspace::read::{event_name, find_stat, StatValue};

    fn environment(start_ns: u64) -> XPlane {
        let mut plane = XPlane {
            id: 1000,
            name: "Task Environment".into(),
            ..XPlane::default()
        };
        plane.stat_metadata.insert(
            1,
            XStatMetadata {
                id: 1,
                name: "profile_start_time".into(),
                description: String::new(),
            },
        );
        plane.stats.push(XStat {
            metadata_id: 1,
            value: Some(x_stat::Value::Uint64Value(start_ns)),
        });
        plane
    }

    /// A plane with one line holding one event named `event` carrying a ref
    /// stat `tf_op` -> `op`.
    fn plane(name: &str, id: i64, event: &str, op: &str) -> XPlane {
        let mut plane = XPlane {
            id,
            name: name.into(),
            ..XPlane::default()
        };
        for (id, name) in [(1, "tf_op"), (2, op)] {
            plane.stat_metadata.insert(
                id,
                XStatMetadata {
                    id,
                    name: name.into(),
                    description: String::new(),
                },
            );
        }
        plane.event_metadata.insert(
            1,
            XEventMetadata {
                id: 1,
                name: event.into(),
                ..XEventMetadata::default()
            },
        );
        plane.lines.push(XLine {
            id: 7,
            name: "python".into(),
            timestamp_ns: 0,
            events: vec![XEvent {
                metadata_id: 1,
                data: Some(x_event::Data::OffsetPs(5_000)),
                duration_ps: 1_000,
                stats: vec![XStat {
                    metadata_id: 1,
                    value: Some(x_stat::Value::RefValue(2)),
                }],
            }],
            ..XLine::default()
        });
        plane
    }

    #[test]
    fn host_threads_join_ours_on_our_time_base_and_devices_move_aside() {
        let mut ours = XSpace {
            planes: vec![
                plane("/host:CPU", 49, "ours", "a:A"),
                plane("/device:GPU:0", 0, "k", "a:A"),
                environment(1_000),
            ],
            hostnames: vec!["agent".into()],
            ..XSpace::default()
        };
        let theirs = XSpace {
            planes: vec![
                plane("/host:CPU", 49, "theirs", "b:B"),
                plane("/device:GPU:0", 0, "k2", "b:B"),
                environment(1_250),
            ],
            errors: vec!["lost 3 events".into()],
            hostnames: vec!["worker".into()],
            ..XSpace::default()
        };
        merge(&mut ours, theirs, "tf@127.0.0.1:9999");
        let names: Vec<&str> = ours.planes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "/host:CPU",
                "/device:GPU:0",
                "Task Environment",
                "/device:GPU:1"
            ]
        );
        assert_eq!(ours.hostnames, vec!["agent".to_string()]);
        assert_eq!(
            ours.errors,
            vec!["tf@127.0.0.1:9999: lost 3 events".to_string()]
        );

        let host = &ours.planes[0];
        assert_eq!(host.lines.len(), 2);
        let merged = &host.lines[1];
        assert_eq!(merged.timestamp_ns, 250, "shifted onto our start");
        assert_eq!(merged.display_name, "tf@127.0.0.1:9999 python");
        let event = &merged.events[0];
        assert_eq!(event_name(host, event), "theirs");
        assert_eq!(
            find_stat(host, &event.stats, "tf_op"),
            Some(StatValue::Str("b:B".into())),
            "ref values follow the remapped stat metadata"
        );
        let ours_event = &host.lines[0].events[0];
        assert_eq!(event_name(host, ours_event), "ours");
        assert_eq!(
            find_stat(host, &ours_event.stats, "tf_op"),
            Some(StatValue::Str("a:A".into()))
        );
        let stat_names: Vec<&str> = host
            .stat_metadata
            .values()
            .map(|m| m.name.as_str())
            .collect();
        assert_eq!(stat_names.iter().filter(|n| **n == "tf_op").count(), 1);

        let moved = &ours.planes[3];
        assert_eq!(moved.id, 1);
        assert_eq!(
            find_stat(moved, &moved.stats, SOURCE_STAT),
            Some(StatValue::Str("tf@127.0.0.1:9999".into()))
        );
        assert_eq!(
            find_stat(moved, &moved.stats, ORIGINAL_NAME_STAT),
            Some(StatValue::Str("/device:GPU:0".into()))
        );
    }
}
