//! Turns the events of one capture window into the bytes of an XSpace that
//! XProf reads. Pure: events and registry facts in, `.xplane.pb` bytes out,
//! written in one pass with [`super::wire`] (no message tree in between).
//! Every naming rule comes from [`crate::model::timeline`].

use std::any::Any;
use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use foldhash::HashMap;
use prost::Message;

use crate::event::{
    CopyKind, Device, DriverCallInfo, Event, KernelInfo, MemoryInfo, NameId, Payload, RpcInfo,
};
use crate::model::registry::{DeviceInfo, RegistrySnapshot};
use crate::proto::tensorflow::profiler::XSpace;
use crate::recorder::Window;

use super::grant::{Grant, Spill, Unlimited};
use super::runs::MergedRuns;
use super::wire::{Open, Writer};
use crate::model::timeline::{self as names, stat};
pub use crate::model::timeline::{task_state_label, COUNTER_TRACK, STILL_RUNNING, XID_TRACK};

/// Everything about the capture that is not an event.
#[derive(Clone, Debug, Default)]
pub struct CaptureInfo {
    pub window: Window,
    pub hostname: String,
    /// Serialized `ProfileOptions` of the request.
    pub profile_options: Vec<u8>,
    pub dropped_newest: u64,
    pub dropped_oldest: u64,
    /// Events backends lost before the ring during the window
    /// (`crate::backend::Backend::losses`); the warnings say what they were.
    pub dropped_before_ring: u64,
    pub warnings: Vec<String>,
    pub errors: Vec<String>,
    /// Further facts about the capture (the CUDA processes it covers, ...),
    /// written as string stats of the Task Environment plane.
    pub properties: Vec<(String, String)>,
}

/// Field numbers of xplane.proto.
pub(super) mod field {
    pub const SPACE_PLANES: u32 = 1;
    pub const SPACE_ERRORS: u32 = 2;
    pub const SPACE_WARNINGS: u32 = 3;
    pub const SPACE_HOSTNAMES: u32 = 4;
    pub const PLANE_ID: u32 = 1;
    pub const PLANE_NAME: u32 = 2;
    pub const PLANE_LINES: u32 = 3;
    pub const PLANE_EVENT_METADATA: u32 = 4;
    pub const PLANE_STAT_METADATA: u32 = 5;
    pub const PLANE_STATS: u32 = 6;
    pub const MAP_KEY: u32 = 1;
    pub const MAP_VALUE: u32 = 2;
    pub const LINE_ID: u32 = 1;
    pub const LINE_NAME: u32 = 2;
    pub const LINE_EVENTS: u32 = 4;
    pub const EVENT_METADATA_ID: u32 = 1;
    pub const EVENT_OFFSET_PS: u32 = 2;
    pub const EVENT_DURATION_PS: u32 = 3;
    pub const EVENT_STATS: u32 = 4;
    pub const STAT_METADATA_ID: u32 = 1;
    pub const STAT_DOUBLE: u32 = 2;
    pub const STAT_UINT64: u32 = 3;
    pub const STAT_INT64: u32 = 4;
    pub const STAT_STR: u32 = 5;
    pub const STAT_BYTES: u32 = 6;
    pub const STAT_REF: u32 = 7;
    pub const METADATA_ID: u32 = 1;
    pub const METADATA_NAME: u32 = 2;
}

/// An encoded XSpace, kept as the parts it was written in (each plane's
/// field, then the space's own fields), and how many events it holds. The
/// parts one after another are the message: a reply sends them as they are,
/// so a trace is never copied into one buffer on its way to a client.
#[derive(Clone, Debug, Default)]
pub struct Encoded {
    parts: Vec<Bytes>,
    len: usize,
    /// Bytes the parts keep allocated: their length (less what is spilled),
    /// or a little more.
    retained: usize,
    /// Bytes of the parts that are a spill's pages rather than memory.
    spilled: usize,
    pub events: usize,
    /// What counts this trace's bytes against a budget, given back when the
    /// last copy of the trace is dropped.
    _accounted: Option<Accounted>,
}

/// An owner of a share of a memory budget, kept alive with a trace.
#[derive(Clone)]
struct Accounted {
    _owner: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Accounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Accounted")
    }
}

impl Encoded {
    /// The XSpace of `parts` (one after another), holding `events` events.
    pub fn from_parts(parts: Vec<Bytes>, events: usize) -> Encoded {
        let len = parts.iter().map(Bytes::len).sum();
        Encoded {
            parts,
            len,
            retained: len,
            spilled: 0,
            events,
            _accounted: None,
        }
    }

    /// The same trace, holding `owner` (its share of a memory budget) for
    /// as long as any copy of it lives.
    pub fn accounted_by(self, owner: Arc<dyn Any + Send + Sync>) -> Encoded {
        Encoded {
            _accounted: Some(Accounted { _owner: owner }),
            ..self
        }
    }

    /// An XSpace already in one buffer.
    pub fn whole(bytes: impl Into<Bytes>, events: usize) -> Encoded {
        Encoded::from_parts(vec![bytes.into()], events)
    }

    /// The encoded length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the trace keeps allocated: what a budget counts it at.
    pub fn retained(&self) -> usize {
        self.retained
    }

    /// Bytes of the trace that were spilled while it was built: pages of a
    /// file, not memory of the agent's own.
    pub fn spilled(&self) -> usize {
        self.spilled
    }

    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// The message in one buffer: the part itself when there is one, else
    /// a copy of them all.
    pub fn contiguous(&self) -> Bytes {
        match self.parts.as_slice() {
            [one] => one.clone(),
            parts => {
                let mut whole = Vec::with_capacity(self.len);
                for part in parts {
                    whole.extend_from_slice(part);
                }
                whole.into()
            }
        }
    }
}

/// Encodes the XSpace for `events` (any order) recorded during `info.window`.
pub fn encode_xspace<E: Borrow<Event>>(
    events: impl IntoIterator<Item = E>,
    registry: &RegistrySnapshot,
    info: &CaptureInfo,
) -> Encoded {
    let mut events: Vec<E> = events.into_iter().collect();
    let order = |e: &E| {
        let e = e.borrow();
        (e.start_ns, Reverse(e.duration_ns))
    };
    // Stable: events alike in start and length keep the order they came in.
    if !events.is_sorted_by_key(order) {
        events.sort_by_key(order);
    }
    let first = events.first().map_or(0, |e| e.borrow().start_ns);
    let run = events.iter().map(|e| *e.borrow());
    match encode_runs(vec![(first, run)], registry, info, &mut Unlimited) {
        Ok(encoded) => encoded,
        Err(outgrown) => match outgrown {},
    }
}

