//! Turns the calls the tap forwards into events: one `Rpc` span per call on
//! its client connection's line, a `Step` span per `RunStep`/`RunCallable`
//! (numbered per session handle), and an `EagerOp` span per enqueued remote
//! eager operation, from its request message to the matching response.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use prost::Message;

use crate::clock;
use crate::event::{Device, Event, NameId, Payload, RpcInfo};
use crate::registry::Registry;
use crate::ring::Producer;

use super::decode::{self, Body, Frame, Framer};

/// Tap lines carry this tag in their upper bits, apart from host thread ids.
const LINE_TAG: u64 = 0x7461_7000_0000_0000;
/// Largest message the tap buffers to decode; bigger ones are forwarded and
/// counted as undecoded.
pub const DECODE_LIMIT: usize = 64 << 20;

/// Sessions whose steps are counted at once; a peer that opens sessions and
/// never closes them makes the oldest be forgotten (their numbering starts
/// again), not the agent grow.
const MAX_SESSIONS: usize = 4096;

/// Enqueued batches of one call still waiting for their response.
const MAX_PENDING: usize = 1024;

/// gRPC status codes the tap produces itself.
pub const CANCELLED: u32 = 1;
pub const UNKNOWN: u32 = 2;
pub const UNAVAILABLE: u32 = 14;

/// Counters over everything a tap forwarded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TapStats {
    pub connections: u64,
    pub calls: u64,
    /// Calls that ended with a non-OK status.
    pub failed: u64,
    pub steps: u64,
    pub eager_ops: u64,
    /// Messages forwarded without being decoded.
    pub undecoded: u64,
    pub request_bytes: u64,
    pub response_bytes: u64,
    /// Events the ring refused (full lane).
    pub dropped_events: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    calls: AtomicU64,
    failed: AtomicU64,
    steps: AtomicU64,
    eager_ops: AtomicU64,
    undecoded: AtomicU64,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    dropped_events: AtomicU64,
}

/// Shared by every connection of one or more taps; owns one ring lane.
pub struct Recorder {
    registry: Arc<Registry>,
    producer: Mutex<Producer>,
    steps: Mutex<HashMap<String, i64>>,
    counters: Counters,
}

impl Recorder {
    pub fn new(registry: Arc<Registry>, producer: Producer) -> Arc<Recorder> {
        Arc::new(Recorder {
            registry,
            producer: Mutex::new(producer),
            steps: Mutex::default(),
            counters: Counters::default(),
        })
    }

    /// A new client connection: returns its line, named after both ends.
    pub fn connection(&self, peer: SocketAddr, upstream: &str) -> u64 {
        let number = self.counters.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let line = LINE_TAG | number;
        self.registry.name_line(
            Device::Host,
            line,
            &format!("tap #{number} {peer} -> {upstream}"),
        );
        line
    }

    pub fn stats(&self) -> TapStats {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TapStats {
            connections: load(&c.connections),
            calls: load(&c.calls),
            failed: load(&c.failed),
            steps: load(&c.steps),
            eager_ops: load(&c.eager_ops),
            undecoded: load(&c.undecoded),
            request_bytes: load(&c.request_bytes),
            response_bytes: load(&c.response_bytes),
            dropped_events: load(&c.dropped_events),
        }
    }

    /// Starts recording one call of `path` (`/package.Service/Method`).
    pub fn call(self: &Arc<Self>, line: u64, path: &str) -> Arc<Call> {
        let kind = Kind::of(path);
        let limit = if kind == Kind::Other { 0 } else { DECODE_LIMIT };
        Arc::new(Call {
            recorder: Arc::clone(self),
            line,
            name: self.registry.intern(path.trim_start_matches('/')),
            kind,
            start_ns: clock::now_ns(),
            state: Mutex::new(State {
                request: Framer::new(limit),
                response: Framer::new(limit),
                ..State::default()
            }),
        })
    }

    fn push(&self, events: &[Event]) {
        let accepted = self.producer.lock().push_batch(events);
        let lost = events.len().saturating_sub(accepted);
        if lost > 0 {
            self.counters
                .dropped_events
                .fetch_add(lost as u64, Ordering::Relaxed);
        }
    }

    fn next_step(&self, session: &str) -> i64 {
        let key = session_key(session);
        let mut steps = self.steps.lock();
        if steps.len() >= MAX_SESSIONS && !steps.contains_key(key) {
            if let Some(forgotten) = steps.keys().next().cloned() {
                steps.remove(&forgotten);
            }
        }
        let counter = steps.entry(key.to_owned()).or_insert(0);
        let step = *counter;
        *counter += 1;
        step
    }
}

