//! The CUDA driver calls the library makes itself, from its control thread:
//! `cuDriverGetVersion`, a call whose exit an armed teardown finalizes CUPTI
//! at ([`poke`]), and what each device is ([`learn_devices`]): its UUID,
//! which places its kernels on the host's plane for that GPU, its name and
//! size, and the limits occupancy needs. CUPTI's DEVICE records carry all
//! of that too, but on CUDA 13 they sit in the control thread's own buffer,
//! which can come back after the kernels that need them, or never (a
//! process that exits during a capture hands its own thread's buffer back
//! first, and the rest only to a detach it does not live to see). Entry
//! points are looked up in the driver the process loaded, never loading
//! one.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use devtrace_shm::device::{gpu_uuid_text, DeviceInfo};
use devtrace_shm::workload::MetaRecord;

use crate::convert::Limits;
use crate::session::Session;
use crate::sys::dl;

// `CUdevice_attribute` values, checked against every release's `cuda.h` by
// `cupti/header_check.rs`.
pub(crate) const CLOCK_RATE: c_int = 13;
pub(crate) const MULTIPROCESSOR_COUNT: c_int = 16;
pub(crate) const WARP_SIZE: c_int = 10;
pub(crate) const MEMORY_CLOCK_RATE: c_int = 36;
pub(crate) const GLOBAL_MEMORY_BUS_WIDTH: c_int = 37;
pub(crate) const COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub(crate) const COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub(crate) const MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
pub(crate) const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: c_int = 81;
pub(crate) const MAX_REGISTERS_PER_MULTIPROCESSOR: c_int = 82;
pub(crate) const MAX_BLOCKS_PER_MULTIPROCESSOR: c_int = 106;

const CUDA_SUCCESS: c_int = 0;
/// The most devices one process is asked about.
const MAX_DEVICES: c_int = 64;

// The driver's signatures (`CUdevice` is an `int`), checked as above.
pub(crate) type DriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
pub(crate) type DeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
pub(crate) type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
pub(crate) type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
pub(crate) type DeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
pub(crate) type DeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
/// `cuDeviceGetUuid`, the first version, looked up by that name: under MIG
/// it names the physical GPU, as NVML's planes do (`_v2`, which CUDA 13's
/// `cuda.h` spells `cuDeviceGetUuid`, names the MIG instance). Drivers keep
/// it for programs built against CUDA 12.
pub(crate) type DeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;

/// The entry points found in the loaded driver.
struct Driver {
    get_version: Option<DriverGetVersion>,
    get_count: Option<DeviceGetCount>,
    get: Option<DeviceGet>,
    get_attribute: Option<DeviceGetAttribute>,
    get_name: Option<DeviceGetName>,
    total_mem: Option<DeviceTotalMem>,
    get_uuid: Option<DeviceGetUuid>,
}

fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let handle = ["libcuda.so.1", "libcuda.so"]
                .iter()
                .find_map(|name| dl::open(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD).ok())?;
            // Each: the driver's function of that name, whose signature the
            // type spells out, in a library whose reference is kept for the
            // process's life.
            Some(Driver {
                // SAFETY: as above.
                get_version: unsafe { entry::<DriverGetVersion>(handle, "cuDriverGetVersion") },
                // SAFETY: as above.
                get_count: unsafe { entry::<DeviceGetCount>(handle, "cuDeviceGetCount") },
                // SAFETY: as above.
                get: unsafe { entry::<DeviceGet>(handle, "cuDeviceGet") },
                // SAFETY: as above.
                get_attribute: unsafe {
                    entry::<DeviceGetAttribute>(handle, "cuDeviceGetAttribute")
                },
                // SAFETY: as above.
                get_name: unsafe { entry::<DeviceGetName>(handle, "cuDeviceGetName") },
                // SAFETY: as above.
                total_mem: unsafe { entry::<DeviceTotalMem>(handle, "cuDeviceTotalMem_v2") },
                // SAFETY: as above.
                get_uuid: unsafe { entry::<DeviceGetUuid>(handle, "cuDeviceGetUuid") },
            })
        })
        .as_ref()
}

/// The function `name` of the library `handle`, typed.
///
/// # Safety
/// `F` is the C signature of `name`, and the library stays loaded.
unsafe fn entry<F: Copy>(handle: *mut c_void, name: &str) -> Option<F> {
    let address = dl::symbol(handle, name)?;
    // SAFETY: as the caller promises.
    Some(unsafe { dl::function::<F>(address) })
}

/// Makes a driver call of the library's own (`cuDriverGetVersion`, which
/// needs no context and changes nothing), so that an armed teardown
/// finalizes at its exit even while the job makes no CUDA call: CUDA 13
/// hands a job thread's partly filled buffer (a window's last records) back
/// only when CUPTI is detached, and a job idle after a capture would
/// otherwise keep them past the trace. The caller must not hold the
/// library's CUPTI gate (the callback takes it).
pub fn poke() {
    if crate::exiting() {
        return;
    }
    if let Some(get_version) = driver().and_then(|d| d.get_version) {
        let mut version: c_int = 0;
        // SAFETY: the driver writes one int.
        unsafe { get_version(&mut version) };
    }
}

