//! Traces in object storage, against a real S3-compatible server (moto's
//! server mode, which `scripts/storage-servers` installs) that each test
//! starts on loopback: the agent writing into an allowed bucket prefix and
//! refusing every other, sessions listed and read from a bucket, the CLI's
//! `capture`, `session new`, `sessions` and `tool` with `s3://` logdirs,
//! a trigger's session saved into a bucket prefix, and traces kept when
//! their upload fails.

use crate::common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::{
    EnumProfileSessionsAndToolsRequest, NewProfileSessionRequest, ProfileSessionDataRequest,
};
use prost::Message;
use tonic::Code;

/// An `Authorization` header of the test's credentials.
const UNCHECKED_SIGNATURE: &str = "Authorization: AWS4-HMAC-SHA256 \
     Credential=devtrace-test/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0";

/// A moto S3 server on a free loopback port; killed when dropped.
struct S3Server {
    child: Child,
    address: String,
}

/// Where moto's server is: `DEVTRACE_MOTO_SERVER` (which must then exist:
/// CI sets it), the repository's `.venv-storage`, or `moto_server` on PATH.
fn moto_server() -> Option<PathBuf> {
    if let Some(given) = std::env::var_os("DEVTRACE_MOTO_SERVER") {
        let given = PathBuf::from(given);
        assert!(
            given.is_file(),
            "DEVTRACE_MOTO_SERVER={} does not exist",
            given.display()
        );
        return Some(given);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-storage/bin/moto_server");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("moto_server"))
            .find(|candidate| candidate.is_file())
    })
}

impl S3Server {
    /// Starts the server, or says why the test is skipped.
    fn start() -> Option<S3Server> {
        let Some(binary) = moto_server() else {
            eprintln!(
                "SKIP: moto_server not found (run scripts/storage-servers, or set DEVTRACE_MOTO_SERVER)"
            );
            return None;
        };
        let mut child = Command::new(&binary)
            .args(["-H", "127.0.0.1", "-p", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        // Werkzeug names the port it bound on standard error.
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut address = None;
        let mut line = String::new();
        while address.is_none() {
            line.clear();
            if stderr.read_line(&mut line).expect("reading moto's output") == 0 {
                panic!("moto_server exited before it listened");
            }
            address = line
                .split("Running on http://")
                .nth(1)
                .map(|rest| rest.trim().to_string());
        }
        // Keep draining its log, or it blocks once the pipe is full.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Some(S3Server {
            child,
            address: address.unwrap_or_default(),
        })
    }

    /// The variables that point the AWS credential chain at this server.
    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", format!("http://{}", self.address)),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "devtrace-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "devtrace-test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// One HTTP/1.0 request: status and body. Moto checks no signature,
    /// but treats a request without one as anonymous (refused objects).
    fn request(&self, method: &str, path: &str) -> (u16, Vec<u8>) {
        self.send(method, path, b"")
    }

