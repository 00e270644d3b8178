//! CUPTI activity records to devtrace events: kernels, copies and memsets on
//! `/device:GPU:<n>` stream lines; driver and runtime calls, NVTX ranges and
//! allocations on host lines; device facts and names as metadata records.
//!
//! Records are read field by field through raw pointers, never as Rust
//! references: cudarc types several fields as Rust enums, and a value a
//! newer libcupti adds would make a reference to the whole record invalid.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::mem::offset_of;

use cudarc::cupti::sys::{
    CUpti_ActivityAPI, CUpti_ActivityDevice5, CUpti_ActivityKernel9, CUpti_ActivityMarker2,
    CUpti_ActivityMemcpy6, CUpti_ActivityMemory4, CUpti_ActivityMemset4, CUpti_ActivityOverhead3,
    CUpti_ActivitySynchronization2,
};
use devtrace::event::{
    AllocatorTally, CopyInfo, CopyKind, Device, Event, KernelInfo, MemsetInfo, NameId, Payload,
};
use devtrace::registry::DeviceInfo;
use devtrace::workload::{MetaRecord, LINE_MEMORY, LINE_OVERHEAD, LINE_SYNCHRONIZATION};

/// A field of a record at `ptr`, copied out without forming a reference.
macro_rules! field {
    ($ptr:expr, $ty:ty, $field:ident) => {
        // SAFETY: callers pass a pointer to a complete record of this type
        // inside a buffer CUPTI filled; the read is unaligned-safe.
        unsafe { std::ptr::addr_of!((*($ptr as *const $ty)).$field).read_unaligned() }
    };
}

/// A 32-bit field read as a plain number (for fields cudarc types as enums).
fn raw_u32(ptr: *const u8, offset: usize) -> u32 {
    // SAFETY: as for `field!`; the offset lies inside the record.
    unsafe { ptr.add(offset).cast::<u32>().read_unaligned() }
}

fn c_string(ptr: *const c_char) -> Option<String> {
    // SAFETY: CUPTI's strings are NUL-terminated and live at least as long
    // as the buffer being read.
    (!ptr.is_null()).then(|| {
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    })
}

/// CUPTI's clock to `CLOCK_REALTIME`, from a pair of readings.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClockMap {
    pub offset: i128,
}

impl ClockMap {
    /// `realtime_ns` read around (before and after) a CUPTI timestamp.
    pub fn from_readings(before_ns: u64, cupti_ns: u64, after_ns: u64) -> ClockMap {
        ClockMap {
            offset: (i128::from(before_ns) + i128::from(after_ns)) / 2 - i128::from(cupti_ns),
        }
    }

    pub fn realtime(self, cupti_ns: u64) -> u64 {
        (i128::from(cupti_ns) + self.offset).clamp(0, i128::from(u64::MAX)) as u64
    }
}

/// What occupancy needs to know about a GPU.
#[derive(Clone, Copy, Debug, Default)]
struct Limits {
    max_warps: u32,
    max_blocks: u32,
    max_registers: u32,
    max_shared: u32,
    warp_size: u32,
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

const KIND_MEMCPY: u32 = 1;
const KIND_MEMSET: u32 = 2;
const KIND_KERNEL: u32 = 3;
const KIND_DRIVER: u32 = 4;
const KIND_RUNTIME: u32 = 5;
const KIND_DEVICE: u32 = 8;
const KIND_CONCURRENT_KERNEL: u32 = 10;
const KIND_MARKER: u32 = 12;
const KIND_OVERHEAD: u32 = 17;
const KIND_SYNCHRONIZATION: u32 = 38;
const KIND_MEMORY2: u32 = 49;

const MARKER_INSTANT: u32 = 1;
const MARKER_START: u32 = 2;
const MARKER_END: u32 = 4;
const OBJECT_KIND_THREAD: u32 = 2;

/// See the module documentation. Names are ids of this process; each new
/// one is queued as a metadata record, to be written before the events that
/// use it are pushed.
pub struct Converter {
    pid: u32,
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
}

impl Converter {
    pub fn new(pid: u32, callback_name: fn(bool, u32) -> Option<String>) -> Converter {
        Converter {
            pid,
            clock: ClockMap::default(),
            names: HashMap::new(),
            api_names: HashMap::new(),
            limits: HashMap::new(),
            memory: HashMap::new(),
            markers: HashMap::new(),
            pending_meta: Vec::new(),
            callback_name,
        }
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
        match raw_u32(record, 0) {
            KIND_KERNEL | KIND_CONCURRENT_KERNEL => self.kernel(record, out),
            KIND_MEMCPY => self.memcpy(record, out),
            KIND_MEMSET => self.memset(record, out),
            KIND_MEMORY2 => self.memory(record, out),
            KIND_DRIVER => self.api(record, false, out),
            KIND_RUNTIME => self.api(record, true, out),
            KIND_DEVICE => self.device(record),
            KIND_OVERHEAD => self.overhead(record, out),
            KIND_SYNCHRONIZATION => self.synchronization(record, out),
            KIND_MARKER => self.marker(record, out),
            _ => {}
        }
    }

