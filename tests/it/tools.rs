//! The tool converters on real traces: the agent runs with its mock backend,
//! `devtrace capture` writes a trace, and each tool's answer is checked
//! against what the XSpace holds. When `DEVTRACE_XPROF_PYTHON` names a
//! Python with `xprof` installed, the memory profile is also compared field
//! by field with XProf's own converter, on the capture and on synthetic
//! traces that reach its corner cases.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{AgentProcess, BIN};
use devtrace::proto::tensorflow::profiler::{
    x_event, x_stat, XEvent, XEventMetadata, XLine, XPlane, XSpace, XStat, XStatMetadata,
};
use devtrace::tools::kernel_stats::kernel_stats;
use devtrace::tools::memory_profile::{memory_profile, MemoryProfile};
use devtrace::tools::overview::overview;
use devtrace::tools::trace_viewer::{trace_viewer, Phase, TraceViewerOptions};
use devtrace::tools::ToolError;
use devtrace::xspace::read::{event_name, event_start_ps, find_stat, read_xspace, StatValue};
use prost::Message;
use serde_json::Value;

/// The mock backend's kernels.
const MOCK_KERNELS: [&str; 5] = [
    "volta_h884gemm_64x64_ldg8_nn",
    "void tensorflow::functor::BiasNHWCKernel<Eigen::half>(int, Eigen::half const*, Eigen::half const*, Eigen::half*, int)",
    "implicit_convolve_sgemm",
    "void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Relu>, long>(Eigen::TensorEvaluator<Relu>, long)",
    "void tensorflow::functor::SoftmaxCrossEntropyKernel<float>(float const*, int const*, float*, int)",
];

struct Captured {
    space: XSpace,
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tools-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// One second of the mock workload, captured once for all tests.
fn capture() -> &'static Captured {
    static CAPTURE: OnceLock<Captured> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let agent = AgentProcess::start(&[]);
        let logdir = scratch("capture");
        let output = Command::new(BIN)
            .args(["capture", &format!("grpc://{}", agent.address)])
            .args(["--duration", "1s", "--quiet", "--logdir"])
            .arg(&logdir)
            .output()
            .expect("running devtrace capture");
        assert!(
            output.status.success(),
            "capture failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        let path = PathBuf::from(stdout.lines().last().expect("capture prints a path").trim());
        let space = read_xspace(&path).expect("reading the capture");
        let _ = std::fs::remove_dir_all(&logdir);
        Captured { space }
    })
}

fn plane<'s>(space: &'s XSpace, name: &str) -> &'s XPlane {
    space
        .planes
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no plane {name}"))
}

fn gpu_planes(space: &XSpace) -> impl Iterator<Item = &XPlane> {
    space
        .planes
        .iter()
        .filter(|p| p.name.starts_with("/device:GPU:"))
}

fn parse(json: &str) -> Value {
    serde_json::from_str(json).unwrap_or_else(|e| panic!("invalid JSON ({e}): {json:.300}"))
}

#[test]
fn kernel_stats_count_every_mock_kernel() {
    let space = &capture().space;
    // Count kernels straight from the trace.
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    for plane in gpu_planes(space) {
        for line in &plane.lines {
            for event in &line.events {
                if event.duration_ps > 0
                    && find_stat(plane, &event.stats, "kernel_details").is_some()
                {
                    *expected
                        .entry(event_name(plane, event).to_string())
                        .or_default() += 1;
                }
            }
        }
    }
    let stats = kernel_stats(space).expect("kernel stats");
    let mut got: BTreeMap<String, u64> = BTreeMap::new();
    for row in &stats.kernels {
        *got.entry(row.kernel_name.clone()).or_default() += row.occurrences;
    }
    assert_eq!(got, expected);
    let mut names: Vec<&str> = got.keys().map(String::as_str).collect();
    let mut mock: Vec<&str> = MOCK_KERNELS.to_vec();
    names.sort_unstable();
    mock.sort_unstable();
    assert_eq!(names, mock);
    // One launch configuration and op per kernel: five rows.
    assert_eq!(stats.kernels.len(), 5);
    assert!(stats
        .kernels
        .windows(2)
        .all(|w| w[0].total_duration_ps >= w[1].total_duration_ps));
    let gemm = stats
        .kernels
        .iter()
        .find(|k| k.kernel_name == MOCK_KERNELS[0])
        .expect("gemm row");
    assert_eq!(gemm.op_name, "model/dense/MatMul");
    assert_eq!((gemm.grid, gemm.block), ([16, 8, 1], [256, 1, 1]));
    assert_eq!(
        (gemm.registers_per_thread, gemm.shared_memory_bytes),
        (128, 32768)
    );
    assert!(gemm.uses_tensor_core);
    assert!(gemm.min_duration_ps <= gemm.max_duration_ps);
    assert_eq!(stats.devices, ["/device:GPU:0", "/device:GPU:1"]);

    let json = parse(&stats.to_json());
    let rows = json["kernels"].as_array().expect("kernels");
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[0]["rank"], 1);
    assert_eq!(
        json["total_occurrences"].as_u64(),
        Some(expected.values().sum::<u64>())
    );
}

