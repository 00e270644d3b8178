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
//!
//! A clock registered before the library could see it (`torch.profiler`
//! run before `devtrace attach`) is recognised from the records when it is
//! the CPU's time-stamp counter, Kineto's ([`adopt_time_stamp_counter`]);
//! another is only said.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    /// make one). Generation 0 is none registered yet: no lock is taken
    /// then, once per buffer converted.
    pub fn follow_registered(&mut self) {
        let generation = GENERATION.load(Ordering::Acquire);
        if generation != self.generation {
            self.registered = registered_line();
            self.generation = generation;
        }
    }

    /// Whether a host time a record was mapped to could be one: within a
    /// year of when the map read its clocks (a record of an unknown clock,
    /// a counter from the boot read as nanoseconds from the epoch, falls
    /// decades away; one of `--cuda-record always` may wait long in a
    /// buffer). Any time is, for a map that read none.
    pub fn plausible(&self, realtime_ns: u64) -> bool {
        const YEAR_NS: u64 = 365 * 86_400_000_000_000;
        self.cupti.realtime_ns == 0 || self.cupti.realtime_ns.abs_diff(realtime_ns) <= YEAR_NS
    }

    /// The reading of CUPTI's own clock a host time maps back from.
    pub fn cupti_ticks_at(&self, realtime_ns: u64) -> u64 {
        let since = i128::from(realtime_ns) - i128::from(self.cupti.realtime_ns);
        (i128::from(self.cupti.ticks) + since).clamp(0, i128::from(u64::MAX)) as u64
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

/// A registered clock read beside the host's: its ticks, `CLOCK_REALTIME`
/// and a monotonic instant at one moment.
#[derive(Clone, Copy, Debug)]
struct Reading {
    ticks: u64,
    realtime_ns: u64,
    at: Instant,
}

/// Readings tried for one: the one least spread out (not preempted
/// between its clock reads) is kept.
const READ_TRIES: usize = 5;
/// How long the first rate's measurement may take at most, preempted or
/// with the host clock stepped.
const FIRST_RATE_LIMIT: Duration = Duration::from_millis(5);

/// Reads `read` beside the host's clocks.
fn read_clock(read: TimestampFunc) -> Reading {
    let (mut tightest, mut best) = read_once(read);
    for _ in 1..READ_TRIES {
        let (spread, reading) = read_once(read);
        if spread < tightest {
            (tightest, best) = (spread, reading);
        }
    }
    best
}

/// One reading, and how long its clock reads took.
fn read_once(read: TimestampFunc) -> (Duration, Reading) {
    let before_ns = devtrace_shm::clock::now_ns();
    let before = Instant::now();
    // SAFETY: a function registered with CUPTI as its timestamp callback,
    // which CUPTI calls from any thread at any time; this library calls it
    // only while the registering library keeps it there (never unloaded, or
    // CUPTI itself would call freed code). One that needs more than the CPU
    // (a Python function through ctypes, which needs the interpreter) would
    // be called here as CUPTI calls it, at a flush and at the process's
    // exit too.
    let ticks = unsafe { read() };
    let after = Instant::now();
    let after_ns = devtrace_shm::clock::now_ns();
    let spread = after - before;
    let reading = Reading {
        ticks,
        realtime_ns: midpoint(before_ns, after_ns),
        at: before + spread / 2,
    };
    (spread, reading)
}

/// Host nanoseconds per tick between two readings, on the monotonic clock
/// (a step of `CLOCK_REALTIME` between them does not count).
fn rate(from: &Reading, to: &Reading) -> Option<f64> {
    let ticks = to.ticks.checked_sub(from.ticks).filter(|t| *t > 0)?;
    let ns = to.at.checked_duration_since(from.at)?.as_nanos();
    (ns > 0).then(|| ns as f64 / ticks as f64)
}

/// A clock another user is registering, measured before CUPTI takes it:
/// once CUPTI has it, records carry it, and a map must know it by then.
pub struct Registration {
    read: TimestampFunc,
    first: Reading,
    first_ns_per_tick: f64,
}

/// Measures `read`'s rate over a quarter of a millisecond (at most
/// [`FIRST_RATE_LIMIT`]), on the registering thread.
pub fn measure_registration(read: TimestampFunc) -> Registration {
    let first = read_clock(read);
    let mut last = first;
    while last.at.duration_since(first.at) < Duration::from_nanos(FIRST_RATE_SPAN_NS)
        && first.at.elapsed() < FIRST_RATE_LIMIT
    {
        last = read_clock(read);
    }
    Registration {
        read,
        first,
        first_ns_per_tick: rate(&first, &last).unwrap_or(1.0),
    }
}

/// The registered clock, with its reading and rate as it was registered.
static REGISTERED: Mutex<Option<Registration>> = Mutex::new(None);
/// Held by the tests that register clocks, one at a time.
#[cfg(test)]
pub static REGISTRATION_TESTS: Mutex<()> = Mutex::new(());
/// Counts registrations, so that maps know to read the clock again.
static GENERATION: AtomicU64 = AtomicU64::new(0);

fn registered_slot() -> std::sync::MutexGuard<'static, Option<Registration>> {
    REGISTERED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// CUPTI took the clock `registration` measured (called by the interposed
/// `cuptiActivityRegisterTimestampCallback`). The same function registered
/// again (each `torch.profiler` start registers Kineto's) keeps its first
/// reading, whose span since makes the rate the finer.
pub fn registered(registration: Registration) {
    let mut slot = registered_slot();
    if slot
        .as_ref()
        .is_some_and(|known| known.read as usize == registration.read as usize)
    {
        return;
    }
    *slot = Some(registration);
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// The CPU's time-stamp counter, the clock PyTorch's Kineto registers.
#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn time_stamp_counter() -> u64 {
    // SAFETY: every x86-64 CPU has RDTSC.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// How far from the counter's reading now a record's ticks may lie to be
/// taken for the counter's.
#[cfg(target_arch = "x86_64")]
const COUNTER_AGE_NS: f64 = 86_400e9;

/// Whether `ticks`, a record's timestamp no known clock places, reads as
/// the CPU's time-stamp counter (within a day of it now): then the counter
/// is taken for the registered clock, as if its registration had been seen,
/// and true is returned.
pub fn adopt_time_stamp_counter(ticks: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let registration = measure_registration(time_stamp_counter);
        let age_ns =
            registration.first.ticks.abs_diff(ticks) as f64 * registration.first_ns_per_tick;
        if age_ns < COUNTER_AGE_NS {
            registered(registration);
            return true;
        }
    }
    let _ = ticks;
    false
}

/// The registered clock read now, its rate measured since it was
/// registered.
fn registered_line() -> Option<Line> {
    let slot = registered_slot();
    let registered = slot.as_ref()?;
    let now = read_clock(registered.read);
    let ns_per_tick =
        if now.at.duration_since(registered.first.at) >= Duration::from_nanos(RATE_SPAN_NS) {
            rate(&registered.first, &now).unwrap_or(registered.first_ns_per_tick)
        } else {
            registered.first_ns_per_tick
        };
    Some(Line {
        ticks: now.ticks,
        realtime_ns: now.realtime_ns,
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
        let _registering = REGISTRATION_TESTS.lock();
        unsafe extern "C" fn ticks() -> u64 {
            // 4 ticks a nanosecond from an origin of its own.
            4 * devtrace_shm::clock::now_ns().wrapping_sub(1_700_000_000_000_000_000) + 99
        }
        registered(measure_registration(ticks));
        let mut map = ClockMap::default();
        map.follow_registered();
        let line = map.registered.expect("the registered clock is read");
        assert!(
            (line.ns_per_tick - 0.25).abs() < 0.025,
            "{} ns a tick",
            line.ns_per_tick
        );
        let now = read_clock(ticks);
        let mapped = map.realtime(now.ticks);
        assert!(
            mapped.abs_diff(now.realtime_ns) < 1_000_000,
            "{mapped} against {}",
            now.realtime_ns
        );
        // The same clock registered again keeps its first reading; another
        // one is read again by maps made before it.
        let generation = GENERATION.load(Ordering::Acquire);
        registered(measure_registration(ticks));
        assert_eq!(GENERATION.load(Ordering::Acquire), generation);
        unsafe extern "C" fn other() -> u64 {
            devtrace_shm::clock::now_ns() / 1_000
        }
        registered(measure_registration(other));
        assert_eq!(GENERATION.load(Ordering::Acquire), generation + 1);
        map.follow_registered();
        assert_eq!(map.generation, generation + 1);
    }
}
