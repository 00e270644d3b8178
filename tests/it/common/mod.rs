//! Starts the real `devtrace` binary on a loopback port and talks to it with
//! the generated gRPC client.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use devtrace::proto::tensorflow::profile_analysis_client::ProfileAnalysisClient;
use devtrace::proto::tensorflow::profiler::{XPlane, XSpace};
use devtrace::proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use devtrace::proto::tensorflow::{
    NewProfileSessionRequest, NewProfileSessionResponse, ProfileOptions, ProfileRequest,
    ProfileResponse,
};
use devtrace::xspace::read::{find_stat, StatValue};
use prost::Message;
use tonic::transport::Channel;

pub mod bulky;
pub mod raw_call;
pub mod workload;

pub const BIN: &str = env!("CARGO_BIN_EXE_devtrace");

/// A running agent; killed when dropped.
pub struct AgentProcess {
    child: Child,
    pub address: String,
}

impl AgentProcess {
    /// Starts `devtrace serve --listen 127.0.0.1:0 <extra>` and waits until it
    /// prints the address it bound.
    pub fn start(extra: &[&str]) -> AgentProcess {
        Self::start_with_env(extra, &[])
    }

    /// As [`AgentProcess::start`], with extra environment variables. Without
    /// a `--backend` in `extra` the agent runs the mock alone, so that the
    /// host's own activity (the eBPF backend under `auto`) stays out of
    /// tests that count events; tests of `auto` ask for it. Without a
    /// `--metrics-listen` it serves no metrics endpoint (agents of tests
    /// running at once would compete for the default port).
    pub fn start_with_env(extra: &[&str], env: &[(&str, &std::path::Path)]) -> AgentProcess {
        Self::adopt(Self::spawn(extra, env))
    }

    /// Starts `devtrace serve --listen LISTEN <extra>` without waiting for
    /// it: [`AgentProcess::adopt`] waits, so that many start at once.
    pub fn spawn_listening(listen: &str, extra: &[&str]) -> Child {
        Self::spawn_on(listen, extra, &[])
    }

    fn spawn(extra: &[&str], env: &[(&str, &std::path::Path)]) -> Child {
        Self::spawn_on("127.0.0.1:0", extra, env)
    }

    fn spawn_on(listen: &str, extra: &[&str], env: &[(&str, &std::path::Path)]) -> Child {
        let default_backend: &[&str] = if extra.contains(&"--backend") {
            &[]
        } else {
            &["--backend", "mock"]
        };
        let default_metrics: &[&str] = if extra.contains(&"--metrics-listen") {
            &[]
        } else {
            &["--metrics-listen", "off"]
        };
        Command::new(BIN)
            .args(["serve", "--listen", listen, "--log-level", "warn"])
            .args(default_backend)
            .args(default_metrics)
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting devtrace serve")
    }

    /// As [`AgentProcess::start_with_env`], with the metrics endpoint on a
    /// free loopback port; also returns that endpoint's address.
    pub fn start_with_metrics(
        extra: &[&str],
        env: &[(&str, &std::path::Path)],
    ) -> (AgentProcess, String) {
        let mut args = vec!["--metrics-listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        Self::adopt_with_metrics(Self::spawn(&args, env))
    }

    /// Takes over an agent started with `--metrics-listen` some other way
    /// (its stdout piped), once it has printed both addresses.
    pub fn adopt_with_metrics(mut child: Child) -> (AgentProcess, String) {
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = || {
            let mut line = String::new();
            stdout
                .read_line(&mut line)
                .expect("reading the agent's output");
            line.trim().to_string()
        };
        let address = line();
        let address = address
            .strip_prefix("devtrace listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {address:?}"))
            .to_string();
        let metrics = line();
        let metrics = metrics
            .strip_prefix("devtrace metrics on http://")
            .unwrap_or_else(|| panic!("unexpected second line: {metrics:?}"))
            .to_string();
        (AgentProcess { child, address }, metrics)
    }

