//! The timeline's API calls, timed by the library's own Callback API
//! subscriber rather than by CUPTI's API activity records.
//!
//! CUPTI's record of each call is most of what a capture paid for: on an
//! H200 the launch-bound loop cost 3.4 us per kernel while capturing with
//! the runtime API records of its launches (and the capture's other kinds),
//! against 1.55 us with the kernel records alone. The capture's subscriber
//! ([`crate::detach`]) is called at every driver and runtime API call's
//! entry and exit anyway, so while
//! [`start`]ed it stamps the timeline's calls ([`crate::cupti::api_calls`])
//! itself: the host clock at entry (kept in the call's `correlationData`,
//! which CUPTI hands to the exit too) and at exit, the call's correlation id
//! (CUPTI gives the same id to the kernel, copy or memset the call
//! enqueued), its callback id and its thread. No CUPTI call is made on the
//! job's threads.
//!
//! A driver call made inside a runtime call (a `cuLaunchKernel` under
//! `cudaLaunchKernel`) carries the runtime call's correlation id and is
//! left out, as CUPTI's own records leave it out; one with an id of its own
//! is kept, since its device work would carry that id.
//!
//! Each thread appends to a log of its own, behind a mutex that only the
//! control thread contends for, when it [`take`]s the calls at each flush.
//! A log holds at most [`MAX_PER_THREAD`] calls between two takes; calls
//! past that are counted ([`take`] answers how many), never blocked on.

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use devtrace_shm::workload::MetaRecord;

use crate::cupti::api_calls;
use crate::cupti::callbacks::{ApiCallback, API_ENTER, API_EXIT, DRIVER_API, RUNTIME_API};
use crate::session::Session;

/// Calls one thread may log between two takes (32 bytes each: at most
/// 2 MiB a thread). The control thread takes them every 100 ms while a
/// capture runs; a thread would need 650,000 timeline calls a second to
/// fill its log.
pub const MAX_PER_THREAD: usize = 1 << 16;

/// One timeline call, on the host clock (`CLOCK_REALTIME` nanoseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedCall {
    pub start_ns: u64,
    pub end_ns: u64,
    pub correlation_id: u32,
    pub cbid: u32,
    /// The thread's system id (`gettid`), as CUPTI's records give it.
    pub thread: u32,
    /// A runtime API call (else a driver API call).
    pub runtime: bool,
    /// Made while a stream capture was under way in the process: a launch
    /// may then have been recorded into a CUDA graph, running no kernel.
    pub in_stream_capture: bool,
    /// The call answered an error (a launch that failed ran nothing).
    pub failed: bool,
}

/// One thread's calls since the last take (their `thread` is filled in
/// when they are taken).
struct ThreadLog {
    calls: Vec<TimedCall>,
    /// The thread's system id.
    thread: u32,
}

type SharedLog = Arc<Mutex<ThreadLog>>;

/// Whether calls are timed now (a capture runs with the subscriber ours).
static ON: AtomicBool = AtomicBool::new(false);
/// When timing last started: an entry stamp older than that is not this
/// module's (CUPTI does not promise a zeroed `correlationData`), so the call
/// entered before timing started.
static STARTED_AT_NS: AtomicU64 = AtomicU64::new(0);
/// The subscriber was called since timing last started (see [`called`]).
static CALLED: AtomicBool = AtomicBool::new(false);
/// Every thread's log, taken from by [`take`]; a log whose thread ended is
/// dropped once it has been emptied.
static LOGS: Mutex<Vec<SharedLog>> = Mutex::new(Vec::new());
/// Calls not logged since the last take (a full log, a thread ending).
static LOST: AtomicU64 = AtomicU64::new(0);
/// Stream captures begun and not yet ended, as the subscriber saw them
/// (one begun before it was called is not seen: its launches count as
/// run).
static STREAM_CAPTURES: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static LOG: RefCell<Option<SharedLog>> = const { RefCell::new(None) };
    /// The correlation ids of the runtime API calls this thread is inside,
    /// innermost first (0: none), so that a runtime call made inside
    /// another hides its own driver call without unhiding the outer's.
    static RUNTIME_CALLS: Cell<[u32; RUNTIME_DEPTH]> = const { Cell::new([0; RUNTIME_DEPTH]) };
}

