//! CUPTI activity records to devtrace events: kernels, copies and memsets on
//! `/device:GPU:<n>` stream lines; driver and runtime calls, NVTX ranges and
//! allocations on host lines; device facts and names as metadata records.
//!
//! Records are read field by field through [`RecordRef`], by the layout of
//! the running libcupti's API version ([`crate::cupti::layout`]); fields a
//! version lacks read as absent. Kernel names are demangled with the C++
//! runtime's `__cxa_demangle` when the process has one (framework profilers
//! show them that way too).

use std::collections::HashMap;

use devtrace_shm::device::DeviceInfo;
use devtrace_shm::event::{
    AllocatorTally, CopyInfo, CopyKind, Device, Event, KernelInfo, MemsetInfo, NameId, Payload,
};
use devtrace_shm::workload::{MetaRecord, LINE_MEMORY, LINE_OVERHEAD, LINE_SYNCHRONIZATION};

use crate::clock::ClockMap;
use crate::cupti::layout::{self, RecordRef};
use crate::cupti::{api_calls, kind};
use crate::timed_calls::TimedCall;
use crate::unanswered::Unanswered;

/// Said once per process when records carry a clock neither CUPTI's nor
/// one registered through the library ([`crate::clock`]).
const UNKNOWN_CLOCK: &str = "CUPTI stamps this process's records with a clock that is neither its \
own nor one registered through the library (a profiler registered a clock of its own for CUPTI's \
records before the library was loaded, and not the CPU's time-stamp counter, which the library \
would recognise); they cannot be placed on the host clock, and the agent drops them as events \
outside what its recorder holds";

/// Said once per process when its records turn out to carry the CPU's
/// time-stamp counter, registered unseen ([`crate::clock`]).
const COUNTER_ADOPTED: &str = "CUPTI stamps this process's records with the CPU's time-stamp \
counter, registered for them before the library could see it (as torch.profiler does, run before \
the library was loaded): the library maps them by that counter";

/// Device work whose record CUPTI handed back unfinished: a forced flush
/// while it ran or waited to run gives its record no end (0), and CUPTI
/// never completes it. Such records are not placed; they are counted, and
/// told per buffer ([`Converter::end_buffer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Unfinished {
    kernels: u64,
    /// Copies and memsets.
    other: u64,
    /// The earliest start among those that had started (host clock).
    earliest_start_ns: Option<u64>,
}

impl Unfinished {
    fn note(&mut self, kernel: bool, started_ns: Option<u64>) {
        if kernel {
            self.kernels += 1;
        } else {
            self.other += 1;
        }
        if let Some(started_ns) = started_ns {
            self.earliest_start_ns = Some(
                self.earliest_start_ns
                    .map_or(started_ns, |earliest| earliest.min(started_ns)),
            );
        }
    }
}

/// What occupancy needs to know about a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_warps: u32,
    pub max_blocks: u32,
    pub max_registers: u32,
    pub max_shared: u32,
    pub warp_size: u32,
}

/// Theoretical occupancy in percent: resident warps over the SM's maximum,
/// limited by warps, blocks, registers and shared memory (without the
/// hardware's allocation granularity).
fn occupancy(limits: &Limits, threads: u32, registers: u32, shared: u32) -> f32 {
    if limits.max_warps == 0 || threads == 0 {
        return 0.0;
    }
    let warp = limits.warp_size.max(1);
    let warps = threads.div_ceil(warp);
    let mut blocks = (limits.max_warps / warps).min(limits.max_blocks.max(1));
    if let Some(by_registers) = limits.max_registers.checked_div(registers * warps * warp) {
        blocks = blocks.min(by_registers);
    }
    if let Some(by_shared) = limits.max_shared.checked_div(shared) {
        blocks = blocks.min(by_shared);
    }
    (blocks * warps) as f32 * 100.0 / limits.max_warps as f32
}

const MARKER_INSTANT: u32 = 1;
const MARKER_START: u32 = 2;
const MARKER_END: u32 = 4;
const OBJECT_KIND_THREAD: u32 = 2;