/// Events the trace viewer shows: all but XProf's internal memory events.
fn displayable(space: &XSpace) -> Vec<(i64, i64)> {
    let mut spans = Vec::new();
    for plane in &space.planes {
        for line in &plane.lines {
            for event in &line.events {
                let name = event_name(plane, event);
                if name != "MemoryAllocation" && name != "MemoryDeallocation" {
                    let start = event_start_ps(line.timestamp_ns, event);
                    spans.push((start, start + event.duration_ps));
                }
            }
        }
    }
    spans
}

#[test]
fn trace_viewer_windows_and_caps_the_events() {
    let space = &capture().space;
    let all_spans = displayable(space);
    let everything = TraceViewerOptions {
        resolution: 0,
        ..TraceViewerOptions::default()
    };
    let full = trace_viewer(space, &everything).expect("trace");
    assert_eq!(full.total_events, all_spans.len());
    assert_eq!(full.events.len(), all_spans.len());

    let (start_ms, end_ms) = (200.0, 400.0);
    let (lo, hi) = (200_000_000_000i64, 400_000_000_000i64);
    let overlapping = all_spans
        .iter()
        .filter(|(s, e)| *s <= hi && *e >= lo)
        .count();
    let window = TraceViewerOptions {
        start_time_ms: Some(start_ms),
        end_time_ms: Some(end_ms),
        resolution: 0,
    };
    let windowed = trace_viewer(space, &window).expect("windowed trace");
    assert_eq!(windowed.events.len(), overlapping);
    assert!(overlapping > 0 && overlapping < all_spans.len() / 2);
    assert!(windowed
        .events
        .iter()
        .all(|e| e.ts_ps <= hi && e.ts_ps + e.dur_ps >= lo));

    let capped = trace_viewer(
        space,
        &TraceViewerOptions {
            resolution: 500,
            ..window
        },
    )
    .expect("capped trace");
    assert_eq!(capped.events.len(), 500);
    assert_eq!(capped.events_in_window, overlapping);
    // The cap keeps long events: every step overlapping the window survives.
    let steps_in_window = capped
        .events
        .iter()
        .filter(|e| e.name.starts_with("train "))
        .count();
    let steps_overlapping = windowed
        .events
        .iter()
        .filter(|e| e.name.starts_with("train "))
        .count();
    assert!(steps_overlapping >= 3);
    assert_eq!(steps_in_window, steps_overlapping);
    assert_eq!(
        capped,
        trace_viewer(
            space,
            &TraceViewerOptions {
                resolution: 500,
                ..window
            }
        )
        .expect("again"),
        "downsampling is deterministic"
    );

    let json = parse(&capped.to_json());
    let events = json["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), capped.complete_events());
    assert!(complete.iter().all(|e| {
        let ts = e["ts"].as_f64().unwrap_or(-1.0);
        let dur = e["dur"].as_f64().unwrap_or(-1.0);
        ts <= end_ms * 1000.0 && ts + dur >= start_ms * 1000.0 && dur >= 0.0
    }));
    let process_names: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert_eq!(process_names.len(), 3, "{process_names:?}");
    assert!(process_names.iter().any(|n| n.ends_with("/host:CPU")));
    assert!(!process_names.iter().any(|n| n.contains("Task Environment")));
    let thread_names: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(thread_names.contains(&"python"));
    assert!(thread_names.iter().any(|n| n.starts_with("Stream #7")));
    // Kernel args carry their stats by name.
    let windowed_json = parse(&windowed.to_json());
    let kernel = windowed_json["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .find(|e| e["name"] == MOCK_KERNELS[2])
        .expect("a kernel in the window");
    assert!(kernel["args"]["kernel_details"]
        .as_str()
        .is_some_and(|d| d.starts_with("regs:96")));
    assert!(capped.events.iter().all(|e| e.phase == Phase::Complete));
}

#[test]
fn overview_counts_the_training_steps() {
    let space = &capture().space;
    let host = plane(space, "/host:CPU");
    let trains = host
        .lines
        .iter()
        .flat_map(|l| &l.events)
        .filter(|e| event_name(host, e) == "train")
        .count();
    let o = overview(space, 3).expect("overview");
    assert_eq!(o.steps.len(), trains);
    assert!(trains >= 15, "{trains} steps in a second");
    let (avg, min, max) = o.step_time_ms().expect("step times");
    // The mock's steps last 95% of its 50 ms period.
    assert!((min - 47.5).abs() < 1e-6 && (max - 47.5).abs() < 1e-6 && (avg - 47.5).abs() < 1e-6);
    assert!(o
        .steps
        .windows(2)
        .all(|w| w[0].step_num + 1 == w[1].step_num));
    assert_eq!(o.devices.len(), 2);
    assert!(o
        .devices
        .iter()
        .all(|d| d.busy_percent > 0.0 && d.busy_percent <= 100.0));
    assert_eq!(o.top_host_ops.len(), 3);
    assert!(o.top_host_ops.iter().all(|op| op.name.contains(':')));
    assert_eq!(o.top_kernels.len(), 3);
    assert!(o
        .top_kernels
        .iter()
        .all(|k| MOCK_KERNELS.contains(&k.name.as_str())));
    let json = parse(&o.to_json());
    assert_eq!(json["step_count"].as_u64(), Some(trains as u64));
    assert_eq!(json["devices"].as_array().map(Vec::len), Some(2));
}

/// (time, stack + heap, heap) of each memory event of `allocator`.
fn memory_events(space: &XSpace, allocator: &str) -> Vec<(i64, i64, i64)> {
    let host = plane(space, "/host:CPU");
    let mut events = Vec::new();
    for line in &host.lines {
        for event in &line.events {
            let name = event_name(host, event);
            if name != "MemoryAllocation" && name != "MemoryDeallocation" {
                continue;
            }
            if find_stat(host, &event.stats, "allocator_name")
                != Some(StatValue::Str(allocator.into()))
            {
                continue;
            }
            let int = |n| match find_stat(host, &event.stats, n) {
                Some(StatValue::Int(v)) => v,
                other => panic!("{n}: {other:?}"),
            };
            let heap = int("bytes_allocated");
            events.push((
                event_start_ps(line.timestamp_ns, event),
                heap + int("bytes_reserved"),
                heap,
            ));
        }
    }
    events.sort_unstable();
    events
}

#[test]
fn memory_profile_invariants_hold_on_a_capture() {
    let space = &capture().space;
    let profile = memory_profile(space).expect("memory profile");
    assert_eq!(profile.memory_ids, ["GPU_0_bfc", "GPU_1_bfc"]);
    assert_eq!((profile.num_hosts, profile.version), (1, 1));
    for id in &profile.memory_ids {
        let a = &profile.memory_profile_per_allocator[id];
        let raw = memory_events(space, id);
        assert!(raw.len() > 100);
        let timeline = &a.sampled_timeline_snapshots;
        assert_eq!(timeline.len(), raw.len().min(1000));
        assert!(timeline
            .windows(2)
            .all(|w| w[0].time_offset_ps <= w[1].time_offset_ps));
        let summary = a.profile_summary.expect("summary");
        let peak = summary.peak_stats.expect("peak stats");
        let max = raw.iter().map(|r| r.1).max().expect("events");
        let last_at_max = raw.iter().rev().find(|r| r.1 == max).expect("peak event");
        assert_eq!(peak.peak_bytes_in_use, max);
        assert_eq!(summary.peak_stats_time_ps, last_at_max.0);
        // Max-box sampling keeps the peak in the timeline.
        let sampled_max = timeline
            .iter()
            .map(|s| {
                let st = s.aggregation_stats.expect("stats");
                st.heap_allocated_bytes + st.stack_reserved_bytes
            })
            .max();
        assert_eq!(sampled_max, Some(max));
        // Active allocations: one kept snapshot per non-special row, and the
        // live tensors plus unmapped memory make up the peak heap.
        let regular: Vec<_> = a
            .active_allocations
            .iter()
            .filter(|r| r.special_index < 0)
            .collect();
        assert_eq!(a.memory_profile_snapshots.len(), regular.len());
        assert!(!regular.is_empty());
        let live: i64 = regular
            .iter()
            .map(|r| {
                let s = &a.memory_profile_snapshots[r.snapshot_index as usize];
                s.activity_metadata
                    .clone()
                    .expect("metadata")
                    .allocation_bytes
                    * r.num_occurrences
            })
            .sum();
        let unmapped: i64 = a
            .special_allocations
            .iter()
            .filter(|s| s.tf_op_name == "unused preallocated device memory")
            .map(|s| s.allocation_bytes)
            .sum();
        if unmapped > 0 {
            assert_eq!(live + unmapped, peak.heap_allocated_bytes);
        } else {
            assert!(live >= peak.heap_allocated_bytes);
        }
        assert!(a
            .special_allocations
            .iter()
            .all(|s| s.tf_op_name != "stack"));
    }
    let json = parse(&profile.to_json());
    assert_eq!(
        json["memoryIds"],
        serde_json::json!(["GPU_0_bfc", "GPU_1_bfc"])
    );
    assert_eq!(json["version"], 1);
    let first = &json["memoryProfilePerAllocator"]["GPU_0_bfc"]["sampledTimelineSnapshots"][0];
    assert!(first["timeOffsetPs"].is_string());
    assert!(first["aggregationStats"]["fragmentation"].is_number());
    assert_eq!(first["activityMetadata"]["memoryActivity"], "ALLOCATION");
}

#[test]
fn tools_report_missing_planes() {
    let empty = XSpace::default();
    assert_eq!(
        memory_profile(&empty),
        Err(ToolError::MissingPlane("/host:CPU".into()))
    );
    assert!(matches!(
        kernel_stats(&empty),
        Err(ToolError::NoDevicePlanes { .. })
    ));
    assert!(overview(&empty, 5).is_err());
    let trace = trace_viewer(&empty, &TraceViewerOptions::default()).expect("empty trace");
    assert!(trace.events.is_empty() && trace.processes.is_empty());
}

/// Of a session's hosts, one whose file cannot be read (a FIFO someone
/// put in its place) is named and left out; the others are served, by
/// `tool` and by `inspect` (one such file failed the whole session, and
/// `inspect` stopped at it), each exiting with a status that says so.
#[test]
fn one_unreadable_host_leaves_the_others_served() {
    let logdir = scratch("one-bad-host");
    let session = logdir.join("plugins/profile/mixed");
    std::fs::create_dir_all(&session).unwrap();
    let trace = capture().space.encode_to_vec();
    std::fs::write(session.join("worker-0.xplane.pb"), &trace).unwrap();
    std::fs::write(session.join("worker-2.xplane.pb"), &trace).unwrap();
    let fifo = session.join("worker-1.xplane.pb");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());

    let tool = Command::new(BIN)
        .arg("tool")
        .args([&logdir, Path::new("mixed"), Path::new("overview")])
        .output()
        .expect("running devtrace tool");
    let said = String::from_utf8_lossy(&tool.stderr);
    // Written, and told apart from a whole success: exit status 3, as a
    // session some of whose hosts failed.
    assert_eq!(tool.status.code(), Some(3), "{said}");
    assert!(
        said.contains("overview: 1 of the session's 3 hosts left out"),
        "{said}"
    );
    let output = parse(&String::from_utf8_lossy(&tool.stdout));
    let served: Vec<&String> = output["hosts"].as_object().unwrap().keys().collect();
    assert_eq!(served, ["worker-0", "worker-2"]);
    let failed = output["failed"]["worker-1"]
        .as_str()
        .expect("worker-1 named");
    assert!(failed.contains("not a regular file"), "{failed}");
    assert!(said.contains("worker-1: left out:"), "{said}");

    let listed = Command::new(BIN)
        .arg("sessions")
        .arg(&logdir)
        .output()
        .expect("running devtrace sessions");
    let printed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        printed.starts_with("mixed\thosts: worker-0,worker-1,worker-2\ttools: ")
            && printed.contains("\tunreadable: worker-1 (not a trace, or not yours to read)"),
        "{printed}"
    );

    let inspect = Command::new(BIN)
        .arg("inspect")
        .arg(&session)
        .output()
        .expect("running devtrace inspect");
    let printed = String::from_utf8_lossy(&inspect.stdout);
    let said = String::from_utf8_lossy(&inspect.stderr);
    assert_eq!(inspect.status.code(), Some(1), "{said}");
    assert_eq!(printed.matches("hosts: ").count(), 2, "{printed}");
    assert!(said.contains("worker-1.xplane.pb"), "{said}");
    assert!(
        said.contains("1 of the 3 traces in") && said.contains("could not be read"),
        "{said}"
    );
}

