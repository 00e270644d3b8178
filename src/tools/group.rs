//! Step grouping as XProf does it before its tools run (`group_events.cc`,
//! the CPU/GPU path of `PreprocessSingleHostXSpace`): every event reachable
//! from a step-root event gets that root's group id, which the memory profile
//! reports as the step of an allocation.
//!
//! The event graph has an edge parent → child when
//! - the child nests in the parent by time on the same line (async events,
//!   `_a` ≠ 0, are left out of nesting);
//! - a producer (`_pt`, `_p`) and a consumer (`_ct`, `_c`) share a context
//!   type and id (and process id, from `_pid` or the plane's `process_id`),
//!   unless both sides have 64 or more events;
//! - a host `ExecutorState::Process` and an `IteratorGetNextOp::DoCompute` /
//!   `IteratorGetNextAsOptionalOp::DoCompute` share `id` and `iter_num`, or a
//!   host kernel launch and a device kernel share `correlation_id`.
//!
//! Roots are events with an `_r` stat (its int64 value is the root level) or
//! named `TraceContext` (level 1). They are taken by level, highest first,
//! then by start time; a root that is already grouped, or that has an
//! ancestor root of the same level, is skipped; the others get ids 0, 1, 2...
//! and pass them to every ungrouped event reachable from them. TensorFlow
//! loops (`ExecutorState::Process` iterations) replace the roots as XProf
//! does, tf.data function steps are not roots, and a trace with TF loop ops
//! (`WhileOp-EvalCond`, ...) is not grouped at all.
//!
//! Differences from XProf: where XProf leaves an order unspecified (roots
//! with equal level and start time), XSpace order decides here; the TPU
//! grouping path (`GroupTpuEventsOSS`) is not reproduced.

use std::collections::HashMap;

use crate::proto::tensorflow::profiler::{x_event, XEvent, XLine, XPlane, XSpace};

use super::stats::{get, int_or_uint_value, int_value, stat_name};
use super::HOST_PLANE;

/// Group id of every event of an XSpace, by plane, line and event index.
#[derive(Clone, Debug, Default)]
pub struct Groups {
    /// Index of the first event of each line, per plane.
    base: Vec<Vec<usize>>,
    ids: Vec<Option<i64>>,
    /// True when the XSpace already carried `group_id` stats.
    pub pregrouped: bool,
}

impl Groups {
    /// The group of event `event` of line `line` of plane `plane`.
    pub fn get(&self, plane: usize, line: usize, event: usize) -> Option<i64> {
        let base = *self.base.get(plane)?.get(line)?;
        self.ids.get(base + event).copied().flatten()
    }

    /// Number of groups (highest id + 1).
    pub fn count(&self) -> usize {
        self.ids
            .iter()
            .flatten()
            .max()
            .map_or(0, |max| usize::try_from(*max + 1).unwrap_or(0))
    }
}

/// True when some plane has stat metadata named `group_id`: XProf then skips
/// grouping and uses the stats as they are.
pub fn is_grouped(space: &XSpace) -> bool {
    space
        .planes
        .iter()
        .any(|p| p.stat_metadata.values().any(|m| m.name == "group_id"))
}

/// Event types whose presence makes XProf skip grouping (`CheckLoopOp`).
const LOOP_OPS: [&str; 5] = [
    "WhileOp-EvalCond",
    "WhileOp-StartBody",
    "ForOp",
    "ParallelForOp",
    "ForeverOp",
];

const TF_DATA_FUNCTIONS: [&str; 4] = [
    "InstantiatedCapturedFunction::Run",
    "InstantiatedCapturedFunction::RunAsync",
    "InstantiatedCapturedFunction::RunInstantiated",
    "InstantiatedCapturedFunction::RunWithBorrowedArgs",
];

const EXECUTOR: &str = "ExecutorState::Process";
const ITERATOR_GET_NEXT: [&str; 2] = [
    "IteratorGetNextOp::DoCompute",
    "IteratorGetNextAsOptionalOp::DoCompute",
];

