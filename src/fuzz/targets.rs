//! The fuzz targets: one per decoder of bytes the agent does not control,
//! each with seeds made by the project's own encoders.
//!
//! | target | bytes from | decoder |
//! |---|---|---|
//! | `workload_metadata` | any user's workload (`cuda-P.meta`) | `MetaReader`, `MetaRecord::decode` |
//! | `tap_messages` | clients and servers through the tap | gRPC framing and the partial protos |
//! | `xspace_read` | files in a repository, upstream replies | XSpace decoding, summary, plane names |
//! | `session_tools` | files in a repository | the tool converters |
//! | `xspace_merge` | upstream profilers | decoding and folding in another XSpace |
//! | `libtpu_collect_data` | libtpu's `collect_data` buffer | `tpu::decode_xspace`, then merging |
//! | `bpf_records` | BPF ring buffers | record reads, scheduler timeline, driver calls |
//! | `shared_ring` | ring files in the runtime directory | `Ring::open_file`, then draining |
//! | `session_replies` | session hosts | a `Profile` reply read as it streams in, its trace written out |

use std::sync::Arc;

use prost::Message;

use super::{bucket, check, Target};
use crate::backend::ebpf::records::{CudaCall, Record, SchedRecord, SCHED_EXEC, SCHED_SWITCH};
use crate::backend::ebpf::{cuda::DriverCalls, sched::SchedTimeline};
use crate::backend::mock::{MockConfig, Workload};
use crate::model::registry::Registry;
use crate::proto::tensorflow::profiler::XSpace;
use crate::recorder::Window;
use crate::ring::{DropPolicy, Ring};
use crate::workload::{MetaReader, MetaRecord};
use crate::xspace::{self, CaptureInfo};

// ---- workload metadata -------------------------------------------------

fn metadata_seeds() -> Vec<Vec<u8>> {
    let records = crate::workload::sample_records();
    let mut seeds: Vec<Vec<u8>> = records.iter().map(|r| r.encode().into_bytes()).collect();
    seeds.push(
        records
            .iter()
            .flat_map(|r| r.encode().into_bytes())
            .collect(),
    );
    seeds
}

/// The first byte says where the file's bytes are split between two reads.
fn metadata(input: &[u8]) -> Option<u64> {
    let (&split, bytes) = input.split_first()?;
    let split = usize::from(split).min(bytes.len());
    let mut reader = MetaReader::default();
    let mut records = reader.absorb(&bytes[..split]);
    records.extend(reader.absorb(&bytes[split..]));
    for record in &records {
        // What was read is written back the same way.
        let line = record.encode();
        assert_eq!(
            MetaRecord::decode(line.trim_end_matches('\n')).as_ref(),
            Some(record),
            "{line:?}"
        );
    }
    // Which kinds of record, how many, how many lines were malformed.
    let kinds = records.iter().fold(0u64, |kinds, record| {
        kinds | 1 << (record.encode().bytes().next().unwrap_or(0) % 32)
    });
    (!records.is_empty())
        .then(|| kinds | bucket(records.len()) << 32 | bucket(reader.malformed() as usize) << 40)
}

static WORKLOAD_METADATA: Target = Target {
    name: "workload_metadata",
    seeds: metadata_seeds,
    run: metadata,
    dictionary: &[
        b"process ",
        b"name ",
        b"device ",
        b"dropped ",
        b"error ",
        b"warning ",
        b"cupti ",
        b"displaced ",
        b"resumed ",
        b" ",
        b"\n",
        b"%",
        b"%2",
        b"%FF",
        b"-",
        b".",
        b"4294967296",
        b"18446744073709551616",
        b"65536",
        b"\xc3",
    ],
    bytes_per_input_byte: 16,
};

// ---- tap ---------------------------------------------------------------

