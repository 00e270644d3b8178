//! `tensorflow.ProfilerService`: on-demand captures (`Profile`, `Terminate`),
//! `Monitor`, and continuous profiling served from the flight recorder
//! (`StartContinuousProfiling`, `GetSnapshot`, `StopContinuousProfiling`).
//!
//! This file holds the RPCs and the state they share (captures running, for
//! `Terminate`; each caller's continuous session). A request is read and planned in
//! [`request`], captured through [`crate::capture`], and answered in
//! [`reply`]; `Monitor`'s summary is [`monitor`].

mod monitor;
mod reply;
mod request;

pub use request::ATTACH_KEY;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::agent::Agent;
use crate::backend::Scope;
use crate::capture::memory::MemoryError;
use crate::capture::write::write_trace;
use crate::capture::{
    local_hostname, CaptureError, CaptureSettings, Captures, Plan, DEFAULT_CHUNK_TRACES_OVER,
};
use crate::clock;
use crate::proto::tensorflow::profiler_service_server;
use crate::proto::tensorflow::{
    ContinuousProfilingResponse, GetSnapshotRequest, MonitorRequest, MonitorResponse,
    ProfileRequest, ProfileResponse, StopContinuousProfilingRequest,
    StopContinuousProfilingResponse, TerminateRequest, TerminateResponse,
};
use crate::protocol::caller::{Caller, Owner};
use crate::protocol::listen::caller_of_request;
use crate::protocol::{client, via};
use crate::recorder::Window;
use crate::repository::XPLANE_SUFFIX;
use crate::service::access::Access;
use crate::telemetry::Telemetry;

use super::validate;
use crate::repository::roots::AllowedRoots;
use crate::service::deadline::memory_wait_deadline;
use crate::service::framed_reply::FramedReply;
use reply::{framed, with_warnings};

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
    /// Where traces that outgrow their share of it are spilled.
    pub spill: Option<Arc<crate::capture::spill::SpillSpace>>,
    /// Who may act on what others started (`--admin-group`).
    pub access: crate::service::access::Access,
    /// How long a continuous session lives without a snapshot
    /// (`--continuous-timeout`).
    pub continuous_timeout: Duration,
    /// Captures one caller (not an admin) may have in progress at once
    /// (`--captures-per-caller`).
    pub captures_per_caller: usize,
    /// How processes a capture names are attached first; none: they are
    /// not.
    pub attach: Option<crate::attach::AttachConfig>,
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
            capture_memory: crate::capture::memory::DEFAULT_CAPTURE_MEMORY,
            spill: None,
            access: Default::default(),
            continuous_timeout: DEFAULT_CONTINUOUS_TIMEOUT,
            captures_per_caller: DEFAULT_CAPTURES_PER_CALLER,
            attach: None,
        }
    }
}

impl ServiceConfig {
    /// The settings of the captures this service makes.
    fn capture_settings(&self) -> CaptureSettings {
        CaptureSettings {
            hostname: self.hostname.clone(),
            upstreams: self.upstreams.clone(),
            client: self.client.clone(),
            chunk_traces_over: self.chunk_traces_over,
            capture_memory: self.capture_memory,
            spill: self.spill.clone(),
        }
    }
}

/// The continuous sessions running, one per caller at most.
type ContinuousSessions = Arc<Mutex<HashMap<Owner, Continuous>>>;

/// Continuous sessions running at once, of all callers together.
const MAX_CONTINUOUS_SESSIONS: usize = 64;

/// Ends `owner`'s continuous session `number` once nobody has taken a
/// snapshot of it (or started it) for `timeout`: a client that went away
/// must not leave every backend attached (and CUPTI on in its workloads)
/// for good.
fn end_when_unattended(
    continuous: ContinuousSessions,
    owner: Owner,
    number: u64,
    timeout: Duration,
) {
    tokio::spawn(async move {
        let mut wait = timeout;
        loop {
            tokio::time::sleep(wait).await;
            let mut sessions = continuous.lock();
            let Some(running) = sessions.get(&owner).filter(|c| c.number == number) else {
                return;
            };
            let idle = running.last_contact.elapsed();
            if idle >= timeout {
                info!(
                    session = %running.request.session_id,
                    caller = %running.caller,
                    idle_s = idle.as_secs(),
                    "continuous profiling ended: no snapshot was taken within --continuous-timeout"
                );
                sessions.remove(&owner);
                return;
            }
            wait = timeout - idle;
        }
    });
}