/// Encodes the XSpace of `runs`, each sorted in timeline order (start
/// ascending, the longer of two that start together first) and paired with
/// the earliest start it may hold, as the flight recorder's chunks are
/// ([`crate::recorder::WindowData::runs`]). Events are encoded as the merge
/// reaches them, each into its line's own blocks, so that what the build
/// holds is the trace it makes (and each plane's metadata tables), not the
/// window's events; every byte it comes to hold is drawn from `grant` first.
pub fn encode_runs<I: Iterator<Item = Event>, G: Grant + ?Sized>(
    runs: Vec<(u64, I)>,
    registry: &RegistrySnapshot,
    info: &CaptureInfo,
    grant: &mut G,
) -> Result<Encoded, G::Refusal> {
    let mut planes: BTreeMap<Device, PlaneWriter> = BTreeMap::new();
    // The host plane is always there; a known device gets its plane (and
    // its facts) even when it was quiet.
    planes.insert(Device::Host, PlaneWriter::new(registry));
    for device in registry.devices() {
        planes
            .entry(device)
            .or_insert_with(|| PlaneWriter::new(registry));
    }
    let mut spill = Spilling::<G::Refusal>::default();
    let mut count = 0;
    for event in MergedRuns::new(runs) {
        let plane = planes
            .entry(event.device())
            .or_insert_with(|| PlaneWriter::new(registry));
        let grown = plane.push(&event, info.window.start_ns);
        count += 1;
        if grown == 0 {
            continue;
        }
        if let Some(to) = spill.to.as_mut() {
            // Once spilling, every block goes as soon as it is finished.
            let freed = plane.spill_sealed(to.as_mut(), &mut spill.bytes)?;
            grant.let_go(freed);
        }
        if let Err(refused) = grant.take(grown) {
            if !std::mem::replace(&mut spill.asked, true) {
                spill.to = grant.spill();
            }
            let Some(to) = spill.to.as_mut() else {
                return Err(refused);
            };
            let mut freed = 0;
            for plane in planes.values_mut() {
                freed += plane.spill_sealed(to.as_mut(), &mut spill.bytes)?;
            }
            grant.let_go(freed);
            grant.take(grown)?;
        }
    }
    // Empty when nothing was spilled: no block then refers to it.
    let spilled = match spill.to {
        Some(to) => to.finish()?,
        None => Bytes::new(),
    };
    let mut parts = Vec::new();
    let mut retained = 0;
    for (device, plane) in planes {
        let framing = plane.finish(device, registry, &spilled, &mut parts, &mut retained);
        grant.take(framing)?;
    }
    let mut out = Writer::with_capacity(4096);
    let plane = out.begin(field::SPACE_PLANES, 5);
    task_environment(&mut out, info);
    out.end(plane);
    for error in &info.errors {
        out.text(field::SPACE_ERRORS, error);
    }
    for warning in warnings(info) {
        out.text(field::SPACE_WARNINGS, &warning);
    }
    out.bytes(field::SPACE_HOSTNAMES, info.hostname.as_bytes());
    grant.take(out.len())?;
    parts.push(freeze(out, &mut retained));
    let mut encoded = Encoded::from_parts(parts, count);
    // Spilled blocks are the spill's pages, not the build's memory.
    encoded.retained = retained.max(encoded.len - spill.bytes);
    encoded.spilled = spill.bytes;
    Ok(encoded)
}

/// Where a build stands with its spill.
struct Spilling<E> {
    /// The grant was asked for one.
    asked: bool,
    to: Option<Box<dyn Spill<Error = E> + Send>>,
    /// Bytes moved there.
    bytes: usize,
}

impl<E> Default for Spilling<E> {
    fn default() -> Self {
        Spilling {
            asked: false,
            to: None,
            bytes: 0,
        }
    }
}

/// Adds `warning` to an encoded XSpace: a repeated field appended to a
/// message's bytes is read as one more element, so nothing is re-encoded.
pub fn append_warning(encoded: &mut Encoded, warning: &str) {
    let mut out = Writer::default();
    out.text(field::SPACE_WARNINGS, warning);
    let part = Bytes::from(out.into_bytes());
    encoded.len += part.len();
    encoded.retained += part.len();
    encoded.parts.push(part);
}

/// A line's events are sealed in blocks of about this size: a block never
/// grows past it, so a large line costs what it holds, not up to twice that
/// as one buffer doubling would.
const BLOCK_BYTES: usize = 256 << 10;

/// Room left in a block below which it is sealed: more than one event takes.
const BLOCK_ROOM: usize = 4 << 10;

/// A finished block of a line's events: held, or moved to the build's
/// spill (where it starts there, and its length).
enum Sealed {
    Held(Bytes),
    Spilled { at: u64, len: usize },
}

impl Sealed {
    fn len(&self) -> usize {
        match self {
            Sealed::Held(bytes) => bytes.len(),
            Sealed::Spilled { len, .. } => *len,
        }
    }
}

/// One line's encoded events: sealed blocks, then the one being written.
#[derive(Default)]
struct LineWriter {
    sealed: Vec<Sealed>,
    /// Bytes the held sealed blocks keep allocated (a little past their
    /// length).
    sealed_capacity: usize,
    open: Writer,
    /// Which kinds of stream work the line holds (a GPU stream's name says).
    stream_kinds: [bool; names::STREAM_KIND_ORDER.len()],
}

impl LineWriter {
    fn len(&self) -> usize {
        self.sealed.iter().map(Sealed::len).sum::<usize>() + self.open.len()
    }

    /// Moves the held sealed blocks to `spill`; returns the bytes they had
    /// allocated, and adds theirs to `spilled`.
    fn spill_sealed<E>(
        &mut self,
        spill: &mut (dyn Spill<Error = E> + Send),
        spilled: &mut usize,
    ) -> Result<usize, E> {
        for block in &mut self.sealed {
            if let Sealed::Held(bytes) = block {
                let at = spill.append(bytes)?;
                *spilled += bytes.len();
                *block = Sealed::Spilled {
                    at,
                    len: bytes.len(),
                };
            }
        }
        Ok(std::mem::take(&mut self.sealed_capacity))
    }

    /// Seals the open block when it is nearly full; the next one is
    /// allocated whole, as a line this large will fill it. Returns the bytes
    /// newly allocated.
    fn seal_if_full(&mut self) -> usize {
        if self.open.len() + BLOCK_ROOM < BLOCK_BYTES {
            return 0;
        }
        let block = std::mem::replace(&mut self.open, Writer::with_capacity(BLOCK_BYTES));
        self.sealed_capacity += block.capacity();
        self.sealed
            .push(Sealed::Held(Bytes::from(block.into_bytes())));
        self.open.capacity()
    }
}

/// One plane's lines being written, and the metadata tables they refer to.
struct PlaneWriter<'r> {
    tables: PlaneTables<'r>,
    lines: BTreeMap<u64, LineWriter>,
}

impl<'r> PlaneWriter<'r> {
    fn new(registry: &'r RegistrySnapshot) -> Self {
        PlaneWriter {
            tables: PlaneTables::new(registry),
            lines: BTreeMap::new(),
        }
    }

    /// Encodes `event` into its line. Returns the bytes the plane has grown
    /// by: its line's buffer and its tables.
    fn push(&mut self, event: &Event, origin_ns: u64) -> usize {
        let line_id = if event.is_counter() {
            COUNTER_TRACK
        } else {
            event.line
        };
        let line = self.lines.entry(line_id).or_default();
        let before = line.open.capacity() + self.tables.bytes;
        self.tables.event(&mut line.open, event, origin_ns);
        if let Some(kind) = stream_kind(event) {
            line.stream_kinds[kind] = true;
        }
        let grown = (line.open.capacity() + self.tables.bytes).saturating_sub(before);
        grown + line.seal_if_full()
    }

    /// Moves every line's held sealed blocks to `spill`; returns the bytes
    /// they had allocated.
    fn spill_sealed<E>(
        &mut self,
        spill: &mut (dyn Spill<Error = E> + Send),
        spilled: &mut usize,
    ) -> Result<usize, E> {
        let mut freed = 0;
        for line in self.lines.values_mut() {
            freed += line.spill_sealed(spill, spilled)?;
        }
        Ok(freed)
    }

