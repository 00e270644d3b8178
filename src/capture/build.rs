//! Building a capture's trace: the flight recorder's window, with what its
//! upstreams (in-process profiler servers) and per-capture sources recorded
//! over the same window merged in, encoded as one XSpace.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tracing::info;

use super::memory::{self, BuildMemory};
use super::scope::Visibility;
use super::{CaptureError, Captures, Plan};
use crate::backend::{CaptureEnd, Scope};
use crate::clock;
use crate::fleet;
use crate::proto::tensorflow::profiler::XSpace;
use crate::protocol::{client, via};
use crate::recorder::Window;
use crate::xspace::{self, CaptureInfo, Encoded, Grant};

impl Captures {
    /// Builds the trace of `window` from the flight recorder alone (a
    /// snapshot of the past: live-only sources cannot serve it), after its
    /// events have all arrived, encoding it off the async runtime.
    pub async fn build(
        &self,
        plan: &Plan,
        window: Window,
        deadline: Instant,
    ) -> Result<Encoded, CaptureError> {
        self.build_with(plan, window, Remote::none(window), deadline)
            .await
    }

    /// Starts capturing every upstream and per-capture source over the
    /// plan's window: each is called when the window starts (at once when it
    /// has), so that it records that window and not the one after it. An
    /// upstream has until the window's end plus [`upstream_grace`] to
    /// answer, and never past `answer_by` (when the caller needs its reply):
    /// a late or silent one makes the trace partial, not the capture fail.
    pub fn start_remote(&self, plan: &Plan, answer_by: Instant) -> Remote {
        // Whose processes upstreams and libtpu record is not known: a trace
        // scoped to one user goes without them (and says so).
        let scoped = plan.scope != Scope::Host;
        let upstreams: &[client::Target] = if scoped {
            &[]
        } else {
            &self.settings.upstreams
        };
        let window = plan.window;
        let end = CaptureEnd::at(window.stop_ns);
        let duration = Duration::from_nanos(window.duration_ns());
        let upstream_by =
            (Instant::now() + clock::until(window.stop_ns) + upstream_grace(duration))
                .min(answer_by);
        let mut upstream_calls = tokio::task::JoinSet::new();
        for upstream in upstreams {
            let options =
                client::default_profile_options(duration.as_millis() as u64, window.start_ns);
            let name = upstream.to_string();
            let mut request = client::trace_request(options, "", &plan.session_id, &name);
            request.emit_xspace = true;
            let upstream = upstream.clone();
            let mut config = self.settings.client.clone();
            config.via = via::onwards(&plan.via, via::this_agent());
            let memory = Arc::clone(&self.memory);
            upstream_calls.spawn(async move {
                // Servers that record from the moment they are asked (TensorFlow's,
                // JAX's) are asked when the window starts; a devtrace upstream
                // would also wait for the start itself.
                tokio::time::sleep(clock::until(window.start_ns)).await;
                let timeout = upstream_by.saturating_duration_since(Instant::now());
                call_upstream(&upstream, request, timeout, config, &memory, name).await
            });
        }
        let mut source_calls = tokio::task::JoinSet::new();
        let sources = if scoped {
            Vec::new()
        } else {
            self.agent.session_sources()
        };
        for source in sources {
            let options = plan.options.clone();
            let end = end.clone();
            source_calls.spawn_blocking(move || {
                let result = source.capture(window, &options, &end);
                (source.name().to_string(), result)
            });
        }
        Remote {
            upstreams: upstreams.to_vec(),
            client: self.settings.client.clone(),
            upstream_calls,
            source_calls,
            end,
        }
    }

    /// How many upstreams and per-capture sources a capture of `plan`
    /// calls besides the flight recorder.
    pub(super) fn remote_sources(&self, plan: &Plan) -> usize {
        match plan.scope {
            Scope::Host => self.settings.upstreams.len() + self.agent.session_sources().len(),
            Scope::User { .. } => 0,
        }
    }

