//! devtrace's CUDA injection library. A workload loads it with
//! `CUDA_INJECTION64_PATH` (the driver calls [`InitializeInjection`] from
//! `cuInit`) or `LD_PRELOAD`; it then streams the process's CUPTI activity
//! into a shared-memory ring that the devtrace agent drains.
//!
//! While no capture runs it costs nothing per CUDA call: CUPTI is detached,
//! and one thread reads the ring's control word every
//! `DEVTRACE_INJECT_POLL_MS` (20 ms). When the agent sets the capture flag it
//! enables CUPTI's activity kinds; buffers CUPTI fills are converted to
//! events on a second thread; when the flag clears it disables them, takes
//! its buffers back and finalizes CUPTI ([`detach`]), so that the job runs
//! as fast after a capture as before it.
//!
//! It must never crash or stall the workload: every failure (no libcupti, a
//! CUPTI error, a panic, an unwritable runtime directory) is logged once to
//! stderr and recorded in the metadata file when there is one, and the
//! library then stays quiet for the rest of the process. Another CUPTI user
//! in the process (a framework profiler) is stepped aside for, never fought
//! ([`coexist`]).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod buffers;
mod coexist;
mod convert;
mod cupti;
mod detach;
mod ffi;
mod sys;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use devtrace_shm::ring::{Control, DropPolicy, Producer, Ring};
use devtrace_shm::workload::{self, ApiRecordSet, MetaRecord, MetaWriter, WorkloadFiles};

use convert::{ClockMap, Converter};
use detach::{Attachment, Progress, Teardown};

/// How often completed records are asked for while a capture runs.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// How long a capture's end waits for CUPTI to hand its buffers back
/// before detaching (detaching hands back the rest).
const RETURN_WAIT: Duration = Duration::from_millis(500);

static QUIET: AtomicBool = AtomicBool::new(false);
static START: Once = Once::new();
static SESSION: OnceLock<Session> = OnceLock::new();

/// Logs the first failure and silences the library.
fn fail(message: &str) {
    if !QUIET.swap(true, Ordering::SeqCst) {
        eprintln!("devtrace-inject: {message}; tracing is off in this process");
        if let Some(session) = SESSION.get() {
            session.write_meta(&MetaRecord::Error {
                message: message.to_string(),
            });
        }
    }
}

fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// Called by the CUDA driver from `cuInit` when `CUDA_INJECTION64_PATH`
/// names this library. Returns 1 (success) in every case: a failure here
/// must not fail the workload's `cuInit`.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> std::ffi::c_int {
    start();
    1
}

/// Runs when the library is loaded (by `LD_PRELOAD`, or by the driver just
/// before it calls [`InitializeInjection`]).
#[cfg(not(test))]
extern "C" fn on_load() {
    start();
}

// Not in this crate's unit-test binary, which is no workload.
#[cfg(not(test))]
#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

fn start() {
    ffi::guard("start-up", (), || START.call_once(start_once));
}

fn start_once() {
    // This library's panics are caught and reported once through
    // `fail`; the default hook would print each one into the
    // workload's stderr. (The hook is this library's own: the workload
    // and other Rust libraries keep theirs.)
    std::panic::set_hook(Box::new(|_| {}));
    coexist::join_global_scope();
    coexist::redirect_callers();
    let spawned = std::thread::Builder::new()
        .name("devtrace-inject".into())
        .spawn(|| ffi::guard("the control thread", (), control_loop));
    if let Err(error) = spawned {
        fail(&format!("cannot start its thread: {error}"));
    }
}

/// Whether the CUDA driver is loaded in this process.
fn cuda_loaded() -> bool {
    ["libcuda.so.1", "libcuda.so"]
        .iter()
        .any(|name| sys::dl::is_loaded(name))
}

fn poll_interval() -> Duration {
    let ms = std::env::var("DEVTRACE_INJECT_POLL_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| (1..=10_000).contains(ms))
        .unwrap_or(20);
    Duration::from_millis(ms)
}

fn ring_capacity() -> u64 {
    std::env::var("DEVTRACE_INJECT_RING_CAPACITY")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|c| (16..=1 << 24).contains(c))
        .unwrap_or(1 << 16)
        .next_power_of_two()
}

