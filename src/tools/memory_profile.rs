//! XProf's `memory_profile` tool: the `tensorflow.profiler.MemoryProfile`
//! message and its JSON, computed as XProf's `xplane_to_memory_profile.cc`
//! computes them after grouping the trace into steps ([`super::group`]).
//!
//! Input: the `MemoryAllocation` / `MemoryDeallocation` events on every line
//! of the `/host:CPU` plane, with the allocator stats XProf reads from the
//! event's own stats (`allocator_name`, `bytes_allocated`, `addr`, ...; int64
//! values, `fragmentation` as a double). Per allocator:
//!
//! 1. snapshots sorted by `offset_ps`;
//! 2. step ids from the step groups, a snapshot outside any step taking the
//!    previous step + 1 (0 before the first);
//! 3. deallocations get the op, region, type and shape of the allocation at
//!    the same address;
//! 4. the timeline is sampled to at most 1000 snapshots with a max box filter;
//! 5. the peak (highest stack + heap in the window, the last one on ties) and
//!    its step; the allocations live at the peak from that step, plus
//!    "unused preallocated device memory" and "stack" special allocations,
//!    sorted by size and merged when identical;
//! 6. `memory_profile_snapshots` keeps only the snapshots those allocations
//!    refer to.
//!
//! The message types here are XProf's full `memory_profile.proto` (with
//! `sampled_timeline_snapshots`, `version` and `hlo_modules`), a wire-compatible
//! superset of `crate::proto::tensorflow::profiler::MemoryProfile`, which
//! [`MemoryProfile::to_tensorflow`] returns.
//!
//! Where XProf's order is unspecified (snapshots with equal times; which of
//! several identical active allocations represents them), the order of the
//! XSpace decides here.

use std::collections::{BTreeMap, HashMap};

use crate::proto::tensorflow::profiler as pb;
use crate::proto::tensorflow::profiler::{
    x_event, ActiveAllocation, MemoryActivity, MemoryActivityMetadata, MemoryAggregationStats,
    MemoryProfileSnapshot, MemoryProfileSummary, XSpace,
};

use super::json::{self, Array, Object};
use super::stats::{double_value, int_value, stat_name, str_or_ref_value};
use super::{group, ToolError, HOST_PLANE, TPU_PLANE_PREFIX};

/// XProf's default number of timeline snapshots per allocator.
pub const MAX_TIMELINE_SNAPSHOTS: usize = 1000;

/// Memory profile of one allocator (XProf's `PerAllocatorMemoryProfile`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PerAllocatorMemoryProfile {
    /// The snapshots the active allocations refer to, in their order.
    #[prost(message, repeated, tag = "1")]
    pub memory_profile_snapshots: Vec<MemoryProfileSnapshot>,
    #[prost(message, optional, tag = "2")]
    pub profile_summary: Option<MemoryProfileSummary>,
    /// Rows of the table of allocations live at the peak.
    #[prost(message, repeated, tag = "3")]
    pub active_allocations: Vec<ActiveAllocation>,
    /// Unused preallocated memory and stack at the peak.
    #[prost(message, repeated, tag = "4")]
    pub special_allocations: Vec<MemoryActivityMetadata>,
    /// The timeline: every snapshot, or a max-box-filtered sample of them.
    #[prost(message, repeated, tag = "5")]
    pub sampled_timeline_snapshots: Vec<MemoryProfileSnapshot>,
}

/// An XLA module run on a TPU, for the timeline's module markers.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HloModule {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(int64, tag = "2")]
    pub start_time_ps: i64,
    #[prost(int64, tag = "3")]
    pub end_time_ps: i64,
    #[prost(int64, tag = "4")]
    pub id: i64,
    #[prost(string, tag = "5")]
    pub plane_name: String,
}

/// XProf's `tensorflow.profiler.MemoryProfile` (plugin
/// `memory_profile.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct MemoryProfile {
    #[prost(btree_map = "string, message", tag = "1")]
    pub memory_profile_per_allocator: BTreeMap<String, PerAllocatorMemoryProfile>,
    #[prost(int32, tag = "2")]
    pub num_hosts: i32,
    /// Allocators with at least one snapshot, sorted.
    #[prost(string, repeated, tag = "3")]
    pub memory_ids: Vec<String>,
    #[prost(int32, tag = "5")]
    pub version: i32,
    #[prost(message, repeated, tag = "6")]
    pub hlo_modules: Vec<HloModule>,
}

