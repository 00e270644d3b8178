//! The NVML backend against a stand-in `libnvidia-ml.so` built from
//! `tests/standins/nvml.c` with the real NVML C ABI: counters and device
//! stats in the trace, Monitor's summary, unsupported metrics, XID errors
//! (and drivers without them), a GPU that falls off the bus, and a machine
//! without NVML.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::xspace::read::{event_name, find_stat, StatValue};

/// Builds the stand-in library once per test run.
fn standin() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| build_standin("nvml.c", "libnvidia-ml.so.1"))
}

struct Gpu {
    _dir: tempfile::TempDir,
    control: PathBuf,
    agent: AgentProcess,
}

/// The stand-in built without its event functions, like a driver that
/// predates them.
fn standin_without_events() -> PathBuf {
    build_program(
        "nvml.c",
        "libnvidia-ml-without-events.so.1",
        &["-shared", "-fPIC", "-DSTANDIN_WITHOUT_EVENTS"],
    )
}

fn agent_with(settings: &str) -> Gpu {
    agent_on(standin(), settings)
}

fn agent_on(library: &Path, settings: &str) -> Gpu {
    agent_told(
        library,
        settings,
        &["--backend", "nvml", "--nvml-interval", "5ms"],
    )
}

/// An agent with `flags` and `--nvml-library library`, the stand-in there
/// told `settings`.
fn agent_told(library: &Path, settings: &str, flags: &[&str]) -> Gpu {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("nvml.ctl");
    std::fs::write(&control, settings).unwrap();
    let library = library.to_str().unwrap();
    let agent = AgentProcess::start_with_env(
        &[flags, &["--nvml-library", library]].concat(),
        &[("DEVTRACE_NVML_STANDIN", control.as_path())],
    );
    Gpu {
        _dir: dir,
        control,
        agent,
    }
}

async fn capture(agent: &AgentProcess, ms: u64) -> XSpace {
    let reply = agent
        .client()
        .await
        .profile(request(ms, "nvml"))
        .await
        .unwrap()
        .into_inner();
    space_of(&reply)
}

/// (name, value) of every counter sample on a GPU plane.
fn counters(space: &XSpace, gpu: u16) -> Vec<(String, f64)> {
    let plane = plane(space, &format!("/device:GPU:{gpu}"));
    let line = plane
        .lines
        .iter()
        .find(|l| l.name == "_counters_")
        .expect("a _counters_ line");
    line.events
        .iter()
        .map(|e| {
            let value = match find_stat(plane, &e.stats, "value") {
                Some(StatValue::Double(v)) => v,
                other => panic!("counter value {other:?}"),
            };
            (event_name(plane, e).to_string(), value)
        })
        .collect()
}

#[tokio::test]
async fn samples_become_counters_and_device_facts_become_plane_stats() {
    let gpu = agent_with(
        "gpus=2\nutil_gpu=40\nutil_mem=9\nmem_used=2147483648\npower_mw=312500\ntemp_c=58\n",
    );
    let space = capture(&gpu.agent, 300).await;
    for ordinal in 0..2 {
        let samples = counters(&space, ordinal);
        let value_of = |name: &str| {
            let values = values_of(&samples, name);
            assert!(
                values.len() >= 10,
                "{name}: {} samples in 300 ms at 5 ms",
                values.len()
            );
            values[0]
        };
        assert_eq!(value_of("SM utilization (%)"), 40.0);
        assert_eq!(value_of("Memory utilization (%)"), 9.0);
        assert_eq!(value_of("Memory used (bytes)"), 2147483648.0);
        assert_eq!(value_of("Power (W)"), 312.5);
        assert_eq!(value_of("Temperature (C)"), 58.0);
        assert_eq!(value_of("SM clock (MHz)"), 1410.0);
        // GPM metrics (Hopper and newer) over each interval.
        assert_eq!(value_of("GPM SM occupancy (%)"), 30.0);
        assert_eq!(value_of("GPM tensor activity (%)"), 20.0);
        assert_eq!(value_of("GPM DRAM bandwidth utilization (%)"), 40.0);
        let p = plane(&space, &format!("/device:GPU:{ordinal}"));
        let stat = |name| find_stat(p, &p.stats, name);
        assert_eq!(
            stat("gpu_device_name"),
            Some(StatValue::Str(format!("NVIDIA Stand-in H100 #{ordinal}")))
        );
        assert_eq!(stat("compute_cap_major"), Some(StatValue::Int(9)));
        assert_eq!(stat("core_count"), Some(StatValue::Int(132)));
        assert_eq!(stat("clock_rate"), Some(StatValue::Int(1_980_000)));
        assert_eq!(stat("memory_size"), Some(StatValue::Uint(85_899_345_920)));
        assert_eq!(
            stat("memory_bandwidth"),
            Some(StatValue::Uint(2 * 2_619_000_000 * 5120 / 8))
        );
    }
}

