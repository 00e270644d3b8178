//! Living beside another CUPTI user in the same process (PyTorch's Kineto
//! behind `torch.profiler`, `jax.profiler`, Nsight's injection).
//!
//! CUPTI's activity API is per process, not per user: one pair of buffer
//! callbacks, one set of enabled kinds, one Callback API subscriber (before
//! CUDA 13.3). A framework profiler that starts registers its own callbacks
//! (ours stop receiving records) and, when it stops, disables its kinds
//! (ours with them). This library never fights for the stream, holds a
//! subscriber only from a capture's start to the detach after it (it times
//! the timeline's calls and detaches, [`crate::detach`]) and gives it up to
//! any profiler that subscribes, never finalizes
//! CUPTI while another user may need it, and says in the trace which part
//! of a window it lost. What it knows of other users is evidence, never a
//! guess from timing:
//!
//! - **Interposition.** Other users' calls to
//!   `cuptiActivityRegisterCallbacks`, `cuptiActivityEnable`,
//!   `cuptiActivityDisable`, `cuptiActivityFlushAll`, `cuptiFinalize`,
//!   `cuptiSubscribe`, `cuptiSubscribe_v2`, `cuptiUnsubscribe` and
//!   `cuptiActivityRegisterTimestampCallback` (whose clock then stamps
//!   every record, ours too: [`crate::clock`]) pass
//!   through this library on
//!   their way to libcupti, unchanged: through the names it exports (enough
//!   when it is preloaded; [`join_global_scope`] adds them to the global
//!   scope when the driver loads it), through other libraries' GOT slots,
//!   redirected to its hooks ([`redirect_callers`]; PyTorch binds to
//!   libcupti directly), and through libcupti's own symbol table, whose
//!   entries for those names point at the hooks once the library has
//!   resolved the real ones (`dlsym` on libcupti's handle, as XLA's CUPTI
//!   wrapper does, and libraries loaded later find the hooks). Before a foreign registration passes on, our
//!   buffers are flushed back to us; it marks the stream as taken; once the
//!   other user has switched off every kind it enabled and flushed (or a
//!   second later), or finalized CUPTI, the stream is taken back at the
//!   next tick.
//! - **A buffer that is not ours** reaching our callback
//!   ([`foreign_buffer_arrived`]): some user registered callbacks before
//!   ours and had buffers in flight. When no user was seen through
//!   interposition, that one reaches CUPTI some other way (it resolved
//!   libcupti's functions before this library loaded): its end cannot be
//!   seen, so CUPTI is never finalized in the process again.
//!
//! Buffers of ours that CUPTI never hands back are not taken for another
//! user: real CUPTI keeps per-thread buffers and hands them back late.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::cupti::library::{
    BufferCompleted, BufferRequested, CallbackFunc, CuptiResult, SubscriberHandle,
    CUPTI_ERROR_NOT_INITIALIZED, CUPTI_ERROR_NOT_SUPPORTED, CUPTI_SUCCESS,
};
use crate::detach::{self, Attachment};

/// What a hook answers when this library failed inside it (`CUPTI_ERROR_UNKNOWN`).
const CUPTI_ERROR_UNKNOWN: CuptiResult = 999;

const FOREIGN_FLUSH_GRACE_NS: u64 = 1_000_000_000;

/// What this library knows of the other CUPTI users in the process.
///
/// Concurrency: the hooks write it on the other users' threads (and
/// `bufferCompleted` on CUPTI's), the control thread reads it. Each field
/// is one fact, stored with `Release` (changed in place with `AcqRel`) and
/// loaded with `Acquire`; no decision reads two fields as one state except
/// [`foreign_done`], where the grace period of `idle_since_ns` makes their
/// order moot. Timestamps are `CLOCK_REALTIME` ns.
struct Others {
    /// A foreign user's buffer callbacks are registered.
    registered: AtomicBool,
    /// When it registered them.
    since_ns: AtomicU64,
    /// Kinds (a bit per `CUpti_ActivityKind` below 64) it has enabled.
    kinds: AtomicU64,
    /// A foreign user finished since the control loop last looked.
    done: AtomicBool,
    /// When it switched its last kind off (0: it has some on). It is done
    /// once it has also flushed, or [`FOREIGN_FLUSH_GRACE_NS`] later: taking
    /// the stream back before its final flush would send its last buffers
    /// to us.
    idle_since_ns: AtomicU64,
    /// Whether foreign users hold Callback API subscribers (see
    /// [`FOREIGN_SUBSCRIBERS`]).
    subscribed: AtomicBool,
    /// A foreign user was seen through interposition at some time.
    ever_seen: AtomicBool,
    /// Buffers that were not ours reached our callback.
    buffers: AtomicU64,
}