    fn span(&self, start: u64, end: u64) -> (u64, u64) {
        let start_ns = self.clock.realtime(start);
        (start_ns, self.clock.realtime(end).saturating_sub(start_ns))
    }

    fn kernel(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type K = CUpti_ActivityKernel9;
        let name = c_string(field!(r, K, name)).unwrap_or_else(|| "<unnamed kernel>".into());
        let name = self.name(&name);
        let device = field!(r, K, deviceId);
        let grid = [
            field!(r, K, gridX),
            field!(r, K, gridY),
            field!(r, K, gridZ),
        ]
        .map(|v| v.max(0) as u32);
        let block = [
            field!(r, K, blockX),
            field!(r, K, blockY),
            field!(r, K, blockZ),
        ]
        .map(|v| v.max(0) as u32);
        let registers = u32::from(field!(r, K, registersPerThread));
        let static_shared = field!(r, K, staticSharedMemory).max(0) as u32;
        let dynamic_shared = field!(r, K, dynamicSharedMemory).max(0) as u32;
        let occupancy_pct = self.limits.get(&device).map_or(0.0, |limits| {
            occupancy(
                limits,
                block.iter().product(),
                registers,
                static_shared + dynamic_shared,
            )
        });
        let (start, duration) = self.span(field!(r, K, start), field!(r, K, end));
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(device as u16),
            u64::from(field!(r, K, streamId)),
            name,
            Payload::Kernel(KernelInfo {
                correlation_id: u64::from(field!(r, K, correlationId)),
                registers_per_thread: registers,
                static_shared_bytes: static_shared,
                dynamic_shared_bytes: dynamic_shared,
                occupancy_pct,
                grid,
                block,
                tf_op: NameId(0),
            }),
        ));
    }

    fn memcpy(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type M = CUpti_ActivityMemcpy6;
        let (kind, label) = match field!(r, M, copyKind) {
            1 => (CopyKind::HostToDevice, "MemcpyH2D"),
            2 => (CopyKind::DeviceToHost, "MemcpyD2H"),
            8 => (CopyKind::DeviceToDevice, "MemcpyD2D"),
            10 => (CopyKind::PeerToPeer, "MemcpyP2P"),
            _ => (CopyKind::Other, "MemcpyOther"),
        };
        let name = self.name(label);
        let (start, duration) = self.span(field!(r, M, start), field!(r, M, end));
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(field!(r, M, deviceId) as u16),
            u64::from(field!(r, M, streamId)),
            name,
            Payload::Memcpy(CopyInfo {
                correlation_id: u64::from(field!(r, M, correlationId)),
                bytes: field!(r, M, bytes),
                kind,
                is_async: field!(r, M, flags) & 1 != 0,
                tf_op: NameId(0),
            }),
        ));
    }

    fn memset(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type M = CUpti_ActivityMemset4;
        let name = self.name("Memset");
        let (start, duration) = self.span(field!(r, M, start), field!(r, M, end));
        out.push(Event::new(
            start,
            duration,
            Device::Gpu(field!(r, M, deviceId) as u16),
            u64::from(field!(r, M, streamId)),
            name,
            Payload::Memset(MemsetInfo {
                correlation_id: u64::from(field!(r, M, correlationId)),
                bytes: field!(r, M, bytes),
                is_async: field!(r, M, flags) & 1 != 0,
                tf_op: NameId(0),
            }),
        ));
    }

    /// Allocations and frees per device, with the in-use and peak bytes
    /// XProf's memory profile plots.
    fn memory(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type M = CUpti_ActivityMemory4;
        let operation = raw_u32(r, offset_of!(M, memoryOperationType));
        let device = field!(r, M, deviceId);
        let bytes = field!(r, M, bytes);
        let address = field!(r, M, address);
        let allocating = match operation {
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
            self.clock.realtime(field!(r, M, timestamp)),
            0,
            Device::Host,
            LINE_MEMORY,
            name,
            payload,
        ));
    }

    fn api(&mut self, r: *const u8, runtime: bool, out: &mut Vec<Event>) {
        type A = CUpti_ActivityAPI;
        let cbid = field!(r, A, cbid);
        let name = match self.api_names.get(&(runtime, cbid)) {
            Some(name) => *name,
            None => {
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
        };
        let (start, duration) = self.span(field!(r, A, start), field!(r, A, end));
        out.push(Event::new(
            start,
            duration,
            Device::Host,
            u64::from(field!(r, A, threadId)),
            name,
            Payload::ApiCall {
                correlation_id: u64::from(field!(r, A, correlationId)),
                device_ordinal: 0,
            },
        ));
    }

    fn device(&mut self, r: *const u8) {
        type D = CUpti_ActivityDevice5;
        let ordinal = field!(r, D, id);
        self.limits.insert(
            ordinal,
            Limits {
                max_warps: field!(r, D, maxWarpsPerMultiprocessor),
                max_blocks: field!(r, D, maxBlocksPerMultiprocessor),
                max_registers: field!(r, D, maxRegistersPerMultiprocessor),
                max_shared: field!(r, D, maxSharedMemoryPerMultiprocessor),
                warp_size: field!(r, D, numThreadsPerWarp),
            },
        );
        self.pending_meta.push(MetaRecord::Device {
            ordinal: ordinal as u16,
            info: DeviceInfo {
                vendor: "Nvidia".into(),
                model: c_string(field!(r, D, name)).unwrap_or_default(),
                compute_capability: (
                    field!(r, D, computeCapabilityMajor),
                    field!(r, D, computeCapabilityMinor),
                ),
                core_count: field!(r, D, numMultiprocessors),
                clock_rate_khz: u64::from(field!(r, D, coreClockRate)),
                memory_bytes: field!(r, D, globalMemorySize),
                // CUPTI reports KB/s.
                memory_bandwidth_bytes_per_s: field!(r, D, globalMemoryBandwidth)
                    .saturating_mul(1000),
            },
        });
    }

    fn overhead(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type O = CUpti_ActivityOverhead3;
        let kind = match raw_u32(r, offset_of!(O, overheadKind)) {
            1 => "driver compiler".to_string(),
            0x10000 => "buffer flush".to_string(),
            0x20000 => "instrumentation".to_string(),
            0x30000 => "resource".to_string(),
            0x70000 => "buffer request".to_string(),
            other => format!("0x{other:x}"),
        };
        let name = self.name(&format!("CUPTI overhead: {kind}"));
        let (start, duration) = self.span(field!(r, O, start), field!(r, O, end));
        out.push(Event::new(
            start,
            duration,
            Device::Host,
            LINE_OVERHEAD,
            name,
            Payload::Plain,
        ));
    }

    fn synchronization(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type S = CUpti_ActivitySynchronization2;
        let label = match raw_u32(r, offset_of!(S, type_)) {
            1 => "event synchronize",
            2 => "stream wait event",
            3 => "stream synchronize",
            4 => "context synchronize",
            _ => "synchronize",
        };
        let name = self.name(label);
        let (start, duration) = self.span(field!(r, S, start), field!(r, S, end));
        out.push(Event::new(
            start,
            duration,
            Device::Host,
            LINE_SYNCHRONIZATION,
            name,
            Payload::ApiCall {
                correlation_id: u64::from(field!(r, S, correlationId)),
                device_ordinal: 0,
            },
        ));
    }

    /// NVTX ranges: a start and an end record with one id become one span on
    /// the thread that opened it.
    fn marker(&mut self, r: *const u8, out: &mut Vec<Event>) {
        type M = CUpti_ActivityMarker2;
        let flags = raw_u32(r, offset_of!(M, flags));
        let id = field!(r, M, id);
        let at = self.clock.realtime(field!(r, M, timestamp));
        let thread = if raw_u32(r, offset_of!(M, objectKind)) == OBJECT_KIND_THREAD {
            // objectId.pt = { processId, threadId }.
            raw_u32(r, offset_of!(M, objectId) + 4)
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
        let text = c_string(field!(r, M, name)).unwrap_or_else(|| format!("NVTX range {id}"));
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
    fn cupti_time_maps_to_the_midpoint_of_the_readings() {
        let clock = ClockMap::from_readings(1_000_100, 500, 1_000_300);
        assert_eq!(clock.realtime(500), 1_000_200);
        assert_eq!(clock.realtime(1_500), 1_001_200);
    }

    #[test]
    fn an_api_record_becomes_a_named_call_with_its_correlation_id() {
        // SAFETY: all-zero bytes are a valid API record (kind patched below).
        let mut record: CUpti_ActivityAPI = unsafe { std::mem::zeroed() };
        record.cbid = 307;
        record.start = 100;
        record.end = 250;
        record.threadId = 77;
        record.correlationId = 9;
        let bytes = (&mut record as *mut CUpti_ActivityAPI).cast::<u8>();
        // SAFETY: `kind` is the first u32 of the record.
        unsafe { bytes.cast::<u32>().write(KIND_DRIVER) };
        let mut converter = Converter::new(5, |_, cbid| Some(format!("cuLaunch{cbid}")));
        converter.clock = ClockMap { offset: 1_000 };
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
}