/// XProf's `HostEventType` names: an event so named has a type, which keeps
/// it from being taken for a kernel launch or execution.
const HOST_EVENT_TYPES: &[&str] = &[
    "UnknownHostEventType",
    "TraceContext",
    "SessionRun",
    "FunctionRun",
    "RunGraph",
    "RunGraphDone",
    "TfOpRun",
    "EagerExecute",
    "ExecutorState::Process",
    "ExecutorDoneCallback",
    "MemoryAllocation",
    "MemoryDeallocation",
    "RemotePerfCounter",
    "InstantiatedCapturedFunction::Run",
    "InstantiatedCapturedFunction::RunWithBorrowedArgs",
    "InstantiatedCapturedFunction::RunInstantiated",
    "InstantiatedCapturedFunction::RunAsync",
    "ParallelForOp",
    "ForeverOp",
    "WhileOp-EvalCond",
    "WhileOp-StartBody",
    "ForOp",
    "IteratorGetNextOp::DoCompute",
    "IteratorGetNextAsOptionalOp::DoCompute",
    "Iterator",
    "Iterator::Prefetch::Generator",
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
    "ParallelBatchProduce",
    "ParallelBatchConsume",
    "BatchingSessionRun",
    "ProcessBatch",
    "BrainSessionRun",
    "ConcatInputTensors",
    "MergeInputTensors",
    "ScheduleWithoutSplit",
    "ScheduleWithSplit",
    "ScheduleWithEagerSplit",
    "ASBSQueue::Schedule",
    "OrbaxServing::ProcessBatch",
    "OrbaxServing::ConcatInputBuffers",
    "TfrtModelRun",
    "ServingModelRun",
    "KernelLaunch",
    "KernelExecute",
    "EnqueueRequestLocked",
    "RunProgramRequest",
    "HostCallbackRequest",
    "TransferH2DRequest",
    "TransferPreprocessedH2DRequest",
    "TransferD2HRequest",
    "OnDeviceSendRequest",
    "OnDeviceRecvRequest",
    "OnDeviceSendRecvLocalRequest",
    "CustomWait",
    "OnDeviceSendRequestMulti",
    "OnDeviceRecvRequestMulti",
    "PjrtAsyncWait",
    "DoEnqueueProgram",
    "DoEnqueueContinuationProgram",
    "WriteHbm",
    "ReadHbm",
    "TpuExecuteOp",
    "CompleteCallbacks",
    "TPUPartitionedCallOp-InitializeVarOnTPU",
    "TPUPartitionedCallOp-ExecuteRemote",
    "TPUPartitionedCallOp-ExecuteLocal",
    "Linearize",
    "Delinearize",
    "TransferBufferFromDevice-FastPath",
    "tpu::System::TransferToDevice=>IssueEvent",
    "tpu::System::TransferToDevice=>IssueEvent=>Done",
    "tpu::System::TransferFromDevice=>IssueEvent",
    "tpu::System::TransferFromDevice=>IssueEvent=>Done",
    "tpu::System::Execute",
];

/// True when XProf resolves an event of this name to a type (a host event
/// type, a framework op, or a tf.data iterator).
fn has_event_type(name: &str) -> bool {
    HOST_EVENT_TYPES.contains(&name)
        || super::parse_tf_op(name).is_some()
        || name.starts_with("Iterator:")
}

fn event_name<'p>(plane: &'p XPlane, event: &XEvent) -> &'p str {
    plane
        .event_metadata
        .get(&event.metadata_id)
        .map_or("", |m| m.name.as_str())
}

fn timestamp_ps(line: &XLine, event: &XEvent) -> i64 {
    let offset = match event.data {
        Some(x_event::Data::OffsetPs(ps)) => ps,
        _ => 0,
    };
    line.timestamp_ns.wrapping_mul(1000).wrapping_add(offset)
}

/// Producer/consumer context key: (context type, context id, process id).
type ContextKey = (i32, u64, Option<i32>);

#[derive(Default)]
struct ContextGroup {
    producers: Vec<usize>,
    consumers: Vec<usize>,
}

/// The event graph of a whole XSpace.
struct Forest<'s> {
    space: &'s XSpace,
    base: Vec<Vec<usize>>,
    /// (plane, line, event) of each node.
    location: Vec<(u32, u32, u32)>,
    start: Vec<i64>,
    root_level: Vec<Option<i32>>,
    edges: Vec<(usize, usize)>,
}

impl<'s> Forest<'s> {
    fn event(&self, node: usize) -> (&'s XPlane, &'s XEvent) {
        let (p, l, e) = self.location[node];
        let plane = &self.space.planes[p as usize];
        (plane, &plane.lines[l as usize].events[e as usize])
    }

    /// IntOrUintValue of the first stat named `name` of a node's event.
    fn stat_u64(&self, node: usize, name: &str) -> Option<u64> {
        let (plane, event) = self.event(node);
        get(plane, &event.stats, name).map(int_or_uint_value)
    }

