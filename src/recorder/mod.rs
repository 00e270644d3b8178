//! The flight recorder: a bounded, time-indexed store of recent events.
//!
//! The collector appends sealed, immutable chunks; captures ask for a time
//! window and get shared references to the chunks that overlap it, so any
//! number of captures (overlapping or not) read the same data without copying
//! it under a lock. The store keeps at most `retention` of history and at most
//! `max_bytes` of events, evicting whole chunks from the old end, and it keeps
//! the log of drops so that a capture can report every loss in its window.
//!
//! Sealed chunks are kept in a compact form ([`compact`]): a few bytes per
//! event instead of 128, decoded only for the windows captures ask for.
//!
//! Time is the agent's: retention is measured back from its own clock, not
//! from the newest event, since event times come from peers. An event dated
//! more than [`MAX_AHEAD`] after the agent's clock, or already older than the
//! retention, is dropped and counted ([`Store::misdated`]): one event from ten
//! years ahead must not push everything else out.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::clock;
use crate::event::Event;

pub mod collect;
pub mod compact;

use compact::CompactEvents;

/// Events per sealed chunk, in a store large enough for them.
const MOST_CHUNK_EVENTS: usize = 1 << 16;

/// A store holds at least this many chunks at `max_bytes`
/// ([`Store::events_per_chunk`]).
const CHUNKS_IN_STORE: usize = 8;

/// Limits of the flight recorder.
#[derive(Clone, Copy, Debug)]
pub struct StoreConfig {
    /// Keep events whose start lies within this much of the newest event.
    pub retention: Duration,
    /// Upper bound on the bytes held in events.
    pub max_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            retention: Duration::from_secs(120),
            max_bytes: 512 << 20,
        }
    }
}

/// An immutable batch of events with the range of their start times.
#[derive(Debug)]
pub struct Chunk {
    events: CompactEvents,
    first_start_ns: u64,
    last_start_ns: u64,
}

impl Chunk {
    /// The chunk of the `events` that `keep` accepts, if any.
    fn new(events: &[Event], keep: impl Fn(&Event) -> bool) -> Option<Chunk> {
        let compact = CompactEvents::encode(events, keep);
        let (first_start_ns, last_start_ns) = compact.starts()?;
        Some(Chunk {
            first_start_ns,
            last_start_ns,
            events: compact,
        })
    }

    /// Bytes the chunk holds, its bookkeeping included.
    fn bytes(&self) -> usize {
        self.events.bytes() + std::mem::size_of::<Chunk>()
    }
}

/// Events lost at one moment, as the collector noticed them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropRecord {
    pub at_ns: u64,
    /// Refused by a full ring (drop-newest).
    pub newest: u64,
    /// Overwritten before being read (drop-oldest).
    pub oldest: u64,
}

/// A half-open window `[start_ns, stop_ns)` in Unix nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub start_ns: u64,
    pub stop_ns: u64,
}

impl Window {
    pub fn contains(&self, ns: u64) -> bool {
        (self.start_ns..self.stop_ns).contains(&ns)
    }

    pub fn duration_ns(&self) -> u64 {
        self.stop_ns.saturating_sub(self.start_ns)
    }
}

/// What a window query returns: shared chunks plus the losses and gaps that
/// affect the window.
pub struct WindowData {
    pub window: Window,
    chunks: Vec<Arc<Chunk>>,
    pub dropped_newest: u64,
    pub dropped_oldest: u64,
    /// Set when part of the window was already evicted (or never recorded).
    pub history_starts_ns: Option<u64>,
    /// Part of the window was evicted to keep the store within its size
    /// (`--store-size`), not for its age.
    pub evicted_for_size: bool,
}