static OTHERS: Others = Others {
    registered: AtomicBool::new(false),
    since_ns: AtomicU64::new(0),
    kinds: AtomicU64::new(0),
    done: AtomicBool::new(false),
    idle_since_ns: AtomicU64::new(0),
    subscribed: AtomicBool::new(false),
    ever_seen: AtomicBool::new(false),
    buffers: AtomicU64::new(0),
};

/// Puts this library's exported names into the process's global symbol
/// scope, so that interposition also works when the CUDA driver loaded it
/// (`CUDA_INJECTION64_PATH` opens it with local scope). Names already bound,
/// or found earlier in that scope, stay as they are.
pub fn join_global_scope() {
    crate::sys::dl::join_global_scope();
}

/// Sends other libraries' calls to the CUPTI entry points this library
/// interposes through it, whoever bound them how (see `sys/got.rs`). Run at
/// start and again when a capture starts and ends, for libraries loaded
/// since. The slots get the private hooks: the address of an exported name,
/// taken in this library, is whatever the dynamic linker bound that name
/// to, which may be libcupti's.
pub fn redirect_callers() -> usize {
    use crate::sys::got::Redirect;
    // Only callers of the libcupti in use are redirected: the hooks
    // forward to it.
    let Some(lib) = crate::cupti::library_ref() else {
        return 0;
    };
    let redirect = |name, from: Option<usize>, hook: *const ()| {
        Some(Redirect {
            name,
            from: from?,
            to: hook as usize,
        })
    };
    let register = lib.register_callbacks as usize;
    // One line a name: a table.
    #[rustfmt::skip]
    let redirects: Vec<Redirect> = [
        redirect(c"cuptiActivityRegisterCallbacks", Some(register), register_callbacks_hook as _),
        redirect(c"cuptiActivityEnable", Some(lib.enable as usize), enable_hook as _),
        redirect(c"cuptiActivityDisable", Some(lib.disable as usize), disable_hook as _),
        redirect(c"cuptiActivityFlushAll", Some(lib.flush_all as usize), flush_all_hook as _),
        redirect(c"cuptiFinalize", lib.finalize.map(|f| f as usize), finalize_hook as _),
        redirect(c"cuptiSubscribe", lib.subscribe.map(|f| f as usize), subscribe_hook as _),
        redirect(c"cuptiSubscribe_v2", lib.subscribe_v2.map(|f| f as usize), subscribe_v2_hook as _),
        redirect(c"cuptiUnsubscribe", lib.unsubscribe.map(|f| f as usize), unsubscribe_hook as _),
        redirect(c"cuptiActivityRegisterTimestampCallback", lib.register_timestamp_callback.map(|f| f as usize), register_timestamp_hook as _),
    ]
    .into_iter()
    .flatten()
    .collect();
    // Later lookups in libcupti itself (dlsym, a library bound later) find
    // the hooks too.
    crate::sys::got::retarget_exports(&redirects);
    crate::sys::got::redirect(&redirects)
}

/// Whether a foreign user seen through interposition holds the stream now,
/// and since when.
pub fn foreign_holder() -> Option<u64> {
    OTHERS
        .registered
        .load(Ordering::Acquire)
        .then(|| OTHERS.since_ns.load(Ordering::Acquire))
}

/// Whether a foreign user seen through interposition has finished (read
/// once: it is reset).
pub fn foreign_done() -> bool {
    let idle_since = OTHERS.idle_since_ns.load(Ordering::Acquire);
    if idle_since != 0
        && devtrace_shm::clock::now_ns().saturating_sub(idle_since) > FOREIGN_FLUSH_GRACE_NS
    {
        foreign_finished();
    }
    OTHERS.done.swap(false, Ordering::AcqRel) && !OTHERS.registered.load(Ordering::Acquire)
}

/// A buffer that is not ours reached our `bufferCompleted`.
pub fn foreign_buffer_arrived() {
    OTHERS.buffers.fetch_add(1, Ordering::AcqRel);
}

/// Why CUPTI must stay attached for another user, if it must: the
/// evidence, in words for the trace.
pub fn other_user_active() -> Option<String> {
    if OTHERS.subscribed.load(Ordering::Acquire) {
        return Some("another CUPTI user in the process holds a Callback API subscriber".into());
    }
    if OTHERS.registered.load(Ordering::Acquire) {
        return Some(
            "another CUPTI user in the process has its activity callbacks registered".into(),
        );
    }
    if OTHERS.kinds.load(Ordering::Acquire) != 0 {
        return Some("another CUPTI user in the process has activity kinds enabled".into());
    }
    let foreign_buffers = OTHERS.buffers.load(Ordering::Acquire);
    if foreign_buffers > 0 && !OTHERS.ever_seen.load(Ordering::Acquire) {
        return Some(format!(
            "{foreign_buffers} activity buffer(s) of another CUPTI user reached this library's \
             callback, from a user that reaches libcupti without passing through the library \
             (dlsym on its handle), whose end cannot be seen"
        ));
    }
    None
}