/// The memory profile of `space` with XProf's defaults.
pub fn memory_profile(space: &XSpace) -> Result<MemoryProfile, ToolError> {
    memory_profile_with(space, MAX_TIMELINE_SNAPSHOTS)
}

/// The memory profile JSON exactly as XProf's tool returns it (fields
/// sorted as in the proto, map keys sorted).
pub fn memory_profile_json(space: &XSpace) -> Result<String, ToolError> {
    Ok(memory_profile(space)?.to_json())
}

/// The memory profile, sampling each allocator's timeline to at most
/// `max_timeline_snapshots` snapshots.
///
/// Fails when `space` has no `/host:CPU` plane (XProf then returns an empty
/// answer) or `max_timeline_snapshots` is 0.
pub fn memory_profile_with(
    space: &XSpace,
    max_timeline_snapshots: usize,
) -> Result<MemoryProfile, ToolError> {
    if max_timeline_snapshots == 0 {
        return Err(ToolError::InvalidParameter {
            name: "max_timeline_snapshots",
            reason: "must be at least 1".into(),
        });
    }
    let host_index = space
        .planes
        .iter()
        .position(|p| p.name == HOST_PLANE)
        .ok_or_else(|| ToolError::MissingPlane(HOST_PLANE.into()))?;
    let mut profile = generate(space, host_index);
    process(&mut profile, max_timeline_snapshots);
    profile.version = 1;
    profile.hlo_modules = hlo_modules(space);
    Ok(profile)
}

/// Step 1: one snapshot per allocation event, and the running summary.
fn generate(space: &XSpace, host_index: usize) -> MemoryProfile {
    let plane = &space.planes[host_index];
    // XProf groups the trace first unless it carries `group_id` already, in
    // which case the events' own `group_id` stats are read below.
    let groups = (!group::is_grouped(space)).then(|| group::group_events(space));
    let mut profile = MemoryProfile::default();
    for (l, line) in plane.lines.iter().enumerate() {
        for (e, event) in line.events.iter().enumerate() {
            let activity = match plane.event_metadata.get(&event.metadata_id) {
                Some(m) if m.name == "MemoryAllocation" => MemoryActivity::Allocation,
                Some(m) if m.name == "MemoryDeallocation" => MemoryActivity::Deallocation,
                _ => continue,
            };
            let mut stats = MemoryAggregationStats::default();
            let mut metadata = MemoryActivityMetadata {
                memory_activity: activity as i32,
                step_id: -1,
                ..MemoryActivityMetadata::default()
            };
            let mut memory_id = String::new();
            for stat in &event.stats {
                match stat_name(plane, stat) {
                    "index_on_host" | "device_ordinal" => memory_id = int_value(stat).to_string(),
                    "allocator_name" => memory_id = str_or_ref_value(plane, stat).to_string(),
                    "bytes_reserved" => stats.stack_reserved_bytes = int_value(stat),
                    "bytes_allocated" => stats.heap_allocated_bytes = int_value(stat),
                    "bytes_available" => stats.free_memory_bytes = int_value(stat),
                    "fragmentation" => stats.fragmentation = double_value(stat),
                    "peak_bytes_in_use" => stats.peak_bytes_in_use = int_value(stat),
                    "requested_bytes" => metadata.requested_bytes = int_value(stat),
                    "allocation_bytes" => metadata.allocation_bytes = int_value(stat),
                    "addr" => metadata.address = int_value(stat) as u64,
                    "tf_op" => metadata.tf_op_name = str_or_ref_value(plane, stat).to_string(),
                    "group_id" => metadata.step_id = int_value(stat),
                    "region_type" => {
                        metadata.region_type = str_or_ref_value(plane, stat).to_string()
                    }
                    "data_type" => metadata.data_type = data_type_string(int_value(stat) as i32),
                    "shape" => metadata.tensor_shape = str_or_ref_value(plane, stat).to_string(),
                    _ => {}
                }
            }
            if let Some(step) = groups.as_ref().and_then(|g| g.get(host_index, l, e)) {
                metadata.step_id = step;
            }
            let offset_ps = match event.data {
                Some(x_event::Data::OffsetPs(ps)) => ps,
                _ => 0,
            };
            let allocator = profile
                .memory_profile_per_allocator
                .entry(memory_id)
                .or_default();
            update_summary(
                &stats,
                offset_ps,
                allocator
                    .profile_summary
                    .get_or_insert_with(Default::default),
            );
            allocator
                .memory_profile_snapshots
                .push(MemoryProfileSnapshot {
                    time_offset_ps: offset_ps,
                    aggregation_stats: Some(stats),
                    activity_metadata: Some(metadata),
                });
        }
    }
    profile
}