/// A trace viewer window past the trace's end returns no events, and says
/// so rather than answering an empty trace as if the host had done nothing.
#[test]
fn a_window_that_misses_the_trace_is_said() {
    let logdir = scratch("missed-window");
    let session = logdir.join("plugins/profile/s");
    std::fs::create_dir_all(&session).unwrap();
    std::fs::write(
        session.join("worker-0.xplane.pb"),
        capture().space.encode_to_vec(),
    )
    .unwrap();
    let tool = Command::new(BIN)
        .arg("tool")
        .args([&logdir, Path::new("s"), Path::new("trace_viewer")])
        .args(["--host", "worker-0", "--param", "start_time_ms=500000"])
        .output()
        .expect("running devtrace tool");
    let said = String::from_utf8_lossy(&tool.stderr);
    assert!(tool.status.success(), "{said}");
    assert!(
        said.contains("trace_viewer: worker-0: none of its ")
            && said.contains(" events overlaps the window asked for (500000 ms to its end"),
        "{said}"
    );
    let output = parse(&String::from_utf8_lossy(&tool.stdout));
    let events = output["traceEvents"].as_array().expect("traceEvents");
    assert!(
        events.iter().all(|event| event["ph"] == "M"),
        "only metadata events expected"
    );
}

// ---------------------------------------------------------------------------
// Synthetic traces for the comparison with XProf.

