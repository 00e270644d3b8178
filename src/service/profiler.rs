//! `tensorflow.ProfilerService`: on-demand captures (`Profile`, `Terminate`),
//! `Monitor`, and continuous profiling served from the flight recorder
//! (`StartContinuousProfiling`, `GetSnapshot`, `StopContinuousProfiling`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::agent::Agent;
use crate::analysis;
use crate::backend::CaptureEnd;
use crate::client;
use crate::clock;
use crate::proto::tensorflow::profile_options::advanced_config_value;
use crate::proto::tensorflow::profiler::XSpace;
use crate::proto::tensorflow::profiler_service_monitor_result::ResponseType;
use crate::proto::tensorflow::profiler_service_server;
use crate::proto::tensorflow::{
    ContinuousProfilingResponse, GetSnapshotRequest, MonitorRequest, MonitorResponse,
    ProfileRequest, ProfileResponse, ProfileToolData, ProfilerServiceMonitorResult,
    StopContinuousProfilingRequest, StopContinuousProfilingResponse, TerminateRequest,
    TerminateResponse,
};
use crate::session;
use crate::store::Window;
use crate::telemetry::Telemetry;
use crate::xspace::chunks::{ChunkedTrace, RIEGELI_SUFFIX};
use crate::xspace::{self, CaptureInfo, Encoded};

use crate::storage::{Folder, StorageError};

use super::capture_memory::{CaptureMemory, DEFAULT_CAPTURE_MEMORY};
use super::framed_reply::FramedReply;
use super::repository::AllowedRoots;
use super::shared_builds::{BuildKey, SharedBuilds, Slot};
use super::validate::{self, invalid};

pub use crate::protocol::{RIEGELI_TOOL, XPLANE_TOOL};
/// Suffix of trace files in a repository.
pub use crate::session::XPLANE_SUFFIX;
/// Traces larger than this are stored as Riegeli chunks unless configured
/// otherwise: well below protobuf's 2 GiB, so that replies that still carry
/// one message stay readable by every client.
pub const DEFAULT_CHUNK_TRACES_OVER: usize = 1 << 30;

/// Operator settings of the service.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Longest capture window a request may ask for.
    pub max_duration: Duration,
    /// How far in the future a capture may be scheduled to start.
    pub max_start_delay: Duration,
    pub allowed_roots: AllowedRoots,
    /// Name of this host, recorded in every trace.
    pub hostname: String,
    /// In-process profiler servers whose traces every `Profile` capture
    /// folds in.
    pub upstreams: Vec<client::Target>,
    /// How upstreams are called: TLS, and the largest reply accepted.
    pub client: client::ClientConfig,
    /// Health and metrics of the server these services run in.
    pub telemetry: Arc<Telemetry>,
    /// Size of an encoded trace above which it is stored as Riegeli chunks
    /// (`<host>.xplane.riegeli`) instead of one XSpace message.
    pub chunk_traces_over: usize,
    /// Budget for traces being built and replied at once
    /// (`--capture-memory`).
    pub capture_memory: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            max_duration: Duration::from_secs(600),
            max_start_delay: Duration::from_secs(600),
            allowed_roots: AllowedRoots::default(),
            hostname: local_hostname(),
            upstreams: Vec::new(),
            client: client::ClientConfig::default(),
            telemetry: Telemetry::new(),
            chunk_traces_over: DEFAULT_CHUNK_TRACES_OVER,
            capture_memory: DEFAULT_CAPTURE_MEMORY,
        }
    }
}

/// This machine's host name, or "localhost" when it has none.
pub fn local_hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A capture request after validation.
#[derive(Clone, Debug)]
struct Plan {
    window: Window,
    session_id: String,
    /// The client named no session: `session_id` is a timestamp, and the
    /// directory gets a suffix when another capture took that name.
    generated_session_id: bool,
    /// Base name of the trace file (`<host>.xplane.pb`).
    file_host: String,
    repository_root: String,
    emit_xspace: bool,
    options: Vec<u8>,
    warnings: Vec<String>,
    /// Backends' running loss totals when the request arrived.
    losses_at_start: Vec<(&'static str, crate::backend::Loss)>,
    /// Facts for the Task Environment beyond the backends' (a trigger's).
    properties: Vec<(String, String)>,
    /// The client asked for device-specific detail
    /// (`device_tracer_level` 2 or more).
    detailed_device: bool,
}

/// The message form of an encoded trace, for replies that carry it inline.
fn decode(bytes: &[u8]) -> Result<XSpace, Status> {
    XSpace::decode(bytes)
        .map_err(|e| Status::internal(format!("re-reading the built trace failed: {e}")))
}

struct Continuous {
    _active: crate::agent::CaptureActivity,
    request: ProfileRequest,
    duration: Option<Duration>,
    last_snapshot_ns: u64,
}

/// See the module documentation.
pub struct ProfilerService {
    agent: Arc<Agent>,
    config: ServiceConfig,
    running: Mutex<HashMap<String, Vec<(u64, CancellationToken)>>>,
    next_capture: std::sync::atomic::AtomicU64,
    continuous: Mutex<Option<Continuous>>,
    shared_builds: SharedBuilds,
    capture_memory: CaptureMemory,
}

/// Removes a capture from the Terminate table when it ends, however it ends.
struct Registration<'s> {
    service: &'s ProfilerService,
    session_id: String,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut running = self.service.running.lock();
        if let Some(list) = running.get_mut(&self.session_id) {
            list.retain(|(id, _)| *id != self.id);
            if list.is_empty() {
                running.remove(&self.session_id);
            }
        }
    }
}