/// What identifies a session in the step table: handles are opaque strings
/// the peer chooses, so only a bounded prefix.
fn session_key(session: &str) -> &str {
    let mut end = session.len().min(256);
    while !session.is_char_boundary(end) {
        end -= 1;
    }
    &session[..end]
}

/// The methods whose messages the tap decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RunStep,
    RunCallable,
    MakeCallable,
    CreateSession,
    ExtendSession,
    /// Other MasterService calls with the session handle at field 1.
    MasterSession,
    /// Ends a session: its step counter is forgotten.
    CloseSession,
    CreateContext,
    Enqueue,
    WaitQueueDone,
    SendTensor,
    /// Other EagerService calls with the context id at field 1.
    EagerContext,
    Other,
}

impl Kind {
    fn of(path: &str) -> Kind {
        let (service, method) = path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or(("", ""));
        match (service, method) {
            ("tensorflow.MasterService", "RunStep") => Kind::RunStep,
            ("tensorflow.MasterService", "RunCallable") => Kind::RunCallable,
            ("tensorflow.MasterService", "MakeCallable") => Kind::MakeCallable,
            ("tensorflow.MasterService", "CreateSession") => Kind::CreateSession,
            ("tensorflow.MasterService", "ExtendSession") => Kind::ExtendSession,
            ("tensorflow.MasterService", "PartialRunSetup" | "ReleaseCallable") => {
                Kind::MasterSession
            }
            ("tensorflow.MasterService", "CloseSession") => Kind::CloseSession,
            ("tensorflow.eager.EagerService", "CreateContext") => Kind::CreateContext,
            ("tensorflow.eager.EagerService", "Enqueue" | "StreamingEnqueue") => Kind::Enqueue,
            ("tensorflow.eager.EagerService", "WaitQueueDone") => Kind::WaitQueueDone,
            ("tensorflow.eager.EagerService", "SendTensor") => Kind::SendTensor,
            (
                "tensorflow.eager.EagerService",
                "KeepAlive"
                | "CloseContext"
                | "UpdateContext"
                | "RegisterFunction"
                | "CleanupFunction"
                | "RunComponentFunction",
            ) => Kind::EagerContext,
            _ => Kind::Other,
        }
    }
}

struct PendingOp {
    name: NameId,
    op_id: i64,
    device: NameId,
}

#[derive(Default)]
struct State {
    request: Framer,
    response: Framer,
    info: RpcInfo,
    session: String,
    context_id: u64,
    step: Option<i64>,
    fetches: Vec<String>,
    targets: Vec<String>,
    /// Enqueue messages waiting for their response: arrival time and ops.
    pending: VecDeque<(u64, Vec<PendingOp>)>,
    status: Option<u32>,
    /// A failure reported inside an OK response (RunStep).
    body_status: u32,
    finished: bool,
}

/// Which way a message travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// One forwarded call being recorded. Finished exactly once, by whichever
/// comes first: the response's end, an error, or the response being dropped.
pub struct Call {
    recorder: Arc<Recorder>,
    line: u64,
    name: NameId,
    kind: Kind,
    start_ns: u64,
    state: Mutex<State>,
}

impl Call {
    /// A copy of one data frame, in order, for one direction.
    pub fn observe(&self, direction: Direction, data: &Bytes) {
        let mut frames = Vec::new();
        let mut events = Vec::new();
        let mut state = self.state.lock();
        match direction {
            Direction::Request => state.request.push(data, &mut frames),
            Direction::Response => state.response.push(data, &mut frames),
        }
        for frame in frames {
            match frame {
                Frame::Skipped { .. } if self.kind != Kind::Other => {
                    state.info.undecoded = state.info.undecoded.saturating_add(1);
                }
                Frame::Skipped { .. } => {}
                Frame::Message(message) => {
                    let decoded = match direction {
                        Direction::Request => self.request(&mut state, &message),
                        Direction::Response => self.response(&mut state, &message, &mut events),
                    };
                    if !decoded {
                        state.info.undecoded = state.info.undecoded.saturating_add(1);
                    }
                }
            }
        }
        drop(state);
        // Ops of a long-lived StreamingEnqueue are recorded as they complete,
        // not when the stream (the eager context) ends.
        if !events.is_empty() {
            self.recorder.push(&events);
        }
    }

    /// The status the upstream sent (headers of a trailers-only response, or
    /// the trailers).
    pub fn set_status(&self, status: u32) {
        self.state.lock().status = Some(status);
    }