/// Every method the tap decodes, and one it does not.
const TAP_METHODS: &[&str] = &[
    "/tensorflow.MasterService/RunStep",
    "/tensorflow.MasterService/RunCallable",
    "/tensorflow.MasterService/MakeCallable",
    "/tensorflow.MasterService/CreateSession",
    "/tensorflow.MasterService/ExtendSession",
    "/tensorflow.MasterService/PartialRunSetup",
    "/tensorflow.MasterService/CloseSession",
    "/tensorflow.eager.EagerService/CreateContext",
    "/tensorflow.eager.EagerService/StreamingEnqueue",
    "/tensorflow.eager.EagerService/WaitQueueDone",
    "/tensorflow.eager.EagerService/SendTensor",
    "/tensorflow.eager.EagerService/KeepAlive",
    "/tensorflow.WorkerService/RecvTensor",
];

/// A gRPC message as it crosses the wire: flag, length, body.
fn grpc_frame(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// The tap target's input: the method, then chunks of at most 128 bytes,
/// each behind a byte giving its direction (bit 0) and length (the rest).
fn tap_input(method: usize, request: &[u8], response: &[u8]) -> Vec<u8> {
    let mut out = vec![method as u8];
    for (direction, bytes) in [(0u8, request), (1, response)] {
        for chunk in bytes.chunks(128) {
            out.push(direction | ((chunk.len() as u8 - 1) << 1));
            out.extend_from_slice(chunk);
        }
    }
    out
}

fn tap_seeds() -> Vec<Vec<u8>> {
    use crate::tap::decode::*;
    let run_step = sample_run_step().encode_to_vec();
    let status = RunStepResponse { status_code: 3 }.encode_to_vec();
    let callable = RunCallableRequest {
        session_handle: "s1".into(),
        handle: 4,
    }
    .encode_to_vec();
    let make = MakeCallableRequest {
        session_handle: "s1".into(),
        options: Some(CallableOptions {
            fetch: vec!["y".into()],
            target: vec!["t".into()],
        }),
    }
    .encode_to_vec();
    let graph = GraphDef {
        node: vec![b"node-a".to_vec().into(), b"node-b".to_vec().into()],
    }
    .encode_to_vec();
    let create = CreateSessionRequest {
        graph_def: graph.clone().into(),
    }
    .encode_to_vec();
    let extend = ExtendSessionRequest {
        session_handle: "s1".into(),
        graph_def: graph.into(),
    }
    .encode_to_vec();
    let handle = SessionHandle {
        session_handle: "s1".into(),
    }
    .encode_to_vec();
    let context = ContextId { context_id: 9 }.encode_to_vec();
    let create_context = CreateContextRequest { context_id: 9 }.encode_to_vec();
    let enqueue = sample_enqueue().encode_to_vec();
    let wait = WaitQueueDoneRequest {
        context_id: 9,
        op_id: vec![1, 2, 3],
    }
    .encode_to_vec();
    let send = SendTensorRequest {
        context_id: 9,
        op_id: 5,
        tensors: vec![b"t".to_vec().into()],
        device_name: "/device:CPU:0".into(),
    }
    .encode_to_vec();
    let pairs: [(&[u8], &[u8]); 13] = [
        (&run_step, &status),
        (&callable, &status),
        (&make, &handle),
        (&create, &handle),
        (&extend, &handle),
        (&handle, &handle),
        (&handle, &[]),
        (&create_context, &context),
        (&enqueue, &[]),
        (&wait, &[]),
        (&send, &[]),
        (&context, &[]),
        (b"opaque", b"opaque"),
    ];
    pairs
        .iter()
        .enumerate()
        .map(|(method, (request, response))| {
            // Two request messages, to match two responses of a stream.
            let mut requests = grpc_frame(request);
            requests.extend(grpc_frame(request));
            let mut responses = grpc_frame(response);
            responses.extend(grpc_frame(response));
            tap_input(method, &requests, &responses)
        })
        .collect()
}

fn tap(input: &[u8]) -> Option<u64> {
    use crate::tap::record::Recorder;
    let (&method, mut rest) = input.split_first()?;
    let ring = Ring::new(1, 64, DropPolicy::DropNewest).expect("a small ring");
    let recorder = Recorder::new(Registry::new(), ring.producer().expect("a lane"));
    let line = recorder.connection("127.0.0.1:1".parse().expect("an address"), "upstream");
    let (call, mut request, mut response) =
        recorder.call(line, TAP_METHODS[usize::from(method) % TAP_METHODS.len()]);
    while let Some((&control, after)) = rest.split_first() {
        let length = (usize::from(control >> 1) + 1).min(after.len());
        let observer = if control & 1 == 0 {
            &mut request
        } else {
            &mut response
        };
        observer.observe(&bytes::Bytes::copy_from_slice(&after[..length]));
        rest = &after[length..];
    }
    call.finish(0);
    if !recorder.settle(std::time::Duration::from_secs(10)) {
        return None;
    }
    let stats = recorder.stats();
    let counts = [
        stats.steps,
        stats.eager_ops,
        stats.undecoded,
        stats.failed,
        stats.request_bytes,
        stats.response_bytes,
    ];
    let summary = counts.iter().fold(u64::from(method), |summary, count| {
        summary << 6 | bucket(*count as usize)
    });
    (stats.undecoded < 4).then_some(summary)
}

static TAP_MESSAGES: Target = Target {
    name: "tap_messages",
    seeds: tap_seeds,
    run: tap,
    dictionary: &[
        b"\x00\x00\x00\x00",
        b"\x00\x04\x00\x00\x00",
        b"\x0a",
        b"\x12",
        b"\x09",
    ],
    bytes_per_input_byte: 64,
};

// ---- XSpace ------------------------------------------------------------

const START_NS: u64 = 1_700_000_000_000_000_000;

/// A trace of the mock workload over `millis`, as the agent encodes it.
fn mock_trace(millis: u64, gpus: u16, hostname: &str) -> Vec<u8> {
    let registry = Registry::new();
    let config = MockConfig {
        seed: 3,
        events_per_second: 2_000,
        gpus,
        ..MockConfig::default()
    };
    let mut workload = Workload::new(&config, &registry, START_NS);
    let mut events = Vec::new();
    while workload.next_time_ns() < START_NS + millis * 1_000_000 {
        workload.emit_next(&mut |e| events.push(e));
    }
    let info = CaptureInfo {
        window: Window {
            start_ns: START_NS,
            stop_ns: START_NS + millis * 1_000_000,
        },
        hostname: hostname.into(),
        warnings: vec!["a warning".into()],
        errors: vec!["an error".into()],
        properties: vec![("key".into(), "value".into())],
        ..CaptureInfo::default()
    };
    xspace::encode_xspace(&events, &registry.snapshot(), &info)
        .contiguous()
        .to_vec()
}

fn xspace_seeds() -> Vec<Vec<u8>> {
    vec![
        mock_trace(5, 1, "worker-0"),
        mock_trace(60, 2, "worker-1"),
        XSpace::default().encode_to_vec(),
    ]
}

/// Protobuf keys of XSpace's fields (planes, lines, events, stats, maps).
const PROTOBUF_TOKENS: &[&[u8]] = &[
    b"\x0a",
    b"\x12",
    b"\x1a",
    b"\x22",
    b"\x2a",
    b"\x32",
    b"\x08",
    b"\x10",
    b"\x18",
    b"\x20",
    b"\x38",
    b"\x11",
    b"\x19",
    b"\x0a\x00",
    b"\x22\x00",
];

fn read(input: &[u8]) -> Option<u64> {
    let names = xspace::read::plane_names(input);
    match XSpace::decode(input) {
        Ok(space) => {
            let summary = xspace::read::summarize(&space, 10);
            let _ = summary.to_string();
            // The quick scan finds a name per plane that has one. (It may
            // refuse what prost reads: prost reads a map field of any wire
            // type as if length-delimited, which protobuf itself refuses.)
            if let Ok(names) = names {
                let named = space.planes.iter().filter(|p| !p.name.is_empty()).count();
                assert!(named <= names.len() && names.len() <= space.planes.len());
            }
            Some(shape(&space))
        }
        Err(_) => None,
    }
}

/// The size of a trace: planes, lines, events, metadata, stats, messages.
fn shape(space: &XSpace) -> u64 {
    let lines = space.planes.iter().map(|p| p.lines.len()).sum::<usize>();
    let events = space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum::<usize>();
    let metadata = space
        .planes
        .iter()
        .map(|p| p.event_metadata.len() + p.stat_metadata.len())
        .sum::<usize>();
    let stats = space.planes.iter().map(|p| p.stats.len()).sum::<usize>();
    let messages = space.errors.len() + space.warnings.len() + space.hostnames.len();
    [space.planes.len(), lines, events, metadata, stats, messages]
        .iter()
        .fold(0, |summary, count| summary << 6 | bucket(*count))
}

/// Decoded messages hold more than their bytes (an empty event is two
/// bytes on the wire and a struct of tens in memory), but in proportion.
const DECODED_BYTES_PER_INPUT_BYTE: usize = 256;

static XSPACE_READ: Target = Target {
    name: "xspace_read",
    seeds: xspace_seeds,
    run: read,
    dictionary: PROTOBUF_TOKENS,
    bytes_per_input_byte: DECODED_BYTES_PER_INPUT_BYTE,
};

/// The first byte picks the trace viewer's resolution.
fn tools(input: &[u8]) -> Option<u64> {
    use crate::tools::{kernel_stats, memory_profile, overview, trace_viewer};
    let (&resolution, bytes) = input.split_first()?;
    let space = XSpace::decode(bytes).ok()?;
    let options = trace_viewer::TraceViewerOptions {
        resolution: usize::from(resolution),
        ..trace_viewer::TraceViewerOptions::default()
    };
    // Which tools answered, and how much each said.
    let mut summary = shape(&space);
    let mut answered = |json: Option<String>| {
        summary = summary << 6 | json.map_or(0, |j| 1 + bucket(j.len()));
    };
    answered(
        trace_viewer::trace_viewer(&space, &options)
            .ok()
            .map(|t| t.to_json()),
    );
    answered(memory_profile::memory_profile_json(&space).ok());
    answered(kernel_stats::kernel_stats(&space).ok().map(|k| k.to_json()));
    answered(overview::overview(&space, 5).ok().map(|o| o.to_json()));
    Some(summary)
}

fn tools_seeds() -> Vec<Vec<u8>> {
    xspace_seeds()
        .into_iter()
        .map(|bytes| [&[20u8][..], &bytes].concat())
        .collect()
}

static SESSION_TOOLS: Target = Target {
    name: "session_tools",
    seeds: tools_seeds,
    run: tools,
    dictionary: PROTOBUF_TOKENS,
    bytes_per_input_byte: DECODED_BYTES_PER_INPUT_BYTE,
};

/// Two traces: a four-byte little-endian length, ours, then theirs.
fn two_traces(ours: &[u8], theirs: &[u8]) -> Vec<u8> {
    let mut out = (ours.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(ours);
    out.extend_from_slice(theirs);
    out
}

fn merge_seeds() -> Vec<Vec<u8>> {
    let a = mock_trace(5, 1, "agent");
    let b = mock_trace(5, 2, "upstream");
    vec![two_traces(&a, &b), two_traces(&b, &a), two_traces(&a, &[])]
}

/// Merges theirs into ours; the result must encode and decode again.
fn merge(input: &[u8]) -> Option<u64> {
    if input.len() < 4 {
        return None;
    }
    let (length, rest) = input.split_at(4);
    let length =
        (u32::from_le_bytes(length.try_into().expect("four bytes")) as usize).min(rest.len());
    let (ours, theirs) = rest.split_at(length);
    let (Ok(mut ours), Ok(theirs)) = (XSpace::decode(ours), XSpace::decode(theirs)) else {
        return None;
    };
    let theirs_shape = shape(&theirs);
    let _ = xspace::merge::profile_start_ns(&theirs);
    xspace::merge::merge(&mut ours, theirs, "upstream 127.0.0.1:9999");
    let again = XSpace::decode(ours.encode_to_vec().as_slice()).expect("a merged trace decodes");
    assert_eq!(again.planes.len(), ours.planes.len());
    Some(theirs_shape ^ shape(&ours).rotate_left(32))
}

static XSPACE_MERGE: Target = Target {
    name: "xspace_merge",
    seeds: merge_seeds,
    run: merge,
    dictionary: PROTOBUF_TOKENS,
    bytes_per_input_byte: DECODED_BYTES_PER_INPUT_BYTE,
};

fn tpu_seeds() -> Vec<Vec<u8>> {
    let trace = mock_trace(5, 0, "tpu-host");
    let mut with_nul = trace.clone();
    with_nul.push(0);
    vec![trace, with_nul]
}

/// As a capture does with libtpu's buffer: decode, re-encode, fold in.
fn tpu(input: &[u8]) -> Option<u64> {
    let space = crate::backend::tpu::decode_xspace(input).ok()?;
    let bytes = space.encode_to_vec();
    let theirs = XSpace::decode(bytes.as_slice()).expect("re-encoded bytes decode");
    let mut ours = XSpace::decode(OURS.with(|o| o.clone()).as_slice()).expect("our trace");
    xspace::merge::merge(&mut ours, theirs, "libtpu");
    Some(shape(&ours))
}

thread_local! {
    /// The agent's side of a libtpu merge, encoded once per thread.
    static OURS: Vec<u8> = mock_trace(2, 1, "agent");
}

static LIBTPU_COLLECT_DATA: Target = Target {
    name: "libtpu_collect_data",
    seeds: tpu_seeds,
    run: tpu,
    dictionary: PROTOBUF_TOKENS,
    bytes_per_input_byte: DECODED_BYTES_PER_INPUT_BYTE,
};

// ---- BPF records -------------------------------------------------------

/// The bytes of a record as the BPF program submits it.
fn record_bytes<R: Record>(record: &R) -> Vec<u8> {
    // SAFETY: records are `repr(C)` plain integers and byte arrays without
    // padding (their sizes are asserted in `records.rs`).
    unsafe {
        std::slice::from_raw_parts((record as *const R).cast::<u8>(), std::mem::size_of::<R>())
    }
    .to_vec()
}

fn comm(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..name.len()].copy_from_slice(name.as_bytes());
    out
}

/// Samples behind a byte saying which ring they came from (bit 0: the
/// CUDA ring) and whether the timeline is cut after them (bit 1).
fn bpf_seeds() -> Vec<Vec<u8>> {
    use crate::backend::ebpf::cuda::{CudaReturns, CUDA_PROBES};
    let sched = |kind, time_ns, matched| SchedRecord {
        time_ns,
        kind,
        cpu: 1,
        prev_tid: 10,
        prev_pid: 10,
        next_tid: 11,
        next_pid: 11,
        prev_state: 1,
        matched,
        prev_comm: comm("python"),
        next_comm: comm("worker"),
    };
    let mut sched_seed = Vec::new();
    for (i, record) in [
        sched(SCHED_EXEC, 1_000, 3),
        sched(SCHED_SWITCH, 2_000, 3),
        sched(SCHED_SWITCH, 3_000, 1),
    ]
    .iter()
    .enumerate()
    {
        sched_seed.push((i as u8 & 1) << 1);
        sched_seed.extend(record_bytes(record));
    }
    let mut cuda_seed = Vec::new();
    let returns = [CudaReturns::All, CudaReturns::Needed];
    for (index, probe) in CUDA_PROBES.iter().enumerate() {
        let mut symbol = [0u8; 96];
        symbol[..6].copy_from_slice(b"kernel");
        let call = CudaCall {
            start_ns: 1_000 + index as u64,
            end_ns: 2_000 + index as u64,
            pid: 7,
            tid: 8,
            cookie: probe.cookie(index, returns[index % 2]) as u32,
            result: 0,
            args: [0x7000, 2, 1, 1, 128, 1, 1, 0, 7],
            launch: [1, 1, 1, 64, 1, 1, 0],
            reserved: 0,
            launch_stream: 7,
            out_value: 0x7000,
            comm: comm("python"),
            symbol,
        };
        cuda_seed.push(1);
        cuda_seed.extend(record_bytes(&call));
    }
    vec![sched_seed, cuda_seed]
}

fn bpf(input: &[u8]) -> Option<u64> {
    let registry = Registry::new();
    let mut sched = SchedTimeline::new(Arc::clone(&registry));
    let mut calls = DriverCalls::new(registry);
    let mut events = Vec::new();
    let mut rest = input;
    let mut whole = true;
    let mut kinds = 0u64;
    while let Some((&control, after)) = rest.split_first() {
        let size = if control & 1 == 0 {
            std::mem::size_of::<SchedRecord>()
        } else {
            std::mem::size_of::<CudaCall>()
        };
        let (sample, next) = after.split_at(size.min(after.len()));
        rest = next;
        if control & 1 == 0 {
            match SchedRecord::read(sample) {
                Some(record) => {
                    kinds |= 1 << (record.kind % 8) << (record.matched % 4 * 8);
                    sched.record(&record, record.time_ns, &mut events);
                }
                None => whole = false,
            }
            if control & 2 != 0 {
                let now = events.last().map_or(0, |e| e.start_ns.saturating_add(1));
                sched.split(now, &mut events);
            }
        } else {
            match CudaCall::read(sample) {
                Some(call) => {
                    kinds |= 1 << (32 + call.cookie % 32);
                    calls.record(&call, call.start_ns, call.end_ns, &mut events);
                }
                None => whole = false,
            }
        }
    }
    whole.then_some(kinds ^ bucket(events.len()) << 58)
}

static BPF_RECORDS: Target = Target {
    name: "bpf_records",
    seeds: bpf_seeds,
    run: bpf,
    dictionary: &[
        b"\x01\x00\x00\x00",
        b"\x02\x00\x00\x00",
        b"\x03\x00\x00\x00",
    ],
    bytes_per_input_byte: 64,
};

// ---- shared ring -------------------------------------------------------

fn ring_seeds() -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("seed.ring");
    let ring = Ring::create_shared(&path, 1, 4, DropPolicy::DropNewest).expect("a shared ring");
    let mut producer = ring.producer().expect("a lane");
    let registry = Registry::new();
    let mut workload = Workload::new(&MockConfig::default(), &registry, START_NS);
    let mut events = Vec::new();
    workload.emit_next(&mut |e| events.push(e));
    producer.push_batch(&events[..events.len().min(3)]);
    vec![std::fs::read(&path).expect("the ring's bytes")]
}