impl ProfilerService {
    pub fn new(agent: Arc<Agent>, config: ServiceConfig) -> ProfilerService {
        ProfilerService {
            agent,
            capture_memory: CaptureMemory::new(config.capture_memory),
            config,
            running: Mutex::new(HashMap::new()),
            next_capture: Default::default(),
            continuous: Mutex::new(None),
            shared_builds: SharedBuilds::default(),
        }
    }

    /// Health and metrics of the server these services run in.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.config.telemetry
    }

    /// A capture of `window` has its reply ready now.
    fn capture_ready(&self, rpc: &'static str, window: Window) {
        let late_ns = clock::now_ns().saturating_sub(window.stop_ns);
        self.config
            .telemetry
            .capture_ready(rpc, Duration::from_nanos(late_ns));
    }

    fn register(&self, session_id: &str) -> (Registration<'_>, CancellationToken) {
        let token = CancellationToken::new();
        let id = self
            .next_capture
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.running
            .lock()
            .entry(session_id.to_string())
            .or_default()
            .push((id, token.clone()));
        (
            Registration {
                service: self,
                session_id: session_id.to_string(),
                id,
            },
            token,
        )
    }

    /// Validates every field of a `ProfileRequest`. `require_duration` is
    /// false for continuous profiling, where the window is open-ended.
    fn plan(&self, request: &ProfileRequest, require_duration: bool) -> Result<Plan, Status> {
        let options = request.opts.clone().unwrap_or_default();
        let modern = options.version != 0;
        let duration_ms = if modern && options.duration_ms != 0 {
            options.duration_ms
        } else {
            request.duration_ms
        };
        let duration_field = if modern {
            "opts.duration_ms"
        } else {
            "duration_ms"
        };
        if require_duration && duration_ms == 0 {
            return Err(invalid(
                duration_field,
                "must be greater than 0 (the length of the capture window in milliseconds)",
            ));
        }
        let max_ms = self.config.max_duration.as_millis() as u64;
        if duration_ms > max_ms {
            return Err(invalid(
                duration_field,
                format!(
                    "{duration_ms} ms exceeds this agent's maximum of {max_ms} ms (--max-duration)"
                ),
            ));
        }
        let now = clock::now_ns();
        let mut warnings = Vec::new();
        let start_ns = if modern && options.start_timestamp_ns != 0 {
            let latest = now.saturating_add(clock::duration_ns(self.config.max_start_delay));
            if options.start_timestamp_ns > latest {
                return Err(invalid(
                    "opts.start_timestamp_ns",
                    format!(
                        "starts {:.1} s from now; at most {} s ahead is accepted",
                        (options.start_timestamp_ns - now) as f64 / 1e9,
                        self.config.max_start_delay.as_secs()
                    ),
                ));
            }
            options.start_timestamp_ns
        } else {
            now
        };
        validate::name_component("session_id", &request.session_id)?;
        validate::name_component("host_name", &request.host_name)?;
        validate::name_component("opts.override_hostname", &options.override_hostname)?;
        validate::name_component("opts.session_id", &options.session_id)?;
        validate::client_path("repository_root", &request.repository_root)?;
        validate::client_path("opts.repository_path", &options.repository_path)?;
        let legacy_override = match options
            .advanced_configuration
            .get("override_hostname")
            .and_then(|v| v.value.as_ref())
        {
            Some(advanced_config_value::Value::StringValue(s)) => s.clone(),
            _ => String::new(),
        };
        validate::name_component(
            "opts.advanced_configuration[override_hostname]",
            &legacy_override,
        )?;
        let file_host = [&options.override_hostname, &legacy_override]
            .into_iter()
            .find(|h| !h.is_empty())
            .cloned()
            .unwrap_or_else(|| {
                if request.host_name.is_empty() {
                    self.config.hostname.clone()
                } else {
                    request.host_name.replace(':', "_")
                }
            });
        let generated_session_id = request.session_id.is_empty() && options.session_id.is_empty();
        let session_id = if !request.session_id.is_empty() {
            request.session_id.clone()
        } else if !options.session_id.is_empty() {
            options.session_id.clone()
        } else {
            session_timestamp()
        };
        // A start a little in the past is network latency; a large one is a
        // deliberate look into the flight recorder, worth saying so.
        if now.saturating_sub(start_ns) > 1_000_000_000 {
            warnings.push(format!(
                "capture window starts {:.3} s before the request arrived; served from the flight recorder",
                (now - start_ns) as f64 / 1e9
            ));
        }
        Ok(Plan {
            window: Window {
                start_ns,
                stop_ns: start_ns.saturating_add(duration_ms.saturating_mul(1_000_000)),
            },
            session_id,
            generated_session_id,
            file_host,
            repository_root: request.repository_root.clone(),
            emit_xspace: request.emit_xspace,
            options: options.encode_to_vec(),
            warnings,
            losses_at_start: self.agent.losses(),
            properties: Vec::new(),
            // TensorFlow reads no option of a version-0 request but this one.
            detailed_device: modern && options.device_tracer_level >= 2,
        })
    }

    /// Collects the window's events (after they have all arrived) and encodes
    /// the XSpace off the async runtime.
    /// Builds the trace of `window` from the flight recorder alone (a
    /// snapshot of the past: live-only sources cannot serve it).
    async fn build(&self, plan: &Plan, window: Window) -> Result<Encoded, Status> {
        self.build_with(plan, window, Remote::none(window)).await
    }

    /// Starts capturing every upstream and per-capture source over the
    /// plan's window: each is called when the window starts (at once when it
    /// has), so that it records that window and not the one after it.
    fn start_remote(&self, plan: &Plan, upstreams: &[client::Target]) -> Remote {
        let window = plan.window;
        let end = CaptureEnd::at(window.stop_ns);
        let duration = Duration::from_nanos(window.duration_ns());
        let deadline = client::capture_deadline(duration) + clock::until(window.start_ns);
        let mut upstream_calls = tokio::task::JoinSet::new();
        for upstream in upstreams {
            let options =
                client::default_profile_options(duration.as_millis() as u64, window.start_ns);
            let name = upstream.to_string();
            let mut request = client::trace_request(options, "", &plan.session_id, &name);
            request.emit_xspace = true;
            let upstream = upstream.clone();
            let config = self.config.client.clone();
            upstream_calls.spawn(async move {
                // Servers that record from the moment they are asked (TensorFlow's,
                // JAX's) are asked when the window starts; a devtrace upstream
                // would also wait for the start itself.
                tokio::time::sleep(clock::until(window.start_ns)).await;
                let result = session::capture_host(&upstream, request, deadline, &config).await;
                (name, result)
            });
        }
        let mut source_calls = tokio::task::JoinSet::new();
        for source in self.agent.session_sources() {
            let options = plan.options.clone();
            let end = end.clone();
            source_calls.spawn_blocking(move || {
                let result = source.capture(window, &options, &end);
                (source.name().to_string(), result)
            });
        }
        Remote {
            upstreams: upstreams.to_vec(),
            client: self.config.client.clone(),
            upstream_calls,
            source_calls,
            end,
        }
    }

    /// As [`Self::build`], with what `remote` recorded over the same window
    /// merged in. An upstream that fails, is slow or recorded another window
    /// makes the trace partial (the reason is in its errors), never failed.
    async fn build_with(
        &self,
        plan: &Plan,
        window: Window,
        mut remote: Remote,
    ) -> Result<Encoded, Status> {
        let local = self.agent.collect(window).await;
        let upstream_calls = std::mem::take(&mut remote.upstream_calls);
        let source_calls = std::mem::take(&mut remote.source_calls);
        let mut remote = upstream_calls.join_all().await;
        remote.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, result) in source_calls.join_all().await {
            remote.push((name, result.map(|trace| Some(trace.into()))));
        }
        let (data, registry) = local.map_err(|e| Status::internal(e.to_string()))?;
        let mut warnings = plan.warnings.clone();
        // A backend that was asked for and could not run leaves a gap the
        // trace should admit to.
        for (name, reason) in self.agent.unavailable_backends() {
            warnings.push(format!("backend {name} is not running: {reason}"));
        }
        for (backend, text) in self.agent.notices(window) {
            warnings.push(format!("backend {backend}: {text}"));
        }
        let mut dropped_before_ring = 0;
        for (backend, loss) in self.agent.losses() {
            let before = plan
                .losses_at_start
                .iter()
                .find(|(b, l)| *b == backend && l.what == loss.what)
                .map_or(0, |(_, l)| l.count);
            let lost = loss.count.saturating_sub(before);
            dropped_before_ring += lost;
            if lost > 0 {
                let source = match backend {
                    "agent" => "the agent".to_string(),
                    _ => format!("backend {backend}"),
                };
                warnings.push(format!(
                    "{source}: {lost} {} while this capture ran",
                    loss.what
                ));
            }
        }
        if let Some(history) = data.history_starts_ns {
            warnings.push(format!(
                "the flight recorder holds nothing before {:.3} s into the window; earlier events were evicted or never recorded",
                history.saturating_sub(window.start_ns) as f64 / 1e9
            ));
        }
        let mut errors = Vec::new();
        let mut merged = Vec::new();
        let mut properties = self.agent.properties(window);
        properties.extend(plan.properties.iter().cloned());
        for (source, result) in remote {
            // Upstreams are named by address; per-capture backends by name.
            let label = if source.contains(':') {
                format!("upstream {source}")
            } else {
                source.clone()
            };
            match result {
                Ok(Some(bytes)) => match XSpace::decode(bytes) {
                    Ok(space) => match upstream_start(&space, window) {
                        Ok(offset) => {
                            if let Some(offset_ns) = offset {
                                properties.push((
                                    format!("devtrace_upstream_start_offset_ns {source}"),
                                    offset_ns.to_string(),
                                ));
                            }
                            merged.push((source, space));
                        }
                        Err(why) => errors.push(format!("{label}: {why}")),
                    },
                    Err(e) => errors.push(format!("{label}: unreadable trace: {e}")),
                },
                Ok(None) => warnings.push(format!("{label}: empty trace")),
                Err(e) => errors.push(format!("{label}: {e}")),
            }
        }
        let info = CaptureInfo {
            window,
            hostname: self.config.hostname.clone(),
            profile_options: plan.options.clone(),
            dropped_newest: data.dropped_newest,
            dropped_oldest: data.dropped_oldest,
            dropped_before_ring,
            warnings,
            errors,
            properties,
        };
        tokio::task::spawn_blocking(move || {
            let encoded = xspace::encode_xspace(data.events(), &registry, &info);
            if merged.is_empty() {
                return Ok(encoded);
            }
            let mut space = XSpace::decode(encoded.contiguous())?;
            let mut events = encoded.events;
            for (upstream, theirs) in merged {
                events += theirs
                    .planes
                    .iter()
                    .flat_map(|p| &p.lines)
                    .map(|l| l.events.len())
                    .sum::<usize>();
                xspace::merge::merge(&mut space, theirs, &upstream);
            }
            Ok(Encoded::whole(space.encode_to_vec(), events))
        })
        .await
        .map_err(|e| Status::internal(format!("building the trace failed: {e}")))?
        .map_err(|e: prost::DecodeError| {
            Status::internal(format!("merging upstream traces failed: {e}"))
        })
    }

    /// Delivers the built trace of `window` the way the request asked:
    /// inline XSpace, a file under an allowed root, or `tool_data` for the
    /// client to write. A trace the agent fails to write goes to the client
    /// instead, saying why. A trace over `--chunk-traces-over` goes as
    /// Riegeli chunks ([`Self::respond_chunked`]).
    ///
    /// `slot` is the build the trace came from, held until the reply is
    /// sent.
    async fn respond(
        &self,
        plan: &Plan,
        window: Window,
        encoded: Arc<Encoded>,
        slot: &Arc<Slot>,
    ) -> Result<Response<ProfileResponse>, Status> {
        if encoded.len() > self.config.chunk_traces_over {
            return self
                .respond_chunked(plan, window, encoded, plan.emit_xspace)
                .await
                .map(Response::new);
        }
        let empty_trace = encoded.events == 0;
        if plan.emit_xspace {
            return Ok(Response::new(ProfileResponse {
                tool_data: Vec::new(),
                empty_trace,
                xspace: Some(decode(&encoded.contiguous())?),
            }));
        }
        let mut encoded = encoded;
        if let Some(root) = self.server_side_root(plan) {
            let written;
            (written, encoded) = write_trace(root, plan, XPLANE_SUFFIX, encoded).await?;
            match written {
                Ok(_) => return Ok(Response::new(written_reply(empty_trace))),
                Err(error) => {
                    encoded = with_warnings(encoded, &[unwritten_warning(&error)]);
                }
            }
        }
        // Sent from the trace's own parts by `FramedRepliesLayer`; the
        // build's memory stays reserved until they are out.
        let mut response = Response::new(ProfileResponse::default());
        frame_trace(&encoded)
            .keeping(Arc::clone(slot) as Arc<dyn std::any::Any + Send + Sync>)
            .attach(&mut response);
        Ok(response)
    }

    /// Delivers a trace too large for one message (over
    /// `--chunk-traces-over`) as Riegeli chunks of XSpace: written as
    /// `<host>.xplane.riegeli` where the agent writes traces, else returned
    /// as `xplane.riegeli` tool data when the file is within the limit. A
    /// client that needs the XSpace itself (`needs_xspace`: emit_xspace,
    /// GetSnapshot), or whose trace is too large even chunked, gets
    /// RESOURCE_EXHAUSTED saying where the trace was written, or how to
    /// get it.
    async fn respond_chunked(
        &self,
        plan: &Plan,
        window: Window,
        encoded: Arc<Encoded>,
        needs_xspace: bool,
    ) -> Result<ProfileResponse, Status> {
        let limit = self.config.chunk_traces_over;
        let size = encoded.len();
        let empty_trace = encoded.events == 0;
        let mut chunked = chunk_trace(encoded, limit).await?;
        info!(
            bytes = size,
            chunks = chunked.chunks(),
            file_bytes = chunked.bytes().len(),
            "trace over --chunk-traces-over stored as Riegeli chunks"
        );
        let mut not_written = None;
        if let Some(root) = self.server_side_root(plan) {
            let written;
            (written, chunked) = write_trace(root, plan, RIEGELI_SUFFIX, chunked).await?;
            match written {
                Ok(path) if needs_xspace => {
                    return Err(Status::resource_exhausted(format!(
                        "this capture's trace is {size} bytes, more than one XSpace may hold \
                         (--chunk-traces-over is {limit} bytes); the agent wrote it as {} \
                         (Riegeli chunks of XSpace, which XProf 2.23 and later and \
                         `devtrace inspect` read)",
                        path
                    )));
                }
                Ok(_) => return Ok(written_reply(empty_trace)),
                Err(error) => not_written = Some(error),
            }
        }
        if !needs_xspace && chunked.bytes().len() <= limit {
            if let Some(error) = &not_written {
                chunked
                    .append_warning(&unwritten_warning(error))
                    .map_err(|e| chunking_failed(&e))?;
            }
            return Ok(tool_reply(
                RIEGELI_TOOL,
                Bytes::from(chunked.into_bytes()),
                empty_trace,
            ));
        }
        let why = if needs_xspace {
            "the request asks for it as one XSpace (emit_xspace, or GetSnapshot), which \
             cannot hold it"
                .to_string()
        } else {
            format!(
                "even as compressed Riegeli chunks it is {} bytes, too large to return",
                chunked.bytes().len()
            )
        };
        let failure = not_written.map_or_else(String::new, |error| {
            format!(" Writing it under repository_root failed: {error}.")
        });
        let roots = self.config.allowed_roots.roots();
        let where_to = if roots.is_empty() {
            "from an agent started with --allow-root DIR (or a bucket URL), with \
             repository_root inside it"
                .into()
        } else {
            let roots: Vec<String> = roots.iter().map(|r| r.to_string()).collect();
            format!(
                "with repository_root inside a directory or bucket prefix this agent writes ({})",
                roots.join(", ")
            )
        };
        Err(Status::resource_exhausted(format!(
            "this capture's trace is {size} bytes, over --chunk-traces-over ({limit} bytes), and \
             {why}.{failure} To get the whole trace, ask for the same window again \
             (opts.start_timestamp_ns {}, opts.duration_ms {}) while the flight recorder still \
             holds it, {where_to} and emit_xspace unset: the agent then writes it as \
             <repository_root>/<session>/<host>.xplane.riegeli, which XProf reads.",
            window.start_ns,
            window.duration_ns().div_ceil(1_000_000)
        )))
    }

    /// Builds the trace of `window` from the flight recorder and writes it
    /// under `root` as a new session named `session_id` (with a suffix when
    /// the name is taken), `properties` in its Task Environment: how a
    /// trigger saves the past. Where it went.
    pub async fn save_window(
        &self,
        window: Window,
        session_id: &str,
        properties: Vec<(String, String)>,
        root: Folder,
    ) -> Result<String, Status> {
        let duration_ms = window.duration_ns().div_ceil(1_000_000);
        let plan = Plan {
            window,
            session_id: session_id.to_string(),
            generated_session_id: true,
            file_host: self.config.hostname.clone(),
            repository_root: String::new(),
            emit_xspace: false,
            options: client::default_profile_options(duration_ms, window.start_ns).encode_to_vec(),
            warnings: Vec::new(),
            losses_at_start: self.agent.losses(),
            properties,
            detailed_device: false,
        };
        let encoded = self.build(&plan, window).await?;
        let limit = self.config.chunk_traces_over;
        // Stored without a log line of its own: the trigger logs the save.
        let written = if encoded.len() > limit {
            let chunked = chunk_trace(Arc::new(encoded), limit).await?;
            store_trace(root, &plan, RIEGELI_SUFFIX, chunked).await?.0
        } else {
            store_trace(root, &plan, XPLANE_SUFFIX, Arc::new(encoded))
                .await?
                .0
        };
        written.map_err(|e| Status::internal(e.to_string()))
    }

    /// The repository root to write into, when the request's lies inside an
    /// allowed root; otherwise the trace goes inline.
    fn server_side_root(&self, plan: &Plan) -> Option<Folder> {
        if plan.repository_root.is_empty() || self.config.allowed_roots.is_empty() {
            return None;
        }
        match self.config.allowed_roots.confine(&plan.repository_root) {
            Ok(root) => Some(root),
            Err(reason) => {
                info!(%reason, "repository_root not writable by policy; returning the trace inline");
                None
            }
        }
    }
}

