//! Where events go on the timeline: the plane and line names and ids XProf
//! looks up (matched as exact strings by its converters, so they live here,
//! once, and tests pin them), the line ids backends put counters and XID
//! errors on, and the labels of scheduler states. Backends and the XSpace
//! builder both read it; it depends on nothing of theirs.

/// Host threads plane; the memory profile reads only this exact name.
pub const HOST_PLANE: &str = "/host:CPU";
/// TensorFlow's id for the host plane.
pub const HOST_PLANE_ID: i64 = 49;
/// The scheduler's view of the host's CPUs. XProf's trace viewer shows every
/// plane whose name starts with `/host:CPU`, and nothing reads this one as the
/// host-threads plane, which must be exactly [`HOST_PLANE`].
pub const HOST_CPUS_PLANE: &str = "/host:CPUs";
pub const HOST_CPUS_PLANE_ID: i64 = 48;
/// Line ids of per-thread off-CPU lines on [`HOST_CPUS_PLANE`] are the thread
/// id with this bit set, apart from the CPU lines (ids = CPU numbers) even
/// after XProf casts line ids to 32 bits.
pub const THREAD_LINE_BIT: u64 = 1 << 30;

pub fn cpu_line_name(cpu: u64) -> String {
    format!("CPU {cpu}")
}

/// Plane with the session's environment (start, stop, options).
pub const TASK_ENVIRONMENT_PLANE: &str = "Task Environment";
/// An id that no device ordinal reaches.
pub const TASK_ENVIRONMENT_PLANE_ID: i64 = 1000;

/// `/device:GPU:<ordinal>`; the plane id is the ordinal.
pub fn gpu_plane_name(ordinal: u16) -> String {
    format!("/device:GPU:{ordinal}")
}

/// Counter tracks live on a line with this name and id.
pub const COUNTERS_LINE: &str = "_counters_";
pub const COUNTERS_LINE_ID: i64 = i64::MAX;
/// A GPU's line of XID error instants (NVML).
pub const XID_LINE: &str = "XID errors";
pub const XID_LINE_ID: i64 = i64::MAX - 1;

/// Stream line labels for each kind of device activity, in display order.
pub const STREAM_COMPUTE: &str = "Compute";
pub const STREAM_MEMCPY_H2D: &str = "MemcpyH2D";
pub const STREAM_MEMCPY_D2H: &str = "MemcpyD2H";
pub const STREAM_MEMCPY_D2D: &str = "MemcpyD2D";
pub const STREAM_MEMCPY_P2P: &str = "MemcpyP2P";
pub const STREAM_MEMCPY_OTHER: &str = "MemcpyOther";
pub const STREAM_MEMSET: &str = "Memset";
pub const STREAM_KIND_ORDER: [&str; 7] = [
    STREAM_COMPUTE,
    STREAM_MEMCPY_H2D,
    STREAM_MEMCPY_D2H,
    STREAM_MEMCPY_D2D,
    STREAM_MEMCPY_P2P,
    STREAM_MEMCPY_OTHER,
    STREAM_MEMSET,
];

/// `Stream #<id>(<kinds>)`, as CUPTI's collector names stream lines.
/// GPU line ids carry the stream in their low bits and, for streams of
/// workload processes (`crate::backend::cuda`), the process's slot above.
pub const STREAM_BITS: u32 = 24;

pub fn stream_of_line(line: u64) -> u64 {
    line & ((1 << STREAM_BITS) - 1)
}

pub fn stream_line_name(stream: u64, kinds: &[&str]) -> String {
    if kinds.is_empty() {
        format!("Stream #{stream}")
    } else {
        format!("Stream #{stream}({})", kinds.join(","))
    }
}

