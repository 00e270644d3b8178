//! Captures: a planned window of the flight recorder turned into a trace and
//! kept. Everything between a validated request and its reply lives here:
//! admission (a build shared by captures of the same window, and the
//! `--capture-memory` budget it reserves), the build itself with upstreams
//! and per-capture sources merged in ([`build`]), and writing the trace into
//! a repository ([`write`]). The RPC services ([`crate::service`]) and the
//! triggers ([`crate::trigger`]) both capture through [`Captures`]; neither
//! knows the other.

mod build;
pub mod memory;
mod plan;
pub mod scope;
pub mod shared_builds;
pub mod spill;
pub mod write;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use build::{upstream_grace, Remote};
pub use plan::Plan;

use crate::agent::Agent;
use crate::protocol::client;
use crate::recorder::Window;
use crate::repository::{Folder, StorageError, XPLANE_SUFFIX};
use crate::xspace::chunks::RIEGELI_SUFFIX;
use crate::xspace::Encoded;
use memory::{CaptureMemory, MemoryError, DEFAULT_CAPTURE_MEMORY};
use shared_builds::{BuildKey, SharedBuilds, Slot};

/// Traces larger than this are stored as Riegeli chunks unless configured
/// otherwise: well below protobuf's 2 GiB, so that replies that still carry
/// one message stay readable by every client.
pub const DEFAULT_CHUNK_TRACES_OVER: usize = 1 << 30;

/// Why a capture produced no trace.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// Its build got no capture memory, or not enough.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("{0}")]
    Collect(String),
    #[error("building the trace failed: {0}")]
    Build(String),
    #[error("merging upstream traces failed: {0}")]
    Merge(prost::DecodeError),
    #[error("storing the trace as Riegeli chunks failed: {0}")]
    Chunk(String),
    #[error("writing the trace failed: {0}")]
    Write(String),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// The operator's settings that shape every capture's trace.
#[derive(Clone, Debug)]
pub struct CaptureSettings {
    /// Name of this host, recorded in every trace.
    pub hostname: String,
    /// In-process profiler servers whose traces every capture of the
    /// present folds in.
    pub upstreams: Vec<client::Target>,
    /// How upstreams are called: TLS, and the largest reply accepted.
    pub client: client::ClientConfig,
    /// Size of an encoded trace above which it is stored as Riegeli chunks
    /// (`<host>.xplane.riegeli`) instead of one XSpace message.
    pub chunk_traces_over: usize,
    /// Budget for traces being built and replied at once
    /// (`--capture-memory`).
    pub capture_memory: usize,
    /// Where traces that outgrow their share of it go while they are built
    /// (`--spill-dir`, `--spill-size`); none: such a trace is refused.
    pub spill: Option<Arc<spill::SpillSpace>>,
}