/// A trace file's content, written from the memory it is held in.
trait TraceFile: Send + 'static {
    fn len(&self) -> usize;
    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError>;
}

impl TraceFile for ChunkedTrace {
    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError> {
        session.write(name, self.bytes())
    }
}

/// An XSpace is written from the parts it was encoded in, not joined.
impl TraceFile for Arc<Encoded> {
    fn len(&self) -> usize {
        Encoded::len(self)
    }

    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError> {
        session.write_parts(name, self.parts())
    }
}

/// Writes a capture's trace file as [`store_trace`] does, and logs where
/// it went or why it is returned to the client instead.
async fn write_trace<B: TraceFile>(
    root: Folder,
    plan: &Plan,
    suffix: &'static str,
    bytes: B,
) -> Result<(Result<String, StorageError>, B), Status> {
    let (written, bytes) = store_trace(root, plan, suffix, bytes).await?;
    match &written {
        Ok(path) => info!(%path, bytes = bytes.len(), "trace written"),
        Err(error) => warn!(%error, "trace not written; returning it to the client instead"),
    }
    Ok((written, bytes))
}

/// Writes a trace file, `<root>/<session>/<host><suffix>` (one XSpace,
/// `.xplane.pb`, or its Riegeli chunks, `.xplane.riegeli`), off the async
/// runtime (a disk write or an upload); hands the bytes back with where
/// they went or why not.
async fn store_trace<B: TraceFile>(
    root: Folder,
    plan: &Plan,
    suffix: &'static str,
    bytes: B,
) -> Result<(Result<String, StorageError>, B), Status> {
    let session_id = plan.session_id.clone();
    let generated = plan.generated_session_id;
    let file_name = format!("{}{suffix}", plan.file_host);
    tokio::task::spawn_blocking(move || {
        let written = root
            .create_session(&session_id, generated)
            .and_then(|(session, _)| bytes.write_to(&session, &file_name));
        (written, bytes)
    })
    .await
    .map_err(|e| Status::internal(format!("writing the trace failed: {e}")))
}

