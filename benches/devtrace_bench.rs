//! devtrace performance harness (`cargo bench --bench devtrace_bench`).
//!
//! A plain `main` (no criterion): every measurement prints its value, a ratio
//! against a baseline measured in the same run, the target, and MET or
//! MISSED. Nothing here asserts on timing; a missed target is reported, never
//! a failure. Lost or duplicated events are reported too (LOST/CORRUPT).
//!
//! Environment:
//! - `DEVTRACE_BENCH_QUICK=1`: small sizes, for smoke testing (numbers are
//!   then only indicative).
//! - `DEVTRACE_BENCH_ONLY=ring,xspace,store,capture,concurrent,tap`: run a
//!   subset.
//! - `DEVTRACE_BENCH_REPEAT=N`: repetitions of each ring run (default 5; the
//!   median is reported).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use prost::Message;

use devtrace::agent::{Agent, AgentConfig, BackendChoice};
use devtrace::backend::mock::{MockConfig, Workload};
use devtrace::clock;
use devtrace::event::Event;
use devtrace::model::registry::{Registry, RegistrySnapshot};
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use devtrace::proto::tensorflow::ProfileRequest;
use devtrace::protocol::XPLANE_TOOL;
use devtrace::recorder::{Store, StoreConfig, Window};
use devtrace::ring::{DropPolicy, Ring};
use devtrace::service::profile_analysis::{AnalysisConfig, ProfileAnalysisService};
use devtrace::service::profiler::{ProfilerService, ServiceConfig};
use devtrace::service::MAX_REPLY_BYTES;
use devtrace::xspace::{encode_runs, encode_xspace, CaptureInfo, Unlimited};

// ---------------------------------------------------------------- settings --

struct Settings {
    quick: bool,
    repeat: usize,
    only: Option<Vec<String>>,
}

impl Settings {
    fn from_env() -> Settings {
        let quick = std::env::var("DEVTRACE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let repeat = std::env::var("DEVTRACE_BENCH_REPEAT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if quick { 3 } else { 5 })
            .max(1);
        let only = std::env::var("DEVTRACE_BENCH_ONLY")
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
        Settings {
            quick,
            repeat,
            only,
        }
    }

    fn wants(&self, part: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|p| p == part))
    }
}

// ------------------------------------------------------------- reporting --

fn verdict(met: bool) -> &'static str {
    if met {
        "MET"
    } else {
        "MISSED"
    }
}

fn mega(per_second: f64) -> String {
    format!("{:.1} M", per_second / 1e6)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ------------------------------------------------------- realistic events --

/// Events of the mock workload (a two-GPU training job) in emission order,
/// generated up front so that generation is never part of a measurement.
fn generate(rate: u64, count: usize) -> (Vec<Event>, Arc<Registry>) {
    let registry = Registry::new();
    let config = MockConfig {
        events_per_second: rate,
        ..MockConfig::default()
    };
    let mut workload = Workload::new(&config, &registry, 1_700_000_000_000_000_000);
    let mut events = Vec::with_capacity(count + 64);
    while events.len() < count {
        workload.emit_next(&mut |e| events.push(e));
    }
    events.truncate(count);
    (events, registry)
}

// ------------------------------------------------------------------- ring --

/// Result of one producer/consumer run.
struct QueueRun {
    elapsed: Duration,
    consumed: u64,
    /// Pushes refused because the queue was full; each was retried.
    full_retries: u64,
    /// Sum of `start_ns` over consumed events, to detect loss or duplication.
    checksum: u64,
}

const DRAIN_BATCH: usize = 4096;
/// A drain that found fewer events than this makes the consumer pause.
const BACKOFF_BELOW: usize = DRAIN_BATCH / 4;
const BACKOFF: Duration = Duration::from_micros(20);

/// Like the agent's collector (which drains every 2 ms), the consumer does
/// not chase the producers one event at a time: when a drain comes back
/// nearly empty it pauses briefly (far less than the producers need to fill
/// a lane), so the two sides do not fight over the same cache lines. Both
/// queues get exactly the same policy.
fn consumer_backoff(read: usize) {
    if read < BACKOFF_BELOW {
        std::thread::sleep(BACKOFF);
    }
}

fn expected_checksum(source: &[Event], per_producer: u64, producers: u64) -> u64 {
    let mut sum = 0u64;
    for i in 0..per_producer {
        sum = sum.wrapping_add(source[(i as usize) % source.len()].start_ns);
    }
    sum.wrapping_mul(producers)
}

/// devtrace's lane ring: one lane per producer, `capacity` slots per lane.
fn run_ring(
    source: &Arc<Vec<Event>>,
    producers: u32,
    per_producer: u64,
    capacity: u64,
    batch: usize,
) -> QueueRun {
    let ring = Ring::new(producers, capacity, DropPolicy::DropNewest).expect("ring");
    let mut consumer = ring.consumer().expect("consumer");
    let barrier = Arc::new(Barrier::new(producers as usize + 1));
    let threads: Vec<_> = (0..producers)
        .map(|_| {
            let mut producer = ring.producer().expect("producer");
            let (source, barrier) = (Arc::clone(source), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let mask = source.len() - 1;
                let mut retries = 0u64;
                barrier.wait();
                if batch <= 1 {
                    for i in 0..per_producer as usize {
                        let event = &source[i & mask];
                        while !producer.push(event) {
                            retries += 1;
                            std::thread::yield_now();
                        }
                    }
                    return retries;
                }
                // Batches are whole slices of the (power-of-two) source.
                let mut sent = 0usize;
                while sent < per_producer as usize {
                    let n = batch.min(per_producer as usize - sent);
                    while producer.free_slots() < n as u64 {
                        retries += 1;
                        std::thread::yield_now();
                    }
                    let at = sent & mask;
                    producer.push_batch(&source[at..at + n]);
                    sent += n;
                }
                retries
            })
        })
        .collect();
    let total = per_producer * u64::from(producers);
    let mut out = Vec::with_capacity(DRAIN_BATCH);
    let (mut consumed, mut checksum) = (0u64, 0u64);
    barrier.wait();
    let start = Instant::now();
    while consumed < total {
        let report = consumer.drain(&mut out, DRAIN_BATCH);
        consumed += report.events;
        for e in &out {
            checksum = checksum.wrapping_add(e.start_ns);
        }
        out.clear();
        consumer_backoff(report.events as usize);
    }
    let elapsed = start.elapsed();
    let full_retries = threads
        .into_iter()
        .map(|t| t.join().expect("producer"))
        .sum();
    QueueRun {
        elapsed,
        consumed,
        full_retries,
        checksum,
    }
}

