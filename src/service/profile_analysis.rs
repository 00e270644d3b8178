//! `tensorflow.ProfileAnalysis`: profile many hosts in one session
//! (`NewSession`, which TensorFlow's client sends when given a worker list),
//! list the sessions of a repository (`EnumSessions`) and serve tool data
//! from them (`GetSessionToolData`). Every path is confined to the operator's
//! allowed roots (directories or bucket prefixes), for reading as for
//! writing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::capture::memory::{CaptureMemory, ReadingMemory};
use crate::clock;
use crate::fleet::hosts::{self, HostEntry, HostList, HostResolver, HostsError, Origin};
use crate::fleet::{self, HostOutcome, ToolDataError};
use crate::proto::tensorflow::profile_analysis_server::ProfileAnalysis;
use crate::proto::tensorflow::{
    EnumProfileSessionsAndToolsRequest, EnumProfileSessionsAndToolsResponse,
    NewProfileSessionRequest, NewProfileSessionResponse, ProfileSessionDataRequest,
    ProfileSessionDataResponse, ProfileSessionInfo,
};
use crate::protocol::caller::Caller;
use crate::protocol::client::{self, ClientConfig, Target};
use crate::protocol::listen::caller_of_request;
use crate::repository::{self, Folder, StorageError};
use crate::service::access::Access;
use crate::service::session_bytes::SessionBytes;
use crate::xspace::read::ReadError;

use super::deadline;
use super::framed_reply::FramedReply;
use super::session_hosts::SessionHosts;
use super::validate::{self, invalid};
use crate::model::calendar::session_timestamp;
use crate::repository::roots::AllowedRoots;

/// Most hosts one NewSession may name.
pub const MAX_HOSTS: usize = 1024;
/// Time kept back from the caller's deadline to write files and reply.
const REPLY_MARGIN: Duration = Duration::from_millis(200);
/// Longest wait for the addresses of `dns:` entries.
const LOOKUP_LIMIT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub struct AnalysisConfig {
    pub allowed_roots: AllowedRoots,
    pub max_duration: Duration,
    pub default_port: u16,
    /// How session hosts are called: TLS, and the largest reply accepted
    /// from each.
    pub client: ClientConfig,
    /// Hosts a session may name (`--session-hosts`).
    pub session_hosts: SessionHosts,
    /// Where a host's trace is kept when its upload to object storage
    /// fails (`--unsent-dir`).
    pub unsent_dir: PathBuf,
    /// How `dns:` entries are looked up (`--dns-server`).
    pub resolver: Arc<HostResolver>,
    /// Most hosts called at once (`--concurrent-hosts`).
    pub concurrent_hosts: usize,
    /// The budget tool requests on stored sessions draw from (the capture
    /// budget, `--capture-memory`); none: unbounded.
    pub memory: Option<Arc<CaptureMemory>>,
    /// Who is an admin (`--admin-group`, `--admin-client`).
    pub access: Access,
    /// What a session of a caller who is not an admin may write
    /// (`--session-bytes`, `--session-bytes-per-hour`).
    pub session_bytes: Arc<SessionBytes>,
}

impl Default for AnalysisConfig {
    fn default() -> Self {
        AnalysisConfig {
            allowed_roots: AllowedRoots::default(),
            max_duration: Duration::from_secs(600),
            default_port: client::DEFAULT_PORT,
            client: ClientConfig::default(),
            session_hosts: SessionHosts::default(),
            unsent_dir: std::env::temp_dir(),
            resolver: Arc::default(),
            concurrent_hosts: fleet::DEFAULT_CONCURRENT_HOSTS,
            memory: None,
            access: Access::default(),
            session_bytes: Arc::default(),
        }
    }
}

pub struct ProfileAnalysisService {
    config: AnalysisConfig,
}

impl ProfileAnalysisService {
    pub fn new(config: AnalysisConfig) -> ProfileAnalysisService {
        ProfileAnalysisService { config }
    }