/// Runtime calls followed inside one another; deeper ones push the
/// outermost out.
const RUNTIME_DEPTH: usize = 4;

/// `calls` with the runtime call `id` entered (innermost first).
fn entered(mut calls: [u32; RUNTIME_DEPTH], id: u32) -> [u32; RUNTIME_DEPTH] {
    // No driver call carries id 0 to be hidden by it.
    if id == 0 {
        return calls;
    }
    calls.rotate_right(1);
    calls[0] = id;
    calls
}

/// `calls` with the runtime call `id` left, wherever it is (one that
/// entered before they were followed is in none).
fn left(mut calls: [u32; RUNTIME_DEPTH], id: u32) -> [u32; RUNTIME_DEPTH] {
    if let Some(at) = calls.iter().position(|call| *call == id && id != 0) {
        calls[at..].rotate_left(1);
        calls[RUNTIME_DEPTH - 1] = 0;
    }
    calls
}

/// The timeline's callback ids, as bit sets per domain.
struct Timeline {
    driver: Vec<u64>,
    runtime: Vec<u64>,
}

impl Timeline {
    fn get() -> &'static Timeline {
        static TIMELINE: OnceLock<Timeline> = OnceLock::new();
        TIMELINE.get_or_init(|| Timeline {
            driver: bits(api_calls::DRIVER),
            runtime: bits(api_calls::RUNTIME),
        })
    }

    fn holds(&self, runtime: bool, cbid: u32) -> bool {
        let set = if runtime { &self.runtime } else { &self.driver };
        set.get(cbid as usize / 64)
            .is_some_and(|word| word & (1 << (cbid % 64)) != 0)
    }
}

fn bits(calls: &[(&str, u32)]) -> Vec<u64> {
    let words = calls.iter().map(|(_, id)| *id as usize / 64 + 1).max();
    let mut set = vec![0u64; words.unwrap_or(0)];
    for (_, id) in calls {
        set[*id as usize / 64] |= 1 << (id % 64);
    }
    set
}

/// Starts timing the timeline's calls. Calls logged since the last capture's
/// last take (by callbacks under way as it stopped) are dropped: their
/// capture's trace is built.
pub fn start() {
    Timeline::get();
    take(&mut Vec::new(), false);
    STARTED_AT_NS.store(devtrace_shm::clock::now_ns(), Ordering::Release);
    CALLED.store(false, Ordering::Release);
    ON.store(true, Ordering::Release);
}

/// Stops timing, in a forked child too (no control thread takes its calls
/// there). Calls already inside the callback still log. Answers whether
/// timing was on.
pub fn stop() -> bool {
    ON.swap(false, Ordering::AcqRel)
}

/// When timing last started.
pub fn started_at_ns() -> u64 {
    STARTED_AT_NS.load(Ordering::Acquire)
}

/// Whether CUPTI called the subscriber at all since timing started: a
/// subscriber CUPTI does not call (as CUPTI 13.0 treats some) times nothing.
pub fn called() -> bool {
    CALLED.load(Ordering::Acquire)
}

/// Whether calls are being timed.
pub fn on() -> bool {
    ON.load(Ordering::Acquire)
}

