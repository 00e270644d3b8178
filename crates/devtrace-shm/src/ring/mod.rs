//! A bounded, lock-free event ring with many producers and one consumer.
//!
//! The ring is split into lanes. Each producer claims a lane of its own and
//! then writes without any read-modify-write instruction: a push is sixteen
//! plain stores and one release store of the head. The consumer (the agent's
//! collector) visits every lane. This is the per-writer buffer design of
//! Perfetto and LTTng: producers never contend with each other and never wait.
//!
//! When a lane is full the [`DropPolicy`] decides what is lost, and every lost
//! event is counted: drop-newest refuses the new event (counted by the
//! producer), drop-oldest overwrites the oldest unread one (counted by the
//! consumer, which detects the overwrite through the slot's sequence word).
//! Either way, events read plus events counted as dropped equals events pushed.
//!
//! # Placement
//!
//! The region is `#[repr(C)]` data addressed by offsets (`layout.rs`), so it
//! can live in two places:
//!
//! - **In process** ([`Ring::new`]): anonymous private memory, for the agent's
//!   own backends.
//! - **Shared** ([`Ring::create_shared`], [`Ring::open_shared`],
//!   [`Ring::create_memfd`]): a file (say `/run/devtrace/<pid>.ring` or any
//!   tmpfs path) or a memfd mapped `MAP_SHARED`, so that a producer in one
//!   process (a CUDA injection library) and the consumer in the agent use the
//!   same lanes. A file is created with mode 0600 under a temporary name,
//!   sized and given its header, and only then linked to its final name, so
//!   no process ever opens a half-written ring. Opening checks magic, layout
//!   version, clock, slot size, lane count, capacity, policy and the file's
//!   size before any offset is trusted. Producers and the consumer then work
//!   exactly as in process. A consumer does not trust its producers: a
//!   ring beyond the opener's limits, or in anything but a regular file with
//!   one link, is refused; a file shrunk under the mapping is survived
//!   (`guard.rs`); and counters that no honest producer writes (a head behind
//!   the tail or further ahead than possible, a falling drop count) end the
//!   ring as [`Corruption`] instead of being followed.
//!
//! The shared header carries the creating process's pid, the clock
//! (`CLOCK_REALTIME` nanoseconds), per-lane drop counters and a control word
//! ([`Ring::control`], [`Ring::set_control`]) through which the agent asks
//! producers to record ([`CONTROL_CAPTURE`]); a producer may sleep until it
//! changes ([`Ring::wait_for_control`], a futex the set wakes).
//!
//! **Liveness.** A lane's owner word holds the producer's pid, and the
//! consumer's pid is in the header. [`Ring::release_dead_producers`] frees the
//! lanes whose process has exited (its published events stay queued and are
//! drained as usual; an event it had written but not yet published is simply
//! not there), and a consumer whose process died is replaced by the next
//! [`Ring::consumer`] call. [`remove_stale_rings`] deletes ring files (and
//! leftover temporary files) of processes that are gone. Pids are those of
//! the pid namespace the ring was created in.

mod control_wait;
mod doorbell;
mod guard;
mod layout;
mod shared;
mod sources;

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;

pub use doorbell::Doorbell;
use layout::{LaneHeader, RingHeader, Slot, SlotSeq, REGION_ALIGN};
pub use layout::{RingLayout, CLOCK_REALTIME_NS, LAYOUT_VERSION, RING_MAGIC};
pub use shared::{
    alive_in_stat, pid_alive, remove_stale_rings, Control, FileIdentity, OpenLimits,
    CONTROL_ALL_API_RECORDS, CONTROL_CAPTURE, CONTROL_CUPTI_API_RECORDS, CONTROL_RECORD_ALWAYS,
};
pub use sources::SourceCounts;

use crate::event::{Event, EVENT_WORDS};

/// What a full lane gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropPolicy {
    /// Keep what is already queued; refuse the new event.
    DropNewest,
    /// Keep the new event; overwrite the oldest unread one.
    DropOldest,
}

impl DropPolicy {
    fn code(self) -> u32 {
        match self {
            DropPolicy::DropNewest => 0,
            DropPolicy::DropOldest => 1,
        }
    }