    /// The repository root of a request, matched to an allowed root, its
    /// files touched with `caller`'s rights ([`crate::repository::acting`]).
    fn root(&self, repository_root: &str, caller: &Caller) -> Result<Folder, Status> {
        validate::client_path("repository_root", repository_root)?;
        if repository_root.is_empty() {
            return Err(invalid("repository_root", "is required"));
        }
        self.config
            .allowed_roots
            .confine(repository_root)
            .map_err(|e| Status::permission_denied(format!("repository_root: {e}")))?
            .acting_for(caller)
            .map_err(|e| Status::permission_denied(format!("repository_root: {e}")))
    }
}

impl ProfileAnalysisService {
    /// The hosts of a NewSession, each entry checked against what the
    /// operator allows before any lookup or connection.
    fn session_hosts(&self, hosts: &[String]) -> Result<Vec<HostEntry>, Status> {
        if hosts.is_empty() {
            return Err(invalid("hosts", "name at least one host to profile"));
        }
        let mut list = HostList::new(Origin::Peer, self.config.default_port, MAX_HOSTS);
        let mut checked = 0;
        for (index, text) in hosts.iter().enumerate() {
            let field = format!("hosts[{index}]");
            list.add(text).map_err(|e| match e {
                HostsError::TooMany { .. } => invalid(
                    "hosts",
                    format!("at most {MAX_HOSTS} hosts per session ({e})"),
                ),
                e => invalid(&field, e),
            })?;
            for entry in &list.entries()[checked..] {
                self.check_host(&field, entry)?;
            }
            checked = list.entries().len();
        }
        list.finish().map_err(|e| invalid("hosts", e))
    }

    /// Whether the operator lets this agent call `entry`. A `dns:` entry is
    /// judged by its name, as a plain host name is: DNS is trusted alike.
    fn check_host(&self, field: &str, entry: &HostEntry) -> Result<(), Status> {
        let target = match entry {
            HostEntry::Host(target) => target.clone(),
            HostEntry::Dns { name, port, scheme } => Target {
                address: format!("{name}:{port}"),
                scheme: *scheme,
            },
        };
        if !self.config.session_hosts.allows(&target.address) {
            return Err(Status::permission_denied(format!(
                "{field}: {entry} is not among the hosts this agent may call (--session-hosts {})",
                self.config.session_hosts.describe()
            )));
        }
        if target.uses_tls(&self.config.client) && self.config.client.tls.is_none() {
            return Err(invalid(
                field,
                "grpcs:// needs the agent to be started with --tls-ca",
            ));
        }
        Ok(())
    }
}

/// A NewSession's folder under an allowed root (a directory or a bucket
/// prefix), made when the first trace arrives.
struct SessionSink {
    root: Folder,
    session_id: String,
    generated_id: bool,
    unsent_dir: PathBuf,
    made: parking_lot::Mutex<Option<Folder>>,
    /// Who asked, and its bounds (none for an admin).
    caller: Caller,
    bounds: Option<Arc<SessionBytes>>,
    /// Bytes this session's files have taken so far.
    written: Arc<parking_lot::Mutex<u64>>,
}

impl fleet::TraceSink for SessionSink {
    fn create(&self, file_name: &str) -> Result<Box<dyn fleet::TraceFile>, String> {
        let folder = {
            let mut made = self.made.lock();
            match made.as_ref() {
                Some(folder) => Ok(folder.clone()),
                None => match self
                    .root
                    .create_session(&self.session_id, self.generated_id)
                {
                    // No trace replaces one the session held: a caller's
                    // session named twice, or two sessions of one name.
                    Ok((folder, _)) => Ok(made.insert(folder.create_only()).clone()),
                    Err(error) if self.root.is_object() => Err(format!(
                        "{}/{}: {error}",
                        self.root.display(),
                        self.session_id
                    )),
                    Err(error) => return Err(format!("repository_root: {error}")),
                },
            }
        };
        let file = repository::create_file(
            folder.as_ref().map_err(Clone::clone),
            &self.session_id,
            file_name,
            &self.unsent_dir,
        )?;
        match &self.bounds {
            None => Ok(Box::new(file)),
            Some(bounds) => Ok(Box::new(BoundedFile {
                file: Some(Box::new(file)),
                caller: self.caller.clone(),
                bounds: Arc::clone(bounds),
                written: Arc::clone(&self.written),
                counted: 0,
            })),
        }
    }
}

