//! Turns the calls the tap forwards into events: one `Rpc` span per call on
//! its client connection's line, a `Step` span per `RunStep`/`RunCallable`
//! (numbered per session handle), and an `EagerOp` span per enqueued remote
//! eager operation, from its request message to the matching response.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use prost::Message;

use crate::clock;
use crate::event::{Device, Event, NameId, Payload, RpcInfo};
use crate::model::registry::Registry;
use crate::ring::Producer;

use super::decode::{self, Body, Frame, Framer};
use super::queue::{Bounds, DecodeQueue, Job};

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
pub const FAILED_PRECONDITION: u32 = 9;
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
    /// Messages forwarded without being decoded (compressed, over the
    /// decode limit, unparsable, or no room in the decode queue).
    pub undecoded: u64,
    /// Of those, the messages the decode queue had no room for.
    pub queue_overflow: u64,
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
    queue_overflow: AtomicU64,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    dropped_events: AtomicU64,
    /// Calls begun and not yet ended.
    open: AtomicU64,
}

/// Shared by every connection of one or more taps; owns one ring lane.
pub struct Recorder {
    registry: Arc<Registry>,
    producer: Mutex<Producer>,
    steps: Mutex<HashMap<String, i64>>,
    counters: Counters,
    queue: DecodeQueue,
}

impl Recorder {
    pub fn new(registry: Arc<Registry>, producer: Producer) -> Arc<Recorder> {
        Recorder::with_queue(
            registry,
            producer,
            DecodeQueue::start(Bounds::default(), Call::decoded),
        )
    }

    fn with_queue(
        registry: Arc<Registry>,
        producer: Producer,
        queue: DecodeQueue,
    ) -> Arc<Recorder> {
        Arc::new(Recorder {
            registry,
            producer: Mutex::new(producer),
            steps: Mutex::default(),
            counters: Counters::default(),
            queue,
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
            queue_overflow: load(&c.queue_overflow),
            request_bytes: load(&c.request_bytes),
            response_bytes: load(&c.response_bytes),
            dropped_events: load(&c.dropped_events),
        }
    }

    /// Calls begun and not yet ended: what a stopping tap waits for.
    pub fn calls_in_progress(&self) -> u64 {
        self.counters.open.load(Ordering::Acquire)
    }

    /// Starts recording one call of `path` (`/package.Service/Method`):
    /// returns the call and the observers of its two directions.
    pub fn call(self: &Arc<Self>, line: u64, path: &str) -> (Arc<Call>, Observer, Observer) {
        self.counters.open.fetch_add(1, Ordering::AcqRel);
        let kind = Kind::of(path);
        let call = Arc::new(Call {
            recorder: Arc::clone(self),
            line,
            name: self.registry.intern(path.trim_start_matches('/')),
            kind,
            start_ns: clock::now_ns(),
            queued: AtomicU32::new(0),
            traffic: Default::default(),
            undecoded: AtomicU32::new(0),
            state: Mutex::default(),
            ending: Mutex::default(),
        });
        let observer = |direction| Observer::new(Arc::clone(&call), direction);
        let (request, response) = (observer(Direction::Request), observer(Direction::Response));
        (call, request, response)
    }

    /// Waits up to `limit` for the messages forwarded so far to be decoded
    /// and the calls that ended to be recorded; false if some still wait.
    pub fn settle(&self, limit: Duration) -> bool {
        self.queue.settle(limit)
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

/// What the tap needs of one direction's messages for a kind of call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Needs {
    /// Nothing: the messages are only counted.
    Nothing,
    /// When each message arrives (an Enqueue response ends its batch's ops).
    Arrival,
    /// The decoded message.
    Decoded,
}

impl Kind {
    fn needs(self, direction: Direction) -> Needs {
        match (self, direction) {
            (Kind::Other, _) => Needs::Nothing,
            (_, Direction::Request) => Needs::Decoded,
            (Kind::RunStep | Kind::CreateSession | Kind::CreateContext, Direction::Response) => {
                Needs::Decoded
            }
            (Kind::Enqueue, Direction::Response) => Needs::Arrival,
            (_, Direction::Response) => Needs::Nothing,
        }
    }

    /// The top-level fields of a message the record reads, where the rest
    /// carries tensors (`feed`, `tensor`) that are neither held nor parsed;
    /// `None` keeps the message whole.
    fn kept_fields(self, direction: Direction) -> Option<&'static [u32]> {
        match (self, direction) {
            // session_handle, fetch, target, partial_run_handle.
            (Kind::RunStep, Direction::Request) => Some(&[1, 3, 4, 6]),
            // session_handle, handle.
            (Kind::RunCallable, Direction::Request) => Some(&[1, 2]),
            // status_code.
            (Kind::RunStep, Direction::Response) => Some(&[3]),
            _ => None,
        }
    }
}

/// What the decoded messages of a call said, and how it ends.
#[derive(Default)]
struct State {
    info: RpcInfo,
    session: String,
    context_id: u64,
    step: Option<i64>,
    fetches: Vec<String>,
    targets: Vec<String>,
    /// Enqueue messages waiting for their response: arrival time and ops
    /// (none for a request that was not decoded).
    pending: VecDeque<(u64, Option<Vec<PendingOp>>)>,
    /// The number the next message of each direction should have.
    next_seq: [u32; 2],
    /// A failure reported inside an OK response (RunStep).
    body_status: u32,
    recorded: bool,
}

/// How a call ended, as the forwarding side saw it: apart from [`State`],
/// which the decoding thread holds while it parses, so that a response
/// never waits on the decoding of a large request.
#[derive(Default)]
struct Ending {
    /// The status the upstream sent.
    status: Option<u32>,
    /// The status to use when the upstream sent none, and when the call
    /// ended: set once it ended, recorded once its messages are decoded.
    ended: Option<(u32, u64)>,
}

/// Which way a message travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

impl Direction {
    fn index(self) -> usize {
        self as usize
    }
}

/// Bytes and messages one direction of a call carried.
#[derive(Default)]
struct Traffic {
    bytes: AtomicU64,
    messages: AtomicU32,
}

/// One forwarded call being recorded. It ends exactly once, by whichever
/// comes first: the response's end, an error, or the response being
/// dropped; it is recorded once its messages still in the decode queue are
/// decoded. The forwarding side touches only `ending` and atomics, never
/// what the decoding thread holds.
pub struct Call {
    recorder: Arc<Recorder>,
    line: u64,
    name: NameId,
    kind: Kind,
    start_ns: u64,
    /// Its messages in the decode queue.
    queued: AtomicU32,
    traffic: [Traffic; 2],
    undecoded: AtomicU32,
    state: Mutex<State>,
    ending: Mutex<Ending>,
}

/// Frames one direction of a call on the forwarding path and hands what
/// the call needs of its messages to the decode queue.
pub struct Observer {
    call: Arc<Call>,
    direction: Direction,
    needs: Needs,
    framer: Framer,
    frames: Vec<Frame>,
}

impl Observer {
    fn new(call: Arc<Call>, direction: Direction) -> Observer {
        let needs = call.kind.needs(direction);
        let framer = match (needs, call.kind.kept_fields(direction)) {
            (Needs::Decoded, Some(fields)) => Framer::keeping(fields, DECODE_LIMIT),
            (Needs::Decoded, None) => Framer::new(DECODE_LIMIT),
            _ => Framer::new(0),
        };
        Observer {
            call,
            direction,
            needs,
            framer,
            frames: Vec::new(),
        }
    }

