//! Profiling sessions over many hosts: the fan-out that captures every host
//! with one shared window, and the listing of sessions in a repository
//! (`<repository_root>/<session>/<host>.xplane.pb`). Used by the
//! ProfileAnalysis service and by `devtrace session` / `devtrace sessions`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::beneath::{BeneathError, Dir, EntryKind};
use crate::client::{self, ClientConfig, Target};
use crate::proto::tensorflow::ProfileRequest;
use crate::streaming::{self, ReceiveError};
use crate::xspace::conventions;
use crate::xspace::read::plane_names;

/// Suffix of trace files in a session directory.
pub const XPLANE_SUFFIX: &str = ".xplane.pb";

/// What one host of a fan-out gave back.
#[derive(Debug)]
pub struct HostOutcome {
    /// `host:port` as addressed (or the entry that stood for no host).
    pub host: String,
    /// Where its trace was written, `None` for an empty trace, or why not.
    pub result: Result<Option<PathBuf>, HostError>,
}

impl HostOutcome {
    /// The outcomes of host entries that stood for no host (`dns:` names
    /// that did not resolve), from [`crate::hosts::Resolved::failures`].
    pub fn unresolved(failures: Vec<(String, String)>) -> Vec<HostOutcome> {
        failures
            .into_iter()
            .map(|(entry, why)| HostOutcome {
                host: entry,
                result: Err(HostError::Unresolved(why)),
            })
            .collect()
    }
}

/// Why a host of a session gave no trace.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A `dns:` entry that stands for no host.
    #[error("{0}")]
    Unresolved(String),
    #[error("cannot connect: {0}")]
    Connect(client::ConnectError),
    #[error("not called: the session's deadline passed while {0} other hosts were being called (--concurrent-hosts)")]
    NoSlot(usize),
    #[error("no reply within {:.0} s", .0.as_secs_f64())]
    Deadline(Duration),
    #[error(transparent)]
    Receive(#[from] ReceiveError),
}

impl HostError {
    /// A word or two for summaries that group hosts by what went wrong.
    pub fn kind(&self) -> &'static str {
        match self {
            HostError::Unresolved(_) => "not resolved",
            HostError::Connect(_) => "cannot connect",
            HostError::NoSlot(_) | HostError::Deadline(_) => "no reply in time",
            HostError::Receive(error) => error.kind(),
        }
    }
}

/// `10.0.0.2:8466` -> `10.0.0.2_8466.xplane.pb`, as TensorFlow names files.
pub fn host_file_name(host: &str) -> String {
    format!("{}{XPLANE_SUFFIX}", host.replace(':', "_"))
}

/// Where a session's traces go: one file per host, each written as its
/// reply arrives.
pub trait TraceSink: Send + Sync {
    /// Starts the file `file_name`; nothing appears under that name until
    /// it is committed.
    fn create(&self, file_name: &str) -> Result<Box<dyn TraceFile>, String>;
}

/// One host's trace file while it is written. Dropped uncommitted, it
/// leaves nothing behind.
pub trait TraceFile: Send {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String>;
    /// Puts the file in place; where it is.
    fn commit(self: Box<Self>) -> Result<PathBuf, String>;
}

impl TraceFile for crate::beneath::AtomicFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.write_all(bytes).map_err(|e| e.to_string())
    }

    fn commit(self: Box<Self>) -> Result<PathBuf, String> {
        crate::beneath::AtomicFile::commit(*self).map_err(|e| e.to_string())
    }
}

/// Most hosts called at once unless configured otherwise.
pub const DEFAULT_CONCURRENT_HOSTS: usize = 64;

/// How a fan-out runs.
#[derive(Clone, Debug)]
pub struct FanOut {
    /// How long the whole session may take, from the call of [`fan_out`]:
    /// every host's reply must have arrived by then.
    pub deadline: Duration,
    /// Most hosts called at once; the others wait for a free slot.
    pub concurrent_hosts: usize,
    pub client: ClientConfig,
}