/// The shared state of one process's tracing.
struct Session {
    ring: Arc<Ring>,
    producer: Mutex<Producer>,
    meta: Mutex<MetaWriter>,
    converter: Mutex<Converter>,
    /// Buffers of ours CUPTI handed back, to be converted (by the converter
    /// thread, or by whoever holds the gate when it must be now).
    pending: Mutex<VecDeque<Completed>>,
    pending_ready: Condvar,
    dropped_total: AtomicU64,
}

impl Session {
    /// The buffers waiting to be converted, taken.
    fn take_pending(&self) -> VecDeque<Completed> {
        self.pending
            .lock()
            .map(|mut pending| std::mem::take(&mut *pending))
            .unwrap_or_default()
    }

    /// Writes a metadata record; a failure silences the library.
    fn write_meta(&self, record: &MetaRecord) {
        let written = match self.meta.lock() {
            Ok(mut meta) => meta.write(record).map_err(|e| e.to_string()),
            Err(_) => Err("metadata lock poisoned".into()),
        };
        if let Err(error) = written {
            // Not through `fail`, which would write metadata again.
            if !QUIET.swap(true, Ordering::SeqCst) {
                eprintln!("devtrace-inject: writing metadata failed: {error}; tracing is off in this process");
            }
        }
    }
}

