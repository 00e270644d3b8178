//! The decode queue: gRPC messages handed off the forwarding path to one
//! decoding thread, so that what the tap records never slows what it
//! forwards.
//!
//! The forwarding tasks only frame messages and [`DecodeQueue::offer`] them;
//! a message's protobuf is parsed on the queue's own thread, which takes
//! what waits in batches. The queue is
//! bounded both in messages and in the bytes they hold (a held message keeps
//! the HTTP/2 receive buffers it arrived in alive). When it is full the
//! message is forwarded undecoded and counted, never waited for: a peer that
//! floods the tap with large messages costs the trace detail, not the job
//! its latency.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::decode::Body;
use super::record::{Call, Direction};

/// How much the queue holds.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Messages waiting to be decoded, across every call.
    pub messages: usize,
    /// Bytes those messages hold.
    pub bytes: usize,
}

impl Default for Bounds {
    /// One message of the decode limit fits.
    fn default() -> Bounds {
        Bounds {
            messages: 4096,
            bytes: super::record::DECODE_LIMIT,
        }
    }
}

/// One message (or, with no body, the arrival of one that is not decoded)
/// of one call, in the order the call's messages arrived.
pub struct Job {
    pub call: Arc<Call>,
    pub direction: Direction,
    /// The message's number in its direction of the call, from 0: gaps are
    /// messages never decoded.
    pub seq: u32,
    /// When it arrived at the tap: the worker runs later.
    pub arrived_ns: u64,
    pub body: Option<Body>,
}

/// Why a message was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Full,
    /// There is no decoding thread (it could not be started).
    Closed,
}

/// The sending side, shared by every forwarding task of a recorder.
pub struct DecodeQueue {
    shared: Arc<Shared>,
    bounds: Bounds,
    /// The decoding thread, to wake it; none when it could not be started.
    worker: Option<std::thread::Thread>,
}

struct Shared {
    jobs: Mutex<Waiting>,
    /// The worker is parked (or about to) and needs waking for new jobs.
    parked: AtomicBool,
    closed: AtomicBool,
    /// Jobs offered and not yet done with: [`DecodeQueue::settle`] waits for 0.
    outstanding: AtomicU64,
}

#[derive(Default)]
struct Waiting {
    jobs: VecDeque<Job>,
    /// Bytes of the waiting jobs and of the batch being decoded.
    bytes: usize,
}

/// While jobs keep coming, the worker looks for more this often rather
/// than being woken for each: a wake-up is a system call on the forwarding
/// path, and a context switch per message on a small machine.
const POLL: Duration = Duration::from_micros(500);
/// Empty polls before the worker parks until the next job wakes it.
const IDLE_POLLS: u32 = 20;

impl DecodeQueue {
    /// Starts the decoding thread, which runs `work` on each job in order
    /// and ends when the queue is dropped.
    pub fn start(bounds: Bounds, work: impl Fn(Job) + Send + 'static) -> DecodeQueue {
        let shared = Arc::new(Shared {
            jobs: Mutex::default(),
            parked: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            outstanding: AtomicU64::new(0),
        });
        let worker_shared = Arc::clone(&shared);
        let started = std::thread::Builder::new()
            .name("devtrace-tap-decode".into())
            .spawn(move || worker_shared.run(work));
        let worker = match started {
            Ok(handle) => Some(handle.thread().clone()),
            Err(error) => {
                tracing::error!(%error, "tap: cannot start the decoding thread; messages are forwarded undecoded");
                None
            }
        };
        DecodeQueue {
            shared,
            bounds,
            worker,
        }
    }

    /// Queues `job` if there is room; never waits.
    pub fn offer(&self, job: Job) -> Result<(), Refused> {
        let Some(worker) = &self.worker else {
            return Err(Refused::Closed);
        };
        let bytes = job.body.as_ref().map_or(0, Body::len);
        {
            let mut waiting = self.shared.jobs.lock();
            if waiting.jobs.len() >= self.bounds.messages
                || waiting.bytes + bytes > self.bounds.bytes
            {
                return Err(Refused::Full);
            }
            waiting.jobs.push_back(job);
            waiting.bytes += bytes;
        }
        self.shared.outstanding.fetch_add(1, Ordering::SeqCst);
        if self.shared.parked.swap(false, Ordering::SeqCst) {
            worker.unpark();
        }
        Ok(())
    }

    /// Waits until every job offered so far has been decoded, for at most
    /// `limit`; false when some are still waiting. For summaries and tests
    /// that read what calls recorded.
    pub fn settle(&self, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while self.shared.outstanding.load(Ordering::SeqCst) > 0 {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }
}

impl Drop for DecodeQueue {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(worker) = &self.worker {
            worker.unpark();
        }
    }
}

impl Shared {
    fn run(&self, work: impl Fn(Job)) {
        let mut idle = 0;
        loop {
            let batch = std::mem::take(&mut self.jobs.lock().jobs);
            if batch.is_empty() {
                if self.closed.load(Ordering::SeqCst) {
                    return;
                }
                idle += 1;
                if idle < IDLE_POLLS {
                    std::thread::sleep(POLL);
                    continue;
                }
                // Parked is set before looking again, so an offer after the
                // look finds it set and wakes this thread.
                self.parked.store(true, Ordering::SeqCst);
                if self.jobs.lock().jobs.is_empty() && !self.closed.load(Ordering::SeqCst) {
                    std::thread::park();
                }
                self.parked.store(false, Ordering::SeqCst);
                continue;
            }
            idle = 0;
            for job in batch {
                let bytes = job.body.as_ref().map_or(0, Body::len);
                work(job);
                // The job, and the receive buffers its body held, are gone.
                self.jobs.lock().bytes -= bytes;
                self.outstanding.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}