/// Captures `request`'s window on every host. Each host gets the same
/// absolute start, so the traces line up, and is called when that start
/// comes (servers such as TensorFlow's record from when they are called),
/// at most `concurrent_hosts` at once: a host called later, once another
/// has answered, is still asked for the same window, which devtrace agents
/// serve from their flight recorder (other servers record from when they
/// are called). Each reply's trace is written through `sink` as it arrives
/// ([`crate::streaming`]), so what is held is a batch per host being
/// called, whatever the number of hosts. A host that fails, times out,
/// returns nothing or more than `client.max_reply_bytes` is reported in its
/// outcome; the others are unaffected. Outcomes come in the order of `hosts`.
pub async fn fan_out(
    hosts: &[Target],
    request: &ProfileRequest,
    plan: &FanOut,
    sink: Arc<dyn TraceSink>,
) -> Vec<HostOutcome> {
    let session_end = Instant::now() + plan.deadline;
    let slots = Arc::new(Semaphore::new(plan.concurrent_hosts.max(1)));
    let start_ns = request.opts.as_ref().map_or(0, |o| o.start_timestamp_ns);
    let mut tasks = JoinSet::new();
    for (index, target) in hosts.iter().enumerate() {
        let mut request = request.clone();
        let host = target.to_string();
        request.host_name = host.clone();
        request.emit_xspace = true;
        let (target, client) = (target.clone(), plan.client.clone());
        let (slots, sink) = (Arc::clone(&slots), Arc::clone(&sink));
        let concurrency = plan.concurrent_hosts;
        tasks.spawn(async move {
            tokio::time::sleep(crate::clock::until(start_ns)).await;
            let slot = tokio::time::timeout_at(session_end, slots.acquire_owned()).await;
            // A slot freed by a host that ran out of time comes when no time
            // is left: nothing is called then.
            let result = match slot {
                Ok(Ok(_slot)) if Instant::now() < session_end => {
                    capture_host_to_file(&target, &request, session_end, &client, sink).await
                }
                _ => Err(HostError::NoSlot(concurrency)),
            };
            (index, HostOutcome { host, result })
        });
    }
    let mut outcomes: Vec<(usize, HostOutcome)> = Vec::with_capacity(hosts.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(outcome) => outcomes.push(outcome),
            Err(error) => tracing::warn!(%error, "a fan-out task failed"),
        }
    }
    outcomes.sort_by_key(|(index, _)| *index);
    outcomes.into_iter().map(|(_, outcome)| outcome).collect()
}

/// Captures one host into `sink` by `until`: where its trace was written,
/// `None` for an empty trace, or why not.
async fn capture_host_to_file(
    target: &Target,
    request: &ProfileRequest,
    until: Instant,
    config: &ClientConfig,
    sink: Arc<dyn TraceSink>,
) -> Result<Option<PathBuf>, HostError> {
    let deadline = until.saturating_duration_since(Instant::now());
    let call = async {
        // The channel's own timeout is a backstop: the timeout below fires
        // first and says which deadline passed.
        let connection = client::connect(target, config, deadline + Duration::from_secs(1))
            .await
            .map_err(HostError::Connect)?;
        let file_name = host_file_name(&target.to_string());
        Ok(streaming::profile_to_file(&connection, request, sink, &file_name).await?)
    };
    match tokio::time::timeout_at(until, call).await {
        Ok(result) => result,
        Err(_) => Err(HostError::Deadline(deadline)),
    }
}

/// The failures of a session's outcomes, for people: how many hosts gave
/// no trace out of how many, grouped by what went wrong, then each host
/// with its reason (`host: reason`).
pub fn failure_summary(outcomes: &[HostOutcome]) -> Option<(String, Vec<String>)> {
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    let mut lines = Vec::new();
    for outcome in outcomes {
        let (kind, reason) = match &outcome.result {
            Ok(Some(_)) => continue,
            Ok(None) => ("empty", "returned an empty trace".to_string()),
            Err(error) => (error.kind(), error.to_string()),
        };
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, count)) => *count += 1,
            None => kinds.push((kind, 1)),
        }
        lines.push(format!("{}: {reason}", outcome.host));
    }
    if lines.is_empty() {
        return None;
    }
    let groups: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
    let headline = format!(
        "{} of {} hosts gave no trace ({})",
        lines.len(),
        outcomes.len(),
        groups.join(", ")
    );
    Some((headline, lines))
}

/// Captures one host: its trace bytes as received, `None` for an empty
/// trace, or why not.
pub async fn capture_host(
    target: &Target,
    request: ProfileRequest,
    deadline: Duration,
    config: &ClientConfig,
) -> Result<Option<Bytes>, String> {
    let call = async {
        // The channel's own timeout is a backstop: the timeout below fires
        // first and says which deadline passed.
        let connection = client::connect(target, config, deadline + Duration::from_secs(1))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let reply = connection
            .profile(request)
            .await
            .map_err(|e| e.to_string())?;
        if reply.empty_trace {
            return Ok(None);
        }
        match client::trace_bytes(reply) {
            Some(bytes) => Ok(Some(bytes)),
            None => Err(
                "the server kept the trace on its own filesystem (it ignores emit_xspace)".into(),
            ),
        }
    };
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result,
        Err(_) => Err(format!("no reply within {:.0} s", deadline.as_secs_f64())),
    }
}