/// Whether another user seen through interposition has `kind` on.
pub fn other_enabled(kind: u32) -> bool {
    OTHERS.kinds.load(Ordering::Acquire) & kind_bit(kind as c_int) != 0
}

/// Whether the other user keeping CUPTI attached is one this library
/// cannot see (its buffers reached our callback), whose end it will never
/// see either.
pub fn unseen_user() -> bool {
    OTHERS.buffers.load(Ordering::Acquire) > 0 && !OTHERS.ever_seen.load(Ordering::Acquire)
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

/// Runs a hook's body; a panic in it answers `CUPTI_ERROR_UNKNOWN`.
fn guarded(body: impl FnOnce() -> CuptiResult) -> CuptiResult {
    crate::ffi::guard("an interposed CUPTI entry point", CUPTI_ERROR_UNKNOWN, body)
}

fn seen_foreign() {
    OTHERS.ever_seen.store(true, Ordering::Release);
}

/// The handles of the Callback API subscribers foreign users made through
/// the hooks (several from CUDA 13.3, `allowMultipleSubscribers`): one that
/// goes takes only itself away (a user that subscribed unseen and
/// unsubscribes through the hooks takes nothing).
static FOREIGN_SUBSCRIBERS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

fn foreign_subscribers() -> std::sync::MutexGuard<'static, Vec<usize>> {
    FOREIGN_SUBSCRIBERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A foreign subscriber `handle` came.
fn foreign_subscribed(handle: usize) {
    let mut held = foreign_subscribers();
    held.push(handle);
    OTHERS.subscribed.store(true, Ordering::Release);
}

/// A foreign subscriber `handle` went; the others keep CUPTI attached.
fn foreign_unsubscribed(handle: usize) {
    let mut held = foreign_subscribers();
    if let Some(index) = held.iter().position(|h| *h == handle) {
        held.swap_remove(index);
    }
    OTHERS.subscribed.store(!held.is_empty(), Ordering::Release);
}

/// Every subscriber went with a finalize.
fn foreign_subscribers_gone() {
    foreign_subscribers().clear();
    OTHERS.subscribed.store(false, Ordering::Release);
}

fn foreign_finished() {
    OTHERS.idle_since_ns.store(0, Ordering::Release);
    OTHERS.registered.store(false, Ordering::Release);
    OTHERS.done.store(true, Ordering::Release);
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
unsafe extern "C" fn register_callbacks_hook(
    requested: Option<BufferRequested>,
    completed: Option<BufferCompleted>,
) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        if !foreign() {
            // SAFETY: forwarded unchanged.
            return unsafe { (lib.register_callbacks)(requested, completed) };
        }
        // The gate is held until the other user counts as registered: no
        // detach of ours can finalize CUPTI under it meanwhile.
        let gate = detach::gate();
        // CUPTI keeps filling each thread's current buffer after new
        // callbacks are registered, and hands it to the new callback, which
        // discards a buffer it does not know: the other user would lose the
        // start of its records and we the end of ours. Every buffer of ours
        // comes back to us first (a detached CUPTI has none, and is not
        // attached again for it).
        if *gate == Attachment::Attached {
            // SAFETY: a plain CUPTI call.
            let _ = own(|| unsafe { (lib.flush_all)(1) });
        }
        // SAFETY: forwarded unchanged.
        let result = unsafe { (lib.register_callbacks)(requested, completed) };
        if result == CUPTI_SUCCESS {
            seen_foreign();
            OTHERS.kinds.store(0, Ordering::Release);
            OTHERS.idle_since_ns.store(0, Ordering::Release);
            OTHERS
                .since_ns
                .store(devtrace_shm::clock::now_ns(), Ordering::Release);
            OTHERS.registered.store(true, Ordering::Release);
        }
        drop(gate);
        result
    })
}

/// The exported name of [`register_callbacks_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityRegisterCallbacks(
    requested: Option<BufferRequested>,
    completed: Option<BufferCompleted>,
) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { register_callbacks_hook(requested, completed) }
}

