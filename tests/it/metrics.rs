//! Health and metrics of the real agent: `/metrics` checked against what
//! the agent reports through captures and Monitor, the NVML stand-in's
//! values as GPU series, `/healthz` and `/readyz`, the gRPC health service
//! through tonic-health's client on each kind of listener and through a
//! shutdown, and a real Prometheus server scraping the agent.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn scrape(metrics: &str) -> String {
    let (status, text) = http_get(metrics, "/metrics");
    assert_eq!(status, 200, "{text}");
    assert!(
        text.ends_with("# EOF\n"),
        "an OpenMetrics exposition: {text}"
    );
    text
}

async fn plain_channel(address: &str) -> Channel {
    Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .expect("connecting to the agent")
}

async fn unix_channel(socket: &Path) -> Channel {
    Endpoint::from_shared(format!("unix:{}", socket.display()))
        .unwrap()
        .connect()
        .await
        .expect("connecting to the agent's socket")
}

async fn health(channel: Channel, service: &str) -> Result<i32, tonic::Status> {
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|reply| reply.into_inner().status)
}

const SERVING: i32 = ServingStatus::Serving as i32;
const NOT_SERVING: i32 = ServingStatus::NotServing as i32;
const SERVICES: [&str; 3] = [
    "",
    "tensorflow.ProfilerService",
    "tensorflow.ProfileAnalysis",
];

/// A call whose deadline (`grpc-timeout`) passes before its reply is
/// answered DEADLINE_EXCEEDED, and counted so (it was answered CANCELLED,
/// which the metrics keep for a client that went away).
#[tokio::test]
async fn a_passed_deadline_is_deadline_exceeded() {
    use common::raw_call::unary_with_headers;
    let (agent, metrics) = AgentProcess::start_with_metrics(&[], &[]);
    let io = tokio::net::TcpStream::connect(&agent.address)
        .await
        .unwrap();
    // A monitoring window of 5 s, asked with a deadline of 1 s.
    let (_, status) = unary_with_headers(
        io,
        &agent.address,
        "/tensorflow.ProfilerService/Monitor",
        &devtrace::proto::tensorflow::MonitorRequest {
            duration_ms: 5000,
            ..Default::default()
        },
        &[("grpc-timeout", "1S")],
    )
    .await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("deadline"), "{status:?}");
    let text = scrape(&metrics);
    let calls = |code| {
        metric_value(
            &text,
            "devtrace_rpcs_total",
            &[("rpc", "Monitor"), ("code", code)],
        )
    };
    assert_eq!(calls("DEADLINE_EXCEEDED"), Some(1.0), "{text}");
    assert_eq!(calls("CANCELLED"), None, "{text}");
}

