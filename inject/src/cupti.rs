//! The CUPTI calls the library makes, each checked and turned into a message
//! that names the call and CUPTI's error. cudarc loads libcupti on first use
//! and panics when it cannot, so [`available`] is asked first.

use std::ffi::CStr;

use cudarc::cupti::sys::{self, CUptiResult, CUpti_ActivityKind};

/// The activity kinds a capture enables, in this order.
pub const KINDS: [CUpti_ActivityKind; 11] = [
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DEVICE,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMORY2,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_OVERHEAD,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_SYNCHRONIZATION,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MARKER,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONTEXT,
];

/// Loads libcupti (cudarc's candidates: libcupti.so, libcupti.so.12, ...)
/// and keeps it loaded; false when none loads. cudarc's own presence check
/// unloads the library again, which a loaded CUPTI may not survive.
pub fn available() -> bool {
    // SAFETY: loads the library once; cudarc panics when no candidate loads.
    std::panic::catch_unwind(|| unsafe { sys::culib() }).is_ok()
}

/// CUPTI's name for a result, without trusting that the call works.
fn result_name(result: CUptiResult) -> String {
    let code = result as u32;
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: CUPTI writes a pointer to a static string into `text`.
    let named = unsafe { sys::cuptiGetResultString(result, &mut text) };
    if named == CUptiResult::CUPTI_SUCCESS && !text.is_null() {
        // SAFETY: a NUL-terminated string owned by libcupti.
        let name = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{name} ({code})")
    } else {
        format!("CUPTI error {code}")
    }
}

pub fn check(call: &str, result: CUptiResult) -> Result<(), String> {
    if result == CUptiResult::CUPTI_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {}", result_name(result)))
    }
}

pub fn register_callbacks(
    requested: sys::CUpti_BuffersCallbackRequestFunc,
    completed: sys::CUpti_BuffersCallbackCompleteFunc,
) -> Result<(), String> {
    // SAFETY: both are `extern "C"` functions living as long as the library.
    check("cuptiActivityRegisterCallbacks", unsafe {
        sys::cuptiActivityRegisterCallbacks(requested, completed)
    })
}

pub fn use_system_thread_ids() -> Result<(), String> {
    // SAFETY: plain call with a valid enum value.
    check("cuptiSetThreadIdType", unsafe {
        sys::cuptiSetThreadIdType(
            sys::CUpti_ActivityThreadIdType::CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM,
        )
    })
}

pub fn enable(kind: CUpti_ActivityKind) -> Result<(), String> {
    // SAFETY: plain call with a valid enum value.
    check(&format!("cuptiActivityEnable({})", kind as u32), unsafe {
        sys::cuptiActivityEnable(kind)
    })
}

pub fn disable(kind: CUpti_ActivityKind) -> Result<(), String> {
    // SAFETY: plain call with a valid enum value.
    check(&format!("cuptiActivityDisable({})", kind as u32), unsafe {
        sys::cuptiActivityDisable(kind)
    })
}

/// Hands back finished buffers; `forced` also the partly filled ones.
pub fn flush_all(forced: bool) -> Result<(), String> {
    // SAFETY: plain call.
    check("cuptiActivityFlushAll", unsafe {
        sys::cuptiActivityFlushAll(u32::from(forced))
    })
}

/// CUPTI API versions whose records this library reads correctly: CUDA
/// 12.2 (20, where `CUpti_ActivityDevice5` begins) to 12.9 (28). Later
/// records of the kinds read here only append fields within 12.x; CUDA 13
/// (130001 on) reports kernels as `CUpti_ActivityKernel10`.
pub const SUPPORTED_VERSIONS: std::ops::RangeInclusive<u32> = 20..=28;

/// The loaded libcupti's API version, refused when its records would be
/// misread.
pub fn check_version() -> Result<u32, String> {
    let mut version = 0u32;
    // SAFETY: CUPTI writes one u32.
    check("cuptiGetVersion", unsafe {
        sys::cuptiGetVersion(&mut version)
    })?;
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(version)
    } else {
        Err(format!(
            "libcupti has API version {version}; this library reads the record layouts of \
             versions {}..={} (CUDA 12.2 to 12.9)",
            SUPPORTED_VERSIONS.start(),
            SUPPORTED_VERSIONS.end()
        ))
    }
}

/// CUPTI's clock, nanoseconds.
pub fn timestamp() -> Result<u64, String> {
    let mut ts = 0u64;
    // SAFETY: CUPTI writes one u64.
    check("cuptiGetTimestamp", unsafe {
        sys::cuptiGetTimestamp(&mut ts)
    })?;
    Ok(ts)
}

/// Records dropped from the global queue since the previous call.
pub fn dropped_since_last() -> Result<u64, String> {
    let mut dropped = 0usize;
    // SAFETY: a null context asks for the global queue; CUPTI writes one size_t.
    check("cuptiActivityGetNumDroppedRecords", unsafe {
        sys::cuptiActivityGetNumDroppedRecords(std::ptr::null_mut(), 0, &mut dropped)
    })?;
    Ok(dropped as u64)
}

/// The API's name for a driver (`runtime` false) or runtime callback id.
pub fn callback_name(runtime: bool, cbid: u32) -> Option<String> {
    let domain = if runtime {
        sys::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API
    } else {
        sys::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API
    };
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: CUPTI writes a pointer to a static string.
    let result = unsafe { sys::cuptiGetCallbackName(domain, cbid, &mut name) };
    if result != CUptiResult::CUPTI_SUCCESS || name.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by libcupti.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The next record of a completed buffer, or `None` at its end.
///
/// # Safety
/// `buffer` must be a buffer CUPTI completed with `valid` bytes, and
/// `record` the previous record returned for it (null at first).
pub unsafe fn next_record(
    buffer: *mut u8,
    valid: usize,
    record: &mut *mut sys::CUpti_Activity,
) -> bool {
    // SAFETY: as the caller promises.
    unsafe { sys::cuptiActivityGetNextRecord(buffer, valid, record) == CUptiResult::CUPTI_SUCCESS }
}
