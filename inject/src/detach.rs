//! Leaving the job as it was before a capture: CUPTI detached, at the
//! point where CUPTI says it is safe to detach.
//!
//! Once any activity kind was enabled, CUPTI keeps its hooks in the CUDA
//! driver until `cuptiFinalize`, and every CUDA call pays for them, kinds
//! enabled or not (a GPT-2 training loop ran 15% slower for the rest of its
//! life after one capture that only disabled its kinds). So after a capture
//! the library finalizes CUPTI, unless another CUPTI user in the process
//! may still need it ([`crate::coexist::other_user_active`]).
//!
//! `cuptiFinalize` must not race other threads' CUPTI calls. CUPTI's own
//! recipe for a dynamic detach is to call it from the exit site of a CUDA
//! API call, through a Callback API subscriber, and that is what
//! [`Teardown`] does. The subscriber is made as each capture takes the
//! stream (before its kinds are enabled on a CUPTI attached afresh, after
//! them on one that stayed attached), with the driver and runtime API
//! domains on ([`subscribe_for_capture`]): CUPTI never calls one made while
//! it is attached with every kind off, as after a capture (and the control
//! thread keeps one kind on from a capture's end to the finalize, in case
//! it calls none at all then). While the capture runs its callback times
//! the timeline's calls ([`crate::timed_calls`]); for the detach it does
//! nothing until the teardown arms it; then the next API call to return
//! finalizes: the job's, or one the control thread makes itself
//! ([`crate::driver::poke`]) so that a job idle after a capture is detached
//! too, and hands back the window's last records before the trace is
//! built. A subscriber blocks other subscribers (Kineto would run without its GPU tracing), so it is handed
//! over at once to another subscriber seen arriving ([`give_way`]); CUPTI
//! then stays attached until the end of the next capture, which subscribes
//! again as it starts. Another user registering activity callbacks does so
//! holding the gate, so no finalize runs under it.
//!
//! The library's own CUPTI calls all happen under [`GATE`]: the control
//! thread's, the converter's (reading records is a CUPTI call too), the
//! finalize and the exit flush. The gate also says whether CUPTI is
//! attached: after a finalize any CUPTI call would attach it again, so
//! nothing calls CUPTI until the next capture takes the stream. Buffers
//! CUPTI hands back while it is being finalized are converted then and
//! there, as CUPTI is still attached, and the finalize does not end before
//! they are ([`convert_if_finalizing`]).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::cupti;
use crate::cupti::callbacks::{self, ApiCallback};
use crate::cupti::library::CUPTI_SUCCESS;

/// How soon a teardown that could not detach looks again.
pub const RETRY_EVERY: Duration = Duration::from_secs(1);

/// Where the library stands with CUPTI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// Never attached by this library, or finalized since.
    Detached,
    /// The library made CUPTI calls since the last finalize.
    Attached,
    /// The process is exiting: no more CUPTI calls from this library.
    Closed,
}

/// Serialises this library's CUPTI calls with the finalize and the exit.
pub static GATE: Mutex<Attachment> = Mutex::new(Attachment::Detached);

/// The gate, whatever a panicking holder left (the state is one word).
pub fn gate() -> MutexGuard<'static, Attachment> {
    GATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Set while a detach subscriber of ours waits for an API call to return.