/// `encoded` as Riegeli chunks of at most `limit` bytes, off the async
/// runtime.
async fn chunk_trace(encoded: Arc<Encoded>, limit: usize) -> Result<ChunkedTrace, Status> {
    tokio::task::spawn_blocking(move || ChunkedTrace::encode(&encoded.contiguous(), limit))
        .await
        .map_err(|e| chunking_failed(&e))?
        .map_err(|e| chunking_failed(&e))
}

fn chunking_failed(error: &dyn std::fmt::Display) -> Status {
    Status::internal(format!(
        "storing the trace as Riegeli chunks failed: {error}"
    ))
}

/// Until when a capture may wait for capture memory: a little before the
/// client's own deadline (`grpc-timeout`), so that it hears why rather than
/// its own timeout; without one, as long as a client would wait for a
/// capture of the longest window.
fn memory_wait_deadline(metadata: &tonic::metadata::MetadataMap) -> std::time::Instant {
    let timeout = metadata
        .get("grpc-timeout")
        .and_then(|value| value.to_str().ok())
        .and_then(parse_grpc_timeout)
        .map_or(client::capture_deadline(Duration::from_secs(600)), |t| {
            t.mul_f64(0.9)
        });
    std::time::Instant::now() + timeout
}

/// A `grpc-timeout` header: up to eight digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// A trace with `warnings` added: the same trace when there are none, else
/// one sharing its parts and adding one.
fn with_warnings(encoded: Arc<Encoded>, warnings: &[String]) -> Arc<Encoded> {
    if warnings.is_empty() {
        return encoded;
    }
    let mut own = Arc::unwrap_or_clone(encoded);
    for warning in warnings {
        xspace::append_warning(&mut own, warning);
    }
    Arc::new(own)
}