    /// Appends the plane as parts of the space's `planes` field: its id and
    /// name, each line (its id and name, then its blocks, spilled ones
    /// sliced from `spilled`, the spill read back) and its tables. Returns the bytes of the parts it
    /// wrote besides the lines' blocks, and adds what all its held parts
    /// keep allocated to `retained`.
    fn finish(
        self,
        device: Device,
        registry: &RegistrySnapshot,
        spilled: &Bytes,
        parts: &mut Vec<Bytes>,
        retained: &mut usize,
    ) -> usize {
        let PlaneWriter { mut tables, lines } = self;
        let (id, name) = match device {
            Device::Host => (names::HOST_PLANE_ID, names::HOST_PLANE.to_string()),
            Device::HostCpus => (
                names::HOST_CPUS_PLANE_ID,
                names::HOST_CPUS_PLANE.to_string(),
            ),
            Device::Gpu(ordinal) => (i64::from(ordinal), names::gpu_plane_name(ordinal)),
        };
        let mut head = Writer::default();
        head.int_nonzero(field::PLANE_ID, id);
        head.text(field::PLANE_NAME, &name);
        let mut plane_len = head.len();
        let mut framing = 0;
        let mut line_parts = Vec::new();
        for (line_id, line) in lines {
            let mut header = Writer::default();
            header.int_nonzero(field::LINE_ID, xline_id(line_id));
            header.text(
                field::LINE_NAME,
                &line_name(device, line_id, &line.stream_kinds, registry),
            );
            let line_len = header.len() + line.len();
            let mut prefixed = Writer::with_capacity(header.len() + 16);
            prefixed.message_prefix(field::PLANE_LINES, line_len);
            prefixed.raw(&header.into_bytes());
            plane_len += prefixed.len() + line.len();
            framing += prefixed.len();
            line_parts.push(freeze(prefixed, retained));
            *retained += line.sealed_capacity;
            for block in line.sealed {
                line_parts.push(match block {
                    Sealed::Held(bytes) => bytes,
                    Sealed::Spilled { at, len } => spilled.slice(at as usize..at as usize + len),
                });
            }
            if !line.open.is_empty() {
                line_parts.push(freeze(line.open, retained));
            }
        }
        if let Some(info) = registry.device_info(device) {
            tables.device_stats(info);
        }
        let mut tail = Writer::default();
        tables.finish(&mut tail);
        plane_len += tail.len();
        let mut prefix = Writer::with_capacity(16 + head.len());
        prefix.message_prefix(field::SPACE_PLANES, plane_len);
        prefix.raw(&head.into_bytes());
        framing += prefix.len() + tail.len();
        parts.push(freeze(prefix, retained));
        parts.extend(line_parts);
        parts.push(freeze(tail, retained));
        framing
    }
}

/// A written buffer as a part of the trace, cut to its length (a part keeps
/// its whole allocation), counting what it keeps in `retained`.
fn freeze(writer: Writer, retained: &mut usize) -> Bytes {
    let mut bytes = writer.into_bytes();
    bytes.shrink_to_fit();
    *retained += bytes.capacity();
    Bytes::from(bytes)
}

/// The id a line has in the trace: its own, or a fixed one for the tracks.
fn xline_id(line_id: u64) -> i64 {
    match line_id {
        COUNTER_TRACK => names::COUNTERS_LINE_ID,
        XID_TRACK => names::XID_LINE_ID,
        _ => line_id as i64,
    }
}

/// A line's name: a thread's, a CPU's, or a GPU stream's (saying the kinds
/// of work it holds and, for workload processes, whose it is).
fn line_name(
    device: Device,
    line_id: u64,
    stream_kinds: &[bool; names::STREAM_KIND_ORDER.len()],
    registry: &RegistrySnapshot,
) -> String {
    match device {
        _ if line_id == COUNTER_TRACK => names::COUNTERS_LINE.to_string(),
        _ if line_id == XID_TRACK => names::XID_LINE.to_string(),
        Device::Host => registry
            .line_name(device, line_id)
            .map_or_else(|| format!("Thread {line_id}"), str::to_string),
        Device::HostCpus => registry.line_name(device, line_id).map_or_else(
            || {
                if line_id & names::THREAD_LINE_BIT != 0 {
                    format!("Thread {} off-CPU", line_id & !names::THREAD_LINE_BIT)
                } else {
                    names::cpu_line_name(line_id)
                }
            },
            str::to_string,
        ),
        Device::Gpu(_) => {
            let kinds: Vec<&str> = names::STREAM_KIND_ORDER
                .iter()
                .zip(stream_kinds)
                .filter_map(|(kind, on)| on.then_some(*kind))
                .collect();
            let stream = names::stream_line_name(names::stream_of_line(line_id), &kinds);
            // Streams of workload processes say whose they are.
            match registry.line_name(device, line_id) {
                Some(owner) => format!("{stream} {owner}"),
                None => stream,
            }
        }
    }
}

/// The same XSpace as a message, for replies that carry it inline.
pub fn build_xspace<E: Borrow<Event> + Send>(
    events: impl IntoIterator<Item = E>,
    registry: &RegistrySnapshot,
    info: &CaptureInfo,
) -> Result<XSpace, prost::DecodeError> {
    XSpace::decode(encode_xspace(events, registry, info).contiguous())
}

fn warnings(info: &CaptureInfo) -> Vec<String> {
    let mut warnings = info.warnings.clone();
    let dropped = info.dropped_newest + info.dropped_oldest;
    if dropped > 0 {
        warnings.push(format!(
            "devtrace dropped {dropped} events during this capture because a ring was full \
             ({} refused by drop-newest, {} overwritten by drop-oldest); \
             raise --ring-capacity or lower the event rate",
            info.dropped_newest, info.dropped_oldest
        ));
    }
    warnings
}

/// True when no line of any plane holds an event.
pub fn is_empty(space: &XSpace) -> bool {
    space
        .planes
        .iter()
        .all(|p| p.lines.iter().all(|l| l.events.is_empty()))
}

/// Which of the stream kinds a GPU stream's name lists `event` is, if any.
fn stream_kind(event: &Event) -> Option<usize> {
    let kind = match event.payload() {
        Payload::Kernel(_) => names::STREAM_COMPUTE,
        Payload::Memcpy(copy) => copy_label(copy.kind),
        Payload::Memset(_) => names::STREAM_MEMSET,
        _ => return None,
    };
    names::STREAM_KIND_ORDER.iter().position(|k| *k == kind)
}

fn copy_label(kind: CopyKind) -> &'static str {
    match kind {
        CopyKind::HostToDevice => names::STREAM_MEMCPY_H2D,
        CopyKind::DeviceToHost => names::STREAM_MEMCPY_D2H,
        CopyKind::DeviceToDevice => names::STREAM_MEMCPY_D2D,
        CopyKind::PeerToPeer => names::STREAM_MEMCPY_P2P,
        CopyKind::Other => names::STREAM_MEMCPY_OTHER,
    }
}

fn copy_kind_words(kind: CopyKind) -> (&'static str, &'static str) {
    match kind {
        CopyKind::HostToDevice => ("pageable", "device"),
        CopyKind::DeviceToHost => ("device", "pageable"),
        CopyKind::DeviceToDevice | CopyKind::PeerToPeer => ("device", "device"),
        CopyKind::Other => ("unknown", "unknown"),
    }
}

/// `regs:R static_shared:S dynamic_shared:D grid:x,y,z block:x,y,z occ_pct:P`.
pub fn kernel_details(k: &KernelInfo) -> String {
    format!(
        "regs:{} static_shared:{} dynamic_shared:{} grid:{},{},{} block:{},{},{} occ_pct:{}",
        k.registers_per_thread,
        k.static_shared_bytes,
        k.dynamic_shared_bytes,
        k.grid[0],
        k.grid[1],
        k.grid[2],
        k.block[0],
        k.block[1],
        k.block[2],
        k.occupancy_pct
    )
}

/// Launch configuration that identifies one `kernel_details` string.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct KernelKey([u32; 10]);

impl KernelKey {
    fn of(k: &KernelInfo) -> KernelKey {
        KernelKey([
            k.registers_per_thread,
            k.static_shared_bytes,
            k.dynamic_shared_bytes,
            k.occupancy_pct.to_bits(),
            k.grid[0],
            k.grid[1],
            k.grid[2],
            k.block[0],
            k.block[1],
            k.block[2],
        ])
    }
}

/// What identifies a memcpy or memset details string.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum DetailsKey {
    Copy(u64, u8, bool, u16),
    Set(u64, bool),
}