/// The baseline: crossbeam's bounded MPMC queue holding the same events,
/// with the same total capacity and the same threads.
fn run_crossbeam(
    source: &Arc<Vec<Event>>,
    producers: u32,
    per_producer: u64,
    capacity: usize,
) -> QueueRun {
    let queue = Arc::new(ArrayQueue::<Event>::new(capacity));
    let barrier = Arc::new(Barrier::new(producers as usize + 1));
    let threads: Vec<_> = (0..producers)
        .map(|_| {
            let (source, barrier, queue) =
                (Arc::clone(source), Arc::clone(&barrier), Arc::clone(&queue));
            std::thread::spawn(move || {
                let mask = source.len() - 1;
                let mut retries = 0u64;
                barrier.wait();
                for i in 0..per_producer as usize {
                    let mut event = source[i & mask];
                    while let Err(back) = queue.push(event) {
                        event = back;
                        retries += 1;
                        std::thread::yield_now();
                    }
                }
                retries
            })
        })
        .collect();
    let total = per_producer * u64::from(producers);
    let mut out = Vec::with_capacity(DRAIN_BATCH);
    let (mut consumed, mut checksum) = (0u64, 0u64);
    barrier.wait();
    let start = Instant::now();
    while consumed < total {
        while out.len() < DRAIN_BATCH {
            match queue.pop() {
                Some(e) => out.push(e),
                None => break,
            }
        }
        let read = out.len();
        consumed += read as u64;
        for e in &out {
            checksum = checksum.wrapping_add(e.start_ns);
        }
        out.clear();
        consumer_backoff(read);
    }
    let elapsed = start.elapsed();
    let full_retries = threads
        .into_iter()
        .map(|t| t.join().expect("producer"))
        .sum();
    QueueRun {
        elapsed,
        consumed,
        full_retries,
        checksum,
    }
}

struct Summary {
    rate: f64,
    full_retries: u64,
    lost: i64,
    corrupt: bool,
}

fn summarize(runs: &[QueueRun], total: u64, expected: u64) -> Summary {
    let mut rates: Vec<f64> = runs
        .iter()
        .map(|r| r.consumed as f64 / r.elapsed.as_secs_f64())
        .collect();
    Summary {
        rate: median(&mut rates),
        full_retries: runs.iter().map(|r| r.full_retries).sum(),
        lost: runs.iter().map(|r| total as i64 - r.consumed as i64).sum(),
        corrupt: runs.iter().any(|r| r.checksum != expected),
    }
}

fn integrity(s: &Summary) -> String {
    let mut text = format!("lost 0, full-queue retries {}", s.full_retries);
    if s.lost != 0 {
        text = format!(
            "LOST {} events, full-queue retries {}",
            s.lost, s.full_retries
        );
    }
    if s.corrupt {
        text.push_str(", CORRUPT (checksum mismatch: lost or duplicated events)");
    }
    text
}

/// Events a batching producer hands over at once (CUPTI delivers activity
/// records in buffers; the mock emits an op's worth at a time).
const PRODUCER_BATCH: usize = 64;

