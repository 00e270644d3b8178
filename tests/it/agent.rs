//! The real agent binary on a loopback port, driven through the profiler
//! protocol: captures, overlap, Terminate, continuous profiling, Monitor,
//! where traces are written, and drop accounting.

use crate::common;

use std::time::Duration;

use common::*;
use devtrace::proto::tensorflow::{
    GetSnapshotRequest, MonitorRequest, StopContinuousProfilingRequest, TerminateRequest,
};
use devtrace::xspace::read::{event_name, find_stat, StatValue};
use tonic::Code;

#[tokio::test]
async fn a_capture_returns_the_window_inline_with_host_and_gpu_planes() {
    let agent = AgentProcess::start(&[]);
    let logs = tempfile::tempdir().unwrap();
    let mut req = request(600, "inline");
    req.repository_root = logs.path().join("plugins/profile").display().to_string();
    let asked_start = req.opts.as_ref().unwrap().start_timestamp_ns;
    let reply = agent
        .client()
        .await
        .profile(req)
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.empty_trace);
    assert!(
        reply.xspace.is_none(),
        "xspace only when emit_xspace is set"
    );
    let space = space_of(&reply);
    let (start, stop) = window_of(&space);
    assert_eq!(start, asked_start);
    assert_eq!(stop - start, 600_000_000);
    for name in ["/host:CPU", "/device:GPU:0", "/device:GPU:1"] {
        assert!(
            plane(&space, name)
                .lines
                .iter()
                .any(|l| !l.events.is_empty()),
            "{name}"
        );
    }
    // About 50k events/s by default.
    let events = event_count(&space);
    assert!(
        (15_000..=45_000).contains(&events),
        "{events} events in 600 ms"
    );
    // Without --allow-root nothing is written on the agent's side.
    assert!(!logs.path().join("plugins").exists());
}

#[tokio::test]
async fn emit_xspace_and_legacy_version_zero_requests() {
    let agent = AgentProcess::start(&[]);
    let mut client = agent.client().await;
    let mut req = request(200, "emit");
    req.emit_xspace = true;
    let reply = client.profile(req).await.unwrap().into_inner();
    assert!(reply.tool_data.is_empty());
    assert!(reply.xspace.is_some());

    // Version 0: the options are legacy, the top-level duration counts.
    let mut legacy = request(300, "legacy");
    legacy.opts = None;
    let reply = client.profile(legacy).await.unwrap().into_inner();
    let (start, stop) = window_of(&space_of(&reply));
    assert_eq!(stop - start, 300_000_000);
}

#[tokio::test]
async fn overlapping_captures_both_get_full_data() {
    let agent = AgentProcess::start(&[]);
    let mut a = agent.client().await;
    let mut b = agent.client().await;
    let t = now_ns() + 200_000_000;
    let mut first = request(800, "first");
    first.opts.as_mut().unwrap().start_timestamp_ns = t;
    let mut second = request(800, "second");
    second.opts.as_mut().unwrap().start_timestamp_ns = t + 400_000_000;
    let (ra, rb) = tokio::join!(a.profile(first), b.profile(second));
    let (sa, sb) = (
        space_of(&ra.unwrap().into_inner()),
        space_of(&rb.unwrap().into_inner()),
    );
    // The 400 ms both windows share hold the same events in both traces.
    let shared = |space: &devtrace::proto::tensorflow::profiler::XSpace, origin: u64| {
        let mut starts = Vec::new();
        for p in &space.planes {
            for l in &p.lines {
                for e in &l.events {
                    let Some(devtrace::proto::tensorflow::profiler::x_event::Data::OffsetPs(ps)) =
                        e.data
                    else {
                        continue;
                    };
                    let at = origin + (ps / 1000) as u64;
                    if (t + 400_000_000..t + 800_000_000).contains(&at) {
                        starts.push((p.name.clone(), l.id, at));
                    }
                }
            }
        }
        starts.sort();
        starts
    };
    let in_a = shared(&sa, t);
    let in_b = shared(&sb, t + 400_000_000);
    assert!(in_a.len() > 5_000, "{} shared events", in_a.len());
    assert_eq!(in_a, in_b);
}