/// A session file whose writes count against its caller's bounds; one
/// that would pass them fails, and the file is not committed. What a file
/// that never lands counted is given back: the bounds are of bytes
/// written.
struct BoundedFile {
    /// `None` once committed.
    file: Option<Box<dyn fleet::TraceFile>>,
    caller: Caller,
    bounds: Arc<SessionBytes>,
    written: Arc<parking_lot::Mutex<u64>>,
    /// What this file's writes counted so far.
    counted: u64,
}

impl fleet::TraceFile for BoundedFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        let file = self.file.as_mut().ok_or("already committed")?;
        {
            let mut written = self.written.lock();
            self.bounds
                .take(&self.caller, *written, bytes.len() as u64)?;
            *written += bytes.len() as u64;
        }
        self.counted += bytes.len() as u64;
        file.write(bytes)
    }

    fn commit(mut self: Box<Self>) -> Result<PathBuf, String> {
        let file = self.file.take().ok_or("already committed")?;
        let committed = file.commit();
        if committed.is_ok() {
            self.counted = 0;
        }
        committed
    }
}

impl Drop for BoundedFile {
    fn drop(&mut self) {
        if self.counted > 0 {
            let mut written = self.written.lock();
            *written = written.saturating_sub(self.counted);
            self.bounds.give_back(&self.caller, self.counted);
        }
    }
}

/// The status of reading or opening what `field` named; `message` is the
/// whole text.
fn storage_status(error: &StorageError, message: String) -> Status {
    match error {
        StorageError::NotFound { .. } => Status::not_found(message),
        StorageError::Refused(_) | StorageError::TooLarge { .. } | StorageError::Url(_) => {
            Status::permission_denied(message)
        }
        // The caller's own rights refused it (their files are read and
        // written with them): not a fault of the agent's.
        StorageError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            Status::permission_denied(message)
        }
        // A file where a directory is named: there is no such directory.
        StorageError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotADirectory => {
            Status::not_found(message)
        }
        StorageError::Io { .. } => Status::internal(message),
        // The bucket's server or credentials failed, not this agent.
        StorageError::Object { .. } => Status::unavailable(message),
    }
}

fn field_status(field: &str, error: StorageError) -> Status {
    storage_status(&error, format!("{field}: {error}"))
}

fn tool_status(error: ToolDataError) -> Status {
    let message = error.to_string();
    match error {
        ToolDataError::UnknownTool { .. }
        | ToolDataError::NeedsHost { .. }
        | ToolDataError::Parameter { .. } => Status::invalid_argument(message),
        ToolDataError::UnknownHost { .. } | ToolDataError::EmptySession { .. } => {
            Status::not_found(message)
        }
        ToolDataError::Storage(error) => storage_status(&error, message),
        ToolDataError::Refused { .. } => Status::resource_exhausted(message),
        ToolDataError::Read(error) => read_status(&error, message),
        ToolDataError::Tool(_) | ToolDataError::Chunked { .. } => {
            Status::failed_precondition(message)
        }
        ToolDataError::Grew { .. } => Status::aborted(message),
    }
}

/// How long a listing waits for memory to look into traces with; without
/// it, sessions are listed with the tools every trace has.
const LISTING_MEMORY_WAIT: Duration = Duration::from_secs(1);

/// A trace that could not be read: too large to hold now, or not a trace
/// (a file someone else wrote, cut short or damaged: nothing this agent
/// did wrong, nor a call worth repeating).
fn read_status(error: &ReadError, message: String) -> Status {
    use crate::xspace::chunks::ChunkError;
    use crate::xspace::riegeli::RiegeliError;
    match error {
        ReadError::Refused { .. }
        | ReadError::Chunked {
            source:
                ChunkError::Refused { .. }
                | ChunkError::MergeRefused { .. }
                | ChunkError::Riegeli(RiegeliError::Refused { .. }),
            ..
        } => Status::resource_exhausted(message),
        ReadError::Io { .. } => Status::internal(message),
        _ => Status::data_loss(message),
    }
}

