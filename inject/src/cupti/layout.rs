//! CUPTI activity record layouts, by the API version of the libcupti that
//! wrote them. This is the one place that knows where a field lies.
//!
//! CUPTI emits the newest record version it has for each kind, and NVIDIA
//! only grows records at their end: every field read here has kept its
//! offset from CUDA 12.2 (API version 20) through 13.5 (130500), so one base
//! table serves them all, and the fields added later carry the first API
//! version that has them. A field is read only where the running version has
//! it; everywhere else it reads as absent. The table is checked against the
//! real headers of several releases (`header_check.rs`).
//!
//! API versions: 12.x reports small integers (20 = 12.2 ... 28 = 12.9); from
//! 13.0 the number is `MMmmuu` (130000 = 13.0 GA, 130001 = 13.0 Update 1,
//! 130101 = 13.1 Update 1, ...).

/// Where a field lies in its record, and the first API version whose record
/// has it (0: every supported version).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub offset: usize,
    pub since: u32,
}

const fn at(offset: usize) -> Field {
    Field { offset, since: 0 }
}

const fn since(offset: usize, since: u32) -> Field {
    Field { offset, since }
}

/// The record families read, by the name stem of their C structs
/// (`CUpti_ActivityKernel10` is of the `Kernel` family).
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    Kernel,
    Memcpy,
    Memset,
    Memory,
    Api,
    Device,
    Overhead,
    Synchronization,
    Marker,
}

#[cfg(test)]
impl Record {
    /// The C struct name without its version number.
    pub fn c_stem(self) -> &'static str {
        match self {
            Record::Kernel => "CUpti_ActivityKernel",
            Record::Memcpy => "CUpti_ActivityMemcpy",
            Record::Memset => "CUpti_ActivityMemset",
            Record::Memory => "CUpti_ActivityMemory",
            Record::Api => "CUpti_ActivityAPI",
            Record::Device => "CUpti_ActivityDevice",
            Record::Overhead => "CUpti_ActivityOverhead",
            Record::Synchronization => "CUpti_ActivitySynchronization",
            Record::Marker => "CUpti_ActivityMarker",
        }
    }
}

pub mod kernel {
    use super::{at, since, Field};
    pub const REGISTERS_PER_THREAD: Field = at(6); // u16
    pub const START: Field = at(16);
    pub const END: Field = at(24);
    pub const DEVICE_ID: Field = at(40);
    pub const STREAM_ID: Field = at(48);
    pub const GRID_X: Field = at(52); // i32
    pub const GRID_Y: Field = at(56);
    pub const GRID_Z: Field = at(60);
    pub const BLOCK_X: Field = at(64); // i32
    pub const BLOCK_Y: Field = at(68);
    pub const BLOCK_Z: Field = at(72);
    pub const STATIC_SHARED_MEMORY: Field = at(76); // i32
    pub const DYNAMIC_SHARED_MEMORY: Field = at(80); // i32
    pub const CORRELATION_ID: Field = at(92);
    pub const NAME: Field = at(104); // const char *
    pub const GRAPH_NODE_ID: Field = at(144); // u64
    pub const GRAPH_ID: Field = at(156); // u32
    pub const IS_DEVICE_LAUNCHED: Field = since(208, 130000); // u8
}

pub mod memcpy {
    use super::{at, Field};
    pub const COPY_KIND: Field = at(4); // u8
    pub const FLAGS: Field = at(7); // u8
    pub const BYTES: Field = at(8);
    pub const START: Field = at(16);
    pub const END: Field = at(24);
    pub const DEVICE_ID: Field = at(32);
    pub const STREAM_ID: Field = at(40);
    pub const CORRELATION_ID: Field = at(44);
}

pub mod memset {
    use super::{at, Field};
    pub const BYTES: Field = at(8);
    pub const START: Field = at(16);
    pub const END: Field = at(24);
    pub const DEVICE_ID: Field = at(32);
    pub const STREAM_ID: Field = at(40);
    pub const CORRELATION_ID: Field = at(44);
    pub const FLAGS: Field = at(48); // u16
}

pub mod memory {
    use super::{at, Field};
    pub const OPERATION_TYPE: Field = at(4);
    pub const ADDRESS: Field = at(16);
    pub const BYTES: Field = at(24);
    pub const TIMESTAMP: Field = at(32);
    pub const DEVICE_ID: Field = at(52);
}

pub mod api {
    use super::{at, Field};
    pub const CBID: Field = at(4);
    pub const START: Field = at(8);
    pub const END: Field = at(16);
    pub const THREAD_ID: Field = at(28);
    pub const CORRELATION_ID: Field = at(32);
}