fn bench_ring(settings: &Settings) {
    println!("== 1. ring throughput (each producer on its own thread, one consumer draining concurrently) ==");
    const LANE_CAPACITY: u64 = 1 << 16; // the agent's default --ring-capacity
    let (events, _) = generate(1_000_000, 1 << 14);
    let source = Arc::new(events);
    let per_producer: u64 = if settings.quick { 1 << 20 } else { 1 << 24 };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "   {} mock-workload events cycled, {} per producer, {} runs each (median; ring and crossbeam \
         interleaved); producers retry when full; the consumer drains up to {} at a time and pauses \
         {:?} after a drain of < {}; lane capacity {} (crossbeam: same total capacity); Event in \
         memory {} B, ring slot {} B; {} cores",
        source.len(),
        per_producer,
        settings.repeat,
        DRAIN_BATCH,
        BACKOFF,
        BACKOFF_BELOW,
        LANE_CAPACITY,
        std::mem::size_of::<Event>(),
        8 * devtrace::event::EVENT_WORDS,
        cores
    );
    for producers in [1u32, 2] {
        let total = per_producer * u64::from(producers);
        let expected = expected_checksum(&source, per_producer, u64::from(producers));
        let capacity = LANE_CAPACITY * u64::from(producers);
        // Warm up both (page faults of the ring region, thread start).
        run_ring(&source, producers, per_producer / 16, LANE_CAPACITY, 1);
        run_crossbeam(&source, producers, per_producer / 16, capacity as usize);
        let mut ring_runs = Vec::new();
        let mut batch_runs = Vec::new();
        let mut cb_runs = Vec::new();
        // Interleave so that background noise hits all alike.
        for _ in 0..settings.repeat {
            ring_runs.push(run_ring(&source, producers, per_producer, LANE_CAPACITY, 1));
            batch_runs.push(run_ring(
                &source,
                producers,
                per_producer,
                LANE_CAPACITY,
                PRODUCER_BATCH,
            ));
            cb_runs.push(run_crossbeam(
                &source,
                producers,
                per_producer,
                capacity as usize,
            ));
        }
        let cb = summarize(&cb_runs, total, expected);
        let absolute = producers == 1;
        let target = if absolute {
            "target >= 2x and >= 50 M/s"
        } else {
            "target >= 2x"
        };
        let plural = if producers == 1 { "" } else { "s" };
        for (how, runs) in [("push", &ring_runs), ("push_batch of 64", &batch_runs)] {
            let ring = summarize(runs, total, expected);
            let ratio = ring.rate / cb.rate;
            let met = ratio >= 2.0 && (!absolute || ring.rate >= 50e6);
            println!(
                "ring {producers} producer{plural}, {how}: {} events/s  ({ratio:.2}x crossbeam ArrayQueue: {}/s; {target}) {}",
                mega(ring.rate),
                mega(cb.rate),
                verdict(met)
            );
            println!("   ring: {}", integrity(&ring));
        }
        println!("   crossbeam: {}", integrity(&cb));
        if producers as usize + 1 > cores {
            println!(
                "   note: {} threads on {cores} cores: producers and consumer time-share, so this is \
                 a contention/oversubscription number, not a scaling one",
                producers + 1
            );
        }
    }
    println!();
}

// ----------------------------------------------------------------- xspace --

fn count_events(space: &XSpace) -> usize {
    space
        .planes
        .iter()
        .flat_map(|p| p.lines.iter())
        .map(|l| l.events.len())
        .sum()
}

fn bench_xspace(settings: &Settings) {
    println!("== 2. XSpace build + encode (one pass to bytes) ==");
    let count = if settings.quick { 500_000 } else { 5_000_000 };
    let started = Instant::now();
    let (events, registry) = generate(10_000_000, count);
    let snapshot: RegistrySnapshot = registry.snapshot();
    let window = Window {
        start_ns: events.iter().map(|e| e.start_ns).min().unwrap_or(0),
        stop_ns: events.iter().map(|e| e.end_ns()).max().unwrap_or(0) + 1,
    };
    let info = CaptureInfo {
        window,
        hostname: "bench".into(),
        ..CaptureInfo::default()
    };
    println!(
        "   {count} mock events at 10 M events/s ({:.2} s of simulated time), generated in {:.0} ms (not measured)",
        window.duration_ns() as f64 / 1e9,
        ms(started.elapsed())
    );

    // Baseline: the least any builder must do: copy the events and put them
    // in per-(device, line) timeline order (sorting references, as the
    // builder does).
    let t = Instant::now();
    let copy = events.clone();
    let mut order: Vec<&Event> = copy.iter().collect();
    order.sort_by_key(|e| {
        (
            e.device(),
            e.line,
            e.start_ns,
            std::cmp::Reverse(e.duration_ns),
        )
    });
    let sort_time = t.elapsed();
    black_box(&order);
    drop(order);
    drop(copy);

    let t = Instant::now();
    let encoded = encode_xspace(&events, &snapshot, &info);
    let total = t.elapsed();
    let bytes = encoded.contiguous();
    // Checked outside the timing: the bytes decode to every event.
    let emitted = XSpace::decode(bytes.clone())
        .map(|space| count_events(&space))
        .unwrap_or(0);

    let rate = count as f64 / total.as_secs_f64();
    let sort_rate = count as f64 / sort_time.as_secs_f64();
    println!(
        "xspace build+encode: {} events/s  ({:.2}x copy+sort baseline: {}/s; {:.2}x the target; target >= 10 M/s) {}",
        mega(rate),
        rate / sort_rate,
        mega(sort_rate),
        rate / 10e6,
        verdict(rate >= 10e6)
    );
    println!(
        "   one pass: {:.0} ms for {count} events ({emitted} in the decoded XSpace{})",
        ms(total),
        if emitted == count { "" } else { ", MISMATCH" },
    );
    println!(
        "   output {:.1} MiB, {:.1} bytes/event (ring record: 128 bytes/event)",
        bytes.len() as f64 / (1 << 20) as f64,
        bytes.len() as f64 / count as f64
    );
    bench_chunk_merge(settings);
    println!();
}

