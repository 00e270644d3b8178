//! The CUPTI calls this library makes, each checked and turned into a
//! message that names the call and CUPTI's error, over the libcupti that
//! [`library`] found. Nothing here panics when CUPTI is missing: every call
//! before [`load`] succeeded answers an error.

pub mod api_calls;
pub mod callbacks;
pub mod layout;
pub mod library;

#[cfg(test)]
mod header_check;

use std::ffi::{c_int, CStr};
use std::sync::OnceLock;

use library::{BufferCompleted, BufferRequested, CuptiResult, Library, CUPTI_SUCCESS};

static LIBRARY: OnceLock<Library> = OnceLock::new();

/// Activity kinds (`CUpti_ActivityKind`), unchanged from 12.x to 13.x.
pub mod kind {
    pub const MEMCPY: u32 = 1;
    pub const MEMSET: u32 = 2;
    pub const KERNEL: u32 = 3;
    pub const DRIVER: u32 = 4;
    pub const RUNTIME: u32 = 5;
    pub const DEVICE: u32 = 8;
    pub const CONTEXT: u32 = 9;
    pub const CONCURRENT_KERNEL: u32 = 10;
    pub const MARKER: u32 = 12;
    pub const OVERHEAD: u32 = 17;
    pub const SYNCHRONIZATION: u32 = 38;
    pub const MEMORY2: u32 = 49;
}

/// The activity kinds a capture enables, in this order, and disables in
/// the reverse one: kernels are recorded only while everything around them
/// is (their device, copies, memsets, synchronizations, markers), so that
/// no kernel at a capture's edge lacks the work it waited for. The API
/// calls' records (the DRIVER and RUNTIME kinds, or a selection) are
/// [`api_calls`]'s.
pub const KINDS: [u32; 9] = [
    kind::DEVICE,
    kind::CONTEXT,
    kind::MEMCPY,
    kind::MEMSET,
    kind::MEMORY2,
    kind::OVERHEAD,
    kind::SYNCHRONIZATION,
    kind::MARKER,
    kind::CONCURRENT_KERNEL,
];
const _: () = assert!(KINDS[KINDS.len() - 1] == kind::CONCURRENT_KERNEL);

/// Finds and loads libcupti once; later calls answer the first outcome.
pub fn load() -> Result<&'static str, String> {
    if let Some(library) = LIBRARY.get() {
        return Ok(&library.origin);
    }
    let library = library::load().map_err(|e| e.to_string())?;
    Ok(&LIBRARY.get_or_init(|| library).origin)
}

/// The loaded libcupti, once [`load`] succeeded.
pub fn library_ref() -> Option<&'static Library> {
    LIBRARY.get()
}

fn lib() -> Result<&'static Library, String> {
    LIBRARY
        .get()
        .ok_or_else(|| "libcupti is not loaded".to_string())
}

/// CUPTI's name for a result, without trusting that the call works.
fn result_name(result: CuptiResult) -> String {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    let named = lib().is_ok_and(|lib| {
        // SAFETY: CUPTI writes a pointer to a static string into `text`.
        unsafe { (lib.get_result_string)(result, &mut text) == CUPTI_SUCCESS }
    });
    if named && !text.is_null() {
        // SAFETY: a NUL-terminated string owned by libcupti.
        let name = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{name} ({result})")
    } else {
        format!("CUPTI error {result}")
    }
}

pub fn check(call: &str, result: CuptiResult) -> Result<(), String> {
    if result == CUPTI_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {}", result_name(result)))
    }
}

pub fn register_callbacks(
    requested: BufferRequested,
    completed: BufferCompleted,
) -> Result<(), String> {
    let lib = lib()?;
    // SAFETY: both are `extern "C"` functions living as long as the process.
    check(
        "cuptiActivityRegisterCallbacks",
        crate::coexist::own(|| unsafe {
            (lib.register_callbacks)(Some(requested), Some(completed))
        }),
    )
}

