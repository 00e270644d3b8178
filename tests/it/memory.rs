//! The agent in a memory cgroup, as its systemd unit and DaemonSet run it:
//! it reads the limit and sizes its budgets inside it, reports them, and
//! refuses budgets that cannot fit rather than start to be OOM-killed.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;

/// A memory cgroup of its own, removed when dropped; `None` (the test then
/// skips, saying why) where this process cannot make one.
struct MemoryCgroup {
    dir: PathBuf,
    /// The file its limit is in.
    limit_file: PathBuf,
}

impl MemoryCgroup {
    fn with_limit(name: &str, bytes: u64) -> Option<MemoryCgroup> {
        let name = format!("devtrace-test-{name}-{}", std::process::id());
        // cgroup v1's memory hierarchy, else v2's root with the controller.
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup");
        let (dir, limit_file) = if v1.join("memory.limit_in_bytes").exists() {
            let dir = v1.join(&name);
            (dir.clone(), dir.join("memory.limit_in_bytes"))
        } else if std::fs::read_to_string(v2.join("cgroup.subtree_control"))
            .is_ok_and(|controllers| controllers.split_whitespace().any(|c| c == "memory"))
        {
            let dir = v2.join(&name);
            (dir.clone(), dir.join("memory.max"))
        } else {
            eprintln!("skipped: no memory cgroup controller this process can use");
            return None;
        };
        if let Err(error) = std::fs::create_dir(&dir) {
            eprintln!(
                "skipped: cannot make a cgroup at {}: {error}",
                dir.display()
            );
            return None;
        }
        let cgroup = MemoryCgroup { dir, limit_file };
        std::fs::write(&cgroup.limit_file, bytes.to_string()).expect("setting the limit");
        Some(cgroup)
    }

    /// `devtrace serve ARGS` started inside the cgroup (a shell moves
    /// itself in, then becomes the agent), on the mock at 1,000 events a
    /// second unless ARGS say another rate.
    fn serve(&self, args: &[&str]) -> Command {
        let procs = self.dir.join("cgroup.procs");
        let rate: &[&str] = if args.contains(&"--mock-rate") {
            &[]
        } else {
            &["--mock-rate", "1000"]
        };
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "echo $$ > '{}' && exec \"$0\" serve --listen 127.0.0.1:0 \
                 --metrics-listen 127.0.0.1:0 --backend mock \"$@\"",
                procs.display()
            ))
            .arg(BIN)
            .args(rate)
            .args(args)
            .stdin(Stdio::null());
        command
    }
}