enum V {
    I(i64),
    U(u64),
    D(f64),
    S(&'static str),
    Owned(String),
    /// A string stored as a reference to stat metadata.
    R(String),
}

/// Builds one plane with interned event and stat metadata.
struct Synth {
    plane: XPlane,
    events: HashMap<String, i64>,
    stats: HashMap<String, i64>,
    next_id: i64,
}

impl Synth {
    fn new(id: i64, name: &str) -> Synth {
        Synth {
            plane: XPlane {
                id,
                name: name.into(),
                ..XPlane::default()
            },
            events: HashMap::new(),
            stats: HashMap::new(),
            next_id: 1,
        }
    }

    fn stat_id(&mut self, name: &str) -> i64 {
        if let Some(id) = self.stats.get(name) {
            return *id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.stats.insert(name.into(), id);
        self.plane.stat_metadata.insert(
            id,
            XStatMetadata {
                id,
                name: name.into(),
                description: String::new(),
            },
        );
        id
    }

    fn line(&mut self, id: i64, name: &str) -> usize {
        self.plane.lines.push(XLine {
            id,
            name: name.into(),
            ..XLine::default()
        });
        self.plane.lines.len() - 1
    }

    fn event(
        &mut self,
        line: usize,
        name: &str,
        start_ps: i64,
        duration_ps: i64,
        stats: Vec<(&str, V)>,
    ) {
        let next = self.events.len() as i64 + 1;
        let metadata_id = *self.events.entry(name.into()).or_insert(next);
        self.plane
            .event_metadata
            .entry(metadata_id)
            .or_insert_with(|| XEventMetadata {
                id: metadata_id,
                name: name.into(),
                ..XEventMetadata::default()
            });
        let stats = stats
            .into_iter()
            .map(|(name, v)| {
                let metadata_id = self.stat_id(name);
                let value = match v {
                    V::I(i) => x_stat::Value::Int64Value(i),
                    V::U(u) => x_stat::Value::Uint64Value(u),
                    V::D(d) => x_stat::Value::DoubleValue(d),
                    V::S(s) => x_stat::Value::StrValue(s.into()),
                    V::Owned(s) => x_stat::Value::StrValue(s),
                    V::R(s) => x_stat::Value::RefValue(self.stat_id(&s) as u64),
                };
                XStat {
                    metadata_id,
                    value: Some(value),
                }
            })
            .collect();
        self.plane.lines[line].events.push(XEvent {
            metadata_id,
            data: Some(x_event::Data::OffsetPs(start_ps)),
            duration_ps,
            stats,
        });
    }

    fn finish(mut self) -> XPlane {
        for line in &mut self.plane.lines {
            line.events.sort_by_key(|e| {
                let start = match e.data {
                    Some(x_event::Data::OffsetPs(ps)) => ps,
                    _ => 0,
                };
                (start, -e.duration_ps)
            });
        }
        self.plane
    }
}

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// An allocator's bookkeeping for synthetic events.
struct Heap {
    heap: i64,
    peak: i64,
    stack: i64,
    next_address: u64,
    live: Vec<(u64, i64, usize)>,
}

/// Op kinds: (tf_op, bytes, requested — None: random, data type, shape).
const KINDS: [(&str, i64, Option<i64>, i64, &str); 6] = [
    ("model/dense/MatMul:MatMul", 1 << 20, None, 1, "[256,1024]"),
    ("model/dense/BiasAdd:BiasAdd", 4096, Some(4096), 1, "[1024]"),
    (
        "model/conv/Conv2D:Conv2D",
        3 << 20,
        None,
        19,
        "[64,28,28,32]",
    ),
    ("model/embed/Gather:GatherV2", 8192, Some(8000), 9, "[1000]"),
    (
        "model/<loss>/\"x\"&\\y ü\u{2028}:Softmax",
        512,
        Some(500),
        101,
        "[8, 64]",
    ),
    ("model/odd:Cast", 256, Some(256), 77, "[]"),
];

fn memory_stats(
    allocator: &V,
    heap: &Heap,
    address: u64,
    bytes: i64,
    requested: i64,
    kind: usize,
    fragmentation: f64,
) -> Vec<(&'static str, V)> {
    let (op, _, _, data_type, shape) = KINDS[kind];
    // A device ordinal is overridden by a later allocator name; no stat at
    // all makes the allocator "".
    let mut stats = match allocator {
        V::I(i) => vec![("device_ordinal", V::I(*i))],
        V::S(s) => vec![("index_on_host", V::I(3)), ("allocator_name", V::S(s))],
        V::R(s) => vec![("allocator_name", V::R(s.clone()))],
        _ => vec![],
    };
    stats.extend([
        ("bytes_reserved", V::I(heap.stack)),
        ("bytes_allocated", V::I(heap.heap)),
        ("bytes_available", V::I((8 << 30) - heap.heap - heap.stack)),
        ("fragmentation", V::D(fragmentation)),
        ("peak_bytes_in_use", V::I(heap.peak)),
        ("requested_bytes", V::I(requested)),
        ("allocation_bytes", V::I(bytes)),
        ("addr", V::I(address as i64)),
        ("tf_op", V::R(op.to_string())),
        ("id", V::I(12)),
        ("region_type", V::R("output".into())),
        ("data_type", V::I(data_type)),
        ("shape", V::Owned(shape.to_string())),
    ]);
    stats
}

/// Emits a memory event on `line` at `time`: an allocation, or (when the
/// heap is large or at random) a deallocation of a live tensor or, rarely,
/// of an address never allocated.
#[allow(clippy::too_many_arguments)]
fn memory_event(
    host: &mut Synth,
    line: usize,
    time: i64,
    rng: &mut Lcg,
    heap: &mut Heap,
    allocator: &V,
    ceiling: i64,
) {
    let fragmentation = match rng.below(200) {
        0 => 0.0,
        1 => 1.0,
        _ => rng.below(1_000_000) as f64 / 7_777_777.0,
    };
    let free = !heap.live.is_empty() && (heap.heap > ceiling || rng.below(100) < 45);
    if free {
        if rng.below(50) == 0 {
            // A deallocation whose allocation happened before the window.
            let stats = memory_stats(
                allocator,
                heap,
                0xdead_0000 + rng.below(1000),
                4096,
                4096,
                1,
                fragmentation,
            );
            host.event(line, "MemoryDeallocation", time, 0, stats);
            return;
        }
        let victim = rng.below(heap.live.len() as u64) as usize;
        let (address, bytes, kind) = heap.live.swap_remove(victim);
        heap.heap -= bytes;
        let stats = memory_stats(allocator, heap, address, bytes, bytes, kind, fragmentation);
        host.event(line, "MemoryDeallocation", time, 0, stats);
    } else {
        let kind = rng.below(KINDS.len() as u64) as usize;
        let (_, bytes, requested, _, _) = KINDS[kind];
        let requested = requested.unwrap_or_else(|| bytes - rng.below(300) as i64);
        let address = heap.next_address;
        heap.next_address += bytes as u64;
        heap.heap += bytes;
        heap.peak = heap.peak.max(heap.heap + heap.stack);
        heap.live.push((address, bytes, kind));
        let stats = memory_stats(
            allocator,
            heap,
            address,
            bytes,
            requested,
            kind,
            fragmentation,
        );
        host.event(line, "MemoryAllocation", time, 0, stats);
    }
}

fn heap(base: i64, stack: i64, address: u64) -> Heap {
    Heap {
        heap: base,
        peak: base + stack,
        stack,
        next_address: address,
        live: Vec::new(),
    }
}

/// Host plane with steps on two threads, roots of two levels, a legacy
/// `TraceContext` root, an async root, a producer/consumer pair, memory
/// events in and between steps for four allocators (named by ref, by string,
/// by device ordinal, and by nothing), more than 1000 snapshots for one of
/// them, preallocated memory, stack, identical allocations, unmatched
/// deallocations, odd data types, strings that need escaping, NaN
/// fragmentation and an address above 2^63.
fn edge_case_space() -> XSpace {
    let mut host = Synth::new(49, "/host:CPU");
    let python = host.line(4242, "python");
    let worker = host.line(4243, "worker");
    let mut rng = Lcg(7);
    let step_ps = 3_000_000i64;
    let period = 3_400_000i64;
    for k in 0..8i64 {
        let start = 100_000 + k * period;
        let mut stats = vec![("_r", V::I(1)), ("step_num", V::I(k))];
        if k == 3 {
            stats.push(("_pt", V::I(1)));
            stats.push(("_p", V::U(77)));
        }
        host.event(python, "train", start, step_ps, stats);
        for j in 0..10 {
            let name = [
                "model/a/MatMul:MatMul",
                "model/b/Relu:Relu",
                "model/c/Add:AddV2",
            ][j % 3];
            host.event(
                python,
                name,
                start + j as i64 * step_ps / 10 + 1_000,
                step_ps / 10 - 2_000,
                vec![],
            );
        }
    }
    // Worker thread: a level-2 root, a TraceContext, an async root and a
    // consumer of step 3's context, then plain time.
    host.event(
        worker,
        "outer_level2",
        1_000_000,
        1_500_000,
        vec![("_r", V::I(2))],
    );
    host.event(worker, "TraceContext", 5_000_000, 1_000_000, vec![]);
    host.event(
        worker,
        "async_root",
        8_000_000,
        1_000_000,
        vec![("_r", V::I(1)), ("_a", V::I(1))],
    );
    host.event(
        worker,
        "consumer",
        13_000_000,
        2_000_000,
        vec![("_ct", V::I(1)), ("_c", V::U(77))],
    );

    let gpu0 = V::R("GPU_0_bfc".into());
    let gpu1 = V::S("GPU_1_bfc");
    let ordinal = V::I(1);
    let nameless = V::D(0.0);
    let mut heap0 = heap(50 << 20, 1 << 20, 0x7f00_0000_0000);
    let mut heap1 = heap(0, 4 << 20, 0xffff_8000_0000_0000);
    let mut heap2 = heap(1 << 20, 0, 0x1000_0000);
    let mut heap3 = heap(0, 0, 0x2000);
    let end = 100_000 + 8 * period;
    let mut time = 10_000i64;
    let mut n = 0u64;
    while time < end {
        // GPU_0: most events, on the python thread, ceiling 80 MiB.
        memory_event(
            &mut host,
            python,
            time,
            &mut rng,
            &mut heap0,
            &gpu0,
            80 << 20,
        );
        n += 1;
        if n.is_multiple_of(9) {
            memory_event(
                &mut host,
                python,
                time + 3,
                &mut rng,
                &mut heap1,
                &gpu1,
                12 << 20,
            );
        }
        if n.is_multiple_of(13) {
            memory_event(
                &mut host,
                worker,
                time + 5,
                &mut rng,
                &mut heap2,
                &ordinal,
                9 << 20,
            );
        }
        if n.is_multiple_of(301) {
            memory_event(
                &mut host,
                worker,
                time + 7,
                &mut rng,
                &mut heap3,
                &nameless,
                1 << 20,
            );
        }
        time += 9_973 + rng.below(2_000) as i64;
    }
    // A NaN fragmentation and a uint64 stat (which XProf reads as 0).
    let mut stats = memory_stats(&gpu1, &heap1, 0x5, 64, 64, 1, f64::NAN);
    stats.push(("bytes_reserved", V::U(99)));
    host.event(python, "MemoryAllocation", end + 11, 0, stats);
    XSpace {
        planes: vec![host.finish()],
        hostnames: vec!["synthetic".into()],
        ..XSpace::default()
    }
}

/// Already grouped (XProf then keeps `group_id` as it is), with a TPU plane
/// whose `XLA Modules` become `hlo_modules`.
fn pregrouped_space() -> XSpace {
    let mut host = Synth::new(49, "/host:CPU");
    let line = host.line(1, "main");
    let mut rng = Lcg(99);
    let allocator = V::R("TPU_0_hbm".into());
    let mut h = heap(2 << 20, 0, 0x4000_0000);
    let mut time = 1_000i64;
    for i in 0..400 {
        let group = if i % 37 == 0 { None } else { Some(i / 50 + 3) };
        let before = host.plane.lines[line].events.len();
        memory_event(&mut host, line, time, &mut rng, &mut h, &allocator, 6 << 20);
        if let Some(group) = group {
            let id = host.stat_id("group_id");
            if let Some(event) = host.plane.lines[line].events.get_mut(before) {
                event.stats.push(XStat {
                    metadata_id: id,
                    value: Some(x_stat::Value::Int64Value(group)),
                });
            }
        }
        time += 5_003;
    }
    let mut tpu = Synth::new(0, "/device:TPU:0");
    let modules = tpu.line(1, "XLA Modules");
    for i in 0..3 {
        tpu.event(
            modules,
            &format!("jit_step_{i}"),
            10_000 + i * 700_000,
            600_000,
            vec![],
        );
    }
    XSpace {
        planes: vec![host.finish(), tpu.finish()],
        ..XSpace::default()
    }
}

/// TF loop ops in the trace: XProf does not group, so every step id comes
/// from the fill rule.
fn loop_op_space() -> XSpace {
    let mut host = Synth::new(49, "/host:CPU");
    let line = host.line(1, "main");
    let mut rng = Lcg(5);
    host.event(line, "WhileOp-EvalCond", 1, 1, vec![]);
    for k in 0..3 {
        host.event(
            line,
            "train",
            100 + k * 1_000_000,
            900_000,
            vec![("_r", V::I(1)), ("step_num", V::I(k))],
        );
    }
    let allocator = V::S("GPU_0_bfc");
    let mut h = heap(0, 0, 0x100);
    for i in 0..250 {
        memory_event(
            &mut host,
            line,
            1_000 + i * 11_111,
            &mut rng,
            &mut h,
            &allocator,
            1 << 22,
        );
    }
    XSpace {
        planes: vec![host.finish()],
        ..XSpace::default()
    }
}

/// A host plane without any memory event.
fn no_memory_space() -> XSpace {
    let mut host = Synth::new(49, "/host:CPU");
    let line = host.line(1, "main");
    host.event(line, "train", 0, 10, vec![("_r", V::I(1))]);
    XSpace {
        planes: vec![host.finish()],
        ..XSpace::default()
    }
}

fn write_case(dir: &Path, name: &str, space: &XSpace) -> (PathBuf, PathBuf, MemoryProfile) {
    let xplane = dir.join(format!("{name}.xplane.pb"));
    std::fs::write(&xplane, space.encode_to_vec()).expect("writing xplane");
    let profile = memory_profile(space).expect("memory profile");
    let json = dir.join(format!("{name}.memory_profile.json"));
    std::fs::write(&json, profile.to_json()).expect("writing json");
    (xplane, json, profile)
}

#[test]
fn synthetic_traces_reach_the_corner_cases() {
    let profile = memory_profile(&edge_case_space()).expect("profile");
    assert_eq!(
        profile.memory_ids,
        ["", "1", "GPU_0_bfc", "GPU_1_bfc"].map(String::from)
    );
    let gpu0 = &profile.memory_profile_per_allocator["GPU_0_bfc"];
    assert_eq!(gpu0.sampled_timeline_snapshots.len(), 1000);
    let specials: Vec<&str> = gpu0
        .special_allocations
        .iter()
        .map(|s| s.tf_op_name.as_str())
        .collect();
    assert_eq!(specials, ["unused preallocated device memory", "stack"]);
    assert!(gpu0
        .active_allocations
        .iter()
        .any(|a| a.num_occurrences > 1));
    let steps: Vec<i64> = gpu0
        .sampled_timeline_snapshots
        .iter()
        .map(|s| s.activity_metadata.clone().unwrap_or_default().step_id)
        .collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "steps only grow");
    assert!(steps.iter().max() >= Some(&8));

