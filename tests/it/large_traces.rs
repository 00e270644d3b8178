//! Traces past `--chunk-traces-over`, with the threshold set low so that a
//! small capture goes the way a trace past 2 GiB would: Riegeli chunks
//! written under an allowed root, returned as `xplane.riegeli` tool data, or
//! a RESOURCE_EXHAUSTED that says where the trace is or how to get it; and
//! `devtrace capture` and `devtrace inspect` on them.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::{ProfileRequest, ProfileResponse};
use devtrace::xspace::chunks;
use devtrace::xspace::read::read_trace;
use tonic::Code;

/// A 200 ms capture of the mock is about 700 KB as one XSpace and about
/// 120 KB as chunks: over this, and its chunks within it.
const THRESHOLD: &str = "256KiB";

fn files_in(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(directory)
        .unwrap_or_else(|e| panic!("{}: {e}", directory.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// The trace of a reply's `xplane.riegeli` tool data, and its chunk count.
fn chunked_tool_data(reply: &ProfileResponse) -> (XSpace, usize) {
    let names: Vec<&str> = reply.tool_data.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, vec!["xplane.riegeli"]);
    chunks::decode(&reply.tool_data[0].data).expect("reading the chunks")
}

/// The whole capture is there: host and GPU planes with events, over the
/// window `request` asked for.
fn assert_whole(space: &XSpace, request: &ProfileRequest) {
    for name in ["/host:CPU", "/device:GPU:0", "/device:GPU:1"] {
        assert!(
            plane(space, name)
                .lines
                .iter()
                .any(|l| !l.events.is_empty()),
            "{name}"
        );
    }
    let (start, stop) = window_of(space);
    let asked = request.opts.as_ref().unwrap().start_timestamp_ns;
    assert_eq!((start, stop - start), (asked, 200_000_000));
    assert!(event_count(space) > 3_000, "{} events", event_count(space));
}

fn inside(root: &Path, session: &str) -> ProfileRequest {
    let mut request = request(200, session);
    request.repository_root = root.join("logs/plugins/profile").display().to_string();
    request
}

fn capture(address: &str, logdir: &Path) -> Output {
    Command::new(BIN)
        .args([
            "capture",
            &format!("grpc://{address}"),
            "--duration",
            "200ms",
        ])
        .args(["--session-id", "cli", "--quiet", "--logdir"])
        .arg(logdir)
        .output()
        .expect("running devtrace capture")
}

fn inspect(file: &Path) -> String {
    let out = Command::new(BIN).arg("inspect").arg(file).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An agent that writes under `allowed` and chunks past [`THRESHOLD`].
fn chunking_agent(allowed: &Path) -> AgentProcess {
    AgentProcess::start(&[
        "--allow-root",
        allowed.to_str().unwrap(),
        "--chunk-traces-over",
        THRESHOLD,
    ])
}

#[tokio::test]
async fn a_large_trace_is_written_as_riegeli_chunks_under_an_allowed_root() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = chunking_agent(&allowed);
    let mut client = agent.client().await;

    let mut written = inside(&allowed, "big");
    written.host_name = "10.0.0.2:8466".into();
    let reply = client.profile(written.clone()).await.unwrap().into_inner();
    assert!(reply.tool_data.is_empty() && reply.xspace.is_none());
    assert!(!reply.empty_trace);
    let session = allowed.join("logs/plugins/profile/big");
    assert_eq!(files_in(&session), vec!["10.0.0.2_8466.xplane.riegeli"]);
    let file = session.join("10.0.0.2_8466.xplane.riegeli");
    let trace = read_trace(&file).unwrap();
    assert!(trace.chunks > 2, "{} chunks", trace.chunks);
    assert_whole(&trace.space, &written);
    let text = inspect(&file);
    assert!(
        text.starts_with(&format!("chunks: {}\nhosts: ", trace.chunks)),
        "{text}"
    );
    assert!(
        text.contains("\nsession host: 10.0.0.2_8466 (as `devtrace tool --host`"),
        "{text}"
    );
    assert!(text.contains("plane /device:GPU:0"), "{text}");

    // `sessions` lists it with its host and tools; `tool` reads its chunks.
    let logdir = allowed.join("logs");
    let devtrace = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let logdir_arg = logdir.to_str().unwrap();
    let listing = devtrace(&["sessions", logdir_arg]);
    let line = listing
        .lines()
        .find(|l| l.starts_with("big\t"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        line.contains("10.0.0.2_8466") && line.contains("kernel_stats"),
        "{line}"
    );
    let overview = devtrace(&["tool", logdir_arg, "big", "overview"]);
    assert!(overview.contains("\"hosts\""), "{overview}");
    let out = Command::new(BIN)
        .args([
            "tool",
            logdir_arg,
            "big",
            "xplane",
            "--host",
            "10.0.0.2:8466",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Riegeli chunks"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A client that needs the XSpace itself learns where the trace went.
    let mut needs_xspace = inside(&allowed, "inline");
    needs_xspace.emit_xspace = true;
    let status = client.profile(needs_xspace.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let path = allowed.join("logs/plugins/profile/inline/127.0.0.1_6009.xplane.riegeli");
    assert!(
        status.message().contains(&path.display().to_string()),
        "{}",
        status.message()
    );
    assert_whole(&read_trace(&path).unwrap().space, &needs_xspace);

    // `devtrace capture` into a logdir the agent writes names the file.
    let out = capture(&agent.address, &allowed);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let host = agent.address.replace(':', "_");
    let printed = String::from_utf8_lossy(&out.stdout);
    let expected = allowed.join(format!("plugins/profile/cli/{host}.xplane.riegeli"));
    assert_eq!(printed.trim(), expected.display().to_string());
    assert!(read_trace(&expected).unwrap().chunks > 2);
}

#[tokio::test]
async fn a_large_trace_goes_to_the_client_as_chunks_when_the_agent_does_not_write_it() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = chunking_agent(&allowed);
    let mut client = agent.client().await;

    let mut outside = request(200, "outside");
    outside.repository_root = dir.path().join("elsewhere").display().to_string();
    let reply = client.profile(outside.clone()).await.unwrap().into_inner();
    assert!(!reply.empty_trace);
    let (space, count) = chunked_tool_data(&reply);
    assert!(count > 2, "{count} chunks");
    assert_whole(&space, &outside);
    assert!(!dir.path().join("elsewhere").exists());

    // A trace the agent fails to write is returned, saying why.
    std::fs::create_dir_all(allowed.join("logs/plugins")).unwrap();
    std::fs::write(allowed.join("logs/plugins/profile"), b"not a directory").unwrap();
    let blocked = inside(&allowed, "blocked");
    let reply = client.profile(blocked.clone()).await.unwrap().into_inner();
    let (space, _) = chunked_tool_data(&reply);
    assert_whole(&space, &blocked);
    let failures = warnings_with(&space, "could not write this trace");
    assert_eq!(failures.len(), 1, "{:?}", space.warnings);

    // A client that needs the XSpace itself is told how to get the trace.
    let mut needs_xspace = request(200, "emit");
    needs_xspace.emit_xspace = true;
    let status = client.profile(needs_xspace.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let start = needs_xspace.opts.as_ref().unwrap().start_timestamp_ns;
    for part in [
        "emit_xspace".to_string(),
        format!("opts.start_timestamp_ns {start}"),
        "opts.duration_ms 200".to_string(),
        allowed.display().to_string(),
    ] {
        assert!(status.message().contains(&part), "{}", status.message());
    }

    // `devtrace capture` writes the chunks it receives.
    let logdir = dir.path().join("client-logs");
    let out = capture(&agent.address, &logdir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let session = logdir.join("plugins/profile/cli");
    let host = agent.address.replace(':', "_");
    assert_eq!(files_in(&session), vec![format!("{host}.xplane.riegeli")]);
    let file = session.join(format!("{host}.xplane.riegeli"));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        file.display().to_string()
    );
    assert!(inspect(&file).contains("plane /host:CPU"));
}

/// A session's fan-out takes a host's chunked trace into the session,
/// where the other hosts' traces go: through the agent's NewSession and
/// through `devtrace session new`. Before, the host wrote the chunks on its
/// own disk and the session said it "gave no trace".
#[tokio::test]
async fn a_session_takes_a_hosts_chunked_trace() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = chunking_agent(&allowed);
    let host = agent.address.replace(':', "_");
    let expected = vec![format!("{host}.xplane.riegeli")];

    let root = allowed.join("logs/plugins/profile");
    let mut new_session = session_request(&root, &[&agent.address], "fanned");
    new_session.request = Some(request(200, "ignored"));
    let reply = agent
        .new_session_within(new_session, std::time::Duration::from_secs(30))
        .await;
    assert_eq!(reply.error_message, "");
    assert!(!reply.empty_trace);
    assert_eq!(files_in(&root.join("fanned")), expected);
    let trace = read_trace(&root.join("fanned").join(&expected[0])).unwrap();
    assert!(trace.chunks > 2, "{} chunks", trace.chunks);
    assert!(event_count(&trace.space) > 3_000);

    let logdir = dir.path().join("client-logs");
    let out = Command::new(BIN)
        .args(["session", "new", "--hosts", &agent.address])
        .args(["--duration", "200ms", "--session-id", "cli", "--logdir"])
        .arg(&logdir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let session = logdir.join("plugins/profile/cli");
    assert_eq!(files_in(&session), expected);
    assert!(inspect(&session.join(&expected[0])).contains("plane /device:GPU:0"));
    // Nothing was written on the host's side of either session.
    assert_eq!(files_in(&root), vec!["fanned".to_string()]);
}

#[tokio::test]
async fn a_trace_too_large_even_as_chunks_is_refused_with_the_way_to_get_it() {
    let agent = AgentProcess::start(&["--chunk-traces-over", "16KiB"]);
    let status = agent
        .client()
        .await
        .profile(request(200, "huge"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    for part in [
        "even as compressed Riegeli chunks",
        "--allow-root DIR",
        "xplane.riegeli",
    ] {
        assert!(status.message().contains(part), "{}", status.message());
    }
}

/// Storing a trace as chunks takes a copy of it and the file besides the
/// trace itself: with too little capture memory for that, the capture is
/// refused naming the budget rather than the agent growing past it.
#[tokio::test]
async fn chunking_a_trace_draws_from_the_capture_budget_too() {
    let agent = AgentProcess::start(&["--chunk-traces-over", "64KiB", "--capture-memory", "4MiB"]);
    let status = agent
        .client()
        .await
        .profile(request(500, "chunked"))
        .await
        .expect_err("no room to chunk it beside itself");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status
            .message()
            .contains("as Riegeli chunks (with the trace itself)")
            && status.message().contains("--capture-memory"),
        "{}",
        status.message()
    );
    // A window small enough for both is served, as chunks.
    let reply = agent.profile(request(50, "small")).await;
    assert!(!reply.tool_data.is_empty());
}
