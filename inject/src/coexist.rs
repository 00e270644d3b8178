//! Living beside another CUPTI user in the same process (PyTorch's Kineto
//! behind `torch.profiler`, `jax.profiler`, Nsight's injection).
//!
//! CUPTI's activity API is per process, not per user: one pair of buffer
//! callbacks, one set of enabled kinds. A framework profiler that starts
//! registers its own callbacks (ours stop receiving records) and, when it
//! stops, disables its kinds (ours with them). This library never holds
//! `cuptiSubscribe` (Kineto runs CPU-only when a subscriber exists), never
//! fights for the stream, and says in the trace which part of a window it
//! lost. It learns of the other user in two ways:
//!
//! - **Interposition.** This library exports `cuptiActivityRegisterCallbacks`,
//!   `cuptiActivityEnable`, `cuptiActivityDisable` and `cuptiFinalize`. When
//!   its symbols come first in the process's lookup order (it is preloaded),
//!   the other user's calls pass through them on their way to libcupti
//!   unchanged: a foreign registration marks the stream as taken, and once
//!   the other user has disabled every kind it enabled (or finalized CUPTI)
//!   the stream is taken back at the next tick.
//! - **A probe.** While it owns the stream, the control thread makes one
//!   traced driver call (`cuDriverGetVersion`) per tick and forces a flush;
//!   the converter recognises that record (and keeps it out of the trace).
//!   Two probes in a row that never come back mean someone else has the
//!   callbacks or switched the driver records off. Without interposition
//!   there is no way to see the other user finish, so the stream is taken
//!   back when the next capture starts.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::cupti::library::{
    BufferCompleted, BufferRequested, CuptiResult, CUPTI_ERROR_NOT_INITIALIZED, CUPTI_SUCCESS,
};

/// Set while a foreign user's callbacks are registered.
static FOREIGN_REGISTERED: AtomicBool = AtomicBool::new(false);
/// When it registered them (`CLOCK_REALTIME` ns).
static FOREIGN_SINCE_NS: AtomicU64 = AtomicU64::new(0);
/// Kinds (bit per `CUpti_ActivityKind` below 64) the foreign user enabled.
static FOREIGN_KINDS: AtomicU64 = AtomicU64::new(0);
/// A foreign user finished since the control loop last looked.
static FOREIGN_DONE: AtomicBool = AtomicBool::new(false);

static PROBES_SENT: AtomicU64 = AtomicU64::new(0);
static PROBES_SEEN: AtomicU64 = AtomicU64::new(0);
/// When the newest probe that was answered was sent.
static LAST_ANSWERED_NS: AtomicU64 = AtomicU64::new(0);
static LAST_SENT_NS: AtomicU64 = AtomicU64::new(0);
/// The thread id (as CUPTI reports system thread ids) that makes probes.
static PROBE_TID: AtomicU32 = AtomicU32::new(0);

/// Whether the converter should count a driver record as this library's
/// own probe and drop it.
pub fn is_probe(cbid: u32, thread_id: u32) -> bool {
    if cbid == crate::cupti::CBID_DRIVER_GET_VERSION
        && thread_id != 0
        && thread_id == PROBE_TID.load(Ordering::Relaxed)
    {
        PROBES_SEEN.fetch_add(1, Ordering::AcqRel);
        LAST_ANSWERED_NS.store(LAST_SENT_NS.load(Ordering::Acquire), Ordering::Release);
        true
    } else {
        false
    }
}

/// Who has the stream, as far as this library can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Our records still arrive.
    Ours,
    /// Another user has it since `since_ns`; `seen` says whether its calls
    /// were seen (interposition), so that its end will be seen too.
    Taken { seen: bool, since_ns: u64 },
}

/// Whether a foreign user seen through interposition holds the stream now,
/// and since when.
pub fn foreign_holder() -> Option<u64> {
    FOREIGN_REGISTERED
        .load(Ordering::Acquire)
        .then(|| FOREIGN_SINCE_NS.load(Ordering::Acquire))
}