fn in_use(stats: &MemoryAggregationStats) -> i64 {
    stats
        .stack_reserved_bytes
        .wrapping_add(stats.heap_allocated_bytes)
}

/// `UpdateProfileSummary`: the lifetime peak is the last one seen; the
/// window's peak is the last snapshot reaching the highest stack + heap.
fn update_summary(
    stats: &MemoryAggregationStats,
    time_ps: i64,
    summary: &mut MemoryProfileSummary,
) {
    summary.peak_bytes_usage_lifetime = stats.peak_bytes_in_use;
    let peak = summary.peak_stats.get_or_insert_with(Default::default);
    if in_use(stats) >= peak.peak_bytes_in_use {
        *peak = *stats;
        peak.peak_bytes_in_use = in_use(stats);
        summary.peak_stats_time_ps = time_ps;
        summary.memory_capacity = in_use(stats).wrapping_add(stats.free_memory_bytes);
    }
}

/// `ProcessMemoryProfileProto`.
fn process(profile: &mut MemoryProfile, max_timeline_snapshots: usize) {
    profile.num_hosts = 1;
    profile.memory_ids = profile
        .memory_profile_per_allocator
        .iter()
        .filter(|(_, a)| !a.memory_profile_snapshots.is_empty())
        .map(|(id, _)| id.clone())
        .collect();
    profile.memory_ids.sort();
    for allocator in profile.memory_profile_per_allocator.values_mut() {
        allocator
            .memory_profile_snapshots
            .sort_by_key(|s| s.time_offset_ps);
        update_step_ids(&mut allocator.memory_profile_snapshots);
        update_deallocations(&mut allocator.memory_profile_snapshots);
        allocator.sampled_timeline_snapshots =
            sample_timeline(&allocator.memory_profile_snapshots, max_timeline_snapshots);
        let peak_step = peak_step(allocator);
        process_active_allocations(peak_step, allocator);
        keep_active_snapshots(allocator);
    }
}

fn meta(snapshot: &MemoryProfileSnapshot) -> MemoryActivityMetadata {
    snapshot.activity_metadata.clone().unwrap_or_default()
}

fn agg(snapshot: &MemoryProfileSnapshot) -> MemoryAggregationStats {
    snapshot.aggregation_stats.unwrap_or_default()
}

/// `UpdateStepId`: snapshots outside a step get the last valid step + 1.
fn update_step_ids(snapshots: &mut [MemoryProfileSnapshot]) {
    let mut last_valid = -1i64;
    for snapshot in snapshots {
        let metadata = snapshot
            .activity_metadata
            .get_or_insert_with(Default::default);
        if metadata.step_id == -1 {
            metadata.step_id = last_valid.wrapping_add(1);
        } else {
            last_valid = metadata.step_id;
        }
    }
}

/// `UpdateDeallocation`: a deallocation takes the op, region, data type and
/// shape of the earliest unmatched allocation at its address.
fn update_deallocations(snapshots: &mut [MemoryProfileSnapshot]) {
    let mut allocations: HashMap<u64, usize> = HashMap::new();
    for i in 0..snapshots.len() {
        let metadata = meta(&snapshots[i]);
        if metadata.memory_activity == MemoryActivity::Deallocation as i32 {
            if let Some(alloc) = allocations.remove(&metadata.address) {
                let source = meta(&snapshots[alloc]);
                let target = snapshots[i]
                    .activity_metadata
                    .get_or_insert_with(Default::default);
                target.tf_op_name = source.tf_op_name;
                target.region_type = source.region_type;
                target.data_type = source.data_type;
                target.tensor_shape = source.tensor_shape;
            }
        } else {
            allocations.entry(metadata.address).or_insert(i);
        }
    }
}