pub mod device {
    use super::{at, Field};
    pub const GLOBAL_MEMORY_BANDWIDTH: Field = at(8); // u64, KB/s
    pub const GLOBAL_MEMORY_SIZE: Field = at(16);
    pub const CORE_CLOCK_RATE: Field = at(36); // u32, kHz
    pub const NUM_MULTIPROCESSORS: Field = at(44);
    pub const MAX_WARPS_PER_MULTIPROCESSOR: Field = at(52);
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: Field = at(56);
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: Field = at(60);
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: Field = at(64);
    pub const NUM_THREADS_PER_WARP: Field = at(32);
    pub const COMPUTE_CAPABILITY_MAJOR: Field = at(104);
    pub const COMPUTE_CAPABILITY_MINOR: Field = at(108);
    pub const ID: Field = at(112);
    pub const UUID: Field = at(120); // 16 bytes
    pub const NAME: Field = at(136); // const char *
}

pub mod overhead {
    use super::{at, Field};
    pub const OVERHEAD_KIND: Field = at(4);
    pub const START: Field = at(24);
    pub const END: Field = at(32);
}

pub mod synchronization {
    use super::{at, Field};
    pub const TYPE: Field = at(4);
    pub const START: Field = at(8);
    pub const END: Field = at(16);
    pub const CORRELATION_ID: Field = at(24);
}

pub mod marker {
    use super::{at, Field};
    pub const FLAGS: Field = at(4);
    pub const TIMESTAMP: Field = at(8);
    pub const ID: Field = at(16);
    pub const OBJECT_KIND: Field = at(20);
    pub const OBJECT_ID: Field = at(24); // { processId, threadId } for threads
    pub const NAME: Field = at(40); // const char *
}

/// Every field of the table with its record family and C field name, for
/// the check against the real headers.
#[cfg(test)]
pub fn fields() -> Vec<(Record, &'static str, Field)> {
    use Record::*;
    vec![
        (Kernel, "registersPerThread", kernel::REGISTERS_PER_THREAD),
        (Kernel, "start", kernel::START),
        (Kernel, "end", kernel::END),
        (Kernel, "deviceId", kernel::DEVICE_ID),
        (Kernel, "streamId", kernel::STREAM_ID),
        (Kernel, "gridX", kernel::GRID_X),
        (Kernel, "gridY", kernel::GRID_Y),
        (Kernel, "gridZ", kernel::GRID_Z),
        (Kernel, "blockX", kernel::BLOCK_X),
        (Kernel, "blockY", kernel::BLOCK_Y),
        (Kernel, "blockZ", kernel::BLOCK_Z),
        (Kernel, "staticSharedMemory", kernel::STATIC_SHARED_MEMORY),
        (Kernel, "dynamicSharedMemory", kernel::DYNAMIC_SHARED_MEMORY),
        (Kernel, "correlationId", kernel::CORRELATION_ID),
        (Kernel, "name", kernel::NAME),
        (Kernel, "graphNodeId", kernel::GRAPH_NODE_ID),
        (Kernel, "graphId", kernel::GRAPH_ID),
        (Kernel, "isDeviceLaunched", kernel::IS_DEVICE_LAUNCHED),
        (Memcpy, "copyKind", memcpy::COPY_KIND),
        (Memcpy, "flags", memcpy::FLAGS),
        (Memcpy, "bytes", memcpy::BYTES),
        (Memcpy, "start", memcpy::START),
        (Memcpy, "end", memcpy::END),
        (Memcpy, "deviceId", memcpy::DEVICE_ID),
        (Memcpy, "streamId", memcpy::STREAM_ID),
        (Memcpy, "correlationId", memcpy::CORRELATION_ID),
        (Memset, "bytes", memset::BYTES),
        (Memset, "start", memset::START),
        (Memset, "end", memset::END),
        (Memset, "deviceId", memset::DEVICE_ID),
        (Memset, "streamId", memset::STREAM_ID),
        (Memset, "correlationId", memset::CORRELATION_ID),
        (Memset, "flags", memset::FLAGS),
        (Memory, "memoryOperationType", memory::OPERATION_TYPE),
        (Memory, "address", memory::ADDRESS),
        (Memory, "bytes", memory::BYTES),
        (Memory, "timestamp", memory::TIMESTAMP),
        (Memory, "deviceId", memory::DEVICE_ID),
        (Api, "cbid", api::CBID),
        (Api, "start", api::START),
        (Api, "end", api::END),
        (Api, "threadId", api::THREAD_ID),
        (Api, "correlationId", api::CORRELATION_ID),
        (
            Device,
            "globalMemoryBandwidth",
            device::GLOBAL_MEMORY_BANDWIDTH,
        ),
        (Device, "globalMemorySize", device::GLOBAL_MEMORY_SIZE),
        (Device, "coreClockRate", device::CORE_CLOCK_RATE),
        (Device, "numMultiprocessors", device::NUM_MULTIPROCESSORS),
        (
            Device,
            "maxWarpsPerMultiprocessor",
            device::MAX_WARPS_PER_MULTIPROCESSOR,
        ),
        (
            Device,
            "maxBlocksPerMultiprocessor",
            device::MAX_BLOCKS_PER_MULTIPROCESSOR,
        ),
        (
            Device,
            "maxSharedMemoryPerMultiprocessor",
            device::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        ),
        (
            Device,
            "maxRegistersPerMultiprocessor",
            device::MAX_REGISTERS_PER_MULTIPROCESSOR,
        ),
        (Device, "numThreadsPerWarp", device::NUM_THREADS_PER_WARP),
        (
            Device,
            "computeCapabilityMajor",
            device::COMPUTE_CAPABILITY_MAJOR,
        ),
        (
            Device,
            "computeCapabilityMinor",
            device::COMPUTE_CAPABILITY_MINOR,
        ),
        (Device, "id", device::ID),
        (Device, "uuid", device::UUID),
        (Device, "name", device::NAME),
        (Overhead, "overheadKind", overhead::OVERHEAD_KIND),
        (Overhead, "start", overhead::START),
        (Overhead, "end", overhead::END),
        (Synchronization, "type", synchronization::TYPE),
        (Synchronization, "start", synchronization::START),
        (Synchronization, "end", synchronization::END),
        (
            Synchronization,
            "correlationId",
            synchronization::CORRELATION_ID,
        ),
        (Marker, "flags", marker::FLAGS),
        (Marker, "timestamp", marker::TIMESTAMP),
        (Marker, "id", marker::ID),
        (Marker, "objectKind", marker::OBJECT_KIND),
        (Marker, "objectId", marker::OBJECT_ID),
        (Marker, "name", marker::NAME),
    ]
}