/// The stats the builder writes, so that their metadata ids can live in an
/// array instead of a map lookup per stat.
#[derive(Clone, Copy)]
enum Stat {
    StepNum,
    RootLevel,
    StepId,
    CorrelationId,
    DeviceId,
    ContextId,
    KernelDetails,
    MemcpyDetails,
    MemsetDetails,
    TfOp,
    AllocatorName,
    BytesReserved,
    BytesAllocated,
    BytesAvailable,
    Fragmentation,
    PeakBytesInUse,
    RequestedBytes,
    AllocationBytes,
    Address,
    RegionType,
    DataType,
    Shape,
    CounterValue,
    DeviceVendor,
    GpuDeviceName,
    ClockRate,
    CoreCount,
    MemoryBandwidth,
    MemorySize,
    ComputeCapMajor,
    ComputeCapMinor,
    ProfileStartTime,
    ProfileStopTime,
    ProfileOptions,
    DroppedTraces,
    DroppedBeforeRing,
    DroppedNewest,
    DroppedOldest,
    RpcStatus,
    RpcRequestBytes,
    RpcResponseBytes,
    RpcRequestMessages,
    RpcResponseMessages,
    RpcUndecoded,
    RpcSession,
    RpcFetches,
    RpcTargets,
    RpcGraphNodes,
    RpcPayloadBytes,
    RpcOpsEnqueued,
    RpcHandlesReleased,
    RpcWaitedOps,
    EagerOpId,
    EagerDevice,
    EagerContextId,
    Pid,
    Tid,
    Cpu,
    TaskState,
    WokenBy,
    CudaResult,
    Grid,
    Block,
    SharedMemBytes,
    Stream,
    Bytes,
    Function,
    Kernel,
    CudaGraphId,
    CudaGraphNodeId,
    DeviceLaunched,
}

const STAT_COUNT: usize = Stat::DeviceLaunched as usize + 1;

impl Stat {
    fn name(self) -> &'static str {
        match self {
            Stat::StepNum => stat::STEP_NUM,
            Stat::RootLevel => stat::ROOT_LEVEL,
            Stat::StepId => stat::STEP_ID,
            Stat::CorrelationId => stat::CORRELATION_ID,
            Stat::DeviceId => stat::DEVICE_ID,
            Stat::ContextId => stat::CONTEXT_ID,
            Stat::KernelDetails => stat::KERNEL_DETAILS,
            Stat::MemcpyDetails => stat::MEMCPY_DETAILS,
            Stat::MemsetDetails => stat::MEMSET_DETAILS,
            Stat::TfOp => stat::TF_OP,
            Stat::AllocatorName => stat::ALLOCATOR_NAME,
            Stat::BytesReserved => stat::BYTES_RESERVED,
            Stat::BytesAllocated => stat::BYTES_ALLOCATED,
            Stat::BytesAvailable => stat::BYTES_AVAILABLE,
            Stat::Fragmentation => stat::FRAGMENTATION,
            Stat::PeakBytesInUse => stat::PEAK_BYTES_IN_USE,
            Stat::RequestedBytes => stat::REQUESTED_BYTES,
            Stat::AllocationBytes => stat::ALLOCATION_BYTES,
            Stat::Address => stat::ADDRESS,
            Stat::RegionType => stat::REGION_TYPE,
            Stat::DataType => stat::DATA_TYPE,
            Stat::Shape => stat::SHAPE,
            Stat::CounterValue => stat::COUNTER_VALUE,
            Stat::DeviceVendor => stat::DEVICE_VENDOR,
            Stat::GpuDeviceName => stat::GPU_DEVICE_NAME,
            Stat::ClockRate => stat::CLOCK_RATE,
            Stat::CoreCount => stat::CORE_COUNT,
            Stat::MemoryBandwidth => stat::MEMORY_BANDWIDTH,
            Stat::MemorySize => stat::MEMORY_SIZE,
            Stat::ComputeCapMajor => stat::COMPUTE_CAP_MAJOR,
            Stat::ComputeCapMinor => stat::COMPUTE_CAP_MINOR,
            Stat::ProfileStartTime => stat::PROFILE_START_TIME,
            Stat::ProfileStopTime => stat::PROFILE_STOP_TIME,
            Stat::ProfileOptions => stat::PROFILE_OPTIONS,
            Stat::DroppedTraces => stat::DROPPED_TRACES,
            Stat::DroppedBeforeRing => stat::DROPPED_BEFORE_RING,
            Stat::DroppedNewest => stat::DROPPED_NEWEST,
            Stat::DroppedOldest => stat::DROPPED_OLDEST,
            Stat::RpcStatus => stat::RPC_STATUS,
            Stat::RpcRequestBytes => stat::RPC_REQUEST_BYTES,
            Stat::RpcResponseBytes => stat::RPC_RESPONSE_BYTES,
            Stat::RpcRequestMessages => stat::RPC_REQUEST_MESSAGES,
            Stat::RpcResponseMessages => stat::RPC_RESPONSE_MESSAGES,
            Stat::RpcUndecoded => stat::RPC_UNDECODED,
            Stat::RpcSession => stat::RPC_SESSION,
            Stat::RpcFetches => stat::RPC_FETCHES,
            Stat::RpcTargets => stat::RPC_TARGETS,
            Stat::RpcGraphNodes => stat::RPC_GRAPH_NODES,
            Stat::RpcPayloadBytes => stat::RPC_PAYLOAD_BYTES,
            Stat::RpcOpsEnqueued => stat::RPC_OPS_ENQUEUED,
            Stat::RpcHandlesReleased => stat::RPC_HANDLES_RELEASED,
            Stat::RpcWaitedOps => stat::RPC_WAITED_OPS,
            Stat::EagerOpId => stat::EAGER_OP_ID,
            Stat::EagerDevice => stat::EAGER_DEVICE,
            Stat::EagerContextId => stat::EAGER_CONTEXT_ID,
            Stat::Pid => stat::PID,
            Stat::Tid => stat::TID,
            Stat::Cpu => stat::CPU,
            Stat::TaskState => stat::TASK_STATE,
            Stat::WokenBy => stat::WOKEN_BY,
            Stat::CudaResult => stat::CUDA_RESULT,
            Stat::Grid => stat::GRID,
            Stat::Block => stat::BLOCK,
            Stat::SharedMemBytes => stat::SHARED_MEM_BYTES,
            Stat::Stream => stat::STREAM,
            Stat::Bytes => stat::BYTES,
            Stat::Function => stat::FUNCTION,
            Stat::Kernel => stat::KERNEL,
            Stat::CudaGraphId => stat::CUDA_GRAPH_ID,
            Stat::CudaGraphNodeId => stat::CUDA_GRAPH_NODE_ID,
            Stat::DeviceLaunched => stat::DEVICE_LAUNCHED,
        }
    }
}

/// A stat value in the oneof case XProf reads for it.
enum Value<'a> {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    /// Id of the stat metadata whose name is the string value.
    Ref(i64),
}

/// One plane's metadata tables; written after its lines.
struct PlaneTables<'r> {
    registry: &'r RegistrySnapshot,
    /// Stat metadata in id order (id = index + 1).
    stat_names: Vec<String>,
    stat_ids: HashMap<String, i64>,
    fixed: [i64; STAT_COUNT],
    /// Stat metadata id of the kernels' context name (0 = not yet used).
    context_ref: i64,
    /// Stat metadata id of each interned name used as a ref value.
    name_refs: Vec<i64>,
    kernel_refs: HashMap<KernelKey, i64>,
    detail_refs: HashMap<DetailsKey, i64>,
    /// Event metadata id of each event name (0 = not yet in this plane).
    event_ids: Vec<i64>,
    event_names: Vec<NameId>,
    plane_stats: Vec<u8>,
    /// What the tables hold, counted as each entry is added (an entry's
    /// strings, its map slot, and room for its vectors to double).
    bytes: usize,
}

/// What a map entry costs besides its strings: its slot and its hash table's
/// spare room.
const TABLE_ENTRY_BYTES: usize = 96;

impl<'r> PlaneTables<'r> {
    fn new(registry: &'r RegistrySnapshot) -> Self {
        PlaneTables {
            registry,
            stat_names: Vec::new(),
            stat_ids: HashMap::default(),
            fixed: [0; STAT_COUNT],
            context_ref: 0,
            name_refs: Vec::new(),
            kernel_refs: HashMap::default(),
            detail_refs: HashMap::default(),
            event_ids: Vec::new(),
            event_names: Vec::new(),
            plane_stats: Vec::new(),
            bytes: 0,
        }
    }

