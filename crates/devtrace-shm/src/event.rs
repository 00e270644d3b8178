//! The fixed-size event record that travels from a backend through a ring into
//! the store, and the typed payloads it carries.
//!
//! An [`Event`] is 128 bytes of plain integers (16 machine words), so that it can
//! be copied word by word into a ring that may live in shared memory between
//! processes. Strings never travel inside an event: they are interned once in the
//! [`crate::registry::Registry`] and referred to by [`NameId`].

/// Number of 64-bit words in one encoded event.
pub const EVENT_WORDS: usize = 16;
/// Number of payload words after the 4-word header.
pub const PAYLOAD_WORDS: usize = 12;

/// An interned string; 0 is the empty string.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NameId(pub u32);

/// Which timeline owner (XSpace plane) an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host threads: the `/host:CPU` plane.
    Host,
    /// The host's CPUs as the scheduler used them: the `/host:CPUs` plane,
    /// one line per CPU and one per thread's off-CPU time.
    HostCpus,
    /// A GPU by ordinal: the `/device:GPU:<n>` plane.
    Gpu(u16),
}

impl Device {
    const GPU_TAG: u16 = 0x1000;
    const HOST_CPUS: u16 = 0x2000;

    fn encode(self) -> u16 {
        match self {
            Device::Host => 0,
            Device::HostCpus => Self::HOST_CPUS,
            Device::Gpu(ordinal) => Self::GPU_TAG | (ordinal & 0x0fff),
        }
    }

    fn decode(raw: u16) -> Device {
        match raw & 0xf000 {
            Self::GPU_TAG => Device::Gpu(raw & 0x0fff),
            Self::HOST_CPUS => Device::HostCpus,
            _ => Device::Host,
        }
    }
}

/// Direction of a memory copy, as CUPTI distinguishes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    PeerToPeer,
    Other,
}

impl CopyKind {
    fn encode(self) -> u64 {
        match self {
            CopyKind::HostToDevice => 1,
            CopyKind::DeviceToHost => 2,
            CopyKind::DeviceToDevice => 3,
            CopyKind::PeerToPeer => 4,
            CopyKind::Other => 0,
        }
    }

    fn decode(raw: u64) -> CopyKind {
        match raw {
            1 => CopyKind::HostToDevice,
            2 => CopyKind::DeviceToHost,
            3 => CopyKind::DeviceToDevice,
            4 => CopyKind::PeerToPeer,
            _ => CopyKind::Other,
        }
    }
}

/// Launch configuration and resources of a GPU kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KernelInfo {
    pub correlation_id: u64,
    pub registers_per_thread: u32,
    pub static_shared_bytes: u32,
    pub dynamic_shared_bytes: u32,
    pub occupancy_pct: f32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Framework op that launched the kernel (`name:Type`), or 0.
    pub tf_op: NameId,
    /// The CUDA graph this kernel ran as a node of (0: launched directly).
    pub graph_id: u32,
    pub graph_node_id: u64,
    /// Launched from the device (CUDA 13's device-side graph launch).
    pub device_launched: bool,
}

/// A host-to-device, device-to-host or device-to-device copy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyInfo {
    pub correlation_id: u64,
    pub bytes: u64,
    pub kind: CopyKind,
    pub is_async: bool,
    pub tf_op: NameId,
}

/// A device memset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemsetInfo {
    pub correlation_id: u64,
    pub bytes: u64,
    pub is_async: bool,
    pub tf_op: NameId,
}

/// One allocator event with every statistic XProf's memory profile reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryInfo {
    pub allocator: NameId,
    pub tf_op: NameId,
    pub region_type: NameId,
    pub shape: NameId,
    /// TensorFlow `DataType` enum number (1 = float, ...).
    pub data_type: u32,
    pub bytes_reserved: i64,
    pub bytes_allocated: i64,
    pub bytes_available: i64,
    pub fragmentation: f64,
    pub peak_bytes_in_use: i64,
    pub requested_bytes: i64,
    pub allocation_bytes: i64,
    pub address: u64,
    pub step_id: i64,
}