static ARMED: AtomicBool = AtomicBool::new(false);
/// The subscriber of ours, while subscribed.
static SUBSCRIBER: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Set while `cuptiFinalize` of ours runs.
static FINALIZING: AtomicBool = AtomicBool::new(false);
/// The thread that runs it, meanwhile.
static FINALIZING_THREAD: AtomicU32 = AtomicU32::new(0);
/// Buffers CUPTI hands back during a finalize of ours on another thread
/// than the finalizing one, being converted now: the finalize does not end
/// (and nothing counts CUPTI detached) before they are done.
static CONVERTING_ELSEWHERE: AtomicU32 = AtomicU32::new(0);
/// How many buffers CUPTI ever handed back on another thread during a
/// finalize, for `DEVTRACE_INJECT_DEBUG` (which thread CUPTI delivers them
/// on is not documented).
static DELIVERED_ELSEWHERE: AtomicU64 = AtomicU64::new(0);
/// How many finalizes of ours succeeded.
static DETACHES: AtomicU64 = AtomicU64::new(0);
/// What the last finalize of ours answered, when it failed.
static FINALIZE_FAILED: AtomicI32 = AtomicI32::new(CUPTI_SUCCESS);
/// What the detach callback met while armed, for `DEVTRACE_INJECT_DEBUG`:
/// API exits, exits that found the gate busy, and exits that found another
/// CUPTI user active.
static ARMED_EXITS: AtomicU64 = AtomicU64::new(0);
static ARMED_GATE_BUSY: AtomicU64 = AtomicU64::new(0);
static ARMED_OTHER_USER: AtomicU64 = AtomicU64::new(0);
/// Another user enabled a kind since the last finalize.
static ATTACHED_BY_ANOTHER: AtomicBool = AtomicBool::new(false);
/// When the subscriber of ours last went (to another user, or with another
/// user's finalize) while it timed the timeline's calls (0: never).
static GIVEN_AWAY_AT_NS: AtomicU64 = AtomicU64::new(0);
/// Why the last capture could not subscribe, if it could not.
static SUBSCRIBE_REFUSED: Mutex<Option<String>> = Mutex::new(None);
/// Converts the buffers CUPTI handed back so far; the gate is held.
static CONVERT_PENDING: OnceLock<fn()> = OnceLock::new();

/// In a forked child: no teardown is armed there (the child's CUDA calls
/// must not finalize a CUPTI whose state is its parent's).
pub fn disarm_in_child() {
    ARMED.store(false, Ordering::Release);
}

/// Runs `convert` on a buffer CUPTI handed back, if a finalize of ours is
/// under way (CUPTI is still attached then; after, reading records would
/// attach it again): whether it ran. On the finalizing thread itself CUPTI
/// is inside the finalize; on another thread the finalize is held from
/// ending until `convert` is done.
pub fn convert_if_finalizing(convert: impl FnOnce()) -> bool {
    if !FINALIZING.load(Ordering::SeqCst) {
        return false;
    }
    if FINALIZING_THREAD.load(Ordering::SeqCst) == crate::sys::process::thread_id() {
        convert();
        return true;
    }
    // Counted before the second look: a finalize that clears the flag
    // after that look waits for the count (both sequentially consistent).
    CONVERTING_ELSEWHERE.fetch_add(1, Ordering::SeqCst);
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            CONVERTING_ELSEWHERE.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _done = Done;
    if !FINALIZING.load(Ordering::SeqCst) {
        return false;
    }
    DELIVERED_ELSEWHERE.fetch_add(1, Ordering::Relaxed);
    convert();
    true
}

/// How long a finalize waits for conversions on other threads once
/// `cuptiFinalize` returned.
const CONVERSIONS_WAIT: Duration = Duration::from_millis(200);

/// Names what converts pending buffers (the library's converter).
pub fn set_converter(convert_pending: fn()) {
    let _ = CONVERT_PENDING.set(convert_pending);
}

fn convert_pending() {
    if let Some(convert) = CONVERT_PENDING.get() {
        convert();
    }
}

/// Where a teardown stands after a step.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// Waiting for a CUDA call to return, or for the next window.
    Waiting,
    /// CUPTI was finalized.
    Detached,
    /// CUPTI stays attached, for this reason.
    Refused(String),
}

/// One teardown after a capture, stepped by the control thread.
pub struct Teardown {
    began: Instant,
    /// The capture's subscriber is armed.
    armed: bool,
    /// `DETACHES` when it began.
    detaches_before: u64,
}

impl Teardown {
    pub fn new() -> Teardown {
        Teardown {
            began: Instant::now(),
            armed: false,
            detaches_before: DETACHES.load(Ordering::Acquire),
        }
    }

