//! Living beside another CUPTI user in the same process (PyTorch's Kineto
//! behind `torch.profiler`, `jax.profiler`, Nsight's injection).
//!
//! CUPTI's activity API is per process, not per user: one pair of buffer
//! callbacks, one set of enabled kinds. A framework profiler that starts
//! registers its own callbacks (ours stop receiving records) and, when it
//! stops, disables its kinds (ours with them). This library never holds
//! `cuptiSubscribe` (Kineto runs CPU-only when a subscriber exists), never
//! fights for the stream, and says in the trace which part of a window it
//! lost. It learns of the other user in these ways:
//!
//! - **Interposition.** Other users' calls to
//!   `cuptiActivityRegisterCallbacks`, `cuptiActivityEnable`,
//!   `cuptiActivityDisable`, `cuptiActivityFlushAll` and `cuptiFinalize` pass
//!   through this library on their way to libcupti, unchanged: through the
//!   names it exports (enough when it is preloaded; [`join_global_scope`]
//!   adds them to the global scope when the driver loads it) and through
//!   other libraries' GOT slots, redirected to its hooks
//!   ([`redirect_callers`]; PyTorch binds to libcupti directly). Before a
//!   foreign registration passes on, our buffers are flushed back to us; it
//!   marks the stream as taken; once the other user has switched off every
//!   kind it enabled and flushed (or a second later), or finalized CUPTI,
//!   the stream is taken back at the next tick.
//! - **Buffers that do not come back** (in `lib.rs`): a user that reaches
//!   CUPTI some other way is found out when the forced flush at a capture's
//!   end (or at exit) leaves buffers of ours elsewhere.
//! - **A probe**, opt-in (`DEVTRACE_INJECT_PROBE=on`; CUDA 13, where CUPTI
//!   gives every thread its own activity buffer). Every 500 ms a new
//!   short-lived thread of this library makes one traced driver call
//!   (`cuDriverGetVersion`): a thread's first record makes CUPTI ask the
//!   *registered* callbacks for that thread's buffer, on that thread, before
//!   the call returns. A probe whose request did not reach us means someone
//!   else has the callbacks (or switched the driver records off). Probe
//!   threads get 4 KiB buffers (smaller ones make real CUPTI loop on its own
//!   overhead records; a second request within one probe turns the probe
//!   off). No flush is forced for it: a forced flush while kernels run loses
//!   their records (seen on an H200 with CUDA 13.0), for this library and
//!   the other user alike.
//!
//! A user found out without interposition cannot be seen to finish, so the
//! stream is taken back when the next capture starts.

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
/// When the foreign user switched its last kind off (0: it has some on).
/// It is done once it has also flushed, or a second later: taking the
/// stream back before its final flush would send its last buffers to us.
static FOREIGN_IDLE_SINCE_NS: AtomicU64 = AtomicU64::new(0);
const FOREIGN_FLUSH_GRACE_NS: u64 = 1_000_000_000;

/// Buffer requests made on the probe thread (each answered probe adds one).
static PROBE_REQUESTS: AtomicU64 = AtomicU64::new(0);
/// The probe thread's id (as CUPTI reports system thread ids).
static PROBE_TID: AtomicU32 = AtomicU32::new(0);

/// Bytes of each buffer handed to a probe thread. (With 64 bytes real CUPTI
/// requested again for its own overhead record without end.)
const PROBE_BUFFER_BYTES: usize = 4096;

/// Requests during the probe call under way; more than one means CUPTI
/// writes more than a probe buffer holds.
static PROBE_CALL_REQUESTS: AtomicU32 = AtomicU32::new(0);
/// The probe was found unusable in this process and is off.
static PROBE_BROKEN: AtomicBool = AtomicBool::new(false);

/// Whether the probe runs: only with `DEVTRACE_INJECT_PROBE=on`. On an H200
/// with CUDA 13.0, a workload whose torch.profiler ran inside a capture
/// aborted with a corrupted heap after CUPTI handed a probe thread's buffer
/// to torch.profiler's callback; until that is understood it stays off.
pub fn probe_enabled() -> bool {
    std::env::var("DEVTRACE_INJECT_PROBE").is_ok_and(|v| v == "on")
}