    /// The id of the stat metadata called `name`, created on first use.
    fn named(&mut self, name: &str) -> i64 {
        if let Some(id) = self.stat_ids.get(name) {
            return *id;
        }
        self.stat_names.push(name.to_string());
        let id = self.stat_names.len() as i64;
        self.stat_ids.insert(name.to_string(), id);
        self.bytes += 2 * name.len() + TABLE_ENTRY_BYTES;
        id
    }

    #[inline]
    fn id(&mut self, stat: Stat) -> i64 {
        let slot = stat as usize;
        if self.fixed[slot] == 0 {
            self.fixed[slot] = self.named(stat.name());
        }
        self.fixed[slot]
    }

    fn name_ref(&mut self, name: NameId) -> i64 {
        let index = name.0 as usize;
        if index >= self.name_refs.len() {
            self.bytes += 2 * 8 * (index + 1 - self.name_refs.len());
            self.name_refs.resize(index + 1, 0);
        }
        if self.name_refs[index] == 0 {
            self.name_refs[index] = self.named(self.registry.name(name));
        }
        self.name_refs[index]
    }

    fn event_id(&mut self, name: NameId) -> i64 {
        let index = name.0 as usize;
        if index >= self.event_ids.len() {
            self.bytes += 2 * 8 * (index + 1 - self.event_ids.len());
            self.event_ids.resize(index + 1, 0);
        }
        if self.event_ids[index] == 0 {
            self.bytes += 2 * 4;
            self.event_names.push(name);
            self.event_ids[index] = self.event_names.len() as i64;
        }
        self.event_ids[index]
    }

    #[inline]
    fn stat(&mut self, out: &mut Writer, stat: Stat, value: Value) {
        let id = self.id(stat);
        write_stat(out, field::EVENT_STATS, id, value);
    }

    fn event(&mut self, out: &mut Writer, event: &Event, origin_ns: u64) {
        let metadata_id = self.event_id(event.name());
        let open = out.begin(field::LINE_EVENTS, 2);
        out.int(field::EVENT_METADATA_ID, metadata_id);
        out.int(
            field::EVENT_OFFSET_PS,
            (event.start_ns.saturating_sub(origin_ns) as i64).saturating_mul(1000),
        );
        out.int_nonzero(
            field::EVENT_DURATION_PS,
            (event.duration_ns as i64).saturating_mul(1000),
        );
        self.event_stats(out, event);
        out.end(open);
    }

    fn event_stats(&mut self, out: &mut Writer, event: &Event) {
        match event.payload() {
            Payload::Plain => {}
            Payload::Step { step_num } => {
                self.stat(out, Stat::StepNum, Value::Int(step_num));
                self.stat(out, Stat::RootLevel, Value::Int(1));
            }
            Payload::ApiCall {
                correlation_id,
                device_ordinal,
            } => {
                self.stat(out, Stat::CorrelationId, Value::Uint(correlation_id));
                self.stat(out, Stat::DeviceId, Value::Int(i64::from(device_ordinal)));
            }
            Payload::Kernel(kernel) => {
                let key = KernelKey::of(&kernel);
                let details = match self.kernel_refs.get(&key) {
                    Some(id) => *id,
                    None => {
                        let id = self.named(&kernel_details(&kernel));
                        self.kernel_refs.insert(key, id);
                        self.bytes += TABLE_ENTRY_BYTES;
                        id
                    }
                };
                if self.context_ref == 0 {
                    self.context_ref = self.named("$$1");
                }
                let context = self.context_ref;
                self.stat(out, Stat::CorrelationId, Value::Uint(kernel.correlation_id));
                self.stat(out, Stat::KernelDetails, Value::Ref(details));
                self.stat(out, Stat::ContextId, Value::Ref(context));
                if kernel.tf_op != NameId(0) {
                    let op = self.name_ref(kernel.tf_op);
                    self.stat(out, Stat::TfOp, Value::Ref(op));
                }
                if kernel.graph_id != 0 {
                    self.stat(
                        out,
                        Stat::CudaGraphId,
                        Value::Uint(u64::from(kernel.graph_id)),
                    );
                    self.stat(
                        out,
                        Stat::CudaGraphNodeId,
                        Value::Uint(kernel.graph_node_id),
                    );
                }
                if kernel.device_launched {
                    self.stat(out, Stat::DeviceLaunched, Value::Int(1));
                }
            }
            Payload::Memcpy(copy) => {
                let destination = match event.device() {
                    Device::Gpu(ordinal) => ordinal,
                    Device::Host | Device::HostCpus => 0,
                };
                let key = DetailsKey::Copy(copy.bytes, copy.kind as u8, copy.is_async, destination);
                let details = match self.detail_refs.get(&key) {
                    Some(id) => *id,
                    None => {
                        let (src, dst) = copy_kind_words(copy.kind);
                        let text = format!(
                            "kind_src:{src} kind_dst:{dst} size:{} dest:{destination} async:{}",
                            copy.bytes,
                            u8::from(copy.is_async)
                        );
                        let id = self.named(&text);
                        self.detail_refs.insert(key, id);
                        self.bytes += TABLE_ENTRY_BYTES;
                        id
                    }
                };
                self.stat(out, Stat::CorrelationId, Value::Uint(copy.correlation_id));
                self.stat(out, Stat::MemcpyDetails, Value::Ref(details));
                if copy.tf_op != NameId(0) {
                    let op = self.name_ref(copy.tf_op);
                    self.stat(out, Stat::TfOp, Value::Ref(op));
                }
            }
            Payload::Memset(memset) => {
                let key = DetailsKey::Set(memset.bytes, memset.is_async);
                let details = match self.detail_refs.get(&key) {
                    Some(id) => *id,
                    None => {
                        let text = format!(
                            "kind:device num_bytes:{} async:{}",
                            memset.bytes,
                            u8::from(memset.is_async)
                        );
                        let id = self.named(&text);
                        self.detail_refs.insert(key, id);
                        self.bytes += TABLE_ENTRY_BYTES;
                        id
                    }
                };
                self.stat(out, Stat::CorrelationId, Value::Uint(memset.correlation_id));
                self.stat(out, Stat::MemsetDetails, Value::Ref(details));
            }
            Payload::MemoryAllocation(memory) | Payload::MemoryDeallocation(memory) => {
                self.memory_stats(out, &memory)
            }
            Payload::Counter { value } => {
                self.stat(out, Stat::CounterValue, Value::Double(value));
            }
            Payload::Rpc(rpc) => self.rpc_stats(out, &rpc),
            Payload::EagerOp {
                op_id,
                device,
                context_id,
            } => {
                self.stat(out, Stat::EagerOpId, Value::Int(op_id));
                if device.0 != 0 {
                    let device = self.name_ref(device);
                    self.stat(out, Stat::EagerDevice, Value::Ref(device));
                }
                self.stat(out, Stat::EagerContextId, Value::Uint(context_id));
            }
            Payload::CpuSlice {
                pid,
                tid,
                cpu,
                end_state,
            } => {
                self.stat(out, Stat::Pid, Value::Uint(u64::from(pid)));
                self.stat(out, Stat::Tid, Value::Uint(u64::from(tid)));
                self.stat(out, Stat::Cpu, Value::Uint(u64::from(cpu)));
                let state = self.named(&task_state_label(end_state));
                self.stat(out, Stat::TaskState, Value::Ref(state));
            }
            Payload::OffCpu {
                pid,
                tid,
                state,
                waker_tid,
            } => {
                self.stat(out, Stat::Pid, Value::Uint(u64::from(pid)));
                self.stat(out, Stat::Tid, Value::Uint(u64::from(tid)));
                let state = self.named(&task_state_label(state));
                self.stat(out, Stat::TaskState, Value::Ref(state));
                if waker_tid != 0 {
                    self.stat(out, Stat::WokenBy, Value::Uint(u64::from(waker_tid)));
                }
            }
            Payload::DriverCall(call) => self.driver_call_stats(out, &call),
        }
    }