/// See the module documentation. Names are ids of this process; each new
/// one is queued as a metadata record, to be written before the events that
/// use it are pushed.
pub struct Converter {
    pid: u32,
    /// The running libcupti's API version, which decides record layouts.
    version: u32,
    pub clock: ClockMap,
    names: HashMap<String, u32>,
    api_names: HashMap<(bool, u32), NameId>,
    limits: HashMap<u32, Limits>,
    /// Allocations per device.
    memory: HashMap<u32, AllocatorTally>,
    markers: HashMap<u32, (u64, NameId, u32)>,
    pending_meta: Vec<MetaRecord>,
    /// Looks up CUPTI's name for an API callback id (driver or runtime).
    callback_name: fn(bool, u32) -> Option<String>,
    /// Kernel records converted so far.
    kernels: u64,
    /// CUPTI's API records converted (not the calls the library timed).
    api_records: u64,
    /// The latest start of a kernel converted (host clock).
    latest_kernel_ns: u64,
    /// Whether a record on a clock the map does not know was told of.
    told_unknown_clock: bool,
    /// Whether the CPU's time-stamp counter was tried for such a record.
    tried_counter: bool,
    /// The capture's launches whose GPU work has not come back.
    pub unanswered: Unanswered,
    /// Device records of the buffer being converted that came back
    /// unfinished.
    unfinished: Unfinished,
}

impl Converter {
    pub fn new(
        pid: u32,
        version: u32,
        callback_name: fn(bool, u32) -> Option<String>,
    ) -> Converter {
        Converter {
            pid,
            version,
            clock: ClockMap::default(),
            names: HashMap::new(),
            api_names: HashMap::new(),
            limits: HashMap::new(),
            memory: HashMap::new(),
            markers: HashMap::new(),
            pending_meta: Vec::new(),
            callback_name,
            kernels: 0,
            api_records: 0,
            latest_kernel_ns: 0,
            told_unknown_clock: false,
            tried_counter: false,
            unanswered: Unanswered::default(),
            unfinished: Unfinished::default(),
        }
    }

    /// A buffer CUPTI handed back at `handed_back_ns` is converted: the
    /// device records in it that came back unfinished are told (queued as
    /// a metadata record).
    pub fn end_buffer(&mut self, handed_back_ns: u64) {
        let unfinished = std::mem::take(&mut self.unfinished);
        if unfinished == Unfinished::default() {
            return;
        }
        self.pending_meta.push(MetaRecord::Unfinished {
            from_ns: unfinished
                .earliest_start_ns
                .map_or(handed_back_ns, |started| started.min(handed_back_ns)),
            at_ns: handed_back_ns,
            kernels: unfinished.kernels,
            other: unfinished.other,
        });
    }

    /// Whether the record's work is unfinished (see [`Unfinished`]): then
    /// it is counted, and not to be placed.
    fn unfinished(&mut self, kernel: bool, start: u64, end: u64) -> bool {
        if end != 0 {
            return false;
        }
        let started_ns = (start != 0).then(|| self.clock.realtime(start));
        self.unfinished.note(kernel, started_ns);
        true
    }

    /// The limits of device `ordinal` as the driver gives them, for kernels
    /// converted before CUPTI's DEVICE record of it (which takes over).
    pub fn know_limits(&mut self, ordinal: u32, limits: Limits) {
        self.limits.entry(ordinal).or_insert(limits);
    }

    /// Kernel records converted so far.
    pub fn kernels_converted(&self) -> u64 {
        self.kernels
    }

    /// CUPTI's API records converted so far.
    pub fn api_records_converted(&self) -> u64 {
        self.api_records
    }

    /// When the latest kernel converted so far started (host clock).
    pub fn latest_kernel_ns(&self) -> u64 {
        self.latest_kernel_ns
    }

    /// Whether the limits of some device are known.
    pub fn knows_limits(&self) -> bool {
        !self.limits.is_empty()
    }

    /// Metadata records to write before the events converted so far.
    pub fn take_meta(&mut self) -> Vec<MetaRecord> {
        std::mem::take(&mut self.pending_meta)
    }

    fn name(&mut self, text: &str) -> NameId {
        if let Some(id) = self.names.get(text) {
            return NameId(*id);
        }
        let id = self.names.len() as u32 + 1;
        self.names.insert(text.to_string(), id);
        self.pending_meta.push(MetaRecord::Name {
            id,
            text: text.to_string(),
        });
        NameId(id)
    }