thread_local! {
    static RING_FILE: tempfile::NamedTempFile =
        tempfile::NamedTempFile::new().expect("a temporary file");
}

/// A ring file of these bytes, opened with the CUDA backend's limits (one
/// lane) and drained as it does, a few passes.
fn ring(input: &[u8]) -> Option<u64> {
    use std::io::{Seek, Write};
    RING_FILE.with(|file| {
        let mut handle = file.as_file();
        handle.set_len(0).expect("truncate");
        handle.rewind().expect("rewind");
        handle.write_all(input).expect("write");
        let limits = crate::backend::cuda::WORKLOAD_RING_LIMITS;
        let (ring, _) = Ring::open_untrusted(file.path(), limits).ok()?;
        let mut consumer = ring.consumer().ok()?;
        let mut events = Vec::new();
        let mut report = crate::ring::DrainReport::default();
        for _ in 0..3 {
            report = consumer.drain(&mut events, 4096);
        }
        Some(
            bucket(events.len())
                | bucket(report.dropped_newest as usize) << 8
                | bucket(report.dropped_oldest as usize) << 16
                | u64::from(report.corrupt.is_some()) << 24,
        )
    })
}

static SHARED_RING: Target = Target {
    name: "shared_ring",
    seeds: ring_seeds,
    run: ring,
    dictionary: &[
        b"\x00\x00\x00\x00\x00\x00\x00\x00",
        b"\xff\xff\xff\xff\xff\xff\xff\xff",
    ],
    bytes_per_input_byte: 64,
};