#[tokio::test]
async fn terminate_ends_a_running_capture_early_and_delivers_it() {
    let agent = AgentProcess::start(&[]);
    let mut client = agent.client().await;
    let mut other = agent.client().await;
    let capture = tokio::spawn(async move { client.profile(request(60_000, "long")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    other
        .terminate(TerminateRequest {
            session_id: "long".into(),
        })
        .await
        .unwrap();
    let reply = capture.await.unwrap().unwrap().into_inner();
    let space = space_of(&reply);
    let (start, stop) = window_of(&space);
    assert!(
        stop - start < 30_000_000_000,
        "stopped after {} ns",
        stop - start
    );
    assert!(event_count(&space) > 1_000);
    // Terminating a session that is not running is harmless.
    other
        .terminate(TerminateRequest {
            session_id: "nothing".into(),
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn continuous_profiling_snapshots_reach_back_before_the_request() {
    let agent = AgentProcess::start(&[]);
    let mut client = agent.client().await;
    let status = client
        .get_snapshot(GetSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let stop = client
        .stop_continuous_profiling(StopContinuousProfilingRequest {})
        .await
        .unwrap_err();
    assert_eq!(stop.code(), Code::NotFound);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let asked_at = now_ns();
    let req = continuous_request();
    client
        .start_continuous_profiling(req.clone())
        .await
        .unwrap();
    let again = client.start_continuous_profiling(req).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists);

    let reply = client
        .get_snapshot(GetSnapshotRequest::default())
        .await
        .unwrap()
        .into_inner();
    let space = reply.xspace.expect("snapshots carry the XSpace");
    let (start, _) = window_of(&space);
    assert!(
        start < asked_at - 500_000_000,
        "window starts before the request"
    );
    let host = plane(&space, "/host:CPU");
    let steps = host
        .lines
        .iter()
        .flat_map(|l| &l.events)
        .filter(|e| event_name(host, e) == "train")
        .count();
    assert!(
        steps >= 15,
        "{steps} steps from the second before the request"
    );
    client
        .stop_continuous_profiling(StopContinuousProfilingRequest {})
        .await
        .unwrap();
}

#[tokio::test]
async fn monitor_reports_device_utilisation_and_step_times() {
    let agent = AgentProcess::start(&[]);
    let reply = agent
        .client()
        .await
        .monitor(MonitorRequest {
            duration_ms: 500,
            monitoring_level: 2,
            timestamp: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.data.contains("GPU 0:"), "{}", reply.data);
    assert!(reply.data.contains("step time: avg"), "{}", reply.data);
    assert!(
        reply.data.contains("backend mock: running"),
        "{}",
        reply.data
    );
    assert!(reply.data.starts_with("timestamp: "), "{}", reply.data);
    let result = reply.monitor_result.expect("monitor_result");
    assert_eq!(result.response_type, 3, "UTIL_IDLE_STEP");
    assert!(result.device_idle_time_percent > 0.0 && result.device_idle_time_percent < 100.0);
    assert!(
        (40.0..=50.0).contains(&result.step_time_ms_avg),
        "{result:?}"
    );
}

#[tokio::test]
async fn traces_are_written_only_inside_allowed_roots() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let mut client = agent.client().await;

    let mut inside = request(200, "run1");
    inside.repository_root = allowed.join("logs/plugins/profile").display().to_string();
    inside.host_name = "10.0.0.2:8466".into();
    let reply = client.profile(inside).await.unwrap().into_inner();
    assert!(
        reply.tool_data.is_empty(),
        "written on the agent's side instead"
    );
    assert!(!reply.empty_trace);
    let session = allowed.join("logs/plugins/profile/run1");
    let files: Vec<String> = std::fs::read_dir(&session)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files, vec!["10.0.0.2_8466.xplane.pb".to_string()]);
    // This caller (root) sees the whole host: its trace is kept from other
    // users.
    use std::os::unix::fs::PermissionsExt;
    let written = std::fs::metadata(session.join(&files[0])).unwrap();
    assert_eq!(written.permissions().mode() & 0o007, 0, "{written:?}");

    let mut renamed = request(200, "run1");
    renamed.repository_root = allowed.join("logs/plugins/profile").display().to_string();
    renamed.opts.as_mut().unwrap().override_hostname = "worker-7".into();
    client.profile(renamed).await.unwrap();
    assert!(
        session.join("worker-7.xplane.pb").is_file(),
        "override_hostname names the file"
    );

    // The client's session named again for a host it holds: refused, the
    // trace there unchanged. (Returned inline, the
    // trace would be written over it by TensorFlow's client.)
    let held = session.join("worker-7.xplane.pb");
    let before = std::fs::read(&held).unwrap();
    let mut again = request(200, "run1");
    again.repository_root = allowed.join("logs/plugins/profile").display().to_string();
    again.opts.as_mut().unwrap().override_hostname = "worker-7".into();
    let refused = client.profile(again).await.unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");
    assert!(refused.message().contains("worker-7"), "{refused:?}");
    assert_eq!(std::fs::read(&held).unwrap(), before);

    let mut outside = request(200, "run2");
    outside.repository_root = dir.path().join("elsewhere").display().to_string();
    let reply = client.profile(outside).await.unwrap().into_inner();
    assert!(
        event_count(&space_of(&reply)) > 0,
        "returned inline instead"
    );
    assert!(!dir.path().join("elsewhere").exists());

    let mut sneaky = request(200, "run3");
    sneaky.repository_root = format!("{}/../elsewhere", allowed.display());
    let reply = client.profile(sneaky).await.unwrap().into_inner();
    assert!(!reply.tool_data.is_empty());
    assert!(!dir.path().join("elsewhere").exists());
}

/// Two captures of one host into one new session of the client's: the
/// second is refused when it asks, while the first is still recording, not
/// after its own window with its trace dropped.
#[tokio::test]
async fn a_second_capture_of_a_host_into_a_session_is_refused_before_its_window() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let root = allowed.join("logs/plugins/profile");
    let into_race = |host: &str| {
        let mut request = request(2_000, "race");
        request.repository_root = root.display().to_string();
        request.opts.as_mut().unwrap().override_hostname = host.into();
        request
    };
    let mut client = agent.client().await;
    let start = |host: &str| {
        let mut client = client.clone();
        let request = into_race(host);
        tokio::spawn(async move { client.profile(request).await })
    };
    // Whichever asks first captures; the other is refused at once.
    let (mut one, mut other) = (start("worker-8"), start("worker-8"));
    let (first_answer, still_running) = tokio::select! {
        answer = &mut one => (answer.unwrap(), other),
        answer = &mut other => (answer.unwrap(), one),
    };
    let refused = first_answer.unwrap_err();
    assert!(
        !still_running.is_finished(),
        "refused only after the first ended"
    );
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");
    assert!(
        refused.message().contains("another capture in progress"),
        "{refused:?}"
    );
    // Another host of the same session is not held up.
    client.profile(into_race("worker-9")).await.unwrap();
    still_running.await.unwrap().unwrap();
    let mut files: Vec<String> = std::fs::read_dir(root.join("race"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, vec!["worker-8.xplane.pb", "worker-9.xplane.pb"]);
    // Once written, the trace itself holds the name.
    let again = client.profile(into_race("worker-8")).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    assert!(again.message().contains("worker-8.xplane.pb"), "{again:?}");
}

/// The warnings of a reply's trace that say it could not be written.
fn write_failures(space: &devtrace::proto::tensorflow::profiler::XSpace) -> Vec<&String> {
    warnings_with(space, "could not write this trace")
}

#[tokio::test]
async fn a_trace_the_agent_cannot_write_is_returned_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    // A file where the session directory must go: the write cannot succeed
    // (this holds even for root, unlike permission bits).
    std::fs::write(allowed.join("blocked"), b"not a directory").unwrap();
    let mut req = request(200, "blocked");
    req.repository_root = allowed.display().to_string();
    let space = space_of(&agent.profile(req).await);
    assert!(event_count(&space) > 0, "the trace itself is kept");
    let failures = write_failures(&space);
    assert_eq!(failures.len(), 1, "{:?}", space.warnings);
    assert!(failures[0].contains("blocked"), "{}", failures[0]);
    let entries: Vec<_> = std::fs::read_dir(&allowed).unwrap().collect();
    assert_eq!(entries.len(), 1, "nothing but the blocking file");
}

#[tokio::test]
async fn symlinks_under_an_allowed_root_never_redirect_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let mut client = agent.client().await;

    // A directory link in the middle of the repository root.
    std::os::unix::fs::symlink(&outside, allowed.join("logs")).unwrap();
    let mut through_directory = request(200, "run1");
    through_directory.repository_root = allowed.join("logs/plugins/profile").display().to_string();
    let reply = client
        .profile(through_directory)
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    let failures = write_failures(&space);
    assert_eq!(failures.len(), 1, "{:?}", space.warnings);
    assert!(failures[0].contains("symbolic link"), "{}", failures[0]);
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);

    // A link where the trace file goes, placed by another user.
    let victim = outside.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let session = allowed.join("run/s1");
    std::fs::create_dir_all(&session).unwrap();
    std::os::unix::fs::symlink(&victim, session.join("worker.xplane.pb")).unwrap();
    let mut onto_file = request(200, "s1");
    onto_file.repository_root = allowed.join("run").display().to_string();
    onto_file.host_name = "worker".into();
    let reply = client.profile(onto_file).await.unwrap().into_inner();
    let space = space_of(&reply);
    let failures = write_failures(&space);
    assert_eq!(failures.len(), 1, "{:?}", space.warnings);
    assert!(failures[0].contains("worker.xplane.pb"), "{}", failures[0]);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(session.join("worker.xplane.pb"))
        .unwrap()
        .file_type()
        .is_symlink());
}

#[tokio::test]
async fn captures_of_the_same_second_without_a_session_id_keep_both_traces() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let root = allowed.join("plugins/profile");
    let unnamed = || {
        let mut req = request(100, "");
        req.repository_root = root.display().to_string();
        req
    };
    // Sent together, both are named after the same second (the rare pair
    // that straddles a second lands in two directories all the same).
    let (mut first, mut second) = (agent.client().await, agent.client().await);
    let (a, b) = tokio::join!(first.profile(unnamed()), second.profile(unnamed()));
    for reply in [a.unwrap().into_inner(), b.unwrap().into_inner()] {
        assert!(reply.tool_data.is_empty(), "written on the agent's side");
    }
    let mut sessions: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    sessions.sort();
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    if sessions[0].len() != sessions[1].len() {
        assert_eq!(sessions[1], format!("{}_2", sessions[0]));
    }
    for session in &sessions {
        let files: Vec<_> = std::fs::read_dir(root.join(session)).unwrap().collect();
        assert_eq!(files.len(), 1, "{session}");
    }
}