/// Folding a chunked trace's chunks costs what each chunk holds, not what
/// came before it: a file of many small chunks, each with a warning, a
/// plane and an event name of its own, and an event on a line that each
/// starts a little earlier, is read at the same cost per chunk whether it
/// has few chunks or ten times as many.
fn bench_chunk_merge(settings: &Settings) {
    use devtrace::proto::tensorflow::profiler::{x_event, XEvent, XEventMetadata, XLine, XPlane};
    use devtrace::xspace::chunks::ChunkMerge;
    let chunk = |i: usize| {
        let earlier = XLine {
            id: 1,
            timestamp_ns: 1_000_000_000 - i as i64,
            events: vec![XEvent {
                metadata_id: 1,
                data: Some(x_event::Data::OffsetPs(0)),
                ..XEvent::default()
            }],
            ..XLine::default()
        };
        let shared = XPlane {
            name: "/host:CPU".into(),
            event_metadata: [(
                1,
                XEventMetadata {
                    id: 1,
                    name: format!("op {i}"),
                    ..XEventMetadata::default()
                },
            )]
            .into(),
            lines: vec![earlier],
            ..XPlane::default()
        };
        let own = XPlane {
            name: format!("/custom:{i}"),
            ..XPlane::default()
        };
        XSpace {
            warnings: vec![format!("warning {i}")],
            planes: vec![shared, own],
            ..XSpace::default()
        }
    };
    let per_chunk = |chunks: usize| {
        let made: Vec<XSpace> = (0..chunks).map(chunk).collect();
        let t = Instant::now();
        let mut merging = ChunkMerge::default();
        for space in made {
            merging.add(space);
        }
        let merged = black_box(merging.finish());
        let took = t.elapsed().as_secs_f64() / chunks as f64;
        assert_eq!(merged.warnings.len(), chunks);
        took
    };
    let few = if settings.quick { 2_000 } else { 10_000 };
    let baseline = per_chunk(few);
    let many = per_chunk(few * 10);
    let ratio = many / baseline;
    println!(
        "chunk merge: {:.2} us a chunk over {} chunks, {:.2} us over {few} ({ratio:.2}x; target at most 2x, i.e. linear) {}",
        many * 1e6,
        few * 10,
        baseline * 1e6,
        verdict(ratio <= 2.0)
    );
}

// ------------------------------------------------------------------ store --

/// The flight recorder's footprint and window reads: mock events at 1 M
/// events/s stored as the collector stores them, against the same events
/// held as 128-byte records (the store's form before it was compacted).
fn bench_store(settings: &Settings) {
    println!("== 2b. flight recorder: bytes per stored event and window reads ==");
    let rate: u64 = 1_000_000;
    let count = if settings.quick { 500_000 } else { 2_000_000 };
    let registry = Registry::new();
    let config = MockConfig {
        events_per_second: rate,
        ..MockConfig::default()
    };
    // Recorded over the last seconds, so that the store keeps all of it.
    let start_ns = clock::now_ns() - count as u64 * 1_000_000_000 / rate - 1_000_000_000;
    let mut workload = Workload::new(&config, &registry, start_ns);
    let mut events = Vec::with_capacity(count + 64);
    while events.len() < count {
        workload.emit_next(&mut |e| events.push(e));
    }
    events.truncate(count);
    let store = Store::new(StoreConfig {
        retention: Duration::from_secs(600),
        max_bytes: usize::MAX,
    });
    let t = Instant::now();
    for chunk in events.chunks(1 << 16) {
        store.append(&mut chunk.to_vec());
    }
    let append = t.elapsed();
    let stats = store.stats();
    let per_event = stats.bytes as f64 / stats.events as f64;
    let baseline_per_event = std::mem::size_of::<Event>() as f64;
    let depth_s = (512u64 << 20) as f64 / (per_event * rate as f64);
    let baseline_depth_s = (512u64 << 20) as f64 / (baseline_per_event * rate as f64);
    println!(
        "store depth at 1 M events/s in 512 MiB: {depth_s:.1} s ({per_event:.1} bytes per stored event; {:.1}x the \
         uncompressed baseline: {baseline_depth_s:.1} s at {baseline_per_event:.0} bytes; target >= 20 s) {}",
        depth_s / baseline_depth_s,
        verdict(depth_s >= 20.0)
    );
    println!(
        "   {} events stored in {:.0} ms ({}/s of collector time to compact)",
        stats.events,
        ms(append),
        mega(stats.events as f64 / append.as_secs_f64())
    );

    let window = Window {
        start_ns,
        stop_ns: clock::now_ns(),
    };
    let snapshot = registry.snapshot();
    let info = CaptureInfo {
        window,
        hostname: "bench".into(),
        ..CaptureInfo::default()
    };
    let mut from_store = Vec::new();
    let mut from_records = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let data = store.query(window);
        let _ = black_box(encode_runs(data.runs(), &snapshot, &info, &mut Unlimited));
        from_store.push(ms(t.elapsed()));
        let t = Instant::now();
        black_box(encode_xspace(&events, &snapshot, &info));
        from_records.push(ms(t.elapsed()));
    }
    let (store_ms, records_ms) = (median(&mut from_store), median(&mut from_records));
    println!(
        "window read + XSpace of {count} events: {store_ms:.0} ms from the compact store ({:.2}x the same from \
         128-byte records: {records_ms:.0} ms; target <= 1.10x) {}",
        store_ms / records_ms,
        verdict(store_ms <= records_ms * 1.10)
    );
    // The path a capture takes: the window's chunks merged and encoded.
    let store_rate = count as f64 / (store_ms / 1e3);
    println!(
        "xspace build+encode from the flight recorder: {} events/s  ({:.2}x the target; target >= 10 M/s) {}",
        mega(store_rate),
        store_rate / 10e6,
        verdict(store_rate >= 10e6)
    );
    println!();
}

// ---------------------------------------------------------------- capture --

struct Capture {
    latency: Duration,
    events: usize,
    reply_bytes: usize,
    warnings: Vec<String>,
}

async fn capture_once(
    client: &mut ProfilerServiceClient<tonic::transport::Channel>,
    duration_ms: u64,
    session: &str,
) -> Capture {
    capture_at(client, clock::now_ns(), duration_ms, session).await
}

