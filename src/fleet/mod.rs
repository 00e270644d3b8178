//! Profiling sessions over many hosts: the fan-out that captures every host
//! with one shared window, and the listing of sessions in a repository
//! (`<repository_root>/<session>/<host>.xplane.pb`). Used by the
//! ProfileAnalysis service and by `devtrace session` / `devtrace sessions`.

pub mod hosts;
pub mod streaming;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::model::timeline;
use crate::proto::tensorflow::ProfileRequest;
use crate::protocol::client::{self, ClientConfig, Target};
use crate::protocol::RIEGELI_TOOL;
use crate::repository::{Folder, StorageError};
use crate::xspace::chunks::RIEGELI_SUFFIX;
use crate::xspace::read::plane_names;
use crate::xspace::Grant;
use streaming::ReceiveError;

pub use crate::repository::XPLANE_SUFFIX;

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
    /// that did not resolve), from [`crate::fleet::hosts::Resolved::failures`].
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
            HostError::NoSlot(_) => "not called in time",
            HostError::Deadline(_) => "no reply in time",
            HostError::Receive(error) => error.kind(),
        }
    }
}

/// `10.0.0.2:8466` -> `10.0.0.2_8466`: the host part of its trace file's
/// name (`10.0.0.2_8466.xplane.pb`, as TensorFlow names files), as
/// [`session_traces`] keys a session's.
pub fn host_file_part(host: &str) -> String {
    host.replace(':', "_")
}

/// The host part of each target's trace file ([`host_file_part`]), as
/// [`held_traces`] takes them.
pub fn host_file_parts(hosts: &[Target]) -> Vec<String> {
    hosts
        .iter()
        .map(|host| host_file_part(&host.to_string()))
        .collect()
}

pub use crate::fleet::streaming::{TraceFile, TraceSink};

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
/// ([`crate::fleet::streaming`]), so what is held is a batch per host being
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
        // The trace comes back here to be written through `sink`: a devtrace
        // agent sends one too large for an XSpace as Riegeli chunks rather
        // than writing it where it stands. (`repository_root` stays: servers
        // that ignore `emit_xspace` write the trace there themselves.)
        if !request.tools.iter().any(|tool| tool == RIEGELI_TOOL) {
            request.tools.push(RIEGELI_TOOL.to_string());
        }
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
        let host = host_file_part(&target.to_string());
        Ok(streaming::profile_to_file(&connection, request, sink, &host).await?)
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
    /// Hosts whose trace is not one, or not one the caller may read.
    pub unreadable: Vec<String>,
    pub modified: SystemTime,
}

/// Tools every trace supports.
pub const BASE_TOOLS: &[&str] = &["trace_viewer", "overview", "xplane"];

/// The sessions in `root`, newest first. Local files are opened beneath
/// `root` without following links; entries that are links are skipped.
pub fn list_sessions(root: &Folder) -> Result<Vec<SessionInfo>, StorageError> {
    list_sessions_within(root, &mut crate::xspace::Unlimited)
}

