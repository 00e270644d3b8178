//! The clocks CUPTI stamps its records with, mapped onto `CLOCK_REALTIME`.
//!
//! CUPTI stamps records with its own clock, the one `cuptiGetTimestamp`
//! reads, until a user in the process registers a clock of its own with
//! `cuptiActivityRegisterTimestampCallback`. From then on every record
//! carries that clock's readings, for the rest of the process: nothing
//! unregisters it. PyTorch's Kineto registers the CPU's time-stamp counter
//! each time `torch.profiler` starts (its default on x86 Linux), whose ticks
//! are not nanoseconds and count from the machine's boot: on an H200, the
//! records of a capture after a `torch.profiler` window, mapped through
//! `cuptiGetTimestamp`, fell decades before the window and were dropped.
//!
//! The registration passes through this library ([`crate::coexist`]),
//! which keeps the registered function: a [`ClockMap`] reads it beside the
//! host clock, with its rate since it was registered, as well as CUPTI's
//! own clock. A record is mapped by the clock whose reading lies nearest
//! its timestamp: the two count from origins far apart (the epoch, the
//! boot), so which clock stamped a record is plain, whether CUPTI's
//! finalize keeps the registered clock or not.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// `CUpti_TimestampCallbackFunc`.
pub type TimestampFunc = unsafe extern "C" fn() -> u64;

/// How long the rate of a registered clock is measured over as it is
/// registered (on the registering thread, once per registration).
const FIRST_RATE_SPAN_NS: u64 = 250_000;
/// Below this span since the registration, its first rate is used.
const RATE_SPAN_NS: u64 = 1_000_000;
/// Readings of CUPTI's clock and the registered one this close (on the
/// registered clock) are of one clock: a `cuptiGetTimestamp` that reads the
/// registered clock too. Records are then mapped by the registered clock,
/// whose rate is measured; CUPTI's is taken to tick in nanoseconds.
const SAME_CLOCK_NS: f64 = 60e9;

/// A clock read at one instant beside the host clock, and how many host
/// nanoseconds one of its ticks lasts.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Line {
    ticks: u64,
    realtime_ns: u64,
    ns_per_tick: f64,
}

impl Line {
    /// The clock as `CLOCK_REALTIME` itself, shifted by nothing.
    const IDENTITY: Line = Line {
        ticks: 0,
        realtime_ns: 0,
        ns_per_tick: 1.0,
    };

    fn since(&self, ticks: u64) -> f64 {
        (i128::from(ticks) - i128::from(self.ticks)) as f64 * self.ns_per_tick
    }

    fn realtime(&self, ticks: u64) -> u64 {
        let at = i128::from(self.realtime_ns) + self.since(ticks).round() as i128;
        at.clamp(0, i128::from(u64::MAX)) as u64
    }
}

/// CUPTI's clock, and a clock another user registered for records (if
/// any), to `CLOCK_REALTIME`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockMap {
    cupti: Line,
    registered: Option<Line>,
    /// The registration [`Self::registered`] was read after.
    generation: u64,
}

impl Default for ClockMap {
    fn default() -> Self {
        ClockMap {
            cupti: Line::IDENTITY,
            registered: None,
            generation: 0,
        }
    }
}

impl ClockMap {
    /// `realtime_ns` read around (before and after) a CUPTI timestamp; no
    /// registered clock.
    pub fn from_readings(before_ns: u64, cupti_ns: u64, after_ns: u64) -> ClockMap {
        ClockMap {
            cupti: Line {
                ticks: cupti_ns,
                realtime_ns: midpoint(before_ns, after_ns),
                ns_per_tick: 1.0,
            },
            ..ClockMap::default()
        }
    }

    /// CUPTI's clock read now, and the registered clock if there is one.
    pub fn measure() -> Result<ClockMap, String> {
        let before = devtrace_shm::clock::now_ns();
        let cupti_ns = crate::cupti::timestamp()?;
        let after = devtrace_shm::clock::now_ns();
        let mut map = ClockMap::from_readings(before, cupti_ns, after);
        map.follow_registered();
        Ok(map)
    }