/// A capture of the window from `start_ns`, which may lie ahead.
async fn capture_at(
    client: &mut ProfilerServiceClient<tonic::transport::Channel>,
    start_ns: u64,
    duration_ms: u64,
    session: &str,
) -> Capture {
    let stop_ns = start_ns + duration_ms * 1_000_000;
    let request = ProfileRequest {
        duration_ms,
        max_events: 1_000_000,
        tools: vec![XPLANE_TOOL.to_string()],
        opts: Some(devtrace::protocol::client::default_profile_options(
            duration_ms,
            start_ns,
        )),
        session_id: session.to_string(),
        host_name: "bench".to_string(),
        ..ProfileRequest::default()
    };
    let reply = client.profile(request).await;
    let replied_ns = clock::now_ns();
    let reply = reply.expect("Profile failed").into_inner();
    let data = reply
        .tool_data
        .iter()
        .find(|t| t.name == XPLANE_TOOL)
        .map(|t| &t.data[..])
        .unwrap_or_default();
    let space = XSpace::decode(data).expect("reply is an XSpace");
    Capture {
        latency: Duration::from_nanos(replied_ns.saturating_sub(stop_ns)),
        events: count_events(&space),
        reply_bytes: data.len(),
        warnings: space.warnings,
    }
}

/// One capture done through the library instead of gRPC, timed by phase.
struct Phases {
    /// From the end of the window until the events are queryable: the
    /// agent's max_delay wait plus the collector flush and the store query.
    collect: Duration,
    /// Building and encoding the XSpace, one pass.
    encode: Duration,
    events: usize,
    bytes: usize,
}

async fn direct_capture(agent: &Agent, duration_ms: u64) -> Phases {
    let start_ns = clock::now_ns();
    let window = Window {
        start_ns,
        stop_ns: start_ns + duration_ms * 1_000_000,
    };
    tokio::time::sleep(clock::until(window.stop_ns)).await;
    let t = Instant::now();
    let (data, registry) = agent.collect(window, None).await.expect("collect");
    let collect = t.elapsed();
    let info = CaptureInfo {
        window,
        hostname: "bench".into(),
        dropped_newest: data.dropped_newest,
        dropped_oldest: data.dropped_oldest,
        ..CaptureInfo::default()
    };
    // Run on this (block_on) thread: it is not one of the runtime's workers.
    let t = Instant::now();
    let encoded = encode_runs(data.runs(), &registry, &info, &mut Unlimited)
        .unwrap_or_else(|never| match never {});
    let encode = t.elapsed();
    Phases {
        collect,
        encode,
        events: encoded.events,
        bytes: encoded.len(),
    }
}

fn bench_capture(settings: &Settings) {
    println!("== 3. capture latency (end of window -> Profile reply received; in-process agent, gRPC over loopback) ==");
    let rate: u64 = 1_000_000;
    let big_ms: u64 = if settings.quick { 200 } else { 1000 };
    let small_ms: u64 = 10;
    let (big_runs, small_runs) = if settings.quick { (1, 3) } else { (3, 5) };
    let server = InProcessAgent::start(rate);
    let (runtime, agent) = (&server.runtime, &server.agent);
    let (big, small, phases) = runtime.block_on(async {
        let mut client = server.client().await;
        capture_once(&mut client, small_ms, "warmup").await;
        let mut big = Vec::new();
        for i in 0..big_runs {
            big.push(capture_once(&mut client, big_ms, &format!("big{i}")).await);
        }
        let mut small = Vec::new();
        for i in 0..small_runs {
            small.push(capture_once(&mut client, small_ms, &format!("small{i}")).await);
        }
        let phases = vec![
            direct_capture(agent, big_ms).await,
            direct_capture(agent, small_ms).await,
        ];
        (big, small, phases)
    });
    let ring = agent.ring_stats();
    let max_delay = agent.max_delay();
    server.stop();

    let lat =
        |runs: &[Capture]| median(&mut runs.iter().map(|c| ms(c.latency)).collect::<Vec<_>>());
    let evs =
        |runs: &[Capture]| median(&mut runs.iter().map(|c| c.events as f64).collect::<Vec<_>>());
    let (big_lat, small_lat) = (lat(&big), lat(&small));
    let (big_events, small_events) = (evs(&big), evs(&small));
    println!(
        "capture latency {:.0}k-event window: {big_lat:.1} ms  ({:.1}x the {:.0}k-event window: {small_lat:.1} ms; \
         target <= 100 ms; TensorFlow's own server: ~850 ms for 300k events) {}",
        big_events / 1e3,
        big_lat / small_lat,
        small_events / 1e3,
        verdict(big_lat <= 100.0)
    );
    for (label, runs) in [("big", &big), ("small", &small)] {
        let detail: Vec<String> = runs
            .iter()
            .map(|c| {
                format!(
                    "{:.1} ms/{} ev/{:.1} MiB",
                    ms(c.latency),
                    c.events,
                    c.reply_bytes as f64 / (1 << 20) as f64
                )
            })
            .collect();
        println!(
            "   {label} ({} ms window) runs: {}",
            if label == "big" { big_ms } else { small_ms },
            detail.join(", ")
        );
    }
    let warnings: Vec<&String> = big.iter().chain(&small).flat_map(|c| &c.warnings).collect();
    println!(
        "   mock rate {rate}/s; agent ring: {} pushed, {} refused (drop-newest), {} overwritten{}",
        ring.pushed,
        ring.dropped_newest,
        ring.dropped_oldest,
        if warnings.is_empty() {
            "; no trace warnings".to_string()
        } else {
            format!("; trace warnings: {warnings:?}")
        }
    );
    println!(
        "   (includes the agent's fixed wait of max_delay = {:?} after the window, for late events)",
        max_delay
    );
    for p in &phases {
        println!(
            "   breakdown of a {}-event capture through the library (no gRPC): wait+flush+query {:.1} ms, \
             build+encode {:.1} ms ({:.1} MiB) = {:.1} ms",
            p.events,
            ms(p.collect),
            ms(p.encode),
            p.bytes as f64 / (1 << 20) as f64,
            ms(p.collect + p.encode)
        );
    }
    println!();
}