    /// Takes over an agent started some other way (with its stdout piped),
    /// once it has printed the address it bound.
    pub fn adopt(mut child: Child) -> AgentProcess {
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reading the listening line");
        let address = line
            .trim()
            .strip_prefix("devtrace listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_string();
        AgentProcess { child, address }
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.address))
            .expect("uri")
            .connect()
            .await
            .expect("connecting to the agent")
    }

    pub async fn client(&self) -> ProfilerServiceClient<Channel> {
        ProfilerServiceClient::new(self.channel().await).max_decoding_message_size(usize::MAX)
    }

    /// `devtrace.Trigger/Fire` of rule `name`: when it fired.
    pub async fn fire_trigger(&self, name: &str) -> Result<u64, tonic::Status> {
        devtrace::proto::devtrace::trigger_client::TriggerClient::new(self.channel().await)
            .fire(devtrace::proto::devtrace::FireRequest {
                name: name.into(),
                reason: String::new(),
            })
            .await
            .map(|reply| reply.into_inner().fired_at_ns)
    }

    /// A `Profile` call that must succeed.
    pub async fn profile(&self, request: ProfileRequest) -> ProfileResponse {
        self.client()
            .await
            .profile(request)
            .await
            .expect("Profile")
            .into_inner()
    }

    /// A level-2 `Monitor` over `duration_ms`, without a timestamp.
    pub async fn monitor(&self, duration_ms: u64) -> devtrace::proto::tensorflow::MonitorResponse {
        self.client()
            .await
            .monitor(devtrace::proto::tensorflow::MonitorRequest {
                duration_ms,
                monitoring_level: 2,
                timestamp: false,
            })
            .await
            .expect("Monitor")
            .into_inner()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The agent's resident memory now, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        self.memory_bytes("VmRSS:")
    }

    /// The most resident memory the agent has had, in bytes.
    pub fn peak_rss_bytes(&self) -> u64 {
        self.memory_bytes("VmHWM:")
    }

    /// A `kB` field of /proc/PID/status, in bytes.
    fn memory_bytes(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc/PID/status"));
        kib * 1024
    }

    /// A ProfileAnalysis client of the agent.
    pub async fn analysis(&self) -> ProfileAnalysisClient<Channel> {
        ProfileAnalysisClient::new(self.channel().await).max_decoding_message_size(usize::MAX)
    }

    /// A NewSession that must be answered, with the deadline a caller sets
    /// (the agent answers in time with the hosts that made it).
    pub async fn new_session_within(
        &self,
        request: NewProfileSessionRequest,
        deadline: Duration,
    ) -> NewProfileSessionResponse {
        let mut call = tonic::Request::new(request);
        call.set_timeout(deadline);
        self.analysis()
            .await
            .new_session(call)
            .await
            .expect("NewSession")
            .into_inner()
    }

    /// Sends SIGTERM and waits up to `limit` for the agent to exit; how it
    /// exited, or `None` if it was still running (it is then killed).
    pub fn stop_with_sigterm(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
        self.wait_for_exit(limit)
    }

    /// Its exit status once it exits, waiting at most `limit`.
    pub fn wait_for_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        while started.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads `stream` (a child's standard error) to its end on a thread of its
/// own, so that the child never blocks on a full pipe: its lines, joined.
pub fn read_in_background(
    stream: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        BufReader::new(stream)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Starts the agent `command` runs, its standard error read on a thread
/// of its own: the agent once listening, and its log (whole once it has
/// exited).
pub fn spawn_logging(command: &mut Command) -> (AgentProcess, std::thread::JoinHandle<String>) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let logged = read_in_background(child.stderr.take().expect("piped"));
    (AgentProcess::adopt(child), logged)
}

/// Runs `devtrace ARGS` off the async runtime, so that servers of the test
/// keep answering it.
pub async fn devtrace(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args(&args)
            .output()
            .expect("running devtrace")
    })
    .await
    .expect("the devtrace process")
}

/// Runs `devtrace serve --listen 127.0.0.1:0 --metrics-listen off <extra>`
/// to its end: for settings the agent must refuse before it serves.
pub fn serve_to_end(extra: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
        ])
        .args(extra)
        .output()
        .expect("running devtrace serve")
}

pub fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| a.to_string()).collect()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// An HTTP/1.0 GET of `path` from `address`: the status and the body.
pub fn http_get(address: &str, path: &str) -> (u16, String) {
    try_http_get(address, path).unwrap_or_else(|e| panic!("GET http://{address}{path}: {e}"))
}

/// As [`http_get`], with connection errors returned.
pub fn try_http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    http_get_within(address, path, None)
}

/// As [`try_http_get`], failing when the reply takes longer than `within`
/// (a probe that waits is a probe that fails).
pub fn http_get_within(
    address: &str,
    path: &str,
    within: Option<Duration>,
) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(within)?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {reply:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    Ok((status, body.to_string()))
}

/// The value of the first series of `name` carrying every label of
/// `labels`, in the exposition `text`.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let matches = series_name == name
                && labels.iter().all(|(key, wanted)| {
                    series_labels
                        .split(',')
                        .any(|pair| pair == format!("{key}=\"{wanted}\""))
                });
            matches.then(|| value.parse().ok()).flatten()
        })
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64
}