    fn from_code(code: u32) -> Option<DropPolicy> {
        match code {
            0 => Some(DropPolicy::DropNewest),
            1 => Some(DropPolicy::DropOldest),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            DropPolicy::DropNewest => "drop-newest",
            DropPolicy::DropOldest => "drop-oldest",
        }
    }
}

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("a ring needs at least one lane")]
    NoLanes,
    #[error("lane capacity {0} is out of range (2 to 2^24 slots)")]
    Capacity(u64),
    #[error("all {0} lanes of the ring already have a producer")]
    AllLanesBusy(u32),
    #[error("the ring already has its consumer")]
    ConsumerTaken,
    #[error("{lanes} lanes of {capacity} slots do not fit in memory")]
    TooLarge { lanes: u32, capacity: u64 },
    /// A system call on a shared ring failed (`kind` is the I/O error kind,
    /// `AlreadyExists` when creating over an existing ring file).
    #[error("{op} {path}: {message}")]
    Io {
        op: &'static str,
        path: String,
        kind: std::io::ErrorKind,
        message: String,
    },
    #[error("{path} is {size} bytes, too short for a ring (needs {needed})")]
    Truncated {
        path: String,
        size: u64,
        needed: u64,
    },
    #[error("{path} is not a devtrace ring (magic {found:#018x})")]
    BadMagic { path: String, found: u64 },
    #[error("{path} has ring layout version {found}; this build reads version {expected}")]
    Version {
        path: String,
        found: u32,
        expected: u32,
    },
    #[error("{path} has an invalid ring header: {reason}")]
    BadHeader { path: String, reason: String },
    /// The file is not one a ring may live in (a FIFO, a second link).
    #[error("{path} is refused as a ring: {reason}")]
    Refused { path: String, reason: String },
}

/// Why a consumer gave up on a shared ring: its peer broke the protocol, by
/// accident or on purpose. A ring in this state is never read again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    #[error("its file shrank under the mapping")]
    Shrunk,
    #[error("lane {lane}'s head {head} is behind its tail {tail}")]
    HeadBehindTail { lane: u32, head: u64, tail: u64 },
    #[error("lane {lane}'s head is {ahead} events ahead of its tail, more than it can hold")]
    HeadTooFarAhead { lane: u32, ahead: u64 },
    #[error("lane {lane}'s count of refused events fell from {before} to {now}")]
    DropCountFell { lane: u32, before: u64, now: u64 },
}

/// More than this many events ahead of the tail in one drain is no producer
/// running ahead of a slow consumer but a forged head (drop-oldest lanes may
/// legitimately be ahead by more than their capacity).
const MAX_PLAUSIBLE_AHEAD: u64 = 1 << 32;

/// Page-aligned memory that holds a ring: zeroed anonymous memory (pages
/// become resident only when first written, so an idle lane costs next to
/// nothing) or a shared mapping of a file or memfd (`shared.rs`).
struct Region {
    base: NonNull<u8>,
    size: usize,
    /// Set for mappings of another process's file, which it may shrink.
    guard: Option<guard::Guard>,
    /// The file, locked shared, for a ring this process made or produces
    /// into: it is in use while the lock is held (`shared::remove_stale_rings`).
    held: Option<std::fs::File>,
}

// SAFETY: after initialisation the region is only accessed through atomics.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    fn zeroed(size: usize) -> Option<Region> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let base = NonNull::new(ptr.cast::<u8>())?;
        debug_assert_eq!(base.as_ptr() as usize % REGION_ALIGN, 0);
        Some(Region {
            base,
            size,
            guard: None,
            held: None,
        })
    }
}

/// Current `CLOCK_REALTIME` in nanoseconds.
fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Owner word of a lane: the pid in the high half, a nonzero token below.
fn owner_word(token: u32) -> u64 {
    (u64::from(std::process::id()) << 32) | u64::from(token.max(1))
}

impl Drop for Region {
    fn drop(&mut self) {
        // The guard goes first: its handler must not match an address that
        // is about to be unmapped (and perhaps reused).
        self.guard.take();
        // SAFETY: mapped in `zeroed` or `shared.rs` with this base and size.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.size);
        }
    }
}

/// Totals over all lanes since the ring was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    pub pushed: u64,
    pub dropped_newest: u64,
    pub dropped_oldest: u64,
}

/// The ring itself; share it with `Arc` and hand out producers and a consumer.
pub struct Ring {
    region: Region,
    layout: RingLayout,
    policy: DropPolicy,
    next_token: AtomicU32,
    /// Which named source holds which lane (in this process only).
    sources: sources::Sources,
    /// Wakes this process's sleeping consumer on a push.
    doorbell: Doorbell,
    /// Every producer is in this process, so every push rings `doorbell`.
    local_producers_only: bool,
}

/// The slots a lane may have (before rounding up to a power of two).
pub const LANE_CAPACITIES: std::ops::RangeInclusive<u64> = 2..=1 << 24;