    /// Ends the call: `status` is used when the upstream sent none.
    pub fn finish(&self, status: u32) {
        let end_ns = clock::now_ns();
        let mut state = self.state.lock();
        if state.finished {
            return;
        }
        state.finished = true;
        let mut status = *state.status.get_or_insert(status);
        if status == 0 {
            status = state.body_status;
        }
        let registry = &self.recorder.registry;
        let mut info = state.info;
        info.status = status;
        info.request_bytes = state.request.bytes;
        info.response_bytes = state.response.bytes;
        info.request_messages = state.request.messages;
        info.response_messages = state.response.messages;
        if !state.session.is_empty() {
            info.session = registry.intern(&state.session);
        } else if state.context_id != 0 {
            info.session = registry.intern(&state.context_id.to_string());
        }
        if !state.fetches.is_empty() {
            info.fetches = registry.intern(&state.fetches.join(","));
        }
        if !state.targets.is_empty() {
            info.targets = registry.intern(&state.targets.join(","));
        }
        let duration = end_ns.saturating_sub(self.start_ns);
        let span = |name, payload| {
            Event::new(
                self.start_ns,
                duration,
                Device::Host,
                self.line,
                name,
                payload,
            )
        };
        let mut events = Vec::new();
        if let Some(step_num) = state.step {
            events.push(span(self.name, Payload::Step { step_num }));
        }
        events.push(span(self.name, Payload::Rpc(info)));
        while let Some((start, ops)) = state.pending.pop_front() {
            self.op_events(&mut events, start, end_ns, state.context_id, ops);
        }
        drop(state);
        let c = &self.recorder.counters;
        c.calls.fetch_add(1, Ordering::Relaxed);
        if status != 0 {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
        c.undecoded
            .fetch_add(u64::from(info.undecoded), Ordering::Relaxed);
        c.request_bytes
            .fetch_add(info.request_bytes, Ordering::Relaxed);
        c.response_bytes
            .fetch_add(info.response_bytes, Ordering::Relaxed);
        c.eager_ops
            .fetch_add(u64::from(info.ops_enqueued), Ordering::Relaxed);
        self.recorder.push(&events);
    }

    fn op_events(
        &self,
        events: &mut Vec<Event>,
        start_ns: u64,
        end_ns: u64,
        context_id: u64,
        ops: Vec<PendingOp>,
    ) {
        for op in ops {
            events.push(Event::new(
                start_ns,
                end_ns.saturating_sub(start_ns),
                Device::Host,
                self.line,
                op.name,
                Payload::EagerOp {
                    op_id: op.op_id,
                    device: op.device,
                    context_id,
                },
            ));
        }
    }

    /// Decodes one request message; false when it does not parse.
    fn request(&self, state: &mut State, message: &Body) -> bool {
        let registry = &self.recorder.registry;
        match self.kind {
            Kind::RunStep => {
                let Ok(m) = decode::RunStepRequest::decode(message.buf()) else {
                    return false;
                };
                self.step(state, &m.session_handle);
                state.fetches = m.fetch;
                state.targets = m.target;
            }
            Kind::RunCallable => {
                let Ok(m) = decode::RunCallableRequest::decode(message.buf()) else {
                    return false;
                };
                self.step(state, &m.session_handle);
                state.fetches = vec![format!("callable:{}", m.handle)];
            }
            Kind::MakeCallable => {
                let Ok(m) = decode::MakeCallableRequest::decode(message.buf()) else {
                    return false;
                };
                state.session = m.session_handle;
                if let Some(options) = m.options {
                    state.fetches = options.fetch;
                    state.targets = options.target;
                }
            }
            Kind::CreateSession => {
                let Ok(m) = decode::CreateSessionRequest::decode(message.buf()) else {
                    return false;
                };
                graph(state, &m.graph_def);
            }
            Kind::ExtendSession => {
                let Ok(m) = decode::ExtendSessionRequest::decode(message.buf()) else {
                    return false;
                };
                state.session = m.session_handle;
                graph(state, &m.graph_def);
            }
            Kind::MasterSession => {
                let Ok(m) = decode::SessionHandle::decode(message.buf()) else {
                    return false;
                };
                state.session = m.session_handle;
            }
            Kind::CloseSession => {
                let Ok(m) = decode::SessionHandle::decode(message.buf()) else {
                    return false;
                };
                self.recorder
                    .steps
                    .lock()
                    .remove(session_key(&m.session_handle));
                state.session = m.session_handle;
            }
            Kind::CreateContext => {
                let Ok(m) = decode::CreateContextRequest::decode(message.buf()) else {
                    return false;
                };
                state.context_id = m.context_id;
            }
            Kind::Enqueue => {
                let Ok(m) = decode::EnqueueRequest::decode(message.buf()) else {
                    return false;
                };
                state.context_id = m.context_id;
                let mut ops = Vec::new();
                for item in m.queue {
                    // A streaming call lives as long as its eager context:
                    // its counts saturate rather than wrap.
                    let info = &mut state.info;
                    if item.handle_to_decref.is_some() {
                        info.handles_released = info.handles_released.saturating_add(1);
                    }
                    if let Some(bytes) = item.send_tensor {
                        info.payload_bytes = info.payload_bytes.saturating_add(bytes.len() as u64);
                    }
                    if let Some(op) = item.operation {
                        info.ops_enqueued = info.ops_enqueued.saturating_add(1);
                        ops.push(PendingOp {
                            name: registry.intern(&op.name),
                            op_id: op.id,
                            device: registry.intern(&op.device),
                        });
                    }
                }
                if state.pending.len() >= MAX_PENDING {
                    // Responses that never come: the oldest batch's ops are
                    // recorded without them.
                    if let Some((_, lost)) = state.pending.pop_front() {
                        self.recorder
                            .counters
                            .dropped_events
                            .fetch_add(lost.len() as u64, Ordering::Relaxed);
                    }
                }
                state.pending.push_back((clock::now_ns(), ops));
            }
            Kind::WaitQueueDone => {
                let Ok(m) = decode::WaitQueueDoneRequest::decode(message.buf()) else {
                    return false;
                };
                state.context_id = m.context_id;
                let waited = u32::try_from(m.op_id.len()).unwrap_or(u32::MAX);
                state.info.waited_ops = state.info.waited_ops.saturating_add(waited);
            }
            Kind::SendTensor => {
                let Ok(m) = decode::SendTensorRequest::decode(message.buf()) else {
                    return false;
                };
                state.context_id = m.context_id;
                let tensors = m.tensors.iter().map(|t| t.len() as u64).sum::<u64>();
                state.info.payload_bytes = state.info.payload_bytes.saturating_add(tensors);
            }
            Kind::EagerContext => {
                let Ok(m) = decode::ContextId::decode(message.buf()) else {
                    return false;
                };
                state.context_id = m.context_id;
            }
            Kind::Other => {}
        }
        true
    }

    /// Decodes one response message; false when it does not parse.
    fn response(&self, state: &mut State, message: &Body, events: &mut Vec<Event>) -> bool {
        match self.kind {
            Kind::RunStep => {
                let Ok(m) = decode::RunStepResponse::decode(message.buf()) else {
                    return false;
                };
                state.body_status = u32::try_from(m.status_code).unwrap_or(UNKNOWN);
            }
            Kind::CreateSession => {
                let Ok(m) = decode::SessionHandle::decode(message.buf()) else {
                    return false;
                };
                state.session = m.session_handle;
            }
            Kind::CreateContext => {
                let Ok(m) = decode::ContextId::decode(message.buf()) else {
                    return false;
                };
                if state.context_id == 0 {
                    state.context_id = m.context_id;
                }
            }
            Kind::Enqueue => {
                // One response per request message, in order.
                if let Some((start, ops)) = state.pending.pop_front() {
                    self.op_events(events, start, clock::now_ns(), state.context_id, ops);
                }
            }
            _ => {}
        }
        true
    }

    fn step(&self, state: &mut State, session: &str) {
        state.session = session.to_owned();
        state.step = Some(self.recorder.next_step(session));
        self.recorder.counters.steps.fetch_add(1, Ordering::Relaxed);
    }
}

fn graph(state: &mut State, graph_def: &[u8]) {
    state.info.payload_bytes = graph_def.len() as u64;
    if let Ok(graph) = decode::GraphDef::decode(graph_def) {
        state.info.graph_nodes = graph.node.len() as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_never_closed_do_not_grow_the_step_table() {
        let registry = Registry::new();
        let ring = crate::ring::Ring::new(1, 4, crate::ring::DropPolicy::DropNewest).unwrap();
        let recorder = Recorder::new(registry, ring.producer().unwrap());
        assert_eq!(recorder.next_step("kept"), 0);
        for n in 0..2 * MAX_SESSIONS {
            recorder.next_step(&format!("session {n}"));
        }
        assert_eq!(recorder.steps.lock().len(), MAX_SESSIONS);
        // A long handle is keyed by its prefix.
        let long = "x".repeat(1 << 20);
        assert_eq!(recorder.next_step(&long), 0);
        assert_eq!(recorder.next_step(&long), 1);
        assert!(recorder.steps.lock().keys().all(|k| k.len() <= 256));
    }

    #[test]
    fn methods_are_classified_by_path() {
        assert_eq!(Kind::of("/tensorflow.MasterService/RunStep"), Kind::RunStep);
        assert_eq!(
            Kind::of("/tensorflow.eager.EagerService/StreamingEnqueue"),
            Kind::Enqueue
        );
        assert_eq!(
            Kind::of("/tensorflow.WorkerService/RecvTensor"),
            Kind::Other
        );
        assert_eq!(Kind::of("garbage"), Kind::Other);
    }
}