/// An agent and its gRPC service in this process, on a loopback port.
struct InProcessAgent {
    runtime: tokio::runtime::Runtime,
    agent: Arc<Agent>,
    address: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl InProcessAgent {
    /// Starts an agent recording the mock workload at `rate` events/s.
    fn start(rate: u64) -> InProcessAgent {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let config = AgentConfig {
            backends: vec![BackendChoice::Mock],
            mock: MockConfig {
                events_per_second: rate,
                ..MockConfig::default()
            },
            ..AgentConfig::default()
        };
        let agent = Agent::start(&config).expect("agent");
        let service = Arc::new(ProfilerService::new(
            Arc::clone(&agent),
            ServiceConfig {
                hostname: "bench".into(),
                ..ServiceConfig::default()
            },
        ));
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (address, server) = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let address = listener.local_addr().expect("address");
            let analysis = Arc::new(ProfileAnalysisService::new(AnalysisConfig::default()));
            let trigger = Arc::new(devtrace::service::trigger::TriggerService::new(
                None,
                devtrace::service::access::Access::default(),
            ));
            let server = tokio::spawn(devtrace::service::serve(
                listener,
                service,
                analysis,
                trigger,
                async {
                    let _ = stop_rx.await;
                },
            ));
            (address, server)
        });
        InProcessAgent {
            runtime,
            agent,
            address,
            stop,
            server,
        }
    }

    /// A client of the agent, once its workload has reached steady state.
    async fn client(&self) -> ProfilerServiceClient<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.address))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        tokio::time::sleep(Duration::from_millis(300)).await;
        ProfilerServiceClient::new(channel)
            .max_decoding_message_size(MAX_REPLY_BYTES)
            .max_encoding_message_size(MAX_REPLY_BYTES)
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.runtime.block_on(self.server);
        self.agent.shutdown();
    }
}

/// A line of /proc/PID/status in bytes (`VmRSS`, `VmHWM`).
fn process_memory(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with(field))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib << 10)
}

/// The real `devtrace serve` recording the mock workload at `rate`
/// events/s, and the address it listens on; killed when dropped.
struct AgentBinary {
    child: std::process::Child,
    address: String,
}