#[tokio::test]
async fn metrics_count_what_the_agent_did() {
    let (agent, metrics) = AgentProcess::start_with_metrics(&["--mock-rate", "20000"], &[]);
    let mut client = agent.client().await;
    let mut captured = 0;
    for session in ["first", "second"] {
        let reply = client
            .profile(request(300, session))
            .await
            .unwrap()
            .into_inner();
        captured += event_count(&space_of(&reply));
    }
    assert!(captured > 0);
    let refused = client.profile(request(300, "a/b")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let monitor = agent.monitor(100).await.data;
    // Health checks are no profiler calls and never become labels.
    let channel = plain_channel(&agent.address).await;
    assert_eq!(health(channel, "").await.unwrap(), SERVING);

    let text = scrape(&metrics);
    let calls = |rpc, code| {
        metric_value(
            &text,
            "devtrace_rpcs_total",
            &[("rpc", rpc), ("code", code)],
        )
    };
    assert_eq!(calls("Profile", "OK"), Some(2.0), "{text}");
    assert_eq!(calls("Profile", "INVALID_ARGUMENT"), Some(1.0));
    assert_eq!(calls("Monitor", "OK"), Some(1.0));
    assert!(!text.contains("rpc=\"Check\""), "{text}");
    let profile = [("rpc", "Profile")];
    assert_eq!(
        metric_value(&text, "devtrace_rpc_duration_seconds_count", &profile),
        Some(3.0)
    );
    // Only the captures that delivered have a latency.
    assert_eq!(
        metric_value(&text, "devtrace_capture_latency_seconds_count", &profile),
        Some(2.0)
    );

    let mock = [("backend", "mock")];
    let ingested = metric_value(&text, "devtrace_events_ingested_total", &mock).unwrap();
    assert!(ingested >= captured as f64, "{ingested} < {captured}");
    let held = metric_value(&text, "devtrace_flight_recorder_events", &[]).unwrap();
    // Monitor counted the recorder's events before this scrape; nothing has
    // aged out since (120 s retention).
    let monitored: f64 = monitor
        .lines()
        .find_map(|l| l.strip_prefix("flight recorder: "))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no flight recorder line in {monitor}"));
    assert!(
        monitored <= held && held <= ingested,
        "{monitored} {held} {ingested}"
    );
    assert!(metric_value(&text, "devtrace_flight_recorder_bytes", &[]).unwrap() > 0.0);
    assert!(metric_value(&text, "devtrace_flight_recorder_seconds", &[]).unwrap() > 0.0);
    assert_eq!(
        metric_value(&text, "devtrace_flight_recorder_limit_bytes", &[]),
        Some((512u64 << 20) as f64)
    );
    assert_eq!(
        metric_value(&text, "devtrace_flight_recorder_retention_seconds", &[]),
        Some(120.0)
    );

    assert!(monitor.contains("backend mock: running"), "{monitor}");
    let state = |state| {
        metric_value(
            &text,
            "devtrace_backend_health",
            &[("backend", "mock"), ("state", state)],
        )
    };
    assert_eq!(
        (state("running"), state("stopped"), state("failed")),
        (Some(1.0), Some(0.0), Some(0.0))
    );
    for place in ["misdated", "name_table"] {
        assert_eq!(
            metric_value(
                &text,
                "devtrace_events_dropped_total",
                &[("backend", "agent"), ("place", place)]
            ),
            Some(0.0),
            "{place}"
        );
    }

    assert_eq!(http_get(&metrics, "/healthz"), (200, "ok\n".to_string()));
    let (status, ready) = http_get(&metrics, "/readyz");
    assert_eq!(status, 200);
    assert!(
        ready.starts_with("ready\n") && ready.contains("backend mock: running"),
        "{ready}"
    );
    assert_eq!(http_get(&metrics, "/other").0, 404);
}

#[tokio::test]
async fn ring_drops_count_for_the_backend_that_made_them() {
    let (agent, metrics) = AgentProcess::start_with_metrics(
        &[
            "--ring-capacity",
            "16",
            "--mock-rate",
            "500000",
            "--drop-policy",
            "drop-oldest",
        ],
        &[],
    );
    let space = space_of(&agent.profile(request(300, "flood")).await);
    let dropped = dropped_of(&space);
    assert!(dropped > 0, "a 16-slot ring at 500k events/s must overflow");
    let text = scrape(&metrics);
    let counted = metric_value(
        &text,
        "devtrace_events_dropped_total",
        &[("backend", "mock"), ("place", "agent_ring")],
    )
    .unwrap();
    assert!(counted >= dropped as f64, "{counted} < {dropped}");
}

#[tokio::test]
async fn the_health_service_answers_on_tcp_and_unix_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = AgentProcess::start(&[
        "--listen-unix",
        socket.to_str().unwrap(),
        "--mock-rate",
        "0",
    ]);
    for channel in [
        plain_channel(&agent.address).await,
        unix_channel(&socket).await,
    ] {
        for service in SERVICES {
            assert_eq!(
                health(channel.clone(), service).await.unwrap(),
                SERVING,
                "{service:?}"
            );
        }
        let unknown = health(channel, "tensorflow.Unknown").await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
    }
}

#[tokio::test]
async fn shutting_down_turns_not_serving_and_ends_health_watches() {
    let (mut agent, metrics) = AgentProcess::start_with_metrics(&["--mock-rate", "1000"], &[]);
    let mut watch = HealthClient::new(plain_channel(&agent.address).await)
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(watch.next().await.unwrap().unwrap().status, SERVING);

    // A capture in flight keeps the server draining after the signal.
    let mut client = agent.client().await;
    let capture = tokio::spawn(async move { client.profile(request(3000, "draining")).await });
    loop {
        let monitor = agent.monitor(1).await.data;
        if monitor.contains("captures in progress: 1") {
            break;
        }
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(agent.pid() as libc::pid_t, libc::SIGTERM) };

    // A minute is only a guard: both arrive as soon as the signal does.
    let guard = Duration::from_secs(60);
    let last = tokio::time::timeout(guard, watch.next())
        .await
        .expect("NOT_SERVING is sent");
    assert_eq!(last.unwrap().unwrap().status, NOT_SERVING);
    let end = tokio::time::timeout(guard, watch.next())
        .await
        .expect("the watch ends, or it would hold the shutdown");
    assert!(end.is_none(), "{end:?}");
    let (status, reason) = http_get(&metrics, "/readyz");
    assert_eq!(
        (status, reason.as_str()),
        (503, "shutting down: the gRPC server accepts no new calls\n")
    );
    assert_eq!(http_get(&metrics, "/healthz").0, 200);

    let delivered = capture
        .await
        .unwrap()
        .expect("the capture in flight delivers");
    assert!(!delivered.into_inner().empty_trace);
    assert!(
        agent.stop_with_sigterm(Duration::from_secs(30)).is_some(),
        "the agent exits once its last call is done"
    );
}

