//! Turns the events of one capture window into an XSpace that XProf reads.
//! Pure: events and registry facts in, `XSpace` out. Every naming rule comes
//! from [`super::conventions`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use crate::event::{CopyKind, Device, Event, KernelInfo, MemoryInfo, NameId, Payload};
use crate::proto::tensorflow::profiler::{
    x_event, x_stat, XEvent, XEventMetadata, XLine, XPlane, XSpace, XStat, XStatMetadata,
};
use crate::registry::RegistrySnapshot;
use crate::store::Window;

use super::conventions::{self as names, stat};

/// Line id under which counter samples are grouped.
pub const COUNTER_TRACK: u64 = u64::MAX;

/// Everything about the capture that is not an event.
#[derive(Clone, Debug, Default)]
pub struct CaptureInfo {
    pub window: Window,
    pub hostname: String,
    /// Serialized `ProfileOptions` of the request.
    pub profile_options: Vec<u8>,
    pub dropped_newest: u64,
    pub dropped_oldest: u64,
    pub warnings: Vec<String>,
    pub errors: Vec<String>,
}

/// Builds the XSpace for `events` (any order) recorded during `info.window`.
pub fn build_xspace<'e>(
    events: impl IntoIterator<Item = &'e Event>,
    registry: &RegistrySnapshot,
    info: &CaptureInfo,
) -> XSpace {
    let mut lines: BTreeMap<Device, BTreeMap<u64, Vec<&Event>>> = BTreeMap::new();
    lines.entry(Device::Host).or_default();
    for event in events {
        let line = match event.payload() {
            Payload::Counter { .. } => COUNTER_TRACK,
            _ => event.line,
        };
        lines
            .entry(event.device())
            .or_default()
            .entry(line)
            .or_default()
            .push(event);
    }
    let mut planes = Vec::with_capacity(lines.len() + 1);
    for (device, device_lines) in lines {
        planes.push(build_plane(device, device_lines, registry, info.window));
    }
    planes.push(task_environment(info));
    let mut warnings = info.warnings.clone();
    let dropped = info.dropped_newest + info.dropped_oldest;
    if dropped > 0 {
        warnings.push(format!(
            "devtrace dropped {dropped} events during this capture because a ring was full \
             ({} refused by drop-newest, {} overwritten by drop-oldest); \
             raise --ring-capacity or lower the event rate",
            info.dropped_newest, info.dropped_oldest
        ));
    }
    XSpace {
        planes,
        errors: info.errors.clone(),
        warnings,
        hostnames: vec![info.hostname.clone()],
    }
}

/// True when no line of any plane holds an event.
pub fn is_empty(space: &XSpace) -> bool {
    space
        .planes
        .iter()
        .all(|p| p.lines.iter().all(|l| l.events.is_empty()))
}

fn build_plane(
    device: Device,
    lines: BTreeMap<u64, Vec<&Event>>,
    registry: &RegistrySnapshot,
    window: Window,
) -> XPlane {
    let (id, name) = match device {
        Device::Host => (names::HOST_PLANE_ID, names::HOST_PLANE.to_string()),
        Device::Gpu(ordinal) => (i64::from(ordinal), names::gpu_plane_name(ordinal)),
    };
    let mut plane = PlaneBuilder::new(id, name, registry);
    if let Some(info) = registry.device_info(device) {
        plane.device_stats(info);
    }
    for (line_id, mut events) in lines {
        // XProf walks lines in order: start ascending, enclosing spans first.
        events.sort_by_key(|e| (e.start_ns, Reverse(e.duration_ns)));
        let line_name = match device {
            _ if line_id == COUNTER_TRACK => names::COUNTERS_LINE.to_string(),
            Device::Host => registry
                .line_name(device, line_id)
                .map_or_else(|| format!("Thread {line_id}"), str::to_string),
            Device::Gpu(_) => names::stream_line_name(line_id, &stream_kinds(&events)),
        };
        let xline_id = if line_id == COUNTER_TRACK {
            names::COUNTERS_LINE_ID
        } else {
            line_id as i64
        };
        let xevents = events
            .iter()
            .map(|e| plane.event(e, window.start_ns))
            .collect();
        plane.plane.lines.push(XLine {
            id: xline_id,
            display_id: 0,
            name: line_name,
            display_name: String::new(),
            timestamp_ns: 0,
            duration_ps: 0,
            events: xevents,
        });
    }
    plane.finish()
}

