//! ProfileAnalysis over real agents on loopback: a session across several
//! hosts (some down, slow or empty), listing sessions, and tool data.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::{
    EnumProfileSessionsAndToolsRequest, NewProfileSessionRequest, ProfileSessionDataRequest,
};
use prost::Message;
use tonic::Code;

/// Accepts connections and never answers: a host past its deadline.
fn silent_host() -> (std::net::TcpListener, String) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    (listener, address)
}

fn unused_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

#[tokio::test]
async fn a_session_lands_every_good_host_and_names_each_failure() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("logs/plugins/profile");
    let coordinator = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let worker = AgentProcess::start(&[]);
    let empty = AgentProcess::start(&["--mock-rate", "0"]);
    let (_silent, slow) = silent_host();
    let down = unused_address();
    let hosts = [
        coordinator.address.as_str(),
        worker.address.as_str(),
        empty.address.as_str(),
        slow.as_str(),
        down.as_str(),
    ];
    let reply = coordinator
        .new_session_within(
            session_request(&root, &hosts, "fleet"),
            Duration::from_secs(6),
        )
        .await;
    assert!(!reply.empty_trace);
    let errors = reply.error_message;
    assert!(
        errors.contains(&format!("{}: returned an empty trace", empty.address)),
        "{errors}"
    );
    assert!(
        errors.contains(&format!("{slow}: no reply within")),
        "{errors}"
    );
    assert!(
        errors.contains(&format!("{down}: cannot connect")),
        "{errors}"
    );
    assert!(
        !errors.contains(&coordinator.address) && !errors.contains(&worker.address),
        "{errors}"
    );

    let mut files: Vec<String> = std::fs::read_dir(root.join("fleet"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let mut expected = vec![
        format!("{}.xplane.pb", coordinator.address.replace(':', "_")),
        format!("{}.xplane.pb", worker.address.replace(':', "_")),
    ];
    expected.sort();
    assert_eq!(files, expected);
    // One shared window: both traces start at the same instant.
    let starts: Vec<u64> = files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(root.join("fleet").join(f)).unwrap();
            window_of(&XSpace::decode(bytes.as_slice()).unwrap()).0
        })
        .collect();
    assert_eq!(starts[0], starts[1]);

    // Named again with a host it holds a trace of: refused before any host
    // is called, and no trace written over.
    let held: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(root.join("fleet").join(f)).unwrap())
        .collect();
    let again = coordinator
        .analysis()
        .await
        .new_session(session_request(
            &root,
            &[empty.address.as_str(), worker.address.as_str()],
            "fleet",
        ))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    let worker_file = format!("{}.xplane.pb", worker.address.replace(':', "_"));
    assert!(
        again.message().contains(&worker_file),
        "{}",
        again.message()
    );
    for (file, bytes) in files.iter().zip(&held) {
        assert_eq!(
            &std::fs::read(root.join("fleet").join(file)).unwrap(),
            bytes
        );
    }
}

#[tokio::test]
async fn only_empty_hosts_make_an_empty_session() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&[
        "--allow-root",
        dir.path().to_str().unwrap(),
        "--mock-rate",
        "0",
    ]);
    let reply = agent
        .analysis()
        .await
        .new_session(session_request(
            dir.path(),
            &[agent.address.as_str()],
            "quiet",
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.empty_trace);
    assert!(reply.error_message.contains("returned an empty trace"));
}