#[tokio::test]
async fn a_client_that_gives_up_cancels_its_capture() {
    let mut agent = AgentProcess::start(&[]);
    let mut client = agent.client().await;
    // Given up after 300 ms of a 60 s window: the call goes away.
    let impatient = client.profile(request(60_000, "impatient"));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), impatient)
            .await
            .is_err(),
        "given up"
    );
    // The agent forgot the capture and keeps serving.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = agent.monitor(100).await;
    assert!(
        reply.data.contains("captures in progress: 0"),
        "{}",
        reply.data
    );
    assert!(agent.is_running());
    let reply = client
        .profile(request(200, "next"))
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.empty_trace);
}

#[tokio::test]
async fn a_full_ring_drops_are_counted_in_the_trace() {
    let agent = AgentProcess::start(&[
        "--ring-capacity",
        "64",
        "--mock-rate",
        "3000000",
        "--drop-policy",
        "drop-oldest",
    ]);
    let reply = agent
        .client()
        .await
        .profile(request(1000, "flood"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    let dropped = dropped_of(&space);
    assert!(dropped > 0, "a 64-slot ring at 3M events/s must overflow");
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains(&format!("dropped {dropped} events"))),
        "{:?}",
        space.warnings
    );
    let env = plane(&space, "Task Environment");
    assert_eq!(
        find_stat(env, &env.stats, "devtrace_dropped_oldest"),
        Some(StatValue::Uint(dropped as u64))
    );
}