fn stream_kinds(events: &[&Event]) -> Vec<&'static str> {
    let mut present = [false; names::STREAM_KIND_ORDER.len()];
    for event in events {
        let kind = match event.payload() {
            Payload::Kernel(_) => names::STREAM_COMPUTE,
            Payload::Memcpy(copy) => copy_label(copy.kind),
            Payload::Memset(_) => names::STREAM_MEMSET,
            _ => continue,
        };
        if let Some(i) = names::STREAM_KIND_ORDER.iter().position(|k| *k == kind) {
            present[i] = true;
        }
    }
    names::STREAM_KIND_ORDER
        .iter()
        .zip(present)
        .filter_map(|(kind, on)| on.then_some(*kind))
        .collect()
}

fn copy_label(kind: CopyKind) -> &'static str {
    match kind {
        CopyKind::HostToDevice => names::STREAM_MEMCPY_H2D,
        CopyKind::DeviceToHost => names::STREAM_MEMCPY_D2H,
        CopyKind::DeviceToDevice => names::STREAM_MEMCPY_D2D,
        CopyKind::PeerToPeer => names::STREAM_MEMCPY_P2P,
        CopyKind::Other => names::STREAM_MEMCPY_OTHER,
    }
}

fn copy_kind_words(kind: CopyKind) -> (&'static str, &'static str) {
    match kind {
        CopyKind::HostToDevice => ("pageable", "device"),
        CopyKind::DeviceToHost => ("device", "pageable"),
        CopyKind::DeviceToDevice | CopyKind::PeerToPeer => ("device", "device"),
        CopyKind::Other => ("unknown", "unknown"),
    }
}

/// `regs:R static_shared:S dynamic_shared:D grid:x,y,z block:x,y,z occ_pct:P`.
pub fn kernel_details(k: &KernelInfo) -> String {
    format!(
        "regs:{} static_shared:{} dynamic_shared:{} grid:{},{},{} block:{},{},{} occ_pct:{}",
        k.registers_per_thread,
        k.static_shared_bytes,
        k.dynamic_shared_bytes,
        k.grid[0],
        k.grid[1],
        k.grid[2],
        k.block[0],
        k.block[1],
        k.block[2],
        k.occupancy_pct
    )
}

/// Launch configuration that identifies one `kernel_details` string.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct KernelKey([u32; 10]);

impl KernelKey {
    fn of(k: &KernelInfo) -> KernelKey {
        KernelKey([
            k.registers_per_thread,
            k.static_shared_bytes,
            k.dynamic_shared_bytes,
            k.occupancy_pct.to_bits(),
            k.grid[0],
            k.grid[1],
            k.grid[2],
            k.block[0],
            k.block[1],
            k.block[2],
        ])
    }
}

/// One plane under construction, with its metadata tables.
struct PlaneBuilder<'r> {
    plane: XPlane,
    registry: &'r RegistrySnapshot,
    next_metadata_id: i64,
    event_metadata: HashMap<NameId, i64>,
    /// Stat metadata by name; also the targets of `ref_value` strings.
    stat_metadata: HashMap<String, i64>,
    name_refs: HashMap<NameId, i64>,
    kernel_refs: HashMap<KernelKey, i64>,
}

impl<'r> PlaneBuilder<'r> {
    fn new(id: i64, name: String, registry: &'r RegistrySnapshot) -> Self {
        PlaneBuilder {
            plane: XPlane {
                id,
                name,
                ..XPlane::default()
            },
            registry,
            next_metadata_id: 1,
            event_metadata: HashMap::new(),
            stat_metadata: HashMap::new(),
            name_refs: HashMap::new(),
            kernel_refs: HashMap::new(),
        }
    }

    fn finish(self) -> XPlane {
        self.plane
    }