    /// Reads the registered clock again if one was registered since this
    /// map last read it (no CUPTI call: the converter's thread may not
    /// make one).
    pub fn follow_registered(&mut self) {
        let generation = GENERATION.load(Ordering::Acquire);
        if generation != self.generation || self.registered.is_none() {
            self.registered = registered_line();
            self.generation = generation;
        }
    }

    /// Whether a host time a record was mapped to could be one: within a
    /// day of when the map read its clocks (a record of an unknown clock
    /// falls decades away). Any time is, for a map that read none.
    pub fn plausible(&self, realtime_ns: u64) -> bool {
        const DAY_NS: u64 = 86_400_000_000_000;
        self.cupti.realtime_ns == 0 || self.cupti.realtime_ns.abs_diff(realtime_ns) <= DAY_NS
    }

    /// A record's timestamp on the host clock, by whichever clock stamped it.
    pub fn realtime(&self, ticks: u64) -> u64 {
        match self.registered {
            Some(registered)
                if registered.since(self.cupti.ticks).abs() < SAME_CLOCK_NS
                    || registered.since(ticks).abs() < self.cupti.since(ticks).abs() =>
            {
                registered.realtime(ticks)
            }
            _ => self.cupti.realtime(ticks),
        }
    }
}

fn midpoint(a: u64, b: u64) -> u64 {
    ((u128::from(a) + u128::from(b)) / 2) as u64
}

/// The clock a user registered, with its reading and the host's when it
/// was registered, and its rate measured then.
struct Registered {
    read: TimestampFunc,
    first: (u64, u64),
    first_ns_per_tick: f64,
}

// SAFETY: a plain function pointer CUPTI itself calls from any thread.
unsafe impl Send for Registered {}

static REGISTERED: Mutex<Option<Registered>> = Mutex::new(None);
/// Counts registrations, so that maps know to read the clock again.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Reads `read` and the host clock at one instant: the host clock's
/// midpoint around the reading.
fn read_pair(read: TimestampFunc) -> (u64, u64) {
    let before = devtrace_shm::clock::now_ns();
    // SAFETY: a function registered with CUPTI as its timestamp callback,
    // which CUPTI calls from any thread at any time; this library calls it
    // only while the registering library keeps it there (never unloaded,
    // or CUPTI itself would call freed code).
    let ticks = unsafe { read() };
    let after = devtrace_shm::clock::now_ns();
    (ticks, midpoint(before, after))
}

/// Another user registered `read` as the clock of CUPTI's records (called
/// by the interposed `cuptiActivityRegisterTimestampCallback` once CUPTI
/// took it).
pub fn registered(read: TimestampFunc) {
    let first = read_pair(read);
    let mut last = first;
    while last.1.saturating_sub(first.1) < FIRST_RATE_SPAN_NS {
        last = read_pair(read);
    }
    let first_ns_per_tick = rate(first, last).unwrap_or(1.0);
    if let Ok(mut slot) = REGISTERED.lock() {
        *slot = Some(Registered {
            read,
            first,
            first_ns_per_tick,
        });
        GENERATION.fetch_add(1, Ordering::AcqRel);
    }
}

/// Host nanoseconds per tick between two (ticks, realtime) readings.
fn rate(from: (u64, u64), to: (u64, u64)) -> Option<f64> {
    let ticks = to.0.checked_sub(from.0).filter(|t| *t > 0)?;
    let ns = to.1.checked_sub(from.1).filter(|n| *n > 0)?;
    Some(ns as f64 / ticks as f64)
}