    /// Whether a finalize of ours succeeded since it began.
    pub fn finalized(&self) -> bool {
        DETACHES.load(Ordering::Acquire) != self.detaches_before
    }

    /// One step: arms the capture's subscriber, so that the next API call
    /// to return (the job's or a [`crate::driver::poke`]) finalizes CUPTI,
    /// or sees that one did.
    pub fn step(&mut self) -> Progress {
        if self.finalized() {
            return Progress::Detached;
        }
        let failed = FINALIZE_FAILED.load(Ordering::Acquire);
        if failed != CUPTI_SUCCESS {
            self.cancel();
            return Progress::Refused(match cupti::check("cuptiFinalize", failed) {
                Err(error) => error,
                Ok(()) => "cuptiFinalize failed".into(),
            });
        }
        let gate = gate();
        // Subscribing now would be of no use: CUPTI never calls a subscriber
        // made after a capture switched its kinds off (and subscribing while
        // the job's threads are inside CUDA calls then is what the job
        // crashed in, on an H200). Armed or not, a subscriber given away
        // since leaves the teardown nothing to wait for.
        if SUBSCRIBER.load(Ordering::Acquire).is_null() {
            drop(gate);
            self.armed = false;
            let why = SUBSCRIBE_REFUSED
                .lock()
                .ok()
                .and_then(|why| why.clone())
                .unwrap_or_else(|| {
                    "the library's Callback API subscriber went to another CUPTI user during \
                     the capture"
                        .into()
                });
            return Progress::Refused(format!("{why}; the next capture's end detaches it"));
        }
        if !self.armed {
            ARMED.store(true, Ordering::Release);
            self.armed = true;
        }
        drop(gate);
        Progress::Waiting
    }

    /// How long ago it began.
    pub fn age(&self) -> Duration {
        self.began.elapsed()
    }

    /// Disarms the subscriber, then waits for a finalize it began before
    /// that to end, so that [`Teardown::finalized`] is settled. The caller
    /// does not hold the gate (the finalize holds it).
    pub fn disarm_and_settle(&mut self) {
        if self.armed {
            ARMED.store(false, Ordering::Release);
        }
        drop(gate());
    }