/// SIGTERM at once after the agent says where it listens stops it cleanly
/// (its handler is in place by then), not by the signal's default action.
#[test]
fn sigterm_right_after_the_listening_line_is_a_clean_stop() {
    for _ in 0..3 {
        let mut agent = AgentProcess::start(&[]);
        let status = agent
            .stop_with_sigterm(std::time::Duration::from_secs(5))
            .expect("SIGTERM did not stop the agent within 5 s");
        assert!(status.success(), "{status:?}");
    }
}

/// Ctrl-C of a capture cancels it cleanly; a stop asked for during a
/// capture says at once that it waits for the capture, and a second
/// signal stops the agent then and there.
#[test]
fn a_stop_during_a_capture_says_it_waits_and_a_second_one_stops_at_once() {
    use std::io::BufRead;
    let mut child = agent_logging_at_info();
    let log = child.stderr.take().unwrap();
    let (lines, said) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(log).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let wait_for = |words: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match said.recv_timeout(left) {
                Ok(line) if line.contains(words) => return line,
                Ok(_) => {}
                Err(_) => panic!("the agent never said {words:?}"),
            }
        }
    };
    let mut agent = AgentProcess::adopt(child);
    let logdir = tempfile::tempdir().unwrap();
    let start_capture = |logdir: &std::path::Path| {
        std::process::Command::new(BIN)
            .args(["capture", &agent.address, "--duration", "60s", "--quiet"])
            .arg("--logdir")
            .arg(logdir)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // A refused request is said in the log, as an accepted one is.
    let refused = std::process::Command::new(BIN)
        .args(["capture", &agent.address, "--duration", "1h", "--quiet"])
        .arg("--logdir")
        .arg(logdir.path().join("refused"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let line = wait_for("capture refused");
    assert!(
        line.contains("InvalidArgument") && line.contains("--max-duration"),
        "{line}"
    );
    // Ctrl-C of a capture (or a service manager's or `timeout`'s SIGTERM):
    // cancelled with a word, nothing left behind, and the command ends as
    // the signal ends commands, so that a script stops too.
    for (signal, named) in [(libc::SIGINT, "Ctrl-C"), (libc::SIGTERM, "SIGTERM")] {
        let cancelled_logdir = logdir.path().join(named);
        let cancelled = start_capture(&cancelled_logdir);
        wait_for("capture requested");
        // SAFETY: signalling the capture this test started.
        unsafe { libc::kill(cancelled.id() as libc::pid_t, signal) };
        let out = cancelled.wait_with_output().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&out.status),
            Some(signal)
        );
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            said.contains(&format!("the capture was cancelled ({named})")),
            "{said}"
        );
        assert!(!cancelled_logdir.exists());
    }

    let mut capture = start_capture(logdir.path());
    wait_for("capture requested");
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: signalling the agent this test started.
    unsafe { libc::kill(agent.pid() as libc::pid_t, libc::SIGTERM) };
    let line = wait_for("stopping");
    assert!(
        line.contains("stopping once the calls and trigger saves in progress end")
            && line.contains("captures=1"),
        "{line}"
    );
    // The same request delivered twice (a wrapper passing Ctrl-C on) is
    // one: the capture goes on.
    // SAFETY: signalling the agent this test started.
    unsafe { libc::kill(agent.pid() as libc::pid_t, libc::SIGINT) };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(capture.try_wait().unwrap().is_none(), "the capture ended");
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(20))
        .expect("a second SIGTERM did not stop the agent");
    assert_eq!(status.code(), Some(130));
    wait_for("stopping now: the calls, trigger saves and writes still in progress are lost");
    assert!(!capture.wait().unwrap().success());
}

