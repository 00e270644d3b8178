//! Captures on a shared node, with the agent as root and clients as other
//! users: a user who is not an admin captures only its own processes (the
//! mock's simulated job here belongs to uid 1001), captures of the same
//! window by different users never share a trace, a session run for a
//! user is captured for that user, and callers the kernel cannot name get
//! nothing. The real kernel's scheduler data and CUDA workloads are scoped
//! in `ebpf.rs` and `cuda.rs`.

use crate::common;

use std::os::unix::fs::MetadataExt;

use common::raw_call::{connect_as, new_session_as, unary_on};
use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::{ProfileRequest, ProfileResponse};
use devtrace::xspace::read::{find_stat, StatValue};
use prost::Message;

const PROFILE: &str = "/tensorflow.ProfilerService/Profile";

fn skip_without_root() -> bool {
    if is_root() {
        return false;
    }
    eprintln!("skipped: needs root to call as other users");
    true
}

/// `request` made as `uid`: the reply (or its status).
async fn profile_as(
    uid: u32,
    address: &str,
    request: &ProfileRequest,
) -> Result<ProfileResponse, tonic::Status> {
    let io = connect_as(uid, address).await;
    let (reply, status) = unary_on(io, address, PROFILE, request).await;
    if status.code() != tonic::Code::Ok {
        return Err(status);
    }
    Ok(ProfileResponse::decode(&reply[..]).expect("a ProfileResponse"))
}

/// The Task Environment's `name`, as text.
fn environment(space: &XSpace, name: &str) -> Option<String> {
    let env = plane(space, "Task Environment");
    match find_stat(env, &env.stats, name) {
        Some(StatValue::Str(text)) => Some(text),
        _ => None,
    }
}

/// Kernels on the first GPU's planes (the mock's job runs on every GPU).
fn kernels(space: &XSpace) -> usize {
    space
        .planes
        .iter()
        .filter(|p| p.name.starts_with("/device:GPU:"))
        .flat_map(|p| &p.lines)
        .flat_map(|l| &l.events)
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_captures_only_its_own_job_and_the_trace_says_whose_it_is() {
    if skip_without_root() {
        return;
    }
    let agent = AgentProcess::start(&["--mock-uid", "1001", "--mock-rate", "20000"]);
    // The same window for all three, so that a shared build would show.
    let mut asked = request(400, "scoped");
    asked.emit_xspace = true;
    let (nobody, owner, root) = tokio::join!(
        profile_as(65534, &agent.address, &asked),
        profile_as(1001, &agent.address, &asked),
        profile_as(0, &agent.address, &asked),
    );
    let nobody = nobody.expect("uid 65534 may capture");
    let owner = owner.expect("uid 1001 may capture");
    let root = root.expect("root may capture");

    // uid 65534 runs nothing traced: no events, and why.
    assert!(nobody.empty_trace);
    let space = space_of(&nobody);
    assert_eq!(event_count(&space), 0);
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.starts_with("this trace is scoped to the processes of uid 65534")),
        "{:?}",
        space.warnings
    );
    assert_eq!(
        environment(&space, "devtrace_scope").as_deref(),
        Some("uid 65534")
    );

    // The job's owner sees its job; root sees it too, unscoped.
    let theirs = space_of(&owner);
    assert!(kernels(&theirs) > 0, "uid 1001's trace has no kernels");
    assert_eq!(
        environment(&theirs, "devtrace_scope").as_deref(),
        Some("uid 1001")
    );
    let whole = space_of(&root);
    assert!(kernels(&whole) > 0);
    assert_eq!(environment(&whole, "devtrace_scope"), None);
    assert!(!whole
        .warnings
        .iter()
        .any(|w| w.starts_with("this trace is scoped")));
}