impl Ring {
    /// Creates an in-process ring of `lanes` lanes with `capacity` slots each
    /// (rounded up to a power of two).
    pub fn new(lanes: u32, capacity: u64, policy: DropPolicy) -> Result<Arc<Ring>, RingError> {
        let layout = Ring::shape(lanes, capacity)?;
        let size = layout.total_size().expect("checked by shape");
        let region = Region::zeroed(size).ok_or(RingError::TooLarge { lanes, capacity })?;
        // SAFETY: a fresh region of `layout`'s size, not yet shared.
        unsafe { Ring::write_header(&region, layout, policy) };
        Ok(Ring::from_region(region, layout, policy, true))
    }

    /// Checks a requested shape and rounds the capacity up.
    fn shape(lanes: u32, capacity: u64) -> Result<RingLayout, RingError> {
        if lanes == 0 {
            return Err(RingError::NoLanes);
        }
        if !LANE_CAPACITIES.contains(&capacity) {
            return Err(RingError::Capacity(capacity));
        }
        let layout = RingLayout {
            lanes,
            capacity: capacity.next_power_of_two(),
        };
        layout
            .total_size()
            .ok_or(RingError::TooLarge { lanes, capacity })?;
        Ok(layout)
    }

    /// Writes the header of a new region.
    ///
    /// # Safety
    /// `region` must be at least `layout.total_size()` bytes and not yet
    /// visible to any other thread or process.
    unsafe fn write_header(region: &Region, layout: RingLayout, policy: DropPolicy) {
        let total_size = layout.total_size().expect("checked by shape") as u64;
        // SAFETY: per the contract, aligned and exclusively ours.
        unsafe {
            region.base.cast::<RingHeader>().as_ptr().write(RingHeader {
                magic: RING_MAGIC,
                version: LAYOUT_VERSION,
                lane_count: layout.lanes,
                lane_capacity: layout.capacity,
                slot_size: std::mem::size_of::<Slot>() as u32,
                policy: policy.code(),
                total_size,
                clock_id: CLOCK_REALTIME_NS,
                creator_pid: std::process::id(),
                created_ns: realtime_ns(),
                consumer_pid: AtomicU32::new(0),
                consumer_beat: AtomicU32::new(0),
                control: layout::Padded(std::sync::atomic::AtomicU64::new(0)),
            });
        }
    }

    fn from_region(
        region: Region,
        layout: RingLayout,
        policy: DropPolicy,
        local_producers_only: bool,
    ) -> Arc<Ring> {
        Arc::new(Ring {
            region,
            layout,
            policy,
            next_token: AtomicU32::new(1),
            sources: sources::Sources::default(),
            doorbell: Doorbell::default(),
            local_producers_only,
        })
    }

    /// What this process's producers ring after each push.
    pub fn doorbell(&self) -> &Doorbell {
        &self.doorbell
    }

    /// True when every push rings [`Ring::doorbell`]: an in-process ring.
    /// Producers of a shared ring may live in other processes and do not.
    pub fn wakes_its_consumer(&self) -> bool {
        self.local_producers_only
    }

    pub fn policy(&self) -> DropPolicy {
        self.policy
    }

    /// Whether the file under a shared ring shrank and its mapping now
    /// holds zeroes (`guard.rs`).
    fn shrunk(&self) -> bool {
        self.region
            .guard
            .as_ref()
            .is_some_and(|guard| guard.broken())
    }

    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: written once before the ring was shared (or validated when
        // opened); the fields that change later are atomics.
        unsafe { &*self.region.base.cast::<RingHeader>().as_ptr() }
    }

    fn lane(&self, lane: u32) -> &LaneHeader {
        debug_assert!(lane < self.layout.lanes);
        // SAFETY: the offset lies inside the region and is 64-byte aligned; a
        // lane header consists of atomics, valid when zeroed.
        unsafe {
            &*self
                .region
                .base
                .as_ptr()
                .add(self.layout.lane_offset(lane))
                .cast::<LaneHeader>()
        }
    }

    fn slot(&self, lane: u32, position: u64) -> &Slot {
        // SAFETY: as for `lane`; slots are atomics and 8-byte aligned.
        unsafe {
            &*self
                .region
                .base
                .as_ptr()
                .add(self.layout.slot_offset(lane, position))
                .cast::<Slot>()
        }
    }

    /// The slot for `position` as plain words, for the producer's writes
    /// under drop-newest, which the lane protocol orders (the consumer reads
    /// slots with atomic loads whatever the producer does).
    fn slot_words(&self, lane: u32, position: u64) -> *mut [u64; EVENT_WORDS] {
        // SAFETY: the offset lies inside the region (see `slot`).
        unsafe {
            self.region
                .base
                .as_ptr()
                .add(self.layout.slot_offset(lane, position))
                .cast::<[u64; EVENT_WORDS]>()
        }
    }

