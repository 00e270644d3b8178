//! The TPU backend against a stand-in `libtpu.so` built from
//! `tests/standins/libtpu.c` with the PJRT profiler extension's real layout:
//! its XSpace is merged into captures, and each failure (no extension, create,
//! collect, no library) gives a clear error.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use devtrace::proto::tensorflow::profiler::{
    x_event, XEvent, XEventMetadata, XLine, XPlane, XSpace,
};
use devtrace::xspace::read::{event_name, find_stat, StatValue};
use prost::Message;

fn standin() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| build_standin("libtpu.c", "libtpu.so"))
}

/// What the stand-in's libtpu recorded: one TPU core running an XLA op.
fn tpu_trace(dir: &Path) -> PathBuf {
    let mut plane = XPlane {
        id: 0,
        name: "/device:TPU:0".into(),
        ..XPlane::default()
    };
    plane.event_metadata.insert(
        1,
        XEventMetadata {
            id: 1,
            name: "fusion.42".into(),
            ..XEventMetadata::default()
        },
    );
    plane.lines.push(XLine {
        id: 1,
        name: "XLA Ops".into(),
        events: (0..3)
            .map(|i| XEvent {
                metadata_id: 1,
                data: Some(x_event::Data::OffsetPs(i * 1_000_000)),
                duration_ps: 500_000,
                stats: Vec::new(),
            })
            .collect(),
        ..XLine::default()
    });
    let space = XSpace {
        planes: vec![plane],
        ..XSpace::default()
    };
    let path = dir.join("tpu.xspace");
    std::fs::write(&path, space.encode_to_vec()).unwrap();
    path
}

fn start(failure: Option<&str>, backends: &[&str]) -> (tempfile::TempDir, AgentProcess) {
    let dir = tempfile::tempdir().unwrap();
    let trace = tpu_trace(dir.path());
    let library = standin().to_str().unwrap().to_string();
    let mut args = vec!["--tpu-library", library.as_str()];
    for backend in backends {
        args.extend(["--backend", backend]);
    }
    let failure = failure.map(PathBuf::from);
    let mut env: Vec<(&str, &Path)> = vec![("DEVTRACE_TPU_STANDIN_XSPACE", trace.as_path())];
    if let Some(failure) = &failure {
        env.push(("DEVTRACE_TPU_STANDIN_FAIL", failure.as_path()));
    }
    let agent = AgentProcess::start_with_env(&args, &env);
    (dir, agent)
}

#[tokio::test]
async fn libtpu_planes_are_merged_into_the_capture() {
    let (_dir, agent) = start(None, &["tpu", "mock"]);
    let reply = agent
        .client()
        .await
        .profile(request(300, "tpu"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert!(space.errors.is_empty(), "{:?}", space.errors);
    let tpu = plane(&space, "/device:TPU:0");
    let events: Vec<&str> = tpu.lines[0]
        .events
        .iter()
        .map(|e| event_name(tpu, e))
        .collect();
    assert_eq!(events, vec!["fusion.42"; 3]);
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