/// A stop asked for during a capture lets the capture reach its client
/// whole, every time: the agent keeps each connection open until its peer
/// has read the reply. (Closed with the client's flow-control updates
/// unread, a connection is reset, and the client lost the end of its reply
/// in about one stop in six.)
#[test]
fn a_capture_in_flight_when_the_agent_stops_reaches_its_client() {
    for round in 0..20 {
        let mut agent = AgentProcess::start(&["--metrics-listen", "off"]);
        let logdir = tempfile::tempdir().unwrap();
        let capture = std::process::Command::new(BIN)
            .args(["capture", &agent.address, "--duration", "1500ms", "--quiet"])
            .arg("--logdir")
            .arg(logdir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(700));
        // SIGHUP (a closed terminal, an operator's `kill -HUP`) stops the
        // agent as SIGTERM does; it used to kill it on the spot.
        let signal = if round % 4 == 3 {
            libc::SIGHUP
        } else {
            libc::SIGTERM
        };
        // SAFETY: signalling the agent this test started.
        unsafe { libc::kill(agent.pid() as libc::pid_t, signal) };
        let out = capture.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let written = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            std::fs::metadata(&written).is_ok_and(|m| m.len() > 0),
            "{written}"
        );
        let status = agent
            .wait_for_exit(std::time::Duration::from_secs(30))
            .expect("the agent stops once the capture is out");
        assert!(status.success(), "{status:?}");
    }
}