/// A record in a buffer CUPTI completed, read by the layout of one API
/// version. Reads are unaligned-safe copies; a field the version lacks reads
/// as `None`.
#[derive(Clone, Copy)]
pub struct RecordRef {
    ptr: *const u8,
    version: u32,
}

impl RecordRef {
    /// # Safety
    /// `ptr` must point at a complete record that CUPTI of API `version`
    /// wrote into a buffer that stays valid while this is used.
    pub unsafe fn new(ptr: *const u8, version: u32) -> RecordRef {
        RecordRef { ptr, version }
    }

    /// The record's kind (`CUpti_ActivityKind`), its first field.
    pub fn kind(self) -> u32 {
        self.read(at(0))
    }

    /// A field of the record, copied out as `T`.
    pub fn read<T: Copy>(self, field: Field) -> T {
        // SAFETY: `new`'s contract: the record is complete, and every field
        // of the table lies inside every version of its record from `since`.
        unsafe { self.ptr.add(field.offset).cast::<T>().read_unaligned() }
    }

    /// A field that only some versions have.
    pub fn read_since<T: Copy>(self, field: Field) -> Option<T> {
        (self.version >= field.since).then(|| self.read(field))
    }

    /// A `const char *` field as text; CUPTI's strings live at least as
    /// long as the buffer being read.
    pub fn string(self, field: Field) -> Option<String> {
        let ptr: *const std::ffi::c_char = self.read(field);
        (!ptr.is_null()).then(|| {
            // SAFETY: a NUL-terminated string owned by libcupti.
            unsafe { std::ffi::CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_added_in_13_read_as_absent_before() {
        let mut record = [0u8; 248];
        record[208] = 1;
        // SAFETY: a buffer as long as the newest kernel record.
        let v12 = unsafe { RecordRef::new(record.as_ptr(), 26) };
        // SAFETY: as above.
        let v13 = unsafe { RecordRef::new(record.as_ptr(), 130001) };
        assert_eq!(v12.read_since::<u8>(kernel::IS_DEVICE_LAUNCHED), None);
        assert_eq!(v13.read_since::<u8>(kernel::IS_DEVICE_LAUNCHED), Some(1));
    }
}