/// The registered clock read now, its rate measured since it was
/// registered.
fn registered_line() -> Option<Line> {
    let slot = REGISTERED.lock().ok()?;
    let registered = slot.as_ref()?;
    let now = read_pair(registered.read);
    let ns_per_tick = if now.1.saturating_sub(registered.first.1) >= RATE_SPAN_NS {
        rate(registered.first, now).unwrap_or(registered.first_ns_per_tick)
    } else {
        registered.first_ns_per_tick
    };
    Some(Line {
        ticks: now.0,
        realtime_ns: now.1,
        ns_per_tick,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cupti_time_maps_to_the_midpoint_of_the_readings() {
        let clock = ClockMap::from_readings(1_000_100, 500, 1_000_300);
        assert_eq!(clock.realtime(500), 1_000_200);
        assert_eq!(clock.realtime(1_500), 1_001_200);
    }

    /// A counter of 3 ticks a nanosecond from the boot, beside CUPTI's
    /// clock on the epoch: each record goes by the clock that stamped it.
    #[test]
    fn records_of_a_registered_clock_are_told_from_cuptis_and_scaled() {
        let epoch = 1_795_000_000_000_000_000u64;
        let mut clock = ClockMap::from_readings(epoch, epoch + 7, epoch);
        clock.registered = Some(Line {
            ticks: 3_000_000_000_000,
            realtime_ns: epoch,
            ns_per_tick: 1.0 / 3.0,
        });
        // 3 ms of ticks before the reading: 1 ms before it on the host.
        assert_eq!(
            clock.realtime(3_000_000_000_000 - 3_000_000),
            epoch - 1_000_000
        );
        assert_eq!(clock.realtime(3_000_000_000_000 + 300), epoch + 100);
        // CUPTI's own clock, 2 ms before its reading.
        assert_eq!(clock.realtime(epoch + 7 - 2_000_000), epoch - 2_000_000);
        // Without the registered clock, its records fall in 1970.
        clock.registered = None;
        let misplaced = clock.realtime(3_000_000_000_000);
        assert!(!clock.plausible(misplaced), "{misplaced}");
        assert!(clock.plausible(clock.realtime(epoch)));
    }

    /// Should `cuptiGetTimestamp` read the registered clock too, records go
    /// by the registered clock's measured rate, never by CUPTI's assumed one.
    #[test]
    fn a_cupti_timestamp_on_the_registered_clock_maps_by_its_rate() {
        let epoch = 1_795_000_000_000_000_000u64;
        let at = 3_000_000_000_000u64;
        let mut clock = ClockMap::from_readings(epoch, at + 30, epoch);
        // A clock slower than nanoseconds: 2 ns a tick.
        clock.registered = Some(Line {
            ticks: at,
            realtime_ns: epoch,
            ns_per_tick: 2.0,
        });
        assert_eq!(clock.realtime(at - 1_000), epoch - 2_000);
        assert_eq!(clock.realtime(at + 30), epoch + 60);
    }

    #[test]
    fn a_clock_registered_through_the_library_is_read_with_its_rate() {
        unsafe extern "C" fn ticks() -> u64 {
            // 4 ticks a nanosecond from an origin of its own.
            4 * devtrace_shm::clock::now_ns().wrapping_sub(1_700_000_000_000_000_000) + 99
        }
        registered(ticks);
        let mut map = ClockMap::default();
        map.follow_registered();
        let line = map.registered.expect("the registered clock is read");
        assert!(
            (line.ns_per_tick - 0.25).abs() < 0.01,
            "{} ns a tick",
            line.ns_per_tick
        );
        // SAFETY: the function above.
        let (now_ticks, now_real) = read_pair(ticks);
        let mapped = map.realtime(now_ticks);
        assert!(
            mapped.abs_diff(now_real) < 1_000_000,
            "{mapped} against {now_real}"
        );
        // A map made before the registration reads it at its next look.
        let generation = GENERATION.load(Ordering::Acquire);
        registered(ticks);
        assert_eq!(GENERATION.load(Ordering::Acquire), generation + 1);
        map.follow_registered();
        assert_eq!(map.generation, generation + 1);
    }
}