/// As [`list_sessions`], each trace read for its plane names (which tools
/// serve it) drawn from `grant` while it is read; one the grant cannot
/// hold now is listed with the tools every trace has.
pub fn list_sessions_within<G>(
    root: &Folder,
    grant: &mut G,
) -> Result<Vec<SessionInfo>, StorageError>
where
    G: Grant,
    G::Refusal: std::fmt::Display,
{
    let mut sessions = Vec::new();
    for subfolder in root.subfolders()? {
        let session = root.join(&subfolder.name);
        // Removed or swapped for a link since it was listed: not a session.
        let Ok(files) = session.listed_files() else {
            continue;
        };
        let traces = traces_among(files.iter().map(|file| file.name.clone()));
        if traces.is_empty() {
            continue;
        }
        // When its traces were written: the caches XProf writes into a
        // session as it is opened do not make it newer.
        let trace_files: std::collections::HashSet<&String> = traces.values().collect();
        let modified = files
            .iter()
            .filter(|file| trace_files.contains(&file.name))
            .map(|file| file.modified)
            .max()
            .unwrap_or(subfolder.modified);
        let (tools, unreadable) = session_tools(&session, &traces, grant);
        let hosts = traces.into_keys().collect();
        sessions.push(SessionInfo {
            session_id: subfolder.name,
            hosts,
            tools,
            unreadable,
            modified,
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
    Ok(traces_among(session.files()?))
}

/// The host a session's trace file is of, as its name says
/// (`10.0.0.2_8466.xplane.pb` -> `10.0.0.2_8466`): how sessions, tools
/// and XProf name it. None for a name that is not a trace's.
pub fn host_of_trace_file(name: &str) -> Option<&str> {
    name.strip_suffix(XPLANE_SUFFIX)
        .or_else(|| name.strip_suffix(RIEGELI_SUFFIX))
        .filter(|host| !host.is_empty() && !host.starts_with('.'))
}

/// The trace file of each host among a session's file `names`, by host
/// ([`session_traces`]).
fn traces_among(names: impl IntoIterator<Item = String>) -> BTreeMap<String, String> {
    let mut traces = BTreeMap::new();
    for name in names {
        let whole = name.ends_with(XPLANE_SUFFIX);
        if let Some(host) = host_of_trace_file(&name) {
            let file = traces
                .entry(host.to_string())
                .or_insert_with(|| name.clone());
            if whole {
                *file = name.clone();
            }
        }
    }
    traces
}

/// The trace files `session` holds already of `hosts` (the host parts of
/// their names, [`host_file_part`]): a session named again, which no
/// trace of theirs may be written over. A session that cannot be read
/// holds none (a write refuses to replace a trace anyway). A link or other
/// entry planted under a trace's name does not count (it is refused when
/// the trace is written, and said then); a trace the caller may not read
/// (another user's) does.
pub fn held_traces(session: &Folder, hosts: &[String]) -> Vec<String> {
    let Ok(traces) = session_traces(session) else {
        return Vec::new();
    };
    hosts
        .iter()
        .filter_map(|host| traces.get(host))
        .filter(|file| {
            !matches!(
                session.size(file),
                Err(StorageError::NotFound { .. } | StorageError::Refused(_))
            )
        })
        .cloned()
        .collect()
}

/// Whether `folder` is a session directory itself: it holds traces (given
/// where a logdir or repository was expected, it lists no sessions).
pub fn holds_traces(folder: &Folder) -> bool {
    session_traces(folder).is_ok_and(|traces| !traces.is_empty())
}

/// Hosts with a trace in a session directory, sorted.
pub fn session_hosts(session: &Folder) -> Result<Vec<String>, StorageError> {
    Ok(session_traces(session)?.into_keys().collect())
}

/// What a look into a session's trace file for its plane names found.
enum Planes {
    Named(Vec<String>),
    /// Not looked into: more than the listing may hold now.
    Unread,
    /// Not a trace, or not one the caller may read: no tool serves it.
    Unreadable,
}

/// The plane names of a session's trace file `file`, the file and what
/// reading it takes drawn from `grant`. The planes of a chunked trace are
/// read chunk by chunk, none decoded.
fn trace_planes<G>(session: &Folder, file: &str, grant: &mut G) -> Planes
where
    G: Grant,
    G::Refusal: std::fmt::Display,
{
    let Ok(size) = session.size(file) else {
        return Planes::Unreadable;
    };
    let held = usize::try_from(size).unwrap_or(usize::MAX);
    if grant.take(held).is_err() {
        return Planes::Unread;
    }
    let planes = match session.read_at_most(file, size) {
        Ok(bytes) if bytes.is_empty() => Planes::Unreadable,
        // Grown since its size was drawn: looked into another time.
        Err(StorageError::TooLarge { .. }) => Planes::Unread,
        Ok(bytes) if file.ends_with(RIEGELI_SUFFIX) => {
            chunk_planes(&bytes, &mut crate::xspace::grant::Said(&mut *grant))
        }
        Ok(bytes) => plane_names(&bytes).map_or(Planes::Unreadable, Planes::Named),
        Err(_) => Planes::Unreadable,
    };
    grant.let_go(held);
    planes
}

/// The plane names in the chunks of a chunked trace.
fn chunk_planes(file: &[u8], grant: crate::xspace::riegeli::ChunkGrant<'_>) -> Planes {
    use crate::xspace::riegeli::RiegeliError;
    let mut names = Vec::new();
    for record in crate::xspace::riegeli::records_within(file, grant) {
        match record.map(|record| plane_names(&record)) {
            Ok(Ok(more)) => names.extend(more),
            Err(RiegeliError::Refused { .. }) => return Planes::Unread,
            // What was read before the damage is what XProf would show.
            Ok(Err(_)) | Err(_) if !names.is_empty() => break,
            Ok(Err(_)) | Err(_) => return Planes::Unreadable,
        }
    }
    Planes::Named(names)
}

/// The tools that serve a session whose traces are `traces`: none when no
/// trace in it can be read (a tool would only fail); the tools every trace
/// has when one could not be looked into now.
fn session_tools<G>(
    session: &Folder,
    traces: &BTreeMap<String, String>,
    grant: &mut G,
) -> (Vec<String>, Vec<String>)
where
    G: Grant,
    G::Refusal: std::fmt::Display,
{
    let (mut readable, mut host_plane, mut gpu_plane) = (false, false, false);
    let mut unreadable = Vec::new();
    for (host, file) in traces {
        match trace_planes(session, file, grant) {
            Planes::Named(names) => {
                readable = true;
                for name in names {
                    host_plane |= name == timeline::HOST_PLANE;
                    gpu_plane |= name.starts_with("/device:GPU:");
                }
            }
            Planes::Unread => readable = true,
            Planes::Unreadable => unreadable.push(host.clone()),
        }
    }
    if !readable {
        return (Vec::new(), unreadable);
    }
    let mut tools: Vec<String> = BASE_TOOLS.iter().map(|t| t.to_string()).collect();
    if host_plane {
        tools.push("memory_profile".into());
    }
    if gpu_plane {
        tools.push("kernel_stats".into());
    }
    tools.sort();
    (tools, unreadable)
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
        "host_name: this host's trace is stored as Riegeli chunks ({file}), as traces too \
         large for one XSpace are, which xplane does not return; read that file itself (XProf \
         2.23 and later, devtrace inspect)"
    )]
    Chunked { file: String },
    #[error("session_id: no traces in {path}")]
    EmptySession { path: String },
    #[error(
        "{file} grew from {planned} to {now} bytes while the tool was being computed; ask again"
    )]
    Grew {
        file: String,
        planned: u64,
        now: u64,
    },
    #[error("parameters[{name}]: {reason}")]
    Parameter { name: String, reason: String },
    #[error("{what} would take more memory than may be held: {why}")]
    Refused { what: String, why: String },
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
/// object keyed by host) when `host` is `None`, what it reads and decodes
/// drawn from `grant`.
pub fn tool_data<G>(
    session: &Folder,
    host: Option<&str>,
    tool: &str,
    parameters: &std::collections::HashMap<String, String>,
    grant: &mut G,
) -> Result<Computed, ToolDataError>
where
    G: Grant,
    G::Refusal: std::fmt::Display,
{
    plan_tool(session, host, tool, parameters)?.run_within(session, grant)
}

