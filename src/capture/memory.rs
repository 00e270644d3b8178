//! `--capture-memory`: the budget every trace being built or replied draws
//! from. A build reserves, before it reads anything, what its window holds
//! (the flight recorder's chunks it keeps alive) and what its trace is
//! expected to take; while it encodes it draws every further byte from the
//! budget ([`BuildMemory`] is the builder's [`Grant`]), and once built it
//! keeps just its trace's bytes, until the last reply sending them is out.
//! A build that does not fit waits for others within its request's
//! deadline; one that outgrows what is left stops, refused. Nothing is
//! allocated for a trace that the budget has not granted first.
//!
//! A caller that is not an admin draws from a share of the budget too:
//! all its builds together hold at most [`CALLER_SHARE`] of it, so that
//! one user's long windows wait for each other and never for all of the
//! budget, and another user's capture still finds room.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::spill::SpillSpace;
use crate::protocol::caller::Owner;
use crate::xspace::grant::Spill;
use crate::xspace::Grant;

/// The default budget.
pub const DEFAULT_CAPTURE_MEMORY: usize = 2 << 30;

/// The budget is counted in KiB, so that a semaphore's permits reach
/// terabytes.
const UNIT: usize = 1 << 10;

/// What a build reserves per event of its window before it starts: what a
/// busy host's events encode to (68 bytes each for the mock's mix; kernels
/// with many stats take more), so that most builds never need to draw more.
pub const EXPECTED_BYTES_PER_EVENT: usize = 80;

/// A build that outgrows its reservation draws at least this much at a
/// time, so that it does not ask the semaphore for every block.
const GROWTH_STEP: usize = 4 << 20;

/// Why a build got no memory, or no more.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// It waited for other captures' traces past its request's deadline.
    #[error(
        "waited {:.3} s for {needed} bytes of capture memory ({held}) until this request's \
         deadline; ask again later, for a shorter window, or start the agent with a larger \
         --capture-memory",
        waited.as_secs_f64()
    )]
    OutOfTime {
        waited: Duration,
        needed: usize,
        /// What held it, as the message says it.
        held: String,
    },
    /// It alone needs more than it may ever hold.
    #[error(
        "{what} takes at least {needed} bytes, more than {allowed}; ask for less (a shorter \
         window, one host), or start the agent with a larger --capture-memory"
    )]
    TooLarge {
        /// What needs it, as the message says it.
        what: String,
        needed: usize,
        /// The most it may hold, as the message says it.
        allowed: String,
    },
    /// Its trace outgrew its reservation while the rest of the budget was
    /// held by other captures.
    #[error(
        "this capture's trace outgrew the {held} bytes of capture memory it held while other \
         captures' traces held the rest of --capture-memory ({budget} bytes); ask again \
         later, for a shorter window, or start the agent with a larger --capture-memory"
    )]
    Outgrown { held: usize, budget: usize },
    /// Spilled traces already hold all of `--spill-size`.
    #[error(
        "this capture's trace outgrew its share of --capture-memory ({budget} bytes) and \
         spilled traces hold all of --spill-size ({limit} bytes) in {dir}; ask again later, \
         for a shorter window, or start the agent with a larger --spill-size"
    )]
    SpillFull {
        budget: usize,
        limit: u64,
        dir: String,
    },
    /// Its trace outgrew what its caller may hold, the caller's other
    /// captures holding the rest.
    #[error(
        "this capture's trace outgrew the {held} bytes of capture memory it held while this \
         caller's other captures held the rest of its share ({share} bytes: a caller that is \
         not an admin holds at most half of --capture-memory at once); ask again when they \
         have ended, or for a shorter window"
    )]
    OverShare { held: usize, share: usize },
    /// The spill file could not be written or read back.
    #[error("spilling this capture's trace to {dir} failed: {why}")]
    SpillFailed { dir: String, why: String },
}

/// The part of the budget one caller that is not an admin may hold at
/// once: a half.
pub const CALLER_SHARE: usize = 2;

/// See the module documentation.
#[derive(Debug)]
pub struct CaptureMemory {
    budget: usize,
    units: usize,
    free: Arc<Semaphore>,
    /// What each caller that is not an admin has left of its share, while
    /// it holds some.
    shares: Mutex<HashMap<Owner, Arc<Semaphore>>>,
    /// Told whenever a share gives memory back.
    released: Arc<Notify>,
    /// Where builds that outgrow their share put their finished blocks.
    spill: Option<Arc<SpillSpace>>,
}