impl Default for CaptureSettings {
    fn default() -> Self {
        CaptureSettings {
            hostname: local_hostname(),
            upstreams: Vec::new(),
            client: client::ClientConfig::default(),
            chunk_traces_over: DEFAULT_CHUNK_TRACES_OVER,
            capture_memory: DEFAULT_CAPTURE_MEMORY,
            spill: None,
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

/// A capture admitted to build: the slot its trace is built in, shared
/// with the captures of the same window when it can be.
pub struct Admission {
    pub slot: Arc<Slot>,
}

/// How long a trigger's save waits for capture memory that other captures
/// hold.
const SAVE_MEMORY_WAIT: Duration = Duration::from_secs(60);

/// How long storing a built trace as Riegeli chunks waits for capture
/// memory that other captures hold, at most.
const CHUNK_MEMORY_WAIT: Duration = Duration::from_secs(10);

impl crate::telemetry::BudgetUse for Captures {
    fn held_bytes(&self) -> u64 {
        self.memory_held()
    }

    fn spill_bytes(&self) -> Option<(u64, u64)> {
        let space = self.memory.spill()?;
        Some((space.used(), space.limit()))
    }
}

/// See the module documentation.
pub struct Captures {
    agent: Arc<Agent>,
    settings: CaptureSettings,
    shared_builds: SharedBuilds,
    memory: Arc<CaptureMemory>,
}

impl Captures {
    pub fn new(agent: Arc<Agent>, settings: CaptureSettings) -> Captures {
        Captures {
            agent,
            memory: Arc::new(match &settings.spill {
                Some(space) => {
                    CaptureMemory::new(settings.capture_memory).with_spill(Arc::clone(space))
                }
                None => CaptureMemory::new(settings.capture_memory),
            }),
            settings,
            shared_builds: SharedBuilds::default(),
        }
    }

    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    pub fn settings(&self) -> &CaptureSettings {
        &self.settings
    }

    /// The capture-memory budget, which tool requests on stored sessions
    /// draw from too.
    pub fn memory(&self) -> Arc<CaptureMemory> {
        Arc::clone(&self.memory)
    }

    /// The capture-memory budget, in bytes.
    pub fn memory_budget(&self) -> usize {
        self.memory.budget()
    }

    /// Bytes of the capture-memory budget reserved now.
    pub fn memory_held(&self) -> u64 {
        self.memory.held()
    }

    /// Traces built, and captures that replied from another's build.
    pub fn build_counts(&self) -> (u64, u64) {
        self.shared_builds.counts()
    }

    /// Admits a capture of the plan's window: joins the build of captures
    /// of the same window (on arrival, so that captures arriving during the
    /// window find each other however late each one wakes at its end).
    /// Captures with upstreams or per-capture sources record their own and
    /// share nothing. Memory is reserved by the build, once the window's
    /// events are in ([`Self::build_with`]).
    pub fn admit(&self, plan: &Plan) -> Admission {
        let shared = self.remote_sources(plan) == 0;
        let slot = if shared {
            let key = BuildKey::new(
                plan.window,
                &plan.options,
                &plan.losses_at_start,
                plan.scope,
            );
            self.shared_builds.join(key)
        } else {
            Arc::new(Slot::default())
        };
        Admission { slot }
    }

    /// The trace of `window` with `remote` merged in: built in the
    /// admission's slot, or the build another capture made there. A capture
    /// that `ended_early` (its window cut short) builds a trace of its own.
    /// Its build waits for capture memory until `deadline` at most.
    pub async fn build_admitted(
        &self,
        admission: &Admission,
        plan: &Plan,
        window: Window,
        remote: Remote,
        ended_early: bool,
        deadline: Instant,
    ) -> Result<Arc<Encoded>, CaptureError> {
        let build = self.build_with(plan, window, remote, deadline);
        if ended_early {
            return Ok(Arc::new(build.await?));
        }
        self.shared_builds
            .get_or_build(&admission.slot, build)
            .await
    }

    /// `encoded` as Riegeli chunks of at most `--chunk-traces-over` bytes,
    /// with what that takes besides the trace (the trace in one buffer, the
    /// file, a chunk) drawn from `--capture-memory` first; the share
    /// returned holds the file's size until dropped. The trace's own share
    /// is held meanwhile, so this waits for others' at most
    /// [`CHUNK_MEMORY_WAIT`] (or until `deadline`), never for its own.
    pub async fn chunk(
        &self,
        encoded: Arc<Encoded>,
        deadline: Instant,
    ) -> Result<(write::ChunkedTrace, memory::BuildMemory), CaptureError> {
        let limit = self.settings.chunk_traces_over;
        let size = encoded.len();
        let needed = size.saturating_mul(2).saturating_add(limit.min(size));
        let what = || format!("storing this {size}-byte trace as Riegeli chunks");
        let with_trace = needed.saturating_add(size);
        if with_trace > self.memory.budget() {
            return Err(MemoryError::TooLarge {
                what: format!("{} (with the trace itself)", what()),
                needed: with_trace,
                allowed: format!("all of --capture-memory ({} bytes)", self.memory.budget()),
            }
            .into());
        }
        let deadline = deadline.min(Instant::now() + CHUNK_MEMORY_WAIT);
        let mut memory = self.memory.reserve(needed, what, deadline).await?;
        let chunked = write::chunk_trace(encoded, limit).await?;
        memory.keep_only(chunked.bytes().len());
        Ok((chunked, memory))
    }

    /// Builds the trace of `window` from the flight recorder and writes it
    /// into session `session_id` of `root`, one the caller made for it
    /// ([`Folder::create_session`]), `properties` in its Task Environment:
    /// how a trigger saves the past. Where it went.
    pub async fn save_window(
        &self,
        window: Window,
        session_id: &str,
        properties: Vec<(String, String)>,
        root: Result<Folder, String>,
        unsent_dir: &std::path::Path,
    ) -> Result<String, CaptureError> {
        let plan = Plan::save(
            window,
            session_id,
            &self.settings.hostname,
            properties,
            self.agent.losses(),
        );
        let deadline = Instant::now() + SAVE_MEMORY_WAIT;
        let encoded = self.build(&plan, window, deadline).await?;
        // Stored without a log line of its own: the trigger logs the save.
        // One that cannot be written (nor its session made: `root` says
        // why) is kept under `unsent_dir`, as a session's trace is: a
        // firing's window is gone from the flight recorder soon after.
        let (error, suffix, bytes) = if encoded.len() > self.settings.chunk_traces_over {
            let (chunked, _memory) = self.chunk(Arc::new(encoded), deadline).await?;
            let (error, chunked) = match root {
                Ok(root) => match write::store_trace(root, &plan, RIEGELI_SUFFIX, chunked).await? {
                    (Ok(path), _) => return Ok(path),
                    (Err(error), chunked) => (error.to_string(), chunked),
                },
                Err(why) => (why, chunked),
            };
            let bytes = bytes::Bytes::copy_from_slice(chunked.bytes());
            (error, RIEGELI_SUFFIX, bytes)
        } else {
            let encoded = Arc::new(encoded);
            let error = match root {
                Ok(root) => {
                    match write::store_trace(root, &plan, XPLANE_SUFFIX, Arc::clone(&encoded))
                        .await?
                    {
                        (Ok(path), _) => return Ok(path),
                        (Err(error), _) => error.to_string(),
                    }
                }
                Err(why) => why,
            };
            (error, XPLANE_SUFFIX, encoded.contiguous())
        };
        let (unsent_dir, session_id) = (unsent_dir.to_path_buf(), session_id.to_string());
        let name = format!("{}{suffix}", plan.file_host);
        let keeping = crate::model::under_way::begin(format!(
            "keeping {name} under {}",
            unsent_dir.display()
        ));
        let kept = tokio::task::spawn_blocking(move || {
            let _keeping = keeping;
            crate::repository::keep_failed_write(
                "saving it",
                &error,
                &unsent_dir,
                &session_id,
                &name,
                &bytes,
            )
        })
        .await
        .map_err(|e| CaptureError::Write(e.to_string()))?;
        Err(CaptureError::Write(kept))
    }
}