/// The running in-use and peak bytes of one allocator seen from outside it
/// (a driver's allocations seen by uprobes or by CUPTI): each allocation or
/// free becomes the [`MemoryInfo`] the memory profile plots.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AllocatorTally {
    pub allocator: NameId,
    in_use: i64,
    peak: i64,
}

impl AllocatorTally {
    pub fn new(allocator: NameId) -> AllocatorTally {
        AllocatorTally {
            allocator,
            ..AllocatorTally::default()
        }
    }

    /// Counts `bytes` allocated at `address`; the statistics after it.
    pub fn allocate(&mut self, address: u64, bytes: u64) -> MemoryInfo {
        self.in_use = self.in_use.saturating_add(bytes as i64);
        self.peak = self.peak.max(self.in_use);
        self.info(address, bytes)
    }

    /// Counts `bytes` freed at `address` (never below zero: a free of memory
    /// allocated before anyone watched has no known size).
    pub fn free(&mut self, address: u64, bytes: u64) -> MemoryInfo {
        self.in_use = self.in_use.saturating_sub(bytes as i64).max(0);
        self.info(address, bytes)
    }

    fn info(&self, address: u64, bytes: u64) -> MemoryInfo {
        MemoryInfo {
            allocator: self.allocator,
            bytes_allocated: self.in_use,
            peak_bytes_in_use: self.peak,
            requested_bytes: bytes as i64,
            allocation_bytes: bytes as i64,
            address,
            ..MemoryInfo::default()
        }
    }
}

/// One gRPC call seen by the tap (`crate::tap`): its outcome, sizes and the
/// facts decoded from TensorFlow's MasterService and EagerService messages.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RpcInfo {
    /// gRPC status code (0 = OK).
    pub status: u32,
    /// Bytes of gRPC messages (prefix included) in each direction.
    pub request_bytes: u64,
    pub response_bytes: u64,
    pub request_messages: u32,
    pub response_messages: u32,
    /// Messages forwarded without being decoded (compressed, malformed).
    pub undecoded: u32,
    /// Session handle (MasterService) or eager context id, as a string.
    pub session: NameId,
    /// Comma-separated fetch names of a RunStep.
    pub fetches: NameId,
    /// Comma-separated target names of a RunStep.
    pub targets: NameId,
    /// Nodes of a CreateSession/ExtendSession graph.
    pub graph_nodes: u32,
    /// Bytes of the graph of a CreateSession, or of the tensors of a SendTensor.
    pub payload_bytes: u64,
    /// Eager operations enqueued and tensor handles released by the call.
    pub ops_enqueued: u32,
    pub handles_released: u32,
    /// Op ids a WaitQueueDone waited for.
    pub waited_ops: u32,
}

/// A CUDA driver API call seen by a uprobe, with the arguments that matter
/// for its kind (zero where they do not apply).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DriverCallInfo {
    pub pid: u32,
    /// The `CUresult` it returned, or [`DriverCallInfo::NOT_RETURNED`].
    pub result: i32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    /// Kernel name when the launch's function handle was resolved, or 0.
    pub kernel: NameId,
    pub stream: u64,
    pub bytes: u64,
    /// Device address allocated, freed or copied to.
    pub address: u64,
    /// `CUfunction` handle of a launch.
    pub function: u64,
}

impl DriverCallInfo {
    /// The result of a call probed at entry only: not known.
    pub const NOT_RETURNED: i32 = i32::MIN;
}

/// What an event is, with the fields that kind carries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Payload {
    /// A plain span or instant with nothing beyond its name.
    Plain,
    /// A training step: grouped by XProf through `step_num` and `_r = 1`.
    Step {
        step_num: i64,
    },
    /// A host-side driver or runtime API call that launched device work.
    ApiCall {
        correlation_id: u64,
        device_ordinal: u32,
    },
    Kernel(KernelInfo),
    Memcpy(CopyInfo),
    Memset(MemsetInfo),
    MemoryAllocation(MemoryInfo),
    MemoryDeallocation(MemoryInfo),
    /// A sample of a counter track (the event name is the counter's name).
    Counter {
        value: f64,
    },
    /// A gRPC call forwarded by the tap; the event name is the method.
    Rpc(RpcInfo),
    /// A remote eager operation enqueued through the tap; the event name is
    /// the op's name.
    EagerOp {
        op_id: i64,
        device: NameId,
        context_id: u64,
    },
    /// A thread running on a CPU (a `/host:CPUs` CPU line); the event name
    /// is the thread's command name.
    CpuSlice {
        pid: u32,
        tid: u32,
        cpu: u32,
        /// Task state the thread left the CPU in (0 = preempted).
        end_state: u32,
    },
    /// A thread off its CPU, from switching out to switching back in.
    OffCpu {
        pid: u32,
        tid: u32,
        /// Task state it switched out in (0 = preempted while runnable).
        state: u32,
        /// Thread that woke it, or 0 when no wakeup was seen.
        waker_tid: u32,
    },
    DriverCall(DriverCallInfo),
}