/// Interposed `cuptiActivityEnable`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn enable_hook(kind: c_int) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        if !foreign() {
            // SAFETY: forwarded unchanged.
            return unsafe { (lib.enable)(kind) };
        }
        // As for a registration: no finalize of ours between the call and
        // the other user counting as having the kind on.
        let gate = detach::gate();
        // SAFETY: forwarded unchanged.
        let result = unsafe { (lib.enable)(kind) };
        if result == CUPTI_SUCCESS {
            seen_foreign();
            detach::attached_by_another();
            OTHERS.kinds.fetch_or(kind_bit(kind), Ordering::AcqRel);
            OTHERS.idle_since_ns.store(0, Ordering::Release);
        }
        drop(gate);
        result
    })
}

/// The exported name of [`enable_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityEnable(kind: c_int) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { enable_hook(kind) }
}

/// Interposed `cuptiActivityDisable`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn disable_hook(kind: c_int) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: forwarded unchanged.
        let result = unsafe { (lib.disable)(kind) };
        if result == CUPTI_SUCCESS && foreign() {
            let bit = kind_bit(kind);
            let left = OTHERS.kinds.fetch_and(!bit, Ordering::AcqRel) & !bit;
            if left == 0 && OTHERS.registered.load(Ordering::Acquire) {
                OTHERS
                    .idle_since_ns
                    .store(devtrace_shm::clock::now_ns().max(1), Ordering::Release);
            }
        }
        result
    })
}

/// The exported name of [`disable_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityDisable(kind: c_int) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { disable_hook(kind) }
}

/// Interposed `cuptiActivityFlushAll`: a foreign user that switched its
/// kinds off and flushes has had its last buffers.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn flush_all_hook(flag: u32) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: forwarded unchanged.
        let result = unsafe { (lib.flush_all)(flag) };
        if foreign() && OTHERS.idle_since_ns.load(Ordering::Acquire) != 0 {
            foreign_finished();
        }
        result
    })
}

/// The exported name of [`flush_all_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityFlushAll(flag: u32) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { flush_all_hook(flag) }
}

/// Interposed `cuptiFinalize`: everything CUPTI had is reset, ours too. It
/// waits for any CUPTI call of this library under way, and after it this
/// library counts CUPTI as detached.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn finalize_hook() -> CuptiResult {
    guarded(|| {
        let Some(finalize) = real().and_then(|lib| lib.finalize) else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        if !foreign() {
            // SAFETY: forwarded unchanged.
            return unsafe { finalize() };
        }
        let mut gate = detach::gate();
        // SAFETY: forwarded unchanged.
        let result = unsafe { finalize() };
        if result == CUPTI_SUCCESS {
            seen_foreign();
            detach::forget_subscriber();
            // CUPTI gave our buffers to whichever callbacks were registered.
            crate::buffers::give_up_unreturned();
            if *gate == Attachment::Attached {
                *gate = Attachment::Detached;
            }
            OTHERS.kinds.store(0, Ordering::Release);
            foreign_subscribers_gone();
            foreign_finished();
        }
        result
    })
}

/// The exported name of [`finalize_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiFinalize() -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { finalize_hook() }
}

/// Interposed `cuptiActivityRegisterTimestampCallback`: CUPTI stamps every
/// record with the clock another user registers (Kineto's is the CPU's
/// time-stamp counter), which this library then maps them by.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn register_timestamp_hook(
    read: Option<crate::clock::TimestampFunc>,
) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        let Some(register) = lib.register_timestamp_callback else {
            return CUPTI_ERROR_NOT_SUPPORTED;
        };
        // In a forked child a lock of the library's may have been held by
        // a parent's thread at the fork; nothing is recorded there anyway.
        if crate::forked() {
            // SAFETY: forwarded unchanged.
            return unsafe { register(read) };
        }
        // Measured first: CUPTI stamps records with it from the moment it
        // takes it, and the library must know it by then.
        let registration = read.map(crate::clock::measure_registration);
        // SAFETY: forwarded unchanged.
        let result = unsafe { register(read) };
        if let (CUPTI_SUCCESS, Some(registration)) = (result, registration) {
            crate::clock::registered(registration);
        }
        result
    })
}

/// The exported name of [`register_timestamp_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiActivityRegisterTimestampCallback(
    read: Option<crate::clock::TimestampFunc>,
) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { register_timestamp_hook(read) }
}

/// Interposed `cuptiSubscribe`: a subscriber of ours waiting to detach
/// makes way first, so that the other user gets the one subscriber.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn subscribe_hook(
    subscriber: *mut SubscriberHandle,
    callback: Option<CallbackFunc>,
    userdata: *mut c_void,
) -> CuptiResult {
    guarded(|| {
        let Some(subscribe) = real().and_then(|lib| lib.subscribe) else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: forwarded unchanged.
        subscribed_by(subscriber, || unsafe {
            subscribe(subscriber, callback, userdata)
        })
    })
}