/// Whose continuous session a Stop or GetSnapshot of `caller` is about:
/// its own; for an admin with none of its own, the only one running.
fn session_of(
    sessions: &HashMap<Owner, Continuous>,
    caller: &Caller,
    admin: bool,
) -> Result<Owner, Status> {
    let own = caller.owner();
    if sessions.contains_key(&own) {
        return Ok(own);
    }
    if admin {
        let mut owners = sessions.keys();
        return match (owners.next(), owners.next()) {
            (Some(only), None) => Ok(only.clone()),
            (None, _) => Err(Status::not_found(
                "no continuous profiling session is running",
            )),
            (Some(_), Some(_)) => Err(Status::failed_precondition(format!(
                "{} continuous profiling sessions of other callers are running and none of \
                 yours; an admin acts on another's only when it is the one running",
                sessions.len()
            ))),
        };
    }
    // Others' sessions are not told of.
    Err(Status::not_found(format!(
        "no continuous profiling session of yours ({caller}) is running"
    )))
}

/// A capture that failed: out of capture memory (or spill space) is
/// RESOURCE_EXHAUSTED (ask again later), anything else the agent's own
/// failure.
impl From<CaptureError> for Status {
    fn from(error: CaptureError) -> Status {
        match error {
            CaptureError::Memory(MemoryError::SpillFailed { .. }) => {
                Status::internal(error.to_string())
            }
            CaptureError::Memory(_) => Status::resource_exhausted(error.to_string()),
            other => Status::internal(other.to_string()),
        }
    }
}

struct Continuous {
    number: u64,
    /// Its client's last call: a session nobody asks for ends by itself
    /// ([`end_when_unattended`]).
    last_contact: std::time::Instant,
    _active: crate::agent::CaptureActivity,
    request: ProfileRequest,
    /// Who started it: it alone (or an admin) takes its snapshots and
    /// stops it, and they are written with its rights.
    caller: Caller,
    duration: Option<Duration>,
    last_snapshot_ns: u64,
}

/// The default `--captures-per-caller`.
pub const DEFAULT_CAPTURES_PER_CALLER: usize = 8;

/// The default `--continuous-timeout`.
pub const DEFAULT_CONTINUOUS_TIMEOUT: Duration = Duration::from_secs(600);

/// See the module documentation.
pub struct ProfilerService {
    agent: Arc<Agent>,
    captures: Arc<Captures>,
    config: ServiceConfig,
    /// Captures in progress by session.
    running: Mutex<HashMap<String, Vec<Running>>>,
    next_capture: std::sync::atomic::AtomicU64,
    /// Shared with the tasks that end them when their clients are gone.
    continuous: ContinuousSessions,
    /// Numbers continuous sessions, so that a check meant for one never
    /// ends the next.
    next_continuous: std::sync::atomic::AtomicU64,
    /// Monitor calls in progress, per caller.
    monitors: Mutex<HashMap<Owner, usize>>,
    /// The trace files that captures in progress will write into clients'
    /// own sessions (`<session folder>/<host>`), so that a second capture
    /// of one host into one session is refused before its window, not
    /// after it ([`Self::refuse_a_held_session`]).
    claimed: Mutex<std::collections::HashSet<String>>,
}

/// A capture in progress: its number, who started it, and what stops it.
type Running = (u64, Caller, CancellationToken);

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
            list.retain(|(id, _, _)| *id != self.id);
            if list.is_empty() {
                running.remove(&self.session_id);
            }
        }
    }
}

impl ProfilerService {
    pub fn new(agent: Arc<Agent>, config: ServiceConfig) -> ProfilerService {
        let captures = Arc::new(Captures::new(Arc::clone(&agent), config.capture_settings()));
        config.telemetry.captures_started(&captures);
        ProfilerService {
            captures,
            agent,
            config,
            running: Mutex::new(HashMap::new()),
            claimed: Mutex::default(),
            next_capture: Default::default(),
            continuous: Arc::default(),
            next_continuous: Default::default(),
            monitors: Mutex::default(),
        }
    }