    /// As [`Self::build`], with what `remote` recorded over the same window
    /// merged in. An upstream that fails, is slow or recorded another window
    /// makes the trace partial (the reason is in its errors), never failed.
    ///
    /// Memory comes from `--capture-memory` ([`super::memory`]): once the
    /// window's events are in, the build reserves what they are expected to
    /// take (waiting for other captures until `deadline`), draws more as it
    /// grows, and the trace keeps its own bytes' worth until dropped.
    pub async fn build_with(
        &self,
        plan: &Plan,
        window: Window,
        mut remote: Remote,
        deadline: Instant,
    ) -> Result<Encoded, CaptureError> {
        let local = self.agent.collect(window, Some(plan.scope)).await;
        let upstream_calls = std::mem::take(&mut remote.upstream_calls);
        let source_calls = std::mem::take(&mut remote.source_calls);
        let mut remote = Vec::new();
        // What the upstreams' replies hold, until the build is done.
        let mut replies_held = Vec::new();
        for (name, result, held) in upstream_calls.join_all().await {
            remote.push((name, result));
            replies_held.extend(held);
        }
        remote.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, result) in source_calls.join_all().await {
            remote.push((name, result.map(|trace| Some(trace.into()))));
        }
        let (data, registry) = local.map_err(|e| CaptureError::Collect(e.to_string()))?;
        let events = data.held();
        // Other servers' traces are decoded into messages to be merged in:
        // by what they decode to when that is more than the usual multiple
        // of their size (a few bytes of protobuf can stand for far more).
        // One that would take more than its share is left out, as a failed
        // upstream: the capture is partial, not failed.
        let most_for_one = self.memory.budget() / 2;
        let mut decoding_theirs = 0usize;
        for (_, result) in remote.iter_mut() {
            let Ok(Some(bytes)) = result else { continue };
            let usual = bytes.len().saturating_mul(MERGE_BYTES_PER_ENCODED_BYTE);
            let decoded = crate::xspace::footprint::decoded_bytes(bytes).unwrap_or(0);
            let needed = usual.max(usize::try_from(decoded).unwrap_or(usize::MAX));
            if needed > most_for_one {
                *result = Err(format!(
                    "its trace of {} bytes decodes to {decoded} bytes, more than one upstream's \
                     share of --capture-memory ({most_for_one} bytes, half of it): left out",
                    bytes.len()
                ));
                continue;
            }
            decoding_theirs = decoding_theirs.saturating_add(needed);
        }
        // A build that may spill reserves at most a share of the budget for
        // its trace: past it, its finished blocks go to the spill.
        let mut trace_expected = events.saturating_mul(memory::EXPECTED_BYTES_PER_EVENT);
        if self.memory.spill().is_some() {
            trace_expected = trace_expected.min(self.memory.budget() / SPILLING_SHARE);
        }
        let expected = data.chunk_bytes() + trace_expected + decoding_theirs + BUILD_OVERHEAD_BYTES;
        let what = || format!("this window holds {events} events, and building its trace");
        let mut memory = self
            .memory
            .reserve_as(plan.memory_owner.as_ref(), expected, what, deadline)
            .await?;
        // The window's chunks live as long as the build, evicted or not.
        memory.take(data.chunk_bytes())?;
        memory.take(decoding_theirs)?;
        let mut warnings = plan.warnings.clone();
        warnings.extend(memory.wait_note());
        // A backend that was asked for and could not run leaves a gap the
        // trace should admit to.
        for (name, reason) in self.agent.unavailable_backends() {
            warnings.push(format!("backend {name} is not running: {reason}"));
        }
        for (backend, text) in self.agent.notices(window, plan.scope) {
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
            // Which bound cut it, so that the right flag is raised.
            let why = if data.evicted_for_size {
                "earlier events were evicted to keep the flight recorder within --store-size \
                 (at this event rate it holds less than --store-retention)"
            } else {
                "earlier events were evicted or never recorded (--store-retention bounds how \
                 far back a window can reach)"
            };
            warnings.push(if history >= window.stop_ns {
                format!(
                    "the flight recorder holds nothing of this window: its oldest event is \
                     {:.3} s after the window's end; {why}",
                    history.saturating_sub(window.stop_ns) as f64 / 1e9
                )
            } else {
                format!(
                    "the flight recorder holds nothing before {:.3} s into the window; {why}",
                    history.saturating_sub(window.start_ns) as f64 / 1e9
                )
            });
        }
        let mut errors = Vec::new();
        let mut merged = Vec::new();
        let mut properties = self.agent.properties(window, plan.scope);
        let visibility = Visibility::of(plan.scope, &self.agent.process_lines(window));
        if let Scope::User { uid } = plan.scope {
            properties.push(("devtrace_scope".into(), format!("uid {uid}")));
        }
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
            hostname: self.settings.hostname.clone(),
            profile_options: plan.options.clone(),
            dropped_newest: data.dropped_newest,
            dropped_oldest: data.dropped_oldest,
            dropped_before_ring,
            warnings,
            errors,
            properties,
        };
        let built = tokio::task::spawn_blocking(move || {
            let runs = data
                .runs()
                .into_iter()
                .map(|(key, run)| {
                    let visible = |event: &crate::event::Event| {
                        visibility.as_ref().is_none_or(|v| v.keeps(event))
                    };
                    (key, run.filter(visible))
                })
                .collect();
            let mut encoded = xspace::encode_runs(runs, &registry, &info, &mut memory)?;
            if let Some(visibility) = &visibility {
                xspace::append_warning(&mut encoded, &visibility.summary());
            }
            memory.let_go(data.chunk_bytes());
            drop(data);
            let encoded = merge_upstreams(encoded, merged, &mut memory)?;
            memory.keep_only(encoded.retained());
            Ok(encoded.accounted_by(Arc::new(memory)))
        })
        .await
        .map_err(|e| CaptureError::Build(e.to_string()))?;
        drop(replies_held);
        built
    }
}