/// How often a waiting build looks again even when told nothing.
const RECHECK: Duration = Duration::from_millis(100);

impl CaptureMemory {
    pub fn new(budget: usize) -> CaptureMemory {
        let units = (budget / UNIT).clamp(1, Semaphore::MAX_PERMITS);
        CaptureMemory {
            budget,
            units,
            free: Arc::new(Semaphore::new(units)),
            shares: Mutex::default(),
            released: Arc::new(Notify::new()),
            spill: None,
        }
    }

    /// Units one caller may hold at once.
    fn share_units(&self) -> usize {
        (self.units / CALLER_SHARE).max(1)
    }

    /// `owner`'s share, made when it holds none.
    fn share_of(&self, owner: &Owner) -> Arc<Semaphore> {
        let mut shares = self.shares.lock();
        // Shares no build holds and nothing is drawn from are forgotten.
        let full = self.share_units();
        shares.retain(|_, share| Arc::strong_count(share) > 1 || share.available_permits() < full);
        Arc::clone(
            shares
                .entry(owner.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(full))),
        )
    }

    /// The same budget, with builds that outgrow their share spilling to
    /// `space` rather than failing.
    pub fn with_spill(mut self, space: Arc<SpillSpace>) -> CaptureMemory {
        self.spill = Some(space);
        self
    }

    /// Where builds spill, when they may.
    pub fn spill(&self) -> Option<&Arc<SpillSpace>> {
        self.spill.as_ref()
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes reserved now.
    pub fn held(&self) -> u64 {
        (self.units.saturating_sub(self.free.available_permits()) * UNIT) as u64
    }

    /// Reserves `needed` bytes for `what` (a build, a tool's work; said in
    /// a refusal), waiting until `deadline` at most; at once refused when
    /// the whole budget could not hold it.
    pub async fn reserve(
        &self,
        needed: usize,
        what: impl FnOnce() -> String,
        deadline: Instant,
    ) -> Result<BuildMemory, MemoryError> {
        self.reserve_as(None, needed, what, deadline).await
    }

    /// As [`Self::reserve`], drawn from `owner`'s share as well when it is
    /// a caller that is not an admin.
    pub async fn reserve_as(
        &self,
        owner: Option<&Owner>,
        needed: usize,
        what: impl FnOnce() -> String,
        deadline: Instant,
    ) -> Result<BuildMemory, MemoryError> {
        let units = needed.div_ceil(UNIT).max(1);
        let limit = match owner {
            Some(_) => self.share_units(),
            None => self.units,
        };
        let Some(units32) = u32::try_from(units).ok().filter(|_| units <= limit) else {
            let allowed = match owner {
                Some(_) => format!(
                    "a caller's share of --capture-memory ({} bytes: half of its {} bytes, the \
                     most a caller that is not an admin holds at once)",
                    limit * UNIT,
                    self.budget
                ),
                None => format!("all of --capture-memory ({} bytes)", self.budget),
            };
            return Err(MemoryError::TooLarge {
                what: what(),
                needed,
                allowed,
            });
        };
        let share = owner.map(|owner| self.share_of(owner));
        let build = |(permit, share), waited| BuildMemory {
            free: Arc::clone(&self.free),
            released: Arc::clone(&self.released),
            permit: Some(permit),
            share,
            budget: self.budget,
            used: 0,
            waited,
            spill: self.spill.clone(),
        };
        if let Some(permits) = acquire(&self.free, share.as_ref(), units32) {
            return Ok(build(permits, None));
        }
        // Waiting holds nothing: a semaphore's own wait would take what is
        // free bit by bit, and leave none for the builds already running
        // to grow into.
        let started = Instant::now();
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(permits) = acquire(&self.free, share.as_ref(), units32) {
                return Ok(build(permits, Some(started.elapsed())));
            }
            let now = Instant::now();
            if now >= deadline {
                let held = match owner {
                    Some(_) => format!(
                        "this caller's share, half of --capture-memory's {} bytes, held by its \
                         other captures' traces, or the rest by other callers'",
                        self.budget
                    ),
                    None => format!(
                        "--capture-memory {} bytes, held by other captures' traces",
                        self.budget
                    ),
                };
                return Err(MemoryError::OutOfTime {
                    waited: started.elapsed(),
                    needed,
                    held,
                });
            }
            let _ = tokio::time::timeout_at(deadline.min(now + RECHECK).into(), released).await;
        }
    }
}