impl MemoryCgroup {
    /// How many processes the kernel has OOM-killed in the cgroup.
    fn oom_kills(&self) -> u64 {
        let counters = ["memory.oom_control", "memory.events"]
            .iter()
            .find_map(|name| std::fs::read_to_string(self.dir.join(name)).ok())
            .unwrap_or_default();
        counters
            .lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Empty once the agent has exited.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

#[test]
fn in_a_memory_cgroup_the_budgets_are_sized_inside_its_limit() {
    let limit: u64 = 768 << 20;
    let Some(cgroup) = MemoryCgroup::with_limit("sized", limit) else {
        return;
    };
    let child = cgroup
        .serve(&[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let pid = child.id();
    let (mut agent, metrics) = AgentProcess::adopt_with_metrics(child);
    let (status, text) = http_get(&metrics, "/metrics");
    assert_eq!(status, 200);
    let value = |name: &str| -> f64 {
        metric_value(&text, name, &[]).unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    // This cgroup's limit, or a tighter one above it.
    let seen = value("devtrace_memory_limit_bytes");
    assert!(seen > 0.0 && seen <= limit as f64, "{seen} for {limit}");
    let store = value("devtrace_flight_recorder_limit_bytes");
    let capture = value("devtrace_capture_memory_budget_bytes");
    assert!(store > 0.0 && capture > 0.0, "{text}");
    assert!(
        store + capture < limit as f64,
        "{store} + {capture} in {limit}"
    );
    // Nothing is being captured: nothing of the capture budget is held.
    assert_eq!(value("devtrace_capture_memory_held_bytes"), 0.0);
    assert!(agent.is_running(), "agent {pid} exited");
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());
}

#[test]
fn budgets_that_cannot_fit_the_cgroups_limit_are_refused_at_start() {
    let Some(cgroup) = MemoryCgroup::with_limit("refused", 768 << 20) else {
        return;
    };
    let out = cgroup
        .serve(&["--store-size", "512MiB", "--capture-memory", "1GiB"])
        .output()
        .expect("running the agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--store-size 512 MiB and --capture-memory 1.0 GiB")
            && stderr.contains(&cgroup.limit_file.display().to_string()),
        "{stderr}"
    );
}

/// `/healthz` on `metrics` answers 200 within the 2 s a liveness probe
/// waits.
fn assert_healthy_within_2s(metrics: &str) {
    let (status, _) = http_get_within(metrics, "/healthz", Some(std::time::Duration::from_secs(2)))
        .expect("/healthz answered within 2 s");
    assert_eq!(status, 200);
}

/// Starts `devtrace capture` of a `duration_ms` window that began `back_ms`
/// ago, from the agent at `address`.
fn capture_back(
    address: &str,
    logdir: &Path,
    duration_ms: u64,
    back_ms: u64,
) -> std::process::Child {
    Command::new(BIN)
        .args(["capture", address, "--quiet", "--logdir"])
        .arg(logdir)
        .arg(format!("--duration={duration_ms}ms"))
        .arg(format!("--delay-back={back_ms}ms"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting a capture")
}

/// Sixteen concurrent captures of distinct windows, whose traces together
/// are more than the cgroup holds, with a session fanned out to the agent
/// itself and a trigger's save among them: the capture budget makes them
/// take turns (or refuses them, saying so) instead of the kernel killing
/// the agent.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_distinct_captures_stays_inside_the_cgroup_each_delivered_or_refused_naming_the_budget(
) {
    let Some(cgroup) = MemoryCgroup::with_limit("burst", 384 << 20) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let root = work.path().display().to_string();
    let repository = work.path().join("plugins/profile");
    let trigger_repository = repository.display().to_string();
    // 400,000 events a second: 2 s windows of about 55 MB of trace each,
    // 16 of them 880 MB. The budget holds one.
    let child = cgroup
        .serve(&[
            "--mock-rate",
            "400000",
            "--store-size",
            "64MiB",
            "--capture-memory",
            "120MiB",
            "--ring-capacity",
            "16384",
            "--allow-root",
            &root,
            "--trigger-repository",
            &trigger_repository,
            "--trigger",
            "name=burst; when=explicit; before=1500ms; after=500ms",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the agent");
    let (mut agent, metrics) = AgentProcess::adopt_with_metrics(child);
    // Windows that end close together, so that their builds overlap;
    // distinct, so that none shares another's build.
    let start_ns = common::now_ns() + 1_000_000_000;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..16u64 {
        let mut client = agent.client().await;
        let mut request = common::request(2000, &format!("burst-{i}"));
        if let Some(options) = request.opts.as_mut() {
            options.start_timestamp_ns = start_ns + i * 37_000_000;
        }
        calls.spawn(async move { client.profile(request).await.map(|_| ()) });
    }
    // A session of the agent's own window, written under the root, and a
    // trigger's save of the past, both during the burst.
    let session = {
        let mut analysis = agent.analysis().await;
        let request = common::session_request(&repository, &[agent.address.as_str()], "fanned");
        tokio::spawn(async move { analysis.new_session(request).await })
    };
    let fired = common::devtrace(
        ["trigger", "burst", "--agent", &agent.address]
            .map(String::from)
            .to_vec(),
    )
    .await;
    assert!(
        fired.status.success(),
        "{}",
        String::from_utf8_lossy(&fired.stderr)
    );
    let (mut delivered, mut refused) = (0, 0);
    while let Some(call) = calls.join_next().await {
        match call.expect("a call") {
            Ok(()) => delivered += 1,
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                assert!(
                    status.message().contains("--capture-memory"),
                    "a capture failed without naming the budget: {status:?}"
                );
                refused += 1;
            }
        }
    }
    let session = session
        .await
        .unwrap()
        .expect("the session ran")
        .into_inner();
    assert!(
        session.error_message.is_empty() || session.error_message.contains("--capture-memory"),
        "{session:?}"
    );
    // The save: written, or failed for want of memory (the log says).
    let waited = std::time::Instant::now();
    let counts = loop {
        assert!(
            waited.elapsed() < std::time::Duration::from_secs(90),
            "the trigger's save neither saved nor failed"
        );
        let text = agent.monitor(10).await.data;
        let line = text
            .lines()
            .find(|line| line.starts_with("trigger burst: "))
            .unwrap_or_default()
            .to_string();
        if line.contains("saved 1") || line.contains("failed 1") {
            break line;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(counts.contains("fired 1"), "{counts}");
    assert_eq!(cgroup.oom_kills(), 0, "the kernel OOM-killed in the cgroup");
    assert!(agent.is_running(), "the agent died in the burst");
    assert!(
        delivered > 0,
        "none of the burst was delivered ({refused} refused)"
    );
    // Still answering, its flight recorder with it.
    assert_healthy_within_2s(&metrics);
    let after = capture_back(&agent.address, &work.path().join("after"), 200, 500)
        .wait_with_output()
        .expect("capture ran");
    assert!(
        after.status.success(),
        "{}",
        String::from_utf8_lossy(&after.stderr)
    );
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());
}

/// The same cgroup under a hostile mix at once: six local users
/// holding 4 MiB request bodies half sent on a dozen calls each, hundreds
/// of idle connections from eight more users, and three tool requests on a large
/// session file (one whose output would be ten times the file). The agent
/// is not OOM-killed, a capture and `/healthz` still answer meanwhile, and
/// every tool request is answered or refused naming the budget.
#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_mix_of_bodies_connections_and_tool_requests_stays_inside_the_cgroup() {
    use common::raw_call::{connect_from, half_sent_call_from, read_reply};
    use devtrace::proto::tensorflow::ProfileSessionDataRequest;

    let Some(cgroup) = MemoryCgroup::with_limit("hostile", 384 << 20) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let root = work.path().display().to_string();
    let child = cgroup
        .serve(&[
            "--mock-rate",
            "200000",
            "--store-size",
            "48MiB",
            "--capture-memory",
            "96MiB",
            "--ring-capacity",
            "16384",
            "--allow-root",
            &root,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the agent");
    let (mut agent, metrics) = AgentProcess::adopt_with_metrics(child);
    // The large session file: 2 s at 200,000 events a second (about 27 MB),
    // written by the client, outside the cgroup.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let written = Command::new(BIN)
        .args(["capture", &agent.address, "--quiet", "--session-id", "big"])
        .args(["--override-hostname", "worker", "--duration=2000ms"])
        .arg("--delay-back=2000ms")
        .arg("--logdir")
        .arg(work.path())
        .output()
        .expect("capture ran");
    let said = String::from_utf8_lossy(&written.stderr);
    assert!(written.status.success(), "{said}");
    // The agent served the past window itself.
    assert!(!said.contains("after the window's start"), "{said}");
    let repository = work.path().join("plugins/profile");
    let file = repository.join("big/worker.xplane.pb");
    let file_bytes = std::fs::metadata(&file).expect("the session file").len();
    assert!(file_bytes > 10 << 20, "{file_bytes} bytes");

    // Half-sent bodies: 6 local users x 12 calls x 4 MiB claimed, three
    // times what one caller may hold and more than all callers together
    // may. (A local caller is bounded as its user, whatever its address.)
    let claimed = (devtrace::service::MAX_REQUEST_BYTES - 5) as u32;
    let sent = claimed as usize - 1000;
    let mut bodies = Vec::new();
    for peer in 0..6u8 {
        for _ in 0..12 {
            bodies.push(
                half_sent_call_from(
                    61_000 + u32::from(peer),
                    [127, 0, 2, peer + 1],
                    &agent.address,
                    claimed,
                    sent,
                )
                .await,
            );
        }
    }
    // Idle connections: 8 local users x 60.
    let mut idle = Vec::new();
    for peer in 0..8u8 {
        let uid = 62_000 + u32::from(peer);
        for _ in 0..60 {
            idle.push(connect_from(uid, [127, 0, 3, peer + 1], &agent.address).await);
        }
    }
    // Tool requests on the large file.
    let mut tools = tokio::task::JoinSet::new();
    for tool in ["trace_viewer", "xplane", "overview"] {
        let mut analysis = agent.analysis().await;
        let request = ProfileSessionDataRequest {
            repository_root: repository.display().to_string(),
            session_id: "big".into(),
            host_name: "worker".into(),
            tool_name: tool.into(),
            parameters: Default::default(),
        };
        tools.spawn(async move {
            (
                tool,
                analysis
                    .get_session_tool_data(request)
                    .await
                    .map(|reply| reply.into_inner().output.len()),
            )
        });
    }
    // Meanwhile a capture and the health probe answer.
    let space = space_of(&agent.profile(request(500, "through-it")).await);
    assert!(!space.planes.is_empty());
    assert_healthy_within_2s(&metrics);

    let mut served = Vec::new();
    while let Some(answer) = tools.join_next().await {
        let (tool, answer) = answer.expect("a tool request");
        match answer {
            Ok(bytes) => {
                assert!(bytes > 0, "{tool}: empty output");
                served.push(tool);
            }
            Err(status) => {
                assert_eq!(
                    status.code(),
                    tonic::Code::ResourceExhausted,
                    "{tool}: {status:?}"
                );
                assert!(
                    status.message().contains("--capture-memory"),
                    "{tool}: refused without naming the budget: {status:?}"
                );
            }
        }
    }
    // The file itself (twice its size) fits the budget.
    assert!(served.contains(&"xplane"), "served: {served:?}");
    // Every half-sent body ends: refused past its caller's share, or out
    // of time; none is served.
    for call in bodies {
        let (_, status) = read_reply(call.response).await;
        assert!(
            matches!(
                status.code(),
                tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded
            ),
            "{status:?}"
        );
    }
    drop(idle);
    assert_eq!(cgroup.oom_kills(), 0, "the kernel OOM-killed in the cgroup");
    assert!(agent.is_running(), "the agent died");
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());
}

/// A window whose trace is larger than all of `--capture-memory`, in a
/// cgroup that could not hold many such traces: its finished blocks are
/// spilled to `--spill-dir` and the whole trace is delivered, nothing is
/// OOM-killed and no file is left with a name there. With `--spill-size`
/// too small for it, the same window is refused naming that flag.
#[tokio::test(flavor = "multi_thread")]
async fn a_trace_larger_than_the_capture_budget_is_spilled_and_delivered() {
    let Some(cgroup) = MemoryCgroup::with_limit("spill", 384 << 20) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let spill_dir = work.path().join("spill");
    std::fs::create_dir(&spill_dir).unwrap();
    let spill_dir = spill_dir.display().to_string();
    let serve = |spill_size: &str| {
        let child = cgroup
            .serve(&[
                "--mock-rate",
                "400000",
                "--store-size",
                "64MiB",
                "--capture-memory",
                "32MiB",
                "--ring-capacity",
                "16384",
                "--spill-dir",
                &spill_dir,
                "--spill-size",
                spill_size,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the agent");
        AgentProcess::adopt_with_metrics(child).0
    };
    // A 2 s window of the past: about 800,000 events, a trace of about
    // 55 MB (still over 40 MB when a busy machine slows the mock) against a
    // 32 MiB budget.
    let past_window = |session: &str| {
        let mut request = common::request(2000, session);
        if let Some(options) = request.opts.as_mut() {
            options.start_timestamp_ns = common::now_ns() - 2_300_000_000;
        }
        request
    };
    let mut agent = serve("1GiB");
    tokio::time::sleep(std::time::Duration::from_millis(2600)).await;
    let reply = agent
        .client()
        .await
        .profile(past_window("spilled"))
        .await
        .expect("the capture was delivered")
        .into_inner();
    let bytes: usize = reply.tool_data.iter().map(|tool| tool.data.len()).sum();
    assert!(bytes > 32 << 20, "a {bytes}-byte trace needed no spill");
    let space = common::space_of(&reply);
    assert!(
        common::event_count(&space) > 500_000,
        "{} events",
        common::event_count(&space)
    );
    drop((reply, space));
    assert_eq!(cgroup.oom_kills(), 0, "the kernel OOM-killed in the cgroup");
    assert!(agent.is_running(), "the agent died building the trace");
    assert_eq!(
        std::fs::read_dir(&spill_dir).unwrap().count(),
        0,
        "a spill file was left with a name"
    );
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());

    let mut agent = serve("4MiB");
    tokio::time::sleep(std::time::Duration::from_millis(2600)).await;
    let refused = agent
        .client()
        .await
        .profile(past_window("refused"))
        .await
        .expect_err("a trace past --spill-size was delivered");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("--spill-size"),
        "{}",
        refused.message()
    );
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());
}

/// Files that decode to far more than their size, put into a session by
/// anyone who can write under the repository: 8 MiB of empty planes (two
/// bytes each on the wire, a couple of hundred decoded) and a Riegeli file
/// of a few KiB whose chunks inflate to 384 MiB. XProf's listing and tool
/// requests on them are refused naming --capture-memory, or served within
/// it; the agent, in a cgroup far smaller than what decoding them would
/// take, is not OOM-killed and goes on serving (it was, at the first
/// listing, when the sizes on disk were all it went by).
#[tokio::test(flavor = "multi_thread")]
async fn traces_that_decode_far_larger_than_their_size_are_refused_not_decoded() {
    use devtrace::proto::tensorflow::{
        EnumProfileSessionsAndToolsRequest, ProfileSessionDataRequest,
    };

    let Some(cgroup) = MemoryCgroup::with_limit("bombs", 512 << 20) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let session = work.path().join("bombs");
    std::fs::create_dir(&session).unwrap();
    // 8 MiB: the reservation by size (ten times it) fits the budget.
    let empty_planes = |bytes: usize| [0x0a, 0x00].repeat(bytes / 2);
    std::fs::write(session.join("planes.xplane.pb"), empty_planes(8 << 20)).unwrap();
    let mut inflating = devtrace::xspace::riegeli::FileWriter::default();
    for _ in 0..2 {
        inflating.write_record(&empty_planes(192 << 20)).unwrap();
    }
    let inflating = inflating.into_bytes();
    assert!(inflating.len() < 64 << 10, "{} bytes", inflating.len());
    std::fs::write(session.join("inflating.xplane.riegeli"), inflating).unwrap();
    let root = work.path().display().to_string();
    let child = cgroup
        .serve(&["--capture-memory", "96MiB", "--store-size", "32MiB"])
        .args(["--allow-root", &root])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the agent");
    let (mut agent, metrics) = AgentProcess::adopt_with_metrics(child);

    let mut analysis = agent.analysis().await;
    let listed = analysis
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.clone(),
        })
        .await
        .expect("EnumSessions")
        .into_inner();
    assert_eq!(listed.sessions.len(), 1, "{listed:?}");
    for (host, tool) in [
        ("planes", "overview"),
        ("planes", "trace_viewer"),
        ("inflating", "overview"),
    ] {
        let refused = analysis
            .get_session_tool_data(ProfileSessionDataRequest {
                repository_root: root.clone(),
                session_id: "bombs".into(),
                host_name: host.into(),
                tool_name: tool.into(),
                parameters: Default::default(),
            })
            .await
            .expect_err("served a trace that decodes past the budget");
        assert_eq!(
            refused.code(),
            tonic::Code::ResourceExhausted,
            "{host} {tool}: {refused:?}"
        );
        let said = refused.message();
        assert!(
            (said.contains("decodes to") || said.contains("decompresses to"))
                && said.contains("more than all of --capture-memory"),
            "{host} {tool}: {refused:?}"
        );
    }
    // Still serving, inside its cgroup.
    let space = space_of(&agent.profile(request(300, "after")).await);
    assert!(!space.planes.is_empty());
    assert_healthy_within_2s(&metrics);
    assert_eq!(cgroup.oom_kills(), 0, "the kernel OOM-killed in the cgroup");
    assert!(agent.is_running(), "the agent died");
    let status = agent
        .stop_with_sigterm(std::time::Duration::from_secs(10))
        .expect("stopped");
    assert!(status.success());
}
