//! Profiling sessions over many hosts: the fan-out that captures every host
//! with one shared window, and the listing of sessions in a repository
//! (`<repository_root>/<session>/<host>.xplane.pb`). Used by the
//! ProfileAnalysis service and by `devtrace session` / `devtrace sessions`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::task::JoinSet;

use crate::client::{self, ClientConfig, Target};
use crate::proto::tensorflow::ProfileRequest;
use crate::storage::{Folder, StorageError};
use crate::xspace::chunks::RIEGELI_SUFFIX;
use crate::xspace::conventions;
use crate::xspace::read::plane_names;

/// Suffix of trace files in a session directory.
pub const XPLANE_SUFFIX: &str = ".xplane.pb";

/// What one host of a fan-out gave back.
#[derive(Debug)]
pub struct HostOutcome {
    /// `host:port` as addressed.
    pub host: String,
    /// Where its trace was written, `None` for an empty trace, or why not.
    pub result: Result<Option<PathBuf>, String>,
}

/// `10.0.0.2:8466` -> `10.0.0.2_8466.xplane.pb`, as TensorFlow names files.
pub fn host_file_name(host: &str) -> String {
    format!("{}{XPLANE_SUFFIX}", host.replace(':', "_"))
}

/// Writes one host's trace (its file name, its bytes) and says where.
pub type Deliver = Arc<dyn Fn(&str, &[u8]) -> Result<PathBuf, String> + Send + Sync>;

/// Captures `request`'s window on every host at once. Each host gets the
/// same absolute start, so the traces line up, and is called when that
/// start comes (servers such as TensorFlow's record from when they are
/// called); each is asked to return its trace inline, and each trace is
/// handed to `deliver` as soon as it arrives, so that only the replies
/// still in flight are held. A host that fails, times out, returns nothing
/// or more than `client.max_reply_bytes` is reported in its outcome; the
/// others are unaffected.
pub async fn fan_out(
    hosts: &[Target],
    request: &ProfileRequest,
    deadline: Duration,
    client: &ClientConfig,
    deliver: Deliver,
) -> Vec<HostOutcome> {
    let mut tasks = JoinSet::new();
    for (index, target) in hosts.iter().enumerate() {
        let mut request = request.clone();
        let host = target.to_string();
        request.host_name = host.clone();
        request.emit_xspace = true;
        let target = target.clone();
        let client = client.clone();
        let deliver = Arc::clone(&deliver);
        let start_ns = request.opts.as_ref().map_or(0, |o| o.start_timestamp_ns);
        tasks.spawn(async move {
            tokio::time::sleep(crate::clock::until(start_ns)).await;
            let result = match capture_host(&target, request, deadline, &client).await {
                Ok(Some(trace)) => {
                    let file_name = host_file_name(&host);
                    tokio::task::spawn_blocking(move || deliver(&file_name, &trace))
                        .await
                        .unwrap_or_else(|e| Err(format!("writing the trace failed: {e}")))
                        .map(Some)
                }
                Ok(None) => Ok(None),
                Err(error) => Err(error),
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

/// The sessions in `root`, newest first. Local files are opened beneath
/// `root` without following links; entries that are links are skipped.
pub fn list_sessions(root: &Folder) -> Result<Vec<SessionInfo>, StorageError> {
    let mut sessions = Vec::new();
    for subfolder in root.subfolders()? {
        let session = root.join(&subfolder.name);
        // Removed or swapped for a link since it was listed: not a session.
        let Ok(traces) = session_traces(&session) else {
            continue;
        };
        if traces.is_empty() {
            continue;
        }
        let tools = session_tools(&session, &traces);
        let hosts = traces.into_keys().collect();
        sessions.push(SessionInfo {
            session_id: subfolder.name,
            hosts,
            tools,
            modified: subfolder.modified,
        });
    }
    sessions.sort_by(|a, b| {
        b.modified
            .cmp(&a.modified)
            .then(b.session_id.cmp(&a.session_id))
    });
    Ok(sessions)
}

/// The trace file of each host in a session directory, by host:
/// `<host>.xplane.pb`, or for a trace too large for one XSpace
/// `<host>.xplane.riegeli` (the `.pb` when both are there). A link or FIFO
/// named like a trace counts, so that asking for it is refused by name.
pub fn session_traces(session: &Folder) -> Result<BTreeMap<String, String>, StorageError> {
    let mut traces = BTreeMap::new();
    for name in session.files()? {
        let whole = name.ends_with(XPLANE_SUFFIX);
        let host = name
            .strip_suffix(XPLANE_SUFFIX)
            .or_else(|| name.strip_suffix(RIEGELI_SUFFIX));
        if let Some(host) = host.filter(|h| !h.is_empty() && !h.starts_with('.')) {
            let file = traces
                .entry(host.to_string())
                .or_insert_with(|| name.clone());
            if whole {
                *file = name.clone();
            }
        }
    }
    Ok(traces)
}

/// Hosts with a trace in a session directory, sorted.
pub fn session_hosts(session: &Folder) -> Result<Vec<String>, StorageError> {
    Ok(session_traces(session)?.into_keys().collect())
}

/// The planes of a session's trace file `file`, by its suffix.
fn trace_planes(file: &str, bytes: &[u8]) -> Vec<String> {
    if file.ends_with(RIEGELI_SUFFIX) {
        return crate::xspace::chunks::decode(bytes)
            .map(|(space, _)| space.planes.into_iter().map(|p| p.name).collect())
            .unwrap_or_default();
    }
    plane_names(bytes).unwrap_or_default()
}

fn session_tools(session: &Folder, traces: &BTreeMap<String, String>) -> Vec<String> {
    let mut tools: Vec<String> = BASE_TOOLS.iter().map(|t| t.to_string()).collect();
    let (mut host_plane, mut gpu_plane) = (false, false);
    for file in traces.values() {
        let Ok(bytes) = session.read(file) else {
            continue;
        };
        for name in trace_planes(file, &bytes) {
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
    #[error(
        "host_name: this host's trace is stored as Riegeli chunks ({file}), too large for one \
         XSpace; read that file itself (XProf 2.23 and later, devtrace inspect)"
    )]
    Chunked { file: String },
    #[error("session_id: no traces in {path}")]
    EmptySession { path: String },
    #[error("parameters[{name}]: {reason}")]
    Parameter { name: String, reason: String },
    #[error(transparent)]
    Storage(#[from] StorageError),
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
    session: &Folder,
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
    let traces = session_traces(session)?;
    let hosts: Vec<String> = traces.keys().cloned().collect();
    if hosts.is_empty() {
        return Err(ToolDataError::EmptySession {
            path: session.display(),
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
        let file = &traces[&selected[0]];
        if file.ends_with(RIEGELI_SUFFIX) {
            return Err(ToolDataError::Chunked {
                file: format!("{}/{file}", session.display()),
            });
        }
        return Ok(ToolOutput::Blob(session.read(file)?));
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
        let file = &traces[name];
        let bytes = session.read(file)?;
        let shown = PathBuf::from(format!("{}/{file}", session.display()));
        let space = crate::xspace::read::decode_trace(&bytes, &shown)?.space;
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