/// `units` from the budget and, when there is one, as many from a caller's
/// share: both or neither.
fn acquire(
    free: &Arc<Semaphore>,
    share: Option<&Arc<Semaphore>>,
    units: u32,
) -> Option<(OwnedSemaphorePermit, Option<SharePermit>)> {
    let from_share = match share {
        Some(share) => Some(SharePermit {
            permit: Arc::clone(share).try_acquire_many_owned(units).ok()?,
        }),
        None => None,
    };
    let permit = Arc::clone(free).try_acquire_many_owned(units).ok()?;
    Some((permit, from_share))
}

/// What a build holds of its caller's share (as many units as of the
/// budget).
#[derive(Debug)]
struct SharePermit {
    permit: OwnedSemaphorePermit,
}

/// One build's share of the budget: what it reserved, and what it drew
/// since. Dropped, it goes back to the budget.
#[derive(Debug)]
pub struct BuildMemory {
    free: Arc<Semaphore>,
    released: Arc<Notify>,
    /// Always there until dropped.
    permit: Option<OwnedSemaphorePermit>,
    /// Of its caller's share, when its caller is not an admin.
    share: Option<SharePermit>,
    budget: usize,
    /// Bytes drawn so far ([`Grant::take`]): the reservation is for them.
    used: usize,
    /// How long the build waited for its reservation, when it had to.
    pub waited: Option<Duration>,
    spill: Option<Arc<SpillSpace>>,
}

impl BuildMemory {
    /// What the build waited for, as its trace says it, when it waited.
    pub fn wait_note(&self) -> Option<String> {
        let waited = self.waited?;
        let held = match self.share {
            Some(_) => format!(
                "this caller's share of it (half of --capture-memory's {} bytes) was held by \
                 its other captures' traces, or the rest by other callers'",
                self.budget
            ),
            None => format!(
                "other captures' traces held --capture-memory ({} bytes)",
                self.budget
            ),
        };
        Some(format!(
            "this trace waited {:.3} s for capture memory: {held}",
            waited.as_secs_f64()
        ))
    }

    /// Bytes held from the budget.
    pub fn held(&self) -> usize {
        self.permit.as_ref().map_or(0, |p| p.num_permits() * UNIT)
    }

    /// Gives back all but `bytes`: what a built trace keeps while its
    /// replies are sent.
    pub fn keep_only(&mut self, bytes: usize) {
        let keep = bytes.div_ceil(UNIT).max(1);
        if let Some(permit) = self.permit.as_mut() {
            if permit.num_permits() > keep {
                drop(permit.split(permit.num_permits() - keep));
                if let Some(share) = self.share.as_mut() {
                    let excess = share.permit.num_permits().saturating_sub(keep);
                    drop(share.permit.split(excess));
                }
                self.released.notify_waiters();
            }
        }
        self.used = bytes;
    }
}

/// A build's memory drawn by a reader of stored traces (a tool's work, a
/// listing), its refusals said for that reader rather than for a capture.
pub struct ReadingMemory<'m>(pub &'m mut BuildMemory);

impl Grant for ReadingMemory<'_> {
    type Refusal = String;

    fn take(&mut self, bytes: usize) -> Result<(), String> {
        let budget = self.0.budget;
        if self.0.used.saturating_add(bytes) > budget {
            return Err(format!(
                "with what this request holds already, that is more than all of \
                 --capture-memory ({budget} bytes); ask for one host, or start the agent with a \
                 larger --capture-memory (or look at the file: a few bytes of protobuf or \
                 Brotli can stand for far more)"
            ));
        }
        self.0.take(bytes).map_err(|refusal| match refusal {
            MemoryError::OverShare { share, .. } => format!(
                "this caller's other work holds the rest of its share of --capture-memory \
                 ({share} bytes); ask again when it has ended"
            ),
            _ => format!(
                "captures and tool requests hold the rest of --capture-memory ({budget} bytes) \
                 now; ask again later, or start the agent with a larger --capture-memory"
            ),
        })
    }

    fn let_go(&mut self, bytes: usize) {
        self.0.let_go(bytes);
    }
}

