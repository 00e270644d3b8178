//! The state one traced process shares between its threads: the ring and
//! metadata file it made for the agent, the record converter, and the
//! buffers waiting to be converted; and how it is set up.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use devtrace_shm::ring::{DropPolicy, Producer, Ring};
use devtrace_shm::workload::{MetaRecord, MetaWriter, WorkloadFiles};

use crate::convert::Converter;
use crate::cupti;
use crate::records::Completed;
use crate::QUIET;

/// The shared state of one process's tracing.
pub struct Session {
    pub ring: Arc<Ring>,
    pub producer: Mutex<Producer>,
    pub meta: Mutex<MetaWriter>,
    pub converter: Mutex<Converter>,
    /// Buffers of ours CUPTI handed back, to be converted (by the converter
    /// thread, or by whoever holds the gate when it must be now).
    pub pending: Mutex<VecDeque<Completed>>,
    pub pending_ready: Condvar,
    pub dropped_total: AtomicU64,
    /// The timeline's calls the subscriber could not log in this capture.
    pub timed_calls_lost: AtomicU64,
}

impl Session {
    pub fn new(
        ring: Arc<Ring>,
        producer: Producer,
        meta: MetaWriter,
        converter: Converter,
    ) -> Session {
        Session {
            ring,
            producer: Mutex::new(producer),
            meta: Mutex::new(meta),
            converter: Mutex::new(converter),
            pending: Mutex::new(VecDeque::new()),
            pending_ready: Condvar::new(),
            dropped_total: AtomicU64::new(0),
            timed_calls_lost: AtomicU64::new(0),
        }
    }

    /// The buffers waiting to be converted, taken.
    pub fn take_pending(&self) -> VecDeque<Completed> {
        self.pending
            .lock()
            .map(|mut pending| std::mem::take(&mut *pending))
            .unwrap_or_default()
    }

    /// Writes a metadata record; a failure silences the library.
    pub fn write_meta(&self, record: &MetaRecord) {
        let written = match self.meta.lock() {
            Ok(mut meta) => meta.write(record).map_err(|e| e.to_string()),
            Err(_) => Err("metadata lock poisoned".into()),
        };
        if let Err(error) = written {
            // Not through `fail`, which would write metadata again.
            if !QUIET.swap(true, Ordering::SeqCst) {
                say!("devtrace-inject: writing metadata failed: {error}; tracing is off in this process");
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
pub fn create_files(dir: &Path, pid: u32) -> Result<(Arc<Ring>, MetaWriter), String> {
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
pub struct Loaded {
    pub version: u32,
    pub origin: &'static str,
    pub warning: Option<&'static str>,
}

/// Loads libcupti and checks that its records are read right.
pub fn load_cupti() -> Result<Loaded, String> {
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

fn ring_capacity() -> u64 {
    std::env::var("DEVTRACE_INJECT_RING_CAPACITY")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|c| (16..=1 << 24).contains(c))
        .unwrap_or(1 << 16)
        .next_power_of_two()
}