    fn seq(&self, lane: u32, position: u64) -> &SlotSeq {
        // SAFETY: as for `lane`; sequence words are atomics, 8-byte aligned.
        unsafe {
            &*self
                .region
                .base
                .as_ptr()
                .add(self.layout.seq_offset(lane, position))
                .cast::<SlotSeq>()
        }
    }

    /// Claims a free lane for a new producer.
    pub fn producer(self: &Arc<Self>) -> Result<Producer, RingError> {
        debug_assert_eq!(self.header().magic, RING_MAGIC);
        let token = owner_word(self.next_token.fetch_add(1, Ordering::Relaxed));
        for lane in 0..self.layout.lanes {
            let header = self.lane(lane);
            if header
                .owner
                .0
                .compare_exchange(0, token, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                let head = header.head.0.load(Ordering::Acquire);
                return Ok(Producer {
                    ring: Arc::clone(self),
                    lane,
                    head,
                    cached_tail: header.tail.0.load(Ordering::Acquire),
                    capacity: self.layout.capacity,
                    overwrite: self.policy == DropPolicy::DropOldest,
                    named: false,
                });
            }
        }
        Err(RingError::AllLanesBusy(self.layout.lanes))
    }

    /// Claims a free lane for a producer whose events count as `source`'s
    /// in [`Ring::source_counts`].
    pub fn producer_for(self: &Arc<Self>, source: &'static str) -> Result<Producer, RingError> {
        let mut producer = self.producer()?;
        self.sources
            .claimed(producer.lane, source, self.lane_counts(producer.lane));
        producer.named = true;
        Ok(producer)
    }

    /// Events each source named in [`Ring::producer_for`] has pushed and
    /// lost in this ring since it was created.
    pub fn source_counts(&self) -> Vec<(&'static str, SourceCounts)> {
        self.sources.totals(|lane| self.lane_counts(lane))
    }

    /// One lane's running totals.
    fn lane_counts(&self, lane: u32) -> SourceCounts {
        let header = self.lane(lane);
        SourceCounts {
            pushed: header.head.0.load(Ordering::Acquire),
            dropped_newest: header.dropped_newest.0.load(Ordering::Relaxed),
            dropped_oldest: header.dropped_oldest.0.load(Ordering::Relaxed),
        }
    }

    /// Takes the ring's single consumer. Once taken it stays taken while the
    /// taking process lives (across processes too, for a shared ring); the
    /// consumer of a process that has died is taken over, resuming at the
    /// tails it had stored.
    pub fn consumer(self: &Arc<Self>) -> Result<Consumer, RingError> {
        let me = std::process::id();
        let word = &self.header().consumer_pid;
        let mut current = 0;
        loop {
            match word.compare_exchange(current, me, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(holder) if holder != me && !pid_alive(holder) => current = holder,
                Err(_) => return Err(RingError::ConsumerTaken),
            }
        }
        let lanes = self.layout.lanes;
        Ok(Consumer {
            ring: Arc::clone(self),
            tails: (0..lanes)
                .map(|lane| self.lane(lane).tail.0.load(Ordering::Relaxed))
                .collect(),
            newest_seen: (0..lanes)
                .map(|lane| self.lane(lane).dropped_newest.0.load(Ordering::Relaxed))
                .collect(),
            corrupt: None,
        })
    }

    pub fn stats(&self) -> RingStats {
        let mut stats = RingStats::default();
        for lane in 0..self.layout.lanes {
            let header = self.lane(lane);
            // Wrapping: a peer's ring may hold any numbers.
            stats.pushed = stats
                .pushed
                .wrapping_add(header.head.0.load(Ordering::Relaxed));
            stats.dropped_newest = stats
                .dropped_newest
                .wrapping_add(header.dropped_newest.0.load(Ordering::Relaxed));
            stats.dropped_oldest = stats
                .dropped_oldest
                .wrapping_add(header.dropped_oldest.0.load(Ordering::Relaxed));
        }
        stats
    }
}

/// Writes into one lane. Not `Clone`: one producer per lane is what makes the
/// lane lock-free without atomic read-modify-write.
pub struct Producer {
    ring: Arc<Ring>,
    lane: u32,
    head: u64,
    cached_tail: u64,
    capacity: u64,
    overwrite: bool,
    /// Claimed with [`Ring::producer_for`]: its lane is in the source book.
    named: bool,
}

impl Producer {
    /// Queues `event`. Returns false when the lane was full under drop-newest
    /// (the event is then counted as dropped). Never blocks.
    #[inline]
    pub fn push(&mut self, event: &Event) -> bool {
        let accepted = self.write(event);
        self.publish();
        accepted
    }