    fn stat_id(&mut self, name: &str) -> i64 {
        if let Some(id) = self.stat_metadata.get(name) {
            return *id;
        }
        let id = self.next_metadata_id;
        self.next_metadata_id += 1;
        self.stat_metadata.insert(name.to_string(), id);
        self.plane.stat_metadata.insert(
            id,
            XStatMetadata {
                id,
                name: name.to_string(),
                description: String::new(),
            },
        );
        id
    }

    fn event_metadata_id(&mut self, name: NameId) -> i64 {
        if let Some(id) = self.event_metadata.get(&name) {
            return *id;
        }
        let id = self.event_metadata.len() as i64 + 1;
        self.event_metadata.insert(name, id);
        self.plane.event_metadata.insert(
            id,
            XEventMetadata {
                id,
                name: self.registry.name(name).to_string(),
                ..XEventMetadata::default()
            },
        );
        id
    }

    fn stat(&mut self, name: &str, value: x_stat::Value) -> XStat {
        XStat {
            metadata_id: self.stat_id(name),
            value: Some(value),
        }
    }

    fn int(&mut self, name: &str, value: i64) -> XStat {
        self.stat(name, x_stat::Value::Int64Value(value))
    }

    fn uint(&mut self, name: &str, value: u64) -> XStat {
        self.stat(name, x_stat::Value::Uint64Value(value))
    }

    fn text(&mut self, name: &str, value: &str) -> XStat {
        self.stat(name, x_stat::Value::StrValue(value.to_string()))
    }

    /// A string stat stored once per plane and referenced by id.
    fn name_ref(&mut self, name: &str, value: NameId) -> XStat {
        let target = match self.name_refs.get(&value) {
            Some(id) => *id,
            None => {
                let id = self.stat_id(self.registry.name(value));
                self.name_refs.insert(value, id);
                id
            }
        };
        self.stat(name, x_stat::Value::RefValue(target as u64))
    }

    fn string_ref(&mut self, name: &str, value: &str) -> XStat {
        let target = self.stat_id(value) as u64;
        self.stat(name, x_stat::Value::RefValue(target))
    }

    fn device_stats(&mut self, info: &crate::registry::DeviceInfo) {
        let stats = vec![
            self.text(stat::DEVICE_VENDOR, &info.vendor),
            self.text(stat::GPU_DEVICE_NAME, &info.model),
            self.int(stat::CLOCK_RATE, info.clock_rate_khz as i64),
            self.int(stat::CORE_COUNT, i64::from(info.core_count)),
            self.uint(stat::MEMORY_BANDWIDTH, info.memory_bandwidth_bytes_per_s),
            self.uint(stat::MEMORY_SIZE, info.memory_bytes),
            self.int(
                stat::COMPUTE_CAP_MAJOR,
                i64::from(info.compute_capability.0),
            ),
            self.int(
                stat::COMPUTE_CAP_MINOR,
                i64::from(info.compute_capability.1),
            ),
        ];
        self.plane.stats.extend(stats);
    }

    fn event(&mut self, event: &Event, origin_ns: u64) -> XEvent {
        let metadata_id = self.event_metadata_id(event.name());
        let stats = self.event_stats(event);
        XEvent {
            metadata_id,
            data: Some(x_event::Data::OffsetPs(
                (event.start_ns.saturating_sub(origin_ns) as i64).saturating_mul(1000),
            )),
            duration_ps: (event.duration_ns as i64).saturating_mul(1000),
            stats,
        }
    }