/// The reply to a capture whose trace the agent wrote itself.
fn written_reply(empty_trace: bool) -> ProfileResponse {
    ProfileResponse {
        tool_data: Vec::new(),
        empty_trace,
        xspace: None,
    }
}

/// The reply carrying a trace as tool data `name`, which the client writes
/// as `<host>.<name>`.
fn tool_reply(name: &str, data: Bytes, empty_trace: bool) -> ProfileResponse {
    ProfileResponse {
        tool_data: vec![ProfileToolData {
            name: name.to_string(),
            data,
        }],
        empty_trace,
        xspace: None,
    }
}

/// The reply carrying `encoded` as XSpace tool data, framed for sending:
/// the trace's own parts behind a few bytes of message fields.
fn frame_trace(encoded: &Encoded) -> FramedReply {
    FramedReply::tool_data(XPLANE_TOOL, encoded.parts(), encoded.events == 0)
}

/// The warning a trace the agent failed to write carries to the client.
fn unwritten_warning(error: &StorageError) -> String {
    format!(
        "the agent could not write this trace under repository_root ({error}); \
         it was returned to the client instead"
    )
}

/// Mean sampled SM utilisation over all GPUs, when a counter backend reports it.
fn sampled_busy_percent(
    usage: &analysis::Utilization,
    registry: &crate::registry::RegistrySnapshot,
) -> Option<f64> {
    let samples: Vec<f64> = usage
        .counter_means
        .iter()
        .filter(|((_, name), _)| registry.name(*name) == crate::backend::nvml::SM_UTILIZATION)
        .map(|(_, mean)| *mean)
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum::<f64>() / samples.len() as f64)
}

