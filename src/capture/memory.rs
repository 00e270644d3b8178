//! `--capture-memory`: a budget for the traces being built and replied at
//! once. A capture reserves its trace's expected size when it arrives
//! (captures sharing a build share its reservation, as their replies share
//! its bytes) and holds it until its reply has been sent; past the budget,
//! later captures wait for earlier ones, within their deadline, instead of
//! piling up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::recorder::Window;

/// The default budget.
pub const DEFAULT_CAPTURE_MEMORY: usize = 2 << 30;

/// The budget is counted in KiB, so that a semaphore's permits reach
/// terabytes.
const UNIT: usize = 1 << 10;

/// What a second of window is expected to encode to before any trace has
/// been built: a busy host at a million events a second.
const INITIAL_BYTES_PER_SECOND: u64 = 32 << 20;

/// A capture waited for memory longer than its deadline allowed.
#[derive(Debug, thiserror::Error)]
#[error(
    "waited {:.3} s for capture memory (--capture-memory {budget} bytes, held by other \
     captures' traces) until this request's deadline; ask again later, for a shorter window, \
     or start the agent with a larger --capture-memory", waited.as_secs_f64()
)]
pub struct OutOfTime {
    pub waited: Duration,
    pub budget: usize,
}

/// Memory held for one build until every capture sharing it has replied.
#[derive(Debug)]
pub struct Reservation {
    _permit: OwnedSemaphorePermit,
    /// How long the build waited for it, when it had to.
    pub waited: Option<Duration>,
}

/// See the module documentation.
pub struct CaptureMemory {
    budget: usize,
    free: Arc<Semaphore>,
    /// Encoded bytes per second of window of the last trace built.
    bytes_per_second: AtomicU64,
}

impl CaptureMemory {
    pub fn new(budget: usize) -> CaptureMemory {
        let units = (budget / UNIT).clamp(1, Semaphore::MAX_PERMITS);
        CaptureMemory {
            budget,
            free: Arc::new(Semaphore::new(units)),
            bytes_per_second: AtomicU64::new(INITIAL_BYTES_PER_SECOND),
        }
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes reserved now.
    pub fn held(&self) -> u64 {
        let whole = (self.budget / UNIT).clamp(1, Semaphore::MAX_PERMITS);
        (whole.saturating_sub(self.free.available_permits()) * UNIT) as u64
    }

    /// Reserves what a trace of `window` is expected to take (never more
    /// than the whole budget, so that any capture can run alone), waiting
    /// until `deadline` at most.
    pub async fn reserve(
        &self,
        window: Window,
        deadline: Instant,
    ) -> Result<Reservation, OutOfTime> {
        let units = self.expected_units(window);
        if let Ok(permit) = Arc::clone(&self.free).try_acquire_many_owned(units) {
            return Ok(Reservation {
                _permit: permit,
                waited: None,
            });
        }
        let started = Instant::now();
        let acquired = tokio::time::timeout_at(
            deadline.into(),
            Arc::clone(&self.free).acquire_many_owned(units),
        )
        .await;
        match acquired {
            Ok(Ok(permit)) => Ok(Reservation {
                _permit: permit,
                waited: Some(started.elapsed()),
            }),
            // The semaphore is never closed; out of time either way.
            _ => Err(OutOfTime {
                waited: started.elapsed(),
                budget: self.budget,
            }),
        }
    }

    /// Learns from a built trace what the next ones are likely to take.
    pub fn built(&self, window: Window, bytes: usize) {
        let seconds = window.duration_ns().max(1_000_000) as f64 / 1e9;
        self.bytes_per_second
            .store((bytes as f64 / seconds) as u64, Ordering::Relaxed);
    }

    fn expected_units(&self, window: Window) -> u32 {
        let seconds = window.duration_ns() as f64 / 1e9;
        let bytes = self.bytes_per_second.load(Ordering::Relaxed) as f64 * seconds;
        let whole = (self.budget / UNIT).clamp(1, Semaphore::MAX_PERMITS);
        ((bytes as usize) / UNIT)
            .clamp(1, whole)
            .min(u32::MAX as usize) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(seconds: u64) -> Window {
        Window {
            start_ns: 0,
            stop_ns: seconds * 1_000_000_000,
        }
    }

    #[tokio::test]
    async fn a_capture_over_budget_waits_for_the_one_before_it() {
        let memory = CaptureMemory::new(1 << 20);
        let far = Instant::now() + Duration::from_secs(3600);
        let first = memory.reserve(window(10), far).await.unwrap();
        assert!(first.waited.is_none());
        let second = tokio::spawn(async move {
            let reservation = memory.reserve(window(10), far).await;
            (memory, reservation)
        });
        tokio::task::yield_now().await;
        drop(first);
        let (_, second) = second.await.unwrap();
        assert!(second.unwrap().waited.is_some());
    }

    #[tokio::test]
    async fn a_wait_past_the_deadline_fails_saying_why() {
        let memory = CaptureMemory::new(1 << 20);
        let _first = memory.reserve(window(10), Instant::now()).await.unwrap();
        let error = memory
            .reserve(window(10), Instant::now())
            .await
            .unwrap_err();
        assert!(error.to_string().contains("--capture-memory"), "{error}");
    }

    #[tokio::test]
    async fn what_is_held_is_counted_until_the_reservation_goes() {
        let memory = CaptureMemory::new(1 << 30);
        memory.built(window(1), 10 << 20);
        assert_eq!(memory.held(), 0);
        let far = Instant::now() + Duration::from_secs(3600);
        let reservation = memory.reserve(window(1), far).await.unwrap();
        assert_eq!(memory.held(), 10 << 20);
        drop(reservation);
        assert_eq!(memory.held(), 0);
    }

    #[test]
    fn small_traces_reserve_what_they_take() {
        let memory = CaptureMemory::new(1 << 30);
        memory.built(window(1), 10 << 20);
        assert_eq!(memory.expected_units(window(2)), (20 << 20) / UNIT as u32);
    }
}