    fn event_stats(&mut self, event: &Event) -> Vec<XStat> {
        match event.payload() {
            Payload::Plain => Vec::new(),
            Payload::Step { step_num } => {
                vec![
                    self.int(stat::STEP_NUM, step_num),
                    self.int(stat::ROOT_LEVEL, 1),
                ]
            }
            Payload::ApiCall {
                correlation_id,
                device_ordinal,
            } => vec![
                self.uint(stat::CORRELATION_ID, correlation_id),
                self.int(stat::DEVICE_ID, i64::from(device_ordinal)),
            ],
            Payload::Kernel(kernel) => {
                let details = match self.kernel_refs.get(&KernelKey::of(&kernel)) {
                    Some(id) => *id,
                    None => {
                        let id = self.stat_id(&kernel_details(&kernel));
                        self.kernel_refs.insert(KernelKey::of(&kernel), id);
                        id
                    }
                };
                let mut stats = vec![
                    self.uint(stat::CORRELATION_ID, kernel.correlation_id),
                    self.stat(
                        stat::KERNEL_DETAILS,
                        x_stat::Value::RefValue(details as u64),
                    ),
                    self.string_ref(stat::CONTEXT_ID, "$$1"),
                ];
                if kernel.tf_op != NameId(0) {
                    stats.push(self.name_ref(stat::TF_OP, kernel.tf_op));
                }
                stats
            }
            Payload::Memcpy(copy) => {
                let (src, dst) = copy_kind_words(copy.kind);
                let destination = match event.device() {
                    Device::Gpu(ordinal) => ordinal,
                    Device::Host => 0,
                };
                let details = format!(
                    "kind_src:{src} kind_dst:{dst} size:{} dest:{destination} async:{}",
                    copy.bytes,
                    u8::from(copy.is_async)
                );
                let mut stats = vec![
                    self.uint(stat::CORRELATION_ID, copy.correlation_id),
                    self.string_ref(stat::MEMCPY_DETAILS, &details),
                ];
                if copy.tf_op != NameId(0) {
                    stats.push(self.name_ref(stat::TF_OP, copy.tf_op));
                }
                stats
            }
            Payload::Memset(memset) => {
                let details = format!(
                    "kind:device num_bytes:{} async:{}",
                    memset.bytes,
                    u8::from(memset.is_async)
                );
                vec![
                    self.uint(stat::CORRELATION_ID, memset.correlation_id),
                    self.string_ref(stat::MEMSET_DETAILS, &details),
                ]
            }
            Payload::MemoryAllocation(memory) | Payload::MemoryDeallocation(memory) => {
                self.memory_stats(&memory)
            }
            Payload::Counter { value } => {
                vec![self.stat(stat::COUNTER_VALUE, x_stat::Value::DoubleValue(value))]
            }
        }
    }

    /// The allocator stats exactly as XProf's memory profile reads them: int64
    /// for numbers, double for fragmentation, strings by reference.
    fn memory_stats(&mut self, m: &MemoryInfo) -> Vec<XStat> {
        vec![
            self.name_ref(stat::ALLOCATOR_NAME, m.allocator),
            self.int(stat::BYTES_RESERVED, m.bytes_reserved),
            self.int(stat::BYTES_ALLOCATED, m.bytes_allocated),
            self.int(stat::BYTES_AVAILABLE, m.bytes_available),
            self.stat(
                stat::FRAGMENTATION,
                x_stat::Value::DoubleValue(m.fragmentation),
            ),
            self.int(stat::PEAK_BYTES_IN_USE, m.peak_bytes_in_use),
            self.int(stat::REQUESTED_BYTES, m.requested_bytes),
            self.int(stat::ALLOCATION_BYTES, m.allocation_bytes),
            self.int(stat::ADDRESS, m.address as i64),
            self.name_ref(stat::TF_OP, m.tf_op),
            self.int(stat::STEP_ID, m.step_id),
            self.name_ref(stat::REGION_TYPE, m.region_type),
            self.int(stat::DATA_TYPE, i64::from(m.data_type)),
            self.name_ref(stat::SHAPE, m.shape),
        ]
    }
}