/// `YYYY_MM_DD_HH_MM_SS` in UTC, as session directories are named.
pub fn session_timestamp() -> String {
    session_timestamp_at(clock::now_ns())
}

/// [`session_timestamp`] of the moment `ns` (Unix nanoseconds).
pub fn session_timestamp_at(ns: u64) -> String {
    let (year, month, day, hour, minute, second) = utc_fields(ns);
    format!("{year:04}_{month:02}_{day:02}_{hour:02}_{minute:02}_{second:02}")
}

/// The moment `ns` (Unix nanoseconds) as ISO 8601 UTC with milliseconds,
/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn utc_text(ns: u64) -> String {
    let (year, month, day, hour, minute, second) = utc_fields(ns);
    let millis = ns % 1_000_000_000 / 1_000_000;
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}

/// Year, month, day, hour, minute and second (UTC) of the moment `ns`.
fn utc_fields(ns: u64) -> (i64, u32, u32, i64, i64, i64) {
    let secs = (ns / 1_000_000_000) as i64;
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    (year, month, day, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Proleptic Gregorian date of a day count since 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// How late an upstream may start its recording and still count as having
/// recorded the window: the call's own latency.
const UPSTREAM_START_SLACK_NS: u64 = 50_000_000;

/// Checks that an upstream's trace covers `window`: its `profile_start_time`
/// may lag the window's start by the call's latency, no more. Returns the
/// offset (theirs minus ours, on their clock against ours) when it reports
/// one. A server that cannot serve a window in the past records from when it
/// was called: that trace is another window's and is refused.
fn upstream_start(space: &XSpace, window: Window) -> Result<Option<i64>, String> {
    let Some(their_start) = xspace::merge::profile_start_ns(space) else {
        return Ok(None);
    };
    let offset = their_start as i128 - window.start_ns as i128;
    if offset > i128::from(UPSTREAM_START_SLACK_NS) {
        return Err(format!(
            "it recorded from {:.3} s after this window's start, not the window itself (a \
             server that cannot serve a window in the past, or a clock {:.3} s ahead of ours); \
             its trace is left out",
            offset as f64 / 1e9,
            offset as f64 / 1e9
        ));
    }
    Ok(Some(
        offset.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64,
    ))
}

/// One upstream's address and its trace (`None`: empty), or why not.
type UpstreamOutcome = (String, Result<Option<bytes::Bytes>, String>);
/// One per-capture source's name and its trace, or why not.
type SourceOutcome = (String, Result<Vec<u8>, String>);

/// What records a capture besides the flight recorder: its upstreams' calls
/// and its per-capture sources, and when they should stop.
struct Remote {
    upstreams: Vec<client::Target>,
    client: client::ClientConfig,
    upstream_calls: tokio::task::JoinSet<UpstreamOutcome>,
    source_calls: tokio::task::JoinSet<SourceOutcome>,
    end: CaptureEnd,
}

impl Remote {
    fn none(window: Window) -> Remote {
        Remote {
            upstreams: Vec::new(),
            client: client::ClientConfig::default(),
            upstream_calls: tokio::task::JoinSet::new(),
            source_calls: tokio::task::JoinSet::new(),
            end: CaptureEnd::at(window.stop_ns),
        }
    }

    /// A terminated capture ends its sources now and asks its upstreams to
    /// end theirs (they still deliver what they have).
    fn end_early(&self, session_id: &str) {
        self.end.now();
        for upstream in &self.upstreams {
            let upstream = upstream.clone();
            let config = self.client.clone();
            let session_id = session_id.to_string();
            tokio::spawn(async move {
                let call = async {
                    let connection =
                        client::connect(&upstream, &config, UPSTREAM_TERMINATE_TIMEOUT)
                            .await
                            .map_err(|e| e.to_string())?;
                    connection
                        .terminate(&session_id)
                        .await
                        .map_err(|e| e.to_string())
                };
                if let Err(error) = call.await {
                    info!(%upstream, %error, "could not end the upstream's capture early");
                }
            });
        }
    }
}

/// An abandoned capture (its client gone) stops its sources too.
impl Drop for Remote {
    fn drop(&mut self) {
        self.end.now();
    }
}

const UPSTREAM_TERMINATE_TIMEOUT: Duration = Duration::from_secs(2);

#[tonic::async_trait]
impl profiler_service_server::ProfilerService for ProfilerService {
    async fn profile(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let deadline = memory_wait_deadline(request.metadata());
        let request = request.into_inner();
        let mut plan = self.plan(&request, true)?;
        info!(
            session = %plan.session_id,
            host = %plan.file_host,
            duration_ms = plan.window.duration_ns() / 1_000_000,
            "capture requested"
        );
        // Joined on arrival, so that captures arriving during the window
        // find each other however late each one wakes at its end. Captures
        // with upstreams or per-capture sources record their own.
        let shareable = self.config.upstreams.is_empty() && self.agent.session_sources().is_empty();
        let slot = if shareable {
            let key = BuildKey::new(plan.window, &plan.options, &plan.losses_at_start);
            self.shared_builds.join(key)
        } else {
            Arc::new(Slot::default())
        };
        let memory_was_reserved = slot.memory.initialized();
        let reservation = slot
            .memory
            .get_or_try_init(|| self.capture_memory.reserve(plan.window, deadline))
            .await
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        if let Some(waited) = reservation.waited.filter(|_| !memory_was_reserved) {
            plan.warnings.push(format!(
                "this capture waited {:.3} s for capture memory: other captures' traces held \
                 --capture-memory ({} bytes)",
                waited.as_secs_f64(),
                self.capture_memory.budget()
            ));
        }
        let (_registration, terminate) = self.register(&plan.session_id);
        let _active = self.agent.capture_activity(plan.detailed_device);
        // Upstreams and per-capture sources record alongside the local
        // window; dropping `remote` (a client gone) ends them.
        let remote = self.start_remote(&plan, &self.config.upstreams);
        let (window, terminated) = tokio::select! {
            _ = tokio::time::sleep(clock::until(plan.window.stop_ns)) => (plan.window, false),
            _ = terminate.cancelled() => {
                info!(session = %plan.session_id, "capture terminated early");
                remote.end_early(&plan.session_id);
                (Window { stop_ns: clock::now_ns().clamp(plan.window.start_ns, plan.window.stop_ns), ..plan.window }, true)
            }
        };
        // The request's own warnings go onto the reply, so that the build
        // itself is the same for every capture of this window.
        let common = Plan {
            warnings: Vec::new(),
            ..plan.clone()
        };
        let encoded = if !terminated {
            self.shared_builds
                .get_or_build(&slot, self.build_with(&common, window, remote))
                .await?
        } else {
            Arc::new(self.build_with(&common, window, remote).await?)
        };
        self.capture_memory.built(window, encoded.len());
        let encoded = with_warnings(encoded, &plan.warnings);
        let reply = self.respond(&plan, window, encoded, &slot).await?;
        self.capture_ready("Profile", window);
        Ok(reply)
    }

    async fn terminate(
        &self,
        request: Request<TerminateRequest>,
    ) -> Result<Response<TerminateResponse>, Status> {
        let session_id = request.into_inner().session_id;
        validate::name_component("session_id", &session_id)?;
        let tokens: Vec<CancellationToken> = self
            .running
            .lock()
            .get(&session_id)
            .map(|list| list.iter().map(|(_, t)| t.clone()).collect())
            .unwrap_or_default();
        if tokens.is_empty() {
            info!(session = %session_id, "terminate: no running capture with this session id");
        }
        for token in tokens {
            token.cancel();
        }
        Ok(Response::new(TerminateResponse {}))
    }

    async fn monitor(
        &self,
        request: Request<MonitorRequest>,
    ) -> Result<Response<MonitorResponse>, Status> {
        let request = request.into_inner();
        if request.duration_ms == 0 {
            return Err(invalid("duration_ms", "must be greater than 0"));
        }
        let max_ms = self.config.max_duration.as_millis() as u64;
        if request.duration_ms > max_ms {
            return Err(invalid(
                "duration_ms",
                format!(
                    "{} ms exceeds this agent's maximum of {max_ms} ms",
                    request.duration_ms
                ),
            ));
        }
        if !(0..=2).contains(&request.monitoring_level) {
            return Err(invalid("monitoring_level", "must be 0, 1 or 2"));
        }
        let _active = self.agent.monitor_activity();
        let start_ns = clock::now_ns();
        let window = Window {
            start_ns,
            stop_ns: start_ns + request.duration_ms * 1_000_000,
        };
        let (data, registry) = self
            .agent
            .collect(window)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let usage = analysis::utilization(data.events(), window);
        let mut result = ProfilerServiceMonitorResult::default();
        let mut text = String::new();
        if request.timestamp {
            text.push_str(&format!(
                "timestamp: {} (Unix ms)\n",
                window.stop_ns / 1_000_000
            ));
        }
        text.push_str(&format!(
            "devtrace on {} over {} ms\n",
            self.config.hostname, request.duration_ms
        ));
        if let Some(idle) = usage.idle_percent() {
            result.response_type = ResponseType::UtilIdle as i32;
            result.device_idle_time_percent = idle;
            for (ordinal, busy) in &usage.device_busy {
                text.push_str(&format!("GPU {ordinal}: {:.1}% busy\n", busy * 100.0));
            }
            text.push_str(&format!("device idle time: {idle:.1}%\n"));
        } else if let Some(busy) = sampled_busy_percent(&usage, &registry) {
            // No kernel timeline, but NVML sampled how busy the SMs were.
            result.response_type = ResponseType::UtilIdle as i32;
            result.device_idle_time_percent = 100.0 - busy;
            text.push_str(&format!(
                "device idle time: {:.1}% (sampled)\n",
                100.0 - busy
            ));
        } else {
            result.response_type = ResponseType::UtilOnly as i32;
            text.push_str("no device activity in this period\n");
        }
        // Device health from counter backends (NVML): the mean over the period.
        for ((ordinal, name), mean) in &usage.counter_means {
            text.push_str(&format!(
                "GPU {ordinal} {}: {mean:.1}\n",
                registry.name(*name)
            ));
        }
        if let Some((avg, min, max)) = usage.step_times_ms() {
            result.response_type = ResponseType::UtilIdleStep as i32;
            result.step_time_ms_avg = avg;
            result.step_time_ms_min = min;
            result.step_time_ms_max = max;
            text.push_str(&format!(
                "step time: avg {avg:.2} ms, min {min:.2} ms, max {max:.2} ms ({} steps)\n",
                usage.step_durations_ns.len()
            ));
        }
        if data.dropped() > 0 {
            text.push_str(&format!("dropped events: {}\n", data.dropped()));
        }
        if request.monitoring_level >= 2 {
            for (name, health) in self.agent.backend_health() {
                text.push_str(&format!("backend {name}: {health}\n"));
            }
            let captures: usize = self.running.lock().values().map(Vec::len).sum();
            text.push_str(&format!("captures in progress: {captures}\n"));
            let (builds, reuses) = self.shared_builds.counts();
            text.push_str(&format!(
                "traces built: {builds}; captures that shared another's build: {reuses}\n"
            ));
            if let Some(triggers) = self.config.telemetry.triggers() {
                text.push_str(&triggers.summary());
            }
            let store = self.agent.store_stats();
            text.push_str(&format!(
                "flight recorder: {} events in {} chunks, {:.1} MiB\n",
                store.events,
                store.chunks,
                store.bytes as f64 / (1 << 20) as f64
            ));
        }
        Ok(Response::new(MonitorResponse {
            data: text,
            monitor_result: Some(result),
        }))
    }

    async fn start_continuous_profiling(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ContinuousProfilingResponse>, Status> {
        let request = request.into_inner();
        let plan = self.plan(&request, false)?;
        let mut continuous = self.continuous.lock();
        if continuous.is_some() {
            return Err(Status::already_exists(
                "a continuous profiling session is already running",
            ));
        }
        let duration = plan.window.duration_ns();
        info!(session = %plan.session_id, "continuous profiling started");
        *continuous = Some(Continuous {
            _active: self.agent.capture_activity(plan.detailed_device),
            request,
            duration: (duration > 0).then(|| Duration::from_nanos(duration)),
            last_snapshot_ns: clock::now_ns(),
        });
        Ok(Response::new(ContinuousProfilingResponse {}))
    }

    async fn stop_continuous_profiling(
        &self,
        _request: Request<StopContinuousProfilingRequest>,
    ) -> Result<Response<StopContinuousProfilingResponse>, Status> {
        match self.continuous.lock().take() {
            Some(_) => {
                info!("continuous profiling stopped");
                Ok(Response::new(StopContinuousProfilingResponse {}))
            }
            None => Err(Status::not_found(
                "no continuous profiling session is running",
            )),
        }
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let snapshot_id = request.into_inner().snapshot_session_id;
        validate::name_component("snapshot_session_id", &snapshot_id)?;
        let now = clock::now_ns();
        let (mut plan, start_ns) = {
            let mut guard = self.continuous.lock();
            let Some(continuous) = guard.as_mut() else {
                return Err(Status::not_found(
                    "no continuous profiling session is running",
                ));
            };
            let plan = self.plan(&continuous.request, false)?;
            // A fixed duration reaches back into the recorder, even to before
            // the session started; otherwise snapshots tile time.
            let start = match continuous.duration {
                Some(duration) => now.saturating_sub(clock::duration_ns(duration)),
                None => continuous.last_snapshot_ns,
            };
            continuous.last_snapshot_ns = now;
            (plan, start)
        };
        plan.window = Window {
            start_ns,
            stop_ns: now,
        };
        plan.warnings.clear();
        if !snapshot_id.is_empty() {
            plan.session_id = snapshot_id;
            plan.generated_session_id = false;
        }
        let encoded = self.build(&plan, plan.window).await?;
        if encoded.len() > self.config.chunk_traces_over {
            let reply = self
                .respond_chunked(&plan, plan.window, Arc::new(encoded), true)
                .await?;
            return Ok(Response::new(reply));
        }
        let encoded = Arc::new(encoded);
        if let Some(root) = self.server_side_root(&plan) {
            // A failure is logged; the snapshot goes inline either way.
            let _ = write_trace(root, &plan, XPLANE_SUFFIX, Arc::clone(&encoded)).await?;
        }
        let whole = encoded.contiguous();
        let reply = ProfileResponse {
            tool_data: Vec::new(),
            empty_trace: encoded.events == 0,
            xspace: Some(decode(&whole)?),
        };
        self.capture_ready("GetSnapshot", plan.window);
        Ok(Response::new(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_are_right() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            utc_text(1_763_731_845_123_456_789),
            "2025-11-21T13:30:45.123Z"
        );
        assert_eq!(civil_from_days(20_413), (2025, 11, 21));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn grpc_timeouts_are_read() {
        assert_eq!(
            parse_grpc_timeout("1500m"),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("2x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }
}