/// Asks at one tick of a capture: first what interposition saw, then what
/// the last probes showed. `probe` makes the next probe call (the caller
/// forces a flush after it).
pub fn check_ownership(probe: impl FnOnce()) -> Verdict {
    if let Some(since_ns) = foreign_holder() {
        return Verdict::Taken {
            seen: true,
            since_ns,
        };
    }
    let sent = PROBES_SENT.load(Ordering::Acquire);
    let seen = PROBES_SEEN.load(Ordering::Acquire);
    // The newest probe may still sit in the converter's queue; two missing
    // ones are not lag. The stream was lost at the first unanswered probe
    // at the latest; when exactly is not known.
    if sent.saturating_sub(seen) >= 2 {
        return Verdict::Taken {
            seen: false,
            since_ns: LAST_ANSWERED_NS.load(Ordering::Acquire),
        };
    }
    PROBE_TID.store(gettid(), Ordering::Relaxed);
    LAST_SENT_NS.store(devtrace::clock::now_ns(), Ordering::Release);
    PROBES_SENT.fetch_add(1, Ordering::AcqRel);
    probe();
    Verdict::Ours
}

/// Whether a foreign user seen through interposition has finished (read
/// once: it is reset).
pub fn foreign_done() -> bool {
    FOREIGN_DONE.swap(false, Ordering::AcqRel) && !FOREIGN_REGISTERED.load(Ordering::Acquire)
}

/// Forgets the probes so far; called when the stream is (re)taken.
pub fn reset_probes() {
    PROBES_SEEN.store(0, Ordering::Release);
    PROBES_SENT.store(0, Ordering::Release);
    LAST_ANSWERED_NS.store(devtrace::clock::now_ns(), Ordering::Release);
}

fn gettid() -> u32 {
    // SAFETY: plain system call without arguments.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

thread_local! {
    /// Set while this library itself calls into CUPTI, so that a libcupti
    /// that calls its own exported names is not taken for another user.
    static OWN_CALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `call` as this library's own CUPTI call.
pub fn own<T>(call: impl FnOnce() -> T) -> T {
    OWN_CALL.with(|own| own.set(true));
    let result = call();
    OWN_CALL.with(|own| own.set(false));
    result
}

fn foreign() -> bool {
    !OWN_CALL.with(|own| own.get())
}

/// The real entry point of libcupti behind an interposed name.
fn real() -> Option<&'static crate::cupti::library::Library> {
    crate::cupti::load().ok()?;
    crate::cupti::library_ref()
}

fn foreign_finished() {
    FOREIGN_REGISTERED.store(false, Ordering::Release);
    FOREIGN_DONE.store(true, Ordering::Release);
}

fn kind_bit(kind: c_int) -> u64 {
    u32::try_from(kind)
        .ok()
        .filter(|k| *k < 64)
        .map_or(0, |k| 1 << k)
}

/// Interposed `cuptiActivityRegisterCallbacks`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityRegisterCallbacks(
    requested: Option<BufferRequested>,
    completed: Option<BufferCompleted>,
) -> CuptiResult {
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.register_callbacks)(requested, completed) };
    if result == CUPTI_SUCCESS && foreign() {
        FOREIGN_KINDS.store(0, Ordering::Release);
        FOREIGN_SINCE_NS.store(devtrace::clock::now_ns(), Ordering::Release);
        FOREIGN_REGISTERED.store(true, Ordering::Release);
    }
    result
}

/// Interposed `cuptiActivityEnable`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityEnable(kind: c_int) -> CuptiResult {
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.enable)(kind) };
    if result == CUPTI_SUCCESS && foreign() {
        FOREIGN_KINDS.fetch_or(kind_bit(kind), Ordering::AcqRel);
    }
    result
}

/// Interposed `cuptiActivityDisable`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityDisable(kind: c_int) -> CuptiResult {
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.disable)(kind) };
    if result == CUPTI_SUCCESS && foreign() {
        let left = FOREIGN_KINDS.fetch_and(!kind_bit(kind), Ordering::AcqRel) & !kind_bit(kind);
        if left == 0 && FOREIGN_REGISTERED.load(Ordering::Acquire) {
            foreign_finished();
        }
    }
    result
}

/// Interposed `cuptiFinalize`: everything CUPTI had is reset, ours too.
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiFinalize() -> CuptiResult {
    let Some(finalize) = real().and_then(|lib| lib.finalize) else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { finalize() };
    if result == CUPTI_SUCCESS && foreign() {
        FOREIGN_KINDS.store(0, Ordering::Release);
        foreign_finished();
    }
    result
}