#[tokio::test]
async fn session_paths_and_hosts_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let mut client = agent.analysis().await;
    let host = agent.address.as_str();
    let outside = client
        .new_session(session_request(&dir.path().join("elsewhere"), &[host], "s"))
        .await
        .unwrap_err();
    assert_eq!(outside.code(), Code::PermissionDenied);
    assert!(
        outside.message().starts_with("repository_root: "),
        "{}",
        outside.message()
    );
    assert!(!dir.path().join("elsewhere").exists());
    for (req, field) in [
        (session_request(&allowed, &[host], "../up"), "session_id"),
        (session_request(&allowed, &[host], "a/b"), "session_id"),
        (
            session_request(&allowed, &[host, "bad/host:1"], "s"),
            "hosts[1]",
        ),
        (
            session_request(&allowed, &[host, "h:99999"], "s"),
            "hosts[1]",
        ),
        (session_request(&allowed, &[], "s"), "hosts"),
        (
            NewProfileSessionRequest {
                request: None,
                ..session_request(&allowed, &[host], "s")
            },
            "request",
        ),
    ] {
        let status = client.new_session(req).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "{}",
            status.message()
        );
    }
    let escape = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: format!("{}/../", allowed.display()),
        })
        .await
        .unwrap_err();
    assert_eq!(escape.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn sessions_are_listed_newest_first_with_their_tools() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("plugins/profile");
    let agent = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let mut client = agent.analysis().await;

    let missing = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.display().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    std::fs::create_dir_all(&root).unwrap();
    let listed = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sessions.is_empty());

    client
        .new_session(session_request(&root, &[agent.address.as_str()], "first"))
        .await
        .unwrap();
    // A crowded root: many sessions holding copies of that trace, plus
    // directories and files that are not sessions.
    let trace = std::fs::read(
        root.join("first")
            .join(format!("{}.xplane.pb", agent.address.replace(':', "_"))),
    )
    .unwrap();
    for i in 0..40 {
        let session = root.join(format!("copy_{i:02}"));
        std::fs::create_dir_all(&session).unwrap();
        std::fs::write(session.join("worker.xplane.pb"), &trace).unwrap();
        // Sessions are ordered by when their traces were written.
        let when = std::time::SystemTime::now() + Duration::from_secs(i + 1);
        std::fs::File::options()
            .write(true)
            .open(session.join("worker.xplane.pb"))
            .unwrap()
            .set_modified(when)
            .unwrap();
    }
    std::fs::create_dir_all(root.join("not_a_session")).unwrap();
    std::fs::write(root.join("stray.txt"), b"x").unwrap();
    let listed = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = listed
        .sessions
        .iter()
        .map(|s| s.session_id.as_str())
        .collect();
    assert_eq!(names.len(), 41);
    assert_eq!(names[0], "copy_39");
    assert_eq!(names[39], "copy_00");
    assert_eq!(names[40], "first");
    assert_eq!(
        listed.sessions[0].available_tools,
        vec![
            "kernel_stats",
            "memory_profile",
            "overview",
            "trace_viewer",
            "xplane"
        ]
    );
    assert!(listed.error_message.is_empty(), "{}", listed.error_message);

    // A session's own directory (XProf pointed one level too deep) lists
    // nothing, and says why.
    let within = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.join("first").display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(within.sessions.is_empty());
    assert!(
        within
            .error_message
            .contains("is a session itself (it holds traces)"),
        "{}",
        within.error_message
    );
}

