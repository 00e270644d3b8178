//! The thread a producing backend runs on: started under a name, told to
//! stop, joined; and the pacing of backends that sample faster while a
//! capture runs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::BackendError;

/// Tells a worker's loop to end; a loop with nothing to do waits on it.
#[derive(Clone, Default)]
pub struct StopFlag(Arc<StopState>);

#[derive(Default)]
struct StopState {
    set: AtomicBool,
    lock: Mutex<()>,
    changed: Condvar,
}

impl StopFlag {
    pub fn is_set(&self) -> bool {
        self.0.set.load(Ordering::Relaxed)
    }

    /// Blocks until the flag is set, without waking in between.
    pub fn wait(&self) {
        let mut guard = self.0.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.is_set() {
            guard = self
                .0
                .changed
                .wait(guard)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn set(&self) {
        // Set under the lock so that a waiter cannot miss the notification.
        let _guard = self.0.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.0.set.store(true, Ordering::Relaxed);
        self.0.changed.notify_all();
    }
}

/// A running backend thread; stopping it waits for the loop to end.
pub struct Worker {
    stop: StopFlag,
    thread: JoinHandle<()>,
}

impl Worker {
    /// Starts `body` on a thread named `devtrace-<backend>`.
    pub fn spawn(
        backend: &'static str,
        body: impl FnOnce(StopFlag) + Send + 'static,
    ) -> Result<Worker, BackendError> {
        let stop = StopFlag::default();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("devtrace-{backend}"))
            .spawn(move || body(flag))
            .map_err(|e| BackendError::Start {
                backend,
                reason: e.to_string(),
            })?;
        Ok(Worker { stop, thread })
    }

    /// True when the loop ended without being asked to.
    pub fn exited(&self) -> bool {
        self.thread.is_finished()
    }

    /// The health of a backend whose thread is `worker`, unless it is
    /// running: stopped without one, failed when its thread ended.
    pub fn not_running(worker: Option<&Worker>, thread: &str) -> Option<super::Health> {
        match worker {
            None => Some(super::Health::Stopped),
            Some(worker) if worker.exited() => Some(super::Health::Failed {
                reason: format!("the {thread} thread ended"),
            }),
            Some(_) => None,
        }
    }

    pub fn stop(self) {
        self.stop.set();
        let _ = self.thread.join();
    }
}

/// Sleeps until the next reading: `busy` apart while any capture runs,
/// `idle` apart otherwise, in steps of at most `busy` so that a capture that
/// starts, or a stop, is noticed within one busy interval.
pub fn pace(stop: &StopFlag, captures: &AtomicUsize, busy: Duration, idle: Duration) {
    let mut slept = Duration::ZERO;
    loop {
        let target = if captures.load(Ordering::Relaxed) > 0 {
            busy
        } else {
            idle
        };
        if slept >= target || stop.is_set() {
            return;
        }
        let step = (target - slept).min(busy);
        std::thread::sleep(step);
        slept += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_worker_stops_when_told_and_reports_an_early_exit() {
        let worker = Worker::spawn("test", |stop| {
            while !stop.is_set() {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .unwrap();
        assert!(!worker.exited());
        worker.stop();
        let early = Worker::spawn("test", |_| {}).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(early.exited());
    }

    #[test]
    fn a_waiting_worker_ends_when_stopped() {
        let worker = Worker::spawn("test", |stop| stop.wait()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!worker.exited(), "waiting is not ending");
        worker.stop();
    }

    #[test]
    fn pacing_follows_capture_activity_and_stops_promptly() {
        let stop = StopFlag::default();
        let captures = AtomicUsize::new(1);
        let started = Instant::now();
        pace(
            &stop,
            &captures,
            Duration::from_millis(5),
            Duration::from_secs(10),
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "busy pacing uses the short interval"
        );
        captures.store(0, Ordering::Relaxed);
        stop.set();
        let started = Instant::now();
        pace(
            &stop,
            &captures,
            Duration::from_millis(5),
            Duration::from_secs(10),
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a stop ends an idle pause"
        );
    }
}