/// A tool's output, and what it leaves out of the traces it was computed
/// from, for people (a trace viewer cut to its resolution, a host whose
/// trace could not be read), one line per host.
#[derive(Debug)]
pub struct Computed {
    pub output: ToolOutput,
    pub left_out: Vec<String>,
    /// Hosts left out whole (their trace unreadable), of `hosts`.
    pub failed_hosts: usize,
    pub hosts: usize,
}

/// What computing a tool takes at most per byte of the trace it reads:
/// the trace read and decoded into messages, and the tool's own tables
/// (measured peaks: 7.3x the file for `trace_viewer`, 8.9x for
/// `memory_profile`, 6.7x for `kernel_stats` and `overview`, on a 68 MB
/// trace of the mock at 1 M events/s).
pub const TOOL_BYTES_PER_TRACE_BYTE: u64 = 10;

/// A tool's work on a session, checked and planned: the hosts' trace files
/// it will read, with their sizes, so that what it takes is known before
/// anything is read ([`ToolPlan::memory_bytes`]).
#[derive(Debug)]
pub struct ToolPlan {
    tool: String,
    /// Whether one host was asked for (its JSON alone, not keyed by host).
    one_host: bool,
    /// (host, file, size) of each trace to read.
    traces: Vec<(String, String, u64)>,
    /// The hosts whose trace cannot be read, and why.
    unplanned: Vec<(String, ToolDataError)>,
    viewer: crate::tools::trace_viewer::TraceViewerOptions,
    top: usize,
}