/// Puts this library's exported names into the process's global symbol
/// scope, so that interposition also works when the CUDA driver loaded it
/// (`CUDA_INJECTION64_PATH` opens it with local scope). Names already bound,
/// or found earlier in that scope, stay as they are.
pub fn join_global_scope() {
    // SAFETY: dladdr fills `info` for an address of this library; dlopen
    // with RTLD_NOLOAD only changes the flags of the loaded copy.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = join_global_scope as *const libc::c_void;
        if libc::dladdr(here, &mut info) != 0 && !info.dli_fname.is_null() {
            libc::dlopen(
                info.dli_fname,
                libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_GLOBAL,
            );
        }
    }
}

/// Sends other libraries' calls to the CUPTI entry points this library
/// interposes through it, whoever bound them how (see `got.rs`). Run at
/// start and again when a capture starts, for libraries loaded since. The
/// slots get the private hooks: the address of an exported name, taken in
/// this library, is whatever the dynamic linker bound that name to, which
/// may be libcupti's.
pub fn redirect_callers() -> usize {
    use crate::got::Redirect;
    let hooks: [(&'static std::ffi::CStr, *const ()); 5] = [
        (
            c"cuptiActivityRegisterCallbacks",
            register_callbacks_hook as *const (),
        ),
        (c"cuptiActivityEnable", enable_hook as *const ()),
        (c"cuptiActivityDisable", disable_hook as *const ()),
        (c"cuptiActivityFlushAll", flush_all_hook as *const ()),
        (c"cuptiFinalize", finalize_hook as *const ()),
    ];
    let redirects = hooks.map(|(name, hook)| Redirect {
        name,
        to: hook as usize,
    });
    crate::got::redirect(&redirects)
}

/// Whether a driver record is one of the probe's calls, which stay out of
/// the trace.
pub fn is_probe(cbid: u32, thread_id: u32) -> bool {
    cbid == crate::cupti::CBID_DRIVER_GET_VERSION
        && thread_id != 0
        && thread_id == PROBE_TID.load(Ordering::Relaxed)
}

/// The size of buffer to hand out for a request on the calling thread:
/// `Some` for the probe thread's first request of a probe call (an answer),
/// `None` for a full-size buffer. A second request within one probe call
/// gets a full-size buffer, which ends any loop of requests, and turns the
/// probe off for the process.
pub fn probe_buffer() -> Option<usize> {
    let probe = PROBE_TID.load(Ordering::Relaxed);
    if probe == 0 || probe != gettid() {
        return None;
    }
    PROBE_REQUESTS.fetch_add(1, Ordering::AcqRel);
    if PROBE_CALL_REQUESTS.fetch_add(1, Ordering::AcqRel) == 0
        && !PROBE_BROKEN.load(Ordering::Acquire)
    {
        Some(PROBE_BUFFER_BYTES)
    } else {
        PROBE_BROKEN.store(true, Ordering::Release);
        None
    }
}

/// The probe's state across ticks; each probe runs on a thread of its own.
pub struct Probe {
    call: fn(),
    /// Whether probes run and answer in this process (switched on, CUDA
    /// 13's per-thread buffers); decided when the stream is taken.
    works: bool,
    last_answered_ns: u64,
}

impl Probe {
    /// `call` is the traced driver call a probe makes.
    pub fn new(call: fn()) -> Probe {
        Probe {
            call,
            works: false,
            last_answered_ns: 0,
        }
    }

    /// Called right after the stream is (re)taken, when it is surely ours:
    /// one probe decides whether probes answer in this process (CUDA 13's
    /// per-thread buffers) before any is trusted.
    pub fn calibrate(&mut self, version: u32) {
        self.last_answered_ns = devtrace::clock::now_ns();
        self.works = version >= 130000
            && probe_enabled()
            && self.ask() == Some(true)
            && !PROBE_BROKEN.load(Ordering::Acquire);
    }

    /// One probe on a new thread; `None` when no thread could be made.
    fn ask(&self) -> Option<bool> {
        let call = self.call;
        std::thread::Builder::new()
            .name("devtrace-probe".into())
            .spawn(move || {
                PROBE_CALL_REQUESTS.store(0, Ordering::Release);
                let before = PROBE_REQUESTS.load(Ordering::Acquire);
                PROBE_TID.store(gettid(), Ordering::Release);
                call();
                PROBE_TID.store(0, Ordering::Release);
                PROBE_REQUESTS.load(Ordering::Acquire) > before
            })
            .ok()?
            .join()
            .ok()
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

/// Asks at one tick of a capture: first what interposition saw, then the
/// probe where it works.
pub fn check_ownership(probe: &mut Probe) -> Verdict {
    if let Some(since_ns) = foreign_holder() {
        return Verdict::Taken {
            seen: true,
            since_ns,
        };
    }
    if PROBE_BROKEN.load(Ordering::Acquire) {
        probe.works = false;
    }
    if !probe.works {
        return Verdict::Ours;
    }
    let sent_ns = devtrace::clock::now_ns();
    match probe.ask() {
        Some(true) => {
            probe.last_answered_ns = sent_ns;
            Verdict::Ours
        }
        // The answer comes before the call returns, so a probe whose request
        // went elsewhere is no lag: the callbacks (or the driver records) are
        // someone else's. Lost after the last answered probe.
        Some(false) => Verdict::Taken {
            seen: false,
            since_ns: probe.last_answered_ns,
        },
        None => Verdict::Ours,
    }
}

/// Whether a foreign user seen through interposition has finished (read
/// once: it is reset).
pub fn foreign_done() -> bool {
    let idle_since = FOREIGN_IDLE_SINCE_NS.load(Ordering::Acquire);
    if idle_since != 0
        && devtrace::clock::now_ns().saturating_sub(idle_since) > FOREIGN_FLUSH_GRACE_NS
    {
        foreign_finished();
    }
    FOREIGN_DONE.swap(false, Ordering::AcqRel) && !FOREIGN_REGISTERED.load(Ordering::Acquire)
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
    FOREIGN_IDLE_SINCE_NS.store(0, Ordering::Release);
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
unsafe extern "C" fn register_callbacks_hook(
    requested: Option<BufferRequested>,
    completed: Option<BufferCompleted>,
) -> CuptiResult {
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    let foreign = foreign();
    if foreign {
        // CUPTI keeps filling each thread's current buffer after new
        // callbacks are registered, and hands it to the new callback, which
        // discards a buffer it does not know: the other user would lose the
        // start of its records and we the end of ours. Every buffer of ours
        // comes back to us first.
        // SAFETY: a plain CUPTI call.
        let _ = own(|| unsafe { (lib.flush_all)(1) });
    }
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.register_callbacks)(requested, completed) };
    if result == CUPTI_SUCCESS && foreign {
        FOREIGN_KINDS.store(0, Ordering::Release);
        FOREIGN_IDLE_SINCE_NS.store(0, Ordering::Release);
        FOREIGN_SINCE_NS.store(devtrace::clock::now_ns(), Ordering::Release);
        FOREIGN_REGISTERED.store(true, Ordering::Release);
    }
    result
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
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.enable)(kind) };
    if result == CUPTI_SUCCESS && foreign() {
        FOREIGN_KINDS.fetch_or(kind_bit(kind), Ordering::AcqRel);
        FOREIGN_IDLE_SINCE_NS.store(0, Ordering::Release);
    }
    result
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
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.disable)(kind) };
    if result == CUPTI_SUCCESS && foreign() {
        let left = FOREIGN_KINDS.fetch_and(!kind_bit(kind), Ordering::AcqRel) & !kind_bit(kind);
        if left == 0 && FOREIGN_REGISTERED.load(Ordering::Acquire) {
            FOREIGN_IDLE_SINCE_NS.store(devtrace::clock::now_ns().max(1), Ordering::Release);
        }
    }
    result
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
    let Some(lib) = real() else {
        return CUPTI_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let result = unsafe { (lib.flush_all)(flag) };
    if foreign() && FOREIGN_IDLE_SINCE_NS.load(Ordering::Acquire) != 0 {
        foreign_finished();
    }
    result
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

/// Interposed `cuptiFinalize`: everything CUPTI had is reset, ours too.
///
/// # Safety
/// Called by C code with CUPTI's contract.
unsafe extern "C" fn finalize_hook() -> CuptiResult {
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

/// The exported name of [`finalize_hook`].
///
/// # Safety
/// Called by C code with CUPTI's contract.
#[no_mangle]
pub unsafe extern "C" fn cuptiFinalize() -> CuptiResult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { finalize_hook() }
}