    /// One data frame, in order.
    pub fn observe(&mut self, data: &Bytes) {
        let first_seq = self.framer.messages;
        self.framer.push(data, &mut self.frames);
        let traffic = &self.call.traffic[self.direction.index()];
        traffic.bytes.store(self.framer.bytes, Ordering::Relaxed);
        traffic
            .messages
            .store(self.framer.messages, Ordering::Relaxed);
        if self.needs == Needs::Nothing {
            self.frames.clear();
            return;
        }
        if self.frames.is_empty() {
            return;
        }
        let arrived_ns = clock::now_ns();
        for (seq, frame) in (first_seq..).zip(self.frames.drain(..)) {
            let body = match frame {
                Frame::Message(body) => Some(body),
                Frame::Skipped { .. } if self.needs == Needs::Decoded => {
                    self.call.undecoded.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Frame::Skipped { .. } => None,
            };
            self.call.offer(Job {
                call: Arc::clone(&self.call),
                direction: self.direction,
                seq,
                arrived_ns,
                body,
            });
        }
    }

    /// The call this observes.
    pub fn call(&self) -> &Arc<Call> {
        &self.call
    }

    pub fn direction(&self) -> Direction {
        self.direction
    }
}

impl Call {
    /// Hands a message to the decode queue, or counts it when there is no room.
    fn offer(&self, job: Job) {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.recorder.queue.offer(job).is_ok() {
            return;
        }
        self.recorder
            .counters
            .queue_overflow
            .fetch_add(1, Ordering::Relaxed);
        self.undecoded.fetch_add(1, Ordering::Relaxed);
        // The gap in the message numbers says what is missing.
        self.release();
    }

