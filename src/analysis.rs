//! Numbers derived from the events of a window: how busy each device was and
//! how long training steps took. `Monitor` reports them.

use std::borrow::Borrow;
use std::collections::BTreeMap;

use crate::event::{Device, Event, NameId, Payload};
use crate::recorder::Window;

/// Utilisation over one window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Utilization {
    /// Busy fraction (0..1) per device that had any activity.
    pub device_busy: BTreeMap<u16, f64>,
    /// Durations of the steps that started in the window, nanoseconds.
    pub step_durations_ns: Vec<u64>,
    /// Mean of each counter track per device: (ordinal, counter) -> mean.
    pub counter_means: BTreeMap<(u16, NameId), f64>,
}

impl Utilization {
    /// Mean idle percentage over the devices, if any device was seen.
    pub fn idle_percent(&self) -> Option<f64> {
        if self.device_busy.is_empty() {
            return None;
        }
        let busy: f64 = self.device_busy.values().sum::<f64>() / self.device_busy.len() as f64;
        Some(100.0 * (1.0 - busy))
    }

    /// (mean, min, max) step time in milliseconds.
    pub fn step_times_ms(&self) -> Option<(f64, f64, f64)> {
        let count = self.step_durations_ns.len();
        if count == 0 {
            return None;
        }
        let ms = |ns: u64| ns as f64 / 1e6;
        let total: u64 = self.step_durations_ns.iter().sum();
        let min = self.step_durations_ns.iter().copied().min().unwrap_or(0);
        let max = self.step_durations_ns.iter().copied().max().unwrap_or(0);
        Some((ms(total) / count as f64, ms(min), ms(max)))
    }
}

/// Computes utilisation of `events` clipped to `window`.
pub fn utilization<E: Borrow<Event>>(
    events: impl IntoIterator<Item = E>,
    window: Window,
) -> Utilization {
    let mut intervals: BTreeMap<u16, Vec<(u64, u64)>> = BTreeMap::new();
    let mut counters: BTreeMap<(u16, NameId), (f64, u32)> = BTreeMap::new();
    let mut result = Utilization::default();
    for event in events {
        let event = event.borrow();
        match (event.device(), event.payload()) {
            (Device::Gpu(ordinal), Payload::Counter { value }) => {
                let entry = counters.entry((ordinal, event.name())).or_default();
                entry.0 += value;
                entry.1 += 1;
            }
            (
                Device::Gpu(ordinal),
                Payload::Kernel(_) | Payload::Memcpy(_) | Payload::Memset(_),
            ) => {
                let start = event.start_ns.max(window.start_ns);
                let end = event.end_ns().min(window.stop_ns);
                if start < end {
                    intervals.entry(ordinal).or_default().push((start, end));
                }
            }
            (_, Payload::Step { .. }) => result.step_durations_ns.push(event.duration_ns),
            _ => {}
        }
    }
    result.counter_means = counters
        .into_iter()
        .map(|(key, (sum, count))| (key, sum / f64::from(count)))
        .collect();
    let length = window.duration_ns().max(1) as f64;
    for (ordinal, mut spans) in intervals {
        result
            .device_busy
            .insert(ordinal, union_length(&mut spans) as f64 / length);
    }
    result
}

/// Total length covered by possibly overlapping intervals.
fn union_length(spans: &mut [(u64, u64)]) -> u64 {
    spans.sort_unstable();
    let mut total = 0;
    let mut current: Option<(u64, u64)> = None;
    for &(start, end) in spans.iter() {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total + current.map_or(0, |(s, e)| e - s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{KernelInfo, NameId};

    fn kernel(gpu: u16, start_ns: u64, duration_ns: u64) -> Event {
        Event::new(
            start_ns,
            duration_ns,
            Device::Gpu(gpu),
            7,
            NameId(1),
            Payload::Kernel(KernelInfo::default()),
        )
    }

    #[test]
    fn overlapping_activity_counts_once_and_is_clipped_to_the_window() {
        let window = Window {
            start_ns: 100,
            stop_ns: 200,
        };
        let events = [
            kernel(0, 90, 30),  // 100..120 inside
            kernel(0, 110, 20), // overlaps: 110..130
            kernel(0, 190, 50), // 190..200
            kernel(1, 100, 100),
            Event::new(
                100,
                40,
                Device::Host,
                1,
                NameId(2),
                Payload::Step { step_num: 1 },
            ),
        ];
        let u = utilization(events, window);
        assert!((u.device_busy[&0] - 0.4).abs() < 1e-9);
        assert!((u.device_busy[&1] - 1.0).abs() < 1e-9);
        assert!((u.idle_percent().unwrap() - 30.0).abs() < 1e-9);
        assert!(u.counter_means.is_empty());
        assert_eq!(u.step_times_ms(), Some((40e-6, 40e-6, 40e-6)));
    }

    #[test]
    fn counters_average_per_device_and_name() {
        let sample = |gpu: u16, name: u32, value: f64| {
            Event::new(
                5,
                0,
                Device::Gpu(gpu),
                u64::MAX,
                NameId(name),
                Payload::Counter { value },
            )
        };
        let events = [
            sample(0, 1, 10.0),
            sample(0, 1, 30.0),
            sample(1, 1, 7.0),
            sample(0, 2, 1.0),
        ];
        let u = utilization(
            events,
            Window {
                start_ns: 0,
                stop_ns: 10,
            },
        );
        assert_eq!(u.counter_means[&(0, NameId(1))], 20.0);
        assert_eq!(u.counter_means[&(1, NameId(1))], 7.0);
        assert_eq!(u.counter_means[&(0, NameId(2))], 1.0);
        assert!(u.device_busy.is_empty(), "counters are not device activity");
    }

    #[test]
    fn nothing_seen_means_no_numbers() {
        let u = utilization(std::iter::empty::<Event>(), Window::default());
        assert_eq!(u.idle_percent(), None);
        assert_eq!(u.step_times_ms(), None);
    }
}
