//! What the Callback API passes and answers, as CUPTI's headers define it
//! (checked against every release by `header_check.rs`): the domains the
//! library's subscriber enables, the call sites, the fields of
//! `CUpti_CallbackData` it reads, and the error a second subscriber gets.

use std::ffi::{c_int, c_void};

use super::library::CuptiResult;

/// `CUPTI_CB_DOMAIN_DRIVER_API` and `CUPTI_CB_DOMAIN_RUNTIME_API`.
pub const DRIVER_API: c_int = 1;
pub const RUNTIME_API: c_int = 2;
pub const DOMAINS: [c_int; 2] = [DRIVER_API, RUNTIME_API];
/// `CUPTI_API_ENTER` and `CUPTI_API_EXIT`.
pub const API_ENTER: u32 = 0;
pub const API_EXIT: u32 = 1;
/// `CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`.
pub const ERROR_MULTIPLE_SUBSCRIBERS: CuptiResult = 39;
/// Where `CUpti_CallbackData` keeps `correlationData` (a `uint64_t *`) and
/// `correlationId` (a `uint32_t`); `callbackSite` is its first field.
pub const CORRELATION_DATA_OFFSET: usize = 56;
pub const CORRELATION_ID_OFFSET: usize = 64;
/// Where it keeps `functionReturnValue`: a `void *` to the call's
/// `CUresult` or `cudaError_t` (both a C enum, 0 for success), valid at
/// the call's exit.
pub const RETURN_VALUE_OFFSET: usize = 24;

/// What the library reads of a driver or runtime API callback's data.
#[derive(Clone, Copy, Debug)]
pub struct ApiCallback {
    /// [`API_ENTER`] or [`API_EXIT`].
    pub site: u32,
    /// The id CUPTI gives the call's records and the work it enqueues.
    pub correlation_id: u32,
    /// A slot CUPTI keeps for the call from its entry to its exit (or null).
    pub correlation_data: *mut u64,
    /// The call's result, at its exit (or null).
    pub return_value: *const c_int,
}

impl ApiCallback {
    /// Reads the fields of `data`.
    ///
    /// # Safety
    /// `data` is the `CUpti_CallbackData` CUPTI passes a callback of the
    /// driver or runtime API domain.
    pub unsafe fn read(data: *const c_void) -> ApiCallback {
        let data = data.cast::<u8>();
        // SAFETY: the fields of a `CUpti_CallbackData` at their header
        // offsets, as the caller promises.
        unsafe {
            ApiCallback {
                site: data.cast::<u32>().read(),
                correlation_id: data.add(CORRELATION_ID_OFFSET).cast::<u32>().read(),
                correlation_data: data
                    .add(CORRELATION_DATA_OFFSET)
                    .cast::<*mut u64>()
                    .read_unaligned(),
                return_value: data
                    .add(RETURN_VALUE_OFFSET)
                    .cast::<*const c_int>()
                    .read_unaligned(),
            }
        }
    }

    /// Whether the call, at its exit, answered an error (a launch that
    /// failed launched nothing).
    ///
    /// # Safety
    /// Read at [`API_EXIT`] of the callback whose data this was read from,
    /// while CUPTI's data lives.
    pub unsafe fn failed(&self) -> bool {
        // SAFETY: CUPTI's pointer to the call's result, valid at its exit,
        // as the caller promises.
        !self.return_value.is_null() && unsafe { self.return_value.read_unaligned() } != 0
    }
}