#[tokio::test]
async fn tool_data_serves_every_tool_and_refuses_what_it_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("plugins/profile");
    let agent = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let mut client = agent.analysis().await;
    client
        .new_session(session_request(&root, &[agent.address.as_str()], "run"))
        .await
        .unwrap();
    let host = agent.address.replace(':', "_");
    let ask = |tool: &str, host: &str, parameters: &[(&str, &str)]| ProfileSessionDataRequest {
        repository_root: root.display().to_string(),
        session_id: "run".into(),
        host_name: host.to_string(),
        tool_name: tool.to_string(),
        parameters: parameters
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>(),
    };
    let file = std::fs::read(root.join("run").join(format!("{host}.xplane.pb"))).unwrap();
    let blob = client
        .get_session_tool_data(ask("xplane", &host, &[]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(blob.output_format, "blob");
    assert_eq!(blob.output, file);

    for tool in ["trace_viewer", "memory_profile", "kernel_stats", "overview"] {
        let reply = client
            .get_session_tool_data(ask(tool, &host, &[]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.output_format, "json", "{tool}");
        let text = String::from_utf8(reply.output).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(json.is_object(), "{tool}");
    }
    let all_hosts = client
        .get_session_tool_data(ask("overview", "", &[]))
        .await
        .unwrap()
        .into_inner();
    let json: serde_json::Value = serde_json::from_slice(&all_hosts.output).unwrap();
    assert!(json["hosts"][&host].is_object(), "{json}");

    let capped = client
        .get_session_tool_data(ask(
            "trace_viewer",
            &host,
            &[("resolution", "50"), ("end_time_ms", "100")],
        ))
        .await
        .unwrap()
        .into_inner();
    let json: serde_json::Value = serde_json::from_slice(&capped.output).unwrap();
    let complete = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    assert!(
        (1..=50).contains(&complete),
        "{complete} events with resolution 50"
    );
    // The command line says what a cut output leaves out.
    let cut = std::process::Command::new(BIN)
        .args(["tool", dir.path().to_str().unwrap(), "run", "trace_viewer"])
        .args(["--host", &host, "--param", "resolution=50"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&cut.stderr);
    assert!(cut.status.success(), "{said}");
    assert!(
        said.contains(&format!("trace_viewer: {host}: 50 of the ")),
        "{said}"
    );
    let whole = std::process::Command::new(BIN)
        .args(["tool", dir.path().to_str().unwrap(), "run", "trace_viewer"])
        .args(["--host", &host, "--param", "resolution=0"])
        .output()
        .unwrap();
    assert!(whole.status.success());
    assert!(!String::from_utf8_lossy(&whole.stderr).contains("events in the window"));

    for (req, code, field) in [
        (
            ask("flame_graph", &host, &[]),
            Code::InvalidArgument,
            "tool_name",
        ),
        (ask("overview", "nohost", &[]), Code::NotFound, "host_name"),
        (
            ask("trace_viewer", &host, &[("resolution", "many")]),
            Code::InvalidArgument,
            "parameters[resolution]",
        ),
        (
            ask("kernel_stats", &host, &[("colour", "red")]),
            Code::InvalidArgument,
            "parameters[colour]",
        ),
        (
            ask("trace_viewer", &host, &[("start_time_ms", "-5")]),
            Code::InvalidArgument,
            "parameters[start_time_ms]",
        ),
        (
            ask(
                "trace_viewer",
                &host,
                &[("start_time_ms", "9"), ("end_time_ms", "inf")],
            ),
            Code::InvalidArgument,
            "parameters[end_time_ms]",
        ),
        (
            ask("overview", "../x", &[]),
            Code::InvalidArgument,
            "host_name",
        ),
    ] {
        let status = client.get_session_tool_data(req).await.unwrap_err();
        assert_eq!(status.code(), code, "{field}: {status:?}");
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "{}",
            status.message()
        );
    }
    let mut missing = ask("overview", &host, &[]);
    missing.session_id = "nope".into();
    assert_eq!(
        client
            .get_session_tool_data(missing)
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
}

#[tokio::test]
async fn sessions_are_read_without_following_links_out_of_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    let root = allowed.join("plugins/profile");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(outside.join("session")).unwrap();
    let secret = XSpace {
        hostnames: vec!["secret".into()],
        ..XSpace::default()
    }
    .encode_to_vec();
    std::fs::write(outside.join("secret.xplane.pb"), &secret).unwrap();
    std::fs::write(outside.join("session/worker.xplane.pb"), &secret).unwrap();
    // A trace file that is a link, and a session directory that is one.
    std::fs::create_dir_all(root.join("leak")).unwrap();
    std::os::unix::fs::symlink(
        outside.join("secret.xplane.pb"),
        root.join("leak/worker.xplane.pb"),
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.join("session"), root.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(&outside, allowed.join("linked")).unwrap();
    // A FIFO named like a trace: reading it would wait for a writer forever.
    let fifo = std::ffi::CString::new(
        root.join("leak/stalled.xplane.pb")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    // SAFETY: a valid path; makes a FIFO no one writes to.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    let agent = AgentProcess::start(&["--allow-root", allowed.to_str().unwrap()]);
    let mut client = agent.analysis().await;
    let ask = |session: &str| ProfileSessionDataRequest {
        repository_root: root.display().to_string(),
        session_id: session.to_string(),
        host_name: "worker".into(),
        tool_name: "xplane".into(),
        parameters: HashMap::new(),
    };
    for (session, link) in [
        ("leak", "leak/worker.xplane.pb"),
        ("elsewhere", "elsewhere"),
    ] {
        let status = client
            .get_session_tool_data(ask(session))
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::PermissionDenied,
            "{session}: {status:?}"
        );
        assert!(
            status.message().contains("symbolic link") && status.message().contains(link),
            "{}",
            status.message()
        );
    }
    let mut stalled = ask("leak");
    stalled.host_name = "stalled".into();
    let status = client.get_session_tool_data(stalled).await.unwrap_err();
    assert!(
        status.message().contains("not a regular file"),
        "{}",
        status.message()
    );
    let listed = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(listed.len(), 1, "a linked directory is not a session");
    assert_eq!(listed[0].session_id, "leak");
    // A repository root reached through a link is refused as a whole.
    let status = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: allowed.join("linked").display().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut through_link = ask("session");
    through_link.repository_root = allowed.join("linked").display().to_string();
    let status = client
        .get_session_tool_data(through_link)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
}

/// Tool requests on stored sessions draw from the capture budget: one whose
/// conversion needs more than all of it is refused at once, naming it, and
/// a cheaper one on the same trace is served.
#[tokio::test]
async fn a_tool_request_larger_than_the_capture_budget_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("plugins/profile");
    let agent = AgentProcess::start(&[
        "--allow-root",
        dir.path().to_str().unwrap(),
        "--capture-memory",
        "8MiB",
    ]);
    let mut client = agent.analysis().await;
    let made = client
        .new_session(session_request(&root, &[agent.address.as_str()], "run"))
        .await
        .unwrap()
        .into_inner();
    assert!(made.error_message.is_empty(), "{made:?}");
    let host = agent.address.replace(':', "_");
    let file = root.join("run").join(format!("{host}.xplane.pb"));
    let size = std::fs::metadata(&file).unwrap().len();
    // Decoded and converted, the trace takes ten times its size.
    assert!(size * 11 > 8 << 20 && size * 2 < 8 << 20, "{size}");
    let ask = |tool: &str| ProfileSessionDataRequest {
        repository_root: root.display().to_string(),
        session_id: "run".into(),
        host_name: host.clone(),
        tool_name: tool.to_string(),
        parameters: HashMap::new(),
    };
    let refused = client
        .get_session_tool_data(ask("trace_viewer"))
        .await
        .expect_err("more than the whole budget");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("computing trace_viewer")
            && refused
                .message()
                .contains("more than all of --capture-memory"),
        "{refused:?}"
    );
    let blob = client
        .get_session_tool_data(ask("xplane"))
        .await
        .expect("the file itself fits")
        .into_inner();
    assert_eq!(blob.output.len() as u64, size);
}