// ---- session replies ----------------------------------------------------

/// Replies as servers send them: the trace as `xspace`, as `xplane.pb`
/// tool data beside another tool's, and an empty one. The first byte is
/// the size of the pieces the body arrives in.
fn reply_seeds() -> Vec<Vec<u8>> {
    use crate::protocol::client::{RawProfileResponse, RawToolData};
    let trace = bytes::Bytes::from(mock_trace(20, 1, "host"));
    let tool = |name: &str, data: &bytes::Bytes| RawToolData {
        name: name.into(),
        data: data.clone(),
    };
    [
        RawProfileResponse {
            xspace: Some(trace.clone()),
            ..RawProfileResponse::default()
        },
        RawProfileResponse {
            tool_data: vec![
                tool("trace_viewer", &"{}".into()),
                tool("xplane.pb", &trace),
            ],
            xspace: Some(trace.clone()),
            ..RawProfileResponse::default()
        },
        RawProfileResponse {
            empty_trace: true,
            ..RawProfileResponse::default()
        },
    ]
    .iter()
    .map(|reply| {
        let message = reply.encode_to_vec();
        let mut input = vec![61, 0];
        input.extend_from_slice(&(message.len() as u32).to_be_bytes());
        input.extend_from_slice(&message);
        input
    })
    .collect()
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime for the fuzz target");
}