    /// Queues a batch and makes it visible with a single store: the cheap way
    /// for producers that already hold several events. Returns how many were
    /// accepted; under drop-newest the rest are counted as dropped.
    pub fn push_batch(&mut self, events: &[Event]) -> usize {
        let accepted = events.iter().filter(|e| self.write(e)).count();
        self.publish();
        accepted
    }

    /// Free slots in the lane right now (drop-newest; drop-oldest never runs
    /// out). Lets a producer size a batch so that nothing is dropped.
    pub fn free_slots(&mut self) -> u64 {
        if self.overwrite {
            return self.capacity;
        }
        self.cached_tail = self.ring.lane(self.lane).tail.0.load(Ordering::Acquire);
        self.capacity - (self.head - self.cached_tail)
    }

    /// Writes one slot without publishing it.
    #[inline]
    fn write(&mut self, event: &Event) -> bool {
        let lane = self.ring.lane(self.lane);
        let position = self.head;
        let words = event.to_words();
        if self.overwrite {
            let slot = self.ring.slot(self.lane, position);
            let seq = self.ring.seq(self.lane, position);
            seq.store(position.wrapping_mul(2) + 1, Ordering::Relaxed);
            fence(Ordering::Release);
            for (cell, word) in slot.words.iter().zip(words) {
                cell.store(word, Ordering::Relaxed);
            }
            seq.store(position.wrapping_mul(2).wrapping_add(2), Ordering::Release);
        } else {
            if position - self.cached_tail >= self.capacity {
                self.cached_tail = lane.tail.0.load(Ordering::Acquire);
                if position - self.cached_tail >= self.capacity {
                    let dropped = lane.dropped_newest.0.load(Ordering::Relaxed);
                    lane.dropped_newest.0.store(dropped + 1, Ordering::Relaxed);
                    return false;
                }
            }
            // SAFETY: under drop-newest the consumer has released this slot
            // (tail acquired above) and reads it only after the head store
            // that publishes it, so nothing else accesses it now; a plain
            // copy lets the compiler use wide stores.
            unsafe { self.ring.slot_words(self.lane, position).write(words) };
        }
        self.head = position + 1;
        true
    }

    /// Makes every written slot visible to the consumer.
    #[inline]
    fn publish(&mut self) {
        self.ring
            .lane(self.lane)
            .head
            .0
            .store(self.head, Ordering::Release);
        self.ring.doorbell.ring();
    }

    pub fn lane(&self) -> u32 {
        self.lane
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if self.named {
            // Before the lane is free: the next owner's counts start here.
            self.ring
                .sources
                .released(self.lane, self.ring.lane_counts(self.lane));
        }
        self.ring
            .lane(self.lane)
            .owner
            .0
            .store(0, Ordering::Release);
    }
}

/// What one [`Consumer::drain`] call found besides events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    pub events: u64,
    pub dropped_newest: u64,
    pub dropped_oldest: u64,
    /// Set when the ring's peer broke the protocol: the ring is done with
    /// (what the failing drain read is discarded, later drains read nothing).
    pub corrupt: Option<Corruption>,
}

/// Reads every lane; the only reader of the ring.
pub struct Consumer {
    ring: Arc<Ring>,
    tails: Vec<u64>,
    newest_seen: Vec<u64>,
    corrupt: Option<Corruption>,
}

impl Consumer {
    /// The ring this consumer reads.
    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Moves up to `max` queued events into `out` and reports drops that
    /// happened since the previous call. Counters a peer forged, or a file
    /// it shrank, end the ring: see [`DrainReport::corrupt`].
    pub fn drain(&mut self, out: &mut Vec<Event>, max: usize) -> DrainReport {
        let mut report = DrainReport {
            corrupt: self.corrupt,
            ..DrainReport::default()
        };
        if self.corrupt.is_some() {
            return report;
        }
        let read_from = out.len();
        let outcome = self.drain_lanes(out, max as u64, &mut report);
        let corrupt = if self.ring.shrunk() {
            Some(Corruption::Shrunk)
        } else {
            outcome.err()
        };
        if let Some(corruption) = corrupt {
            // What this pass read may be zero pages or forgeries.
            out.truncate(read_from);
            report.events = 0;
            report.corrupt = Some(corruption);
            self.corrupt = Some(corruption);
        }
        report
    }