/// A NewSession of a 500 ms window over `hosts` into `root/session`.
pub fn session_request(
    root: &std::path::Path,
    hosts: &[&str],
    session: &str,
) -> NewProfileSessionRequest {
    NewProfileSessionRequest {
        request: Some(request(500, "ignored")),
        repository_root: root.display().to_string(),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        session_id: session.to_string(),
    }
}

/// A request shaped like TensorFlow's `client.trace`.
pub fn request(duration_ms: u64, session_id: &str) -> ProfileRequest {
    ProfileRequest {
        duration_ms,
        max_events: 1_000_000,
        opts: Some(ProfileOptions {
            version: 1,
            host_tracer_level: 2,
            device_tracer_level: 1,
            include_dataset_ops: true,
            enable_hlo_proto: true,
            start_timestamp_ns: now_ns(),
            duration_ms,
            ..ProfileOptions::default()
        }),
        repository_root: String::new(),
        session_id: session_id.to_string(),
        host_name: "127.0.0.1:6009".into(),
        ..ProfileRequest::default()
    }
}

/// The warnings of `space` that hold `needle`.
pub fn warnings_with<'s>(space: &'s XSpace, needle: &str) -> Vec<&'s String> {
    space
        .warnings
        .iter()
        .filter(|w| w.contains(needle))
        .collect()
}

/// The XSpace a reply carries, inline or as `tool_data`.
pub fn space_of(reply: &ProfileResponse) -> XSpace {
    if let Some(space) = &reply.xspace {
        return space.clone();
    }
    let tool = reply
        .tool_data
        .iter()
        .find(|t| t.name == "xplane.pb")
        .expect("xplane.pb tool data");
    XSpace::decode(&tool.data[..]).expect("decoding the XSpace")
}

/// Asserts that one of the trace's errors starts with `prefix`.
pub fn assert_error_starting(space: &XSpace, prefix: &str) {
    assert!(
        space.errors.iter().any(|e| e.starts_with(prefix)),
        "no error starts with {prefix:?}: {:?}",
        space.errors
    );
}

pub fn plane<'s>(space: &'s XSpace, name: &str) -> &'s XPlane {
    space
        .planes
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no plane {name}"))
}

pub fn event_count(space: &XSpace) -> usize {
    space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum()
}

/// (start, stop) Unix ns from the Task Environment plane.
pub fn window_of(space: &XSpace) -> (u64, u64) {
    let env = plane(space, "Task Environment");
    let get = |name| match find_stat(env, &env.stats, name) {
        Some(StatValue::Uint(v)) => v,
        other => panic!("{name}: {other:?}"),
    };
    (get("profile_start_time"), get("profile_stop_time"))
}

pub fn dropped_of(space: &XSpace) -> i64 {
    let env = plane(space, "Task Environment");
    match find_stat(env, &env.stats, "dropped_traces") {
        Some(StatValue::Int(v)) => v,
        other => panic!("dropped_traces: {other:?}"),
    }
}

/// Builds `tests/standins/<source>` into a shared library named `library`
/// under the test target directory, once per test process, and returns its
/// path. Tests running at once share it: it is never rebuilt under a test
/// that has it loaded, and appears whole (see [`build_program`]).
pub fn build_standin(source: &str, library: &str) -> std::path::PathBuf {
    build_program(source, library, &["-shared", "-fPIC"])
}

/// Builds `tests/standins/<source>` into the program `name` under the test
/// target directory (`cc <args> -o name source`) once per test process and
/// returns its path. Written under a temporary name and renamed into place,
/// so that test processes building the same program at once never run a
/// half-written file.
pub fn build_program(source: &str, name: &str, args: &[&str]) -> std::path::PathBuf {
    static BUILT: std::sync::Mutex<Vec<(String, std::path::PathBuf)>> =
        std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("standins");
    std::fs::create_dir_all(&dir).expect("standin directory");
    let output = dir.join(name);
    let partial = dir.join(format!("{name}.{}.partial", std::process::id()));
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/standins")
        .join(source);
    let status = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&partial)
        .arg(&source)
        .args(args)
        .status()
        .expect("running cc");
    assert!(status.success(), "building {} failed", source.display());
    std::fs::rename(&partial, &output).expect("moving the program into place");
    built.push((name.to_string(), output.clone()));
    output
}

/// A temporary directory every user may add to and only remove their own
/// from (mode 1777, as /tmp or a team's shared directory).
pub fn shared_directory() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777))
        .expect("making it shared");
    dir
}

/// Whether this process runs as root; tests that load BPF programs need it.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