impl Payload {
    fn tag(&self) -> u16 {
        match self {
            Payload::Plain => 0,
            Payload::Step { .. } => 1,
            Payload::ApiCall { .. } => 2,
            Payload::Kernel(_) => 3,
            Payload::Memcpy(_) => 4,
            Payload::Memset(_) => 5,
            Payload::MemoryAllocation(_) => 6,
            Payload::MemoryDeallocation(_) => 7,
            Payload::Counter { .. } => 8,
            Payload::Rpc(_) => 9,
            Payload::EagerOp { .. } => 10,
            Payload::CpuSlice { .. } => 11,
            Payload::OffCpu { .. } => 12,
            Payload::DriverCall(_) => 13,
        }
    }
}

/// One timestamped record: 16 plain words, so that moving it through a ring
/// is a copy. The payload stays encoded until someone asks for it with
/// [`Event::payload`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// Start, Unix nanoseconds (see [`crate::clock`]).
    pub start_ns: u64,
    /// Zero for instants.
    pub duration_ns: u64,
    /// Thread id on the host, stream id on a GPU, or a counter track id.
    pub line: u64,
    device: u16,
    tag: u16,
    name: u32,
    payload: [u64; PAYLOAD_WORDS],
}

fn pack(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

fn unpack(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}

impl Payload {
    fn encode(&self) -> [u64; PAYLOAD_WORDS] {
        let mut p = [0u64; PAYLOAD_WORDS];
        match *self {
            Payload::Plain => {}
            Payload::Step { step_num } => p[0] = step_num as u64,
            Payload::ApiCall {
                correlation_id,
                device_ordinal,
            } => {
                p[0] = correlation_id;
                p[1] = u64::from(device_ordinal);
            }
            Payload::Kernel(k) => {
                p[0] = k.correlation_id;
                p[1] = pack(k.registers_per_thread, k.static_shared_bytes);
                p[2] = pack(k.dynamic_shared_bytes, k.occupancy_pct.to_bits());
                p[3] = pack(k.grid[0], k.grid[1]);
                p[4] = pack(k.grid[2], k.block[0]);
                p[5] = pack(k.block[1], k.block[2]);
                p[6] = u64::from(k.tf_op.0);
                p[7] = u64::from(k.graph_id) | (u64::from(k.device_launched) << 32);
                p[8] = k.graph_node_id;
            }
            Payload::Memcpy(c) => {
                p[0] = c.correlation_id;
                p[1] = c.bytes;
                p[2] = c.kind.encode() | (u64::from(c.is_async) << 8);
                p[3] = u64::from(c.tf_op.0);
            }
            Payload::Memset(m) => {
                p[0] = m.correlation_id;
                p[1] = m.bytes;
                p[2] = u64::from(m.is_async);
                p[3] = u64::from(m.tf_op.0);
            }
            Payload::MemoryAllocation(m) | Payload::MemoryDeallocation(m) => {
                p[0] = pack(m.allocator.0, m.tf_op.0);
                p[1] = pack(m.region_type.0, m.shape.0);
                p[2] = u64::from(m.data_type);
                p[3] = m.bytes_reserved as u64;
                p[4] = m.bytes_allocated as u64;
                p[5] = m.bytes_available as u64;
                p[6] = m.fragmentation.to_bits();
                p[7] = m.peak_bytes_in_use as u64;
                p[8] = m.requested_bytes as u64;
                p[9] = m.allocation_bytes as u64;
                p[10] = m.address;
                p[11] = m.step_id as u64;
            }
            Payload::Counter { value } => p[0] = value.to_bits(),
            Payload::Rpc(r) => {
                p[0] = pack(r.status, r.undecoded);
                p[1] = r.request_bytes;
                p[2] = r.response_bytes;
                p[3] = pack(r.request_messages, r.response_messages);
                p[4] = pack(r.session.0, r.fetches.0);
                p[5] = pack(r.targets.0, r.graph_nodes);
                p[6] = r.payload_bytes;
                p[7] = pack(r.ops_enqueued, r.handles_released);
                p[8] = u64::from(r.waited_ops);
            }
            Payload::EagerOp {
                op_id,
                device,
                context_id,
            } => {
                p[0] = op_id as u64;
                p[1] = u64::from(device.0);
                p[2] = context_id;
            }
            Payload::CpuSlice {
                pid,
                tid,
                cpu,
                end_state,
            } => {
                p[0] = pack(pid, tid);
                p[1] = pack(cpu, end_state);
            }
            Payload::OffCpu {
                pid,
                tid,
                state,
                waker_tid,
            } => {
                p[0] = pack(pid, tid);
                p[1] = pack(state, waker_tid);
            }
            Payload::DriverCall(d) => {
                p[0] = pack(d.pid, d.result as u32);
                p[1] = pack(d.grid[0], d.grid[1]);
                p[2] = pack(d.grid[2], d.block[0]);
                p[3] = pack(d.block[1], d.block[2]);
                p[4] = pack(d.shared_bytes, d.kernel.0);
                p[5] = d.stream;
                p[6] = d.bytes;
                p[7] = d.address;
                p[8] = d.function;
            }
        }
        p
    }

    /// Decodes words written by [`Payload::encode`]. An unknown tag (a newer
    /// producer) decodes as [`Payload::Plain`] rather than failing.
    fn decode(tag: u16, p: &[u64; PAYLOAD_WORDS]) -> Payload {
        let memory = || {
            let (allocator, tf_op) = unpack(p[0]);
            let (region_type, shape) = unpack(p[1]);
            MemoryInfo {
                allocator: NameId(allocator),
                tf_op: NameId(tf_op),
                region_type: NameId(region_type),
                shape: NameId(shape),
                data_type: p[2] as u32,
                bytes_reserved: p[3] as i64,
                bytes_allocated: p[4] as i64,
                bytes_available: p[5] as i64,
                fragmentation: f64::from_bits(p[6]),
                peak_bytes_in_use: p[7] as i64,
                requested_bytes: p[8] as i64,
                allocation_bytes: p[9] as i64,
                address: p[10],
                step_id: p[11] as i64,
            }
        };
        match tag {
            1 => Payload::Step {
                step_num: p[0] as i64,
            },
            2 => Payload::ApiCall {
                correlation_id: p[0],
                device_ordinal: p[1] as u32,
            },
            3 => {
                let (registers_per_thread, static_shared_bytes) = unpack(p[1]);
                let (dynamic_shared_bytes, occupancy_bits) = unpack(p[2]);
                let (gx, gy) = unpack(p[3]);
                let (gz, bx) = unpack(p[4]);
                let (by, bz) = unpack(p[5]);
                Payload::Kernel(KernelInfo {
                    correlation_id: p[0],
                    registers_per_thread,
                    static_shared_bytes,
                    dynamic_shared_bytes,
                    occupancy_pct: f32::from_bits(occupancy_bits),
                    grid: [gx, gy, gz],
                    block: [bx, by, bz],
                    tf_op: NameId(p[6] as u32),
                    graph_id: p[7] as u32,
                    device_launched: (p[7] >> 32) & 1 == 1,
                    graph_node_id: p[8],
                })
            }
            4 => Payload::Memcpy(CopyInfo {
                correlation_id: p[0],
                bytes: p[1],
                kind: CopyKind::decode(p[2] & 0xff),
                is_async: (p[2] >> 8) & 1 == 1,
                tf_op: NameId(p[3] as u32),
            }),
            5 => Payload::Memset(MemsetInfo {
                correlation_id: p[0],
                bytes: p[1],
                is_async: p[2] & 1 == 1,
                tf_op: NameId(p[3] as u32),
            }),
            6 => Payload::MemoryAllocation(memory()),
            7 => Payload::MemoryDeallocation(memory()),
            8 => Payload::Counter {
                value: f64::from_bits(p[0]),
            },
            9 => {
                let (status, undecoded) = unpack(p[0]);
                let (request_messages, response_messages) = unpack(p[3]);
                let (session, fetches) = unpack(p[4]);
                let (targets, graph_nodes) = unpack(p[5]);
                let (ops_enqueued, handles_released) = unpack(p[7]);
                Payload::Rpc(RpcInfo {
                    status,
                    request_bytes: p[1],
                    response_bytes: p[2],
                    request_messages,
                    response_messages,
                    undecoded,
                    session: NameId(session),
                    fetches: NameId(fetches),
                    targets: NameId(targets),
                    graph_nodes,
                    payload_bytes: p[6],
                    ops_enqueued,
                    handles_released,
                    waited_ops: p[8] as u32,
                })
            }
            10 => Payload::EagerOp {
                op_id: p[0] as i64,
                device: NameId(p[1] as u32),
                context_id: p[2],
            },
            11 => {
                let (pid, tid) = unpack(p[0]);
                let (cpu, end_state) = unpack(p[1]);
                Payload::CpuSlice {
                    pid,
                    tid,
                    cpu,
                    end_state,
                }
            }
            12 => {
                let (pid, tid) = unpack(p[0]);
                let (state, waker_tid) = unpack(p[1]);
                Payload::OffCpu {
                    pid,
                    tid,
                    state,
                    waker_tid,
                }
            }
            13 => {
                let (pid, result) = unpack(p[0]);
                let (gx, gy) = unpack(p[1]);
                let (gz, bx) = unpack(p[2]);
                let (by, bz) = unpack(p[3]);
                let (shared_bytes, kernel) = unpack(p[4]);
                Payload::DriverCall(DriverCallInfo {
                    pid,
                    result: result as i32,
                    grid: [gx, gy, gz],
                    block: [bx, by, bz],
                    shared_bytes,
                    kernel: NameId(kernel),
                    stream: p[5],
                    bytes: p[6],
                    address: p[7],
                    function: p[8],
                })
            }
            _ => Payload::Plain,
        }
    }
}

fn map_memory(mut m: MemoryInfo, map: &mut impl FnMut(NameId) -> NameId) -> MemoryInfo {
    m.allocator = map(m.allocator);
    m.tf_op = map(m.tf_op);
    m.region_type = map(m.region_type);
    m.shape = map(m.shape);
    m
}

impl Event {
    pub fn new(
        start_ns: u64,
        duration_ns: u64,
        device: Device,
        line: u64,
        name: NameId,
        payload: Payload,
    ) -> Event {
        Event {
            start_ns,
            duration_ns,
            line,
            device: device.encode(),
            tag: payload.tag(),
            name: name.0,
            payload: payload.encode(),
        }
    }

    pub fn device(&self) -> Device {
        Device::decode(self.device)
    }

    /// Moves the event to another plane (a process's CUDA ordinal to its
    /// physical GPU's plane).
    pub fn set_device(&mut self, device: Device) {
        self.device = device.encode();
    }

    pub fn name(&self) -> NameId {
        NameId(self.name)
    }

    /// The typed payload, decoded from its words.
    pub fn payload(&self) -> Payload {
        Payload::decode(self.tag, &self.payload)
    }

    /// The same event with its name and every name in its payload passed
    /// through `map`: how events from another process, whose names are ids
    /// of that process, join this agent's registry.
    pub fn map_names(&self, mut map: impl FnMut(NameId) -> NameId) -> Event {
        let payload = match self.payload() {
            Payload::Kernel(mut k) => {
                k.tf_op = map(k.tf_op);
                Payload::Kernel(k)
            }
            Payload::Memcpy(mut c) => {
                c.tf_op = map(c.tf_op);
                Payload::Memcpy(c)
            }
            Payload::Memset(mut m) => {
                m.tf_op = map(m.tf_op);
                Payload::Memset(m)
            }
            Payload::MemoryAllocation(m) => Payload::MemoryAllocation(map_memory(m, &mut map)),
            Payload::MemoryDeallocation(m) => Payload::MemoryDeallocation(map_memory(m, &mut map)),
            Payload::Rpc(mut r) => {
                r.session = map(r.session);
                r.fetches = map(r.fetches);
                r.targets = map(r.targets);
                Payload::Rpc(r)
            }
            Payload::EagerOp {
                op_id,
                device,
                context_id,
            } => Payload::EagerOp {
                op_id,
                device: map(device),
                context_id,
            },
            Payload::DriverCall(mut d) => {
                d.kernel = map(d.kernel);
                Payload::DriverCall(d)
            }
            other => other,
        };
        Event::new(
            self.start_ns,
            self.duration_ns,
            self.device(),
            self.line,
            map(self.name()),
            payload,
        )
    }

    /// True for counter samples, without decoding the payload.
    pub fn is_counter(&self) -> bool {
        self.tag == Payload::Counter { value: 0.0 }.tag()
    }

    /// True for step markers, without decoding the payload.
    pub fn is_step(&self) -> bool {
        self.tag == Payload::Step { step_num: 0 }.tag()
    }

    /// End of the event, Unix nanoseconds.
    pub fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.duration_ns)
    }

    /// The 16 words a ring slot holds.
    #[inline]
    pub fn to_words(&self) -> [u64; EVENT_WORDS] {
        let mut w = [0u64; EVENT_WORDS];
        w[0] = self.start_ns;
        w[1] = self.duration_ns;
        w[2] = self.line;
        w[3] = u64::from(self.device) | (u64::from(self.tag) << 16) | (u64::from(self.name) << 32);
        w[4..].copy_from_slice(&self.payload);
        w
    }

    /// The inverse of [`Event::to_words`]; every bit pattern is an event.
    #[inline]
    pub fn from_words(w: &[u64; EVENT_WORDS]) -> Event {
        let mut payload = [0u64; PAYLOAD_WORDS];
        payload.copy_from_slice(&w[4..]);
        Event {
            start_ns: w[0],
            duration_ns: w[1],
            line: w[2],
            device: w[3] as u16,
            tag: (w[3] >> 16) as u16,
            name: (w[3] >> 32) as u32,
            payload,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(payload: Payload) {
        let event = Event::new(
            1_700_000_000_123_456_789,
            4_321,
            Device::Gpu(3),
            7,
            NameId(42),
            payload,
        );
        let copied = Event::from_words(&event.to_words());
        assert_eq!(copied, event);
        assert_eq!(copied.payload(), payload);
        assert_eq!(copied.device(), Device::Gpu(3));
        assert_eq!(copied.name(), NameId(42));
    }

    #[test]
    fn a_tally_keeps_in_use_and_peak_bytes_and_never_goes_negative() {
        let mut tally = AllocatorTally::new(NameId(3));
        assert_eq!(tally.allocate(0x10, 100).bytes_allocated, 100);
        let second = tally.allocate(0x20, 50);
        assert_eq!(
            (second.bytes_allocated, second.peak_bytes_in_use),
            (150, 150)
        );
        let freed = tally.free(0x10, 100);
        assert_eq!(
            (
                freed.bytes_allocated,
                freed.peak_bytes_in_use,
                freed.allocation_bytes
            ),
            (50, 150, 100)
        );
        assert_eq!((freed.allocator, freed.address), (NameId(3), 0x10));
        assert_eq!(tally.free(0x30, 500).bytes_allocated, 0);
    }

    #[test]
    fn mapping_names_reaches_every_name_in_the_payload() {
        let memory = MemoryInfo {
            allocator: NameId(1),
            tf_op: NameId(2),
            region_type: NameId(3),
            shape: NameId(4),
            bytes_allocated: 9,
            ..MemoryInfo::default()
        };
        let event = Event::new(
            5,
            6,
            Device::Gpu(1),
            7,
            NameId(8),
            Payload::MemoryAllocation(memory),
        );
        let mapped = event.map_names(|n| NameId(n.0 + 100));
        assert_eq!(mapped.name(), NameId(108));
        let Payload::MemoryAllocation(m) = mapped.payload() else {
            panic!()
        };
        assert_eq!(
            (
                m.allocator,
                m.tf_op,
                m.region_type,
                m.shape,
                m.bytes_allocated
            ),
            (NameId(101), NameId(102), NameId(103), NameId(104), 9)
        );
        assert_eq!(
            (
                mapped.start_ns,
                mapped.duration_ns,
                mapped.line,
                mapped.device()
            ),
            (5, 6, 7, Device::Gpu(1))
        );
    }

    #[test]
    fn every_payload_survives_the_word_encoding() {
        round_trip(Payload::Plain);
        round_trip(Payload::Step { step_num: -5 });
        round_trip(Payload::ApiCall {
            correlation_id: u64::MAX,
            device_ordinal: 1,
        });
        round_trip(Payload::Kernel(KernelInfo {
            correlation_id: 9,
            registers_per_thread: 64,
            static_shared_bytes: 1024,
            dynamic_shared_bytes: 2048,
            occupancy_pct: 37.5,
            grid: [1, 2, 3],
            block: [128, 1, 1],
            tf_op: NameId(5),
            graph_id: 77,
            graph_node_id: u64::MAX - 1,
            device_launched: true,
        }));
        round_trip(Payload::Memcpy(CopyInfo {
            correlation_id: 1,
            bytes: 1 << 40,
            kind: CopyKind::DeviceToHost,
            is_async: true,
            tf_op: NameId(2),
        }));
        round_trip(Payload::Memset(MemsetInfo {
            correlation_id: 3,
            bytes: 77,
            is_async: false,
            tf_op: NameId(0),
        }));
        let memory = MemoryInfo {
            allocator: NameId(1),
            tf_op: NameId(2),
            region_type: NameId(3),
            shape: NameId(4),
            data_type: 19,
            bytes_reserved: 10,
            bytes_allocated: -20,
            bytes_available: 30,
            fragmentation: 0.25,
            peak_bytes_in_use: 40,
            requested_bytes: 50,
            allocation_bytes: 60,
            address: 0xdead_beef_0000,
            step_id: 12,
        };
        round_trip(Payload::MemoryAllocation(memory));
        round_trip(Payload::MemoryDeallocation(memory));
        round_trip(Payload::Counter { value: -1.5 });
        round_trip(Payload::Rpc(RpcInfo {
            status: 14,
            request_bytes: 5 << 32,
            response_bytes: 7,
            request_messages: 3,
            response_messages: 2,
            undecoded: 1,
            session: NameId(8),
            fetches: NameId(9),
            targets: NameId(10),
            graph_nodes: 11,
            payload_bytes: 12,
            ops_enqueued: 13,
            handles_released: 14,
            waited_ops: 15,
        }));
        round_trip(Payload::EagerOp {
            op_id: -3,
            device: NameId(4),
            context_id: u64::MAX,
        });
        round_trip(Payload::CpuSlice {
            pid: 7,
            tid: u32::MAX,
            cpu: 255,
            end_state: 0x402,
        });
        round_trip(Payload::OffCpu {
            pid: 1,
            tid: 2,
            state: 1,
            waker_tid: 99,
        });
        round_trip(Payload::DriverCall(DriverCallInfo {
            pid: 40,
            result: -1,
            grid: [1, 2, 3],
            block: [4, 5, 6],
            shared_bytes: 4096,
            kernel: NameId(12),
            stream: u64::MAX,
            bytes: 1 << 40,
            address: 0x7f00_0000_0000,
            function: 0xdead_beef,
        }));
    }

    #[test]
    fn an_event_is_exactly_sixteen_words() {
        assert_eq!(std::mem::size_of::<Event>(), 8 * EVENT_WORDS);
    }

    #[test]
    fn host_and_gpu_devices_keep_their_identity() {
        assert_eq!(Device::decode(Device::Host.encode()), Device::Host);
        assert_eq!(Device::decode(Device::HostCpus.encode()), Device::HostCpus);
        assert_eq!(
            Device::decode(Device::Gpu(4095).encode()),
            Device::Gpu(4095)
        );
    }
}