pub fn use_system_thread_ids() -> Result<(), String> {
    const CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM: c_int = 1;
    let lib = lib()?;
    // SAFETY: plain call with a valid enum value.
    check("cuptiSetThreadIdType", unsafe {
        (lib.set_thread_id_type)(CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM)
    })
}

pub fn enable(kind: u32) -> Result<(), String> {
    let lib = lib()?;
    // SAFETY: plain call with a valid enum value.
    check(
        &format!("cuptiActivityEnable({kind})"),
        crate::coexist::own(|| unsafe { (lib.enable)(kind as c_int) }),
    )
}

pub fn disable(kind: u32) -> Result<(), String> {
    let lib = lib()?;
    // SAFETY: plain call with a valid enum value.
    check(
        &format!("cuptiActivityDisable({kind})"),
        crate::coexist::own(|| unsafe { (lib.disable)(kind as c_int) }),
    )
}

/// Hands back finished buffers; `forced` also the partly filled ones.
pub fn flush_all(forced: bool) -> Result<(), String> {
    let lib = lib()?;
    // SAFETY: plain call.
    check(
        "cuptiActivityFlushAll",
        crate::coexist::own(|| unsafe { (lib.flush_all)(u32::from(forced)) }),
    )
}

pub use devtrace_shm::cupti::{support, Support};

/// The loaded libcupti's API version.
pub fn version() -> Result<u32, String> {
    let lib = lib()?;
    let mut version = 0u32;
    // SAFETY: CUPTI writes one u32.
    check("cuptiGetVersion", unsafe {
        (lib.get_version)(&mut version)
    })?;
    Ok(version)
}

/// CUPTI's clock, nanoseconds.
pub fn timestamp() -> Result<u64, String> {
    let lib = lib()?;
    let mut ts = 0u64;
    // SAFETY: CUPTI writes one u64.
    check("cuptiGetTimestamp", unsafe { (lib.get_timestamp)(&mut ts) })?;
    Ok(ts)
}

/// Records dropped from the global queue since the previous call.
pub fn dropped_since_last() -> Result<u64, String> {
    let lib = lib()?;
    let mut dropped = 0usize;
    // SAFETY: a null context asks for the global queue; CUPTI writes one size_t.
    check("cuptiActivityGetNumDroppedRecords", unsafe {
        (lib.get_num_dropped_records)(std::ptr::null_mut(), 0, &mut dropped)
    })?;
    Ok(dropped as u64)
}

/// Set when the library must make no CUPTI call at all any more (an exit
/// beside another CUPTI user, whose state may be gone).
static NO_MORE_CALLS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on [`callback_name`] asks CUPTI nothing (its callers name a
/// call by its id instead).
pub fn make_no_more_calls() {
    NO_MORE_CALLS.store(true, std::sync::atomic::Ordering::Release);
}

/// The API's name for a driver (`runtime` false) or runtime callback id;
/// none once [`make_no_more_calls`] was called.
pub fn callback_name(runtime: bool, cbid: u32) -> Option<String> {
    const DRIVER_API: c_int = 1;
    const RUNTIME_API: c_int = 2;
    if NO_MORE_CALLS.load(std::sync::atomic::Ordering::Acquire) {
        return None;
    }
    let lib = lib().ok()?;
    let domain = if runtime { RUNTIME_API } else { DRIVER_API };
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: CUPTI writes a pointer to a static string.
    let result = unsafe { (lib.get_callback_name)(domain, cbid, &mut name) };
    if result != CUPTI_SUCCESS || name.is_null() {
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
pub unsafe fn next_record(buffer: *mut u8, valid: usize, record: &mut *mut u8) -> bool {
    let Ok(lib) = lib() else { return false };
    // SAFETY: as the caller promises.
    unsafe { (lib.get_next_record)(buffer, valid, record) == CUPTI_SUCCESS }
}