/// Called by the capture's subscriber at every API call's entry and exit,
/// with what CUPTI passed it.
///
/// # Safety
/// `data` is null or the `CUpti_CallbackData` CUPTI passes for the driver
/// and runtime API domains.
pub unsafe fn on_callback(domain: c_int, cbid: u32, data: *const c_void) {
    let runtime = match domain {
        DRIVER_API => false,
        RUNTIME_API => true,
        _ => return,
    };
    if data.is_null() {
        return;
    }
    // SAFETY: as the caller promises.
    let callback = unsafe { ApiCallback::read(data) };
    let ApiCallback {
        site,
        correlation_id,
        correlation_data,
        ..
    } = callback;
    // Followed while not timing too, so that a runtime call that entered
    // before timing started still hides its driver call.
    if runtime && (site == API_ENTER || site == API_EXIT) {
        let _ = RUNTIME_CALLS.try_with(|calls| {
            calls.set(if site == API_ENTER {
                entered(calls.get(), correlation_id)
            } else {
                left(calls.get(), correlation_id)
            })
        });
    }
    if !runtime && site == API_EXIT {
        follow_stream_captures(cbid);
    }
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    // Read before written: the line stays shared between the job's threads.
    if !CALLED.load(Ordering::Relaxed) {
        CALLED.store(true, Ordering::Relaxed);
    }
    if !runtime
        && site == API_EXIT
        && correlation_id != 0
        && RUNTIME_CALLS.try_with(|calls| calls.get()[0]) == Ok(correlation_id)
    {
        return;
    }
    if !Timeline::get().holds(runtime, cbid) {
        return;
    }
    let now = devtrace_shm::clock::now_ns();
    if site == API_ENTER {
        if !correlation_data.is_null() {
            // SAFETY: CUPTI's 64-bit slot for this call, shared by its entry
            // and exit callbacks.
            unsafe { correlation_data.write_unaligned(now) };
        }
        return;
    }
    if site != API_EXIT {
        return;
    }
    let entered = if correlation_data.is_null() {
        now
    } else {
        // SAFETY: as above.
        unsafe { correlation_data.read_unaligned() }
    };
    let started = STARTED_AT_NS.load(Ordering::Relaxed);
    let start_ns = if (started..=now).contains(&entered) {
        entered
    } else {
        now
    };
    log(TimedCall {
        start_ns,
        end_ns: now,
        correlation_id,
        cbid,
        thread: 0,
        runtime,
        in_stream_capture: STREAM_CAPTURES.load(Ordering::Relaxed) > 0,
        // SAFETY: at the call's exit, in its callback.
        failed: unsafe { callback.failed() },
    });
}