/// Interposed `cuptiSubscribe_v2`, as [`subscribe_hook`]: Kineto built for
/// CUDA 13 subscribes this way, and from CUDA 13.3 its subscriber may live
/// beside ours (`allowMultipleSubscribers`), so that only this hook tells
/// that another user needs CUPTI attached.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn subscribe_v2_hook(
    subscriber: *mut SubscriberHandle,
    callback: Option<CallbackFunc>,
    userdata: *mut c_void,
    params: *mut c_void,
) -> CuptiResult {
    guarded(|| {
        let Some(lib) = real() else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        // Reached through the exported name only: a libcupti without it is
        // older than its caller's headers.
        let Some(subscribe_v2) = lib.subscribe_v2 else {
            return CUPTI_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: forwarded unchanged.
        subscribed_by(subscriber, || unsafe {
            subscribe_v2(subscriber, callback, userdata, params)
        })
    })
}

/// Runs a subscription (`subscribe`, forwarded unchanged): the library's
/// own as it is; another user's with the gate held from the subscriber of
/// ours making way to the other's being in place (so that a capture
/// starting meanwhile cannot subscribe in between and leave it refused),
/// and known as another user's subscriber (by the handle CUPTI wrote to
/// `subscriber`) once it succeeded.
fn subscribed_by(
    subscriber: *mut SubscriberHandle,
    subscribe: impl FnOnce() -> CuptiResult,
) -> CuptiResult {
    if !foreign() {
        return subscribe();
    }
    let mut gate = detach::gate();
    detach::give_way(&mut gate);
    let result = subscribe();
    if result == CUPTI_SUCCESS && !subscriber.is_null() {
        seen_foreign();
        // SAFETY: CUPTI wrote the handle there, as it succeeded.
        foreign_subscribed(unsafe { *subscriber } as usize);
    }
    drop(gate);
    result
}

/// The exported name of [`subscribe_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiSubscribe(
    subscriber: *mut SubscriberHandle,
    callback: Option<CallbackFunc>,
    userdata: *mut c_void,
) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { subscribe_hook(subscriber, callback, userdata) }
}

/// The exported name of [`subscribe_v2_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiSubscribe_v2(
    subscriber: *mut SubscriberHandle,
    callback: Option<CallbackFunc>,
    userdata: *mut c_void,
    params: *mut c_void,
) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { subscribe_v2_hook(subscriber, callback, userdata, params) }
}

/// Interposed `cuptiUnsubscribe`.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn unsubscribe_hook(subscriber: SubscriberHandle) -> CuptiResult {
    guarded(|| {
        let Some(unsubscribe) = real().and_then(|lib| lib.unsubscribe) else {
            return CUPTI_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: forwarded unchanged.
        let result = unsafe { unsubscribe(subscriber) };
        if result == CUPTI_SUCCESS && foreign() {
            foreign_unsubscribed(subscriber as usize);
        }
        result
    })
}

/// The exported name of [`unsubscribe_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiUnsubscribe(subscriber: SubscriberHandle) -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { unsubscribe_hook(subscriber) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two other users' subscribers (CUDA 13.3 allows several): CUPTI stays
    /// attached until both went (one flag was cleared by the first to go),
    /// and one that was never seen going takes none of them away.
    #[test]
    fn every_foreign_subscriber_keeps_cupti_attached_until_it_goes() {
        assert!(other_user_active().is_none());
        // What CUPTI would write: a handle, for two; a refusal for the third.
        for (value, result) in [
            (0x10usize, CUPTI_SUCCESS),
            (0x20, CUPTI_SUCCESS),
            (0x30, 39),
        ] {
            let mut handle: SubscriberHandle = std::ptr::null_mut();
            let slot: *mut SubscriberHandle = &mut handle;
            let subscribe = || {
                // SAFETY: the test's own slot.
                unsafe { *slot = value as SubscriberHandle };
                result
            };
            assert_eq!(subscribed_by(slot, subscribe), result);
        }
        // The refused one is not held.
        foreign_unsubscribed(0x30);
        assert!(other_user_active().is_some(), "two are held");
        // One subscribed unseen goes: nothing of the others.
        foreign_unsubscribed(0x99);
        assert!(other_user_active().is_some());
        foreign_unsubscribed(0x10);
        assert!(other_user_active().is_some(), "one subscriber is left");
        foreign_unsubscribed(0x20);
        assert!(other_user_active().is_none());
    }
}