/// A NewSession asked by a user is captured for that user: the agent calls
/// itself on the user's behalf, so the trace it writes is scoped to the
/// user (not to the agent's root) and written as the user's file.
#[tokio::test(flavor = "multi_thread")]
async fn a_users_session_of_this_host_is_captured_for_that_user() {
    if skip_without_root() {
        return;
    }
    let shared = shared_directory();
    let agent = AgentProcess::start(&[
        "--allow-root",
        shared.path().to_str().unwrap(),
        "--mock-uid",
        "1001",
        "--mock-rate",
        "20000",
    ]);
    let hosts = [agent.address.as_str()];
    let request = session_request(shared.path(), &hosts, "theirs");
    let reply = new_session_as(1001, &agent.address, &request).await;
    assert!(reply.error_message.is_empty(), "{}", reply.error_message);
    let file = std::fs::read_dir(shared.path().join("theirs"))
        .unwrap()
        .next()
        .expect("the host's trace")
        .unwrap();
    assert_eq!(file.metadata().unwrap().uid(), 1001);
    let space = XSpace::decode(&std::fs::read(file.path()).unwrap()[..]).unwrap();
    assert_eq!(
        environment(&space, "devtrace_scope").as_deref(),
        Some("uid 1001")
    );
    assert!(kernels(&space) > 0);
}

/// A header naming another user is honoured only from the agent's own
/// user: uid 65534 cannot claim to capture for uid 1001.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_agents_own_user_may_capture_on_another_users_behalf() {
    if skip_without_root() {
        return;
    }
    let agent = AgentProcess::start(&["--mock-uid", "1001", "--mock-rate", "20000"]);
    let io = connect_as(65534, &agent.address).await;
    let (client, connection) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let call = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}{PROFILE}", agent.address))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("devtrace-on-behalf-of-uid", "1001")
        .body(())
        .unwrap();
    let (response, mut body) = client.send_request(call, false).unwrap();
    let mut asked = request(300, "claimed");
    asked.emit_xspace = true;
    body.send_data(raw_call::grpc_frame(&asked), true).unwrap();
    let (reply, status) = raw_call::read_reply(response).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let space = space_of(&ProfileResponse::decode(&reply[..]).unwrap());
    assert_eq!(
        environment(&space, "devtrace_scope").as_deref(),
        Some("uid 65534")
    );
    assert_eq!(kernels(&space), 0);
}

/// From root, a header that names no user is refused, not ignored: an
/// agent forwarding a session whose uid got lost on the way must not have
/// it captured as root's, unscoped. 4294967295 is the kernel's "no user".
#[tokio::test(flavor = "multi_thread")]
async fn root_naming_no_user_on_whose_behalf_it_calls_is_refused() {
    use common::raw_call::unary_with_headers;
    if skip_without_root() {
        return;
    }
    let agent = AgentProcess::start(&["--mock-uid", "1001", "--mock-rate", "20000"]);
    let asked = request(200, "unnamed");
    for value in ["4294967295", "uid 1001", "-1", ""] {
        let io = connect_as(0, &agent.address).await;
        let headers = [("devtrace-on-behalf-of-uid", value)];
        let (_, status) = unary_with_headers(io, &agent.address, PROFILE, &asked, &headers).await;
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{value:?}: {status:?}"
        );
        assert!(
            status
                .message()
                .contains("devtrace-on-behalf-of-uid must be a user id"),
            "{status:?}"
        );
    }
    // A well-formed one still scopes the capture to that user.
    let io = connect_as(0, &agent.address).await;
    let headers = [("devtrace-on-behalf-of-uid", "1001")];
    let mut asked = request(300, "named");
    asked.emit_xspace = true;
    let (reply, status) = unary_with_headers(io, &agent.address, PROFILE, &asked, &headers).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let space = space_of(&ProfileResponse::decode(&reply[..]).unwrap());
    assert_eq!(
        environment(&space, "devtrace_scope").as_deref(),
        Some("uid 1001")
    );
}

