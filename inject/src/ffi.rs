//! The one boundary between the C code that calls into this library (the
//! CUDA driver, the dynamic loader, libcupti's callbacks, other profilers
//! through the interposed entry points, `atexit`) and its Rust.
//!
//! A panic must never unwind into C (it would abort the workload), and a
//! library that panicked once is not trusted to trace on: every entry point
//! runs its body through [`guard`], which catches the panic, silences the
//! library with one message naming the entry point, and answers the
//! caller's fallback.

#![forbid(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs an entry point's `body`; after a panic the library goes quiet and
/// the caller gets `fallback`.
pub fn guard<T>(entry_point: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        // Saying so must not unwind into C either.
        let _ = catch_unwind(|| crate::fail(&format!("internal error (panic) in {entry_point}")));
        fallback
    })
}