/// An agent started with SIGHUP ignored (`nohup`) goes on ignoring it: a
/// closed terminal does not stop it.
#[test]
fn an_agent_started_under_nohup_ignores_sighup() {
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new(BIN);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .args(["--metrics-listen", "off"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut agent = AgentProcess::adopt(command.spawn().unwrap());
    // SAFETY: signalling the agent this test started.
    unsafe { libc::kill(agent.pid() as libc::pid_t, libc::SIGHUP) };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        agent.is_running(),
        "SIGHUP stopped an agent started ignoring it"
    );
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(20))
        .expect("SIGTERM stops it");
    assert!(status.success(), "{status:?}");
}

/// A peer that opened an HTTP/2 connection and went silent does not hold a
/// stopping agent: HTTP/2 waits for the peer to answer the goodbye, and the
/// agent closes such connections a few seconds after its last call ended
/// (it waited until the peer's keep-alive timed out, over a minute, so that
/// a supervisor's stop timeout killed it with its trigger saves).
#[test]
fn a_silent_peer_does_not_hold_a_stopping_agent() {
    use std::io::Write;
    let mut agent = AgentProcess::start(&[]);
    let mut silent = std::net::TcpStream::connect(&agent.address).unwrap();
    // The client preface and an empty SETTINGS frame, then nothing more.
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(30))
        .expect("the silent connection held the agent for 30 s");
    assert!(status.success(), "{status:?}");
    drop(silent);
}