/// How long past its window's end an upstream may take to answer: its own
/// build and the transfer, 5 s and a quarter of the window, at most a
/// minute.
pub fn upstream_grace(window: Duration) -> Duration {
    (Duration::from_secs(5) + window / 4).min(Duration::from_secs(60))
}

/// A build that may spill reserves at most this fraction of the budget for
/// its trace to begin with.
const SPILLING_SHARE: usize = 4;

/// What a build holds besides its events' bytes: each plane's metadata, the
/// space's own fields, the merge's bookkeeping.
const BUILD_OVERHEAD_BYTES: usize = 256 << 10;

/// How many bytes a decoded XSpace and its re-encoding take per encoded
/// byte, at most: merging upstream traces decodes ours and theirs into
/// messages and encodes the result anew.
const MERGE_BYTES_PER_ENCODED_BYTE: usize = 6;

/// `encoded` with the upstream traces `merged` into it, drawing what the
/// merge takes from `memory`. When it cannot have that, the trace goes
/// without them and says so.
fn merge_upstreams(
    encoded: Encoded,
    merged: Vec<(String, XSpace)>,
    memory: &mut BuildMemory,
) -> Result<Encoded, CaptureError> {
    if merged.is_empty() {
        return Ok(encoded);
    }
    // Theirs were counted when they were decoded; ours is decoded now.
    let needed = encoded.len().saturating_mul(MERGE_BYTES_PER_ENCODED_BYTE);
    if let Err(refused) = memory.take(needed) {
        let names: Vec<&str> = merged.iter().map(|(name, _)| name.as_str()).collect();
        let mut encoded = encoded;
        xspace::append_warning(
            &mut encoded,
            &format!(
                "upstream traces left out ({}): merging them needs {needed} bytes of capture \
                 memory: {refused}",
                names.join(", ")
            ),
        );
        return Ok(encoded);
    }
    let mut space = XSpace::decode(encoded.contiguous()).map_err(CaptureError::Merge)?;
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
}

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
    if offset > i128::from(xspace::read::RECORDING_START_SLACK_NS) {
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

/// One upstream's address and its trace (`None`: empty), or why not, with
/// the capture memory its reply holds.
type UpstreamOutcome = (
    String,
    Result<Option<bytes::Bytes>, String>,
    Option<BuildMemory>,
);

/// How long an upstream's call waits for capture memory to receive its
/// reply into: not longer, or it would record a later window than asked.
const UPSTREAM_MEMORY_WAIT: Duration = Duration::from_secs(1);

/// The most one upstream's reply may hold of a capture budget of `budget`
/// bytes, within `max_reply_bytes`: its bytes are held from the moment
/// they arrive, before the build knows how large they are.
pub(crate) fn upstream_reply_share(max_reply_bytes: usize, budget: usize) -> usize {
    max_reply_bytes.min(budget / 4).max(1)
}

/// Calls one upstream for its trace, with the bytes its reply may hold
/// reserved from `memory` first and the reply held to them; what the reply
/// did not need goes back at once.
async fn call_upstream(
    upstream: &client::Target,
    request: crate::proto::tensorflow::ProfileRequest,
    deadline: Duration,
    mut config: client::ClientConfig,
    memory: &memory::CaptureMemory,
    name: String,
) -> UpstreamOutcome {
    let share = upstream_reply_share(config.max_reply_bytes, memory.budget());
    let what = || format!("a reply of up to {share} bytes from upstream {name}");
    let mut held = match memory
        .reserve(share, what, Instant::now() + UPSTREAM_MEMORY_WAIT)
        .await
    {
        Ok(held) => held,
        Err(refused) => return (name, Err(format!("not asked: {refused}")), None),
    };
    let narrowed = share < config.max_reply_bytes;
    config.max_reply_bytes = share;
    let result = fleet::capture_host(upstream, request, deadline, &config)
        .await
        .map_err(|error| {
            if narrowed {
                error.replace(
                    "is more than --max-reply-size allows",
                    "is more than an upstream's share of --capture-memory (a quarter, within \
                     --max-reply-size) allows",
                )
            } else {
                error
            }
        });
    let received = result
        .as_ref()
        .ok()
        .and_then(Option::as_ref)
        .map_or(0, |b| b.len());
    held.keep_only(received);
    (name, result, Some(held))
}
/// One per-capture source's name and its trace, or why not.
type SourceOutcome = (String, Result<Vec<u8>, String>);

/// What records a capture besides the flight recorder: its upstreams' calls
/// and its per-capture sources, and when they should stop.
pub struct Remote {
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
    pub fn end_early(&self, session_id: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::timeline::{stat, TASK_ENVIRONMENT_PLANE};
    use crate::proto::tensorflow::profiler::{x_stat, XPlane, XStat, XStatMetadata};

    /// A trace whose Task Environment says it started at `start_ns`.
    fn started_at(start_ns: u64) -> XSpace {
        let mut plane = XPlane {
            name: TASK_ENVIRONMENT_PLANE.to_string(),
            ..XPlane::default()
        };
        plane.stat_metadata.insert(
            1,
            XStatMetadata {
                id: 1,
                name: stat::PROFILE_START_TIME.to_string(),
                ..XStatMetadata::default()
            },
        );
        plane.stats.push(XStat {
            metadata_id: 1,
            value: Some(x_stat::Value::Uint64Value(start_ns)),
        });
        XSpace {
            planes: vec![plane],
            ..XSpace::default()
        }
    }

    const WINDOW: Window = Window {
        start_ns: 10_000_000_000,
        stop_ns: 11_000_000_000,
    };

    #[test]
    fn an_upstream_that_started_within_the_calls_latency_recorded_the_window() {
        let late = WINDOW.start_ns + xspace::read::RECORDING_START_SLACK_NS;
        assert_eq!(
            upstream_start(&started_at(late), WINDOW),
            Ok(Some(xspace::read::RECORDING_START_SLACK_NS as i64))
        );
        // Early (a clock behind ours) is their offset, not a refusal.
        assert_eq!(
            upstream_start(&started_at(WINDOW.start_ns - 3), WINDOW),
            Ok(Some(-3))
        );
    }

    #[test]
    fn an_upstream_that_started_later_recorded_another_window() {
        let late = WINDOW.start_ns + xspace::read::RECORDING_START_SLACK_NS + 1;
        let refused = upstream_start(&started_at(late), WINDOW).unwrap_err();
        assert!(refused.contains("not the window itself"), "{refused}");
    }

    #[test]
    fn an_upstream_that_reports_no_start_is_taken_as_it_is() {
        assert_eq!(upstream_start(&XSpace::default(), WINDOW), Ok(None));
    }
}