    fn send(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let mut stream = std::net::TcpStream::connect(&self.address).expect("connecting to moto");
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: {}\r\n{UNCHECKED_SIGNATURE}\r\nContent-Length: {}\r\n\r\n",
            self.address,
            body.len()
        )
        .expect("sending");
        stream.write_all(body).expect("sending");
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).expect("reading");
        let end = reply
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("end of headers");
        let head = String::from_utf8_lossy(&reply[..end]).to_string();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("status");
        (status, reply[end + 4..].to_vec())
    }

    fn create_bucket(&self, bucket: &str) {
        let (status, body) = self.request("PUT", &format!("/{bucket}"));
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }

    /// Every key in `bucket`, sorted.
    fn keys(&self, bucket: &str) -> Vec<String> {
        let (status, body) = self.request("GET", &format!("/{bucket}?list-type=2"));
        assert_eq!(status, 200);
        let body = String::from_utf8(body).expect("XML");
        let mut keys: Vec<String> = body
            .split("<Key>")
            .skip(1)
            .filter_map(|rest| rest.split("</Key>").next().map(str::to_string))
            .collect();
        keys.sort();
        keys
    }

    fn object(&self, bucket: &str, key: &str) -> Vec<u8> {
        let (status, body) = self.request("GET", &format!("/{bucket}/{key}"));
        assert_eq!(status, 200, "{bucket}/{key}");
        body
    }

    fn put_object(&self, bucket: &str, key: &str, data: &[u8]) {
        let (status, body) = self.send("PUT", &format!("/{bucket}/{key}"), data);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn agent_in(server: &S3Server, args: &[&str]) -> AgentProcess {
    let env = server.env();
    let env: Vec<(&str, &Path)> = env.iter().map(|(k, v)| (*k, Path::new(v))).collect();
    AgentProcess::start_with_env(args, &env)
}

/// `devtrace ARGS` with the server's variables (and `extra`).
fn devtrace(server: &S3Server, args: &[&str], extra: &[(&str, &Path)]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .args(["--log-level", "warn"])
        .envs(server.env())
        .envs(extra.iter().copied())
        .output()
        .expect("running devtrace")
}

/// The standard output of a command that must have succeeded, trimmed.
fn succeeded(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn decodes(bytes: &[u8]) -> XSpace {
    XSpace::decode(bytes).expect("an XSpace")
}

/// A trace request written server-side under `repository_root`.
fn request_into(
    repository_root: &str,
    session_id: &str,
) -> devtrace::proto::tensorflow::ProfileRequest {
    let mut request = request(300, session_id);
    request.repository_root = repository_root.to_string();
    request
}

/// The session name the agent generates in second `secs` (UTC).
fn session_name_at(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = devtrace::model::calendar::civil_from_days(days);
    format!(
        "{year:04}_{month:02}_{day:02}_{:02}_{:02}_{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[tokio::test]
async fn the_agent_writes_into_an_allowed_bucket_prefix_and_no_other() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    server.create_bucket("traces-evil");
    let agent = agent_in(&server, &["--allow-root", "s3://traces/team"]);

    let reply = agent
        .profile(request_into("s3://traces/team/run1/plugins/profile", "s1"))
        .await;
    assert!(
        reply.tool_data.is_empty(),
        "the agent wrote it, so no inline copy"
    );
    let key = "team/run1/plugins/profile/s1/127.0.0.1_6009.xplane.pb";
    assert_eq!(server.keys("traces"), [key]);
    assert!(event_count(&decodes(&server.object("traces", key))) > 0);

    // Outside the prefix, another bucket (named like it), another provider,
    // a traversal: never written, the trace comes back inline instead.
    for outside in [
        "s3://traces/team2/run1",
        "s3://traces/tea",
        "s3://traces-evil/team/run1",
        "gs://traces/team/run1",
        "s3://traces/team/../escape",
        "s3://traces/team//x",
    ] {
        let reply = agent.profile(request_into(outside, "s2")).await;
        assert!(
            event_count(&space_of(&reply)) > 0,
            "{outside}: no inline trace"
        );
    }
    assert_eq!(server.keys("traces"), [key]);
    assert!(server.keys("traces-evil").is_empty());
}

#[tokio::test]
async fn generated_session_names_never_replace_objects_in_a_bucket() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let agent = agent_in(&server, &["--allow-root", "s3://traces"]);
    // Sessions already named after each of the next seconds: the capture's
    // generated name is taken whenever it runs, and must be suffixed.
    let now = now_ns() / 1_000_000_000;
    let taken: Vec<String> = (0..30).map(|s| session_name_at(now + s)).collect();
    for name in &taken {
        let key = format!("logs/{name}/127.0.0.1_6009.xplane.pb");
        server.put_object("traces", &key, b"earlier capture");
    }
    let reply = agent.profile(request_into("s3://traces/logs", "")).await;
    assert!(
        reply.tool_data.is_empty(),
        "not written: {:?}",
        space_of(&reply).warnings
    );
    let keys = server.keys("traces");
    let new: Vec<&String> = keys
        .iter()
        .filter(|k| !taken.iter().any(|t| k.starts_with(&format!("logs/{t}/"))))
        .collect();
    // The trace, and the marker that took its session's name.
    assert_eq!(new.len(), 2, "{keys:?}");
    let session = new[0].rsplit_once('/').unwrap().0;
    assert!(session.ends_with("_2"), "{keys:?}");
    assert_eq!(
        new,
        [
            &format!("{session}/.devtrace-session"),
            &format!("{session}/127.0.0.1_6009.xplane.pb")
        ]
    );
    for name in &taken {
        let key = format!("logs/{name}/127.0.0.1_6009.xplane.pb");
        assert_eq!(server.object("traces", &key), b"earlier capture");
    }
}

#[tokio::test]
async fn sessions_in_a_bucket_are_made_listed_and_read_over_the_protocol() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let coordinator = agent_in(&server, &["--allow-root", "s3://traces/fleet"]);
    let worker = AgentProcess::start(&[]);
    let root = "s3://traces/fleet/plugins/profile";
    let hosts = vec![coordinator.address.clone(), worker.address.clone()];
    let mut client = coordinator.analysis().await;
    let session_f1 = || NewProfileSessionRequest {
        request: Some(request(300, "ignored")),
        repository_root: root.into(),
        hosts: hosts.clone(),
        session_id: "f1".into(),
    };
    let reply = client.new_session(session_f1()).await.unwrap().into_inner();
    assert!(!reply.empty_trace, "{}", reply.error_message);
    assert_eq!(reply.error_message, "");
    let mut expected: Vec<String> = hosts
        .iter()
        .map(|h| format!("fleet/plugins/profile/f1/{}.xplane.pb", h.replace(':', "_")))
        .collect();
    expected.sort();
    assert_eq!(server.keys("traces"), expected);

    let listed = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: root.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].session_id, "f1");
    assert!(listed[0]
        .available_tools
        .contains(&"trace_viewer".to_string()));

    let host = hosts[1].replace(':', "_");
    let ask = |tool: &str, session: &str| ProfileSessionDataRequest {
        repository_root: root.into(),
        session_id: session.into(),
        host_name: host.clone(),
        tool_name: tool.into(),
        parameters: HashMap::new(),
    };
    let xplane = client
        .get_session_tool_data(ask("xplane", "f1"))
        .await
        .unwrap()
        .into_inner();
    let key = format!("fleet/plugins/profile/f1/{host}.xplane.pb");
    assert_eq!(xplane.output, server.object("traces", &key));

    // The session named again: refused before any host is called, and
    // nothing in it replaced.
    let again = client.new_session(session_f1()).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    assert!(again.message().contains(&host), "{}", again.message());
    assert_eq!(server.keys("traces"), expected);
    assert_eq!(xplane.output, server.object("traces", &key));
    let overview = client
        .get_session_tool_data(ask("overview", "f1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(overview.output_format, "json");
    assert!(String::from_utf8(overview.output)
        .unwrap()
        .contains("span_ms"));
    let missing = client
        .get_session_tool_data(ask("overview", "nope"))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    let elsewhere = client
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: "s3://traces/other".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(elsewhere.code(), Code::PermissionDenied, "{elsewhere:?}");
}

#[tokio::test]
async fn the_cli_captures_into_lists_and_reads_from_a_bucket() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let agent = AgentProcess::start(&[]);
    let other = AgentProcess::start(&[]);
    let host = agent.address.replace(':', "_");
    let out = devtrace(
        &server,
        &[
            "capture",
            &agent.address,
            "--duration",
            "300ms",
            "--logdir",
            "s3://traces/cli",
            "--session-id",
            "c1",
            "--quiet",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c1 = format!("cli/plugins/profile/c1/{host}.xplane.pb");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("s3://traces/{c1}")
    );
    assert!(event_count(&decodes(&server.object("traces", &c1))) > 0);
    // Sessions named after the second: each capture its own, in a bucket too.
    let unnamed: Vec<String> = (0..2)
        .map(|_| {
            let out = devtrace(
                &server,
                &["capture", &agent.address, "--duration", "100ms"]
                    .into_iter()
                    .chain(["--logdir", "s3://traces/unnamed", "--quiet"])
                    .collect::<Vec<_>>(),
                &[],
            );
            succeeded(out)
        })
        .collect();
    assert_ne!(unnamed[0], unnamed[1]);

    let hosts = format!("{},{}", agent.address, other.address);
    let out = devtrace(
        &server,
        &[
            "session",
            "new",
            "--hosts",
            &hosts,
            "--logdir",
            "s3://traces/cli",
            "--duration",
            "300ms",
            "--session-id",
            "c2",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let keys = server.keys("traces");
    for address in [&agent.address, &other.address] {
        let key = format!(
            "cli/plugins/profile/c2/{}.xplane.pb",
            address.replace(':', "_")
        );
        assert!(keys.contains(&key), "{key} not in {keys:?}");
    }

    let out = devtrace(&server, &["sessions", "s3://traces/cli"], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    let names: Vec<&str> = listing
        .lines()
        .map(|l| l.split('\t').next().unwrap_or(""))
        .collect();
    assert_eq!(names, ["c2", "c1"], "{listing}");

    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.xplane.pb");
    let out = devtrace(
        &server,
        &[
            "tool",
            "s3://traces/cli",
            "c1",
            "xplane",
            "--host",
            &host,
            "-o",
            copy.to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&copy).unwrap(), server.object("traces", &c1));
    let out = devtrace(&server, &["tool", "s3://traces/cli", "c9", "overview"], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no session \"c9\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Captures started in the same second into one bucket, each naming its
/// session after that second: each takes a name of its own before it
/// captures (a bucket has no directory to make), so none is refused at the
/// upload and kept off the bucket.
#[tokio::test]
async fn captures_of_one_second_into_a_bucket_each_land_in_a_session_of_their_own() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let agent = AgentProcess::start(&[]);
    let host = agent.address.replace(':', "_");
    // Early in a second, so that every capture names its session after it.
    let into_second = now_ns() % 1_000_000_000;
    if into_second > 100_000_000 {
        std::thread::sleep(std::time::Duration::from_nanos(1_000_000_000 - into_second));
    }
    let captures: Vec<Child> = (0..3)
        .map(|_| {
            Command::new(BIN)
                .args(["capture", &agent.address, "--duration", "300ms"])
                .args(["--logdir", "s3://traces/same", "--quiet"])
                .args(["--log-level", "warn"])
                .envs(server.env())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("running devtrace")
        })
        .collect();
    let mut written: Vec<String> = captures
        .into_iter()
        .map(|capture| succeeded(capture.wait_with_output().unwrap()))
        .collect();
    written.sort();
    written.dedup();
    assert_eq!(written.len(), 3, "{written:?}");
    let keys = server.keys("traces");
    let traces: Vec<&String> = keys.iter().filter(|k| k.ends_with(".xplane.pb")).collect();
    assert_eq!(traces.len(), 3, "{keys:?}");
    for key in traces {
        assert!(written.contains(&format!("s3://traces/{key}")), "{key}");
        assert!(key.ends_with(&format!("/{host}.xplane.pb")), "{key}");
        assert!(event_count(&decodes(&server.object("traces", key))) > 0);
    }

    // A capture that fails gives its session's name back: nothing is left.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap().to_string();
    drop(closed);
    let out = devtrace(
        &server,
        &["capture", &address, "--duration", "100ms"]
            .into_iter()
            .chain(["--logdir", "s3://traces/failed", "--quiet"])
            .collect::<Vec<_>>(),
        &[],
    );
    assert!(!out.status.success());
    let left: Vec<String> = server
        .keys("traces")
        .into_iter()
        .filter(|k| k.starts_with("failed/"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Asserts that `message` says the trace is kept in a file under `dir`,
/// and that the file holds the trace.
fn assert_kept(message: &str, dir: &Path) {
    let rest = message
        .split("the trace is kept at ")
        .nth(1)
        .unwrap_or_else(|| panic!("no kept path in {message:?}"));
    let end = rest.find(".xplane.pb").expect("a trace file name") + ".xplane.pb".len();
    let kept = Path::new(&rest[..end]);
    assert!(kept.starts_with(dir), "{message}");
    assert!(event_count(&decodes(&std::fs::read(kept).unwrap())) > 0);
}

/// Runs a CLI command whose upload fails: it must fail, keeping the trace
/// in its temporary directory `tmp`.
fn assert_cli_keeps(server: &S3Server, args: &[&str], tmp: &Path) {
    let out = devtrace(server, args, &[("TMPDIR", tmp)]);
    assert!(!out.status.success());
    assert_kept(&String::from_utf8_lossy(&out.stderr), tmp);
}

#[tokio::test]
async fn a_failed_upload_keeps_the_trace() {
    let Some(mut server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let unsent = tempfile::tempdir().unwrap();
    let agent = agent_in(
        &server,
        &[
            "--allow-root",
            "s3://missing-bucket/x",
            "--allow-root",
            "s3://traces/ok",
            "--unsent-dir",
            unsent.path().to_str().unwrap(),
        ],
    );
    // Profile: the protocol can carry it, so it comes back inline.
    let reply = agent
        .profile(request_into("s3://missing-bucket/x/plugins/profile", "p1"))
        .await;
    let space = space_of(&reply);
    assert!(event_count(&space) > 0);
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains("could not write this trace") && w.contains("missing-bucket")),
        "{:?}",
        space.warnings
    );

    // NewSession: its reply cannot, so each host's trace stays on disk.
    let mut client = agent.analysis().await;
    let session = |root: &str| NewProfileSessionRequest {
        request: Some(request(300, "ignored")),
        repository_root: root.into(),
        hosts: vec![agent.address.clone()],
        session_id: "n1".into(),
    };
    let reply = client
        .new_session(session("s3://missing-bucket/x/plugins/profile"))
        .await
        .unwrap()
        .into_inner();
    assert_kept(&reply.error_message, unsent.path());
    // Nothing reached the session; the kept trace is named above.
    assert!(reply.empty_trace, "{}", reply.error_message);

    // The CLI: the trace lands in the temporary directory, and the command
    // fails naming it.
    let tmp = tempfile::tempdir().unwrap();
    let capture = [
        "capture",
        &agent.address,
        "--duration",
        "300ms",
        "--logdir",
        "s3://missing-bucket/cli",
        "--quiet",
    ];
    assert_cli_keeps(&server, &capture, tmp.path());

    // With the server stopped, uploads to an allowed bucket fail the same way.
    server.stop();
    let reply = client
        .new_session(session("s3://traces/ok/plugins/profile"))
        .await
        .unwrap()
        .into_inner();
    assert_kept(&reply.error_message, unsent.path());
    let session_new = [
        "session",
        "new",
        "--hosts",
        &agent.address,
        "--logdir",
        "s3://traces/cli",
        "--duration",
        "300ms",
    ];
    assert_cli_keeps(&server, &session_new, tmp.path());
}

/// The agent refuses a malformed or foreign `--allow-root` URL at start.
#[tokio::test]
async fn a_trigger_saves_its_session_into_an_allowed_bucket_prefix() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let agent = agent_in(
        &server,
        &[
            "--allow-root",
            "s3://traces/team",
            "--trigger-repository",
            "s3://traces/team/plugins/profile",
            "--trigger",
            "name=watchdog; when=explicit; before=500ms; after=100ms",
        ],
    );
    // History for the window before the firing.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let fired_at_ns = agent.fire_trigger("watchdog").await.expect("firing");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let key = loop {
        let keys = server.keys("traces");
        if let Some(key) = keys.iter().find(|k| k.ends_with(".xplane.pb")) {
            break key.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no trace in the bucket: {keys:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(
        key.starts_with("team/plugins/profile/") && key.contains("_watchdog/"),
        "{key}"
    );
    let space = decodes(&server.object("traces", &key));
    let env = plane(&space, "Task Environment");
    assert_eq!(
        devtrace::xspace::read::find_stat(env, &env.stats, "trigger.fired_at_ns"),
        Some(devtrace::xspace::read::StatValue::Str(
            fired_at_ns.to_string()
        ))
    );
    assert_eq!(window_of(&space).0, fired_at_ns - 500_000_000);
    assert!(event_count(&space) > 0);
}

#[test]
fn malformed_bucket_roots_are_refused_at_start() {
    for bad in ["s3://", "s3://b/a/../c", "ftp://b/x"] {
        let out = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
            .args(["--metrics-listen", "off", "--allow-root", bad])
            .output()
            .expect("running devtrace");
        assert!(!out.status.success(), "{bad} accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--allow-root"),
            "{bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A signal while a capture's trace is being uploaded keeps the trace on
/// this machine and says where; the command then ends by that signal.
/// (It ended at once, and the trace was lost without a word.)
#[tokio::test]
async fn a_signal_during_an_upload_keeps_the_trace_here() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let agent = AgentProcess::start(&[]);
    let temporary = tempfile::tempdir().unwrap();
    let mut capture = Command::new(BIN)
        .args(["capture", &agent.address, "--duration", "5s", "--quiet"])
        .args(["--session-id", "stalled", "--logdir", "s3://traces/cli"])
        .envs(server.env())
        .env("TMPDIR", temporary.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(capture.stderr.take().unwrap());
    let (lines, said) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    // Well within the window, long after the command looked into the
    // bucket: the server stops answering, so that the upload waits on it.
    let moto = server.child.id() as libc::pid_t;
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    // SAFETY: signalling a child of this test.
    unsafe { libc::kill(moto, libc::SIGSTOP) };
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains("reply received")) {
        let line = said
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no reply: {seen:?}"));
        seen.push(line);
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    // SAFETY: as above.
    unsafe { libc::kill(capture.id() as libc::pid_t, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || capture.wait().unwrap())
        .await
        .unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(moto, libc::SIGCONT) };
    seen.extend(said.iter());
    let stderr = seen.join("\n");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{stderr}");
    let kept = stderr
        .split("SIGTERM while the trace was being written, which may still finish: it is kept at ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        kept.starts_with(&*temporary.path().to_string_lossy()),
        "{kept}"
    );
    let trace = devtrace::xspace::read::read_trace(Path::new(kept)).unwrap();
    assert!(trace.space.planes.iter().any(|p| p.name == "/host:CPU"));
}

/// A stopping agent waits for a trace write its client gave up on only so
/// long, and names it: an upload to a bucket that stopped answering held
/// the exit for as long as object storage's requests take (30 s each), saying
/// nothing past "shutting down".
#[tokio::test]
async fn a_stopping_agent_names_the_stalled_write_it_stops_without() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("traces");
    let (mut agent, logged) = spawn_logging(
        Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
            .args([
                "--metrics-listen",
                "off",
                "--allow-root",
                "s3://traces/team",
            ])
            .envs(server.env()),
    );

    let mut client = agent.client().await;
    let mut call = tonic::Request::new(devtrace::proto::tensorflow::ProfileRequest {
        repository_root: "s3://traces/team/run".into(),
        ..request(1000, "stalled")
    });
    call.set_timeout(std::time::Duration::from_secs(4));
    let profile = tokio::spawn(async move { client.profile(call).await });
    // Within the window, after the agent looked into the bucket: the server
    // stops answering, so that the trace's upload waits on it.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let moto = server.child.id() as libc::pid_t;
    // SAFETY: signalling a child of this test.
    unsafe { libc::kill(moto, libc::SIGSTOP) };
    let given_up = profile.await.unwrap().unwrap_err();
    assert!(
        matches!(given_up.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{given_up:?}"
    );

    let status = tokio::task::spawn_blocking(move || {
        let status = agent.stop_with_sigterm(std::time::Duration::from_secs(60));
        (status, agent)
    })
    .await
    .unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(moto, libc::SIGCONT) };
    let (status, _agent) = status;
    let log = logged.join().unwrap();
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{log}");
    let stopped_without = log
        .lines()
        .find(|line| line.contains("stopping without the work still under way"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        stopped_without.contains("s3://traces/team/run/stalled/"),
        "{stopped_without}"
    );
}