fn command_line() -> String {
    std::fs::read("/proc/self/cmdline")
        .map(|bytes| {
            bytes
                .split(|b| *b == 0)
                .filter(|part| !part.is_empty())
                .map(|part| String::from_utf8_lossy(part).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Creates the metadata file, then the ring (the agent discovers rings, so
/// the metadata is always there first), under names no other process wants,
/// whatever pid namespace it is in. Both stay locked while the process lives,
/// which is how the agent finds it from the host (`host_process`).
fn create_files(dir: &Path, pid: u32) -> Result<(Arc<Ring>, MetaWriter), String> {
    let files = WorkloadFiles::new(dir, pid);
    let mut meta = MetaWriter::create(&files.meta)
        .map_err(|e| format!("cannot create {}: {e}", files.meta.display()))?;
    meta.write(&MetaRecord::Process {
        pid,
        command: command_line(),
    })
    .map_err(|e| format!("cannot write {}: {e}", files.meta.display()))?;
    let ring = Ring::create_shared(&files.ring, 1, ring_capacity(), DropPolicy::DropNewest)
        .map_err(|e| format!("cannot create {}: {e}", files.ring.display()))?;
    Ok((ring, meta))
}

/// The libcupti in use: its API version, where it came from, and a warning
/// worth recording about that release.
struct Loaded {
    version: u32,
    origin: &'static str,
    warning: Option<&'static str>,
}

/// Loads libcupti and checks that its records are read right.
fn load_cupti() -> Result<Loaded, String> {
    let origin = cupti::load()?;
    let version = cupti::version().map_err(|e| format!("{origin}: {e}"))?;
    let warning = match cupti::support(version).map_err(|e| format!("{origin}: {e}"))? {
        cupti::Support::Supported => None,
        cupti::Support::Warn(text) => Some(text),
    };
    Ok(Loaded {
        version,
        origin,
        warning,
    })
}

/// Waits for the driver and the runtime directory, sets up the session,
/// then follows the agent's control word until the process ends.
fn control_loop() {
    let poll = poll_interval();
    // In processes that never load CUDA (children of an LD_PRELOAD-ed
    // workload) this is all the library does, ever more rarely.
    let mut wait = poll;
    while !cuda_loaded() {
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(1));
    }
    let loaded = load_cupti();
    let dir = workload::runtime_dir();
    // The agent makes the directory; a workload may start first.
    while !dir.is_dir() {
        std::thread::sleep(Duration::from_secs(1));
    }
    let pid = std::process::id();
    let (ring, meta) = match create_files(&dir, pid) {
        Ok(files) => files,
        Err(error) => return fail(&error),
    };
    let producer = match ring.producer() {
        Ok(producer) => producer,
        Err(error) => return fail(&format!("cannot claim its ring lane: {error}")),
    };
    let session = Session {
        ring,
        producer: Mutex::new(producer),
        meta: Mutex::new(meta),
        converter: Mutex::new(Converter::new(
            pid,
            loaded.as_ref().map_or(0, |loaded| loaded.version),
            cupti::callback_name,
        )),
        pending: Mutex::new(VecDeque::new()),
        pending_ready: Condvar::new(),
        dropped_total: AtomicU64::new(0),
    };
    if SESSION.set(session).is_err() {
        return;
    }
    // Refused or missing CUPTI is told to the agent through the metadata.
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(error) => return fail(&error),
    };
    let Some(session) = SESSION.get() else { return };
    // Users that look CUPTI up from now on find the hooks.
    coexist::redirect_callers();
    session.write_meta(&MetaRecord::Cupti {
        version: loaded.version,
        origin: loaded.origin.to_string(),
    });
    if let Some(text) = loaded.warning {
        eprintln!("devtrace-inject: {text}");
        session.write_meta(&MetaRecord::Warning {
            message: text.to_string(),
        });
    }
    detach::set_converter(convert_pending_now);
    let converter = std::thread::Builder::new()
        .name("devtrace-convert".into())
        .spawn(|| ffi::guard("the converter thread", (), convert_loop));
    if let Err(error) = converter {
        return fail(&format!("cannot start its converter thread: {error}"));
    }
    let mut tracer = Tracer {
        stream: Stream::Off,
        exit_flush_set: false,
        displaced: false,
        last_flush: None,
        api: None,
        all_api: false,
        unselectable_told: false,
        teardown: None,
        kept_attached_told: false,
        next_detach_try: None,
    };
    while !quiet() {
        std::thread::sleep(poll);
        if *detach::gate() == Attachment::Closed {
            return;
        }
        let control = session.ring.control();
        if let Err(error) = tracer.tick(session, control) {
            tracer.give_up(session);
            return fail(&error);
        }
    }
}

/// Where this library stands with CUPTI's activity stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    /// Nothing enabled (no capture).
    Off,
    /// Enabled, and our records arrive.
    Ours,
    /// Another CUPTI user in the process has it; `seen` when its calls pass
    /// through this library, so that its end is seen too.
    Taken { seen: bool },
}

/// The control loop's state across ticks.
struct Tracer {
    stream: Stream,
    /// `flush_at_exit` is registered with atexit (once, at the first take).
    exit_flush_set: bool,
    /// The stream was taken from us and not yet taken back.
    displaced: bool,
    last_flush: Option<Instant>,
    /// The API calls whose records are enabled (`None`: none).
    api: Option<ApiRecordSet>,
    /// The agent asks for every API call's records.
    all_api: bool,
    /// Why the timeline's calls cannot be selected was said.
    unselectable_told: bool,
    /// Detaching CUPTI after a capture, while it is under way.
    teardown: Option<Teardown>,
    /// Why CUPTI stays attached was said, since the last capture.
    kept_attached_told: bool,
    /// After a refused detach, when to try again.
    next_detach_try: Option<Instant>,
}

impl Tracer {
    /// One poll of the control word.
    fn tick(&mut self, session: &Session, control: Control) -> Result<(), String> {
        let capture = control.capture();
        self.all_api = control.all_api_records();
        match (self.stream, capture) {
            (Stream::Off, false) => {
                self.detach_when_alone(session);
                Ok(())
            }
            // Another user holds the stream as a capture starts: it is not
            // taken from it.
            (Stream::Off, true) => match coexist::foreign_holder() {
                Some(_) => {
                    self.displaced_at(session, true, devtrace_shm::clock::now_ns());
                    Ok(())
                }
                None => self.take(session),
            },
            (Stream::Ours, true) => self.keep(session),
            (Stream::Ours, false) => self.stop(session),
            (Stream::Taken { seen: true }, true) if coexist::foreign_done() => self.take(session),
            (Stream::Taken { .. }, true) => Ok(()),
            // The other user keeps what it enabled: nothing is switched off.
            // One whose end cannot be seen is taken back from at the next
            // capture.
            (Stream::Taken { seen }, false) => {
                if !seen || coexist::foreign_done() {
                    self.stream = Stream::Off;
                }
                Ok(())
            }
        }
    }

    /// Registers our callbacks (again: CUPTI was finalized, or another user
    /// replaced them) and enables every kind; says when recording began.
    fn take(&mut self, session: &Session) -> Result<(), String> {
        if let Some(mut teardown) = self.teardown.take() {
            teardown.cancel();
        }
        self.kept_attached_told = false;
        self.next_detach_try = None;
        if !self.exit_flush_set {
            sys::process::at_exit(flush_at_exit);
            self.exit_flush_set = true;
        }
        // Libraries loaded since the last look (a framework imported late).
        coexist::redirect_callers();
        let mut gate = detach::gate();
        if *gate == Attachment::Closed {
            return Ok(());
        }
        *gate = Attachment::Attached;
        cupti::use_system_thread_ids()?;
        cupti::register_callbacks(buffer_requested, buffer_completed)?;
        if self.displaced {
            session.write_meta(&MetaRecord::Resumed {
                at_ns: devtrace_shm::clock::now_ns(),
            });
            self.displaced = false;
        }
        set_clock(session)?;
        for kind in cupti::KINDS {
            cupti::enable(kind)?;
        }
        // Another user may have changed the selection while it had the
        // stream: it is made again.
        let current = self.api.filter(|set| *set != ApiRecordSet::Timeline);
        self.switch_api(session, current)?;
        drop(gate);
        session.write_meta(&MetaRecord::Recording {
            at_ns: devtrace_shm::clock::now_ns(),
        });
        self.stream = Stream::Ours;
        self.last_flush = Some(Instant::now());
        Ok(())
    }

    /// Enables the API records the agent asks for, from `current`, and
    /// tells the agent which (and, once, why not the timeline's alone).
    /// The caller holds the gate.
    fn switch_api(
        &mut self,
        session: &Session,
        current: Option<ApiRecordSet>,
    ) -> Result<(), String> {
        let (set, unselectable) = cupti::api_calls::switch(current, self.all_api)?;
        if let Some(why) = unselectable.filter(|_| !self.unselectable_told) {
            self.unselectable_told = true;
            eprintln!("devtrace-inject: {why}");
            session.write_meta(&MetaRecord::Warning { message: why });
        }
        session.write_meta(&MetaRecord::ApiRecords {
            at_ns: devtrace_shm::clock::now_ns(),
            set,
        });
        self.api = Some(set);
        Ok(())
    }

    /// While capturing: follows the API records asked for, sees whether a
    /// user seen through interposition took the stream, and flushes.
    fn keep(&mut self, session: &Session) -> Result<(), String> {
        if let Some(since_ns) = coexist::foreign_holder() {
            self.displaced_at(session, true, since_ns);
            return Ok(());
        }
        let all_now = matches!(
            self.api,
            Some(ApiRecordSet::All | ApiRecordSet::AllUnselectable)
        );
        let gate = detach::gate();
        if *gate != Attachment::Attached {
            return Ok(());
        }
        if self.all_api != all_now && self.api != Some(ApiRecordSet::AllUnselectable) {
            self.switch_api(session, self.api)?;
        }
        if self
            .last_flush
            .is_some_and(|last| last.elapsed() < FLUSH_EVERY)
        {
            return Ok(());
        }
        self.last_flush = Some(Instant::now());
        // Not forced: a forced flush while kernels run loses their records.
        flush(session, false)
    }

    fn displaced_at(&mut self, session: &Session, seen: bool, at_ns: u64) {
        self.stream = Stream::Taken { seen };
        self.displaced = true;
        session.write_meta(&MetaRecord::Displaced { at_ns, seen });
    }

    /// Ends a capture: switches every kind and API record off, takes the
    /// buffers back, and starts detaching CUPTI.
    fn stop(&mut self, session: &Session) -> Result<(), String> {
        self.stream = Stream::Off;
        {
            let gate = detach::gate();
            if *gate != Attachment::Attached {
                return Ok(());
            }
            self.disable(session)?;
        }
        wait_for_buffers(RETURN_WAIT);
        // Libraries loaded during the capture, before CUPTI may be finalized
        // for want of seeing their calls.
        coexist::redirect_callers();
        self.detach_when_alone(session);
        Ok(())
    }

    /// Detaches CUPTI while no capture runs, unless another CUPTI user may
    /// need it (said once, with the evidence).
    fn detach_when_alone(&mut self, session: &Session) {
        if *detach::gate() != Attachment::Attached {
            self.teardown = None;
            return;
        }
        if let Some(why) = coexist::other_user_active() {
            if let Some(mut teardown) = self.teardown.take() {
                teardown.cancel();
            }
            if !self.kept_attached_told {
                self.kept_attached_told = true;
                session.write_meta(&MetaRecord::Warning {
                    message: format!(
                        "CUPTI stays attached after the capture, at a cost on every CUDA call, \
                         because {why}; it is detached once that user is done"
                    ),
                });
            }
            return;
        }
        if self
            .next_detach_try
            .is_some_and(|next| Instant::now() < next)
        {
            return;
        }
        let teardown = self.teardown.get_or_insert_with(Teardown::new);
        match teardown.step() {
            Progress::Waiting => {}
            Progress::Detached { .. } => {
                self.teardown = None;
                self.api = None;
                let unreturned = buffers::give_up_unreturned();
                if unreturned > 0 {
                    session.write_meta(&MetaRecord::Warning {
                        message: format!(
                            "CUPTI was detached without handing back {unreturned} of the \
                             library's activity buffers ({} in all so far): they went to another \
                             CUPTI user's callback, the records in them are lost, and their memory \
                             is left to that user",
                            buffers::unreturned_total()
                        ),
                    });
                }
            }
            Progress::Refused(why) => {
                self.teardown = None;
                self.next_detach_try = Some(Instant::now() + detach::RETRY_EVERY);
                if !self.kept_attached_told {
                    self.kept_attached_told = true;
                    session.write_meta(&MetaRecord::Warning {
                        message: format!(
                            "CUPTI stays attached after the capture, at a cost on every CUDA \
                             call: {why} (detaching is tried again every second)"
                        ),
                    });
                }
            }
        }
    }

    /// After a failure: leaves CUPTI as the process needs it.
    fn give_up(&mut self, session: &Session) {
        let gate = detach::gate();
        if self.stream == Stream::Ours && *gate == Attachment::Attached {
            let _ = self.disable(session);
        }
        self.stream = Stream::Off;
    }

    /// Disables every kind and the API records, then flushes what CUPTI
    /// holds; the clock is measured again so that records converted from
    /// here on use the stop reading. The caller holds the gate.
    fn disable(&mut self, session: &Session) -> Result<(), String> {
        for kind in cupti::KINDS {
            cupti::disable(kind)?;
        }
        if let Some(set) = self.api.take() {
            cupti::api_calls::disable(set)?;
        }
        flush(session, true)
    }
}

/// Measures CUPTI's clock against `CLOCK_REALTIME`.
fn measure_clock() -> Result<ClockMap, String> {
    let before = devtrace_shm::clock::now_ns();
    let cupti_ns = cupti::timestamp()?;
    let after = devtrace_shm::clock::now_ns();
    Ok(ClockMap::from_readings(before, cupti_ns, after))
}

fn set_clock(session: &Session) -> Result<(), String> {
    let clock = measure_clock()?;
    if let Ok(mut converter) = session.converter.lock() {
        converter.clock = clock;
    }
    Ok(())
}

/// Waits (up to `limit`) until every buffer of ours is back and converted.
fn wait_for_buffers(limit: Duration) {
    let deadline = Instant::now() + limit;
    while buffers::out() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Asks CUPTI for completed buffers (`forced`: partly filled ones too) and
/// counts what it dropped. The caller holds the gate.
fn flush(session: &Session, forced: bool) -> Result<(), String> {
    cupti::flush_all(forced)?;
    set_clock(session)?;
    let dropped = cupti::dropped_since_last()?;
    if dropped > 0 {
        let total = session.dropped_total.fetch_add(dropped, Ordering::Relaxed) + dropped;
        session.write_meta(&MetaRecord::Dropped { total });
    }
    Ok(())
}

/// At exit: CUPTI's last buffers are converted, and from then on this
/// library makes no CUPTI call (the process is tearing down, libcupti's
/// own state with it).
extern "C" fn flush_at_exit() {
    ffi::guard("the exit handler", (), || {
        let mut gate = detach::gate();
        let attached = *gate == Attachment::Attached;
        *gate = Attachment::Closed;
        let Some(session) = SESSION.get() else { return };
        if quiet() || !attached {
            return;
        }
        // CUPTI hands the buffers back to our callback, which queues them.
        if cupti::flush_all(true).is_ok() {
            let _ = set_clock(session);
        }
        convert_all(session, session.take_pending(), true);
    });
}

/// CUPTI asks for a buffer: one of ours, or none past the limit or when
/// the library is quiet (CUPTI then drops records and counts them).
///
/// # Safety
/// Called by CUPTI with three valid out-pointers.
unsafe extern "C" fn buffer_requested(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_records: *mut usize,
) {
    ffi::guard("bufferRequested", (), || {
        let lent = SESSION
            .get()
            .filter(|_| !quiet())
            .and_then(|_| buffers::lend());
        let (out, bytes) = lent.unwrap_or((std::ptr::null_mut(), 0));
        // SAFETY: CUPTI passes valid out-pointers.
        unsafe {
            *buffer = out;
            *size = bytes;
            *max_records = 0;
        }
    });
}

/// CUPTI hands a buffer back: ours are queued for the converter (converted
/// at once while CUPTI is being finalized); another user's are left alone.
///
/// # Safety
/// Called by CUPTI with a buffer it completed (ours or not: that is checked
/// before anything reads it) of `size` bytes, `valid` of them filled.
unsafe extern "C" fn buffer_completed(
    _context: *mut std::ffi::c_void,
    _stream: u32,
    buffer: *mut u8,
    size: usize,
    valid: usize,
) {
    ffi::guard("bufferCompleted", (), || {
        if buffer.is_null() {
            return;
        }
        if !buffers::returned(buffer, size) {
            coexist::foreign_buffer_arrived();
            return;
        }
        let completed = Completed {
            address: buffer as usize,
            valid,
        };
        let Some(session) = SESSION.get() else {
            return buffers::release(buffer);
        };
        if detach::finalizing() {
            // CUPTI is still attached while it finalizes; after, reading
            // records would attach it again.
            return convert_all(session, VecDeque::from([completed]), true);
        }
        match session.pending.lock() {
            Ok(mut pending) => {
                pending.push_back(completed);
                session.pending_ready.notify_one();
            }
            Err(_) => buffers::release(buffer),
        }
    });
}

/// A buffer of ours CUPTI gave back, with the bytes it filled.
#[derive(Clone, Copy)]
struct Completed {
    address: usize,
    valid: usize,
}

/// Converts the pending buffers now; the caller holds the gate, and CUPTI
/// is attached.
fn convert_pending_now() {
    if let Some(session) = SESSION.get() {
        convert_all(session, session.take_pending(), true);
    }
}

/// Converts buffers into events (when `readable`: CUPTI is attached) and
/// frees them: metadata first, then the events into the ring (a full ring
/// counts what it refuses).
fn convert_all(session: &Session, completed: VecDeque<Completed>, readable: bool) {
    let mut events = Vec::new();
    for buffer in completed {
        let address = buffer.address as *mut u8;
        if readable && !quiet() {
            let meta = {
                let Ok(mut converter) = session.converter.lock() else {
                    buffers::release(address);
                    continue;
                };
                let mut record = std::ptr::null_mut();
                // SAFETY: a buffer CUPTI completed with `valid` bytes.
                while unsafe { cupti::next_record(address, buffer.valid, &mut record) } {
                    converter.convert(record, &mut events);
                }
                converter.take_meta()
            };
            for record in &meta {
                session.write_meta(record);
            }
            if let Ok(mut producer) = session.producer.lock() {
                producer.push_batch(&events);
            }
            events.clear();
        }
        buffers::release(address);
    }
}

/// The converter thread: waits for buffers CUPTI gave back and converts
/// them under the gate (reading records is a CUPTI call). Buffers that
/// arrive after CUPTI was detached or the process began exiting are freed
/// unread.
fn convert_loop() {
    let Some(session) = SESSION.get() else { return };
    loop {
        {
            let Ok(mut pending) = session.pending.lock() else {
                return;
            };
            while pending.is_empty() {
                pending = match session.pending_ready.wait(pending) {
                    Ok(pending) => pending,
                    Err(_) => return,
                };
            }
        }
        let gate = detach::gate();
        let readable = *gate == Attachment::Attached;
        convert_all(session, session.take_pending(), readable);
        if *gate == Attachment::Closed {
            return;
        }
    }
}