    fn stat_i64(&self, node: usize, name: &str) -> Option<i64> {
        let (plane, event) = self.event(node);
        get(plane, &event.stats, name).map(int_value)
    }
}

/// Computes XProf's group ids for every event of `space`. When the space is
/// already grouped, the ids are its own `group_id` stats.
pub fn group_events(space: &XSpace) -> Groups {
    let mut base = Vec::with_capacity(space.planes.len());
    let mut total = 0usize;
    for plane in &space.planes {
        let mut lines = Vec::with_capacity(plane.lines.len());
        for line in &plane.lines {
            lines.push(total);
            total += line.events.len();
        }
        base.push(lines);
    }
    if is_grouped(space) {
        let mut ids = Vec::with_capacity(total);
        for plane in &space.planes {
            for line in &plane.lines {
                for event in &line.events {
                    ids.push(get(plane, &event.stats, "group_id").map(int_value));
                }
            }
        }
        return Groups {
            base,
            ids,
            pregrouped: true,
        };
    }
    let loop_ops = space.planes.iter().any(|p| {
        p.event_metadata
            .values()
            .any(|m| LOOP_OPS.contains(&m.name.as_str()))
    });
    if loop_ops {
        return Groups {
            base,
            ids: vec![None; total],
            pregrouped: false,
        };
    }
    let forest = build_forest(space, base, total);
    let ids = assign_groups(&forest);
    Groups {
        base: forest.base,
        ids,
        pregrouped: false,
    }
}

fn build_forest(space: &XSpace, base: Vec<Vec<usize>>, total: usize) -> Forest<'_> {
    let mut forest = Forest {
        space,
        base,
        location: Vec::with_capacity(total),
        start: Vec::with_capacity(total),
        root_level: Vec::with_capacity(total),
        edges: Vec::new(),
    };
    let mut contexts: HashMap<ContextKey, ContextGroup> = HashMap::new();
    // Nodes by the event types inter-thread connections use, in XSpace order.
    let mut executors = Vec::new();
    let mut get_nexts = Vec::new();
    let mut launches = Vec::new();
    let mut kernels = Vec::new();
    for (p, plane) in space.planes.iter().enumerate() {
        let is_host = plane.name == HOST_PLANE;
        let plane_pid = get(plane, &plane.stats, "process_id").map(|s| int_value(s) as i32);
        for (l, line) in plane.lines.iter().enumerate() {
            let mut stack: Vec<(usize, i64, i64)> = Vec::new();
            for (e, event) in line.events.iter().enumerate() {
                let node = forest.location.len();
                let start = timestamp_ps(line, event);
                let end = start.wrapping_add(event.duration_ps);
                let name = event_name(plane, event);
                let mut producer: (Option<i32>, Option<u64>) = (None, None);
                let mut consumer: (Option<i32>, Option<u64>) = (None, None);
                let mut pid = plane_pid;
                let mut root_level = None;
                let mut is_async = false;
                let mut correlated = false;
                for stat in &event.stats {
                    match stat_name(plane, stat) {
                        "_pt" => producer.0 = Some(int_value(stat) as i32),
                        "_p" => producer.1 = Some(int_or_uint_value(stat)),
                        "_ct" => consumer.0 = Some(int_value(stat) as i32),
                        "_c" => consumer.1 = Some(int_or_uint_value(stat)),
                        "_pid" => pid = Some(int_value(stat) as i32),
                        "_r" => root_level = Some(int_value(stat) as i32),
                        "_a" => is_async = int_value(stat) != 0,
                        "correlation_id" => correlated = true,
                        _ => {}
                    }
                }
                if root_level.is_none() && name == "TraceContext" {
                    root_level = Some(1);
                }
                forest.location.push((p as u32, l as u32, e as u32));
                forest.start.push(start);
                forest.root_level.push(root_level);
                if let (Some(kind), Some(id)) = producer {
                    contexts
                        .entry((kind, id, pid))
                        .or_default()
                        .producers
                        .push(node);
                }
                if let (Some(kind), Some(id)) = consumer {
                    contexts
                        .entry((kind, id, pid))
                        .or_default()
                        .consumers
                        .push(node);
                }
                if name == EXECUTOR {
                    executors.push(node);
                } else if ITERATOR_GET_NEXT.contains(&name) {
                    get_nexts.push(node);
                } else if correlated && !has_event_type(name) {
                    if is_host {
                        launches.push(node);
                    } else {
                        kernels.push(node);
                    }
                }
                if !is_async {
                    while let Some(&(parent, parent_start, parent_end)) = stack.last() {
                        if parent_start <= start && end <= parent_end {
                            forest.edges.push((parent, node));
                            break;
                        }
                        stack.pop();
                    }
                    stack.push((node, start, end));
                }
            }
        }
    }
    connect_by_stats(&mut forest, &executors, &get_nexts, &["id", "iter_num"]);
    connect_by_stats(&mut forest, &launches, &kernels, &["correlation_id"]);
    // Context groups in a stable order, so edges (and nothing observable)
    // do not depend on hashing.
    let mut groups: Vec<(ContextKey, ContextGroup)> = contexts.into_iter().collect();
    groups.sort_by_key(|(key, _)| *key);
    for (_, group) in groups {
        if group.producers.len() >= 64 && group.consumers.len() >= 64 {
            continue;
        }
        for &parent in &group.producers {
            for &child in &group.consumers {
                forest.edges.push((parent, child));
            }
        }
    }
    forest
}