/// Tells the agent what each device is and gives the converter its
/// limits, once per process (while the converter knows no device's limits:
/// CUPTI's DEVICE record, when it came first, said it all). Not to be called
/// with the library's CUPTI gate held: another subscriber's callback may
/// run on this thread and call CUPTI through the library.
pub fn learn_devices(session: &Session) {
    let knows = session
        .converter
        .lock()
        .map_or(true, |converter| converter.knows_limits());
    if knows || crate::exiting() {
        return;
    }
    let devices = devices();
    // Before any event that needs them: the agent reads the metadata before
    // it names what it drained.
    for device in &devices {
        if let Some(record) = &device.record {
            session.write_meta(record);
        }
    }
    if let Ok(mut converter) = session.converter.lock() {
        for device in devices {
            if let Some(limits) = device.limits {
                converter.know_limits(device.ordinal, limits);
            }
        }
    }
}

/// What the driver says of one device.
struct Learned {
    /// The CUDA ordinal (the `deviceId` of CUPTI's records).
    ordinal: u32,
    /// Its description for the agent, when all of it could be read.
    record: Option<MetaRecord>,
    /// Its limits, when every one could be read.
    limits: Option<Limits>,
}

/// Each device the process sees; empty before the job's `cuInit` or
/// without the entry points.
fn devices() -> Vec<Learned> {
    let Some(Driver {
        get_count: Some(get_count),
        get: Some(get),
        get_attribute: Some(get_attribute),
        get_name,
        total_mem,
        get_uuid,
        ..
    }) = driver()
    else {
        return Vec::new();
    };
    let mut count: c_int = 0;
    // SAFETY: the driver writes one int.
    if unsafe { get_count(&mut count) } != CUDA_SUCCESS {
        return Vec::new();
    }
    let attribute = |device: c_int, which: c_int| -> Option<u32> {
        let mut value: c_int = 0;
        // SAFETY: the driver writes one int for a device handle it gave.
        let result = unsafe { get_attribute(&mut value, which, device) };
        (result == CUDA_SUCCESS).then(|| value.max(0) as u32)
    };
    let limits = |device: c_int| -> Option<Limits> {
        let warp_size = attribute(device, WARP_SIZE)?;
        let threads = attribute(device, MAX_THREADS_PER_MULTIPROCESSOR)?;
        Some(Limits {
            max_warps: threads.checked_div(warp_size)?,
            max_blocks: attribute(device, MAX_BLOCKS_PER_MULTIPROCESSOR)?,
            max_registers: attribute(device, MAX_REGISTERS_PER_MULTIPROCESSOR)?,
            max_shared: attribute(device, MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            warp_size,
        })
    };
    let name = |device: c_int| -> Option<String> {
        let get_name = (*get_name)?;
        let mut text = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL included.
        if unsafe { get_name(text.as_mut_ptr(), text.len() as c_int, device) } != CUDA_SUCCESS {
            return None;
        }
        text[text.len() - 1] = 0;
        // SAFETY: NUL-terminated just above, if the driver did not.
        let text = unsafe { CStr::from_ptr(text.as_ptr()) };
        Some(text.to_string_lossy().into_owned())
    };
    let uuid = |device: c_int| -> Option<[u8; 16]> {
        let get_uuid = (*get_uuid)?;
        let mut bytes = [0u8; 16];
        // SAFETY: the driver writes one 16-byte CUuuid.
        let read = unsafe { get_uuid(&mut bytes, device) } == CUDA_SUCCESS;
        (read && bytes != [0; 16]).then_some(bytes)
    };
    let memory_bytes = |device: c_int| -> Option<u64> {
        let total_mem = (*total_mem)?;
        let mut bytes: usize = 0;
        // SAFETY: the driver writes one size_t.
        let read = unsafe { total_mem(&mut bytes, device) } == CUDA_SUCCESS;
        (read && bytes > 0).then_some(bytes as u64)
    };
    // Whole or not at all: the agent keeps the first description of a GPU
    // it is given, so one read in part is left to CUPTI's DEVICE record.
    let describe = |ordinal: c_int, device: c_int| -> Option<MetaRecord> {
        let read = |which| attribute(device, which);
        Some(MetaRecord::Device {
            ordinal: u16::try_from(ordinal).ok()?,
            uuid: Some(gpu_uuid_text(&uuid(device)?)),
            info: DeviceInfo {
                vendor: "Nvidia".into(),
                model: name(device).filter(|name| !name.is_empty())?,
                compute_capability: (
                    read(COMPUTE_CAPABILITY_MAJOR)?,
                    read(COMPUTE_CAPABILITY_MINOR)?,
                ),
                core_count: read(MULTIPROCESSOR_COUNT)?,
                clock_rate_khz: u64::from(read(CLOCK_RATE)?),
                memory_bytes: memory_bytes(device)?,
                // Double data rate: two transfers a clock, over the bus's
                // width in bits (CUPTI's DEVICE record says the same).
                memory_bandwidth_bytes_per_s: u64::from(read(MEMORY_CLOCK_RATE)?)
                    .saturating_mul(1000)
                    .saturating_mul(u64::from(read(GLOBAL_MEMORY_BUS_WIDTH)?))
                    .saturating_mul(2)
                    / 8,
            },
        })
    };
    (0..count.clamp(0, MAX_DEVICES))
        .filter_map(|ordinal| {
            let mut device: c_int = 0;
            // SAFETY: the driver writes one device handle.
            if unsafe { get(&mut device, ordinal) } != CUDA_SUCCESS {
                return None;
            }
            Some(Learned {
                ordinal: ordinal as u32,
                record: describe(ordinal, device),
                limits: limits(device),
            })
        })
        .collect()
}