impl Drop for BuildMemory {
    fn drop(&mut self) {
        // Back first, then told: a waiter told finds it there.
        drop(self.permit.take());
        drop(self.share.take());
        self.released.notify_waiters();
    }
}

impl Grant for BuildMemory {
    type Refusal = MemoryError;

    fn take(&mut self, bytes: usize) -> Result<(), MemoryError> {
        let used = self.used.saturating_add(bytes);
        let held = self.held();
        if used <= held {
            self.used = used;
            return Ok(());
        }
        let short = (used - held).div_ceil(UNIT);
        // A step at a time when the budget has it, else just what is short.
        let step = short.max(GROWTH_STEP / UNIT);
        let share = self
            .share
            .as_ref()
            .map(|share| Arc::clone(share.permit.semaphore()));
        for units in [step, short] {
            let Ok(units) = u32::try_from(units) else {
                continue;
            };
            if let Some((more, more_share)) = acquire(&self.free, share.as_ref(), units) {
                match self.permit.as_mut() {
                    Some(permit) => permit.merge(more),
                    None => self.permit = Some(more),
                }
                if let (Some(mine), Some(more)) = (self.share.as_mut(), more_share) {
                    mine.permit.merge(more.permit);
                }
                self.used = used;
                return Ok(());
            }
        }
        match share {
            Some(share) if share.available_permits() < short => Err(MemoryError::OverShare {
                held,
                share: (self.budget / CALLER_SHARE).max(UNIT),
            }),
            _ => Err(MemoryError::Outgrown {
                held,
                budget: self.budget,
            }),
        }
    }

    fn let_go(&mut self, bytes: usize) {
        self.used = self.used.saturating_sub(bytes);
    }