    /// A driver call's arguments; launch geometry only for launches, sizes
    /// and addresses only where the call has them.
    fn driver_call_stats(&mut self, out: &mut Writer, call: &DriverCallInfo) {
        self.stat(out, Stat::Pid, Value::Uint(u64::from(call.pid)));
        if call.result != DriverCallInfo::NOT_RETURNED {
            self.stat(out, Stat::CudaResult, Value::Int(i64::from(call.result)));
        }
        if call.grid != [0; 3] || call.block != [0; 3] {
            let [gx, gy, gz] = call.grid;
            let [bx, by, bz] = call.block;
            let grid = self.named(&format!("{gx},{gy},{gz}"));
            let block = self.named(&format!("{bx},{by},{bz}"));
            self.stat(out, Stat::Grid, Value::Ref(grid));
            self.stat(out, Stat::Block, Value::Ref(block));
            self.stat(
                out,
                Stat::SharedMemBytes,
                Value::Uint(u64::from(call.shared_bytes)),
            );
        }
        if call.kernel != NameId(0) {
            let kernel = self.name_ref(call.kernel);
            self.stat(out, Stat::Kernel, Value::Ref(kernel));
        }
        for (stat, value) in [
            (Stat::Function, call.function),
            (Stat::Stream, call.stream),
            (Stat::Bytes, call.bytes),
        ] {
            if value != 0 {
                self.stat(out, stat, Value::Uint(value));
            }
        }
        if call.address != 0 {
            self.stat(out, Stat::Address, Value::Uint(call.address));
        }
    }

    /// The tap's view of one gRPC call; zero counts and empty names are left out.
    fn rpc_stats(&mut self, out: &mut Writer, rpc: &RpcInfo) {
        self.stat(out, Stat::RpcStatus, Value::Int(i64::from(rpc.status)));
        self.stat(out, Stat::RpcRequestBytes, Value::Uint(rpc.request_bytes));
        self.stat(out, Stat::RpcResponseBytes, Value::Uint(rpc.response_bytes));
        self.stat(
            out,
            Stat::RpcRequestMessages,
            Value::Uint(u64::from(rpc.request_messages)),
        );
        self.stat(
            out,
            Stat::RpcResponseMessages,
            Value::Uint(u64::from(rpc.response_messages)),
        );
        for (stat, name) in [
            (Stat::RpcSession, rpc.session),
            (Stat::RpcFetches, rpc.fetches),
            (Stat::RpcTargets, rpc.targets),
        ] {
            if name.0 != 0 {
                let id = self.name_ref(name);
                self.stat(out, stat, Value::Ref(id));
            }
        }
        for (stat, value) in [
            (Stat::RpcUndecoded, u64::from(rpc.undecoded)),
            (Stat::RpcGraphNodes, u64::from(rpc.graph_nodes)),
            (Stat::RpcPayloadBytes, rpc.payload_bytes),
            (Stat::RpcOpsEnqueued, u64::from(rpc.ops_enqueued)),
            (Stat::RpcHandlesReleased, u64::from(rpc.handles_released)),
            (Stat::RpcWaitedOps, u64::from(rpc.waited_ops)),
        ] {
            if value != 0 {
                self.stat(out, stat, Value::Uint(value));
            }
        }
    }

    /// The allocator stats exactly as XProf's memory profile reads them: int64
    /// for numbers, double for fragmentation, strings by reference.
    fn memory_stats(&mut self, out: &mut Writer, m: &MemoryInfo) {
        let allocator = self.name_ref(m.allocator);
        let tf_op = self.name_ref(m.tf_op);
        let region = self.name_ref(m.region_type);
        let shape = self.name_ref(m.shape);
        self.stat(out, Stat::AllocatorName, Value::Ref(allocator));
        self.stat(out, Stat::BytesReserved, Value::Int(m.bytes_reserved));
        self.stat(out, Stat::BytesAllocated, Value::Int(m.bytes_allocated));
        self.stat(out, Stat::BytesAvailable, Value::Int(m.bytes_available));
        self.stat(out, Stat::Fragmentation, Value::Double(m.fragmentation));
        self.stat(out, Stat::PeakBytesInUse, Value::Int(m.peak_bytes_in_use));
        self.stat(out, Stat::RequestedBytes, Value::Int(m.requested_bytes));
        self.stat(out, Stat::AllocationBytes, Value::Int(m.allocation_bytes));
        self.stat(out, Stat::Address, Value::Int(m.address as i64));
        self.stat(out, Stat::TfOp, Value::Ref(tf_op));
        self.stat(out, Stat::StepId, Value::Int(m.step_id));
        self.stat(out, Stat::RegionType, Value::Ref(region));
        self.stat(out, Stat::DataType, Value::Int(i64::from(m.data_type)));
        self.stat(out, Stat::Shape, Value::Ref(shape));
    }

    /// Plane-level stats are kept aside and written with the metadata.
    fn plane_stat(&mut self, stat: Stat, value: Value) {
        let id = self.id(stat);
        let mut scratch = Writer::default();
        write_stat(&mut scratch, field::PLANE_STATS, id, value);
        self.plane_stats.extend_from_slice(&scratch.into_bytes());
    }

    fn device_stats(&mut self, info: &DeviceInfo) {
        self.plane_stat(Stat::DeviceVendor, Value::Str(&info.vendor));
        self.plane_stat(Stat::GpuDeviceName, Value::Str(&info.model));
        self.plane_stat(Stat::ClockRate, Value::Int(info.clock_rate_khz as i64));
        self.plane_stat(Stat::CoreCount, Value::Int(i64::from(info.core_count)));
        self.plane_stat(
            Stat::MemoryBandwidth,
            Value::Uint(info.memory_bandwidth_bytes_per_s),
        );
        self.plane_stat(Stat::MemorySize, Value::Uint(info.memory_bytes));
        self.plane_stat(
            Stat::ComputeCapMajor,
            Value::Int(i64::from(info.compute_capability.0)),
        );
        self.plane_stat(
            Stat::ComputeCapMinor,
            Value::Int(i64::from(info.compute_capability.1)),
        );
    }

    /// Writes the metadata maps and plane stats that the lines referred to.
    fn finish(self, out: &mut Writer) {
        for (index, name) in self.event_names.iter().enumerate() {
            let id = index as i64 + 1;
            let entry = out.begin(field::PLANE_EVENT_METADATA, 2);
            out.int(field::MAP_KEY, id);
            let value = out.begin(field::MAP_VALUE, 2);
            out.int(field::METADATA_ID, id);
            out.text(field::METADATA_NAME, self.registry.name(*name));
            out.end(value);
            out.end(entry);
        }
        for (index, name) in self.stat_names.iter().enumerate() {
            let id = index as i64 + 1;
            let entry = out.begin(field::PLANE_STAT_METADATA, 2);
            out.int(field::MAP_KEY, id);
            let value = out.begin(field::MAP_VALUE, 2);
            out.int(field::METADATA_ID, id);
            out.text(field::METADATA_NAME, name);
            out.end(value);
            out.end(entry);
        }
        out.raw(&self.plane_stats);
    }
}

fn write_stat(out: &mut Writer, field_number: u32, metadata_id: i64, value: Value) {
    let id = metadata_id as u64;
    match value {
        Value::Int(v) => return out.pair(field_number, id, field::STAT_INT64, v as u64),
        Value::Uint(v) => return out.pair(field_number, id, field::STAT_UINT64, v),
        Value::Ref(v) => return out.pair(field_number, id, field::STAT_REF, v as u64),
        Value::Double(v) => return out.pair_double(field_number, id, field::STAT_DOUBLE, v),
        Value::Str(_) | Value::Bytes(_) => {}
    }
    let open: Open = out.begin(field_number, 1);
    out.int(field::STAT_METADATA_ID, metadata_id);
    match value {
        Value::Int(v) => out.int(field::STAT_INT64, v),
        Value::Uint(v) => out.uint(field::STAT_UINT64, v),
        Value::Double(v) => out.double(field::STAT_DOUBLE, v),
        Value::Str(v) => out.bytes(field::STAT_STR, v.as_bytes()),
        Value::Bytes(v) => out.bytes(field::STAT_BYTES, v),
        Value::Ref(id) => out.uint(field::STAT_REF, id as u64),
    }
    out.end(open);
}