/// Checks a tool request against the session (the tool, the host, the
/// parameters) and plans it.
pub fn plan_tool(
    session: &Folder,
    host: Option<&str>,
    tool: &str,
    parameters: &std::collections::HashMap<String, String>,
) -> Result<ToolPlan, ToolDataError> {
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
    }
    let viewer = tools::trace_viewer::TraceViewerOptions {
        start_time_ms: parameter(parameters, "start_time_ms")?,
        end_time_ms: parameter(parameters, "end_time_ms")?,
        resolution: parameter(parameters, "resolution")?
            .unwrap_or(tools::trace_viewer::TraceViewerOptions::default().resolution),
    };
    if let Err(tools::ToolError::InvalidParameter { name, reason }) = viewer.window_ps() {
        return Err(ToolDataError::Parameter {
            name: name.to_string(),
            reason,
        });
    }
    let top: usize = parameter(parameters, "top")?.unwrap_or(10);
    let mut planned = Vec::with_capacity(selected.len());
    let mut unplanned = Vec::new();
    for name in selected {
        let file = traces[&name].clone();
        match session.size(&file) {
            Ok(size) => planned.push((name, file, size)),
            // Of every host, one whose file cannot be read is left out.
            Err(error) if host.is_none() && tool != "xplane" => {
                unplanned.push((name, ToolDataError::from(error)));
            }
            Err(error) => return Err(error.into()),
        }
    }
    if planned.is_empty() && !unplanned.is_empty() {
        return Err(unplanned.swap_remove(0).1);
    }
    Ok(ToolPlan {
        tool: tool.to_string(),
        one_host: host.is_some(),
        traces: planned,
        unplanned,
        viewer,
        top,
    })
}

impl ToolPlan {
    /// The most memory computing the tool takes: the largest trace decoded
    /// and worked on (hosts are done one at a time), and every host's
    /// output kept until all are done (no larger than its trace). `xplane`
    /// returns the file itself, read once and sent.
    pub fn memory_bytes(&self) -> u64 {
        let total = self.input_bytes();
        if self.tool == "xplane" {
            return total.saturating_mul(2);
        }
        let largest = self
            .traces
            .iter()
            .map(|(_, _, size)| *size)
            .max()
            .unwrap_or(0);
        largest
            .saturating_mul(TOOL_BYTES_PER_TRACE_BYTE)
            .saturating_add(total)
    }

    /// The tool's name.
    pub fn tool(&self) -> &str {
        &self.tool
    }

    /// Bytes of the traces it reads.
    pub fn input_bytes(&self) -> u64 {
        self.traces.iter().map(|(_, _, size)| size).sum()
    }

    /// Reads the traces and computes the tool. A trace that grew since it
    /// was planned is refused: what the tool takes was counted for the
    /// size it had.
    pub fn run(self, session: &Folder) -> Result<Computed, ToolDataError> {
        self.run_within(session, &mut crate::xspace::Unlimited)
    }

    /// As [`Self::run`], drawing from `grant` each trace read and what
    /// decoding it takes before it is taken ([`crate::xspace::footprint`]),
    /// and each host's output as it is kept: a trace that would take more
    /// than the grant gives is refused, whatever its size on disk. Of
    /// several hosts, one whose trace cannot be read or computed is named
    /// in the output (`"failed"`) and the others are served; only when none
    /// can be is it an error.
    pub fn run_within<G>(
        mut self,
        session: &Folder,
        grant: &mut G,
    ) -> Result<Computed, ToolDataError>
    where
        G: Grant,
        G::Refusal: std::fmt::Display,
    {
        let mut grant = crate::xspace::grant::Tally::new(grant);
        if self.tool == "xplane" {
            let (_, file, size) = &self.traces[0];
            return Ok(Computed {
                output: ToolOutput::Blob(read_planned(session, file, *size, &mut grant)?),
                left_out: Vec::new(),
                failed_hosts: 0,
                hosts: 1,
            });
        }
        let mut left_out = Vec::new();
        let mut per_host = Vec::with_capacity(self.traces.len());
        let mut failed = std::mem::take(&mut self.unplanned);
        for (name, error) in &failed {
            left_out.push(format!("{name}: left out: {error}"));
        }
        for (name, file, size) in &self.traces {
            let before = grant.held();
            let computed = self.host_output(session, name, file, *size, &mut grant, &mut left_out);
            // What this host's work drew is let go of; its output is kept.
            grant.let_go(grant.held() - before);
            let kept = computed.and_then(|json| {
                grant
                    .take(json.len())
                    .map(|()| json)
                    .map_err(|refusal| ToolDataError::Refused {
                        what: format!("keeping {name}'s {}", self.tool),
                        why: refusal.to_string(),
                    })
            });
            match kept {
                Ok(json) => per_host.push((name.clone(), json)),
                Err(error) if self.one_host => return Err(error),
                Err(error) => {
                    left_out.push(format!("{name}: left out: {error}"));
                    failed.push((name.clone(), error));
                }
            }
        }
        if per_host.is_empty() && !failed.is_empty() {
            return Err(failed.swap_remove(0).1);
        }
        let host_count = per_host.len() + failed.len();
        if self.one_host {
            return Ok(Computed {
                output: ToolOutput::Json(per_host.remove(0).1),
                left_out,
                failed_hosts: 0,
                hosts: host_count,
            });
        }
        use crate::tools::json::Object;
        let mut out = String::new();
        let mut whole = Object::new(&mut out);
        let mut hosts = Object::new(whole.key("hosts"));
        for (name, json) in &per_host {
            hosts.raw(name, json);
        }
        hosts.end();
        if !failed.is_empty() {
            let mut why = Object::new(whole.key("failed"));
            for (name, error) in &failed {
                why.str(name, &error.to_string());
            }
            why.end();
        }
        whole.end();
        Ok(Computed {
            output: ToolOutput::Json(out),
            left_out,
            failed_hosts: failed.len(),
            hosts: host_count,
        })
    }