fn nvml_standin() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| build_standin("nvml.c", "libnvidia-ml.so.1"))
}

/// The stand-in's UUID of GPU `index` (tests/standins/standin_call.h).
fn standin_uuid(index: u8) -> String {
    format!("GPU-5e7a4d1b-0000-4000-8000-0000000000{index:02x}")
}

const NVML_SETTINGS: &str = "gpus=2\nutil_gpu=40\nutil_mem=9\nmem_total=85899345920\n\
                             mem_used=2147483648\npower_mw=312500\ntemp_c=58\nsm_clock=1410\n\
                             mem_clock=1215\n";

/// An agent on the NVML stand-in (and the mock) with its metrics endpoint.
fn gpu_agent(control: &Path) -> (AgentProcess, String) {
    std::fs::write(control, NVML_SETTINGS).unwrap();
    let library = nvml_standin().to_str().unwrap().to_string();
    AgentProcess::start_with_metrics(
        &[
            "--nvml-library",
            &library,
            "--backend",
            "nvml",
            "--backend",
            "mock",
            "--nvml-idle-interval=100ms",
            "--mock-rate=1000",
        ],
        &[("DEVTRACE_NVML_STANDIN", control)],
    )
}

/// Scrapes until `done` holds for the exposition (the sampler publishes
/// after each round), at most for a minute.
fn scrape_until(metrics: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
    let started = Instant::now();
    loop {
        let text = scrape(metrics);
        if done(&text) {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{what}, never seen in:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn gpu_series_carry_the_nvml_readings_and_vanish_with_a_lost_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("nvml.ctl");
    let (_agent, metrics) = gpu_agent(&control);
    let gpu = |index: u8| {
        let uuid = standin_uuid(index);
        move |text: &str, name: &str| {
            metric_value(
                text,
                name,
                &[("gpu", index.to_string().as_str()), ("uuid", uuid.as_str())],
            )
        }
    };
    // The readings are published as a round is taken, its events counted
    // as they reach the ring: both are waited for.
    let text = scrape_until(&metrics, "both GPUs' readings and their events", |text| {
        gpu(1)(text, "devtrace_gpu_memory_clock_hertz").is_some()
            && metric_value(
                text,
                "devtrace_events_ingested_total",
                &[("backend", "nvml")],
            )
            .is_some_and(|count| count > 0.0)
    });
    for index in 0..2 {
        let of = gpu(index);
        assert_eq!(of(&text, "devtrace_gpu_utilization_percent"), Some(40.0));
        assert_eq!(
            of(&text, "devtrace_gpu_memory_copy_utilization_percent"),
            Some(9.0)
        );
        assert_eq!(
            of(&text, "devtrace_gpu_memory_used_bytes"),
            Some(2147483648.0)
        );
        assert_eq!(
            of(&text, "devtrace_gpu_memory_total_bytes"),
            Some(85899345920.0)
        );
        assert_eq!(of(&text, "devtrace_gpu_power_usage_watts"), Some(312.5));
        assert_eq!(of(&text, "devtrace_gpu_temperature_celsius"), Some(58.0));
        assert_eq!(of(&text, "devtrace_gpu_sm_clock_hertz"), Some(1410e6));
        assert_eq!(of(&text, "devtrace_gpu_memory_clock_hertz"), Some(1215e6));
    }
    assert_eq!(
        metric_value(
            &text,
            "devtrace_backend_health",
            &[("backend", "nvml"), ("state", "running")]
        ),
        Some(1.0)
    );

    // New values show up; a GPU that falls off the bus leaves no stale
    // series behind.
    std::fs::write(&control, format!("{NVML_SETTINGS}temp_c=77\nlost_gpu=1\n")).unwrap();
    let text = scrape_until(&metrics, "GPU 0 at 77 C and GPU 1 gone", |text| {
        gpu(0)(text, "devtrace_gpu_temperature_celsius") == Some(77.0)
            && !text.contains(&standin_uuid(1))
    });
    assert_eq!(gpu(0)(&text, "devtrace_gpu_power_usage_watts"), Some(312.5));
}

/// A Prometheus server of our own, on a free port, scraping `target` every
/// second; killed when dropped.
struct Prometheus {
    child: Child,
    address: String,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Whether the test can run: the binary is there, or it is missing and
    /// DEVTRACE_SKIP_PROMETHEUS=1 says to skip (anything else fails).
    fn available() -> bool {
        let found = Command::new("prometheus")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !found {
            if std::env::var("DEVTRACE_SKIP_PROMETHEUS").as_deref() == Ok("1") {
                eprintln!("skipped: no prometheus binary and DEVTRACE_SKIP_PROMETHEUS=1");
                return false;
            }
            panic!(
                "the prometheus binary is not on PATH: .ci/run installs it (apt-get install \
                 prometheus); set DEVTRACE_SKIP_PROMETHEUS=1 to skip this test"
            );
        }
        true
    }

    fn start(target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: devtrace\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        // Its own port, whatever a system Prometheus (9090) is doing.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting prometheus");
        Prometheus {
            child,
            address,
            dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The samples of an instant query, as (labels, value).
    fn query(&mut self, query: &str) -> Vec<(serde_json::Value, f64)> {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("prometheus exited with {status}:\n{}", self.log());
        }
        let encoded: String = query
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let path = format!("/api/v1/query?query={encoded}");
        let Ok((200, body)) = try_http_get(&self.address, &path) else {
            // Not listening, or not ready, yet.
            return Vec::new();
        };
        let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(reply["status"], "success", "{body}");
        reply["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|sample| {
                let value = sample["value"][1].as_str().unwrap().parse().unwrap();
                (sample["metric"].clone(), value)
            })
            .collect()
    }

    /// Queries until the result has samples, at most for a minute.
    fn query_until_present(&mut self, query: &str) -> Vec<(serde_json::Value, f64)> {
        let started = Instant::now();
        loop {
            let samples = self.query(query);
            if !samples.is_empty() {
                return samples;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{query}: no samples; prometheus log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

#[tokio::test]
async fn a_real_prometheus_scrapes_the_values_the_agent_reports() {
    if !Prometheus::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("nvml.ctl");
    let (agent, metrics) = gpu_agent(&control);
    for session in ["one", "two"] {
        agent.profile(request(200, session)).await;
    }
    let before = scrape(&metrics);
    let mut prometheus = Prometheus::start(&metrics);
    // Three scrapes, so that what it stored is what it saw each time.
    let scrapes = "count_over_time(up{job=\"devtrace\"}[1m]) >= 3";
    prometheus.query_until_present(scrapes);
    assert_eq!(
        prometheus.query("up{job=\"devtrace\"}")[0].1,
        1.0,
        "the scrapes succeeded; prometheus log:\n{}",
        prometheus.log()
    );
    let after = scrape(&metrics);

    // Counters of what the test did, unchanged since.
    let captures = "devtrace_rpcs_total{rpc=\"Profile\",code=\"OK\"}";
    let samples = prometheus.query(&format!("max_over_time({captures}[1m])"));
    assert_eq!(samples.len(), 1);
    assert_eq!(samples[0].1, 2.0);
    let own = [("rpc", "Profile"), ("code", "OK")];
    assert_eq!(
        metric_value(&before, "devtrace_rpcs_total", &own),
        Some(2.0)
    );
    assert_eq!(metric_value(&after, "devtrace_rpcs_total", &own), Some(2.0));

    // Counters that keep growing: what Prometheus holds lies between the
    // agent's own readings around its scrapes.
    let mock = [("backend", "mock")];
    let ingested = prometheus.query("devtrace_events_ingested_total{backend=\"mock\"}");
    let low = metric_value(&before, "devtrace_events_ingested_total", &mock).unwrap();
    let high = metric_value(&after, "devtrace_events_ingested_total", &mock).unwrap();
    assert!(
        low <= ingested[0].1 && ingested[0].1 <= high,
        "{low} {} {high}",
        ingested[0].1
    );

    // Gauges of each GPU, with their labels.
    for (name, expected) in [
        ("devtrace_gpu_utilization_percent", 40.0),
        ("devtrace_gpu_power_usage_watts", 312.5),
        ("devtrace_gpu_memory_total_bytes", 85899345920.0),
        ("devtrace_gpu_sm_clock_hertz", 1410e6),
    ] {
        let samples = prometheus.query_until_present(name);
        assert_eq!(samples.len(), 2, "{name}: {samples:?}");
        for (labels, value_seen) in samples {
            let index: u8 = labels["gpu"].as_str().unwrap().parse().unwrap();
            assert_eq!(labels["uuid"], standin_uuid(index), "{name}");
            assert_eq!(value_seen, expected, "{name}");
            let own = [("gpu", index.to_string()), ("uuid", standin_uuid(index))];
            let own: Vec<(&str, &str)> = own.iter().map(|(k, v)| (*k, v.as_str())).collect();
            assert_eq!(metric_value(&after, name, &own), Some(value_seen), "{name}");
        }
    }
    let health = prometheus.query("devtrace_backend_health{backend=\"nvml\",state=\"running\"}");
    assert_eq!(health[0].1, 1.0);
}