fn task_environment(out: &mut Writer, info: &CaptureInfo) {
    out.int_nonzero(field::PLANE_ID, names::TASK_ENVIRONMENT_PLANE_ID);
    out.text(field::PLANE_NAME, names::TASK_ENVIRONMENT_PLANE);
    let registry = RegistrySnapshot::default();
    let mut plane = PlaneTables::new(&registry);
    let dropped = info.dropped_newest + info.dropped_oldest + info.dropped_before_ring;
    plane.plane_stat(Stat::ProfileStartTime, Value::Uint(info.window.start_ns));
    plane.plane_stat(Stat::ProfileStopTime, Value::Uint(info.window.stop_ns));
    plane.plane_stat(Stat::ProfileOptions, Value::Bytes(&info.profile_options));
    plane.plane_stat(Stat::DroppedTraces, Value::Int(dropped as i64));
    plane.plane_stat(Stat::DroppedNewest, Value::Uint(info.dropped_newest));
    plane.plane_stat(Stat::DroppedOldest, Value::Uint(info.dropped_oldest));
    plane.plane_stat(
        Stat::DroppedBeforeRing,
        Value::Uint(info.dropped_before_ring),
    );
    for (name, value) in &info.properties {
        let id = plane.named(name);
        let mut scratch = Writer::default();
        write_stat(&mut scratch, field::PLANE_STATS, id, Value::Str(value));
        plane.plane_stats.extend_from_slice(&scratch.into_bytes());
    }
    plane.finish(out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mock::{MockConfig, Workload, COMPUTE_STREAM, PYTHON_TID};
    use crate::model::registry::Registry;
    use crate::proto::tensorflow::profiler::{x_event, XLine, XPlane};
    use crate::xspace::read::{event_name, find_stat, StatValue};

    const START: u64 = 1_800_000_000_000_000_000;

    fn mock_space(dropped_newest: u64) -> XSpace {
        let registry = Registry::new();
        let mut workload = Workload::new(&MockConfig::default(), &registry, START);
        let mut events = Vec::new();
        while workload.next_time_ns() < START + 120_000_000 {
            workload.emit_next(&mut |e| events.push(e));
        }
        // Arrival order is not time order.
        events.reverse();
        let info = CaptureInfo {
            window: Window {
                start_ns: START,
                stop_ns: START + 100_000_000,
            },
            hostname: "worker-0".into(),
            profile_options: vec![1, 2, 3],
            dropped_newest,
            ..CaptureInfo::default()
        };
        let window = info.window;
        let inside = events.iter().filter(|e| window.contains(e.start_ns));
        build_xspace(inside, &registry.snapshot(), &info).expect("decodes")
    }

    /// `count` events of the mock on `gpus` GPUs, in the order it made
    /// them, and a capture of the 10 s they fall in.
    fn mock_events(gpus: u16, count: usize) -> (Vec<Event>, std::sync::Arc<Registry>, CaptureInfo) {
        let registry = Registry::new();
        let config = MockConfig {
            gpus,
            ..MockConfig::default()
        };
        let mut workload = Workload::new(&config, &registry, START);
        let mut events = Vec::new();
        while events.len() < count {
            workload.emit_next(&mut |e| events.push(e));
        }
        let info = CaptureInfo {
            window: Window {
                start_ns: START,
                stop_ns: START + 10_000_000_000,
            },
            ..CaptureInfo::default()
        };
        (events, registry, info)
    }

    #[test]
    fn a_windows_sorted_runs_encode_to_the_bytes_of_its_events_sorted() {
        let (events, registry, info) = mock_events(3, 20_000);
        let snapshot = registry.snapshot();
        let whole = encode_xspace(&events, &snapshot, &info).contiguous();
        // Chunks of arrival order, each sorted, overlapping in time.
        let runs: Vec<(u64, std::vec::IntoIter<Event>)> = events
            .chunks(997)
            .map(|chunk| {
                let mut run = chunk.to_vec();
                run.sort_by_key(|e| (e.start_ns, Reverse(e.duration_ns)));
                (run[0].start_ns, run.into_iter())
            })
            .collect();
        let merged = encode_runs(runs, &snapshot, &info, &mut Unlimited)
            .unwrap_or_else(|never| match never {});
        assert_eq!(merged.contiguous(), whole);
        let space = XSpace::decode(whole).expect("decodes");
        assert_eq!(
            space.planes.len(),
            5,
            "host, three GPUs and the environment"
        );
    }

    /// A grant that refuses past `left` bytes, counting what it gave, with
    /// a spill in memory when asked.
    struct Budget {
        left: usize,
        given: usize,
        spills: bool,
    }

    impl Budget {
        fn of(left: usize, spills: bool) -> Budget {
            Budget {
                left,
                given: 0,
                spills,
            }
        }
    }

    impl Grant for Budget {
        type Refusal = usize;

        fn take(&mut self, bytes: usize) -> Result<(), usize> {
            if bytes > self.left {
                return Err(self.given + bytes);
            }
            self.left -= bytes;
            self.given += bytes;
            Ok(())
        }

        fn let_go(&mut self, bytes: usize) {
            self.left += bytes;
            self.given -= bytes;
        }

        fn spill(&mut self) -> Option<Box<dyn Spill<Error = usize> + Send>> {
            self.spills.then(|| {
                Box::new(SpillInMemory(Vec::new())) as Box<dyn Spill<Error = usize> + Send>
            })
        }
    }

    struct SpillInMemory(Vec<u8>);

    impl Spill for SpillInMemory {
        type Error = usize;

        fn append(&mut self, block: &[u8]) -> Result<u64, usize> {
            let at = self.0.len() as u64;
            self.0.extend_from_slice(block);
            Ok(at)
        }

        fn finish(self: Box<Self>) -> Result<Bytes, usize> {
            Ok(Bytes::from(self.0))
        }
    }

    /// A build whose grant gives a tenth of its trace, with somewhere to
    /// spill: the same bytes as a build in memory, most of them spilled and
    /// not counted as held.
    #[test]
    fn a_build_past_its_grant_spills_its_blocks_and_makes_the_same_trace() {
        let (events, registry, info) = mock_events(2, 200_000);
        let snapshot = registry.snapshot();
        let run = || vec![(START, events.clone().into_iter())];
        let whole = encode_runs(run(), &snapshot, &info, &mut Unlimited)
            .unwrap_or_else(|never| match never {});
        let mut tenth = Budget::of(whole.len() / 10, true);
        let spilled = encode_runs(run(), &snapshot, &info, &mut tenth).expect("spilled");
        assert_eq!(spilled.contiguous(), whole.contiguous());
        assert_eq!(spilled.events, whole.events);
        assert!(
            spilled.spilled() > whole.len() * 3 / 4,
            "spilled {} of {}",
            spilled.spilled(),
            whole.len()
        );
        assert!(
            spilled.retained() < whole.len() / 4,
            "{}",
            spilled.retained()
        );
        assert_eq!(whole.spilled(), 0);
        // Without a spill, the same grant stops the build.
        let mut no_spill = Budget::of(whole.len() / 10, false);
        assert!(encode_runs(run(), &snapshot, &info, &mut no_spill).is_err());
    }

    #[test]
    fn a_build_draws_what_it_holds_from_its_grant_and_stops_when_refused() {
        let (events, registry, info) = mock_events(2, 200_000);
        let snapshot = registry.snapshot();
        let run = || vec![(START, events.clone().into_iter())];
        let mut ample = Budget::of(usize::MAX, false);
        let encoded = encode_runs(run(), &snapshot, &info, &mut ample).expect("within");
        // What it drew covers the trace, and not many times over: block
        // slack and tables, not a copy of the events.
        assert!(
            ample.given >= encoded.len(),
            "{} < {}",
            ample.given,
            encoded.len()
        );
        assert!(
            ample.given < encoded.len() + encoded.len() / 4 + (1 << 20),
            "drew {} for a {}-byte trace",
            ample.given,
            encoded.len()
        );
        // What the trace keeps is counted, and within what was drawn.
        assert!(
            encoded.retained() >= encoded.len() && encoded.retained() <= ample.given,
            "retained {} of {} drawn for {}",
            encoded.retained(),
            ample.given,
            encoded.len()
        );
        let mut short = Budget::of(encoded.len() / 2, false);
        let wanted = encode_runs(run(), &snapshot, &info, &mut short).unwrap_err();
        assert!(short.given <= encoded.len() / 2 && wanted > encoded.len() / 2);
    }

    fn plane<'s>(space: &'s XSpace, name: &str) -> &'s XPlane {
        space
            .planes
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no plane {name}"))
    }

    fn line(plane: &XPlane, id: i64) -> &XLine {
        plane.lines.iter().find(|l| l.id == id).expect("line")
    }

    #[test]
    fn planes_follow_xprof_naming_and_ids() {
        let space = mock_space(0);
        let names: Vec<(&str, i64)> = space
            .planes
            .iter()
            .map(|p| (p.name.as_str(), p.id))
            .collect();
        assert_eq!(
            names,
            vec![
                ("/host:CPU", 49),
                ("/device:GPU:0", 0),
                ("/device:GPU:1", 1),
                ("Task Environment", 1000)
            ]
        );
        assert_eq!(space.hostnames, vec!["worker-0".to_string()]);
        for plane in &space.planes {
            for (key, metadata) in &plane.event_metadata {
                assert_eq!(*key, metadata.id);
            }
            for (key, metadata) in &plane.stat_metadata {
                assert_eq!(*key, metadata.id);
                assert_ne!(
                    metadata.name,
                    stat::GROUP_ID,
                    "group_id would disable XProf grouping"
                );
            }
        }
    }

    #[test]
    fn lines_are_relative_sorted_and_named() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        assert_eq!(line(host, PYTHON_TID as i64).name, "python");
        let gpu = plane(&space, "/device:GPU:0");
        assert_eq!(
            line(gpu, COMPUTE_STREAM as i64).name,
            "Stream #7(Compute,Memset)"
        );
        assert_eq!(line(gpu, 13).name, "Stream #13(MemcpyH2D)");
        for plane in &space.planes {
            for line in &plane.lines {
                assert_eq!(line.timestamp_ns, 0);
                let starts: Vec<(i64, i64)> = line
                    .events
                    .iter()
                    .map(|e| match e.data {
                        Some(x_event::Data::OffsetPs(ps)) => (ps, -e.duration_ps),
                        _ => panic!("event without offset"),
                    })
                    .collect();
                assert!(
                    starts.windows(2).all(|w| w[0] <= w[1]),
                    "line {} unsorted",
                    line.name
                );
                assert!(starts
                    .iter()
                    .all(|(ps, _)| (0..100_000_000_000).contains(ps)));
            }
        }
    }

    #[test]
    fn steps_kernels_and_flows_carry_the_stats_xprof_reads() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        let python = line(host, PYTHON_TID as i64);
        let step = python
            .events
            .iter()
            .find(|e| event_name(host, e) == "train")
            .expect("a step");
        assert_eq!(
            find_stat(host, &step.stats, "step_num"),
            Some(StatValue::Int(0))
        );
        assert_eq!(find_stat(host, &step.stats, "_r"), Some(StatValue::Int(1)));
        let launch = python
            .events
            .iter()
            .find(|e| event_name(host, e) == "cudaLaunchKernel")
            .expect("a launch");
        let Some(StatValue::Uint(correlation)) = find_stat(host, &launch.stats, "correlation_id")
        else {
            panic!("correlation_id must be uint64 for XProf's flows");
        };
        let gpu = plane(&space, "/device:GPU:0");
        let kernel = line(gpu, COMPUTE_STREAM as i64)
            .events
            .iter()
            .find(|e| {
                find_stat(gpu, &e.stats, "correlation_id") == Some(StatValue::Uint(correlation))
            })
            .expect("the launched kernel");
        assert_eq!(event_name(gpu, kernel), "volta_h884gemm_64x64_ldg8_nn");
        assert_eq!(
            find_stat(gpu, &kernel.stats, "kernel_details"),
            Some(StatValue::Str(
                "regs:128 static_shared:0 dynamic_shared:32768 grid:16,8,1 block:256,1,1 occ_pct:25".into()
            ))
        );
        assert_eq!(
            find_stat(gpu, &kernel.stats, "tf_op"),
            Some(StatValue::Str("model/dense/MatMul:MatMul".into()))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "compute_cap_major"),
            Some(StatValue::Int(8))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "core_count"),
            Some(StatValue::Int(108))
        );
        assert_eq!(
            find_stat(gpu, &gpu.stats, "memory_size"),
            Some(StatValue::Uint(40 << 30))
        );
        let copy = line(gpu, 13).events.first().expect("a copy");
        assert_eq!(
            find_stat(gpu, &copy.stats, "memcpy_details"),
            Some(StatValue::Str(
                "kind_src:pageable kind_dst:device size:25165824 dest:0 async:1".into()
            ))
        );
    }

    #[test]
    fn memory_events_use_the_oneof_cases_the_memory_profile_reads() {
        let space = mock_space(0);
        let host = plane(&space, "/host:CPU");
        let allocation = host
            .lines
            .iter()
            .flat_map(|l| &l.events)
            .find(|e| event_name(host, e) == "MemoryAllocation")
            .expect("an allocation");
        for name in [
            "bytes_reserved",
            "bytes_allocated",
            "bytes_available",
            "peak_bytes_in_use",
            "requested_bytes",
            "allocation_bytes",
            "addr",
            "data_type",
        ] {
            assert!(
                matches!(
                    find_stat(host, &allocation.stats, name),
                    Some(StatValue::Int(_))
                ),
                "{name} must be int64"
            );
        }
        assert!(matches!(
            find_stat(host, &allocation.stats, "fragmentation"),
            Some(StatValue::Double(_))
        ));
        assert_eq!(
            find_stat(host, &allocation.stats, "allocator_name"),
            Some(StatValue::Str("GPU_0_bfc".into()))
        );
        assert_eq!(
            find_stat(host, &allocation.stats, "shape"),
            Some(StatValue::Str("[256,2048]".into()))
        );
        assert_eq!(allocation.duration_ps, 0);
    }

    #[test]
    fn task_environment_records_the_window_options_and_drops() {
        let space = mock_space(7);
        let env = plane(&space, "Task Environment");
        assert_eq!(
            find_stat(env, &env.stats, "profile_start_time"),
            Some(StatValue::Uint(START))
        );
        assert_eq!(
            find_stat(env, &env.stats, "profile_stop_time"),
            Some(StatValue::Uint(START + 100_000_000))
        );
        assert_eq!(
            find_stat(env, &env.stats, "profile_options"),
            Some(StatValue::Bytes(vec![1, 2, 3]))
        );
        assert_eq!(
            find_stat(env, &env.stats, "dropped_traces"),
            Some(StatValue::Int(7))
        );
        assert!(space
            .warnings
            .iter()
            .any(|w| w.contains("dropped 7 events")));
        assert!(mock_space(0).warnings.is_empty());
    }

    #[test]
    fn an_empty_window_still_has_a_host_plane_and_is_empty() {
        let info = CaptureInfo {
            hostname: "h".into(),
            ..CaptureInfo::default()
        };
        let space = build_xspace(
            std::iter::empty::<Event>(),
            &RegistrySnapshot::default(),
            &info,
        )
        .expect("decodes");
        assert!(is_empty(&space));
        assert_eq!(space.planes[0].name, "/host:CPU");
    }
}