/// `SampleMemoryProfileTimeline`: at most `max` snapshots; when there are
/// more, each of `max` consecutive windows (the later ones one wider) keeps
/// its first snapshot with the highest stack + heap.
fn sample_timeline(snapshots: &[MemoryProfileSnapshot], max: usize) -> Vec<MemoryProfileSnapshot> {
    let count = snapshots.len();
    if count <= max {
        return snapshots.to_vec();
    }
    let width = count / max;
    let narrow = max * (width + 1) - count;
    let wide = max - narrow;
    let mut sampled = Vec::with_capacity(max);
    let mut max_box = |width: usize, windows: usize, start: usize| {
        for i in 0..windows {
            let window = &snapshots[start + width * i..start + width * (i + 1)];
            let mut best = &window[0];
            for snapshot in &window[1..] {
                if in_use(&agg(snapshot)) > in_use(&agg(best)) {
                    best = snapshot;
                }
            }
            sampled.push(best.clone());
        }
    };
    max_box(width, narrow, 0);
    max_box(width + 1, wide, width * narrow);
    sampled
}

/// `GetPeakMemoryStep`: the step of the last snapshot at the window's peak.
fn peak_step(allocator: &PerAllocatorMemoryProfile) -> i64 {
    let peak = peak_stats(allocator).peak_bytes_in_use;
    allocator
        .memory_profile_snapshots
        .iter()
        .rev()
        .find(|s| in_use(&agg(s)) == peak)
        .map_or(0, |s| meta(s).step_id)
}

fn peak_stats(allocator: &PerAllocatorMemoryProfile) -> MemoryAggregationStats {
    allocator
        .profile_summary
        .as_ref()
        .and_then(|s| s.peak_stats)
        .unwrap_or_default()
}

/// The fields active allocations are sorted and merged by.
fn sort_key(m: &MemoryActivityMetadata) -> (i64, i64, &str, &str, &str, &str) {
    (
        m.allocation_bytes.wrapping_neg(),
        m.requested_bytes.wrapping_neg(),
        &m.tf_op_name,
        &m.region_type,
        &m.data_type,
        &m.tensor_shape,
    )
}

