//! libc calls about the process itself.

/// Runs `handler` when the process exits (after `main` returns or at
/// `exit`), before libraries' destructors.
pub fn at_exit(handler: extern "C" fn()) {
    // SAFETY: registers a plain `extern "C"` function that lives as long as
    // the process.
    unsafe { libc::atexit(handler) };
}

/// Frees memory another library allocated with `malloc` and handed over.
///
/// # Safety
/// `pointer` came from `malloc` (or is null) and is not used afterwards.
pub unsafe fn free_malloced(pointer: *mut std::ffi::c_void) {
    // SAFETY: as the caller promises.
    unsafe { libc::free(pointer) };
}
