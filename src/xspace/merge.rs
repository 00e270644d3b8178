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

use crate::model::timeline::{self, stat};

/// Stat naming where a merged plane came from.
pub const SOURCE_STAT: &str = "devtrace_source";
/// Stat holding a moved plane's original name.
pub const ORIGINAL_NAME_STAT: &str = "devtrace_original_plane";

/// The `profile_start_time` of an XSpace's Task Environment, if recorded.
pub fn profile_start_ns(space: &XSpace) -> Option<u64> {
    let plane = space
        .planes
        .iter()
        .find(|p| p.name == timeline::TASK_ENVIRONMENT_PLANE)?;
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
    // In i128: both starts are theirs to choose, and any u64 is a start.
    let line_shift = |timestamp_ns: i64| -> i128 {
        match (their_start, our_start) {
            (Some(their), Some(our)) => i128::from(their) - i128::from(our),
            // Times since the epoch (within a day of ours) are absolute.
            (None, Some(our))
                if (i128::from(timestamp_ns) - i128::from(our)).abs() < i128::from(ONE_DAY_NS) =>
            {
                -i128::from(our)
            }
            _ => 0,
        }
    };
    ours.errors
        .extend(theirs.errors.iter().map(|e| format!("{source}: {e}")));
    ours.warnings
        .extend(theirs.warnings.iter().map(|w| format!("{source}: {w}")));
    for mut plane in theirs.planes {
        if plane.name == timeline::TASK_ENVIRONMENT_PLANE {
            continue;
        }
        for line in &mut plane.lines {
            let shifted = i128::from(line.timestamp_ns) + line_shift(line.timestamp_ns);
            line.timestamp_ns = shifted.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        }
        if plane.name == timeline::HOST_PLANE {
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
                .find(|p| p.name == timeline::HOST_PLANE)
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
    let id = FreshIds::new(plane.stat_metadata.keys().copied()).next();
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

/// Hands out ids that no existing entry of a metadata map uses, nor any
/// id handed out before: upstream ids of any value (negative, sparse, at
/// the top of the range) can never land on ours.
pub(super) struct FreshIds {
    taken: std::collections::HashSet<i64>,
    next: i64,
}

impl FreshIds {
    pub(super) fn new(taken: impl IntoIterator<Item = i64>) -> FreshIds {
        let taken: std::collections::HashSet<i64> = taken.into_iter().collect();
        let next = taken
            .iter()
            .max()
            .map_or(1, |max| max.checked_add(1).unwrap_or(1));
        FreshIds { taken, next }
    }

    pub(super) fn next(&mut self) -> i64 {
        while self.taken.contains(&self.next) {
            self.next = self.next.checked_add(1).unwrap_or(i64::MIN);
        }
        let id = self.next;
        self.taken.insert(id);
        id
    }
}

/// Their ids to the fresh ids that replace them, each given out once.
struct Remap {
    fresh: FreshIds,
    map: HashMap<i64, i64>,
}

impl Remap {
    fn new(ours: impl IntoIterator<Item = i64>) -> Remap {
        Remap {
            fresh: FreshIds::new(ours),
            map: HashMap::new(),
        }
    }

    fn get(&mut self, theirs: i64) -> i64 {
        *self.map.entry(theirs).or_insert_with(|| self.fresh.next())
    }
}

/// Moves `theirs`' lines into `ours`, giving their metadata ids that none
/// of ours has. Stat metadata is matched by name (names must be unique
/// within a plane; ref values point at stat metadata, so they are remapped
/// too). An id of theirs with no metadata still gets an id of its own, so
/// it can never take on the meaning of one of ours.
fn merge_plane(ours: &mut XPlane, theirs: XPlane) {
    let stat_by_name: HashMap<String, i64> = ours
        .stat_metadata
        .values()
        .map(|m| (m.name.clone(), m.id))
        .collect();
    let mut stats = Remap::new(ours.stat_metadata.keys().copied());
    let mut their_stats: Vec<_> = theirs.stat_metadata.into_iter().collect();
    their_stats.sort_by_key(|(id, _)| *id);
    for (id, metadata) in their_stats {
        if let Some(existing) = stat_by_name.get(&metadata.name) {
            stats.map.insert(id, *existing);
            continue;
        }
        let new = stats.get(id);
        ours.stat_metadata.insert(
            new,
            XStatMetadata {
                id: new,
                ..metadata
            },
        );
    }
    let remap_stats = |stats_of: &mut Vec<XStat>, stats: &mut Remap| {
        for s in stats_of.iter_mut() {
            s.metadata_id = stats.get(s.metadata_id);
            if let Some(x_stat::Value::RefValue(target)) = &mut s.value {
                *target = stats.get(*target as i64) as u64;
            }
        }
    };
    let mut events = Remap::new(ours.event_metadata.keys().copied());
    let mut their_events: Vec<_> = theirs.event_metadata.into_iter().collect();
    their_events.sort_by_key(|(id, _)| *id);
    for (id, mut metadata) in their_events {
        let new = events.get(id);
        metadata.id = new;
        for child in &mut metadata.child_id {
            *child = events.get(*child);
        }
        remap_stats(&mut metadata.stats, &mut stats);
        ours.event_metadata.insert(new, metadata);
    }
    for mut line in theirs.lines {
        for event in &mut line.events {
            event.metadata_id = events.get(event.metadata_id);
            remap_stats(&mut event.stats, &mut stats);
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

    #[test]
    fn upstream_metadata_ids_of_any_value_never_land_on_ours() {
        let mut ours = XSpace {
            planes: vec![plane("/host:CPU", 49, "ours", "a:A"), environment(1_000)],
            ..XSpace::default()
        };
        let host = &mut ours.planes[0];
        host.event_metadata.insert(
            2,
            XEventMetadata {
                id: 2,
                name: "ours_two".into(),
                ..XEventMetadata::default()
            },
        );
        let mut theirs_host = plane("/host:CPU", 49, "theirs", "b:B");
        // With the old offset (our largest id, 2), -1 became 1 and -2 became
        // 0; an id at the top of the range overflowed.
        for (id, name) in [(-1, "minus_one"), (i64::MAX, "top"), (i64::MIN, "bottom")] {
            theirs_host.event_metadata.insert(
                id,
                XEventMetadata {
                    id,
                    name: name.into(),
                    child_id: vec![1, -1],
                    ..XEventMetadata::default()
                },
            );
            let mut event = theirs_host.lines[0].events[0].clone();
            event.metadata_id = id;
            theirs_host.lines[0].events.push(event);
        }
        // An event whose metadata they never sent.
        let mut orphan = theirs_host.lines[0].events[0].clone();
        orphan.metadata_id = -2;
        theirs_host.lines[0].events.push(orphan);
        let theirs = XSpace {
            planes: vec![theirs_host, environment(1_000)],
            ..XSpace::default()
        };
        merge(&mut ours, theirs, "up");
        let host = &ours.planes[0];
        assert_eq!(host.event_metadata.len(), 6);
        for (id, metadata) in &host.event_metadata {
            assert_eq!(*id, metadata.id);
        }
        assert_eq!(host.event_metadata[&1].name, "ours");
        assert_eq!(host.event_metadata[&2].name, "ours_two");
        assert_eq!(event_name(host, &host.lines[0].events[0]), "ours");
        let merged: Vec<&str> = host.lines[1]
            .events
            .iter()
            .map(|e| event_name(host, e))
            .collect();
        assert_eq!(merged, vec!["theirs", "minus_one", "top", "bottom", ""]);
        let orphan = host.lines[1].events[4].metadata_id;
        assert!(!host.event_metadata.contains_key(&orphan));
        assert!(![0, 1, 2].contains(&orphan), "{orphan}");
        let theirs_one = host.lines[1].events[0].metadata_id;
        let minus_one = host.lines[1].events[1].metadata_id;
        let top = &host.event_metadata[&host.lines[1].events[2].metadata_id];
        assert_eq!(top.child_id, vec![theirs_one, minus_one], "children follow");
    }
}