impl WindowData {
    /// Events whose start lies inside the window, decoded as they are
    /// read, in start order within each chunk.
    pub fn events(&self) -> impl Iterator<Item = Event> + '_ {
        let window = self.window;
        self.chunks.iter().flat_map(move |chunk| {
            chunk
                .events
                .iter()
                .skip_while(move |e| e.start_ns < window.start_ns)
                .take_while(move |e| e.start_ns < window.stop_ns)
        })
    }

    /// The window's events as runs sorted by start (enclosing spans
    /// first), one per chunk, each with the earliest start it may hold:
    /// what [`crate::xspace::encode_runs`] merges. A run decodes its chunk
    /// only once it is first read, so that runs not yet reached cost
    /// nothing.
    pub fn runs(&self) -> Vec<(u64, impl Iterator<Item = Event> + '_)> {
        let window = self.window;
        self.chunks
            .iter()
            .map(move |chunk| {
                let mut events = None;
                let run = std::iter::from_fn(move || {
                    events
                        .get_or_insert_with(|| {
                            chunk
                                .events
                                .iter()
                                .skip_while(move |e| e.start_ns < window.start_ns)
                                .take_while(move |e| e.start_ns < window.stop_ns)
                        })
                        .next()
                });
                (chunk.first_start_ns.max(window.start_ns), run)
            })
            .collect()
    }

    /// Bytes of the chunks the window holds on to: memory the capture keeps
    /// alive even once the flight recorder has evicted them.
    pub fn chunk_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.bytes()).sum()
    }

    /// How many events the window's chunks hold (an upper bound on
    /// [`WindowData::events`]).
    pub fn held(&self) -> usize {
        self.chunks.iter().map(|c| c.events.len()).sum()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped_newest + self.dropped_oldest
    }
}

#[derive(Default)]
struct Inner {
    chunks: VecDeque<Arc<Chunk>>,
    bytes: usize,
    drops: VecDeque<DropRecord>,
    /// Nothing older than this is held any more (0 = nothing evicted yet).
    evicted_before_ns: u64,
    /// Nothing older than this is held because the store was full, while
    /// younger than its retention (0 = never so).
    evicted_for_size_before_ns: u64,
    /// When the store started recording.
    recording_since_ns: u64,
}

/// How far after the agent's clock an event may start.
pub const MAX_AHEAD: Duration = Duration::from_secs(60);

/// Sees the events of each chunk as it is appended, before it is
/// compacted: how a reader that watches events as they arrive (trigger
/// rules) gets each once, late ones too, without decoding the store. It
/// runs on the collector, so it must only pick out what it wants.
pub type ArrivalTap = Box<dyn Fn(&mut dyn Iterator<Item = &Event>) + Send + Sync>;

/// See the module documentation.
pub struct Store {
    config: StoreConfig,
    inner: RwLock<Inner>,
    /// The agent's clock (replaced in tests).
    now_ns: Box<dyn Fn() -> u64 + Send + Sync>,
    misdated: std::sync::atomic::AtomicU64,
    tap: std::sync::OnceLock<ArrivalTap>,
}

/// Totals for health reporting.
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreStats {
    pub chunks: usize,
    pub events: usize,
    pub bytes: usize,
    /// From the earliest to the latest start time held.
    pub span_ns: u64,
}

impl Store {
    pub fn new(config: StoreConfig) -> Store {
        Store::with_clock(config, clock::now_ns)
    }

    fn with_clock(config: StoreConfig, now_ns: impl Fn() -> u64 + Send + Sync + 'static) -> Store {
        Store {
            config,
            inner: RwLock::new(Inner {
                recording_since_ns: now_ns(),
                ..Inner::default()
            }),
            now_ns: Box::new(now_ns),
            misdated: Default::default(),
            tap: std::sync::OnceLock::new(),
        }
    }