    /// Disarms the subscriber, keeping it for the next capture's end.
    pub fn cancel(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        ARMED.store(false, Ordering::Release);
        let exits = ARMED_EXITS.swap(0, Ordering::AcqRel);
        let busy = ARMED_GATE_BUSY.swap(0, Ordering::AcqRel);
        let other = ARMED_OTHER_USER.swap(0, Ordering::AcqRel);
        if crate::debug_enabled() && !self.finalized() {
            say!(
                "devtrace-inject: teardown ended without a detach after {} ms: {exits} API exits, \
                 {busy} with the library's CUPTI lock busy, {other} with another CUPTI user active",
                self.age().as_millis()
            );
        }
        if crate::debug_enabled() && self.finalized() {
            say!(
                "devtrace-inject: buffers CUPTI handed back on a thread other than the \
                 finalizing one while it finalized, so far: {}",
                DELIVERED_ELSEWHERE.load(Ordering::Relaxed)
            );
        }
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Subscribes the library's callback as a capture takes the stream: before
/// its kinds are enabled on a CUPTI attached afresh, after them on one that
/// stayed attached; the caller holds the gate, with CUPTI attached. A
/// subscriber made while CUPTI is attached with every kind off (after a
/// capture) is never called (CUPTI 13.0 on an H200 called none in 342
/// windows), so a teardown arms this one rather than subscribing anew.
/// Until armed, the callback only times the timeline's calls (while a
/// capture has it do so, [`crate::timed_calls`]).
/// A subscriber another CUPTI user holds is left to it; the teardown then
/// says why CUPTI stays attached.
pub fn subscribe_for_capture(gate: &Attachment) {
    // A finalize that failed after an earlier capture is tried again.
    FINALIZE_FAILED.store(CUPTI_SUCCESS, Ordering::Release);
    if *gate != Attachment::Attached {
        return;
    }
    let refused = if SUBSCRIBER.load(Ordering::Acquire).is_null() {
        subscribe_locked().err()
    } else {
        None
    };
    if let Ok(mut why) = SUBSCRIBE_REFUSED.lock() {
        *why = refused;
    }
}

/// Subscribes and enables the API domains (not armed); the caller holds
/// the gate, with CUPTI attached.
fn subscribe_locked() -> Result<(), String> {
    let lib = cupti::library_ref().ok_or("libcupti is not loaded")?;
    let (Some(subscribe), Some(enable_domain), Some(_), Some(_)) = (
        lib.subscribe,
        lib.enable_domain,
        lib.unsubscribe,
        lib.finalize,
    ) else {
        return Err("this libcupti has no cuptiFinalize or Callback API to detach with".into());
    };
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: CUPTI writes the handle; the callback is an `extern "C"`
    // function living as long as the process.
    let result = crate::coexist::own(|| unsafe {
        subscribe(&mut handle, Some(on_api_callback), std::ptr::null_mut())
    });
    if result == callbacks::ERROR_MULTIPLE_SUBSCRIBERS {
        return Err("another CUPTI user in the process holds the Callback API subscriber".into());
    }
    cupti::check("cuptiSubscribe", result)?;
    SUBSCRIBER.store(handle, Ordering::Release);
    for domain in callbacks::DOMAINS {
        // SAFETY: our subscriber and a valid domain.
        let result = crate::coexist::own(|| unsafe { enable_domain(1, handle, domain) });
        if let Err(error) = cupti::check("cuptiEnableDomain", result) {
            disarm_locked();
            return Err(error);
        }
    }
    Ok(())
}

/// Drops the subscriber of ours, if any; the caller holds the gate.
fn disarm_locked() {
    ARMED.store(false, Ordering::Release);
    let handle = SUBSCRIBER.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if handle.is_null() {
        return;
    }
    if let Some(unsubscribe) = cupti::library_ref().and_then(|lib| lib.unsubscribe) {
        // SAFETY: our live subscriber.
        let _ = crate::coexist::own(|| unsafe { unsubscribe(handle) });
    }
}

/// CUPTI was finalized (by this library or another user): the subscriber
/// of ours went with everything else, and its handle must never be used
/// again; nobody has CUPTI attached any more.
pub fn forget_subscriber() {
    ARMED.store(false, Ordering::Release);
    if !SUBSCRIBER
        .swap(std::ptr::null_mut(), Ordering::AcqRel)
        .is_null()
    {
        timing_lost();
    }
    ATTACHED_BY_ANOTHER.store(false, Ordering::Release);
}

/// Another CUPTI user is about to subscribe: the subscriber of ours makes
/// way (only one subscriber is allowed before CUDA 13.3), armed or not.
pub fn give_way(_gate: &mut Attachment) {
    if !SUBSCRIBER.load(Ordering::Acquire).is_null() {
        timing_lost();
    }
    disarm_locked();
}

/// The subscriber of ours goes: when it was timing the timeline's calls,
/// the time is kept, for the capture to say from when they are missing.
fn timing_lost() {
    if crate::timed_calls::on() {
        GIVEN_AWAY_AT_NS.store(devtrace_shm::clock::now_ns(), Ordering::Release);
    }
}

/// Whether the subscriber of ours is subscribed (it times the timeline's
/// calls while a capture runs, [`crate::timed_calls`]).
pub fn subscribed() -> bool {
    !SUBSCRIBER.load(Ordering::Acquire).is_null()
}

/// When the subscriber of ours last went while it timed the timeline's
/// calls, if it ever did.
pub fn given_away_at_ns() -> Option<u64> {
    Some(GIVEN_AWAY_AT_NS.load(Ordering::Acquire)).filter(|at| *at != 0)
}

/// Lets the subscriber of ours go (another user that this library cannot
/// see keeps CUPTI attached for good: ours would only block its
/// subscriber).
pub fn release_subscriber() {
    let gate = gate();
    // An exiting process's libcupti may be going already.
    if *gate != Attachment::Closed {
        disarm_locked();
    }
}

/// Another CUPTI user enabled a kind: CUPTI is attached whatever this
/// library did, until the next finalize.
pub fn attached_by_another() {
    ATTACHED_BY_ANOTHER.store(true, Ordering::Release);
}

/// Whether CUPTI is attached afresh as a capture takes the stream: neither
/// this library nor another user attached it since the last finalize.
pub fn fresh(gate: &Attachment) -> bool {
    *gate == Attachment::Detached && !ATTACHED_BY_ANOTHER.load(Ordering::Acquire)
}

/// The subscriber's callback, at every driver and runtime API call's entry
/// and exit from a capture's start until CUPTI is detached: while a capture
/// runs it times the timeline's calls ([`crate::timed_calls`]); once a
/// teardown armed it, CUPTI is finalized at the next exit. It never
/// waits for the gate (a holder may be inside CUPTI waiting on this very
/// call); a busy gate leaves it to the next call.
///
/// # Safety
/// Called by CUPTI with a `CUpti_CallbackData` (or null) as `data`.
unsafe extern "C" fn on_api_callback(
    _userdata: *mut c_void,
    domain: c_int,
    cbid: u32,
    data: *const c_void,
) {
    crate::ffi::guard("the API callback", (), || {
        // A forked child never calls CUPTI: a finalize there could wait
        // forever on a lock a parent's thread held at the fork.
        if crate::forked() {
            return;
        }
        // SAFETY: as CUPTI passes it.
        unsafe { crate::timed_calls::on_callback(domain, cbid, data) };
        if !ARMED.load(Ordering::Acquire) || data.is_null() || !callbacks::DOMAINS.contains(&domain)
        {
            return;
        }
        // SAFETY: CUPTI passes a `CUpti_CallbackData` for the API domains.
        let site = unsafe { ApiCallback::read(data) }.site;
        if site != callbacks::API_EXIT {
            return;
        }
        ARMED_EXITS.fetch_add(1, Ordering::Relaxed);
        let Ok(mut gate) = GATE.try_lock() else {
            ARMED_GATE_BUSY.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A user that arrived since the teardown began keeps CUPTI; the
        // teardown sees it and stands down.
        if crate::coexist::other_user_active().is_some() {
            ARMED_OTHER_USER.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !ARMED.swap(false, Ordering::AcqRel) || *gate != Attachment::Attached {
            return;
        }
        finalize(&mut gate);
    });
}

/// Finalizes CUPTI: what CUPTI handed back is converted first, what it
/// hands back while finalizing is converted as it comes, and from then on
/// nothing of this library calls CUPTI until the next capture.
fn finalize(gate: &mut Attachment) {
    let Some(finalize) = cupti::library_ref().and_then(|lib| lib.finalize) else {
        return;
    };
    convert_pending();
    FINALIZING_THREAD.store(crate::sys::process::thread_id(), Ordering::SeqCst);
    FINALIZING.store(true, Ordering::SeqCst);
    // SAFETY: called at an API exit site, as CUPTI's dynamic detach asks,
    // with every other CUPTI call of this library held off by the gate.
    let result = crate::coexist::own(|| unsafe { finalize() });
    // Buffers CUPTI handed back on its own threads while it finalized are
    // still being read: their conversions end before the finalize counts
    // as done (CUPTI itself presumably waits for its callbacks before it
    // returns; this holds if it does not).
    FINALIZING.store(false, Ordering::SeqCst);
    let waited_from = Instant::now();
    while CONVERTING_ELSEWHERE.load(Ordering::SeqCst) > 0
        && waited_from.elapsed() < CONVERSIONS_WAIT
    {
        std::thread::yield_now();
    }
    FINALIZING_THREAD.store(0, Ordering::SeqCst);
    if result == CUPTI_SUCCESS {
        forget_subscriber();
        *gate = Attachment::Detached;
        DETACHES.fetch_add(1, Ordering::AcqRel);
    } else {
        FINALIZE_FAILED.store(result, Ordering::Release);
    }
}