    let pregrouped = memory_profile(&pregrouped_space()).expect("profile");
    assert_eq!(pregrouped.hlo_modules.len(), 3);
    assert_eq!(pregrouped.hlo_modules[2].plane_name, "TPU:0");
    let empty = memory_profile(&no_memory_space()).expect("profile");
    assert_eq!(
        empty.to_json(),
        r#"{"memoryProfilePerAllocator":{},"numHosts":1,"memoryIds":[],"version":1,"hloModules":[]}"#
    );
}

/// Compares our memory profile with XProf's converter when
/// `DEVTRACE_XPROF_PYTHON` is set (e.g. `.venv/bin/python`).
#[test]
fn memory_profile_matches_xprof() {
    let Some(python) = std::env::var_os("DEVTRACE_XPROF_PYTHON") else {
        println!(
            "note: DEVTRACE_XPROF_PYTHON is not set; skipping the comparison with XProf's \
             memory_profile converter"
        );
        return;
    };
    let dir = scratch("xprof-compare");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/py/compare_memory_profile.py");
    let mut cases = vec![("capture", capture().space.clone())];
    cases.push(("edge_cases", edge_case_space()));
    cases.push(("pregrouped", pregrouped_space()));
    cases.push(("loop_ops", loop_op_space()));
    cases.push(("no_memory", no_memory_space()));
    let mut failures = Vec::new();
    for (name, space) in &cases {
        let (xplane, json, _) = write_case(&dir, name, space);
        let output = Command::new(&python)
            .arg(&script)
            .arg(&xplane)
            .arg(&json)
            .output()
            .expect("running the comparison script");
        let text = String::from_utf8_lossy(&output.stdout);
        println!("== {name}\n{text}");
        if !output.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&output.stderr));
            failures.push(*name);
        }
    }
    assert!(
        failures.is_empty(),
        "differences from XProf: {failures:?} (traces and JSON kept in {})",
        dir.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