    /// What this service captures through, for the triggers to save with.
    pub fn captures(&self) -> &Arc<Captures> {
        &self.captures
    }

    /// Health and metrics of the server these services run in.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.config.telemetry
    }

    /// A capture of `window`, asked for at `asked_ns`, has its reply ready
    /// now: how long after its window ended, or after it was asked for when
    /// that was later (a look-back window ended long before; its age is
    /// not the agent's slowness).
    fn capture_ready(&self, rpc: &'static str, window: Window, asked_ns: u64) {
        let latency = reply_latency(clock::now_ns(), window, asked_ns);
        self.config.telemetry.capture_ready(rpc, latency);
    }

    /// Whose processes `caller`'s captures hold, or why it gets none.
    fn scope_of(&self, caller: &Caller) -> Result<Scope, Status> {
        self.config
            .access
            .scope_of(caller)
            .map_err(Status::permission_denied)
    }

    /// Attaches the injection library to the processes a capture names
    /// before its window, each that `caller` may attach (an admin any, a
    /// local user its own): what happened to each, for the reply's
    /// warnings.
    async fn attach_first(&self, pids: &[i32], caller: &Caller) -> Vec<String> {
        let mut said = Vec::new();
        let admin = self.config.access.is_admin(caller);
        for &pid in pids {
            let allowed = match caller {
                _ if admin => Ok(None),
                Caller::User { uid, .. } => {
                    crate::attach::attachable_by(pid, *uid).map(|()| Some(*uid))
                }
                _ => Err("only local users and admins may have processes attached".to_string()),
            };
            let owner = match allowed {
                Ok(owner) => owner,
                Err(why) => {
                    info!(pid, %caller, %why, "capture: not attaching");
                    said.push(format!("process {pid} was not attached: {why}"));
                    continue;
                }
            };
            let Some(config) = self.config.attach.clone() else {
                said.push(format!(
                    "process {pid} was not attached: this agent attaches nothing"
                ));
                continue;
            };
            // A user's process must still be that user's once it is stopped.
            // Not cut off by a stopping agent while the process is held:
            // it goes on if this call's client gives up.
            let attaching = crate::model::under_way::begin(format!(
                "attaching the injection library to process {pid}"
            ));
            let outcome = tokio::task::spawn_blocking(move || {
                let _attaching = attaching;
                crate::attach::attach_as(pid, &config, owner)
            })
            .await;
            let text = match outcome {
                Ok(Ok(attached)) => {
                    info!(pid, %caller, stopped_ms = attached.stopped_for.as_secs_f64() * 1e3, "attached for a capture");
                    format!(
                        "process {pid} was attached for this capture: the injection library \
                         loaded {:.1} ms after {} was let go (stopped {:.1} ms); its GPU \
                         activity is recorded once CUPTI starts in it",
                        attached.loaded_in.as_secs_f64() * 1e3,
                        attached.thread,
                        attached.stopped_for.as_secs_f64() * 1e3
                    )
                }
                Ok(Err(crate::attach::AttachError::AlreadyInjected)) => continue,
                Ok(Err(error)) => format!("process {pid} was not attached: {error}"),
                Err(error) => format!("process {pid} was not attached: {error}"),
            };
            said.push(text);
        }
        said
    }

    /// Makes `plan` `caller`'s: whose processes it holds, whose rights its
    /// files are written with, whose share of capture memory it draws.
    fn plan_for(&self, plan: &mut Plan, caller: &Caller) -> Result<(), Status> {
        plan.scope = self.scope_of(caller)?;
        plan.memory_owner = (!self.config.access.is_admin(caller)).then(|| caller.owner());
        plan.caller = caller.clone();
        Ok(())
    }

    /// The plan of `request`'s capture (see [`request::plan`]).
    fn plan(&self, request: &ProfileRequest, require_duration: bool) -> Result<Plan, Status> {
        request::plan(&self.config, request, require_duration, self.agent.losses())
    }

    /// Enters a capture in the Terminate table, unless its caller (not an
    /// admin) already has `--captures-per-caller` in progress: one caller
    /// cannot hold the agent's captures (and their memory) for everyone.
    fn register(
        &self,
        session_id: &str,
        caller: Caller,
    ) -> Result<(Registration<'_>, CancellationToken), Status> {
        let token = CancellationToken::new();
        let id = self
            .next_capture
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut running = self.running.lock();
        let limit = self.config.captures_per_caller;
        if !self.config.access.is_admin(&caller) {
            let theirs = running
                .values()
                .flatten()
                .filter(|(_, owner, _)| Access::same_caller(owner, &caller))
                .count();
            if theirs >= limit {
                return Err(Status::resource_exhausted(format!(
                    "{caller} has {theirs} captures in progress, as many as \
                     --captures-per-caller ({limit}) lets one caller have; ask again when one \
                     has ended"
                )));
            }
        }
        running
            .entry(session_id.to_string())
            .or_default()
            .push((id, caller, token.clone()));
        Ok((
            Registration {
                service: self,
                session_id: session_id.to_string(),
                id,
            },
            token,
        ))
    }
}