    /// Converts the record at `record` (a complete record of a completed
    /// buffer) and appends what it becomes to `out`. Unknown kinds are
    /// skipped.
    pub fn convert(&mut self, record: *const u8, out: &mut Vec<Event>) {
        let first = out.len();
        self.convert_record(record, out);
        let Some(event) = out.get(first) else {
            return;
        };
        // A time CUPTI could not take is written as 0, no clock's (mapped
        // only for a time already found implausible: this runs per record).
        if self.clock.plausible(event.start_ns) || event.start_ns == self.clock.realtime(0) {
            return;
        }
        if !self.tried_counter {
            self.tried_counter = true;
            let ticks = self.clock.cupti_ticks_at(event.start_ns);
            if crate::clock::adopt_time_stamp_counter(ticks) {
                self.clock.follow_registered();
                self.pending_meta.push(MetaRecord::Warning {
                    message: COUNTER_ADOPTED.into(),
                });
                out.truncate(first);
                self.convert_record(record, out);
                return;
            }
        }
        if !self.told_unknown_clock {
            self.told_unknown_clock = true;
            self.pending_meta.push(MetaRecord::Warning {
                message: UNKNOWN_CLOCK.into(),
            });
        }
    }

    fn convert_record(&mut self, record: *const u8, out: &mut Vec<Event>) {
        // SAFETY: the caller passes a complete record of a buffer CUPTI of
        // this version completed.
        let r = unsafe { RecordRef::new(record, self.version) };
        match r.kind() {
            kind::KERNEL | kind::CONCURRENT_KERNEL => self.kernel(r, out),
            kind::MEMCPY => self.memcpy(r, out),
            kind::MEMSET => self.memset(r, out),
            kind::MEMORY2 => self.memory(r, out),
            kind::DRIVER => self.api(r, false, out),
            kind::RUNTIME => self.api(r, true, out),
            kind::DEVICE => self.device(r),
            kind::OVERHEAD => self.overhead(r, out),
            kind::SYNCHRONIZATION => self.synchronization(r, out),
            kind::MARKER => self.marker(r, out),
            _ => {}
        }
    }

    fn span(&self, start: u64, end: u64) -> (u64, u64) {
        let start_ns = self.clock.realtime(start);
        (start_ns, self.clock.realtime(end).saturating_sub(start_ns))
    }