#[tokio::test]
async fn sampling_is_slow_while_no_capture_runs() {
    let gpu = agent_with("gpus=1\n");
    // Let the agent idle, then look back at that time from the recorder.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut req = request(1000, "idle");
    req.opts.as_mut().unwrap().start_timestamp_ns = now_ns() - 1_100_000_000;
    let reply = gpu
        .agent
        .client()
        .await
        .profile(req)
        .await
        .unwrap()
        .into_inner();
    let idle = space_of(&reply);
    let samples = values_of(&counters(&idle, 0), "SM utilization (%)").len();
    assert!(
        samples <= 3,
        "{samples} samples in an idle second at --nvml-idle-interval 1s"
    );
    let busy = capture(&gpu.agent, 300).await;
    let fast = values_of(&counters(&busy, 0), "SM utilization (%)").len();
    assert!(fast >= 10, "{fast} samples in 300 ms during a capture");
}

#[tokio::test]
async fn gpus_without_gpm_report_the_rest() {
    let gpu = agent_with("gpus=1\ngpm=0\n");
    let space = capture(&gpu.agent, 200).await;
    let samples = counters(&space, 0);
    assert!(samples.iter().all(|(n, _)| !n.starts_with("GPM")));
    assert!(samples.iter().any(|(n, _)| n == "SM utilization (%)"));
}

#[tokio::test]
async fn monitor_summarises_the_sampled_health() {
    let gpu = agent_with("gpus=1\nutil_gpu=25\n");
    let reply = gpu.agent.monitor(200).await;
    assert!(
        reply.data.contains("GPU 0 SM utilization (%): 25.0"),
        "{}",
        reply.data
    );
    assert!(
        reply.data.contains("device idle time: 75.0% (sampled)"),
        "{}",
        reply.data
    );
    assert!(
        reply.data.contains("backend nvml: running (1 GPUs"),
        "{}",
        reply.data
    );
    let result = reply.monitor_result.unwrap();
    assert_eq!(result.device_idle_time_percent, 75.0);
}

/// The names of the instants on a GPU plane's `XID errors` line.
fn xid_instants(space: &XSpace, gpu: u16) -> Vec<String> {
    let plane = plane(space, &format!("/device:GPU:{gpu}"));
    plane
        .lines
        .iter()
        .filter(|l| l.name == "XID errors")
        .flat_map(|l| l.events.iter().map(|e| event_name(plane, e).to_string()))
        .collect()
}

fn values_of(samples: &[(String, f64)], name: &str) -> Vec<f64> {
    samples
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .collect()
}