/// One session directory and the tools its files support.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    pub session_id: String,
    pub hosts: Vec<String>,
    pub tools: Vec<String>,
    pub modified: SystemTime,
}

/// Tools every trace supports.
pub const BASE_TOOLS: &[&str] = &["trace_viewer", "overview", "xplane"];

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{path} does not exist")]
    Missing { path: String },
    #[error(transparent)]
    Refused(BeneathError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl From<BeneathError> for SessionError {
    fn from(error: BeneathError) -> SessionError {
        match error {
            BeneathError::NotFound { path } => SessionError::Missing { path },
            BeneathError::Io { path, source } => SessionError::Io { path, source },
            refused => SessionError::Refused(refused),
        }
    }
}

/// The sessions in `root`, newest first. Every file is opened beneath
/// `root` without following links; entries that are links are skipped.
pub fn list_sessions(root: &Dir) -> Result<Vec<SessionInfo>, SessionError> {
    let mut sessions = Vec::new();
    for entry in root.entries()? {
        if entry.kind != EntryKind::Directory {
            continue;
        }
        let Some(session_id) = entry.name.to_str().map(str::to_string) else {
            continue;
        };
        // Removed or swapped for a link since it was listed: not a session.
        let Ok(session) = root.open_dir(Path::new(&session_id)) else {
            continue;
        };
        let hosts = session_hosts(&session)?;
        if hosts.is_empty() {
            continue;
        }
        let tools = session_tools(&session, &hosts);
        sessions.push(SessionInfo {
            session_id,
            hosts,
            tools,
            modified: entry.modified,
        });
    }
    sessions.sort_by(|a, b| {
        b.modified
            .cmp(&a.modified)
            .then(b.session_id.cmp(&a.session_id))
    });
    Ok(sessions)
}

/// Hosts with a trace in a session directory, sorted. A link or FIFO named
/// like a trace counts, so that asking for it is refused by name.
pub fn session_hosts(session: &Dir) -> Result<Vec<String>, SessionError> {
    let mut hosts = Vec::new();
    for entry in session.entries()? {
        if entry.kind == EntryKind::Directory {
            continue;
        }
        if let Some(host) = entry
            .name
            .to_str()
            .and_then(|n| n.strip_suffix(XPLANE_SUFFIX))
        {
            if !host.is_empty() && !host.starts_with('.') {
                hosts.push(host.to_string());
            }
        }
    }
    hosts.sort();
    Ok(hosts)
}

/// The trace file name of `host` in a session.
pub fn host_file(host: &str) -> PathBuf {
    PathBuf::from(format!("{host}{XPLANE_SUFFIX}"))
}

fn session_tools(session: &Dir, hosts: &[String]) -> Vec<String> {
    let mut tools: Vec<String> = BASE_TOOLS.iter().map(|t| t.to_string()).collect();
    let (mut host_plane, mut gpu_plane) = (false, false);
    for host in hosts {
        let Ok(bytes) = session.read(&host_file(host)) else {
            continue;
        };
        for name in plane_names(&bytes).unwrap_or_default() {
            host_plane |= name == conventions::HOST_PLANE;
            gpu_plane |= name.starts_with("/device:GPU:");
        }
    }
    if host_plane {
        tools.push("memory_profile".into());
    }
    if gpu_plane {
        tools.push("kernel_stats".into());
    }
    tools.sort();
    tools
}

/// Tools [`tool_data`] serves.
pub const TOOLS: &[&str] = &[
    "kernel_stats",
    "memory_profile",
    "overview",
    "trace_viewer",
    "xplane",
];

/// What a tool returns.
#[derive(Debug, PartialEq)]
pub enum ToolOutput {
    Json(String),
    Blob(Vec<u8>),
}

impl ToolOutput {
    /// The `output_format` name of this output.
    pub fn format(&self) -> &'static str {
        match self {
            ToolOutput::Json(_) => "json",
            ToolOutput::Blob(_) => "blob",
        }
    }

    pub fn into_bytes(self) -> Vec<u8> {
        match self {
            ToolOutput::Json(text) => text.into_bytes(),
            ToolOutput::Blob(bytes) => bytes,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ToolDataError {
    #[error("tool_name: unknown tool {tool:?} (available: {})", TOOLS.join(", "))]
    UnknownTool { tool: String },
    #[error("host_name: no trace for host {host:?} in this session (hosts: {})", hosts.join(", "))]
    UnknownHost { host: String, hosts: Vec<String> },
    #[error("host_name: {tool} returns one host's file; name one of: {}", hosts.join(", "))]
    NeedsHost { tool: String, hosts: Vec<String> },
    #[error("session_id: no traces in {path}")]
    EmptySession { path: String },
    #[error("parameters[{name}]: {reason}")]
    Parameter { name: String, reason: String },
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Read(#[from] crate::xspace::read::ReadError),
    #[error(transparent)]
    Tool(#[from] crate::tools::ToolError),
}

fn parameter<T: std::str::FromStr>(
    parameters: &std::collections::HashMap<String, String>,
    name: &str,
) -> Result<Option<T>, ToolDataError> {
    parameters
        .get(name)
        .map(|text| {
            text.trim()
                .parse::<T>()
                .map_err(|_| ToolDataError::Parameter {
                    name: name.to_string(),
                    reason: format!("{text:?} is not a valid number"),
                })
        })
        .transpose()
}

fn check_parameters(
    tool: &str,
    parameters: &std::collections::HashMap<String, String>,
    known: &[&str],
) -> Result<(), ToolDataError> {
    match parameters.keys().find(|k| !known.contains(&k.as_str())) {
        Some(unknown) => Err(ToolDataError::Parameter {
            name: unknown.clone(),
            reason: format!(
                "{tool} takes no such parameter (it takes: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ),
        }),
        None => Ok(()),
    }
}

/// Computes `tool` for one host of a session, or for every host (a JSON
/// object keyed by host) when `host` is `None`.
pub fn tool_data(
    session: &Dir,
    host: Option<&str>,
    tool: &str,
    parameters: &std::collections::HashMap<String, String>,
) -> Result<ToolOutput, ToolDataError> {
    use crate::tools;
    if !TOOLS.contains(&tool) {
        return Err(ToolDataError::UnknownTool {
            tool: tool.to_string(),
        });
    }
    let hosts = session_hosts(session)?;
    if hosts.is_empty() {
        return Err(ToolDataError::EmptySession {
            path: session.path().display().to_string(),
        });
    }
    let selected: Vec<String> = match host {
        Some(host) => {
            let wanted = host.replace(':', "_");
            if !hosts.contains(&wanted) {
                return Err(ToolDataError::UnknownHost {
                    host: host.to_string(),
                    hosts,
                });
            }
            vec![wanted]
        }
        None => hosts.clone(),
    };
    let known: &[&str] = match tool {
        "trace_viewer" => &["start_time_ms", "end_time_ms", "resolution"],
        "overview" => &["top"],
        _ => &[],
    };
    check_parameters(tool, parameters, known)?;
    if tool == "xplane" {
        if selected.len() > 1 {
            return Err(ToolDataError::NeedsHost {
                tool: tool.to_string(),
                hosts,
            });
        }
        let bytes = session
            .read(&host_file(&selected[0]))
            .map_err(SessionError::from)?;
        return Ok(ToolOutput::Blob(bytes));
    }
    let viewer = tools::trace_viewer::TraceViewerOptions {
        start_time_ms: parameter(parameters, "start_time_ms")?,
        end_time_ms: parameter(parameters, "end_time_ms")?,
        resolution: parameter(parameters, "resolution")?
            .unwrap_or(tools::trace_viewer::TraceViewerOptions::default().resolution),
    };
    let top: usize = parameter(parameters, "top")?.unwrap_or(10);
    let mut per_host = Vec::with_capacity(selected.len());
    for name in &selected {
        let file = host_file(name);
        let bytes = session.read(&file).map_err(SessionError::from)?;
        let space = crate::xspace::read::decode_xspace(&bytes, &session.path().join(&file))?;
        let json = match tool {
            "trace_viewer" => tools::trace_viewer::trace_viewer(&space, &viewer)?.to_json(),
            "memory_profile" => tools::memory_profile::memory_profile_json(&space)?,
            "kernel_stats" => tools::kernel_stats::kernel_stats(&space)?.to_json(),
            _ => tools::overview::overview(&space, top)?.to_json(),
        };
        per_host.push((name.clone(), json));
    }
    if host.is_some() {
        return Ok(ToolOutput::Json(per_host.remove(0).1));
    }
    let mut out = String::from("{\"hosts\":{");
    for (i, (name, json)) in per_host.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        crate::tools::json::string(&mut out, name);
        out.push(':');
        out.push_str(json);
    }
    out.push_str("}}");
    Ok(ToolOutput::Json(out))
}