/// Logs how a capture ended: answered, or without a reply (an error the
/// client was told, or a client gone, whose call was dropped).
struct CaptureEnd {
    session: String,
    answered: bool,
    /// The error the client was answered with, when it was.
    failed: Option<(tonic::Code, String)>,
}

impl CaptureEnd {
    fn new(session: &str) -> CaptureEnd {
        CaptureEnd {
            session: session.to_string(),
            answered: false,
            failed: None,
        }
    }

    fn failed(&mut self, status: &Status) {
        self.failed = Some((status.code(), status.message().to_string()));
    }
}

impl Drop for CaptureEnd {
    fn drop(&mut self) {
        match &self.failed {
            _ if self.answered => info!(session = %self.session, "capture answered"),
            Some((code, reason)) => {
                info!(session = %self.session, ?code, %reason, "capture failed");
            }
            None => info!(
                session = %self.session,
                "capture dropped before its reply: its client went away, or the call's deadline \
                 passed (then logged on a line of its own: the caller's deadline passed before \
                 the reply)"
            ),
        }
    }
}

#[tonic::async_trait]
impl profiler_service_server::ProfilerService for ProfilerService {
    async fn profile(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let asked_ns = clock::now_ns();
        let deadline = memory_wait_deadline(request.metadata());
        let caller = caller_of_request(&request)?;
        let via = via::of_request(request.metadata().as_ref());
        let caller_timeout = super::deadline::caller_timeout(request.metadata());
        let request = request.into_inner();
        // Said where the operator looks, as an accepted request is.
        let refused = |refusal: &Status| {
            info!(
                %caller,
                code = ?refusal.code(),
                reason = refusal.message(),
                "capture refused"
            );
        };
        if via.contains(&via::this_agent()) {
            let looped = Status::failed_precondition(
                "this capture came back to the agent that asked for it along --upstream \
                 (the upstreams form a loop): it is not captured again",
            );
            refused(&looped);
            return Err(looped);
        }
        let mut plan = self
            .plan(&request, true)
            .and_then(|mut plan| {
                super::deadline::refuse_window_past_deadline(
                    caller_timeout,
                    "opts",
                    plan.window.stop_ns,
                )?;
                self.plan_for(&mut plan, &caller)?;
                plan.via = via;
                Ok(plan)
            })
            .inspect_err(refused)?;
        let _claim = self
            .refuse_a_held_session(&plan)
            .await
            .inspect_err(refused)?;
        info!(
            session = %plan.session_id,
            host = %plan.file_host,
            duration_ms = plan.window.duration_ns() / 1_000_000,
            %caller,
            scope = %plan.scope,
            "capture requested"
        );
        let (_registration, terminate) = self
            .register(&plan.session_id, caller.clone())
            .inspect_err(refused)?;
        // Its end is logged too, answered or not.
        let mut ended = CaptureEnd::new(&plan.session_id);
        let attached = self.attach_first(&plan.attach, &caller).await;
        plan.warnings.extend(attached);
        let admission = self.captures.admit(&plan);
        let mut active = self
            .agent
            .capture_activity(plan.detailed_device, plan.scope);
        // Upstreams and per-capture sources record alongside the local
        // window; dropping `remote` (a client gone) ends them.
        let remote = self.captures.start_remote(&plan, deadline);
        let (window, terminated) = tokio::select! {
            _ = tokio::time::sleep(clock::until(plan.window.stop_ns)) => (plan.window, false),
            _ = terminate.cancelled() => {
                info!(session = %plan.session_id, "capture terminated early");
                remote.end_early(&plan.session_id);
                (Window { stop_ns: clock::now_ns().clamp(plan.window.start_ns, plan.window.stop_ns), ..plan.window }, true)
            }
        };
        active.end_recording();
        // The request's own warnings go onto the reply, so that the build
        // itself is the same for every capture of this window.
        let common = Plan {
            warnings: Vec::new(),
            ..plan.clone()
        };
        let encoded = self
            .captures
            .build_admitted(&admission, &common, window, remote, terminated, deadline)
            .await
            .map_err(Status::from)
            .inspect_err(|status| ended.failed(status))?;
        let encoded = with_warnings(encoded, &plan.warnings);
        let reply = self
            .respond(&plan, window, encoded, deadline)
            .await
            .inspect_err(|status| ended.failed(status))?;
        drop(active);
        self.capture_ready("Profile", window, asked_ns);
        ended.answered = true;
        Ok(reply)
    }