/// The body ends with an OK status: whatever is refused, the bytes did it.
fn reply(input: &[u8]) -> Option<u64> {
    use crate::fleet::streaming::stand_in::{body_in_pieces, MemorySink};
    let (&piece, body) = input.split_first()?;
    let body = body_in_pieces(
        body.to_vec(),
        usize::from(piece).max(1),
        Some(tonic::Code::Ok),
    );
    let sink = Arc::new(MemorySink::default());
    let refused = |status| crate::protocol::client::CallError::Status { status, tls: false };
    let file = RUNTIME.with(|runtime| {
        runtime.block_on(crate::fleet::streaming::read_reply(
            body,
            1 << 20,
            Arc::new(Arc::clone(&sink)),
            "host",
            refused,
        ))
    });
    file.ok()?.map(|file| file.commit()).transpose().ok()?;
    let written = sink
        .committed
        .lock()
        .pop()
        .map_or(0, |(_, bytes)| bytes.len());
    Some(1 + bucket(written))
}

static SESSION_REPLIES: Target = Target {
    name: "session_replies",
    seeds: reply_seeds,
    run: reply,
    dictionary: PROTOBUF_TOKENS,
    bytes_per_input_byte: 16,
};

#[test]
fn workload_metadata() {
    check(&WORKLOAD_METADATA);
}

#[test]
fn tap_messages() {
    check(&TAP_MESSAGES);
}

#[test]
fn xspace_read() {
    check(&XSPACE_READ);
}

#[test]
fn session_tools() {
    check(&SESSION_TOOLS);
}

#[test]
fn xspace_merge() {
    check(&XSPACE_MERGE);
}

#[test]
fn libtpu_collect_data() {
    check(&LIBTPU_COLLECT_DATA);
}

#[test]
fn bpf_records() {
    check(&BPF_RECORDS);
}

#[test]
fn shared_ring() {
    check(&SHARED_RING);
}

#[test]
fn session_replies() {
    check(&SESSION_REPLIES);
}