    fn kernel(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::kernel as k;
        self.kernels += 1;
        let name = r
            .string(k::NAME)
            .map(|mangled| demangle(&mangled))
            .unwrap_or_else(|| "<unnamed kernel>".into());
        let name = self.name(&name);
        let device: u32 = r.read(k::DEVICE_ID);
        let dims = |fields: [layout::Field; 3]| fields.map(|f| r.read::<i32>(f).max(0) as u32);
        let grid = dims([k::GRID_X, k::GRID_Y, k::GRID_Z]);
        let block = dims([k::BLOCK_X, k::BLOCK_Y, k::BLOCK_Z]);
        let registers = u32::from(r.read::<u16>(k::REGISTERS_PER_THREAD));
        let static_shared = r.read::<i32>(k::STATIC_SHARED_MEMORY).max(0) as u32;
        let dynamic_shared = r.read::<i32>(k::DYNAMIC_SHARED_MEMORY).max(0) as u32;
        let occupancy_pct = self.limits.get(&device).map_or(0.0, |limits| {
            occupancy(
                limits,
                block.iter().product(),
                registers,
                static_shared + dynamic_shared,
            )
        });
        let correlation_id = r.read::<u32>(k::CORRELATION_ID);
        let (raw_start, raw_end) = (r.read(k::START), r.read(k::END));
        if self.unfinished(true, raw_start, raw_end) {
            // Its launch was answered: the kernel is not lost to another
            // user, only its times.
            self.unanswered.answered(correlation_id, 0);
            return;
        }
        let (start, duration) = self.span(raw_start, raw_end);
        self.latest_kernel_ns = self.latest_kernel_ns.max(start);
        self.unanswered
            .answered(correlation_id, start.saturating_add(duration));
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(device as u16),
            u64::from(r.read::<u32>(k::STREAM_ID)),
            name,
            Payload::Kernel(KernelInfo {
                correlation_id: u64::from(correlation_id),
                registers_per_thread: registers,
                static_shared_bytes: static_shared,
                dynamic_shared_bytes: dynamic_shared,
                occupancy_pct,
                grid,
                block,
                tf_op: NameId(0),
                graph_id: r.read(k::GRAPH_ID),
                graph_node_id: r.read(k::GRAPH_NODE_ID),
                device_launched: r.read_since::<u8>(k::IS_DEVICE_LAUNCHED).unwrap_or(0) != 0,
            }),
        ));
    }

    fn memcpy(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::memcpy as m;
        let (kind, label) = match r.read::<u8>(m::COPY_KIND) {
            1 => (CopyKind::HostToDevice, "MemcpyH2D"),
            2 => (CopyKind::DeviceToHost, "MemcpyD2H"),
            8 => (CopyKind::DeviceToDevice, "MemcpyD2D"),
            10 => (CopyKind::PeerToPeer, "MemcpyP2P"),
            _ => (CopyKind::Other, "MemcpyOther"),
        };
        let correlation_id = r.read::<u32>(m::CORRELATION_ID);
        // A graph's copy carries its launch's id.
        self.unanswered.work_came_back(correlation_id);
        let (raw_start, raw_end) = (r.read(m::START), r.read(m::END));
        if self.unfinished(false, raw_start, raw_end) {
            return;
        }
        let name = self.name(label);
        let (start, duration) = self.span(raw_start, raw_end);
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(r.read::<u32>(m::DEVICE_ID) as u16),
            u64::from(r.read::<u32>(m::STREAM_ID)),
            name,
            Payload::Memcpy(CopyInfo {
                correlation_id: u64::from(correlation_id),
                bytes: r.read(m::BYTES),
                kind,
                is_async: r.read::<u8>(m::FLAGS) & 1 != 0,
                tf_op: NameId(0),
            }),
        ));
    }

    fn memset(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::memset as m;
        let correlation_id = r.read::<u32>(m::CORRELATION_ID);
        self.unanswered.work_came_back(correlation_id);
        let (raw_start, raw_end) = (r.read(m::START), r.read(m::END));
        if self.unfinished(false, raw_start, raw_end) {
            return;
        }
        let name = self.name("Memset");
        let (start, duration) = self.span(raw_start, raw_end);
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(r.read::<u32>(m::DEVICE_ID) as u16),
            u64::from(r.read::<u32>(m::STREAM_ID)),
            name,
            Payload::Memset(MemsetInfo {
                correlation_id: u64::from(correlation_id),
                bytes: r.read(m::BYTES),
                is_async: r.read::<u16>(m::FLAGS) & 1 != 0,
                tf_op: NameId(0),
            }),
        ));
    }

    /// Allocations and frees per device, with the in-use and peak bytes
    /// XProf's memory profile plots.
    fn memory(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::memory as m;
        let device: u32 = r.read(m::DEVICE_ID);
        let bytes: u64 = r.read(m::BYTES);
        let address: u64 = r.read(m::ADDRESS);
        let allocating = match r.read::<u32>(m::OPERATION_TYPE) {
            1 => true,
            2 => false,
            _ => return,
        };
        if !self.memory.contains_key(&device) {
            let allocator = self.name(&format!("GPU_{device}_cuda (pid {})", self.pid));
            self.memory.insert(device, AllocatorTally::new(allocator));
        }
        let Some(tally) = self.memory.get_mut(&device) else {
            return;
        };
        let (name, payload) = if allocating {
            let info = tally.allocate(address, bytes);
            ("MemoryAllocation", Payload::MemoryAllocation(info))
        } else {
            let info = tally.free(address, bytes);
            ("MemoryDeallocation", Payload::MemoryDeallocation(info))
        };
        let name = self.name(name);
        out.push(Event::new(
            self.clock.realtime(r.read(m::TIMESTAMP)),
            0,
            Device::Host,
            LINE_MEMORY,
            name,
            payload,
        ));
    }

    fn api(&mut self, r: RecordRef, runtime: bool, out: &mut Vec<Event>) {
        use layout::api as a;
        self.api_records += 1;
        let (start, duration) = self.span(r.read(a::START), r.read(a::END));
        let name = self.api_name(runtime, r.read(a::CBID));
        out.push(api_event(
            start,
            duration,
            r.read(a::THREAD_ID),
            name,
            r.read(a::CORRELATION_ID),
        ));
    }

    /// A timeline call the library timed itself (on the host clock).
    pub fn timed_call(&mut self, call: &TimedCall, out: &mut Vec<Event>) {
        // A launch into a graph being captured, or one that failed, ran
        // nothing to come back.
        if api_calls::launches_gpu_work(call.runtime, call.cbid)
            && !call.in_stream_capture
            && !call.failed
        {
            self.unanswered.launched(call.correlation_id, call.start_ns);
        }
        let name = self.api_name(call.runtime, call.cbid);
        out.push(api_event(
            call.start_ns,
            call.end_ns.saturating_sub(call.start_ns),
            call.thread,
            name,
            call.correlation_id,
        ));
    }

    /// CUPTI's name for a driver (`runtime` false) or runtime callback id.
    fn api_name(&mut self, runtime: bool, cbid: u32) -> NameId {
        if let Some(name) = self.api_names.get(&(runtime, cbid)) {
            return *name;
        }
        let text = (self.callback_name)(runtime, cbid).unwrap_or_else(|| {
            format!(
                "cuda {} api {cbid}",
                if runtime { "runtime" } else { "driver" }
            )
        });
        let name = self.name(&text);
        self.api_names.insert((runtime, cbid), name);
        name
    }

    fn device(&mut self, r: RecordRef) {
        use layout::device as d;
        let ordinal: u32 = r.read(d::ID);
        self.limits.insert(
            ordinal,
            Limits {
                max_warps: r.read(d::MAX_WARPS_PER_MULTIPROCESSOR),
                max_blocks: r.read(d::MAX_BLOCKS_PER_MULTIPROCESSOR),
                max_registers: r.read(d::MAX_REGISTERS_PER_MULTIPROCESSOR),
                max_shared: r.read(d::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
                warp_size: r.read(d::NUM_THREADS_PER_WARP),
            },
        );
        let uuid: [u8; 16] = r.read(d::UUID);
        self.pending_meta.push(MetaRecord::Device {
            ordinal: ordinal as u16,
            uuid: (uuid != [0; 16]).then(|| devtrace_shm::device::gpu_uuid_text(&uuid)),
            info: DeviceInfo {
                vendor: "Nvidia".into(),
                model: r.string(d::NAME).unwrap_or_default(),
                compute_capability: (
                    r.read(d::COMPUTE_CAPABILITY_MAJOR),
                    r.read(d::COMPUTE_CAPABILITY_MINOR),
                ),
                core_count: r.read(d::NUM_MULTIPROCESSORS),
                clock_rate_khz: u64::from(r.read::<u32>(d::CORE_CLOCK_RATE)),
                memory_bytes: r.read(d::GLOBAL_MEMORY_SIZE),
                // CUPTI reports KB/s.
                memory_bandwidth_bytes_per_s: r
                    .read::<u64>(d::GLOBAL_MEMORY_BANDWIDTH)
                    .saturating_mul(1000),
            },
        });
    }

    fn overhead(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::overhead as o;
        let kind = match r.read::<u32>(o::OVERHEAD_KIND) {
            1 => "driver compiler".to_string(),
            0x10000 => "buffer flush".to_string(),
            0x20000 => "instrumentation".to_string(),
            0x30000 => "resource".to_string(),
            0x70000 => "buffer request".to_string(),
            other => format!("0x{other:x}"),
        };
        let name = self.name(&format!("CUPTI overhead: {kind}"));
        let (start, duration) = self.span(r.read(o::START), r.read(o::END));
        out.push(Event::new(
            start,
            duration,
            Device::Host,
            LINE_OVERHEAD,
            name,
            Payload::Plain,
        ));
    }

    fn synchronization(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::synchronization as s;
        let label = match r.read::<u32>(s::TYPE) {
            1 => "event synchronize",
            2 => "stream wait event",
            3 => "stream synchronize",
            4 => "context synchronize",
            _ => "synchronize",
        };
        let name = self.name(label);
        let (start, duration) = self.span(r.read(s::START), r.read(s::END));
        out.push(Event::new(
            start,
            duration,
            Device::Host,
            LINE_SYNCHRONIZATION,
            name,
            Payload::ApiCall {
                correlation_id: u64::from(r.read::<u32>(s::CORRELATION_ID)),
                device_ordinal: 0,
            },
        ));
    }

    /// NVTX ranges: a start and an end record with one id become one span on
    /// the thread that opened it.
    fn marker(&mut self, r: RecordRef, out: &mut Vec<Event>) {
        use layout::marker as m;
        let flags: u32 = r.read(m::FLAGS);
        let id: u32 = r.read(m::ID);
        let at = self.clock.realtime(r.read(m::TIMESTAMP));
        let thread = if r.read::<u32>(m::OBJECT_KIND) == OBJECT_KIND_THREAD {
            // objectId.pt = { processId, threadId }.
            r.read::<u32>(layout::Field {
                offset: m::OBJECT_ID.offset + 4,
                since: 0,
            })
        } else {
            0
        };
        if flags & MARKER_END != 0 {
            if let Some((start, name, thread)) = self.markers.remove(&id) {
                out.push(Event::new(
                    start,
                    at.saturating_sub(start),
                    Device::Host,
                    u64::from(thread),
                    name,
                    Payload::Plain,
                ));
            }
            return;
        }
        let text = r
            .string(m::NAME)
            .unwrap_or_else(|| format!("NVTX range {id}"));
        let name = self.name(&text);
        if flags & MARKER_START != 0 {
            self.markers.insert(id, (at, name, thread));
        } else if flags & MARKER_INSTANT != 0 {
            out.push(Event::new(
                at,
                0,
                Device::Host,
                u64::from(thread),
                name,
                Payload::Plain,
            ));
        }
    }
}