impl AgentBinary {
    fn start(rate: u64) -> AgentBinary {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_devtrace"))
            .args(["serve", "--listen", "127.0.0.1:0", "--log-level", "warn"])
            .args(["--metrics-listen", "off", "--backend", "mock"])
            .args(["--mock-rate", &rate.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting devtrace serve");
        // Its first line is `devtrace listening on ADDRESS`.
        let first = std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .lines()
            .next()
            .and_then(Result::ok)
            .unwrap_or_default();
        let address = first.rsplit(' ').next().unwrap_or_default().to_string();
        AgentBinary { child, address }
    }
}

impl Drop for AgentBinary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One of many concurrent captures: when its reply came, and its trace
/// (compared by the caller with the first: cheaper than hashing 32 traces
/// alongside the agent).
async fn fanned_capture(
    mut client: ProfilerServiceClient<tonic::transport::Channel>,
    start_ns: u64,
    duration_ms: u64,
    session: String,
) -> (Duration, bytes::Bytes) {
    let mut request = ProfileRequest {
        duration_ms,
        opts: Some(devtrace::protocol::client::default_profile_options(
            duration_ms,
            start_ns,
        )),
        session_id: session,
        host_name: "bench".to_string(),
        ..ProfileRequest::default()
    };
    request.tools.push(XPLANE_TOOL.to_string());
    let reply = client.profile(request).await;
    let replied_ns = clock::now_ns();
    let reply = reply.expect("Profile failed").into_inner();
    let trace = reply
        .tool_data
        .into_iter()
        .next()
        .map(|tool| tool.data)
        .unwrap_or_default();
    let stop_ns = start_ns + duration_ms * 1_000_000;
    (
        Duration::from_nanos(replied_ns.saturating_sub(stop_ns)),
        trace,
    )
}

fn bench_concurrent(settings: &Settings) {
    const CAPTURES: usize = 32;
    let rate: u64 = 1_000_000;
    let window_ms: u64 = if settings.quick { 500 } else { 2000 };
    println!(
        "== 3b. {CAPTURES} concurrent captures of one {window_ms} ms window at {} events/s (devtrace serve, gRPC over loopback) ==",
        mega(rate as f64)
    );
    let agent = AgentBinary::start(rate);
    let pid = agent.child.id();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (alone, (rss_before_alone, alone_peak), together, rss_before, rss_peak) =
        runtime.block_on(async {
            let channel =
                tonic::transport::Endpoint::from_shared(format!("http://{}", agent.address))
                    .expect("endpoint")
                    .connect()
                    .await
                    .expect("connect");
            let client = ProfilerServiceClient::new(channel)
                .max_decoding_message_size(MAX_REPLY_BYTES)
                .max_encoding_message_size(MAX_REPLY_BYTES);
            // Let the workload fill the flight recorder's first seconds.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            // Peak RSS from each point on: writing 5 to clear_refs resets VmHWM.
            let reset_peak = || std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
            let rss_before_alone = process_memory(pid, "VmRSS:");
            let _ = reset_peak();
            let alone = capture_once(&mut client.clone(), window_ms, "alone").await;
            let alone_peak = process_memory(pid, "VmHWM:");
            let rss_before = process_memory(pid, "VmRSS:");
            let _ = reset_peak();
            let start_ns = clock::now_ns() + 200_000_000;
            let mut calls = tokio::task::JoinSet::new();
            for i in 0..CAPTURES {
                calls.spawn(fanned_capture(
                    client.clone(),
                    start_ns,
                    window_ms,
                    format!("fanned{i}"),
                ));
            }
            // Each trace is compared with the first as it comes and
            // dropped, so that this process holds two at most.
            let mut together = Vec::new();
            let mut first: Option<bytes::Bytes> = None;
            while let Some(joined) = calls.join_next().await {
                let (latency, trace) = joined.expect("capture task");
                let same = first.get_or_insert_with(|| trace.clone()) == &trace;
                together.push((latency, same));
            }
            let rss_peak = process_memory(pid, "VmHWM:");
            (
                alone,
                (rss_before_alone, alone_peak),
                together,
                rss_before,
                rss_peak,
            )
        });
    drop(agent);
    let slowest = together
        .iter()
        .map(|(latency, _)| *latency)
        .max()
        .unwrap_or_default();
    let ratio = ms(slowest) / ms(alone.latency).max(1e-3);
    println!(
        "{CAPTURES} concurrent captures: slowest reply {:.1} ms after the window ({ratio:.1}x one capture alone: {:.1} ms; target <= 2x) {}",
        ms(slowest),
        ms(alone.latency),
        verdict(ratio <= 2.0)
    );
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    let trace = alone.reply_bytes as u64;
    let target = rss_before + 2 * trace;
    println!(
        "   agent peak RSS during them {:.1} MiB (its RSS before them, flight recorder included, {:.1} MiB \
         plus 2x one trace of {:.1} MiB: {:.1} MiB; target <= that) {}",
        mib(rss_peak),
        mib(rss_before),
        mib(trace),
        mib(target),
        verdict(rss_peak <= target)
    );
    println!(
        "   for comparison, one capture alone peaked at {:.1} MiB from {:.1} MiB (building a \
         trace decodes its window's events)",
        mib(alone_peak),
        mib(rss_before_alone)
    );
    let differing = together.iter().filter(|(_, same)| !same).count();
    println!(
        "   {differing} of the {CAPTURES} replies differ from the first (none expected: they share one build)"
    );
    println!();
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is ignored.
    let settings = Settings::from_env();
    println!(
        "devtrace bench ({} mode){}",
        if settings.quick { "quick" } else { "full" },
        std::fs::read_to_string("/proc/loadavg")
            .map(|l| format!(
                ", load average at start: {}",
                l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
            ))
            .unwrap_or_default()
    );
    println!();
    if settings.wants("ring") {
        bench_ring(&settings);
    }
    if settings.wants("xspace") {
        bench_xspace(&settings);
    }
    if settings.wants("store") {
        bench_store(&settings);
    }
    if settings.wants("capture") {
        bench_capture(&settings);
    }
    if settings.wants("concurrent") {
        bench_concurrent(&settings);
    }
    if settings.wants("tap") {
        bench_tap(&settings);
    }
}

// ------------------------------------------------------------------- tap --

type TapBenchBody = http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>;

/// An in-process gRPC-shaped echo upstream: the request's data frames come
/// back as they arrive, then `grpc-status: 0` trailers.
async fn tap_bench_upstream() -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |request: http::Request<hyper::body::Incoming>| async move {
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                        let body = request
                            .into_body()
                            .with_trailers(async move { Some(Ok(trailers)) })
                            .boxed();
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .header("content-type", "application/grpc")
                                .body(body)
                                .unwrap(),
                        )
                    },
                );
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .adaptive_window(true)
                        .max_frame_size(1 << 20)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    address
}

async fn tap_bench_client(
    address: std::net::SocketAddr,
) -> hyper::client::conn::http2::SendRequest<TapBenchBody> {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .adaptive_window(true)
            .max_frame_size(1 << 20)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

/// One unary call: sends `message`, reads the echo and the trailers.
async fn tap_bench_call(
    sender: &mut hyper::client::conn::http2::SendRequest<TapBenchBody>,
    path: &str,
    message: bytes::Bytes,
) -> usize {
    use http_body_util::BodyExt;
    let body = http_body_util::Full::new(message)
        .map_err(|never| match never {})
        .boxed();
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://bench{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let collected = response.into_body().collect().await.unwrap();
    assert!(collected.trailers().is_some(), "trailers");
    collected.to_bytes().len()
}

fn grpc_framed(body: &[u8]) -> bytes::Bytes {
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    bytes::Bytes::from(out)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// The least any HTTP/2 proxy does: a hyper server whose calls a hyper
/// client sends on, bodies passed through untouched, with the tap's window
/// and frame settings and nothing recorded. What the tap adds beyond it is
/// the tap's own cost; what this adds to a direct connection is the hop's.
async fn bare_forwarder(upstream: std::net::SocketAddr) -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    type Body = http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>;
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    let client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .http2_initial_stream_window_size(Some(8 << 20))
            .http2_initial_connection_window_size(Some(32 << 20))
            .http2_max_frame_size(Some(1 << 20))
            .build(connector);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let client = client.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let client = client.clone();
                        async move {
                            let (mut parts, body) = request.into_parts();
                            parts.uri = format!("http://{upstream}{}", parts.uri.path())
                                .parse()
                                .unwrap();
                            let response = client
                                .request(http::Request::from_parts(parts, body.boxed()))
                                .await
                                .unwrap();
                            Ok::<_, std::convert::Infallible>(response.map(|body| body.boxed()))
                        }
                    },
                );
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .initial_stream_window_size(8 << 20)
                        .initial_connection_window_size(32 << 20)
                        .max_frame_size(1 << 20)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    address
}