/// `ConnectInterThread`: parent → child where the named stats are all
/// present and equal; the last parent with a key wins.
fn connect_by_stats(
    forest: &mut Forest<'_>,
    parents: &[usize],
    children: &[usize],
    names: &[&str],
) {
    if parents.is_empty() || children.is_empty() {
        return;
    }
    let key = |forest: &Forest<'_>, node: usize| -> Option<Vec<u64>> {
        names.iter().map(|n| forest.stat_u64(node, n)).collect()
    };
    let mut by_key: HashMap<Vec<u64>, usize> = HashMap::new();
    for &parent in parents {
        if let Some(k) = key(forest, parent) {
            by_key.insert(k, parent);
        }
    }
    for &child in children {
        if let Some(parent) = key(forest, child).and_then(|k| by_key.get(&k).copied()) {
            forest.edges.push((parent, child));
        }
    }
}

/// Adjacency in compressed form: `targets[offsets[n]..offsets[n + 1]]`.
struct Adjacency {
    offsets: Vec<usize>,
    targets: Vec<usize>,
}

impl Adjacency {
    fn new(nodes: usize, edges: impl Iterator<Item = (usize, usize)> + Clone) -> Self {
        let mut offsets = vec![0usize; nodes + 1];
        for (from, _) in edges.clone() {
            offsets[from + 1] += 1;
        }
        for i in 0..nodes {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets.clone();
        let mut targets = vec![0usize; offsets[nodes]];
        for (from, to) in edges {
            targets[next[from]] = to;
            next[from] += 1;
        }
        Adjacency { offsets, targets }
    }

    fn of(&self, node: usize) -> &[usize] {
        &self.targets[self.offsets[node]..self.offsets[node + 1]]
    }
}

fn assign_groups(forest: &Forest<'_>) -> Vec<Option<i64>> {
    let nodes = forest.location.len();
    let mut extra_edges = Vec::new();
    let roots = tensorflow_loop_roots(forest, &mut extra_edges);
    let all_edges = || forest.edges.iter().chain(extra_edges.iter()).copied();
    let children = Adjacency::new(nodes, all_edges());
    let parents = Adjacency::new(nodes, all_edges().map(|(p, c)| (c, p)));
    let mut groups: Vec<Option<i64>> = vec![None; nodes];
    let mut seen = vec![0u32; nodes];
    let mut stamp = 0u32;
    let mut next_group = 0i64;
    let propagate = |root: usize,
                     group: i64,
                     groups: &mut Vec<Option<i64>>,
                     stamp: u32,
                     seen: &mut Vec<u32>| {
        let mut queue = std::collections::VecDeque::from([root]);
        seen[root] = stamp;
        while let Some(node) = queue.pop_front() {
            if groups[node].is_some() {
                continue;
            }
            groups[node] = Some(group);
            for &child in children.of(node) {
                if seen[child] != stamp {
                    seen[child] = stamp;
                    queue.push_back(child);
                }
            }
        }
    };
    if let Some(loop_roots) = roots {
        for root in loop_roots {
            stamp += 1;
            propagate(root, next_group, &mut groups, stamp, &mut seen);
            next_group += 1;
        }
        return groups;
    }
    let tf_data_steps: Vec<i64> = (0..nodes)
        .filter(|&n| {
            let (plane, event) = forest.event(n);
            TF_DATA_FUNCTIONS.contains(&event_name(plane, event))
        })
        .filter_map(|n| forest.stat_i64(n, "id"))
        .collect();
    let mut roots: Vec<usize> = (0..nodes)
        .filter(|&n| forest.root_level[n].is_some())
        .filter(|&n| {
            tf_data_steps.is_empty()
                || forest
                    .stat_i64(n, "id")
                    .is_none_or(|id| !tf_data_steps.contains(&id))
        })
        .collect();
    let level = |n: usize| forest.root_level[n].unwrap_or(0);
    roots.sort_by(|&a, &b| {
        level(b)
            .cmp(&level(a))
            .then(forest.start[a].cmp(&forest.start[b]))
            .then(a.cmp(&b))
    });
    for root in roots {
        if groups[root].is_some() {
            continue;
        }
        // An ancestor root of the same level groups this one.
        stamp += 1;
        let mut queue = std::collections::VecDeque::new();
        seen[root] = stamp;
        for &parent in parents.of(root) {
            if seen[parent] != stamp {
                seen[parent] = stamp;
                queue.push_back(parent);
            }
        }
        let mut covered = false;
        while let Some(node) = queue.pop_front() {
            if forest.root_level[node].is_some() && level(node) == level(root) {
                covered = true;
                break;
            }
            for &parent in parents.of(node) {
                if seen[parent] != stamp {
                    seen[parent] = stamp;
                    queue.push_back(parent);
                }
            }
        }
        if covered {
            continue;
        }
        stamp += 1;
        propagate(root, next_group, &mut groups, stamp, &mut seen);
        next_group += 1;
    }
    groups
}

/// `ProcessTensorFlowLoop`: when `ExecutorState::Process` events (with `id`
/// and `iter_num`) form loops, the first event of each iteration is a root,
/// parent of the iteration's other events, in start order.
fn tensorflow_loop_roots(
    forest: &Forest<'_>,
    edges: &mut Vec<(usize, usize)>,
) -> Option<Vec<usize>> {
    let mut loops: HashMap<i64, HashMap<i64, Vec<usize>>> = HashMap::new();
    let mut tf_data_steps = Vec::new();
    for n in 0..forest.location.len() {
        let (plane, event) = forest.event(n);
        if TF_DATA_FUNCTIONS.contains(&event_name(plane, event)) {
            if let Some(id) = forest.stat_i64(n, "id") {
                tf_data_steps.push(id);
            }
        }
    }
    for n in 0..forest.location.len() {
        let (plane, event) = forest.event(n);
        if event_name(plane, event) != EXECUTOR {
            continue;
        }
        let (Some(step), Some(iter)) = (forest.stat_i64(n, "id"), forest.stat_i64(n, "iter_num"))
        else {
            continue;
        };
        if tf_data_steps.contains(&step) {
            continue;
        }
        loops
            .entry(step)
            .or_default()
            .entry(iter)
            .or_default()
            .push(n);
    }
    let mut iterations: Vec<Vec<usize>> = Vec::new();
    for iterations_of_step in loops.into_values() {
        if iterations_of_step.len() == 1 && iterations_of_step.contains_key(&0) {
            continue;
        }
        iterations.extend(iterations_of_step.into_values());
    }
    if iterations.is_empty() {
        return None;
    }
    let first = |events: &Vec<usize>| -> usize {
        events
            .iter()
            .copied()
            .min_by_key(|&n| (forest.start[n], n))
            .unwrap_or(0)
    };
    iterations.sort_by_key(|events| {
        let f = first(events);
        (forest.start[f], f)
    });
    let mut roots = Vec::with_capacity(iterations.len());
    for events in &iterations {
        let root = first(events);
        for &n in events {
            if n != root {
                edges.push((root, n));
            }
        }
        roots.push(root);
    }
    Some(roots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{x_stat, XEventMetadata, XStat, XStatMetadata};

    /// (name, start ps, duration ps, int stats)
    type TestEvent<'a> = (&'a str, i64, i64, &'a [(&'a str, i64)]);

    /// A plane builder for tests.
    fn plane(name: &str, lines: &[&[TestEvent<'_>]]) -> XPlane {
        let mut plane = XPlane {
            name: name.into(),
            ..XPlane::default()
        };
        let mut names: HashMap<String, i64> = HashMap::new();
        let mut stat_ids: HashMap<String, i64> = HashMap::new();
        for (l, events) in lines.iter().enumerate() {
            let mut line = XLine {
                id: l as i64,
                ..XLine::default()
            };
            for (name, start, duration, stats) in events.iter() {
                let next = names.len() as i64 + 1;
                let id = *names.entry(name.to_string()).or_insert(next);
                plane.event_metadata.insert(
                    id,
                    XEventMetadata {
                        id,
                        name: name.to_string(),
                        ..XEventMetadata::default()
                    },
                );
                let stats = stats
                    .iter()
                    .map(|(stat, value)| {
                        let next = stat_ids.len() as i64 + 1;
                        let sid = *stat_ids.entry(stat.to_string()).or_insert(next);
                        plane.stat_metadata.insert(
                            sid,
                            XStatMetadata {
                                id: sid,
                                name: stat.to_string(),
                                description: String::new(),
                            },
                        );
                        XStat {
                            metadata_id: sid,
                            value: Some(x_stat::Value::Int64Value(*value)),
                        }
                    })
                    .collect();
                line.events.push(XEvent {
                    metadata_id: id,
                    data: Some(x_event::Data::OffsetPs(*start)),
                    duration_ps: *duration,
                    stats,
                });
            }
            plane.lines.push(line);
        }
        plane
    }

    #[test]
    fn nested_events_take_the_group_of_their_root_in_time_order() {
        let host = plane(
            HOST_PLANE,
            &[
                &[
                    ("alloc", 0, 0, &[]),
                    ("train", 10, 100, &[("_r", 1)]),
                    ("op", 20, 10, &[]),
                    ("alloc", 25, 0, &[]),
                    ("train", 200, 100, &[("_r", 1)]),
                    ("alloc", 300, 0, &[]),
                    ("alloc", 301, 0, &[]),
                ],
                &[("train", 150, 10, &[("_r", 1)]), ("alloc", 155, 0, &[])],
            ],
        );
        let space = XSpace {
            planes: vec![host],
            ..XSpace::default()
        };
        let groups = group_events(&space);
        let line0: Vec<Option<i64>> = (0..7).map(|e| groups.get(0, 0, e)).collect();
        assert_eq!(
            line0,
            [None, Some(0), Some(0), Some(0), Some(2), Some(2), None]
        );
        assert_eq!(groups.get(0, 1, 1), Some(1));
        assert_eq!(groups.count(), 3);
    }

    #[test]
    fn higher_levels_group_first_and_same_level_nesting_merges() {
        let host = plane(
            HOST_PLANE,
            &[&[
                ("outer", 0, 100, &[("_r", 1)]),
                ("inner", 10, 10, &[("_r", 1)]),
                ("x", 12, 1, &[]),
                ("deep", 50, 10, &[("_r", 2)]),
                ("y", 55, 1, &[]),
                ("async", 70, 100, &[("_a", 1), ("_r", 1)]),
                ("z", 80, 1, &[]),
            ]],
        );
        let space = XSpace {
            planes: vec![host],
            ..XSpace::default()
        };
        let groups = group_events(&space);
        let ids: Vec<Option<i64>> = (0..7).map(|e| groups.get(0, 0, e)).collect();
        // Level 2 first (group 0); `inner` nests in `outer`, same level.
        assert_eq!(
            ids,
            [
                Some(1),
                Some(1),
                Some(1),
                Some(0),
                Some(0),
                Some(2),
                Some(1)
            ]
        );
    }

    #[test]
    fn producer_consumer_contexts_connect_threads() {
        let host = plane(
            HOST_PLANE,
            &[
                &[("step", 0, 100, &[("_r", 1), ("_pt", 3), ("_p", 42)])],
                &[
                    ("work", 500, 10, &[("_ct", 3), ("_c", 42)]),
                    ("alloc", 505, 0, &[]),
                ],
            ],
        );
        let space = XSpace {
            planes: vec![host],
            ..XSpace::default()
        };
        let groups = group_events(&space);
        assert_eq!(groups.get(0, 1, 1), Some(0));
    }

    #[test]
    fn loop_ops_disable_grouping_and_existing_groups_are_kept() {
        let host = plane(
            HOST_PLANE,
            &[&[("train", 0, 100, &[("_r", 1)]), ("ForOp", 10, 1, &[])]],
        );
        let space = XSpace {
            planes: vec![host],
            ..XSpace::default()
        };
        assert_eq!(group_events(&space).get(0, 0, 0), None);

        let host = plane(HOST_PLANE, &[&[("train", 0, 100, &[("group_id", 7)])]]);
        let space = XSpace {
            planes: vec![host],
            ..XSpace::default()
        };
        let groups = group_events(&space);
        assert!(groups.pregrouped);
        assert_eq!(groups.get(0, 0, 0), Some(7));
    }
}
