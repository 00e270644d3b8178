//! Finding libcupti at run time and the entry points this library calls.
//!
//! A process must never hold two copies of CUPTI (each would keep its own
//! activity state, and the framework's profiler would see half of it), so a
//! libcupti the process already has is reused: `RTLD_NOLOAD` on
//! `libcupti.so.13`, then `.so.12`. Otherwise the candidates are, in order,
//! those of `devtrace_shm::cupti::candidates` (`DEVTRACE_CUPTI_PATH`, the
//! pip layout beside the CUDA libraries the process has mapped,
//! `$CUDA_HOME/extras/CUPTI/lib64`), then the loader's own search path. A library without one of the entry points is
//! refused with its name, except those only newer releases have, which are
//! optional.

use std::ffi::{c_char, c_int, c_void};

use crate::sys::dl;

/// `CUptiResult`.
pub type CuptiResult = c_int;
pub const CUPTI_SUCCESS: CuptiResult = 0;
/// What a call answers when CUPTI could not be reached at all.
pub const CUPTI_ERROR_NOT_INITIALIZED: CuptiResult = 15;
/// What a hook answers for an entry point the libcupti in use lacks.
pub const CUPTI_ERROR_NOT_SUPPORTED: CuptiResult = 27;

pub type BufferRequested = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
pub type BufferCompleted = unsafe extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);

use devtrace_shm::cupti::candidates;
pub use devtrace_shm::cupti::SONAMES;

pub type GetVersion = unsafe extern "C" fn(*mut u32) -> CuptiResult;
pub type GetResultString = unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult;
pub type RegisterCallbacks =
    unsafe extern "C" fn(Option<BufferRequested>, Option<BufferCompleted>) -> CuptiResult;
pub type SetThreadIdType = unsafe extern "C" fn(c_int) -> CuptiResult;
pub type Enable = unsafe extern "C" fn(c_int) -> CuptiResult;
pub type Disable = unsafe extern "C" fn(c_int) -> CuptiResult;
pub type FlushAll = unsafe extern "C" fn(u32) -> CuptiResult;
pub type GetTimestamp = unsafe extern "C" fn(*mut u64) -> CuptiResult;
pub type GetNumDroppedRecords = unsafe extern "C" fn(*mut c_void, u32, *mut usize) -> CuptiResult;
pub type GetCallbackName = unsafe extern "C" fn(c_int, u32, *mut *const c_char) -> CuptiResult;
pub type GetNextRecord = unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult;
pub type Finalize = unsafe extern "C" fn() -> CuptiResult;
/// `cuptiActivityRegisterTimestampCallback`.
pub type RegisterTimestampCallback =
    unsafe extern "C" fn(Option<crate::clock::TimestampFunc>) -> CuptiResult;
/// A Callback API subscriber (`CUpti_SubscriberHandle`).
pub type SubscriberHandle = *mut c_void;
/// `CUpti_CallbackFunc`: userdata, domain, callback id, callback data.
pub type CallbackFunc = unsafe extern "C" fn(*mut c_void, c_int, u32, *const c_void);
pub type Subscribe =
    unsafe extern "C" fn(*mut SubscriberHandle, Option<CallbackFunc>, *mut c_void) -> CuptiResult;
/// `cuptiSubscribe_v2` (CUDA 13.0's libcupti and later): as [`Subscribe`],
/// with a `CUpti_SubscriberParams` (or null) that is only ever passed on.
pub type SubscribeV2 = unsafe extern "C" fn(
    *mut SubscriberHandle,
    Option<CallbackFunc>,
    *mut c_void,
    *mut c_void,
) -> CuptiResult;
pub type Unsubscribe = unsafe extern "C" fn(SubscriberHandle) -> CuptiResult;
pub type EnableDomain = unsafe extern "C" fn(u32, SubscriberHandle, c_int) -> CuptiResult;
/// `cuptiActivityEnableDriverApi` and `cuptiActivityEnableRuntimeApi`:
/// a callback id and whether its calls are recorded.
pub type EnableApi = unsafe extern "C" fn(u32, u8) -> CuptiResult;

/// The entry points used, resolved once from one loaded libcupti.
pub struct Library {
    /// Where it came from (a path, or the soname it was found loaded under).
    pub origin: String,
    pub get_version: GetVersion,
    pub get_result_string: GetResultString,
    pub register_callbacks: RegisterCallbacks,
    pub set_thread_id_type: SetThreadIdType,
    pub enable: Enable,
    pub disable: Disable,
    pub flush_all: FlushAll,
    pub get_timestamp: GetTimestamp,
    pub get_num_dropped_records: GetNumDroppedRecords,
    pub get_callback_name: GetCallbackName,
    pub get_next_record: GetNextRecord,
    pub finalize: Option<Finalize>,
    /// Only other users' calls of it are seen (interposed): the clock they
    /// register stamps the records ([`crate::clock`]).
    pub register_timestamp_callback: Option<RegisterTimestampCallback>,
    /// The Callback API entry points detaching needs (`detach`).
    pub subscribe: Option<Subscribe>,
    /// Only other users' calls of it are seen (interposed); the library
    /// itself subscribes with [`Subscribe`].
    pub subscribe_v2: Option<SubscribeV2>,
    pub unsubscribe: Option<Unsubscribe>,
    pub enable_domain: Option<EnableDomain>,
    /// Absent before CUDA 12.8's libcupti: every API call is then recorded.
    pub enable_driver_api: Option<EnableApi>,
    pub enable_runtime_api: Option<EnableApi>,
}

