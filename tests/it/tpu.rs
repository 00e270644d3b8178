//! The TPU backend against a stand-in `libtpu.so` built from
//! `tests/standins/libtpu.c` with the PJRT profiler extension's real layout:
//! its XSpace is merged into captures, and each failure (no extension, create,
//! collect, no library) gives a clear error.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use devtrace::proto::tensorflow::profiler::x_event;
use devtrace::proto::tensorflow::TerminateRequest;
use devtrace::xspace::read::{event_name, find_stat, StatValue};

fn standin() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| build_standin("libtpu.c", "libtpu.so"))
}

fn start(failure: Option<&str>, backends: &[&str]) -> (tempfile::TempDir, AgentProcess) {
    let dir = tempfile::tempdir().unwrap();
    let library = standin().to_str().unwrap().to_string();
    let mut args = vec!["--tpu-library", library.as_str()];
    for backend in backends {
        args.extend(["--backend", backend]);
    }
    let failure = failure.map(PathBuf::from);
    let mut env: Vec<(&str, &Path)> = Vec::new();
    if let Some(failure) = &failure {
        env.push(("DEVTRACE_TPU_STANDIN_FAIL", failure.as_path()));
    }
    let agent = AgentProcess::start_with_env(&args, &env);
    (dir, agent)
}

/// The TPU events of the trace as times since the epoch.
fn tpu_times(space: &devtrace::proto::tensorflow::profiler::XSpace) -> Vec<u64> {
    let (start_ns, _) = common::window_of(space);
    let tpu = plane(space, "/device:TPU:0");
    let line = &tpu.lines[0];
    line.events
        .iter()
        .map(|e| match e.data {
            Some(x_event::Data::OffsetPs(ps)) => {
                start_ns + line.timestamp_ns as u64 + (ps / 1000) as u64
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

/// A terminated capture ends libtpu's session too: its events stop when
/// the window was cut short, and the reply does not wait for the rest.
#[tokio::test]
async fn terminate_ends_the_libtpu_session_with_the_capture() {
    let (_dir, agent) = start(None, &["tpu", "mock"]);
    let mut client = agent.client().await;
    let mut other = agent.client().await;
    let capture = tokio::spawn(async move { client.profile(request(30_000, "cut")).await });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    other
        .terminate(TerminateRequest {
            session_id: "cut".into(),
        })
        .await
        .unwrap();
    let reply = capture.await.unwrap().unwrap().into_inner();
    let space = space_of(&reply);
    assert!(space.errors.is_empty(), "{:?}", space.errors);
    let (start_ns, stop_ns) = common::window_of(&space);
    let times = tpu_times(&space);
    // Cut at about 0.7 s: libtpu recorded that, not the 30 s asked for (its
    // session ends within one 10 ms poll of the cut).
    let recorded_ms = (stop_ns - start_ns) / 1_000_000;
    assert!(
        (500..=2_000).contains(&recorded_ms),
        "window of {recorded_ms} ms"
    );
    assert!(
        times.len() as u64 + 150 >= recorded_ms && times.len() as u64 <= recorded_ms + 15,
        "{} TPU events for a {recorded_ms} ms window",
        times.len()
    );
    assert!(times.iter().all(|t| *t <= stop_ns + 60_000_000));
}

/// The stand-in records one event per millisecond of its session, so its
/// events show when libtpu's session ran: it must span the window itself,
/// not start after it.
#[tokio::test]
async fn libtpu_records_the_window_of_the_capture_and_is_merged() {
    let (_dir, agent) = start(None, &["tpu", "mock"]);
    let reply = agent
        .client()
        .await
        .profile(request(500, "tpu"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert!(space.errors.is_empty(), "{:?}", space.errors);
    let (start_ns, stop_ns) = common::window_of(&space);
    let tpu = plane(&space, "/device:TPU:0");
    assert!(tpu.lines[0]
        .events
        .iter()
        .all(|e| event_name(tpu, e) == "fusion.42"));
    let times = tpu_times(&space);
    // One per millisecond of the 500 ms window, give or take the session's
    // start latency, and none outside it.
    assert!(
        (400..=505).contains(&times.len()),
        "{} events: libtpu's session did not span the window",
        times.len()
    );
    let slack = 20_000_000;
    assert!(
        times
            .iter()
            .all(|t| *t + slack >= start_ns && *t <= stop_ns + slack),
        "events outside [{start_ns}, {stop_ns}]: first {:?}, last {:?}",
        times.first(),
        times.last()
    );
    assert_eq!(
        find_stat(tpu, &tpu.stats, "devtrace_source"),
        Some(StatValue::Str("libtpu".into()))
    );
    assert!(plane(&space, "/device:GPU:0")
        .lines
        .iter()
        .any(|l| !l.events.is_empty()));
}

#[tokio::test]
async fn create_and_collect_failures_make_the_capture_partial() {
    for (failure, message) in [
        (
            "create",
            "libtpu: libtpu profiler create failed: TPU is owned by another process (stand-in)",
        ),
        (
            "collect",
            "libtpu: libtpu profiler collect_data failed: collect failed (stand-in)",
        ),
        (
            "start",
            "libtpu: libtpu profiler start failed: cannot start the TPU tracer (stand-in)",
        ),
    ] {
        let (_dir, agent) = start(Some(failure), &["tpu", "mock"]);
        let reply = agent
            .client()
            .await
            .profile(request(200, failure))
            .await
            .unwrap()
            .into_inner();
        let space = space_of(&reply);
        assert_eq!(space.errors, vec![message.to_string()], "{failure}");
        assert!(event_count(&space) > 100, "the mock's events still arrive");
    }
}

#[test]
fn a_libtpu_without_profiler_or_a_missing_library_is_refused_clearly() {
    let library = standin().to_str().unwrap();
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "tpu",
            "--tpu-library",
            library,
        ])
        .env("DEVTRACE_TPU_STANDIN_FAIL", "no_extension")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tpu is not available here: libtpu's PJRT API has no profiler extension"),
        "{stderr}"
    );

    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "tpu",
            "--tpu-library",
            "/nonexistent/libtpu.so",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot load libtpu from \"/nonexistent/libtpu.so\""),
        "{stderr}"
    );
}