/// `ProcessActiveAllocations` and `InsertSpecialAllocations`.
fn process_active_allocations(peak_step: i64, allocator: &mut PerAllocatorMemoryProfile) {
    let summary = allocator.profile_summary.unwrap_or_default();
    let peak = summary.peak_stats.unwrap_or_default();
    let mut unmapped = peak.heap_allocated_bytes;
    let mut unmapped_deallocations = 0i64;
    let mut live: HashMap<u64, usize> = HashMap::new();
    for (i, snapshot) in allocator.memory_profile_snapshots.iter().enumerate() {
        if snapshot.time_offset_ps > summary.peak_stats_time_ps {
            break;
        }
        let m = meta(snapshot);
        if m.step_id != peak_step {
            continue;
        }
        if m.memory_activity == MemoryActivity::Allocation as i32 {
            live.insert(m.address, i);
            unmapped = unmapped.wrapping_sub(m.allocation_bytes);
        } else {
            if live.remove(&m.address).is_none() {
                unmapped_deallocations = unmapped_deallocations.wrapping_add(m.allocation_bytes);
            }
            unmapped = unmapped.wrapping_add(m.allocation_bytes);
        }
    }
    unmapped = unmapped.wrapping_sub(unmapped_deallocations);

    // (snapshot index, or -1, -2 for special allocations; metadata)
    let mut active: Vec<(i64, MemoryActivityMetadata)> = {
        let mut indices: Vec<usize> = live.into_values().collect();
        indices.sort_unstable();
        indices
            .into_iter()
            .map(|i| (i as i64, meta(&allocator.memory_profile_snapshots[i])))
            .collect()
    };
    let special = |bytes: i64, op: &str, region: &str| MemoryActivityMetadata {
        memory_activity: MemoryActivity::Allocation as i32,
        requested_bytes: bytes,
        allocation_bytes: bytes,
        address: 0,
        tf_op_name: op.into(),
        step_id: peak_step,
        region_type: region.into(),
        data_type: data_type_string(0),
        tensor_shape: "unknown".into(),
    };
    let mut index = 0i64;
    if unmapped > 0 {
        let m = special(
            unmapped,
            "unused preallocated device memory",
            "persist/dynamic",
        );
        allocator.special_allocations.push(m.clone());
        index -= 1;
        active.push((index, m));
    }
    if peak.stack_reserved_bytes > 0 {
        let m = special(peak.stack_reserved_bytes, "stack", "stack");
        allocator.special_allocations.push(m.clone());
        index -= 1;
        active.push((index, m));
    }
    active.sort_by(|a, b| sort_key(&a.1).cmp(&sort_key(&b.1)));

    let mut i = 0;
    while i < active.len() {
        let (snapshot_index, ref m) = active[i];
        let mut occurrences = 1;
        while i + 1 < active.len() && sort_key(&active[i + 1].1) == sort_key(m) {
            occurrences += 1;
            i += 1;
        }
        allocator.active_allocations.push(ActiveAllocation {
            snapshot_index,
            special_index: if snapshot_index < 0 {
                -snapshot_index - 1
            } else {
                -1
            },
            num_occurrences: occurrences,
        });
        i += 1;
    }
}

/// `SaveActiveAllocationSnapshots`: keep only the snapshots the active
/// allocations point at, in their order, and re-point them.
fn keep_active_snapshots(allocator: &mut PerAllocatorMemoryProfile) {
    let mut kept = Vec::new();
    for allocation in &mut allocator.active_allocations {
        let Ok(index) = usize::try_from(allocation.snapshot_index) else {
            continue;
        };
        if let Some(snapshot) = allocator.memory_profile_snapshots.get(index) {
            allocation.snapshot_index = kept.len() as i64;
            kept.push(snapshot.clone());
        }
    }
    allocator.memory_profile_snapshots = kept;
}

/// `GenerateHloModules`: every event on an `XLA Modules` line of a TPU plane.
fn hlo_modules(space: &XSpace) -> Vec<HloModule> {
    let mut modules = Vec::new();
    for plane in super::planes_with_prefix(space, TPU_PLANE_PREFIX) {
        for line in plane.lines.iter().filter(|l| l.name == "XLA Modules") {
            for event in &line.events {
                let offset = match event.data {
                    Some(x_event::Data::OffsetPs(ps)) => ps,
                    _ => 0,
                };
                modules.push(HloModule {
                    name: plane
                        .event_metadata
                        .get(&event.metadata_id)
                        .map_or_else(String::new, |m| m.name.clone()),
                    start_time_ps: offset,
                    end_time_ps: offset.wrapping_add(event.duration_ps),
                    id: modules.len() as i64,
                    plane_name: plane
                        .name
                        .strip_prefix("/device:")
                        .unwrap_or(&plane.name)
                        .to_string(),
                });
            }
        }
    }
    modules
}

/// TensorFlow's `DataTypeString` for a `DataType` number (`_ref` above 100).
pub fn data_type_string(data_type: i32) -> String {
    if data_type > 100 {
        return format!("{}_ref", data_type_name(data_type - 100));
    }
    data_type_name(data_type)
}

fn data_type_name(data_type: i32) -> String {
    let name = match data_type {
        0 => "INVALID",
        1 => "float",
        2 => "double",
        3 => "int32",
        4 => "uint8",
        5 => "int16",
        6 => "int8",
        7 => "string",
        8 => "complex64",
        9 => "int64",
        10 => "bool",
        11 => "qint8",
        12 => "quint8",
        13 => "qint32",
        14 => "bfloat16",
        15 => "qint16",
        16 => "quint16",
        17 => "uint16",
        18 => "complex128",
        19 => "half",
        20 => "resource",
        21 => "variant",
        22 => "uint32",
        23 => "uint64",
        24 => "float8_e5m2",
        25 => "float8_e4m3fn",
        26 => "float8_e4m3fnuz",
        27 => "float8_e4m3b11fnuz",
        28 => "float8_e5m2fnuz",
        29 => "int4",
        30 => "uint4",
        other => return format!("unknown dtype enum ({other})"),
    };
    name.to_string()
}

