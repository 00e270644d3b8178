//! Replies to a capture: the built trace delivered the way the request
//! asked (inline XSpace, a file the agent writes under an allowed root, or
//! tool data for the client to write), as Riegeli chunks when it is too
//! large for one message, and what the client is told when it cannot have
//! it at all.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tonic::{Response, Status};
use tracing::{debug, info};

use super::ProfilerService;
use crate::capture::write::{session_taken, write_trace};
use crate::capture::{CaptureError, Plan};
use crate::proto::tensorflow::ProfileResponse;
use crate::protocol::{RIEGELI_TOOL, XPLANE_TOOL};
use crate::recorder::Window;
use crate::repository::{Folder, StorageError, XPLANE_SUFFIX};
use crate::service::framed_reply::FramedReply;
use crate::xspace::chunks::RIEGELI_SUFFIX;
use crate::xspace::{self, Encoded};

impl ProfilerService {
    /// Delivers the built trace of `window` the way the request asked:
    /// inline XSpace, a file under an allowed root, or `tool_data` for the
    /// client to write. A trace the agent fails to write goes to the client
    /// instead, saying why. A trace over `--chunk-traces-over` goes as
    /// Riegeli chunks ([`Self::respond_chunked`]).
    pub(super) async fn respond(
        &self,
        plan: &Plan,
        window: Window,
        encoded: Arc<Encoded>,
        deadline: Instant,
    ) -> Result<Response<ProfileResponse>, Status> {
        if encoded.len() > self.config.chunk_traces_over {
            return self
                .respond_chunked(
                    plan,
                    window,
                    encoded,
                    plan.emit_xspace && !plan.takes_chunks,
                    deadline,
                )
                .await;
        }
        let empty_trace = encoded.events == 0;
        if plan.emit_xspace {
            return Ok(framed(
                FramedReply::xspace(encoded.parts(), empty_trace),
                encoded,
            ));
        }
        let mut encoded = encoded;
        if let Some(root) = self.server_side_root(plan) {
            let written;
            (written, encoded) = write_trace(root, plan, XPLANE_SUFFIX, encoded).await?;
            match written {
                Ok(_) => return Ok(Response::new(written_reply(empty_trace))),
                Err(error) => {
                    refuse_taken(plan, &error)?;
                    encoded = with_warnings(encoded, &[unwritten_warning(&error)]);
                }
            }
        }
        Ok(framed(frame_trace(&encoded), encoded))
    }

    /// Delivers a trace too large for one message (over
    /// `--chunk-traces-over`) as Riegeli chunks of XSpace: written as
    /// `<host>.xplane.riegeli` where the agent writes traces, else returned
    /// as `xplane.riegeli` tool data when the file is within the limit. A
    /// client that needs the XSpace itself (`needs_xspace`: emit_xspace,
    /// GetSnapshot), or whose trace is too large even chunked, gets
    /// RESOURCE_EXHAUSTED saying where the trace was written, or how to
    /// get it.
    pub(super) async fn respond_chunked(
        &self,
        plan: &Plan,
        window: Window,
        encoded: Arc<Encoded>,
        needs_xspace: bool,
        deadline: Instant,
    ) -> Result<Response<ProfileResponse>, Status> {
        let limit = self.config.chunk_traces_over;
        let size = encoded.len();
        let empty_trace = encoded.events == 0;
        let (mut chunked, memory) = self.captures.chunk(encoded, deadline).await?;
        info!(
            bytes = size,
            chunks = chunked.chunks(),
            file_bytes = chunked.bytes().len(),
            "trace over --chunk-traces-over stored as Riegeli chunks"
        );
        let mut not_written = None;
        // A session's fan-out writes the chunks it is sent into the session
        // itself.
        let server_side = (!plan.takes_chunks)
            .then(|| self.server_side_root(plan))
            .flatten();
        if let Some(root) = server_side {
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
                Ok(_) => return Ok(Response::new(written_reply(empty_trace))),
                Err(error) => {
                    refuse_taken(plan, &error)?;
                    not_written = Some(error)
                }
            }
        }
        if !needs_xspace && chunked.bytes().len() <= limit {
            if let Some(error) = &not_written {
                chunked
                    .append_warning(&unwritten_warning(error))
                    .map_err(|e| Status::from(CaptureError::Chunk(e.to_string())))?;
            }
            // Sent from the file itself, its memory held until it is out.
            let file = Bytes::from(chunked.into_bytes());
            let mut response = Response::new(ProfileResponse::default());
            FramedReply::tool_data(RIEGELI_TOOL, &[file], empty_trace)
                .keeping(Arc::new(memory))
                .attach(&mut response);
            return Ok(response);
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

    /// Refuses, before its window, a capture into a client's own session
    /// that holds this host's trace already, or that another capture in
    /// progress will write this host's trace into: it could only be
    /// refused after ([`refuse_taken`]), or, returned for the client to
    /// write, replace the one there. What it returns holds the session's
    /// file for this capture until it is dropped.
    pub(super) async fn refuse_a_held_session(
        &self,
        plan: &Plan,
    ) -> Result<Option<SessionClaim<'_>>, Status> {
        if plan.generated_session_id || plan.emit_xspace {
            return Ok(None);
        }
        let Some(root) = self.server_side_root(plan) else {
            return Ok(None);
        };
        let session = root.join(&plan.session_id);
        let file = format!("{}/{}", session.display(), plan.file_host);
        // Claimed before the session is looked into: a capture that ends
        // meanwhile has written its trace by the time it gives the claim up.
        if !self.claimed.lock().insert(file.clone()) {
            return Err(held_session(
                plan,
                "another capture in progress writes it there",
            ));
        }
        let claim = SessionClaim {
            service: self,
            file,
        };
        let hosts = [plan.file_host.clone()];
        let held = tokio::task::spawn_blocking(move || crate::fleet::held_traces(&session, &hosts))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        match held.first() {
            Some(file) => Err(held_session(plan, file)),
            None => Ok(Some(claim)),
        }
    }