/// A C++ symbol as the C++ runtime demangles it, or as it is when the
/// process has no C++ runtime or the name is not mangled.
fn demangle(mangled: &str) -> String {
    type CxaDemangle = unsafe extern "C" fn(
        *const std::ffi::c_char,
        *mut std::ffi::c_char,
        *mut usize,
        *mut std::ffi::c_int,
    ) -> *mut std::ffi::c_char;
    static DEMANGLER: std::sync::OnceLock<Option<CxaDemangle>> = std::sync::OnceLock::new();
    if !mangled.starts_with("_Z") {
        return mangled.to_string();
    }
    let demangler = DEMANGLER.get_or_init(|| {
        let address = crate::sys::dl::symbol(libc::RTLD_DEFAULT, "__cxa_demangle")?;
        // SAFETY: the C++ runtime's `__cxa_demangle` has this C signature.
        Some(unsafe { crate::sys::dl::function::<CxaDemangle>(address) })
    });
    let (Some(demangle), Ok(c_name)) = (demangler, std::ffi::CString::new(mangled)) else {
        return mangled.to_string();
    };
    let mut status = 0;
    // SAFETY: a NUL-terminated name; the runtime mallocs the result.
    let out = unsafe {
        demangle(
            c_name.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut status,
        )
    };
    if out.is_null() || status != 0 {
        return mangled.to_string();
    }
    // SAFETY: a NUL-terminated string the runtime allocated with malloc.
    let text = unsafe { std::ffi::CStr::from_ptr(out) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: the runtime's malloc'd buffer, freed once, after its text
    // was copied.
    unsafe { crate::sys::process::free_malloced(out.cast()) };
    text
}

/// A driver or runtime API call on its thread's host line.
fn api_event(
    start_ns: u64,
    duration_ns: u64,
    thread: u32,
    name: NameId,
    correlation: u32,
) -> Event {
    Event::new(
        start_ns,
        duration_ns,
        Device::Host,
        u64::from(thread),
        name,
        Payload::ApiCall {
            correlation_id: u64::from(correlation),
            device_ordinal: 0,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_is_limited_by_the_scarcest_resource() {
        let hopper = Limits {
            max_warps: 64,
            max_blocks: 32,
            max_registers: 65_536,
            max_shared: 228 * 1024,
            warp_size: 32,
        };
        // 256 threads, 32 registers: 8 blocks of 8 warps fill all 64 warps.
        assert_eq!(occupancy(&hopper, 256, 32, 0), 100.0);
        // 128 registers per thread: 65536 / (128 * 256) = 2 blocks, 16 warps.
        assert_eq!(occupancy(&hopper, 256, 128, 0), 25.0);
        // 100 KiB of shared memory per block: 2 blocks.
        assert_eq!(occupancy(&hopper, 256, 32, 100 * 1024), 25.0);
        assert_eq!(occupancy(&Limits::default(), 256, 32, 0), 0.0);
    }

    #[test]
    fn an_api_record_becomes_a_named_call_with_its_correlation_id() {
        use crate::cupti::layout::api;
        let mut record = [0u8; 40];
        let mut put = |field: layout::Field, value: u32| {
            record[field.offset..field.offset + 4].copy_from_slice(&value.to_ne_bytes())
        };
        put(
            layout::Field {
                offset: 0,
                since: 0,
            },
            kind::DRIVER,
        );
        put(api::CBID, 307);
        put(api::THREAD_ID, 77);
        put(api::CORRELATION_ID, 9);
        record[api::START.offset..api::START.offset + 8].copy_from_slice(&100u64.to_ne_bytes());
        record[api::END.offset..api::END.offset + 8].copy_from_slice(&250u64.to_ne_bytes());
        let bytes = record.as_ptr();
        let mut converter = Converter::new(5, 26, |_, cbid| Some(format!("cuLaunch{cbid}")));
        converter.clock = ClockMap::from_readings(1_000, 0, 1_000);
        let mut out = Vec::new();
        converter.convert(bytes, &mut out);
        assert_eq!(
            converter.take_meta(),
            vec![MetaRecord::Name {
                id: 1,
                text: "cuLaunch307".into()
            }]
        );
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].start_ns, out[0].duration_ns, out[0].line),
            (1_100, 150, 77)
        );
        assert_eq!(out[0].name(), NameId(1));
        assert_eq!(
            out[0].payload(),
            Payload::ApiCall {
                correlation_id: 9,
                device_ordinal: 0
            }
        );
        // A second record of the same call reuses the name.
        converter.convert(bytes, &mut out);
        assert!(converter.take_meta().is_empty());
    }

    /// A copy whose record CUPTI handed back unfinished (no end) is not
    /// placed at a made-up time: it is counted, with when it started.
    #[test]
    fn device_work_handed_back_unfinished_is_counted_not_placed() {
        use crate::cupti::layout::memcpy;
        let copy = |start: u64, end: u64| {
            let mut record = [0u8; 128];
            record[0..4].copy_from_slice(&kind::MEMCPY.to_ne_bytes());
            record[memcpy::COPY_KIND.offset] = 1;
            record[memcpy::START.offset..memcpy::START.offset + 8]
                .copy_from_slice(&start.to_ne_bytes());
            record[memcpy::END.offset..memcpy::END.offset + 8].copy_from_slice(&end.to_ne_bytes());
            record
        };
        let mut converter = Converter::new(5, 26, |_, _| None);
        converter.clock = ClockMap::from_readings(1_000, 0, 1_000);
        let mut out = Vec::new();
        for (start, end) in [(100, 150), (400, 0), (0, 0), (300, 0)] {
            converter.convert(copy(start, end).as_ptr(), &mut out);
        }
        assert_eq!(out.len(), 1, "only the finished copy is placed");
        converter.end_buffer(5_000);
        let told: Vec<MetaRecord> = converter
            .take_meta()
            .into_iter()
            .filter(|record| matches!(record, MetaRecord::Unfinished { .. }))
            .collect();
        assert_eq!(
            told,
            [MetaRecord::Unfinished {
                from_ns: 1_300,
                at_ns: 5_000,
                kernels: 0,
                other: 3,
            }]
        );
        converter.end_buffer(6_000);
        assert!(converter.take_meta().is_empty(), "told once");
    }

    /// A record stamped by a clock the map does not know (a profiler's,
    /// registered unseen) lands decades away: the process is told so once.
    #[test]
    fn records_on_an_unknown_clock_are_told_of_once() {
        use crate::cupti::layout::api;
        let mut record = [0u8; 40];
        record[0..4].copy_from_slice(&kind::DRIVER.to_ne_bytes());
        record[api::CBID.offset..api::CBID.offset + 4].copy_from_slice(&307u32.to_ne_bytes());
        let mut stamp = |start: u64| {
            record[api::START.offset..api::START.offset + 8].copy_from_slice(&start.to_ne_bytes());
            record[api::END.offset..api::END.offset + 8]
                .copy_from_slice(&(start + 150).to_ne_bytes());
            record
        };
        let epoch = 1_795_000_000_000_000_000u64;
        let mut converter = Converter::new(5, 26, |_, cbid| Some(format!("cuLaunch{cbid}")));
        converter.clock = ClockMap::from_readings(epoch, epoch, epoch);
        let mut out = Vec::new();
        let unknown_clock = |meta: Vec<MetaRecord>| {
            meta.iter()
                .filter(
                    |m| matches!(m, MetaRecord::Warning { message } if message == UNKNOWN_CLOCK),
                )
                .count()
        };
        converter.convert(stamp(epoch - 5_000).as_ptr(), &mut out);
        assert_eq!(unknown_clock(converter.take_meta()), 0);
        // A clock of its own, counting from an origin of its own (nowhere
        // near the CPU's time-stamp counter either).
        let _registering = crate::clock::REGISTRATION_TESTS.lock();
        converter.convert(stamp(9_000_000_000_000_000_000).as_ptr(), &mut out);
        assert_eq!(unknown_clock(converter.take_meta()), 1);
        converter.convert(stamp(9_000_000_000_000_001_000).as_ptr(), &mut out);
        assert_eq!(unknown_clock(converter.take_meta()), 0);
        assert_eq!(out.len(), 3);
        // A time CUPTI could not take (0) is no clock's.
        let mut fresh = Converter::new(5, 26, |_, cbid| Some(format!("cuLaunch{cbid}")));
        fresh.clock = ClockMap::from_readings(epoch, epoch, epoch);
        fresh.convert(stamp(0).as_ptr(), &mut out);
        assert_eq!(unknown_clock(fresh.take_meta()), 0);
    }

    /// Records of the CPU's time-stamp counter, registered unseen, are
    /// recognised and placed on the host clock.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn records_of_the_time_stamp_counter_registered_unseen_are_placed() {
        use crate::cupti::layout::api;
        let _registering = crate::clock::REGISTRATION_TESTS.lock();
        let mut record = [0u8; 40];
        record[0..4].copy_from_slice(&kind::DRIVER.to_ne_bytes());
        record[api::CBID.offset..api::CBID.offset + 4].copy_from_slice(&307u32.to_ne_bytes());
        // SAFETY: RDTSC exists on every x86-64 CPU.
        let ticks = unsafe { core::arch::x86_64::_rdtsc() };
        record[api::START.offset..api::START.offset + 8].copy_from_slice(&ticks.to_ne_bytes());
        record[api::END.offset..api::END.offset + 8].copy_from_slice(&ticks.to_ne_bytes());
        let now = devtrace_shm::clock::now_ns();
        let mut converter = Converter::new(5, 26, |_, cbid| Some(format!("cuLaunch{cbid}")));
        converter.clock = ClockMap::from_readings(now, now, now);
        let mut out = Vec::new();
        converter.convert(record.as_ptr(), &mut out);
        let meta = converter.take_meta();
        assert!(
            meta.iter().any(
                |m| matches!(m, MetaRecord::Warning { message } if message == COUNTER_ADOPTED)
            ),
            "{meta:?}"
        );
        assert_eq!(out.len(), 1);
        assert!(
            out[0].start_ns.abs_diff(now) < 50_000_000,
            "{} against {now}",
            out[0].start_ns
        );
    }

    /// CUPTI's DEVICE record still describes the GPU where the driver could
    /// not (the library writes the driver's description first when it can),
    /// and its limits take over from the driver's.
    #[test]
    fn a_device_record_describes_its_gpu_and_sets_its_limits() {
        use crate::cupti::layout::device as d;
        let name = c"Some GPU";
        let mut record = [0u8; 184];
        let mut put = |field: layout::Field, bytes: &[u8]| {
            record[field.offset..field.offset + bytes.len()].copy_from_slice(bytes)
        };
        let at_zero = layout::Field {
            offset: 0,
            since: 0,
        };
        put(at_zero, &kind::DEVICE.to_ne_bytes());
        put(d::GLOBAL_MEMORY_BANDWIDTH, &2_000_000u64.to_ne_bytes());
        put(d::GLOBAL_MEMORY_SIZE, &(16u64 << 30).to_ne_bytes());
        put(d::CORE_CLOCK_RATE, &1_500_000u32.to_ne_bytes());
        put(d::NUM_MULTIPROCESSORS, &80u32.to_ne_bytes());
        put(d::MAX_WARPS_PER_MULTIPROCESSOR, &48u32.to_ne_bytes());
        put(d::MAX_BLOCKS_PER_MULTIPROCESSOR, &16u32.to_ne_bytes());
        put(
            d::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            &98_304u32.to_ne_bytes(),
        );
        put(
            d::MAX_REGISTERS_PER_MULTIPROCESSOR,
            &65_536u32.to_ne_bytes(),
        );
        put(d::NUM_THREADS_PER_WARP, &32u32.to_ne_bytes());
        put(d::COMPUTE_CAPABILITY_MAJOR, &8u32.to_ne_bytes());
        put(d::COMPUTE_CAPABILITY_MINOR, &6u32.to_ne_bytes());
        put(d::ID, &1u32.to_ne_bytes());
        put(d::UUID, &[0xab; 16]);
        put(d::NAME, &(name.as_ptr() as usize).to_ne_bytes());
        let mut converter = Converter::new(5, 26, |_, _| None);
        converter.know_limits(1, Limits::default());
        converter.convert(record.as_ptr(), &mut Vec::new());
        let Some(MetaRecord::Device {
            ordinal,
            uuid,
            info,
        }) = converter.take_meta().pop()
        else {
            panic!("no device description");
        };
        assert_eq!((ordinal, uuid.is_some()), (1, true));
        assert_eq!(
            info,
            DeviceInfo {
                vendor: "Nvidia".into(),
                model: "Some GPU".into(),
                compute_capability: (8, 6),
                core_count: 80,
                clock_rate_khz: 1_500_000,
                memory_bytes: 16 << 30,
                memory_bandwidth_bytes_per_s: 2_000_000_000,
            }
        );
        assert_eq!(
            converter.limits.get(&1),
            Some(&Limits {
                max_warps: 48,
                max_blocks: 16,
                max_registers: 65_536,
                max_shared: 98_304,
                warp_size: 32,
            })
        );
    }
}