    /// One host's output: its trace read, decoded and the tool computed.
    fn host_output<G>(
        &self,
        session: &Folder,
        name: &str,
        file: &str,
        size: u64,
        grant: &mut G,
        left_out: &mut Vec<String>,
    ) -> Result<String, ToolDataError>
    where
        G: Grant,
        G::Refusal: std::fmt::Display,
    {
        use crate::tools;
        let bytes = read_planned(session, file, size, grant)?;
        let shown = PathBuf::from(format!("{}/{file}", session.display()));
        let space = crate::xspace::read::decode_trace_within(&bytes, &shown, grant)?.space;
        drop(bytes);
        Ok(match self.tool.as_str() {
            "trace_viewer" => {
                let trace = tools::trace_viewer::trace_viewer(&space, &self.viewer)?;
                if trace.events_in_window == 0 && trace.total_events > 0 {
                    let ms = |bound: Option<f64>| bound.map(|ms| format!("{ms} ms"));
                    left_out.push(format!(
                        "{name}: none of its {} events overlaps the window asked for ({} to {}, \
                         from the capture's start)",
                        trace.total_events,
                        ms(self.viewer.start_time_ms).unwrap_or_else(|| "its start".into()),
                        ms(self.viewer.end_time_ms).unwrap_or_else(|| "its end".into()),
                    ));
                }
                if trace.events.len() < trace.events_in_window {
                    left_out.push(format!(
                        "{name}: {} of the {} events in the window, the longest in each part \
                         of it (resolution {}; resolution=0 returns every one)",
                        trace.events.len(),
                        trace.events_in_window,
                        self.viewer.resolution
                    ));
                }
                trace.to_json()
            }
            "memory_profile" => tools::memory_profile::memory_profile_json(&space)?,
            "kernel_stats" => tools::kernel_stats::kernel_stats(&space)?.to_json(),
            _ => tools::overview::overview(&space, self.top)?.to_json(),
        })
    }
}

/// A session's trace `file`, drawn from `grant` at the size it was planned
/// at; one that grew since is refused (what the tool takes was counted for
/// the size it had).
fn read_planned<G>(
    session: &Folder,
    file: &str,
    planned: u64,
    grant: &mut G,
) -> Result<Vec<u8>, ToolDataError>
where
    G: Grant,
    G::Refusal: std::fmt::Display,
{
    grant
        .take(usize::try_from(planned).unwrap_or(usize::MAX))
        .map_err(|refusal| ToolDataError::Refused {
            what: format!("reading {}/{file} ({planned} bytes)", session.display()),
            why: refusal.to_string(),
        })?;
    let grew = |now| ToolDataError::Grew {
        file: format!("{}/{file}", session.display()),
        planned,
        now,
    };
    match session.read_at_most(file, planned) {
        Err(StorageError::TooLarge { .. }) if planned < crate::repository::MAX_READ_BYTES => {
            Err(grew(session.size(file).unwrap_or(0)))
        }
        read => Ok(read?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repository::Location;
    use std::time::Duration;

    #[test]
    fn sessions_are_newest_first_by_when_their_traces_were_written() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        for (session, age) in [("older", 100), ("newer", 50)] {
            std::fs::create_dir(dir.path().join(session)).unwrap();
            let trace =
                std::fs::File::create(dir.path().join(session).join("h.xplane.pb")).unwrap();
            trace.set_modified(now - Duration::from_secs(age)).unwrap();
        }
        // XProf's caches, written as the older session is opened.
        std::fs::write(dir.path().join("older/h.trace_viewer.SSTABLE"), b"cache").unwrap();
        let root = Folder::open(&Location::Local(dir.path().to_path_buf())).unwrap();
        let listed: Vec<String> = list_sessions(&root)
            .unwrap()
            .into_iter()
            .map(|session| session.session_id)
            .collect();
        assert_eq!(listed, ["newer", "older"]);
    }
}