/// The highest rate `--mock-rate` accepts still leaves an agent that SIGTERM
/// stops cleanly (at 2^64 - 1, which it refuses now, the generator never
/// caught up with its schedule and never looked at its stop flag).
#[test]
fn sigterm_stops_an_agent_whose_mock_runs_at_the_highest_rate() {
    let rate = devtrace::backend::mock::MAX_EVENTS_PER_SECOND.to_string();
    let mut agent = AgentProcess::start(&["--mock-rate", &rate]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("SIGTERM did not stop the agent within 10 s");
    assert!(status.success(), "{status:?}");
}

/// A continuous session whose client stops asking for snapshots ends by
/// itself after --continuous-timeout; one whose client keeps asking goes on.
#[tokio::test]
async fn an_unattended_continuous_session_ends_by_itself() {
    let agent = AgentProcess::start(&["--continuous-timeout", "2s"]);
    let mut client = agent.client().await;
    let req = continuous_request();
    client
        .start_continuous_profiling(req.clone())
        .await
        .unwrap();
    // Attended: a snapshot every 300 ms, for more than its timeout.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        client
            .get_snapshot(GetSnapshotRequest::default())
            .await
            .expect("an attended session goes on");
    }
    // Unattended for more than twice its timeout: gone.
    tokio::time::sleep(Duration::from_millis(5000)).await;
    let status = client
        .get_snapshot(GetSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    // A new one may start.
    client.start_continuous_profiling(req).await.unwrap();
}

/// A continuous session's request: 1 s snapshots, from when it is asked.
/// A window from before anything the flight recorder holds says so as
/// that: nothing of the window, the recorder's oldest event after its end.
#[tokio::test]
async fn a_window_older_than_the_recorder_says_it_holds_nothing_of_it() {
    let agent = AgentProcess::start(&[]);
    let mut req = request(1000, "too_old");
    req.opts.as_mut().unwrap().start_timestamp_ns = now_ns() - 10_000_000_000;
    let space = space_of(&agent.profile(req).await);
    let said = warnings_with(&space, "flight recorder holds nothing");
    assert_eq!(said.len(), 1, "{:?}", space.warnings);
    assert!(
        said[0].contains("holds nothing of this window: its oldest event is")
            && said[0].contains("s after the window's end"),
        "{}",
        said[0]
    );
}

/// A window the flight recorder lost to its size, not its age, names the
/// flag that bounds it: `--store-size` (the warning named
/// `--store-retention`, which was not the limit).
#[tokio::test]
async fn a_window_cut_by_the_recorders_size_names_store_size() {
    let agent = AgentProcess::start(&["--store-size", "1MiB", "--mock-rate", "500000"]);
    let space = space_of(&agent.profile(request(1500, "small_store")).await);
    // Nothing before some point of the window, or, when a loaded machine
    // builds the trace late, nothing of it at all: either way its size.
    let said = warnings_with(&space, "flight recorder holds nothing");
    assert_eq!(said.len(), 1, "{:?}", space.warnings);
    assert!(
        said[0].contains("evicted to keep the flight recorder within --store-size"),
        "{}",
        said[0]
    );
}

/// Snapshots of a continuous session written under `repository_root`: each
/// a session of its own, named after the start request's, none written
/// over another.
#[tokio::test]
async fn continuous_snapshots_written_by_the_agent_each_keep_their_trace() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let mut client = agent.client().await;
    let repository = dir.path().join("plugins/profile");
    let mut req = continuous_request();
    req.repository_root = repository.display().to_string();
    client.start_continuous_profiling(req).await.unwrap();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        client
            .get_snapshot(GetSnapshotRequest::default())
            .await
            .unwrap();
    }
    // A snapshot named after a session holding its host's trace is not
    // written over it: it comes inline, saying why.
    let named = client
        .get_snapshot(GetSnapshotRequest {
            snapshot_session_id: "continuous".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let space = named.xspace.expect("snapshots carry the XSpace");
    assert_eq!(write_failures(&space).len(), 1, "{:?}", space.warnings);
    client
        .stop_continuous_profiling(StopContinuousProfilingRequest {})
        .await
        .unwrap();
    let mut sessions: Vec<String> = std::fs::read_dir(&repository)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    sessions.sort();
    assert_eq!(sessions, ["continuous", "continuous_2", "continuous_3"]);
    for session in &sessions {
        let files: Vec<_> = std::fs::read_dir(repository.join(session))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{session}: {files:?}");
        assert!(std::fs::metadata(&files[0]).unwrap().len() > 0);
    }
}

fn continuous_request() -> devtrace::proto::tensorflow::ProfileRequest {
    let mut req = request(1000, "continuous");
    if let Some(options) = req.opts.as_mut() {
        options.start_timestamp_ns = 0;
    }
    req
}

/// The agent's log says how each capture ended, not only that it was
/// asked for: answered, or without a reply (a client that went away).
#[tokio::test]
async fn the_log_says_how_each_capture_ended() {
    let mut child = agent_logging_at_info();
    let logged = read_in_background(child.stderr.take().unwrap());
    let mut agent = AgentProcess::adopt(child);
    agent.profile(request(200, "answered")).await;
    let mut client = agent.client().await;
    // Given up by the client (no deadline the agent would know of).
    let abandoned = client.profile(request(3000, "abandoned"));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), abandoned)
            .await
            .is_err(),
        "given up"
    );
    // The agent sees the call go, at once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    agent.stop_with_sigterm(Duration::from_secs(30));
    let log = logged.join().unwrap();
    let ended = |session: &str, how: &str| {
        log.lines()
            .any(|line| line.contains(how) && line.contains(&format!("session={session}")))
    };
    assert!(ended("answered", "capture answered"), "{log}");
    assert!(
        ended("abandoned", "capture dropped before its reply"),
        "{log}"
    );
}

/// `devtrace serve` on the mock, logging at `info`, its standard output and
/// error piped (not yet listening: [`AgentProcess::adopt`] waits).
fn agent_logging_at_info() -> std::process::Child {
    std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .args(["--metrics-listen", "off", "--log-level", "info"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// A capture that fails is logged with the code and reason its client was
/// given, told apart from one whose client went away.
#[tokio::test]
async fn the_log_says_why_a_capture_failed() {
    let (agent, logged) = spawn_logging(
        std::process::Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
            .args(["--metrics-listen", "off", "--log-level", "info"])
            .args(["--mock-rate", "200000", "--capture-memory", "1MiB"]),
    );
    let mut agent = agent;
    let refused = agent
        .client()
        .await
        .profile(request(1000, "too_large"))
        .await
        .expect_err("more than all of --capture-memory");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    agent.stop_with_sigterm(Duration::from_secs(30));
    let log = logged.join().unwrap();
    let line = log
        .lines()
        .find(|line| line.contains("capture failed") && line.contains("session=too_large"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains("code=ResourceExhausted") && line.contains("--capture-memory"),
        "{line}"
    );
    assert!(!log.contains("capture dropped before its reply"), "{log}");
}
