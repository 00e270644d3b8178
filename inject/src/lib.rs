//! devtrace's CUDA injection library. A workload loads it with
//! `CUDA_INJECTION64_PATH` (the driver calls [`InitializeInjection`] from
//! `cuInit`) or `LD_PRELOAD`; it then streams the process's CUPTI activity
//! into a shared-memory ring that the devtrace agent drains.
//!
//! While no capture runs it costs nothing per CUDA call: CUPTI is not
//! enabled, and one thread reads the ring's control word every
//! `DEVTRACE_INJECT_POLL_MS` (20 ms). When the agent sets the capture flag it
//! enables CUPTI's activity kinds; buffers CUPTI fills are converted to
//! events on a second thread; when the flag clears it flushes and disables.
//!
//! It must never crash or stall the workload: every failure (no libcupti, a
//! CUPTI error, a panic, an unwritable runtime directory) is logged once to
//! stderr and recorded in the metadata file when there is one, and the
//! library then stays quiet for the rest of the process. Another CUPTI user
//! in the process (a framework profiler) is stepped aside for, never fought
//! ([`coexist`]).

mod coexist;
mod convert;
mod cupti;
mod got;

use std::alloc::Layout;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use devtrace::ring::{Control, DropPolicy, Producer, Ring};
use devtrace::workload::{self, ApiRecordSet, MetaRecord, MetaWriter, WorkloadFiles};

use coexist::Verdict;
use convert::{ClockMap, Converter};

/// Bytes of each activity buffer handed to CUPTI.
const BUFFER_BYTES: usize = 1 << 20;
/// Buffers CUPTI may hold or have completed but not yet converted; beyond
/// this a request gets none and CUPTI drops (and counts) records.
const MAX_BUFFERS: usize = 64;
/// How often completed records are asked for while a capture runs.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

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
    START.call_once(|| {
        // This library's panics are caught and reported once through
        // `fail`; the default hook would print each one into the
        // workload's stderr. (The hook is this library's own: the workload
        // and other Rust libraries keep theirs.)
        std::panic::set_hook(Box::new(|_| {}));
        coexist::join_global_scope();
        coexist::redirect_callers();
        let spawned = std::thread::Builder::new()
            .name("devtrace-inject".into())
            .spawn(|| {
                if std::panic::catch_unwind(control_loop).is_err() {
                    fail("internal error (panic) in the control thread");
                }
            });
        if let Err(error) = spawned {
            fail(&format!("cannot start its thread: {error}"));
        }
    });
}

/// The CUDA driver this process has loaded, if any; the caller owns the
/// reference the lookup takes.
fn loaded_driver() -> Option<*mut libc::c_void> {
    ["libcuda.so.1", "libcuda.so"]
        .iter()
        .find_map(|name| cupti::library::dlopen(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD).ok())
}

/// Whether the CUDA driver is loaded in this process.
fn cuda_loaded() -> bool {
    loaded_driver().is_some_and(|handle| {
        // SAFETY: a handle dlopen returned; the lookup's reference is dropped.
        unsafe { libc::dlclose(handle) };
        true
    })
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
    buffers: Mutex<Sender<Completed>>,
    /// Buffers this library handed to CUPTI and has not got back, with
    /// their sizes, by address. Another CUPTI user's buffers may be handed
    /// to our callback: those are not ours to read or free.
    ours: Mutex<HashMap<usize, usize>>,
    outstanding: AtomicUsize,
    dropped_total: AtomicU64,
    /// When CUPTI last gave one of our buffers back (or the stream was
    /// taken), `CLOCK_REALTIME` ns.
    last_ours_ns: AtomicU64,
}