#[tokio::test]
async fn an_xid_error_is_an_instant_on_its_gpu_and_a_count_from_zero() {
    let gpu = agent_with("gpus=2\n");
    let script = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&gpu.control, "gpus=2\nxid=79\nxid_gpu=1\n").unwrap();
    };
    let (space, ()) = tokio::join!(capture(&gpu.agent, 500), script);
    assert_eq!(xid_instants(&space, 1), vec!["XID 79".to_string()]);
    assert!(xid_instants(&space, 0).is_empty());

    let errors = values_of(&counters(&space, 1), "XID errors");
    let (before, after): (Vec<f64>, Vec<f64>) = errors.iter().partition(|v| **v == 0.0);
    assert!(before.len() >= 10, "{errors:?}: samples before the XID");
    assert!(
        after.len() >= 10 && after.iter().all(|v| *v == 1.0),
        "{errors:?}"
    );
    assert!(
        errors.windows(2).all(|w| w[0] <= w[1]),
        "a running count: {errors:?}"
    );
    assert_eq!(values_of(&counters(&space, 1), "Last XID"), vec![79.0]);
    let other = values_of(&counters(&space, 0), "XID errors");
    assert!(
        !other.is_empty() && other.iter().all(|v| *v == 0.0),
        "{other:?}"
    );
    assert!(values_of(&counters(&space, 0), "Last XID").is_empty());

    // A second XID adds to the count.
    let script = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(&gpu.control, "gpus=2\nxid=31\nxid_gpu=1\n").unwrap();
    };
    let (space, ()) = tokio::join!(capture(&gpu.agent, 400), script);
    assert_eq!(xid_instants(&space, 1), vec!["XID 31".to_string()]);
    let errors = values_of(&counters(&space, 1), "XID errors");
    assert!(
        errors.contains(&1.0) && errors.last() == Some(&2.0),
        "{errors:?}"
    );
}

#[tokio::test]
async fn gpus_and_drivers_without_xid_events_still_sample_their_counters() {
    let without_events = standin_without_events();
    let cases = [
        (without_events.as_path(), "gpus=2\n"),
        (standin(), "gpus=2\nfail_event_set=999\n"),
        (standin(), "gpus=2\nfail_events=3\n"),
        // A supported-event-types mask with both ECC kinds but no XID.
        (standin(), "gpus=2\nevent_types=3\n"),
    ];
    for (library, settings) in cases {
        let gpu = agent_on(library, settings);
        let space = capture(&gpu.agent, 200).await;
        for ordinal in 0..2 {
            let samples = counters(&space, ordinal);
            assert!(
                !values_of(&samples, "SM utilization (%)").is_empty(),
                "{settings}: GPU {ordinal} {samples:?}"
            );
            assert!(values_of(&samples, "XID errors").is_empty(), "{settings}");
        }
        let reply = gpu.agent.monitor(50).await;
        assert!(
            reply.data.contains("not supported: GPU 0 Xid, GPU 1 Xid"),
            "{settings}: {}",
            reply.data
        );
        assert!(
            reply.data.contains("backend nvml: running"),
            "{}",
            reply.data
        );
        // A scripted XID has no set to arrive through.
        std::fs::write(&gpu.control, format!("{settings}xid=79\n")).unwrap();
        let space = capture(&gpu.agent, 100).await;
        for ordinal in 0..2 {
            assert!(xid_instants(&space, ordinal).is_empty(), "{settings}");
            let samples = counters(&space, ordinal);
            assert!(values_of(&samples, "XID errors").is_empty(), "{settings}");
        }
    }
}

#[tokio::test]
async fn unsupported_metrics_are_skipped_and_a_lost_gpu_is_reported() {
    let gpu = agent_with("gpus=2\nfail_power=3\n");
    let space = capture(&gpu.agent, 200).await;
    assert!(counters(&space, 0).iter().all(|(n, _)| n != "Power (W)"));
    assert!(counters(&space, 0)
        .iter()
        .any(|(n, _)| n == "Temperature (C)"));

    std::fs::write(&gpu.control, "gpus=2\nfail_power=3\nlost_gpu=1\n").unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let space = capture(&gpu.agent, 200).await;
    assert!(!counters(&space, 0).is_empty(), "GPU 0 keeps reporting");
    let gpu1 = plane(&space, "/device:GPU:1");
    assert!(
        gpu1.lines.iter().all(|l| l.events.is_empty()),
        "a lost GPU is no longer sampled"
    );
    let reply = gpu.agent.monitor(50).await;
    assert!(reply.data.contains("lost GPUs: [1]"), "{}", reply.data);
    assert!(
        reply
            .data
            .contains("not supported: GPU 0 Power, GPU 1 Power"),
        "{}",
        reply.data
    );
}