    fn drain_lanes(
        &mut self,
        out: &mut Vec<Event>,
        mut budget: u64,
        report: &mut DrainReport,
    ) -> Result<(), Corruption> {
        for lane in 0..self.ring.layout.lanes {
            let header = self.ring.lane(lane);
            let newest = header.dropped_newest.0.load(Ordering::Relaxed);
            let before = self.newest_seen[lane as usize];
            if newest < before {
                return Err(Corruption::DropCountFell {
                    lane,
                    before,
                    now: newest,
                });
            }
            report.dropped_newest += newest - before;
            self.newest_seen[lane as usize] = newest;
            if budget == 0 {
                continue;
            }
            let (read, overwritten) = self.drain_lane(lane, out, budget)?;
            budget -= read;
            report.events += read;
            report.dropped_oldest += overwritten;
        }
        Ok(())
    }

    fn drain_lane(
        &mut self,
        lane: u32,
        out: &mut Vec<Event>,
        budget: u64,
    ) -> Result<(u64, u64), Corruption> {
        let ring = &*self.ring;
        let header = ring.lane(lane);
        let head = header.head.0.load(Ordering::Acquire);
        let mut tail = self.tails[lane as usize];
        let overwrite = ring.policy == DropPolicy::DropOldest;
        if head < tail {
            return Err(Corruption::HeadBehindTail { lane, head, tail });
        }
        let ahead = head - tail;
        let limit = if overwrite {
            MAX_PLAUSIBLE_AHEAD
        } else {
            ring.layout.capacity
        };
        if ahead > limit {
            return Err(Corruption::HeadTooFarAhead { lane, ahead });
        }
        let mut overwritten = 0;
        if overwrite && ahead > ring.layout.capacity {
            overwritten += ahead - ring.layout.capacity;
            tail = head - ring.layout.capacity;
        }
        let end = head.min(tail.saturating_add(budget));
        let mut read = 0;
        let mut words = [0u64; EVENT_WORDS];
        for position in tail..end {
            let slot = ring.slot(lane, position);
            let seq = ring.seq(lane, position);
            // Wrapping: a forged head may put positions anywhere.
            let expected = position.wrapping_mul(2).wrapping_add(2);
            if overwrite && seq.load(Ordering::Acquire) != expected {
                overwritten += 1;
                continue;
            }
            // Atomic loads under both policies: a producer in another process
            // is not trusted to leave a published slot alone (one that
            // rewrites it gives garbage words, which `from_words` and the
            // translation validate, never a data race).
            for (word, cell) in words.iter_mut().zip(&slot.words) {
                *word = cell.load(Ordering::Relaxed);
            }
            if overwrite {
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) != expected {
                    overwritten += 1;
                    continue;
                }
            }
            out.push(Event::from_words(&words));
            read += 1;
        }
        self.tails[lane as usize] = end;
        header.tail.0.store(end, Ordering::Release);
        if overwritten > 0 {
            let total = header.dropped_oldest.0.load(Ordering::Relaxed);
            header
                .dropped_oldest
                .0
                .store(total.wrapping_add(overwritten), Ordering::Relaxed);
        }
        Ok((read, overwritten))
    }
}