    /// The repository root to write into, when the request's lies inside an
    /// allowed root; otherwise the trace goes inline.
    pub(super) fn server_side_root(&self, plan: &Plan) -> Option<Folder> {
        if plan.repository_root.is_empty() || self.config.allowed_roots.is_empty() {
            return None;
        }
        let root = match self.config.allowed_roots.confine(&plan.repository_root) {
            Ok(root) => root,
            // The usual case, not news: a client that writes the trace
            // itself names its own logdir, outside this host's roots.
            Err(reason) => {
                debug!(%reason, "repository_root outside --allow-root; returning the trace inline");
                return None;
            }
        };
        // Written with the caller's rights: what it could not write there
        // itself is not written for it.
        // A trace of the whole host is not for other users; one of a
        // user's own processes is as open as the agent's umask makes it.
        let root = root
            .acting_for(&plan.caller)
            .and_then(|root| match plan.scope {
                crate::model::scope::Scope::Host => root.kept_from_others(),
                crate::model::scope::Scope::User { .. } => Ok(root),
            });
        match root {
            Ok(root) => Some(root),
            Err(reason) => {
                info!(%reason, caller = %plan.caller, "repository_root not open to the caller; returning the trace inline");
                None
            }
        }
    }
}

/// A trace file of a client's own session that a capture in progress will
/// write; given up when dropped, however the capture ends.
pub(super) struct SessionClaim<'s> {
    service: &'s ProfilerService,
    file: String,
}

impl Drop for SessionClaim<'_> {
    fn drop(&mut self) {
        self.service.claimed.lock().remove(&self.file);
    }
}

/// The reply sending `reply`, framed from `encoded`'s own parts by
/// `FramedRepliesLayer`: the trace (and its share of capture memory) is
/// kept until they are out.
pub(super) fn framed(reply: FramedReply, encoded: Arc<Encoded>) -> Response<ProfileResponse> {
    let mut response = Response::new(ProfileResponse::default());
    reply
        .keeping(encoded as Arc<dyn std::any::Any + Send + Sync>)
        .attach(&mut response);
    response
}

/// A trace with `warnings` added: the same trace when there are none, else
/// one sharing its parts and adding one.
pub(super) fn with_warnings(encoded: Arc<Encoded>, warnings: &[String]) -> Arc<Encoded> {
    if warnings.is_empty() {
        return encoded;
    }
    let mut own = Arc::unwrap_or_clone(encoded);
    for warning in warnings {
        xspace::append_warning(&mut own, warning);
    }
    Arc::new(own)
}

/// A client's own session found holding this host's trace as the trace
/// was written: ALREADY_EXISTS, as NewSession answers, rather than the
/// trace returned inline, which TensorFlow's client would write over the
/// one there. (A generated session name moves on to a free one instead.)
fn refuse_taken(plan: &Plan, error: &StorageError) -> Result<(), Status> {
    if session_taken(plan, error) {
        return Err(held_session(plan, &error.to_string()));
    }
    Ok(())
}

fn held_session(plan: &Plan, held: &str) -> Status {
    Status::already_exists(format!(
        "session_id: session {} holds a trace of {} already ({held}); no trace replaces \
         another: name another session, or leave session_id empty for a new one",
        plan.session_id, plan.file_host
    ))
}

/// The reply to a capture whose trace the agent wrote itself.
fn written_reply(empty_trace: bool) -> ProfileResponse {
    ProfileResponse {
        tool_data: Vec::new(),
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
pub(super) fn unwritten_warning(error: &StorageError) -> String {
    format!(
        "the agent could not write this trace under repository_root ({error}); \
         it was returned to the client instead"
    )
}