fn bench_tap(settings: &Settings) {
    println!("== tap: added latency and throughput of the gRPC tap vs a direct connection ==");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let upstream = tap_bench_upstream().await;
        let registry = Registry::new();
        let ring = Ring::new(1, 1 << 16, DropPolicy::DropNewest).unwrap();
        let recorder = devtrace::tap::Recorder::new(Arc::clone(&registry), ring.producer().unwrap());
        let mut consumer = ring.consumer().unwrap();
        let tap = devtrace::tap::Tap::bind("127.0.0.1:0", &upstream.to_string(), Arc::clone(&recorder))
            .await
            .unwrap();
        let tap_address = tap.local_addr().unwrap();
        tokio::spawn(tap.run(std::future::pending()));
        let bare = bare_forwarder(upstream).await;
        // Keep the ring drained as the collector would.
        tokio::spawn(async move {
            let mut sink = Vec::new();
            loop {
                sink.clear();
                consumer.drain(&mut sink, usize::MAX);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        let routes = [("direct", upstream), ("bare proxy", bare), ("tap", tap_address)];

        // A RunStep-sized unary call, sequential.
        let run_step = devtrace::tap::decode::RunStepRequest {
            session_handle: "bench-session".into(),
            fetch: vec!["loss:0".into()],
            target: vec!["train".into()],
            ..Default::default()
        };
        let small = grpc_framed(&run_step.encode_to_vec());
        let calls = if settings.quick { 300 } else { 3000 };
        let path = "/tensorflow.MasterService/RunStep";
        let mut latency = Vec::new();
        for (label, address) in routes {
            let mut sender = tap_bench_client(address).await;
            for _ in 0..calls / 10 {
                tap_bench_call(&mut sender, path, small.clone()).await;
            }
            let mut latencies = Vec::with_capacity(calls);
            for _ in 0..calls {
                let t0 = Instant::now();
                tap_bench_call(&mut sender, path, small.clone()).await;
                latencies.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            latencies.sort_by(|a, b| a.total_cmp(b));
            let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
            println!(
                "   unary RunStep ({} bytes), {calls} sequential calls, {label:>10}: p50 {p50:.0} us, p99 {p99:.0} us",
                small.len()
            );
            latency.push((p50, p99));
        }
        let [direct, bare, tapped] = [latency[0], latency[1], latency[2]];
        let (added_p50, added_p99) = (tapped.0 - direct.0, tapped.1 - direct.1);
        println!(
            "   added by the tap: p50 {added_p50:+.0} us ({:.2}x direct; target at most +50 us: {}), \
             p99 {added_p99:+.0} us (target at most +200 us: {})",
            tapped.0 / direct.0,
            verdict(added_p50 <= 50.0),
            verdict(added_p99 <= 200.0)
        );
        println!(
            "   of which the HTTP/2 hop itself (bare proxy): p50 {:+.0} us, p99 {:+.0} us; \
             the tap's own recording: p50 {:+.0} us, p99 {:+.0} us",
            bare.0 - direct.0,
            bare.1 - direct.1,
            tapped.0 - bare.0,
            tapped.1 - bare.1
        );

        // Large tensors: 6 MiB messages, echoed, on a decoded method (its
        // frames are held to be decoded off the forwarding path) and on an
        // opaque one (RecvTensor: counted, never held).
        let size = 6 << 20;
        let rounds = if settings.quick { 4 } else { 24 };
        let big = grpc_framed(&vec![7u8; size]);
        for path in [path, "/tensorflow.WorkerService/RecvTensor"] {
            let mut rates = Vec::new();
            for (label, address) in routes {
                let mut sender = tap_bench_client(address).await;
                tap_bench_call(&mut sender, path, big.clone()).await;
                let t0 = Instant::now();
                let mut moved = 0usize;
                for _ in 0..rounds {
                    moved += big.len() + tap_bench_call(&mut sender, path, big.clone()).await;
                }
                let rate = moved as f64 / t0.elapsed().as_secs_f64() / (1 << 20) as f64;
                println!(
                    "   {rounds} x {} MiB echoed on {path}, {label:>10}: {rate:.0} MiB/s",
                    size >> 20
                );
                rates.push(rate);
            }
            println!(
                "   tap throughput is {:.2}x direct (target at least 0.9x: {}); the bare proxy's {:.2}x, \
                 so the tap moves {:.2}x what the hop alone does",
                rates[2] / rates[0],
                verdict(rates[2] / rates[0] >= 0.9),
                rates[1] / rates[0],
                rates[2] / rates[1]
            );
        }
        // The echo sends each request back as its response, which does not
        // parse as one: every call has an undecoded message here.
        println!("   tap stats (responses are echoed requests, so undecoded): {:?}", recorder.stats());
    });
    println!(
        "   note: client, upstream and proxy share this machine's cores; every byte through a proxy is read \
         and written once more, so on {} cores the hop alone takes what the bare proxy row shows",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
}