    /// Events dropped since the agent started because their times lay
    /// outside what the store can hold (see the module documentation).
    pub fn misdated(&self) -> u64 {
        self.misdated.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn config(&self) -> StoreConfig {
        self.config
    }

    /// Most events to seal into one chunk: [`MOST_CHUNK_EVENTS`], or fewer
    /// where even a chunk of events of the longest encoding could take more
    /// than [`CHUNKS_IN_STORE`]th of `max_bytes`. The newest chunk is kept
    /// whatever its size, so only a bound on chunks keeps the store within
    /// `max_bytes`.
    pub fn events_per_chunk(&self) -> usize {
        let most = self.config.max_bytes / CHUNKS_IN_STORE / compact::MAX_ENCODED_EVENT;
        most.clamp(1, MOST_CHUNK_EVENTS)
    }

    /// Seals a batch of events (any order) into a chunk and evicts what
    /// falls out of bounds, leaving `events` empty for the caller to fill
    /// again.
    pub fn append(&self, events: &mut Vec<Event>) {
        let now = (self.now_ns)();
        let horizon = self.horizon(now);
        let latest = now.saturating_add(clock::duration_ns(MAX_AHEAD));
        let kept = |e: &Event| (horizon..=latest).contains(&e.start_ns);
        if let Some(tap) = self.tap.get() {
            tap(&mut events.iter().filter(|e| kept(e)));
        }
        let chunk = Chunk::new(events, kept);
        let misdated = events.len() - chunk.as_ref().map_or(0, |c| c.events.len());
        events.clear();
        if misdated > 0 {
            self.misdated
                .fetch_add(misdated as u64, std::sync::atomic::Ordering::Relaxed);
        }
        let Some(chunk) = chunk else {
            return;
        };
        let mut inner = self.inner.write();
        inner.bytes += chunk.bytes();
        inner.chunks.push_back(Arc::new(chunk));
        self.evict(&mut inner, horizon);
    }

    /// Shows every chunk appended from now on to `tap` (one tap per store;
    /// false when one is set already).
    pub fn tap_arrivals(&self, tap: ArrivalTap) -> bool {
        self.tap.set(tap).is_ok()
    }

    /// The oldest start time the store keeps at `now`.
    fn horizon(&self, now: u64) -> u64 {
        now.saturating_sub(clock::duration_ns(self.config.retention))
    }

    /// Records events lost at `at_ns`.
    pub fn record_drops(&self, record: DropRecord) {
        if record.newest + record.oldest == 0 {
            return;
        }
        self.inner.write().drops.push_back(record);
    }

    fn evict(&self, inner: &mut Inner, horizon: u64) {
        while let Some(front) = inner.chunks.front() {
            let too_old = front.last_start_ns < horizon;
            let too_big = inner.bytes > self.config.max_bytes && inner.chunks.len() > 1;
            if !(too_old || too_big) {
                break;
            }
            let evicted = front.last_start_ns + 1;
            inner.bytes -= front.bytes();
            inner.chunks.pop_front();
            inner.evicted_before_ns = inner.evicted_before_ns.max(evicted);
            if !too_old {
                inner.evicted_for_size_before_ns = inner.evicted_for_size_before_ns.max(evicted);
            }
        }
        while inner
            .drops
            .front()
            .is_some_and(|d| d.at_ns < horizon.min(inner.evicted_before_ns))
        {
            inner.drops.pop_front();
        }
    }

    /// Everything recorded for `window`.
    pub fn query(&self, window: Window) -> WindowData {
        let inner = self.inner.read();
        let chunks = inner
            .chunks
            .iter()
            .filter(|c| c.first_start_ns < window.stop_ns && c.last_start_ns >= window.start_ns)
            .cloned()
            .collect();
        let (mut dropped_newest, mut dropped_oldest) = (0, 0);
        for record in inner.drops.iter().filter(|d| window.contains(d.at_ns)) {
            dropped_newest += record.newest;
            dropped_oldest += record.oldest;
        }
        let history_start = inner.evicted_before_ns.max(inner.recording_since_ns);
        WindowData {
            window,
            chunks,
            dropped_newest,
            dropped_oldest,
            history_starts_ns: (window.start_ns < history_start).then_some(history_start),
            evicted_for_size: window.start_ns < inner.evicted_for_size_before_ns,
        }
    }

    pub fn stats(&self) -> StoreStats {
        let inner = self.inner.read();
        let first = inner.chunks.iter().map(|c| c.first_start_ns).min();
        let last = inner.chunks.iter().map(|c| c.last_start_ns).max();
        StoreStats {
            chunks: inner.chunks.len(),
            events: inner.chunks.iter().map(|c| c.events.len()).sum(),
            bytes: inner.bytes,
            span_ns: match (first, last) {
                (Some(first), Some(last)) => last - first,
                _ => 0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Device, NameId, Payload};

    fn at(start_ns: u64) -> Event {
        Event::new(start_ns, 10, Device::Host, 1, NameId(1), Payload::Plain)
    }

    fn starts(data: &WindowData) -> Vec<u64> {
        let mut v: Vec<u64> = data.events().map(|e| e.start_ns).collect();
        v.sort_unstable();
        v
    }

    use std::sync::atomic::{AtomicU64, Ordering};

    /// A store whose clock reads `now`, which starts at 1000 ns.
    fn store_at(retention_s: u64, max_bytes: usize) -> (Store, Arc<AtomicU64>) {
        let now = Arc::new(AtomicU64::new(1000));
        let clock = Arc::clone(&now);
        let store = Store::with_clock(
            StoreConfig {
                retention: Duration::from_secs(retention_s),
                max_bytes,
            },
            move || clock.load(Ordering::Relaxed),
        );
        // Pretend recording started at the epoch so the tests' small
        // timestamps count as recorded history.
        store.inner.write().recording_since_ns = 0;
        (store, now)
    }

    fn store(retention_s: u64, max_bytes: usize) -> Store {
        store_at(retention_s, max_bytes).0
    }

    #[test]
    fn windows_return_exactly_the_events_that_start_inside() {
        let store = store(1000, usize::MAX);
        store.append(&mut (0..100).map(|i| at(i * 10)).collect());
        store.append(&mut (100..200).map(|i| at(i * 10)).collect());
        let data = store.query(Window {
            start_ns: 950,
            stop_ns: 1050,
        });
        assert_eq!(
            starts(&data),
            vec![950, 960, 970, 980, 990, 1000, 1010, 1020, 1030, 1040]
        );
        assert_eq!(data.history_starts_ns, None);
    }

    #[test]
    fn a_tap_sees_each_kept_event_once_as_it_arrives_late_ones_too() {
        let store = Arc::new(store(1000, usize::MAX));
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let into = Arc::clone(&seen);
        let tapped = store.tap_arrivals(Box::new(move |events| {
            into.lock().extend(events.map(|e| e.start_ns));
        }));
        assert!(tapped);
        assert!(!store.tap_arrivals(Box::new(|_| {})), "one tap per store");
        store.append(&mut vec![at(500), at(400)]);
        // Arrives later but starts earlier than what came before.
        store.append(&mut vec![at(100)]);
        // Too far ahead of the clock: not kept, not shown.
        store.append(&mut vec![at(600), at(u64::MAX / 2)]);
        assert_eq!(*seen.lock(), vec![500, 400, 100, 600]);
    }

    #[test]
    fn overlapping_windows_both_see_full_data() {
        let store = store(1000, usize::MAX);
        store.append(&mut (0..50).map(at).collect());
        let a = store.query(Window {
            start_ns: 0,
            stop_ns: 30,
        });
        let b = store.query(Window {
            start_ns: 20,
            stop_ns: 50,
        });
        assert_eq!(starts(&a), (0..30).collect::<Vec<_>>());
        assert_eq!(starts(&b), (20..50).collect::<Vec<_>>());
    }

    #[test]
    fn retention_evicts_old_chunks_and_reports_the_gap() {
        let (store, now) = store_at(1, usize::MAX);
        let second = 1_000_000_000;
        store.append(&mut vec![at(0), at(10)]);
        now.store(2 * second, Ordering::Relaxed);
        store.append(&mut vec![at(2 * second)]);
        assert_eq!(store.stats().chunks, 1);
        let data = store.query(Window {
            start_ns: 0,
            stop_ns: 3 * second,
        });
        assert_eq!(starts(&data), vec![2 * second]);
        assert_eq!(data.history_starts_ns, Some(11));
        assert!(!data.evicted_for_size, "evicted for its age");
    }

    /// The smallest store (`--store-size 1MiB`) with chunks as full as the
    /// collector makes them, of events with random times and names: never
    /// more than its bound once a chunk is in. (Chunks of 65,536 events took
    /// 1.4 MB each at 1 M events/s, and the newest is always kept.)
    #[test]
    fn the_store_stays_within_its_bytes_whatever_its_size() {
        let max_bytes = 1 << 20;
        let store = store(1000, max_bytes);
        let per_chunk = store.events_per_chunk();
        assert!(per_chunk < MOST_CHUNK_EVENTS, "{per_chunk}");
        assert_eq!(
            store_at(1000, 1 << 30).0.events_per_chunk(),
            MOST_CHUNK_EVENTS
        );
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = move || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            seed >> 20
        };
        for _ in 0..50 {
            let mut events: Vec<Event> = (0..per_chunk)
                .map(|_| {
                    let name = NameId((random() % 100_000) as u32);
                    Event::new(
                        random() % 900,
                        random(),
                        Device::Gpu(0),
                        random(),
                        name,
                        Payload::Plain,
                    )
                })
                .collect();
            store.append(&mut events);
            let held = store.stats().bytes;
            assert!(held <= max_bytes, "{held} bytes held");
        }
        assert!(store.stats().chunks >= 4);
    }

    #[test]
    fn byte_bound_evicts_oldest_first() {
        let chunk_of = |c: u64| (0..10).map(move |i| at(c * 100 + i)).collect::<Vec<_>>();
        let one_chunk = Chunk::new(&chunk_of(4), |_| true).unwrap().bytes();
        let store = store(1000, 2 * one_chunk);
        for c in 0..5u64 {
            store.append(&mut chunk_of(c));
        }
        let stats = store.stats();
        assert_eq!(stats.chunks, 2);
        assert!(stats.bytes <= 2 * one_chunk);
        // Chunks of 300..309 and 400..409 are left.
        assert_eq!(stats.span_ns, 409 - 300);
        let data = store.query(Window {
            start_ns: 0,
            stop_ns: 1000,
        });
        assert_eq!(starts(&data).first(), Some(&300));
        // The trace says which bound cut the window: the size.
        assert_eq!(data.history_starts_ns, Some(210));
        assert!(data.evicted_for_size);
        let held = store.query(Window {
            start_ns: 300,
            stop_ns: 1000,
        });
        assert!(!held.evicted_for_size, "nothing of it was evicted");
    }

    #[test]
    fn an_event_from_the_far_future_is_dropped_and_evicts_nothing() {
        let (store, now) = store_at(10, usize::MAX);
        let second = 1_000_000_000;
        now.store(100 * second, Ordering::Relaxed);
        store.append(&mut vec![at(99 * second), at(100 * second)]);
        let ten_years = 10 * 365 * 86_400 * second;
        store.append(&mut vec![at(ten_years), at(100 * second + 1)]);
        // A minute ahead is a clock step, not a forgery: kept.
        store.append(&mut vec![at(100 * second + 59 * second)]);
        assert_eq!(store.misdated(), 1);
        let data = store.query(Window {
            start_ns: 0,
            stop_ns: u64::MAX,
        });
        assert_eq!(
            starts(&data),
            vec![99 * second, 100 * second, 100 * second + 1, 159 * second]
        );
        // And one from before the retention is not kept either.
        store.append(&mut vec![at(second)]);
        assert_eq!(store.misdated(), 2);
    }

    #[test]
    fn drops_are_attributed_to_the_window_they_happened_in() {
        let store = store(1000, usize::MAX);
        store.record_drops(DropRecord {
            at_ns: 5,
            newest: 3,
            oldest: 0,
        });
        store.record_drops(DropRecord {
            at_ns: 50,
            newest: 0,
            oldest: 4,
        });
        let early = store.query(Window {
            start_ns: 0,
            stop_ns: 10,
        });
        assert_eq!((early.dropped_newest, early.dropped_oldest), (3, 0));
        let all = store.query(Window {
            start_ns: 0,
            stop_ns: 100,
        });
        assert_eq!(all.dropped(), 7);
    }
}