    async fn terminate(
        &self,
        request: Request<TerminateRequest>,
    ) -> Result<Response<TerminateResponse>, Status> {
        let caller = caller_of_request(&request)?;
        let session_id = request.into_inner().session_id;
        validate::name_component("session_id", &session_id)?;
        let (mine, others): (Vec<_>, Vec<_>) = self
            .running
            .lock()
            .get(&session_id)
            .map(|list| {
                list.iter()
                    .map(|(_, owner, token)| (owner.clone(), token.clone()))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
            .into_iter()
            .partition(|(owner, _)| self.config.access.may_act_on(&caller, owner));
        if !others.is_empty() {
            // Said to nobody but the log: the caller learns nothing of
            // captures that are not its own.
            info!(session = %session_id, %caller, captures = others.len(), "terminate: not stopping captures another caller started");
        }
        if mine.is_empty() {
            info!(session = %session_id, %caller, "terminate: no running capture of this caller with this session id");
        } else {
            info!(session = %session_id, %caller, captures = mine.len(), "terminate");
        }
        for (_, token) in mine {
            token.cancel();
        }
        Ok(Response::new(TerminateResponse {}))
    }

    async fn monitor(
        &self,
        request: Request<MonitorRequest>,
    ) -> Result<Response<MonitorResponse>, Status> {
        let caller = caller_of_request(&request)?;
        self.monitor_report(request.into_inner(), caller)
            .await
            .map(Response::new)
    }

    async fn start_continuous_profiling(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ContinuousProfilingResponse>, Status> {
        let caller = caller_of_request(&request)?;
        let request = request.into_inner();
        let plan = self.plan(&request, false)?;
        let scope = self.scope_of(&caller)?;
        let owner = caller.owner();
        let mut sessions = self.continuous.lock();
        if sessions.contains_key(&owner) {
            return Err(Status::already_exists(format!(
                "a continuous profiling session of yours ({caller}) is already running"
            )));
        }
        if sessions.len() >= MAX_CONTINUOUS_SESSIONS {
            return Err(Status::resource_exhausted(format!(
                "{} continuous profiling sessions are running, the most this agent keeps at \
                 once; ask again when one has ended",
                sessions.len()
            )));
        }
        let duration = plan.window.duration_ns();
        info!(session = %plan.session_id, %caller, %scope, "continuous profiling started");
        let number = self
            .next_continuous
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        end_when_unattended(
            Arc::clone(&self.continuous),
            owner.clone(),
            number,
            self.config.continuous_timeout,
        );
        sessions.insert(
            owner,
            Continuous {
                number,
                last_contact: std::time::Instant::now(),
                _active: self.agent.capture_activity(plan.detailed_device, scope),
                request,
                caller,
                duration: (duration > 0).then(|| Duration::from_nanos(duration)),
                last_snapshot_ns: clock::now_ns(),
            },
        );
        Ok(Response::new(ContinuousProfilingResponse {}))
    }

    async fn stop_continuous_profiling(
        &self,
        request: Request<StopContinuousProfilingRequest>,
    ) -> Result<Response<StopContinuousProfilingResponse>, Status> {
        let caller = caller_of_request(&request)?;
        let mut sessions = self.continuous.lock();
        let admin = self.config.access.is_admin(&caller);
        let owner = session_of(&sessions, &caller, admin)?;
        if let Some(stopped) = sessions.remove(&owner) {
            info!(%caller, session = %stopped.request.session_id, started_by = %stopped.caller, "continuous profiling stopped");
        }
        Ok(Response::new(StopContinuousProfilingResponse {}))
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let deadline = memory_wait_deadline(request.metadata());
        let caller = caller_of_request(&request)?;
        let snapshot_id = request.into_inner().snapshot_session_id;
        validate::name_component("snapshot_session_id", &snapshot_id)?;
        let now = clock::now_ns();
        let (mut plan, start_ns, number) = {
            let mut sessions = self.continuous.lock();
            let admin = self.config.access.is_admin(&caller);
            let owner = session_of(&sessions, &caller, admin)?;
            let Some(continuous) = sessions.get_mut(&owner) else {
                return Err(Status::not_found(
                    "no continuous profiling session is running",
                ));
            };
            let mut plan = self.plan(&continuous.request, false)?;
            self.plan_for(&mut plan, &continuous.caller)?;
            // A fixed duration reaches back into the recorder, even to before
            // the session started; otherwise snapshots tile time.
            let start = match continuous.duration {
                Some(duration) => now.saturating_sub(clock::duration_ns(duration)),
                None => continuous.last_snapshot_ns,
            };
            continuous.last_snapshot_ns = now;
            continuous.last_contact = std::time::Instant::now();
            (plan, start, (owner, continuous.number))
        };
        plan.window = Window {
            start_ns,
            stop_ns: now,
        };
        plan.warnings.clear();
        if snapshot_id.is_empty() {
            // Each snapshot a session of its own, named after the
            // continuous session's (`_2`, `_3`, ... for the later ones):
            // one named by its start request would otherwise hold only the
            // last snapshot's trace.
            plan.generated_session_id = true;
        } else {
            plan.session_id = snapshot_id;
            plan.generated_session_id = false;
        }
        let encoded = self.captures.build(&plan, plan.window, deadline).await?;
        // Its client was here until now: a slow build does not count
        // against it.
        let (owner, number) = number;
        if let Some(continuous) = self
            .continuous
            .lock()
            .get_mut(&owner)
            .filter(|continuous| continuous.number == number)
        {
            continuous.last_contact = std::time::Instant::now();
        }
        if encoded.len() > self.config.chunk_traces_over {
            return self
                .respond_chunked(&plan, plan.window, Arc::new(encoded), true, deadline)
                .await;
        }
        let mut encoded = Arc::new(encoded);
        if let Some(root) = self.server_side_root(&plan) {
            // The snapshot goes inline either way; one not written says why.
            let (written, _) =
                write_trace(root, &plan, XPLANE_SUFFIX, Arc::clone(&encoded)).await?;
            if let Err(error) = written {
                encoded = reply::with_warnings(encoded, &[reply::unwritten_warning(&error)]);
            }
        }
        self.capture_ready("GetSnapshot", plan.window, now);
        let empty_trace = encoded.events == 0;
        Ok(framed(
            FramedReply::xspace(encoded.parts(), empty_trace),
            encoded,
        ))
    }
}

/// How long a reply ready at `now_ns` took, for a window asked for at
/// `asked_ns`: from the window's end, or from the request when the window
/// ended before it (a look-back).
fn reply_latency(now_ns: u64, window: Window, asked_ns: u64) -> Duration {
    Duration::from_nanos(now_ns.saturating_sub(window.stop_ns.max(asked_ns)))
}

#[cfg(test)]
mod tests {
    use super::{reply_latency, Window};
    use std::time::Duration;

    #[test]
    fn a_look_back_is_late_from_its_request_not_its_window() {
        let second = 1_000_000_000;
        let window = Window {
            start_ns: 100 * second,
            stop_ns: 102 * second,
        };
        // Asked for while it ran: from its end.
        assert_eq!(
            reply_latency(103 * second, window, 100 * second),
            Duration::from_secs(1)
        );
        // Asked for 200 s after it ended: from the request.
        assert_eq!(
            reply_latency(302 * second + second / 2, window, 302 * second),
            Duration::from_millis(500)
        );
    }
}