/// Counts the stream captures under way from the driver calls that begin
/// and end them (the runtime's make those too). A begin that failed counts
/// until an end: launches then go uncounted by [`crate::unanswered`],
/// which misses a loss rather than reporting one.
fn follow_stream_captures(cbid: u32) {
    match api_calls::stream_capture_edge(cbid) {
        Some(true) => {
            STREAM_CAPTURES.fetch_add(1, Ordering::Relaxed);
        }
        Some(false) => {
            let _ = STREAM_CAPTURES
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
        None => {}
    }
}

/// Appends `call` to this thread's log (made on its first call).
fn log(call: TimedCall) {
    let logged = LOG.try_with(|slot| {
        let Ok(mut slot) = slot.try_borrow_mut() else {
            return false;
        };
        let log = slot.get_or_insert_with(register);
        let Ok(mut log) = log.lock() else {
            return false;
        };
        if log.calls.len() >= MAX_PER_THREAD {
            return false;
        }
        log.calls.push(call);
        true
    });
    if logged != Ok(true) {
        LOST.fetch_add(1, Ordering::Relaxed);
    }
}

fn register() -> SharedLog {
    let log = Arc::new(Mutex::new(ThreadLog {
        calls: Vec::new(),
        thread: crate::sys::process::thread_id(),
    }));
    if let Ok(mut logs) = LOGS.lock() {
        logs.push(Arc::clone(&log));
    }
    log
}

/// Moves every thread's calls into `out` and answers how many calls were
/// lost since the last take. A thread's log is swapped for an empty one
/// while its lock is held, so the thread never waits on a copy. With
/// `release`, the logs give their memory back (the capture is over).
pub fn take(out: &mut Vec<TimedCall>, release: bool) -> u64 {
    let mut taken = Vec::new();
    if let Ok(mut logs) = LOGS.lock() {
        logs.retain(|shared| {
            if let Ok(mut log) = shared.lock() {
                let room = if release { 0 } else { log.calls.capacity() };
                let calls = std::mem::replace(&mut log.calls, Vec::with_capacity(room));
                taken.push((log.thread, calls));
            }
            // Only this list holds the log of a thread that ended.
            Arc::strong_count(shared) > 1
        });
    }
    for (thread, calls) in taken {
        out.extend(calls.into_iter().map(|call| TimedCall { thread, ..call }));
    }
    LOST.swap(0, Ordering::AcqRel)
}

/// Converts the calls timed since the last delivery into events for the
/// ring (their names' metadata first), and counts the calls lost. With
/// `ending`, the capture is over: the logs' memory goes, and the calls this
/// capture lost are told once.
pub fn deliver(session: &Session, ending: bool) {
    let mut calls = Vec::new();
    let lost = take(&mut calls, ending);
    let capture_lost = session.timed_calls_lost.fetch_add(lost, Ordering::Relaxed) + lost;
    let mut events = Vec::with_capacity(calls.len());
    // Even with no call: a delivery is what the tracker of launches in
    // flight counts time by.
    let meta = session.converter.lock().map(|mut converter| {
        for call in &calls {
            converter.timed_call(call, &mut events);
        }
        converter.unanswered.delivered();
        converter.take_meta()
    });
    if let Ok(meta) = meta {
        for record in &meta {
            session.write_meta(record);
        }
        if !events.is_empty() {
            if let Ok(mut producer) = session.producer.lock() {
                producer.push_batch(&events);
            }
        }
    }
    if ending {
        session.timed_calls_lost.store(0, Ordering::Relaxed);
        if capture_lost > 0 {
            session.write_meta(&MetaRecord::Warning {
                message: format!(
                    "{capture_lost} of the timeline's API calls in a capture were not recorded: \
                     a thread made more than {MAX_PER_THREAD} of them between two of the \
                     library's 100 ms flushes, or made them as it ended"
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cupti::callbacks::{CORRELATION_DATA_OFFSET, CORRELATION_ID_OFFSET};

    /// A `CUpti_CallbackData` as CUPTI lays it out (header-checked offsets).
    #[repr(C)]
    struct CallbackData {
        site: u32,
        function_name: *const u8,
        params: *const c_void,
        return_value: *mut c_void,
        symbol_name: *const u8,
        context: *mut c_void,
        context_uid: u32,
        correlation_data: *mut u64,
        correlation_id: u32,
    }

    fn data(site: u32, correlation_id: u32, slot: &mut u64) -> CallbackData {
        CallbackData {
            site,
            function_name: std::ptr::null(),
            params: std::ptr::null(),
            return_value: std::ptr::null_mut(),
            symbol_name: std::ptr::null(),
            context: std::ptr::null_mut(),
            context_uid: 0,
            correlation_data: slot,
            correlation_id,
        }
    }

    fn call(domain: c_int, cbid: u32, site: u32, correlation_id: u32, slot: &mut u64) {
        let d = data(site, correlation_id, slot);
        // SAFETY: a complete callback data record.
        unsafe { on_callback(domain, cbid, std::ptr::addr_of!(d).cast()) };
    }

    const CU_LAUNCH_KERNEL: u32 = 307;
    const CU_CTX_SYNCHRONIZE: u32 = 17;
    const CUDA_LAUNCH_KERNEL: u32 = 211;

    // One test, because timing is one switch for the whole process.
    #[test]
    fn timeline_calls_are_timed_once_each_and_nested_driver_calls_are_left_out() {
        assert_eq!(
            std::mem::offset_of!(CallbackData, correlation_data),
            CORRELATION_DATA_OFFSET
        );
        assert_eq!(
            std::mem::offset_of!(CallbackData, correlation_id),
            CORRELATION_ID_OFFSET
        );
        let (driver, runtime) = (DRIVER_API, RUNTIME_API);
        let mut out = Vec::new();
        take(&mut out, true);
        out.clear();

        // Off: nothing is logged.
        let mut slot = 0u64;
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 1, &mut slot);
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 1, &mut slot);
        assert_eq!(take(&mut out, false), 0);
        assert!(out.is_empty());

        start();
        // A driver launch of its own, stamped at entry and exit.
        let before = devtrace_shm::clock::now_ns();
        let mut slot = 0u64;
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 7, &mut slot);
        assert!(slot >= before, "the entry is stamped in correlationData");
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 7, &mut slot);
        // Not a timeline call.
        let mut other = 0u64;
        call(driver, CU_CTX_SYNCHRONIZE, API_ENTER, 8, &mut other);
        call(driver, CU_CTX_SYNCHRONIZE, API_EXIT, 8, &mut other);
        // A runtime launch with its driver launch inside, sharing its id.
        let (mut outer, mut inner) = (0u64, 0u64);
        call(runtime, CUDA_LAUNCH_KERNEL, API_ENTER, 9, &mut outer);
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 9, &mut inner);
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 9, &mut inner);
        call(runtime, CUDA_LAUNCH_KERNEL, API_EXIT, 9, &mut outer);
        // A runtime launch whose driver launch has an id of its own.
        let (mut outer, mut inner) = (0u64, 0u64);
        call(runtime, CUDA_LAUNCH_KERNEL, API_ENTER, 10, &mut outer);
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 11, &mut inner);
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 11, &mut inner);
        call(runtime, CUDA_LAUNCH_KERNEL, API_EXIT, 10, &mut outer);
        // A runtime call inside another (a library's launch inside a graph
        // or copy call, say), each with its driver launch sharing its id:
        // the inner's exit leaves the outer's driver launch hidden too.
        let (mut outer, mut inner, mut outer_driver, mut inner_driver) = (0u64, 0u64, 0u64, 0u64);
        call(runtime, CUDA_LAUNCH_KERNEL, API_ENTER, 30, &mut outer);
        call(runtime, CUDA_LAUNCH_KERNEL, API_ENTER, 31, &mut inner);
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 31, &mut inner_driver);
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 31, &mut inner_driver);
        call(runtime, CUDA_LAUNCH_KERNEL, API_EXIT, 31, &mut inner);
        call(driver, CU_LAUNCH_KERNEL, API_ENTER, 30, &mut outer_driver);
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 30, &mut outer_driver);
        call(runtime, CUDA_LAUNCH_KERNEL, API_EXIT, 30, &mut outer);
        // A launch that entered before timing began: its slot holds no stamp.
        let mut unstamped = 12_345u64;
        call(driver, CU_LAUNCH_KERNEL, API_EXIT, 13, &mut unstamped);
        // Another thread's launch.
        std::thread::spawn(move || {
            let mut slot = 0u64;
            call(driver, CU_LAUNCH_KERNEL, API_ENTER, 14, &mut slot);
            call(driver, CU_LAUNCH_KERNEL, API_EXIT, 14, &mut slot);
        })
        .join()
        .expect("the thread ran");
        assert!(stop());

        assert_eq!(take(&mut out, false), 0);
        let seen: Vec<(u32, bool, u32)> = out
            .iter()
            .map(|c| (c.correlation_id, c.runtime, c.cbid))
            .collect();
        assert_eq!(
            seen,
            [
                (7, false, CU_LAUNCH_KERNEL),
                (9, true, CUDA_LAUNCH_KERNEL),
                (11, false, CU_LAUNCH_KERNEL),
                (10, true, CUDA_LAUNCH_KERNEL),
                (31, true, CUDA_LAUNCH_KERNEL),
                (30, true, CUDA_LAUNCH_KERNEL),
                (13, false, CU_LAUNCH_KERNEL),
                (14, false, CU_LAUNCH_KERNEL),
            ]
        );
        for c in &out {
            assert!(c.start_ns <= c.end_ns && c.start_ns >= before, "{c:?}");
            assert_ne!(c.thread, 0);
        }
        let unstamped = out.iter().find(|c| c.correlation_id == 13).expect("13");
        assert_eq!(unstamped.start_ns, unstamped.end_ns);
        let threads: std::collections::HashSet<u32> = out.iter().map(|c| c.thread).collect();
        assert_eq!(threads.len(), 2, "two threads' calls");

        // The ended thread's log went with the take; a full log counts.
        out.clear();
        start();
        let mut slot = 0u64;
        for _ in 0..MAX_PER_THREAD + 3 {
            call(driver, CU_LAUNCH_KERNEL, API_EXIT, 20, &mut slot);
        }
        stop();
        assert_eq!(take(&mut out, true), 3);
        assert_eq!(out.len(), MAX_PER_THREAD);
        assert_eq!(LOGS.lock().map(|logs| logs.len()).unwrap_or(0), 1);
    }
}