impl MemoryProfile {
    /// The JSON XProf's tool returns: protobuf's JSON mapping with every
    /// field printed, lowerCamelCase names, 64-bit integers as strings,
    /// enums by name, doubles as `SimpleDtoa` prints them.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(4096);
        let mut o = Object::new(&mut out);
        {
            let mut map = Object::new(o.key("memoryProfilePerAllocator"));
            for (id, allocator) in &self.memory_profile_per_allocator {
                write_allocator(map.key(id), allocator);
            }
            map.end();
        }
        o.raw("numHosts", self.num_hosts);
        {
            let mut ids = Array::new(o.key("memoryIds"));
            for id in &self.memory_ids {
                json::string(ids.item(), id);
            }
            ids.end();
        }
        o.raw("version", self.version);
        {
            let mut modules = Array::new(o.key("hloModules"));
            for module in &self.hlo_modules {
                let mut m = Object::new(modules.item());
                m.str("name", &module.name);
                m.str("startTimePs", &module.start_time_ps.to_string());
                m.str("endTimePs", &module.end_time_ps.to_string());
                m.str("id", &module.id.to_string());
                m.str("planeName", &module.plane_name);
                m.end();
            }
            modules.end();
        }
        o.end();
        out
    }

    /// The same profile as the `tensorflow.profiler.MemoryProfile` compiled
    /// from `proto/` (TensorFlow's older copy, without the sampled timeline,
    /// `version` and `hlo_modules`).
    pub fn to_tensorflow(&self) -> pb::MemoryProfile {
        pb::MemoryProfile {
            memory_profile_per_allocator: self
                .memory_profile_per_allocator
                .iter()
                .map(|(id, a)| {
                    (
                        id.clone(),
                        pb::PerAllocatorMemoryProfile {
                            memory_profile_snapshots: a.memory_profile_snapshots.clone(),
                            profile_summary: a.profile_summary,
                            active_allocations: a.active_allocations.clone(),
                            special_allocations: a.special_allocations.clone(),
                        },
                    )
                })
                .collect(),
            num_hosts: self.num_hosts,
            memory_ids: self.memory_ids.clone(),
        }
    }
}

fn write_allocator(out: &mut String, a: &PerAllocatorMemoryProfile) {
    let mut o = Object::new(out);
    write_snapshots(o.key("memoryProfileSnapshots"), &a.memory_profile_snapshots);
    if let Some(summary) = &a.profile_summary {
        let mut s = Object::new(o.key("profileSummary"));
        s.str(
            "peakBytesUsageLifetime",
            &summary.peak_bytes_usage_lifetime.to_string(),
        );
        if let Some(peak) = &summary.peak_stats {
            write_stats(s.key("peakStats"), peak);
        }
        s.str("peakStatsTimePs", &summary.peak_stats_time_ps.to_string());
        s.str("memoryCapacity", &summary.memory_capacity.to_string());
        s.end();
    }
    {
        let mut rows = Array::new(o.key("activeAllocations"));
        for row in &a.active_allocations {
            let mut r = Object::new(rows.item());
            r.str("snapshotIndex", &row.snapshot_index.to_string());
            r.str("specialIndex", &row.special_index.to_string());
            r.str("numOccurrences", &row.num_occurrences.to_string());
            r.end();
        }
        rows.end();
    }
    {
        let mut specials = Array::new(o.key("specialAllocations"));
        for m in &a.special_allocations {
            write_metadata(specials.item(), m);
        }
        specials.end();
    }
    write_snapshots(
        o.key("sampledTimelineSnapshots"),
        &a.sampled_timeline_snapshots,
    );
    o.end();
}