    /// Runs on the decoding thread: applies one message of a call.
    fn decoded(job: Job) {
        let call = &job.call;
        let mut events = Vec::new();
        let mut state = call.state.lock();
        if !state.recorded {
            call.apply(&mut state, &job, &mut events);
        }
        drop(state);
        // Ops of a long-lived StreamingEnqueue are recorded as they complete,
        // not when the stream (the eager context) ends.
        if !events.is_empty() {
            call.recorder.push(&events);
        }
        call.release();
    }

    /// One queued message is done with: the call is recorded when it had
    /// ended and this was its last.
    fn release(&self) {
        if self.queued.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.record();
        }
    }

    fn apply(&self, state: &mut State, job: &Job, events: &mut Vec<Event>) {
        let side = job.direction.index();
        let missed = job.seq.saturating_sub(state.next_seq[side]);
        state.next_seq[side] = job.seq.saturating_add(1);
        match job.direction {
            Direction::Request => {
                if self.kind == Kind::Enqueue {
                    // Requests never decoded still get their response.
                    for _ in 0..missed {
                        self.queue_batch(state, job.arrived_ns, None);
                    }
                }
                let decoded = job
                    .body
                    .as_ref()
                    .is_some_and(|body| self.request(state, body, job.arrived_ns));
                if !decoded {
                    self.undecoded.fetch_add(1, Ordering::Relaxed);
                }
            }
            Direction::Response => {
                if self.kind == Kind::Enqueue {
                    // Responses the queue had no room for end their batches
                    // at an unknown time: their ops are counted as lost.
                    for _ in 0..missed {
                        if let Some((_, Some(lost))) = state.pending.pop_front() {
                            self.lose_ops(lost.len());
                        }
                    }
                    if let Some((start, ops)) = state.pending.pop_front() {
                        let ops = ops.unwrap_or_default();
                        self.op_events(events, start, job.arrived_ns, state.context_id, ops);
                    }
                } else if let Some(body) = &job.body {
                    if !self.response(state, body) {
                        self.undecoded.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    fn lose_ops(&self, count: usize) {
        self.recorder
            .counters
            .dropped_events
            .fetch_add(count as u64, Ordering::Relaxed);
    }

    /// The status the upstream sent (headers of a trailers-only response, or
    /// the trailers).
    pub fn set_status(&self, status: u32) {
        self.ending.lock().status = Some(status);
    }

    /// Ends the call: `status` is used when the upstream sent none. It is
    /// recorded now, or once its messages still queued are decoded.
    pub fn finish(&self, status: u32) {
        let end_ns = clock::now_ns();
        {
            let mut ending = self.ending.lock();
            if ending.ended.is_some() {
                return;
            }
            ending.ended = Some((status, end_ns));
        }
        self.recorder.counters.open.fetch_sub(1, Ordering::AcqRel);
        if self.queued.load(Ordering::Acquire) == 0 {
            self.record();
        }
    }

    /// Writes the call's events once it has ended; once.
    fn record(&self) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if state.recorded {
            return;
        }
        let (sent_status, ended) = {
            let ending = self.ending.lock();
            (ending.status, ending.ended)
        };
        let Some((default_status, end_ns)) = ended else {
            return;
        };
        state.recorded = true;
        let mut status = sent_status.unwrap_or(default_status);
        if status == 0 {
            status = state.body_status;
        }
        let registry = &self.recorder.registry;
        let [request, response] = &self.traffic;
        let mut info = state.info;
        info.status = status;
        info.undecoded = self.undecoded.load(Ordering::Relaxed);
        info.request_bytes = request.bytes.load(Ordering::Relaxed);
        info.response_bytes = response.bytes.load(Ordering::Relaxed);
        info.request_messages = request.messages.load(Ordering::Relaxed);
        info.response_messages = response.messages.load(Ordering::Relaxed);
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
            let ops = ops.unwrap_or_default();
            self.op_events(&mut events, start, end_ns, state.context_id, ops);
        }
        drop(guard);
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

    /// Queues one Enqueue batch to wait for its response, the oldest's
    /// ops counted as lost when responses never come.
    fn queue_batch(&self, state: &mut State, arrived_ns: u64, ops: Option<Vec<PendingOp>>) {
        if state.pending.len() >= MAX_PENDING {
            if let Some((_, Some(lost))) = state.pending.pop_front() {
                self.lose_ops(lost.len());
            }
        }
        state.pending.push_back((arrived_ns, ops));
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
    fn request(&self, state: &mut State, message: &Body, arrived_ns: u64) -> bool {
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
                self.queue_batch(state, arrived_ns, Some(ops));
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
    fn response(&self, state: &mut State, message: &Body) -> bool {
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

    fn grpc_message(body: &[u8]) -> Bytes {
        let mut out = vec![0u8];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body);
        Bytes::from(out)
    }

    fn enqueue_one_op(op_id: i64) -> Bytes {
        let request = decode::EnqueueRequest {
            context_id: 7,
            queue: vec![decode::QueueItem {
                operation: Some(decode::Operation {
                    id: op_id,
                    name: "MatMul".into(),
                    device: "/job:worker/replica:0/task:0/device:GPU:0".into(),
                }),
                ..Default::default()
            }],
        };
        grpc_message(&request.encode_to_vec())
    }

    #[test]
    fn a_full_decode_queue_counts_the_message_and_keeps_ops_paired_with_their_responses() {
        let registry = Registry::new();
        let ring = crate::ring::Ring::new(1, 256, crate::ring::DropPolicy::DropNewest).unwrap();
        let body_bytes = enqueue_one_op(10).len() - decode::PREFIX_BYTES;
        // The decoding thread waits until the gate is dropped; the queue
        // holds two requests' bytes.
        let (gate, waiting) = std::sync::mpsc::channel::<()>();
        let waiting = Mutex::new(waiting);
        let bounds = Bounds {
            messages: 64,
            bytes: 2 * body_bytes,
        };
        let queue = DecodeQueue::start(bounds, move |job| {
            let _ = waiting.lock().recv();
            Call::decoded(job);
        });
        let recorder = Recorder::with_queue(registry, ring.producer().unwrap(), queue);
        let (call, mut requests, mut responses) = recorder.call(
            LINE_TAG | 1,
            "/tensorflow.eager.EagerService/StreamingEnqueue",
        );
        for op_id in 10..13 {
            requests.observe(&enqueue_one_op(op_id));
        }
        assert_eq!(recorder.stats().queue_overflow, 1, "the third had no room");
        drop(gate);
        assert!(recorder.settle(Duration::from_secs(10)));
        requests.observe(&enqueue_one_op(13));
        let mut response_times = Vec::new();
        for _ in 0..4 {
            response_times.push(clock::now_ns());
            responses.observe(&grpc_message(b""));
        }
        call.finish(0);
        assert!(recorder.settle(Duration::from_secs(10)));

        let stats = recorder.stats();
        assert_eq!((stats.calls, stats.undecoded, stats.eager_ops), (1, 1, 3));
        let mut events = Vec::new();
        ring.consumer().unwrap().drain(&mut events, usize::MAX);
        let ends: Vec<(i64, u64)> = events
            .iter()
            .filter_map(|event| match event.payload() {
                Payload::EagerOp { op_id, .. } => Some((op_id, event.start_ns + event.duration_ns)),
                _ => None,
            })
            .collect();
        assert_eq!(
            ends.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            [10, 11, 13]
        );
        // Each op ends at its own response: op 13 at the fourth, although the
        // third request was never decoded.
        let ended_between = |end: u64, response: usize| {
            end >= response_times[response]
                && response_times
                    .get(response + 1)
                    .is_none_or(|next| end < *next)
        };
        assert!(ended_between(ends[0].1, 0), "{ends:?} {response_times:?}");
        assert!(ended_between(ends[1].1, 1), "{ends:?} {response_times:?}");
        assert!(ended_between(ends[2].1, 3), "{ends:?} {response_times:?}");
    }

    #[test]
    fn a_call_ends_without_waiting_for_its_messages_to_be_decoded() {
        let registry = Registry::new();
        let ring = crate::ring::Ring::new(1, 64, crate::ring::DropPolicy::DropNewest).unwrap();
        let (gate, waiting) = std::sync::mpsc::channel::<()>();
        let waiting = Mutex::new(waiting);
        let queue = DecodeQueue::start(Bounds::default(), move |job| {
            let _ = waiting.lock().recv();
            Call::decoded(job);
        });
        let recorder = Recorder::with_queue(registry, ring.producer().unwrap(), queue);
        let (call, mut requests, _responses) =
            recorder.call(LINE_TAG | 1, "/tensorflow.MasterService/RunStep");
        requests.observe(&grpc_message(&decode::sample_run_step().encode_to_vec()));
        // The decoding thread holds what the messages said while it parses;
        // the response's status and end do not wait for it.
        let parsing = call.state.lock();
        let (ended, ends) = std::sync::mpsc::channel();
        let forwarding = Arc::clone(&call);
        std::thread::spawn(move || {
            forwarding.set_status(0);
            forwarding.finish(UNKNOWN);
            let _ = ended.send(());
        });
        assert!(
            ends.recv_timeout(Duration::from_secs(10)).is_ok(),
            "the call's end waited on its decoding"
        );
        drop(parsing);
        drop(gate);
        assert!(recorder.settle(Duration::from_secs(10)));
        let stats = recorder.stats();
        assert_eq!((stats.calls, stats.steps, stats.failed), (1, 1, 0));
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