/// Over a UNIX socket the kernel names the caller too (`SO_PEERCRED`): a
/// user the socket's mode lets in captures its own processes, and one
/// whose processes the agent does not trace is told why its trace is
/// empty.
#[tokio::test(flavor = "multi_thread")]
async fn over_a_unix_socket_each_user_captures_its_own_processes() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;
    if skip_without_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.path().join("agent.sock");
    let _agent = AgentProcess::start(&[
        "--listen-unix",
        socket.to_str().unwrap(),
        "--listen-unix-mode",
        "0660",
        // A group both users are in, set as the agent makes the socket.
        "--listen-unix-group",
        "65534",
        "--mock-uid",
        "1001",
        "--mock-rate",
        "20000",
    ]);
    use std::os::unix::fs::MetadataExt;
    let made = std::fs::metadata(&socket).unwrap();
    assert_eq!((made.gid(), made.mode() & 0o777), (65534, 0o660));
    let logdir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(logdir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let capture_as = |uid: u32| {
        Command::new("setpriv")
            .arg(format!("--reuid={uid}"))
            .args(["--regid=65534", "--clear-groups", "--"])
            .arg(BIN)
            .arg("capture")
            .arg(format!("unix:{}", socket.display()))
            .args(["--duration", "300ms", "--quiet", "--logdir"])
            .arg(logdir.path().join(uid.to_string()))
            .output()
            .unwrap()
    };
    let nobody = capture_as(65534);
    let said = text(&nobody.stderr);
    assert!(!nobody.status.success(), "{said}");
    assert!(
        said.contains("collected no trace events")
            && said.contains("scoped to the processes of uid 65534"),
        "{said}"
    );
    let owner = capture_as(1001);
    assert!(owner.status.success(), "{}", text(&owner.stderr));
    let sessions = logdir.path().join("1001/plugins/profile");
    let session = std::fs::read_dir(&sessions)
        .unwrap()
        .next()
        .expect("a session")
        .unwrap()
        .path();
    let file = std::fs::read_dir(&session)
        .unwrap()
        .next()
        .expect("a trace")
        .unwrap()
        .path();
    let space = XSpace::decode(&std::fs::read(file).unwrap()[..]).unwrap();
    assert_eq!(
        environment(&space, "devtrace_scope").as_deref(),
        Some("uid 1001")
    );
    assert!(kernels(&space) > 0);
}

/// Level 2 of Monitor (the agent's own state, which names other users'
/// processes and rings) is an admin's: a user who asks for it gets level 1
/// and is told why, root gets it.
#[tokio::test(flavor = "multi_thread")]
async fn monitor_level_2_is_for_admins_and_says_so() {
    use devtrace::proto::tensorflow::{MonitorRequest, MonitorResponse};
    if skip_without_root() {
        return;
    }
    let agent = AgentProcess::start(&["--mock-uid", "1001", "--mock-rate", "20000"]);
    let asked = MonitorRequest {
        duration_ms: 200,
        monitoring_level: 2,
        timestamp: false,
    };
    let monitor_as = |uid: u32| {
        let address = agent.address.clone();
        async move {
            let io = connect_as(uid, &address).await;
            let path = "/tensorflow.ProfilerService/Monitor";
            let (reply, status) = unary_on(io, &address, path, &asked).await;
            assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
            MonitorResponse::decode(&reply[..]).unwrap().data
        }
    };
    let theirs = monitor_as(1001).await;
    assert!(
        theirs.contains("level 2 (the agent's own state) is for admins"),
        "{theirs}"
    );
    assert!(!theirs.contains("flight recorder:"), "{theirs}");
    let roots = monitor_as(0).await;
    assert!(roots.contains("flight recorder:"), "{roots}");
    assert!(!roots.contains("is for admins"), "{roots}");
}

/// `devtrace monitor` asks each period as the one before ends, two calls
/// in flight; an agent that lets a user have one at a time
/// (`--captures-per-caller 1`) refuses the second, and the command goes on
/// one at a time, saying so, rather than failing.
#[test]
fn monitor_goes_on_one_call_at_a_time_when_the_agent_allows_no_more() {
    if skip_without_root() {
        return;
    }
    let agent = AgentProcess::start(&["--mock-rate", "20000", "--captures-per-caller", "1"]);
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=1001", "--regid=1001", "--clear-groups", "--"])
        .arg(BIN)
        .args([
            "monitor",
            &agent.address,
            "--duration",
            "300ms",
            "--count",
            "3",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(printed.matches(" over 300 ms\n").count(), 3, "{printed}");
    assert!(
        said.contains("one Monitor at a time for this caller: periods now follow each answer"),
        "{said}"
    );
}