fn task_environment(info: &CaptureInfo) -> XPlane {
    let registry = RegistrySnapshot::default();
    let mut plane = PlaneBuilder::new(
        names::TASK_ENVIRONMENT_PLANE_ID,
        names::TASK_ENVIRONMENT_PLANE.to_string(),
        &registry,
    );
    let stats = vec![
        plane.uint(stat::PROFILE_START_TIME, info.window.start_ns),
        plane.uint(stat::PROFILE_STOP_TIME, info.window.stop_ns),
        plane.stat(
            stat::PROFILE_OPTIONS,
            x_stat::Value::BytesValue(info.profile_options.clone()),
        ),
        plane.int(
            stat::DROPPED_TRACES,
            (info.dropped_newest + info.dropped_oldest) as i64,
        ),
        plane.uint(stat::DROPPED_NEWEST, info.dropped_newest),
        plane.uint(stat::DROPPED_OLDEST, info.dropped_oldest),
    ];
    plane.plane.stats = stats;
    plane.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mock::{MockConfig, Workload, COMPUTE_STREAM, PYTHON_TID};
    use crate::proto::tensorflow::profiler::XLine;
    use crate::registry::Registry;
    use crate::xspace::read::{event_name, find_stat, StatValue};

    const START: u64 = 1_800_000_000_000_000_000;

    fn mock_space(dropped_newest: u64) -> XSpace {
        let registry = Registry::new();
        let mut workload = Workload::new(&MockConfig::default(), &registry, START);
        let mut events = Vec::new();
        while workload.next_time_ns() < START + 120_000_000 {
            workload.emit_next(&mut |e| events.push(e));
        }
        // Arrival order is not time order.
        events.reverse();
        let info = CaptureInfo {
            window: Window {
                start_ns: START,
                stop_ns: START + 100_000_000,
            },
            hostname: "worker-0".into(),
            profile_options: vec![1, 2, 3],
            dropped_newest,
            ..CaptureInfo::default()
        };
        let window = info.window;
        let inside = events.iter().filter(|e| window.contains(e.start_ns));
        build_xspace(inside, &registry.snapshot(), &info)
    }

    fn plane<'s>(space: &'s XSpace, name: &str) -> &'s XPlane {
        space
            .planes
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no plane {name}"))
    }

    fn line(plane: &XPlane, id: i64) -> &XLine {
        plane.lines.iter().find(|l| l.id == id).expect("line")
    }

    #[test]
    fn planes_follow_xprof_naming_and_ids() {
        let space = mock_space(0);
        let names: Vec<(&str, i64)> = space
            .planes
            .iter()
            .map(|p| (p.name.as_str(), p.id))
            .collect();
        assert_eq!(
            names,
            vec![
                ("/host:CPU", 49),
                ("/device:GPU:0", 0),
                ("/device:GPU:1", 1),
                ("Task Environment", 1000)
            ]
        );
        assert_eq!(space.hostnames, vec!["worker-0".to_string()]);
        for plane in &space.planes {
            for (key, metadata) in &plane.event_metadata {
                assert_eq!(*key, metadata.id);
            }
            for (key, metadata) in &plane.stat_metadata {
                assert_eq!(*key, metadata.id);
                assert_ne!(
                    metadata.name,
                    stat::GROUP_ID,
                    "group_id would disable XProf grouping"
                );
            }
        }
    }

    #[test]
    fn lines_are_relative_sorted_and_named() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        assert_eq!(line(host, PYTHON_TID as i64).name, "python");
        let gpu = plane(&space, "/device:GPU:0");
        assert_eq!(
            line(gpu, COMPUTE_STREAM as i64).name,
            "Stream #7(Compute,Memset)"
        );
        assert_eq!(line(gpu, 13).name, "Stream #13(MemcpyH2D)");
        for plane in &space.planes {
            for line in &plane.lines {
                assert_eq!(line.timestamp_ns, 0);
                let starts: Vec<(i64, i64)> = line
                    .events
                    .iter()
                    .map(|e| match e.data {
                        Some(x_event::Data::OffsetPs(ps)) => (ps, -e.duration_ps),
                        _ => panic!("event without offset"),
                    })
                    .collect();
                assert!(
                    starts.windows(2).all(|w| w[0] <= w[1]),
                    "line {} unsorted",
                    line.name
                );
                assert!(starts
                    .iter()
                    .all(|(ps, _)| (0..100_000_000_000).contains(ps)));
            }
        }
    }

    #[test]
    fn steps_kernels_and_flows_carry_the_stats_xprof_reads() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        let python = line(host, PYTHON_TID as i64);
        let step = python
            .events
            .iter()
            .find(|e| event_name(host, e) == "train")
            .expect("a step");
        assert_eq!(
            find_stat(host, &step.stats, "step_num"),
            Some(StatValue::Int(0))
        );
        assert_eq!(find_stat(host, &step.stats, "_r"), Some(StatValue::Int(1)));
        let launch = python
            .events
            .iter()
            .find(|e| event_name(host, e) == "cudaLaunchKernel")
            .expect("a launch");
        let Some(StatValue::Uint(correlation)) = find_stat(host, &launch.stats, "correlation_id")
        else {
            panic!("correlation_id must be uint64 for XProf's flows");
        };
        let gpu = plane(&space, "/device:GPU:0");
        let kernel = line(gpu, COMPUTE_STREAM as i64)
            .events
            .iter()
            .find(|e| {
                find_stat(gpu, &e.stats, "correlation_id") == Some(StatValue::Uint(correlation))
            })
            .expect("the launched kernel");
        assert_eq!(event_name(gpu, kernel), "volta_h884gemm_64x64_ldg8_nn");
        assert_eq!(
            find_stat(gpu, &kernel.stats, "kernel_details"),
            Some(StatValue::Str(
                "regs:128 static_shared:0 dynamic_shared:32768 grid:16,8,1 block:256,1,1 occ_pct:25".into()
            ))
        );
        assert_eq!(
            find_stat(gpu, &kernel.stats, "tf_op"),
            Some(StatValue::Str("model/dense/MatMul:MatMul".into()))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "compute_cap_major"),
            Some(StatValue::Int(8))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "core_count"),
            Some(StatValue::Int(108))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "memory_size"),
            Some(StatValue::Uint(40 << 30))
        );
        let copy = line(gpu, 13).events.first().expect("a copy");
        assert_eq!(
            find_stat(gpu, &copy.stats, "memcpy_details"),
            Some(StatValue::Str(
                "kind_src:pageable kind_dst:device size:25165824 dest:0 async:1".into()
            ))
        );
    }

    #[test]
    fn memory_events_use_the_oneof_cases_the_memory_profile_reads() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        let allocation = host
            .lines
            .iter()
            .flat_map(|l| &l.events)
            .find(|e| event_name(host, e) == "MemoryAllocation")
            .expect("an allocation");
        for name in [
            "bytes_reserved",
            "bytes_allocated",
            "bytes_available",
            "peak_bytes_in_use",
            "requested_bytes",
            "allocation_bytes",
            "addr",
            "data_type",
        ] {
            assert!(
                matches!(
                    find_stat(host, &allocation.stats, name),
                    Some(StatValue::Int(_))
                ),
                "{name} must be int64"
            );
        }
        assert!(matches!(
            find_stat(host, &allocation.stats, "fragmentation"),
            Some(StatValue::Double(_))
        ));
        assert_eq!(
            find_stat(host, &allocation.stats, "allocator_name"),
            Some(StatValue::Str("GPU_0_bfc".into()))
        );
        assert_eq!(
            find_stat(host, &allocation.stats, "shape"),
            Some(StatValue::Str("[256,2048]".into()))
        );
        assert_eq!(allocation.duration_ps, 0);
    }

    #[test]
    fn task_environment_records_the_window_options_and_drops() {
        let space = mock_space(7);
        let env = plane(&space, "Task Environment");
        assert_eq!(
            find_stat(env, &env.stats, "profile_start_time"),
            Some(StatValue::Uint(START))
        );
        assert_eq!(
            find_stat(env, &env.stats, "profile_stop_time"),
            Some(StatValue::Uint(START + 100_000_000))
        );
        assert_eq!(
            find_stat(env, &env.stats, "profile_options"),
            Some(StatValue::Bytes(vec![1, 2, 3]))
        );
        assert_eq!(
            find_stat(env, &env.stats, "dropped_traces"),
            Some(StatValue::Int(7))
        );
        assert!(space
            .warnings
            .iter()
            .any(|w| w.contains("dropped 7 events")));
        assert!(mock_space(0).warnings.is_empty());
    }

    #[test]
    fn an_empty_window_still_has_a_host_plane_and_is_empty() {
        let info = CaptureInfo {
            hostname: "h".into(),
            ..CaptureInfo::default()
        };
        let space = build_xspace(std::iter::empty(), &RegistrySnapshot::default(), &info);
        assert!(is_empty(&space));
        assert_eq!(space.planes[0].name, "/host:CPU");
    }
}