#[test]
fn without_nvml_the_backend_says_so() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "nvml",
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no backend could start: nvml is not available here: cannot load NVML"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_backend_that_cannot_start_is_named_in_monitor_and_the_trace() {
    let gpu = agent_told(
        standin(),
        "fail_init=999\n",
        &["--backend", "mock", "--backend", "nvml"],
    );
    let agent = &gpu.agent;
    let space = capture(agent, 200).await;
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.starts_with("backend nvml is not running: nvml failed to start")),
        "{:?}",
        space.warnings
    );
    let reply = agent.monitor(50).await;
    assert!(
        reply
            .data
            .contains("backend nvml: failed: nvml failed to start"),
        "{}",
        reply.data
    );
    assert!(
        reply.data.contains("backend mock: running"),
        "{}",
        reply.data
    );
}

/// A driver that hangs as it initialises is named in the log while the
/// agent waits for it, and the probes answer meanwhile (not ready).
#[test]
fn a_backend_that_hangs_as_it_starts_is_named_while_probes_answer() {
    use std::io::BufRead;
    let library = standin().to_str().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("nvml.ctl");
    std::fs::write(&control, "hang_init_ms=12000\n").unwrap();
    let metrics = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let mut agent = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "nvml"])
        .args(["--nvml-library", &library, "--metrics-listen", &metrics])
        .env("DEVTRACE_NVML_STANDIN", &control)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = std::io::BufReader::new(agent.stderr.take().unwrap());
    let mut answered = None;
    let mut named = None;
    for line in log.lines() {
        let line = line.unwrap();
        if answered.is_none() {
            answered = try_http_get(&metrics, "/readyz").ok();
        }
        if line.contains("backend still starting") {
            named = Some(line);
            break;
        }
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let named = named.expect("the hanging backend was never named");
    assert!(named.contains("backend=\"nvml\""), "{named}");
    let (status, body) = answered.expect("/readyz did not answer while the backends started");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("the backends are starting"), "{body}");
}

/// A GPU host whose NVML loads and fails is not a host without GPUs: `auto`
/// reports NVML failed and starts no mock, whose made-up GPU events would
/// pass for the host's own.
#[tokio::test]
async fn auto_stands_no_mock_in_for_an_nvml_that_fails() {
    // NVML_ERROR_UNKNOWN: a driver that fails.
    let failing = "fail_init=999\n";
    let auto = agent_told(standin(), failing, &["--backend", "auto"]);
    // Named besides auto, the same.
    let named = agent_told(
        standin(),
        failing,
        &["--backend", "nvml", "--backend", "auto"],
    );
    let agent = &auto.agent;
    for agent in [agent, &named.agent] {
        let reply = agent.monitor(50).await;
        assert!(
            reply
                .data
                .contains("backend nvml: failed: nvml failed to start"),
            "{}",
            reply.data
        );
        assert!(!reply.data.contains("backend mock"), "{}", reply.data);
    }
    let space = capture(agent, 200).await;
    assert!(
        !space
            .planes
            .iter()
            .any(|p| p.name.starts_with("/device:GPU")),
        "{:?}",
        space.planes.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.starts_with("backend nvml is not running: nvml failed to start")),
        "{:?}",
        space.warnings
    );
    // A library and no driver (NVML_ERROR_DRIVER_NOT_LOADED, no kernel
    // module here) is a host without a GPU: the mock runs.
    if devtrace::backend::nvml::kernel_module().is_some() {
        return;
    }
    let absent = agent_told(standin(), "fail_init=9\n", &["--backend", "auto"]);
    let reply = absent.agent.monitor(50).await;
    assert!(
        reply.data.contains("backend mock: running"),
        "{}",
        reply.data
    );
}

#[tokio::test]
async fn auto_falls_back_to_the_mock_without_nvml() {
    let agent = AgentProcess::start(&[
        "--backend",
        "auto",
        "--nvml-library",
        "/nonexistent/libnvidia-ml.so.1",
    ]);
    let space = capture(&agent, 200).await;
    let host = plane(&space, "/host:CPU");
    assert!(
        host.lines.iter().any(|l| !l.events.is_empty()),
        "the mock runs"
    );
}