fn write_snapshots(out: &mut String, snapshots: &[MemoryProfileSnapshot]) {
    let mut list = Array::new(out);
    for snapshot in snapshots {
        let mut s = Object::new(list.item());
        s.str("timeOffsetPs", &snapshot.time_offset_ps.to_string());
        if let Some(stats) = &snapshot.aggregation_stats {
            write_stats(s.key("aggregationStats"), stats);
        }
        if let Some(m) = &snapshot.activity_metadata {
            write_metadata(s.key("activityMetadata"), m);
        }
        s.end();
    }
    list.end();
}

fn write_stats(out: &mut String, stats: &MemoryAggregationStats) {
    let mut o = Object::new(out);
    o.str(
        "stackReservedBytes",
        &stats.stack_reserved_bytes.to_string(),
    );
    o.str(
        "heapAllocatedBytes",
        &stats.heap_allocated_bytes.to_string(),
    );
    o.str("freeMemoryBytes", &stats.free_memory_bytes.to_string());
    json::proto_double(o.key("fragmentation"), stats.fragmentation);
    o.str("peakBytesInUse", &stats.peak_bytes_in_use.to_string());
    o.end();
}

fn write_metadata(out: &mut String, m: &MemoryActivityMetadata) {
    let mut o = Object::new(out);
    match MemoryActivity::try_from(m.memory_activity) {
        Ok(activity) => o.str("memoryActivity", activity.as_str_name()),
        Err(_) => o.raw("memoryActivity", m.memory_activity),
    }
    o.str("requestedBytes", &m.requested_bytes.to_string());
    o.str("allocationBytes", &m.allocation_bytes.to_string());
    o.str("address", &m.address.to_string());
    o.str("tfOpName", &m.tf_op_name);
    o.str("stepId", &m.step_id.to_string());
    o.str("regionType", &m.region_type);
    o.str("dataType", &m.data_type);
    o.str("tensorShape", &m.tensor_shape);
    o.end();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{
        x_stat, XEvent, XEventMetadata, XLine, XPlane, XStat, XStatMetadata,
    };
    use prost::Message;

    /// Memory events of one allocator: (time ps, alloc?, address, bytes,
    /// heap after).
    fn space(events: &[(i64, bool, u64, i64, i64)], stack: i64) -> XSpace {
        let mut plane = XPlane {
            name: HOST_PLANE.into(),
            ..XPlane::default()
        };
        for (id, name) in [(1, "MemoryAllocation"), (2, "MemoryDeallocation")] {
            plane.event_metadata.insert(
                id,
                XEventMetadata {
                    id,
                    name: name.into(),
                    ..XEventMetadata::default()
                },
            );
        }
        let names = [
            "allocator_name",
            "bytes_allocated",
            "addr",
            "allocation_bytes",
            "requested_bytes",
            "tf_op",
            "bytes_reserved",
            "GPU_0_bfc",
        ];
        for (i, name) in names.iter().enumerate() {
            let id = i as i64 + 1;
            plane.stat_metadata.insert(
                id,
                XStatMetadata {
                    id,
                    name: name.to_string(),
                    description: String::new(),
                },
            );
        }
        let int = |id: i64, v: i64| XStat {
            metadata_id: id,
            value: Some(x_stat::Value::Int64Value(v)),
        };
        let mut line = XLine::default();
        for &(time, alloc, addr, bytes, heap) in events {
            line.events.push(XEvent {
                metadata_id: if alloc { 1 } else { 2 },
                data: Some(x_event::Data::OffsetPs(time)),
                duration_ps: 0,
                stats: vec![
                    XStat {
                        metadata_id: 1,
                        value: Some(x_stat::Value::RefValue(8)),
                    },
                    int(2, heap),
                    int(3, addr as i64),
                    int(4, bytes),
                    int(5, bytes),
                    XStat {
                        metadata_id: 6,
                        value: Some(x_stat::Value::StrValue(format!("op{addr}"))),
                    },
                    int(7, stack),
                ],
            });
        }
        plane.lines.push(line);
        XSpace {
            planes: vec![plane],
            ..XSpace::default()
        }
    }

    #[test]
    fn peak_active_allocations_and_specials() {
        // 100 was allocated before the window: it shows as preallocated.
        let s = space(
            &[
                (10, true, 1, 10, 110),
                (20, true, 2, 20, 130),
                (30, false, 1, 10, 120),
                (40, true, 3, 20, 140),
                (50, false, 3, 20, 120),
            ],
            5,
        );
        let p = memory_profile(&s).expect("profile");
        assert_eq!(p.memory_ids, ["GPU_0_bfc"]);
        assert_eq!((p.num_hosts, p.version), (1, 1));
        let a = &p.memory_profile_per_allocator["GPU_0_bfc"];
        let summary = a.profile_summary.expect("summary");
        assert_eq!(summary.peak_stats_time_ps, 40);
        assert_eq!(summary.peak_stats.expect("peak").peak_bytes_in_use, 145);
        assert_eq!(a.sampled_timeline_snapshots.len(), 5);
        // Live at the peak: addr 2 and 3 (20 each) + 100 unmapped + stack 5.
        let rows: Vec<(i64, i64, i64)> = a
            .active_allocations
            .iter()
            .map(|r| (r.snapshot_index, r.special_index, r.num_occurrences))
            .collect();
        assert_eq!(rows, [(-1, 0, 1), (0, -1, 1), (1, -1, 1), (-2, 1, 1)]);
        assert_eq!(a.special_allocations[0].allocation_bytes, 100);
        assert_eq!(a.special_allocations[1].tf_op_name, "stack");
        let kept: Vec<i64> = a
            .memory_profile_snapshots
            .iter()
            .map(|s| s.time_offset_ps)
            .collect();
        assert_eq!(kept, [20, 40]);
        // The deallocation of addr 1 took the allocation's op.
        let dealloc = meta(&a.sampled_timeline_snapshots[2]);
        assert_eq!(dealloc.tf_op_name, "op1");
        let json = p.to_json();
        assert!(json.starts_with(r#"{"memoryProfilePerAllocator":{"GPU_0_bfc":{"memoryProfileSnapshots":[{"timeOffsetPs":"#));
        assert!(json
            .ends_with(r#""numHosts":1,"memoryIds":["GPU_0_bfc"],"version":1,"hloModules":[]}"#));
        // The message encodes and decodes as the older TensorFlow type.
        let tf = pb::MemoryProfile::decode(p.encode_to_vec().as_slice()).expect("decode");
        assert_eq!(tf, p.to_tensorflow());
    }

    #[test]
    fn sampling_keeps_the_largest_per_window() {
        let events: Vec<(i64, bool, u64, i64, i64)> = (0..2500)
            .map(|i| (i, true, i as u64, 1, (i * 7919) % 1000))
            .collect();
        let p = memory_profile_with(&space(&events, 0), 1000).expect("profile");
        let a = &p.memory_profile_per_allocator["GPU_0_bfc"];
        assert_eq!(a.sampled_timeline_snapshots.len(), 1000);
        // 2500 / 1000: 500 windows of 2, then 500 of 3.
        let first = &a.sampled_timeline_snapshots[0];
        let heap = |t: i64| (t * 7919) % 1000;
        assert_eq!(first.time_offset_ps, if heap(1) > heap(0) { 1 } else { 0 });
        let times: Vec<i64> = a
            .sampled_timeline_snapshots
            .iter()
            .map(|s| s.time_offset_ps)
            .collect();
        assert!(times.windows(2).all(|w| w[0] < w[1]));
        assert!(matches!(
            memory_profile_with(&space(&events, 0), 0),
            Err(ToolError::InvalidParameter { .. })
        ));
    }

    #[test]
    fn data_types_and_missing_host_plane() {
        assert_eq!(data_type_string(0), "INVALID");
        assert_eq!(data_type_string(19), "half");
        assert_eq!(data_type_string(101), "float_ref");
        assert_eq!(data_type_string(100), "unknown dtype enum (100)");
        assert_eq!(data_type_string(77), "unknown dtype enum (77)");
        assert_eq!(
            memory_profile(&XSpace::default()),
            Err(ToolError::MissingPlane(HOST_PLANE.into()))
        );
    }
}