#[tonic::async_trait]
impl ProfileAnalysis for ProfileAnalysisService {
    async fn new_session(
        &self,
        request: Request<NewProfileSessionRequest>,
    ) -> Result<Response<NewProfileSessionResponse>, Status> {
        let arrived = Instant::now();
        let caller_deadline = deadline::caller_timeout(request.metadata());
        let caller = caller_of_request(&request)?;
        // Who may not capture here may not have this agent capture for it
        // elsewhere either.
        self.config
            .access
            .scope_of(&caller)
            .map_err(Status::permission_denied)?;
        let request = request.into_inner();
        let Some(mut profile) = request.request else {
            return Err(invalid(
                "request",
                "the ProfileRequest to send to every host is missing",
            ));
        };
        let entries = self.session_hosts(&request.hosts)?;
        validate::name_component("session_id", &request.session_id)?;
        // The hosts' traces may each hold a whole host: not for other users.
        let root = self
            .root(&request.repository_root, &caller)?
            .kept_from_others()
            .map_err(|e| Status::internal(format!("repository_root: {e}")))?;
        let generated_id = request.session_id.is_empty();
        let session_id = if generated_id {
            session_timestamp()
        } else {
            request.session_id.clone()
        };
        let mut options = profile.opts.take().unwrap_or_default();
        let modern = options.version != 0;
        let duration_ms = if modern && options.duration_ms != 0 {
            options.duration_ms
        } else {
            profile.duration_ms
        };
        if duration_ms == 0 {
            return Err(invalid(
                "request.opts.duration_ms",
                "must be greater than 0",
            ));
        }
        let max_ms = self.config.max_duration.as_millis() as u64;
        if duration_ms > max_ms {
            return Err(invalid(
                "request.opts.duration_ms",
                format!("{duration_ms} ms exceeds this agent's maximum of {max_ms} ms"),
            ));
        }
        // Answer our caller in time with whatever hosts made it, rather than
        // letting one slow host (or name server) turn the whole session
        // into a timeout.
        let caller_end = caller_deadline.and_then(|caller| {
            arrived.checked_add(caller.saturating_sub(caller / 10 + REPLY_MARGIN))
        });
        // A window that ends after the session is cut short for the caller
        // could never reach it: refused before any name is looked up.
        let asked_start = if modern {
            options.start_timestamp_ns
        } else {
            0
        };
        deadline::refuse_window_past_deadline(
            caller_end.map(|end| end.saturating_duration_since(Instant::now())),
            "request.opts",
            asked_start
                .max(clock::now_ns())
                .saturating_add(duration_ms.saturating_mul(1_000_000)),
        )?;
        // Names are looked up before the window is placed, so that lookups
        // do not eat into it.
        let lookup_limit = caller_end.map_or(LOOKUP_LIMIT, |end| {
            end.saturating_duration_since(Instant::now())
                .min(LOOKUP_LIMIT)
        });
        let resolved = hosts::resolve(
            entries,
            &self.config.resolver,
            &self.config.client,
            MAX_HOSTS,
            lookup_limit,
        )
        .await;
        let mut outcomes = HostOutcome::unresolved(resolved.failures);
        let hosts = resolved.targets;
        // Whether the caller's session was there before this one (then it
        // is the caller's, and stays even if nothing reaches it).
        let mut named_existed = false;
        if !generated_id {
            let session = root.join(&session_id);
            let files = fleet::host_file_parts(&hosts);
            let (taken, existed) = tokio::task::spawn_blocking(move || {
                let taken = fleet::held_traces(&session, &files);
                (taken, session.exists().unwrap_or(true))
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
            named_existed = existed;
            if !taken.is_empty() {
                return Err(Status::already_exists(format!(
                    "session_id: session {session_id} under {} holds traces of these hosts \
                     already ({}); name another session, or leave session_id empty for a new one",
                    root.display(),
                    taken.join(", ")
                )));
            }
        }
        // One absolute start for every host, so that the traces line up.
        let now = clock::now_ns();
        let start_ns = if modern && options.start_timestamp_ns > now {
            options.start_timestamp_ns
        } else {
            now
        };
        options.version = 1;
        options.start_timestamp_ns = start_ns;
        options.duration_ms = duration_ms;
        profile.opts = Some(options);
        profile.duration_ms = duration_ms;
        profile.session_id = session_id.clone();
        profile.repository_root = request.repository_root.clone();
        let mut session_end = Instant::now()
            + client::capture_deadline(Duration::from_millis(duration_ms))
            + clock::until(start_ns);
        if let Some(caller_end) = caller_end {
            session_end = session_end.min(caller_end);
        }
        info!(session = %session_id, hosts = hosts.len(), duration_ms, %caller, "session requested");
        // Each host's trace is written as it arrives, in a session folder
        // made when the first one does (a unique name for a generated id, so
        // that two sessions in one second keep both). A trace whose upload
        // fails is kept on this host's disk, and the error says where.
        let sink = Arc::new(SessionSink {
            root: root.clone(),
            session_id: session_id.clone(),
            generated_id,
            unsent_dir: self.config.unsent_dir.clone(),
            made: parking_lot::Mutex::new(None),
            bounds: (!self.config.access.is_admin(&caller))
                .then(|| Arc::clone(&self.config.session_bytes)),
            caller: caller.clone(),
            written: Arc::default(),
        });
        // An agent on this host (this one included) captures for the
        // caller, not for this agent's user.
        let mut client = self.config.client.clone();
        if let Caller::User { uid, .. } = caller {
            client.on_behalf_of_uid = Some(uid);
        }
        let plan = fleet::FanOut {
            deadline: session_end.saturating_duration_since(Instant::now()),
            concurrent_hosts: self.config.concurrent_hosts,
            client,
        };
        if !hosts.is_empty() {
            outcomes.extend(
                fleet::fan_out(
                    &hosts,
                    &profile,
                    &plan,
                    Arc::clone(&sink) as Arc<dyn fleet::TraceSink>,
                )
                .await,
            );
        }
        let delivered = outcomes
            .iter()
            .filter(|o| matches!(o.result, Ok(Some(_))))
            .count();
        // A session this call made and nothing reached is taken back,
        // without holding up the reply (the bucket may be why nothing
        // reached it); a named one that was there before is the caller's.
        let made = sink.made.lock().clone().filter(|_| !named_existed);
        if let (0, Some(folder)) = (delivered, made) {
            let session = session_id.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(error) = folder.release_session() {
                    info!(%session, %error, "could not give back the session's name");
                }
            });
        }
        for outcome in &outcomes {
            if let Err(e) = &outcome.result {
                info!(session = %session_id, host = %outcome.host, error = %e, "host failed");
            }
        }
        info!(session = %session_id, delivered, failed = outcomes.len() - delivered, "session done");
        let error_message = fleet::failure_summary(&outcomes)
            .map(|(headline, lines)| format!("{headline}: {}", lines.join("; ")))
            .unwrap_or_default();
        // Nothing reached the session: a trace kept on this host's disk
        // instead is named in error_message.
        Ok(Response::new(NewProfileSessionResponse {
            error_message,
            empty_trace: delivered == 0,
        }))
    }

