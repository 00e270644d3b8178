//! libc calls about the process itself.

/// Runs `handler` when the process exits (after `main` returns or at
/// `exit`), before libraries' destructors.
pub fn at_exit(handler: extern "C" fn()) {
    // SAFETY: registers a plain `extern "C"` function that lives as long as
    // the process.
    unsafe { libc::atexit(handler) };
}

/// Runs `handler` in the child of every `fork` of the process, where only
/// the forking thread lives on.
pub fn at_fork_child(handler: extern "C" fn()) {
    // SAFETY: registers a plain `extern "C"` function that lives as long as
    // the process.
    unsafe { libc::pthread_atfork(None, None, Some(handler)) };
}

/// The calling thread's system id (by the system call: glibc's `gettid`
/// wrapper is younger than some hosts' glibc).
pub fn thread_id() -> u32 {
    // SAFETY: gettid has no arguments and no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// Frees memory another library allocated with `malloc` and handed over.
///
/// # Safety
/// `pointer` came from `malloc` (or is null) and is not used afterwards.
pub unsafe fn free_malloced(pointer: *mut std::ffi::c_void) {
    // SAFETY: as the caller promises.
    unsafe { libc::free(pointer) };
}