/// Stat names (XStatMetadata.name) that XProf resolves to stat types.
pub mod stat {
    pub const STEP_NUM: &str = "step_num";
    pub const ROOT_LEVEL: &str = "_r";
    pub const STEP_ID: &str = "id";
    pub const CORRELATION_ID: &str = "correlation_id";
    pub const DEVICE_ID: &str = "device_id";
    pub const CONTEXT_ID: &str = "context_id";
    pub const KERNEL_DETAILS: &str = "kernel_details";
    pub const MEMCPY_DETAILS: &str = "memcpy_details";
    pub const MEMSET_DETAILS: &str = "Memset_details";
    pub const TF_OP: &str = "tf_op";
    /// The CUDA graph a kernel ran in (XLA's name for it) and its node.
    pub const CUDA_GRAPH_ID: &str = "cuda_graph_id";
    pub const CUDA_GRAPH_NODE_ID: &str = "cuda_graph_node_id";
    /// A kernel launched from the device rather than the host.
    pub const DEVICE_LAUNCHED: &str = "device_launched";
    pub const ALLOCATOR_NAME: &str = "allocator_name";
    pub const BYTES_RESERVED: &str = "bytes_reserved";
    pub const BYTES_ALLOCATED: &str = "bytes_allocated";
    pub const BYTES_AVAILABLE: &str = "bytes_available";
    pub const FRAGMENTATION: &str = "fragmentation";
    pub const PEAK_BYTES_IN_USE: &str = "peak_bytes_in_use";
    pub const REQUESTED_BYTES: &str = "requested_bytes";
    pub const ALLOCATION_BYTES: &str = "allocation_bytes";
    pub const ADDRESS: &str = "addr";
    pub const REGION_TYPE: &str = "region_type";
    pub const DATA_TYPE: &str = "data_type";
    pub const SHAPE: &str = "shape";
    pub const COUNTER_VALUE: &str = "value";
    pub const DEVICE_VENDOR: &str = "device_vendor";
    pub const GPU_DEVICE_NAME: &str = "gpu_device_name";
    pub const CLOCK_RATE: &str = "clock_rate";
    pub const CORE_COUNT: &str = "core_count";
    pub const MEMORY_BANDWIDTH: &str = "memory_bandwidth";
    pub const MEMORY_SIZE: &str = "memory_size";
    pub const COMPUTE_CAP_MAJOR: &str = "compute_cap_major";
    pub const COMPUTE_CAP_MINOR: &str = "compute_cap_minor";
    pub const PROFILE_START_TIME: &str = "profile_start_time";
    pub const PROFILE_STOP_TIME: &str = "profile_stop_time";
    pub const PROFILE_OPTIONS: &str = "profile_options";
    pub const DROPPED_TRACES: &str = "dropped_traces";
    pub const DROPPED_NEWEST: &str = "devtrace_dropped_newest";
    /// Events lost before they reached the agent's ring (a full BPF ring
    /// buffer, records CUPTI dropped in a workload, a workload's full ring).
    pub const DROPPED_BEFORE_RING: &str = "devtrace_dropped_before_ring";
    pub const DROPPED_OLDEST: &str = "devtrace_dropped_oldest";
    /// Written on the tap's RPC and eager-op events (`crate::tap`).
    pub const RPC_STATUS: &str = "grpc_status";
    pub const RPC_REQUEST_BYTES: &str = "request_bytes";
    pub const RPC_RESPONSE_BYTES: &str = "response_bytes";
    pub const RPC_REQUEST_MESSAGES: &str = "request_messages";
    pub const RPC_RESPONSE_MESSAGES: &str = "response_messages";
    pub const RPC_UNDECODED: &str = "undecoded_messages";
    pub const RPC_SESSION: &str = "session";
    pub const RPC_FETCHES: &str = "fetches";
    pub const RPC_TARGETS: &str = "targets";
    pub const RPC_GRAPH_NODES: &str = "graph_nodes";
    pub const RPC_PAYLOAD_BYTES: &str = "payload_bytes";
    pub const RPC_OPS_ENQUEUED: &str = "ops_enqueued";
    pub const RPC_HANDLES_RELEASED: &str = "handles_released";
    pub const RPC_WAITED_OPS: &str = "waited_ops";
    pub const EAGER_OP_ID: &str = "op_id";
    pub const EAGER_DEVICE: &str = "device";
    pub const EAGER_CONTEXT_ID: &str = "eager_context_id";
    // Scheduler and driver-call events (devtrace's own; XProf shows them as
    // arguments).
    pub const PID: &str = "pid";
    pub const TID: &str = "tid";
    pub const CPU: &str = "cpu";
    pub const TASK_STATE: &str = "state";
    pub const WOKEN_BY: &str = "woken_by_tid";
    pub const CUDA_RESULT: &str = "result";
    pub const GRID: &str = "grid";
    pub const BLOCK: &str = "block";
    pub const SHARED_MEM_BYTES: &str = "shared_mem_bytes";
    pub const STREAM: &str = "stream";
    pub const BYTES: &str = "bytes";
    pub const FUNCTION: &str = "function";
    pub const KERNEL: &str = "kernel";
    /// Never written: its presence makes XProf skip step grouping.
    pub const GROUP_ID: &str = "group_id";
}

/// Event names with meaning to XProf.
pub mod event {
    pub const MEMORY_ALLOCATION: &str = "MemoryAllocation";
    pub const MEMORY_DEALLOCATION: &str = "MemoryDeallocation";
}

/// Line id under which counter samples are grouped.
pub const COUNTER_TRACK: u64 = u64::MAX;
/// Line id of a GPU's XID error instants.
pub const XID_TRACK: u64 = u64::MAX - 1;

/// `CpuSlice::end_state` of a slice cut while its thread still ran.
pub const STILL_RUNNING: u32 = u32::MAX;

/// What the name of a thread's off-CPU span begins with (`off-CPU: S
/// (sleeping)`): a state of the thread, not work it did.
pub const OFF_CPU_PREFIX: &str = "off-CPU: ";

/// A scheduler task state as `ps` letters it, with a word.
pub fn task_state_label(state: u32) -> std::borrow::Cow<'static, str> {
    const INTERRUPTIBLE: u32 = 0x1;
    const UNINTERRUPTIBLE: u32 = 0x2;
    const STOPPED: u32 = 0x4;
    const TRACED: u32 = 0x8;
    const DEAD: u32 = 0x10 | 0x20 | 0x80;
    const PARKED: u32 = 0x40;
    const NOLOAD: u32 = 0x400;
    const FROZEN: u32 = 0x8000;
    let label = match state {
        STILL_RUNNING => "R (still running)",
        0 => "R (preempted)",
        s if s & UNINTERRUPTIBLE != 0 && s & NOLOAD != 0 => "I (idle)",
        s if s & INTERRUPTIBLE != 0 => "S (sleeping)",
        s if s & UNINTERRUPTIBLE != 0 => "D (uninterruptible)",
        s if s & STOPPED != 0 => "T (stopped)",
        s if s & TRACED != 0 => "t (traced)",
        s if s & DEAD != 0 => "X (exiting)",
        s if s & PARKED != 0 => "P (parked)",
        s if s & FROZEN != 0 => "frozen",
        s => return format!("state 0x{s:x}").into(),
    };
    label.into()
}