    fn spill(&mut self) -> Option<Box<dyn Spill<Error = MemoryError> + Send>> {
        let space = self.spill.as_ref()?;
        Some(Box::new(space.file(self.budget)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAR: Duration = Duration::from_secs(3600);

    fn test_build() -> String {
        "a test build".into()
    }

    #[tokio::test]
    async fn a_build_over_budget_waits_for_the_one_before_it() {
        let memory = Arc::new(CaptureMemory::new(1 << 20));
        let first = memory
            .reserve(700 << 10, test_build, Instant::now() + FAR)
            .await
            .unwrap();
        assert!(first.waited.is_none());
        let waiting = Arc::clone(&memory);
        let second = tokio::spawn(async move {
            waiting
                .reserve(700 << 10, test_build, Instant::now() + FAR)
                .await
                .map(|m| m.waited)
        });
        tokio::task::yield_now().await;
        assert!(!second.is_finished());
        drop(first);
        assert!(second.await.unwrap().unwrap().is_some());
    }

    #[tokio::test]
    async fn a_wait_past_the_deadline_fails_saying_why() {
        let memory = CaptureMemory::new(1 << 20);
        let _first = memory
            .reserve(1 << 20, test_build, Instant::now())
            .await
            .unwrap();
        let error = memory
            .reserve(1 << 10, test_build, Instant::now())
            .await
            .unwrap_err();
        assert!(matches!(error, MemoryError::OutOfTime { .. }));
        assert!(error.to_string().contains("--capture-memory"), "{error}");
    }

    #[tokio::test]
    async fn a_window_larger_than_the_whole_budget_is_refused_at_once() {
        let memory = CaptureMemory::new(1 << 20);
        let error = memory
            .reserve(
                2 << 20,
                || "this window holds 5 events, and building its trace".into(),
                Instant::now() + FAR,
            )
            .await
            .unwrap_err();
        assert!(
            error.to_string().starts_with("this window holds 5 events"),
            "{error}"
        );
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test]
    async fn a_build_draws_more_while_there_is_more_and_is_refused_after() {
        let memory = CaptureMemory::new(8 << 20);
        let mut build = memory
            .reserve(1 << 20, test_build, Instant::now() + FAR)
            .await
            .unwrap();
        build.take(512 << 10).unwrap();
        assert_eq!(memory.held(), 1 << 20, "within its reservation");
        build.take(1 << 20).unwrap();
        assert_eq!(memory.held(), (1 << 20) + (GROWTH_STEP as u64));
        let _other = memory
            .reserve(2 << 20, test_build, Instant::now())
            .await
            .unwrap();
        // Less than a step is left, but what is short still fits.
        build.take(GROWTH_STEP).unwrap();
        let refused = build.take(8 << 20).unwrap_err();
        assert!(matches!(refused, MemoryError::Outgrown { .. }), "{refused}");
    }

    #[tokio::test]
    async fn a_waiting_build_leaves_what_is_free_to_the_builds_growing() {
        let memory = Arc::new(CaptureMemory::new(8 << 20));
        let mut running = memory
            .reserve(2 << 20, test_build, Instant::now() + FAR)
            .await
            .unwrap();
        let waiting = Arc::clone(&memory);
        let waiter = tokio::spawn(async move {
            waiting
                .reserve(7 << 20, test_build, Instant::now() + FAR)
                .await
                .map(|m| m.waited.is_some())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        // Free: 6 MiB, all of it still there for the running build to
        // grow from its 2 MiB to 8.
        running.take(8 << 20).unwrap();
        assert_eq!(memory.held(), 8 << 20);
        drop(running);
        assert!(
            waiter.await.unwrap().unwrap(),
            "the waiter got it once it was given back"
        );
    }

    #[tokio::test]
    async fn one_caller_holds_at_most_half_and_another_still_finds_room() {
        let memory = CaptureMemory::new(8 << 20);
        let first = Owner::Uid(1001);
        let second = Owner::Uid(1002);
        let mut held = memory
            .reserve_as(Some(&first), 3 << 20, test_build, Instant::now())
            .await
            .unwrap();
        // Its next build waits for its own first, not for the budget.
        let refused = memory
            .reserve_as(Some(&first), 2 << 20, test_build, Instant::now())
            .await
            .unwrap_err();
        assert!(
            matches!(refused, MemoryError::OutOfTime { .. }),
            "{refused}"
        );
        // Said as the share it waited for, not the whole budget.
        assert!(
            refused.to_string().contains("this caller's share, half of"),
            "{refused}"
        );
        // A window larger than the share is refused at once, as such.
        let too_large = memory
            .reserve_as(Some(&first), 5 << 20, test_build, Instant::now())
            .await
            .unwrap_err();
        let said = too_large.to_string();
        assert!(
            said.contains("more than a caller's share of --capture-memory (4194304 bytes: half of its 8388608 bytes"),
            "{said}"
        );
        // Its build outgrowing the half is stopped there.
        let outgrown = held.take(5 << 20).unwrap_err();
        assert!(
            matches!(outgrown, MemoryError::OverShare { .. }),
            "{outgrown}"
        );
        assert!(outgrown.to_string().contains("half of --capture-memory"));
        // Another caller has the other half.
        let other = memory
            .reserve_as(Some(&second), 4 << 20, test_build, Instant::now())
            .await
            .unwrap();
        // More than half in one build: refused at once, saying why.
        let too_large = memory
            .reserve_as(Some(&second), 5 << 20, test_build, Instant::now() + FAR)
            .await
            .unwrap_err();
        assert!(too_large.to_string().contains("half of it"), "{too_large}");
        // A build that waited on its own share says so, not that the
        // whole budget was held.
        let waiter = memory.reserve_as(Some(&first), 2 << 20, test_build, Instant::now() + FAR);
        let (waited, ()) = tokio::join!(waiter, async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(held);
        });
        let waited = waited.unwrap();
        let note = waited.wait_note().expect("it waited");
        assert!(note.contains("this caller's share of it"), "{note}");
        drop((waited, other));
        assert_eq!(memory.held(), 0);
        // An admin's build is bounded by the budget alone.
        let admin = memory
            .reserve_as(None, 7 << 20, test_build, Instant::now())
            .await
            .unwrap();
        drop(admin);
        // Shares held by no build are forgotten.
        memory.share_of(&first);
        assert_eq!(memory.shares.lock().len(), 1);
    }

    #[tokio::test]
    async fn a_built_trace_keeps_only_its_bytes_until_it_is_dropped() {
        let memory = CaptureMemory::new(64 << 20);
        let mut build = memory
            .reserve(10 << 20, test_build, Instant::now() + FAR)
            .await
            .unwrap();
        build.keep_only(3 << 20);
        assert_eq!(memory.held(), 3 << 20);
        drop(build);
        assert_eq!(memory.held(), 0);
    }
}