impl Drop for Consumer {
    /// Lets go of the ring, so that a later consumer (this agent attaching
    /// again, or another) can take it.
    fn drop(&mut self) {
        let _ = self.ring.header().consumer_pid.compare_exchange(
            std::process::id(),
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Device, NameId, Payload};
    use std::collections::HashSet;

    fn event(producer: u64, sequence: u64) -> Event {
        Event::new(
            sequence,
            1,
            Device::Host,
            producer,
            NameId(1),
            Payload::Step {
                step_num: sequence as i64,
            },
        )
    }

    #[test]
    fn drop_newest_counts_every_refused_event_exactly() {
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        let accepted = (0..20).filter(|i| producer.push(&event(0, *i))).count();
        assert_eq!(accepted, 8);
        let mut out = Vec::new();
        let report = consumer.drain(&mut out, usize::MAX);
        assert_eq!(report.events, 8);
        assert_eq!(report.dropped_newest, 12);
        // The oldest eight were kept.
        let kept: Vec<u64> = out.iter().map(|e| e.start_ns).collect();
        assert_eq!(kept, (0..8).collect::<Vec<_>>());
        // Space is free again after draining.
        assert!(producer.push(&event(0, 100)));
        assert_eq!(consumer.drain(&mut out, usize::MAX).dropped_newest, 0);
        assert_eq!(ring.stats().dropped_newest, 12);
    }

    #[test]
    fn drop_oldest_keeps_the_newest_and_counts_the_overwritten() {
        let ring = Ring::new(1, 8, DropPolicy::DropOldest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        for i in 0..20 {
            assert!(producer.push(&event(0, i)));
        }
        let mut out = Vec::new();
        let report = consumer.drain(&mut out, usize::MAX);
        assert_eq!(report.events, 8);
        assert_eq!(report.dropped_oldest, 12);
        let kept: Vec<u64> = out.iter().map(|e| e.start_ns).collect();
        assert_eq!(kept, (12..20).collect::<Vec<_>>());
        assert_eq!(ring.stats().dropped_oldest, 12);
    }

    #[test]
    fn events_count_for_the_source_that_held_the_lane() {
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        let counts = |name: &str| {
            ring.source_counts()
                .into_iter()
                .find(|(source, _)| *source == name)
                .map(|(_, counts)| counts)
                .unwrap_or_default()
        };
        // An unnamed producer before: its events belong to no source.
        let mut unnamed = ring.producer().unwrap();
        unnamed.push_batch(&[event(0, 0), event(0, 1)]);
        drop(unnamed);
        let mut consumer = ring.consumer().unwrap();
        consumer.drain(&mut Vec::new(), usize::MAX);

        let mut first = ring.producer_for("first").unwrap();
        let accepted = (0..10).filter(|i| first.push(&event(0, *i))).count();
        assert_eq!(accepted, 8);
        // Counted while the lane is held, and kept once it is let go.
        let held = counts("first");
        assert_eq!((held.pushed, held.dropped_newest), (8, 2));
        drop(first);
        assert_eq!(counts("first"), held);

        // The same lane under a second source counts from its claim.
        consumer.drain(&mut Vec::new(), usize::MAX);
        let mut second = ring.producer_for("second").unwrap();
        assert_eq!(
            second.push_batch(&[event(0, 20), event(0, 21), event(0, 22)]),
            3
        );
        assert_eq!(counts("second").pushed, 3);
        assert_eq!(counts("first"), held);
        drop(second);
        let mut again = ring.producer_for("first").unwrap();
        again.push(&event(0, 30));
        assert_eq!(counts("first").pushed, 9);
        assert_eq!(ring.stats().pushed, 2 + 8 + 3 + 1);
    }

    #[test]
    fn batches_publish_together_and_count_what_did_not_fit() {
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        assert_eq!(producer.free_slots(), 8);
        let batch: Vec<Event> = (0..5).map(|i| event(0, i)).collect();
        assert_eq!(producer.push_batch(&batch), 5);
        assert_eq!(producer.free_slots(), 3);
        assert_eq!(producer.push_batch(&batch), 3);
        let mut out = Vec::new();
        let report = consumer.drain(&mut out, usize::MAX);
        assert_eq!((report.events, report.dropped_newest), (8, 2));
        let starts: Vec<u64> = out.iter().map(|e| e.start_ns).collect();
        assert_eq!(starts, vec![0, 1, 2, 3, 4, 0, 1, 2]);
        assert_eq!(producer.free_slots(), 8);
    }

    #[test]
    fn drain_respects_its_budget_and_resumes() {
        let ring = Ring::new(2, 16, DropPolicy::DropNewest).unwrap();
        let mut a = ring.producer().unwrap();
        let mut b = ring.producer().unwrap();
        assert_ne!(a.lane(), b.lane());
        for i in 0..5 {
            a.push(&event(0, i));
            b.push(&event(1, i));
        }
        let mut consumer = ring.consumer().unwrap();
        let mut out = Vec::new();
        assert_eq!(consumer.drain(&mut out, 3).events, 3);
        assert_eq!(consumer.drain(&mut out, 100).events, 7);
        assert_eq!(out.len(), 10);
    }

    #[test]
    fn lanes_are_exclusive_and_released_on_drop() {
        let ring = Ring::new(1, 4, DropPolicy::DropNewest).unwrap();
        let first = ring.producer().unwrap();
        assert_eq!(ring.producer().err(), Some(RingError::AllLanesBusy(1)));
        drop(first);
        let mut second = ring.producer().unwrap();
        assert!(second.push(&event(0, 1)));
        let consumer = ring.consumer().unwrap();
        assert_eq!(ring.consumer().err(), Some(RingError::ConsumerTaken));
        // A consumer let go of frees the ring for the next.
        drop(consumer);
        assert!(ring.consumer().is_ok());
    }

    /// Writes `value` into a lane counter as a hostile peer would.
    fn forge(counter: &std::sync::atomic::AtomicU64, value: u64) {
        counter.store(value, Ordering::Release);
    }

    #[test]
    fn forged_counters_end_the_ring_instead_of_being_followed() {
        // A head far ahead of the tail (once a loop of 2^48 reads).
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        producer.push(&event(0, 0));
        forge(&ring.lane(0).head.0, 1 << 48);
        let mut out = Vec::new();
        let report = consumer.drain(&mut out, usize::MAX);
        assert_eq!(
            report.corrupt,
            Some(Corruption::HeadTooFarAhead {
                lane: 0,
                ahead: 1 << 48
            })
        );
        assert!(out.is_empty());
        // Once corrupt, never read again, even if the counters look sane.
        forge(&ring.lane(0).head.0, 1);
        assert_eq!(consumer.drain(&mut out, 10).events, 0);
        assert!(consumer.drain(&mut out, 10).corrupt.is_some());

        // A head behind the tail.
        let ring = Ring::new(1, 8, DropPolicy::DropOldest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        for i in 0..4 {
            producer.push(&event(0, i));
        }
        assert_eq!(consumer.drain(&mut out, 10).events, 4);
        forge(&ring.lane(0).head.0, 2);
        assert_eq!(
            consumer.drain(&mut out, 10).corrupt,
            Some(Corruption::HeadBehindTail {
                lane: 0,
                head: 2,
                tail: 4
            })
        );

        // A count of refused events that falls.
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        let _producer = ring.producer().unwrap();
        forge(&ring.lane(0).dropped_newest.0, 10);
        let mut consumer = ring.consumer().unwrap();
        forge(&ring.lane(0).dropped_newest.0, 3);
        assert!(matches!(
            consumer.drain(&mut out, 10).corrupt,
            Some(Corruption::DropCountFell { .. })
        ));
    }

    #[test]
    fn a_drop_oldest_lane_may_run_ahead_by_more_than_its_capacity() {
        let ring = Ring::new(1, 4, DropPolicy::DropOldest).unwrap();
        let mut producer = ring.producer().unwrap();
        let mut consumer = ring.consumer().unwrap();
        for i in 0..100 {
            producer.push(&event(0, i));
        }
        let mut out = Vec::new();
        let report = consumer.drain(&mut out, 100);
        assert_eq!((report.events, report.dropped_oldest), (4, 96));
        assert_eq!(report.corrupt, None);
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert_eq!(
            Ring::new(0, 8, DropPolicy::DropNewest).err(),
            Some(RingError::NoLanes)
        );
        assert_eq!(
            Ring::new(1, 1, DropPolicy::DropNewest).err(),
            Some(RingError::Capacity(1))
        );
        assert_eq!(
            Ring::new(1, 5, DropPolicy::DropNewest)
                .unwrap()
                .layout()
                .capacity,
            8
        );
    }

    /// Producers on their own threads race a consumer: nothing is lost without
    /// being counted, nothing arrives twice, per-producer order is kept.
    fn concurrent_run(policy: DropPolicy) {
        const PRODUCERS: u64 = 4;
        const PER_PRODUCER: u64 = 200_000;
        let ring = Ring::new(PRODUCERS as u32, 1024, policy).unwrap();
        let mut consumer = ring.consumer().unwrap();
        let threads: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let mut producer = ring.producer().unwrap();
                std::thread::spawn(move || {
                    let mut refused = 0u64;
                    for i in 0..PER_PRODUCER {
                        if !producer.push(&event(p, i)) {
                            refused += 1;
                        }
                    }
                    refused
                })
            })
            .collect();
        let mut out = Vec::new();
        let mut dropped = 0;
        let mut seen = HashSet::new();
        let mut last = vec![None::<u64>; PRODUCERS as usize];
        let mut check = |out: &mut Vec<Event>| {
            for e in out.drain(..) {
                assert!(seen.insert((e.line, e.start_ns)), "duplicate {e:?}");
                let previous = &mut last[e.line as usize];
                assert!(previous.is_none_or(|p| p < e.start_ns), "out of order");
                *previous = Some(e.start_ns);
            }
        };
        while threads.iter().any(|t| !t.is_finished()) {
            let report = consumer.drain(&mut out, 4096);
            dropped += report.dropped_newest + report.dropped_oldest;
            check(&mut out);
        }
        let refused: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let report = consumer.drain(&mut out, usize::MAX);
        dropped += report.dropped_newest + report.dropped_oldest;
        check(&mut out);
        assert_eq!(seen.len() as u64 + dropped, PRODUCERS * PER_PRODUCER);
        if policy == DropPolicy::DropNewest {
            assert_eq!(refused, dropped);
        } else {
            assert_eq!(refused, 0);
        }
        let stats = ring.stats();
        assert_eq!(stats.pushed, PRODUCERS * PER_PRODUCER - refused);
        assert_eq!(stats.dropped_newest + stats.dropped_oldest, dropped);
    }

    #[test]
    fn concurrent_producers_lose_nothing_uncounted_drop_newest() {
        concurrent_run(DropPolicy::DropNewest);
    }

    #[test]
    fn concurrent_producers_lose_nothing_uncounted_drop_oldest() {
        concurrent_run(DropPolicy::DropOldest);
    }
}
