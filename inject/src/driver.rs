//! The CUDA driver calls the library makes itself, from its control thread:
//! `cuDriverGetVersion`, a call whose exit an armed teardown finalizes CUPTI
//! at ([`poke`]), and the device limits occupancy needs ([`device_limits`]).
//! CUPTI's DEVICE records carry those limits too, but on CUDA 13 they sit in
//! the control thread's own buffer, which can come back after the kernels
//! that need them (a process that exits during a capture hands its own
//! thread's buffer back first). Entry points are looked up in the driver
//! the process loaded, never loading one.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use crate::convert::Limits;
use crate::session::Session;
use crate::sys::dl;

// `CUdevice_attribute` values, checked against every release's `cuda.h` by
// `cupti/header_check.rs`.
pub(crate) const WARP_SIZE: c_int = 10;
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

/// The entry points found in the loaded driver.
struct Driver {
    get_version: Option<DriverGetVersion>,
    get_count: Option<DeviceGetCount>,
    get: Option<DeviceGet>,
    get_attribute: Option<DeviceGetAttribute>,
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
    if let Some(get_version) = driver().and_then(|d| d.get_version) {
        let mut version: c_int = 0;
        // SAFETY: the driver writes one int.
        unsafe { get_version(&mut version) };
    }
}

/// Gives the converter the devices' limits, until it knows some. Not to be
/// called with the library's CUPTI gate held: another subscriber's
/// callback may run on this thread and call CUPTI through the library.
pub fn teach_limits(session: &Session) {
    let knows = session
        .converter
        .lock()
        .map_or(true, |converter| converter.knows_limits());
    if knows {
        return;
    }
    let limits = device_limits();
    if let Ok(mut converter) = session.converter.lock() {
        for (ordinal, device) in limits {
            converter.know_limits(ordinal, device);
        }
    }
}

/// The limits of each device the process sees, by CUDA ordinal (the
/// `deviceId` of CUPTI's records); empty before the job's `cuInit` or
/// without the entry points. A device whose attributes cannot all be read
/// is left out.
fn device_limits() -> Vec<(u32, Limits)> {
    let Some(Driver {
        get_count: Some(get_count),
        get: Some(get),
        get_attribute: Some(get_attribute),
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
    (0..count.clamp(0, MAX_DEVICES))
        .filter_map(|ordinal| {
            let mut device: c_int = 0;
            // SAFETY: the driver writes one device handle.
            if unsafe { get(&mut device, ordinal) } != CUDA_SUCCESS {
                return None;
            }
            let warp_size = attribute(device, WARP_SIZE)?;
            let threads = attribute(device, MAX_THREADS_PER_MULTIPROCESSOR)?;
            let limits = Limits {
                max_warps: threads.checked_div(warp_size)?,
                max_blocks: attribute(device, MAX_BLOCKS_PER_MULTIPROCESSOR)?,
                max_registers: attribute(device, MAX_REGISTERS_PER_MULTIPROCESSOR)?,
                max_shared: attribute(device, MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
                warp_size,
            };
            Some((ordinal as u32, limits))
        })
        .collect()
}
