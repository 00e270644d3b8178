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
//! library then stays quiet for the rest of the process.

mod convert;
mod cupti;

use std::alloc::Layout;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use devtrace::ring::{DropPolicy, Producer, Ring};
use devtrace::workload::{self, MetaRecord, MetaWriter};

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

/// Whether the CUDA driver is loaded in this process.
fn cuda_loaded() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL");
        // SAFETY: RTLD_NOLOAD only looks the library up; the reference it
        // takes is dropped at once.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            false
        } else {
            // SAFETY: a handle dlopen returned.
            unsafe { libc::dlclose(handle) };
            true
        }
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
    buffers: Mutex<Sender<(usize, usize)>>,
    outstanding: AtomicUsize,
    dropped_total: AtomicU64,
}

impl Session {
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
/// the metadata is always there first). Files left by an earlier process
/// with this pid are removed: no live process can own them.
fn create_files(dir: &Path, pid: u32) -> Result<(Arc<Ring>, MetaWriter), String> {
    let meta_path = workload::meta_path(dir, pid);
    let ring_path = workload::ring_path(dir, pid);
    for stale in [&ring_path, &meta_path] {
        let _ = std::fs::remove_file(stale);
    }
    let mut meta = MetaWriter::create(&meta_path)
        .map_err(|e| format!("cannot create {}: {e}", meta_path.display()))?;
    meta.write(&MetaRecord::Process {
        pid,
        command: command_line(),
    })
    .map_err(|e| format!("cannot write {}: {e}", meta_path.display()))?;
    let ring = Ring::create_shared(&ring_path, 1, ring_capacity(), DropPolicy::DropNewest)
        .map_err(|e| format!("cannot create {}: {e}", ring_path.display()))?;
    Ok((ring, meta))
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
    if !cupti::available() {
        fail("libcupti was not found (add CUDA's extras/CUPTI/lib64 to LD_LIBRARY_PATH)");
        return;
    }
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
        converter: Mutex::new(Converter::new(pid, cupti::callback_name)),
        buffers: Mutex::new(sender),
        outstanding: AtomicUsize::new(0),
        dropped_total: AtomicU64::new(0),
    };
    if SESSION.set(session).is_err() {
        return;
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
    let Some(session) = SESSION.get() else { return };
    let mut enabled = false;
    let mut registered = false;
    let mut last_flush = Instant::now();
    while !quiet() {
        std::thread::sleep(poll);
        let capture = session.ring.control().capture();
        let step = if capture && !enabled {
            enable(session, &mut registered).map(|()| enabled = true)
        } else if !capture && enabled {
            enabled = false;
            disable(session)
        } else if enabled && last_flush.elapsed() >= FLUSH_EVERY {
            last_flush = Instant::now();
            flush(session, false)
        } else {
            Ok(())
        };
        if let Err(error) = step {
            if enabled {
                let _ = disable(session);
            }
            return fail(&error);
        }
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

fn enable(session: &Session, registered: &mut bool) -> Result<(), String> {
    if !*registered {
        cupti::check_version()?;
        cupti::use_system_thread_ids()?;
        cupti::register_callbacks(Some(buffer_requested), Some(buffer_completed))?;
        *registered = true;
        // SAFETY: registers a plain `extern "C"` function.
        unsafe { libc::atexit(flush_at_exit) };
    }
    set_clock(session)?;
    for kind in cupti::KINDS {
        cupti::enable(kind)?;
    }
    Ok(())
}

/// Flushes what CUPTI holds and disables every kind; the clock is measured
/// again so that records converted from here on use the stop reading.
fn disable(session: &Session) -> Result<(), String> {
    for kind in cupti::KINDS {
        cupti::disable(kind)?;
    }
    flush(session, true)
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
        // Give the converter a moment to push the last buffers.
        let deadline = Instant::now() + Duration::from_millis(200);
        while session.outstanding.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    });
}

fn buffer_layout() -> Layout {
    Layout::from_size_align(BUFFER_BYTES, 8).expect("a valid layout")
}

/// CUPTI asks for a buffer. None is given past [`MAX_BUFFERS`] or when the
/// library is quiet; CUPTI then drops records and counts them.
unsafe extern "C" fn buffer_requested(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_records: *mut usize,
) {
    let _ = std::panic::catch_unwind(|| {
        let mut out = std::ptr::null_mut();
        let mut bytes = 0;
        if let Some(session) = SESSION.get() {
            if !quiet() && session.outstanding.fetch_add(1, Ordering::AcqRel) < MAX_BUFFERS {
                // SAFETY: a non-zero layout.
                out = unsafe { std::alloc::alloc(buffer_layout()) };
                if out.is_null() {
                    session.outstanding.fetch_sub(1, Ordering::AcqRel);
                } else {
                    bytes = BUFFER_BYTES;
                }
            } else if !quiet() {
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
    _context: cudarc::driver::sys::CUcontext,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    let _ = std::panic::catch_unwind(|| {
        if buffer.is_null() {
            return;
        }
        let sent = SESSION
            .get()
            .and_then(|s| s.buffers.lock().ok())
            .is_some_and(|sender| sender.send((buffer as usize, valid)).is_ok());
        if !sent {
            release(buffer);
        }
    });
}

fn release(buffer: *mut u8) {
    // SAFETY: every buffer CUPTI holds came from `buffer_requested`.
    unsafe { std::alloc::dealloc(buffer, buffer_layout()) };
    if let Some(session) = SESSION.get() {
        session.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Converts completed buffers into events: metadata first, then the events
/// into the ring (a full ring counts what it refuses).
fn convert_loop(buffers: Receiver<(usize, usize)>) {
    let Some(session) = SESSION.get() else { return };
    let mut events = Vec::new();
    for (address, valid) in buffers {
        let buffer = address as *mut u8;
        if !quiet() {
            let meta = {
                let Ok(mut converter) = session.converter.lock() else {
                    release(buffer);
                    continue;
                };
                let mut record = std::ptr::null_mut();
                // SAFETY: a buffer CUPTI completed with `valid` bytes.
                while unsafe { cupti::next_record(buffer, valid, &mut record) } {
                    converter.convert(record.cast::<u8>(), &mut events);
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
        release(buffer);
    }
}