// SAFETY: plain function pointers into a library that is never unloaded.
unsafe impl Send for Library {}
// SAFETY: as above; nothing in it is ever written after it is made.
unsafe impl Sync for Library {}

/// Why no usable libcupti was found: every place tried, with what happened.
#[derive(Debug)]
pub struct NotFound {
    pub tried: Vec<String>,
}

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "libcupti was not found (set DEVTRACE_CUPTI_PATH, or add CUDA's extras/CUPTI/lib64 \
             to LD_LIBRARY_PATH; tried {})",
            self.tried.join("; ")
        )
    }
}

/// The libcupti this process already has loaded, if any.
pub fn already_loaded() -> Option<(*mut c_void, &'static str)> {
    SONAMES.iter().find_map(|soname| {
        dl::open(soname, libc::RTLD_NOW | libc::RTLD_NOLOAD)
            .ok()
            .map(|handle| (handle, *soname))
    })
}

/// Finds and loads libcupti (see the module documentation).
pub fn load() -> Result<Library, NotFound> {
    let mut tried = Vec::new();
    if let Some((handle, soname)) = already_loaded() {
        match resolve(handle, format!("{soname} (already loaded)")) {
            Ok(library) => return Ok(library),
            Err(error) => tried.push(error),
        }
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for path in candidates(&maps) {
        if !path.exists() {
            continue;
        }
        let shown = path.display().to_string();
        match dl::open(&shown, libc::RTLD_NOW | libc::RTLD_GLOBAL) {
            Ok(handle) => match resolve(handle, shown) {
                Ok(library) => return Ok(library),
                Err(error) => tried.push(error),
            },
            Err(error) => tried.push(format!("{shown}: {error}")),
        }
    }
    for name in SONAMES.iter().chain(&["libcupti.so"]) {
        match dl::open(name, libc::RTLD_NOW | libc::RTLD_GLOBAL) {
            Ok(handle) => match resolve(handle, (*name).to_string()) {
                Ok(library) => return Ok(library),
                Err(error) => tried.push(error),
            },
            Err(_) => tried.push(format!("{name} on the loader's path")),
        }
    }
    Err(NotFound { tried })
}

fn resolve(handle: *mut c_void, origin: String) -> Result<Library, String> {
    macro_rules! optional {
        ($name:literal, $ty:ty) => {
            dl::symbol(handle, $name).map(|address| {
                // SAFETY: the symbol is libcupti's function of that name,
                // whose C signature the type spells out.
                unsafe { dl::function::<$ty>(address) }
            })
        };
    }
    macro_rules! entry {
        ($name:literal, $ty:ty) => {
            match dl::symbol(handle, $name) {
                Some(address) => {
                    // SAFETY: the symbol is libcupti's function of that
                    // name, whose C signature the type spells out.
                    unsafe { dl::function::<$ty>(address) }
                }
                None => return Err(format!("{origin}: no {} in it", $name)),
            }
        };
    }
    Ok(Library {
        get_version: entry!("cuptiGetVersion", GetVersion),
        get_result_string: entry!("cuptiGetResultString", GetResultString),
        register_callbacks: entry!("cuptiActivityRegisterCallbacks", RegisterCallbacks),
        set_thread_id_type: entry!("cuptiSetThreadIdType", SetThreadIdType),
        enable: entry!("cuptiActivityEnable", Enable),
        disable: entry!("cuptiActivityDisable", Disable),
        flush_all: entry!("cuptiActivityFlushAll", FlushAll),
        get_timestamp: entry!("cuptiGetTimestamp", GetTimestamp),
        get_num_dropped_records: entry!("cuptiActivityGetNumDroppedRecords", GetNumDroppedRecords),
        get_callback_name: entry!("cuptiGetCallbackName", GetCallbackName),
        get_next_record: entry!("cuptiActivityGetNextRecord", GetNextRecord),
        finalize: optional!("cuptiFinalize", Finalize),
        register_timestamp_callback: optional!(
            "cuptiActivityRegisterTimestampCallback",
            RegisterTimestampCallback
        ),
        subscribe: optional!("cuptiSubscribe", Subscribe),
        subscribe_v2: optional!("cuptiSubscribe_v2", SubscribeV2),
        unsubscribe: optional!("cuptiUnsubscribe", Unsubscribe),
        enable_domain: optional!("cuptiEnableDomain", EnableDomain),
        enable_driver_api: optional!("cuptiActivityEnableDriverApi", EnableApi),
        enable_runtime_api: optional!("cuptiActivityEnableRuntimeApi", EnableApi),
        origin,
    })
}