impl Session {
    /// How many full-size buffers of ours CUPTI still holds (probe buffers
    /// aside).
    fn full_buffers_held(&self) -> usize {
        self.ours.lock().map_or(0, |ours| {
            ours.values().filter(|b| **b == BUFFER_BYTES).count()
        })
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
    let (sender, receiver) = channel();
    let session = Session {
        ring,
        producer: Mutex::new(producer),
        meta: Mutex::new(meta),
        converter: Mutex::new(Converter::new(
            pid,
            loaded.as_ref().map_or(0, |loaded| loaded.version),
            cupti::callback_name,
        )),
        buffers: Mutex::new(sender),
        ours: Mutex::new(HashMap::new()),
        outstanding: AtomicUsize::new(0),
        dropped_total: AtomicU64::new(0),
        last_ours_ns: AtomicU64::new(0),
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
    let converter = std::thread::Builder::new()
        .name("devtrace-convert".into())
        .spawn(move || {
            if std::panic::catch_unwind(move || convert_loop(receiver)).is_err() {
                fail("internal error (panic) converting CUPTI records");
            }
        });
    if let Err(error) = converter {
        return fail(&format!("cannot start its converter thread: {error}"));
    }
    let probe = coexist::Probe::new(probe_driver);
    let mut tracer = Tracer {
        stream: Stream::Off,
        exit_flush_set: false,
        displaced: false,
        last_flush: None,
        probe,
        version: loaded.version,
        ticks: 0,
        api: None,
        all_api: false,
        unselectable_told: false,
    };
    while !quiet() {
        std::thread::sleep(poll);
        let control = session.ring.control();
        if let Err(error) = tracer.tick(session, control) {
            tracer.give_up(session);
            return fail(&error);
        }
    }
}

/// Where this library stands with CUPTI.
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
    probe: coexist::Probe,
    /// The libcupti's API version.
    version: u32,
    /// Flush ticks while the stream is ours.
    ticks: u64,
    /// The API calls whose records are enabled (`None`: none).
    api: Option<ApiRecordSet>,
    /// The agent asks for every API call's records.
    all_api: bool,
    /// Why the timeline's calls cannot be selected was said.
    unselectable_told: bool,
}

/// The probe runs at every fifth flush (500 ms).
const PROBE_EVERY_TICKS: u64 = 5;

impl Tracer {
    /// One poll of the control word.
    fn tick(&mut self, session: &Session, control: Control) -> Result<(), String> {
        let capture = control.capture();
        self.all_api = control.all_api_records();
        match (self.stream, capture) {
            (Stream::Off, false) => Ok(()),
            // Another user holds the stream as a capture starts: it is not
            // taken from it.
            (Stream::Off, true) => match coexist::foreign_holder() {
                Some(_) => {
                    self.displaced_at(session, true, devtrace::clock::now_ns());
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

    /// Registers our callbacks (again: another user may have replaced them
    /// or finalized CUPTI) and enables every kind.
    fn take(&mut self, session: &Session) -> Result<(), String> {
        if !self.exit_flush_set {
            // SAFETY: registers a plain `extern "C"` function.
            unsafe { libc::atexit(flush_at_exit) };
            self.exit_flush_set = true;
        }
        // Libraries loaded since the last look (a framework imported late).
        coexist::redirect_callers();
        cupti::use_system_thread_ids()?;
        cupti::register_callbacks(buffer_requested, buffer_completed)?;
        if self.displaced {
            // Buffers CUPTI handed to the other user's callback are gone.
            let lost = session.full_buffers_held();
            if let Ok(mut ours) = session.ours.lock() {
                ours.clear();
                let _ =
                    session
                        .outstanding
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                            Some(n.saturating_sub(lost))
                        });
            }
            session.write_meta(&MetaRecord::Resumed {
                at_ns: devtrace::clock::now_ns(),
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
        self.probe.calibrate(self.version);
        session
            .last_ours_ns
            .store(devtrace::clock::now_ns(), Ordering::Release);
        self.stream = Stream::Ours;
        self.last_flush = Some(Instant::now());
        Ok(())
    }

    /// Enables the API records the agent asks for, from `current`, and
    /// tells the agent which (and, once, why not the timeline's alone).
    fn switch_api(
        &mut self,
        session: &Session,
        current: Option<ApiRecordSet>,
    ) -> Result<(), String> {
        let (set, unselectable) = cupti::api_calls::switch(current, self.all_api, probe_calls())?;
        if let Some(why) = unselectable.filter(|_| !self.unselectable_told) {
            self.unselectable_told = true;
            eprintln!("devtrace-inject: {why}");
            session.write_meta(&MetaRecord::Warning { message: why });
        }
        session.write_meta(&MetaRecord::ApiRecords {
            at_ns: devtrace::clock::now_ns(),
            set,
        });
        self.api = Some(set);
        Ok(())
    }

    /// While capturing: follows the API records asked for, checks the
    /// stream is still ours (probing once per flush) and flushes.
    fn keep(&mut self, session: &Session) -> Result<(), String> {
        let all_now = matches!(
            self.api,
            Some(ApiRecordSet::All | ApiRecordSet::AllUnselectable)
        );
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
        flush(session, false)?;
        self.ticks += 1;
        if !self.ticks.is_multiple_of(PROBE_EVERY_TICKS) && coexist::foreign_holder().is_none() {
            return Ok(());
        }
        match coexist::check_ownership(&mut self.probe) {
            Verdict::Ours => Ok(()),
            Verdict::Taken { seen, since_ns } => {
                self.displaced_at(session, seen, since_ns);
                Ok(())
            }
        }
    }

    fn displaced_at(&mut self, session: &Session, seen: bool, at_ns: u64) {
        self.stream = Stream::Taken { seen };
        self.displaced = true;
        session.write_meta(&MetaRecord::Displaced { at_ns, seen });
    }

    /// Ends a capture. Every buffer of ours is flushed back first: one that
    /// does not come back went to another user's callbacks, which took the
    /// stream during the capture without our seeing it. Its kinds then stay
    /// on, and the trace says from when (at most) records are missing.
    fn stop(&mut self, session: &Session) -> Result<(), String> {
        self.stream = Stream::Off;
        flush(session, true)?;
        if let Some(last_ours_ns) = buffers_went_elsewhere(session) {
            self.displaced = true;
            session.write_meta(&MetaRecord::Displaced {
                at_ns: last_ours_ns,
                seen: false,
            });
            return Ok(());
        }
        self.disable(session)
    }

    /// After a failure: leaves CUPTI as the process needs it.
    fn give_up(&mut self, session: &Session) {
        if self.stream == Stream::Ours {
            let _ = self.disable(session);
        }
        self.stream = Stream::Off;
    }

    /// Disables every kind and the API records, then flushes what CUPTI
    /// holds; the clock is measured again so that records converted from
    /// here on use the stop reading.
    fn disable(&mut self, session: &Session) -> Result<(), String> {
        for kind in cupti::KINDS {
            cupti::disable(kind)?;
        }
        if let Some(set) = self.api.take() {
            cupti::api_calls::disable(set, probe_calls())?;
        }
        flush(session, true)
    }
}

/// The driver call the ownership probe makes: cheap, no context needed,
/// and recorded by CUPTI's DRIVER kind on this thread.
fn probe_driver() {
    type GetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    static ENTRY: OnceLock<Option<GetVersion>> = OnceLock::new();
    let entry = ENTRY.get_or_init(|| {
        // The driver's reference is kept for the process's life.
        let address = cupti::library::symbol(loaded_driver()?, "cuDriverGetVersion")?;
        // SAFETY: the driver's cuDriverGetVersion has this signature.
        Some(unsafe { std::mem::transmute::<*mut libc::c_void, GetVersion>(address) })
    });
    if let Some(get_version) = entry {
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { get_version(&mut version) };
    }
}

/// Measures CUPTI's clock against `CLOCK_REALTIME`.
fn measure_clock() -> Result<ClockMap, String> {
    let before = devtrace::clock::now_ns();
    let cupti_ns = cupti::timestamp()?;
    let after = devtrace::clock::now_ns();
    Ok(ClockMap::from_readings(before, cupti_ns, after))
}

fn set_clock(session: &Session) -> Result<(), String> {
    let clock = measure_clock()?;
    if let Ok(mut converter) = session.converter.lock() {
        converter.clock = clock;
    }
    Ok(())
}

/// After a forced flush: waits (up to a second) for our full-size buffers
/// to come back, and when some do not, returns when the last of ours did
/// come back, the latest moment the stream was surely ours.
fn buffers_went_elsewhere(session: &Session) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        if session.full_buffers_held() == 0 {
            return None;
        }
        if Instant::now() >= deadline {
            return Some(session.last_ours_ns.load(Ordering::Acquire));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Driver calls recorded for this library's own sake: the probe's, when it
/// may run.
fn probe_calls() -> &'static [u32] {
    if coexist::probe_enabled() {
        &[cupti::CBID_DRIVER_GET_VERSION]
    } else {
        &[]
    }
}

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

extern "C" fn flush_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Some(session) = SESSION.get() else { return };
        if quiet() || flush(session, true).is_err() {
            return;
        }
        // Give the converter a moment to push the last buffers; ours that
        // never come back went to another CUPTI user's callbacks.
        if let Some(last_ours_ns) = buffers_went_elsewhere(session) {
            session.write_meta(&MetaRecord::Displaced {
                at_ns: last_ours_ns,
                seen: false,
            });
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        while session.outstanding.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    });
}

fn layout(bytes: usize) -> Layout {
    Layout::from_size_align(bytes, 8).expect("a valid layout")
}

/// CUPTI asks for a buffer. None is given past [`MAX_BUFFERS`] or when the
/// library is quiet; CUPTI then drops records and counts them. The probe
/// thread gets buffers with room for one record ([`coexist`]); they do not
/// count towards the limit.
unsafe extern "C" fn buffer_requested(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_records: *mut usize,
) {
    let _ = std::panic::catch_unwind(|| {
        let mut out = std::ptr::null_mut();
        let mut bytes = 0;
        if let Some(session) = SESSION.get().filter(|_| !quiet()) {
            let probe = coexist::probe_buffer();
            let wanted = probe.unwrap_or(BUFFER_BYTES);
            let counted = probe.is_none();
            if !counted || session.outstanding.fetch_add(1, Ordering::AcqRel) < MAX_BUFFERS {
                // SAFETY: a non-zero layout.
                out = unsafe { std::alloc::alloc(layout(wanted)) };
                let kept = !out.is_null()
                    && session.ours.lock().is_ok_and(|mut ours| {
                        ours.insert(out as usize, wanted);
                        true
                    });
                if kept {
                    bytes = wanted;
                } else if !out.is_null() {
                    // SAFETY: allocated just above with this layout.
                    unsafe { std::alloc::dealloc(out, layout(wanted)) };
                    out = std::ptr::null_mut();
                }
            }
            if counted && out.is_null() {
                session.outstanding.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // SAFETY: CUPTI passes valid out-pointers.
        unsafe {
            *buffer = out;
            *size = bytes;
            *max_records = 0;
        }
    });
}

/// CUPTI hands a buffer back: it goes to the converter thread.
unsafe extern "C" fn buffer_completed(
    _context: *mut std::ffi::c_void,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    let _ = std::panic::catch_unwind(|| {
        if buffer.is_null() {
            return;
        }
        // Another CUPTI user's buffer: neither read nor freed here.
        let Some(bytes) = SESSION
            .get()
            .and_then(|s| s.ours.lock().ok())
            .and_then(|mut ours| ours.remove(&(buffer as usize)))
        else {
            return;
        };
        if let Some(session) = SESSION.get() {
            session
                .last_ours_ns
                .store(devtrace::clock::now_ns(), Ordering::Release);
        }
        let completed = Completed {
            address: buffer as usize,
            bytes,
            valid,
        };
        let sent = SESSION
            .get()
            .and_then(|s| s.buffers.lock().ok())
            .is_some_and(|sender| sender.send(completed).is_ok());
        if !sent {
            release(completed);
        }
    });
}

/// A buffer CUPTI gave back: where, its size, and the bytes it filled.
#[derive(Clone, Copy)]
struct Completed {
    address: usize,
    bytes: usize,
    valid: usize,
}

fn release(buffer: Completed) {
    // SAFETY: every buffer in `ours` came from `buffer_requested` with this
    // size.
    unsafe { std::alloc::dealloc(buffer.address as *mut u8, layout(buffer.bytes)) };
    // Probe buffers (smaller) never counted towards the limit.
    if buffer.bytes == BUFFER_BYTES {
        if let Some(session) = SESSION.get() {
            session.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Converts completed buffers into events: metadata first, then the events
/// into the ring (a full ring counts what it refuses).
fn convert_loop(buffers: Receiver<Completed>) {
    let Some(session) = SESSION.get() else { return };
    let mut events = Vec::new();
    for completed in buffers {
        let buffer = completed.address as *mut u8;
        if !quiet() {
            let meta = {
                let Ok(mut converter) = session.converter.lock() else {
                    release(completed);
                    continue;
                };
                let mut record = std::ptr::null_mut();
                // SAFETY: a buffer CUPTI completed with `valid` bytes.
                while unsafe { cupti::next_record(buffer, completed.valid, &mut record) } {
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
        }
        events.clear();
        release(completed);
    }
}