    async fn enum_sessions(
        &self,
        request: Request<EnumProfileSessionsAndToolsRequest>,
    ) -> Result<Response<EnumProfileSessionsAndToolsResponse>, Status> {
        let caller = caller_of_request(&request)?;
        let root = self.root(&request.into_inner().repository_root, &caller)?;
        // Which tools serve a session is read from its traces (their plane
        // names), each drawn from the budget while it is read: a listing
        // is asked for on every XProf page, and a repository's files are
        // anyone's who could write there.
        let memory = match &self.config.memory {
            Some(memory) => Some(
                memory
                    .reserve(
                        1,
                        || "listing the sessions' tools".to_string(),
                        std::time::Instant::now() + LISTING_MEMORY_WAIT,
                    )
                    .await
                    .ok(),
            ),
            None => None,
        };
        let sessions = tokio::task::spawn_blocking(move || {
            let missing = || StorageError::NotFound {
                path: root.display(),
            };
            match root.exists() {
                Ok(true) => {}
                Ok(false) => return Err(field_status("repository_root", missing())),
                Err(error) => return Err(field_status("repository_root", error)),
            }
            let sessions = match memory {
                Some(Some(mut memory)) => {
                    fleet::list_sessions_within(&root, &mut ReadingMemory(&mut memory))
                }
                Some(None) => {
                    fleet::list_sessions_within(&root, &mut crate::xspace::grant::Nothing)
                }
                None => fleet::list_sessions(&root),
            }
            .map_err(|e| field_status("repository_root", e))?;
            // XProf pointed one level too deep shows nothing, unsaid.
            let said = if sessions.is_empty() && fleet::holds_traces(&root) {
                format!(
                    "repository_root: {} is a session itself (it holds traces): give the \
                     directory above it",
                    root.display()
                )
            } else {
                String::new()
            };
            Ok((sessions, said))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        let (sessions, error_message) = sessions;
        Ok(Response::new(EnumProfileSessionsAndToolsResponse {
            error_message,
            sessions: sessions
                .into_iter()
                .map(|s| ProfileSessionInfo {
                    session_id: s.session_id,
                    available_tools: s.tools,
                })
                .collect(),
        }))
    }

    async fn get_session_tool_data(
        &self,
        request: Request<ProfileSessionDataRequest>,
    ) -> Result<Response<ProfileSessionDataResponse>, Status> {
        let wait_until = deadline::memory_wait_deadline(request.metadata());
        let caller = caller_of_request(&request)?;
        let request = request.into_inner();
        let root = self.root(&request.repository_root, &caller)?;
        if request.session_id.is_empty() {
            return Err(invalid("session_id", "is required"));
        }
        validate::name_component("session_id", &request.session_id)?;
        validate::name_component("host_name", &request.host_name)?;
        if request.tool_name.is_empty() {
            return Err(invalid(
                "tool_name",
                format!("is required (one of: {})", fleet::TOOLS.join(", ")),
            ));
        }
        let session_id = request.session_id;
        let host = (!request.host_name.is_empty()).then_some(request.host_name);
        let tool = request.tool_name;
        let parameters = request.parameters;
        let (directory, plan) = tokio::task::spawn_blocking(move || {
            let directory = root.join(&session_id);
            match directory.exists() {
                Ok(true) => {}
                Ok(false) | Err(StorageError::NotFound { .. }) => {
                    return Err(Status::not_found(format!(
                        "session_id: no session {session_id:?} under {}",
                        root.display()
                    )))
                }
                Err(error) => return Err(field_status("session_id", error)),
            }
            let plan = fleet::plan_tool(&directory, host.as_deref(), &tool, &parameters)
                .map_err(tool_status)?;
            Ok((directory, plan))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        // Held until the reply has been sent.
        let memory = match &self.config.memory {
            Some(memory) => {
                let what = || {
                    format!(
                        "computing {} from {} bytes of this session's traces",
                        plan.tool(),
                        plan.input_bytes()
                    )
                };
                let needed = usize::try_from(plan.memory_bytes()).unwrap_or(usize::MAX);
                Some(
                    memory
                        .reserve(needed, what, wait_until)
                        .await
                        .map_err(|error| Status::resource_exhausted(error.to_string()))?,
                )
            }
            None => None,
        };
        // XProf's trace viewer asks for what it shows by resolution and
        // window: what a cut leaves out is its own choice, not news. What
        // decoding takes is drawn as the traces are read: their sizes say
        // little of it.
        let (output, memory) = tokio::task::spawn_blocking(move || {
            let mut memory = memory;
            let computed = match memory.as_mut() {
                Some(memory) => plan.run_within(&directory, &mut ReadingMemory(memory)),
                None => plan.run(&directory),
            };
            computed
                .map(|computed| (computed.output, memory))
                .map_err(tool_status)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        // Sent from the output itself by `FramedRepliesLayer`, not copied
        // into a buffer of tonic's.
        let mut response = Response::new(ProfileSessionDataResponse::default());
        let format = output.format();
        let mut output = output.into_bytes();
        // Held as long as it is sent: no spare capacity with it.
        output.shrink_to_fit();
        let size = output.len();
        let reply = FramedReply::session_data(format, output.into());
        match memory {
            Some(mut memory) => {
                // The tool's work is done: only its output is held now.
                memory.keep_only(size);
                reply.keeping(Arc::new(memory))
            }
            None => reply,
        }
        .attach(&mut response);
        Ok(response)
    }
}
