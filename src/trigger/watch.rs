//! Conditions evaluated over events as they arrive: each rule that watches
//! events keeps the little state it needs (a GPU's low spell, a counter's
//! last value, a line's recent step lengths) and says when it fires.
//! Pure: events in, firings out, so that every rule is tested without an
//! agent.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::rule::{Condition, Rule, SpanName};
use crate::clock;
use crate::event::{Device, Event, NameId, Payload};
use crate::model::registry::Registry;
use crate::xspace::builder::COUNTER_TRACK;

/// Lines whose step lengths a slow-step rule keeps at once; past it the
/// history starts over, so that a stream of new lines (tap connections)
/// cannot grow it without bound.
const MAX_STEP_LINES: usize = 4096;

/// A condition met: which rule, when, and the value that met it.
#[derive(Clone, Debug, PartialEq)]
pub struct Firing {
    pub rule: usize,
    pub at_ns: u64,
    pub value: String,
}

/// The state of one rule that watches events.
enum Watch {
    UtilizationBelow {
        counter: NameId,
        percent: f64,
        for_ns: u64,
        /// Per GPU: since when it has been low, and whether this spell fired.
        low: HashMap<u16, (u64, bool)>,
    },
    CounterChanges {
        counter: NameId,
        name: String,
        last: HashMap<Device, f64>,
    },
    /// NVML's XID count per GPU, and the code of its latest XID (sampled
    /// just before the count that includes it).
    Xid {
        count: NameId,
        code: NameId,
        last: HashMap<Device, f64>,
        codes: HashMap<Device, f64>,
    },
    SlowStep {
        factor: f64,
        steps: usize,
        /// Per (device, line): the lengths of the last `steps` steps.
        recent: Recent,
    },
    SlowSpan {
        spans: SpanNames,
        factor: f64,
        steps: usize,
        recent: Recent,
    },
}

/// Per (device, line): the lengths of the last steps (or spans) timed.
type Recent = HashMap<(Device, u64), VecDeque<u64>>;

/// Which names a span rule times, decided once per name.
struct SpanNames {
    pattern: SpanName,
    registry: Arc<Registry>,
    decided: HashMap<NameId, Option<Arc<str>>>,
}

impl SpanNames {
    /// The span's name when the rule times it.
    fn timed(&mut self, id: NameId) -> Option<Arc<str>> {
        let (pattern, registry) = (&self.pattern, &self.registry);
        self.decided
            .entry(id)
            .or_insert_with(|| registry.name_of(id).filter(|name| pattern.matches(name)))
            .clone()
    }
}

/// Picks out of every event that arrives what the rules look at: samples
/// of the counters they compare, step markers, and spans whose names a span
/// rule times. It runs on the collector's thread
/// ([`crate::recorder::ArrivalTap`]), so each event costs an id compare or an
/// index, and a span name is matched once, the first time it is seen.
pub struct Filter {
    counters: Vec<NameId>,
    steps: bool,
    spans: Vec<SpanName>,
    registry: Arc<Registry>,
    /// Per name id: not decided yet, timed by a span rule, or not.
    timed: Mutex<Vec<Timed>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Timed {
    Undecided,
    Yes,
    No,
}

impl Filter {
    /// The events of `events` the rules look at, added to `wanted`.
    pub fn pick(&self, events: &mut dyn Iterator<Item = &Event>, wanted: &mut Vec<Event>) {
        let mut timed = self.timed.lock();
        for event in events {
            if self.wants(event, &mut timed) {
                wanted.push(*event);
            }
        }
    }

    fn wants(&self, event: &Event, timed: &mut Vec<Timed>) -> bool {
        if event.is_counter() {
            return event.line == COUNTER_TRACK && self.counters.contains(&event.name());
        }
        if self.steps && event.is_step() {
            return true;
        }
        if self.spans.is_empty() || event.duration_ns == 0 {
            return false;
        }
        let id = event.name().0 as usize;
        if id >= timed.len() {
            // Ids are dense and bounded by the registry's name table.
            timed.resize(id + 1, Timed::Undecided);
        }
        if timed[id] == Timed::Undecided {
            let name = self.registry.name_of(event.name());
            let matched = name.is_some_and(|name| self.spans.iter().any(|p| p.matches(&name)));
            timed[id] = if matched { Timed::Yes } else { Timed::No };
        }
        timed[id] == Timed::Yes
    }
}

/// Every event-watching rule of an agent.
pub struct Watcher {
    watches: Vec<(usize, Watch)>,
}

impl Watcher {
    /// Watches for the rules whose conditions are about events; names are
    /// interned in `registry` so that events are matched by id.
    pub fn new(rules: &[Rule], registry: &Arc<Registry>) -> Watcher {
        let watches = rules
            .iter()
            .enumerate()
            .filter_map(|(index, rule)| {
                let watch = match &rule.condition {
                    Condition::UtilizationBelow { percent, for_ } => Watch::UtilizationBelow {
                        counter: registry.intern(crate::backend::nvml::SM_UTILIZATION),
                        percent: *percent,
                        for_ns: clock::duration_ns(*for_),
                        low: HashMap::new(),
                    },
                    Condition::CounterChanges { counter } => Watch::CounterChanges {
                        counter: registry.intern(counter),
                        name: counter.clone(),
                        last: HashMap::new(),
                    },
                    Condition::Xid => Watch::Xid {
                        count: registry.intern(crate::backend::nvml::XID_ERRORS),
                        code: registry.intern(crate::backend::nvml::LAST_XID),
                        last: HashMap::new(),
                        codes: HashMap::new(),
                    },
                    Condition::SlowStep { factor, steps } => Watch::SlowStep {
                        factor: *factor,
                        steps: *steps,
                        recent: HashMap::new(),
                    },
                    Condition::SlowSpan {
                        name,
                        factor,
                        steps,
                    } => Watch::SlowSpan {
                        spans: SpanNames {
                            pattern: name.clone(),
                            registry: Arc::clone(registry),
                            decided: HashMap::new(),
                        },
                        factor: *factor,
                        steps: *steps,
                        recent: HashMap::new(),
                    },
                    Condition::Dropped | Condition::Explicit => return None,
                };
                Some((index, watch))
            })
            .collect();
        Watcher { watches }
    }

    /// Whether any rule needs to see events at all.
    pub fn is_idle(&self) -> bool {
        self.watches.is_empty()
    }

    /// What picks the events these rules look at out of all that arrive.
    pub fn filter(&self, registry: &Arc<Registry>) -> Filter {
        let mut filter = Filter {
            counters: Vec::new(),
            steps: false,
            spans: Vec::new(),
            registry: Arc::clone(registry),
            timed: Mutex::new(Vec::new()),
        };
        for (_, watch) in &self.watches {
            match watch {
                Watch::UtilizationBelow { counter, .. } | Watch::CounterChanges { counter, .. } => {
                    filter.counters.push(*counter)
                }
                Watch::Xid { count, code, .. } => filter.counters.extend([*count, *code]),
                Watch::SlowStep { .. } => filter.steps = true,
                Watch::SlowSpan { spans, .. } => filter.spans.push(spans.pattern.clone()),
            }
        }
        filter
    }

    /// Looks at one event; what it makes fire goes to `fired`.
    pub fn observe(&mut self, event: &Event, fired: &mut Vec<Firing>) {
        let payload = event.payload();
        for (rule, watch) in &mut self.watches {
            let firing = match (watch, payload) {
                (
                    Watch::UtilizationBelow {
                        counter,
                        percent,
                        for_ns,
                        low,
                    },
                    Payload::Counter { value },
                ) if event.name() == *counter && event.line == COUNTER_TRACK => {
                    let Device::Gpu(gpu) = event.device() else {
                        continue;
                    };
                    utilization(low, gpu, event.start_ns, value, *percent, *for_ns)
                }
                (
                    Watch::CounterChanges {
                        counter,
                        name,
                        last,
                    },
                    Payload::Counter { value },
                ) if event.name() == *counter && event.line == COUNTER_TRACK => {
                    changed(last, event.device(), value).map(|previous| {
                        let text = format!(
                            "{} {name} changed from {previous} to {value}",
                            device_label(event.device())
                        );
                        (event.start_ns, text)
                    })
                }
                (
                    Watch::Xid {
                        count,
                        code,
                        last,
                        codes,
                    },
                    Payload::Counter { value },
                ) if event.line == COUNTER_TRACK => {
                    if event.name() == *code {
                        codes.insert(event.device(), value);
                        continue;
                    }
                    if event.name() != *count {
                        continue;
                    }
                    xid(last, codes, event.device(), value).map(|text| (event.start_ns, text))
                }
                (
                    Watch::SlowStep {
                        factor,
                        steps,
                        recent,
                    },
                    Payload::Step { step_num },
                ) => {
                    let history = history_of(recent, event);
                    slow_step(history, *steps, *factor, event.duration_ns, || {
                        format!("step {step_num}")
                    })
                    .map(|text| (event.end_ns(), text))
                }
                (
                    Watch::SlowSpan {
                        spans,
                        factor,
                        steps,
                        recent,
                    },
                    _,
                ) if event.duration_ns > 0 && event.line != COUNTER_TRACK => {
                    let Some(name) = spans.timed(event.name()) else {
                        continue;
                    };
                    let history = history_of(recent, event);
                    slow_step(history, *steps, *factor, event.duration_ns, || {
                        format!("span {name:?}")
                    })
                    .map(|text| (event.end_ns(), text))
                }
                _ => None,
            };
            if let Some((at_ns, value)) = firing {
                fired.push(Firing {
                    rule: *rule,
                    at_ns,
                    value,
                });
            }
        }
    }
}

/// One utilisation sample of one GPU: fires once per low spell, when it
/// has lasted `for_ns`.
fn utilization(
    low: &mut HashMap<u16, (u64, bool)>,
    gpu: u16,
    at_ns: u64,
    value: f64,
    percent: f64,
    for_ns: u64,
) -> Option<(u64, String)> {
    if value >= percent {
        low.remove(&gpu);
        return None;
    }
    let (since, fired) = low.entry(gpu).or_insert((at_ns, false));
    let lasted = at_ns.saturating_sub(*since);
    if *fired || lasted < for_ns {
        return None;
    }
    *fired = true;
    Some((
        at_ns,
        format!(
            "GPU {gpu} SM utilization {value:.1}% below {percent}% for {:.3} s",
            Duration::from_nanos(lasted).as_secs_f64()
        ),
    ))
}

/// Remembers `value` as `device`'s latest and gives the value it replaces
/// when that differs; a device's first value is no change.
fn changed(last: &mut HashMap<Device, f64>, device: Device, value: f64) -> Option<f64> {
    let previous = last.insert(device, value)?;
    (previous != value).then_some(previous)
}

/// One XID count sample of one GPU: fires when it changes, naming the code
/// of the latest XID.
fn xid(
    last: &mut HashMap<Device, f64>,
    codes: &HashMap<Device, f64>,
    device: Device,
    count: f64,
) -> Option<String> {
    changed(last, device, count)?;
    let errors = if count == 1.0 { "error" } else { "errors" };
    let since = format!("({count} {errors} since the agent started)");
    Some(match codes.get(&device) {
        Some(code) => format!(
            "{} {} {since}",
            device_label(device),
            crate::backend::nvml::xid_label(*code as u64)
        ),
        None => format!("{} XID {since}", device_label(device)),
    })
}

/// The recent lengths of the line `event` is on.
fn history_of<'r>(recent: &'r mut Recent, event: &Event) -> &'r mut VecDeque<u64> {
    let key = (event.device(), event.line);
    if recent.len() >= MAX_STEP_LINES && !recent.contains_key(&key) {
        recent.clear();
    }
    recent.entry(key).or_default()
}

/// One step (or timed span) of a line: slow when it lasts more than
/// `factor` times the median of the `steps` before it (judged once that
/// many were seen); `what` names it in the value.
fn slow_step(
    history: &mut VecDeque<u64>,
    steps: usize,
    factor: f64,
    duration_ns: u64,
    what: impl FnOnce() -> String,
) -> Option<String> {
    let verdict = (history.len() == steps)
        .then(|| median(history))
        .filter(|median| duration_ns as f64 > factor * *median as f64)
        .map(|median| {
            format!(
                "{} took {:.3} ms, {:.1}x the median {:.3} ms of the last {steps}",
                what(),
                duration_ns as f64 / 1e6,
                duration_ns as f64 / median.max(1) as f64,
                median as f64 / 1e6
            )
        });
    if history.len() == steps {
        history.pop_front();
    }
    history.push_back(duration_ns);
    verdict
}

fn median(values: &VecDeque<u64>) -> u64 {
    let mut sorted: Vec<u64> = values.iter().copied().collect();
    sorted.sort_unstable();
    sorted[sorted.len() / 2]
}

fn device_label(device: Device) -> String {
    match device {
        Device::Gpu(gpu) => format!("GPU {gpu}"),
        Device::Host | Device::HostCpus => "host".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(texts: &[&str]) -> Vec<Rule> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    fn sample(registry: &Registry, name: &str, gpu: u16, at_ms: u64, value: f64) -> Event {
        Event::new(
            at_ms * 1_000_000,
            0,
            Device::Gpu(gpu),
            COUNTER_TRACK,
            registry.intern(name),
            Payload::Counter { value },
        )
    }

    fn step(num: i64, at_ms: u64, length_ms: u64) -> Event {
        Event::new(
            at_ms * 1_000_000,
            length_ms * 1_000_000,
            Device::Host,
            1,
            NameId(1),
            Payload::Step { step_num: num },
        )
    }

    fn run(watcher: &mut Watcher, events: &[Event]) -> Vec<Firing> {
        let mut fired = Vec::new();
        for event in events {
            watcher.observe(event, &mut fired);
        }
        fired
    }

    #[test]
    fn low_utilisation_fires_once_per_spell_after_its_duration() {
        let registry = Registry::new();
        let mut watcher = Watcher::new(&rules(&["name=u; when=util < 20% for 100ms"]), &registry);
        let util = crate::backend::nvml::SM_UTILIZATION;
        let events: Vec<Event> = [(0, 90.0), (50, 5.0), (100, 5.0), (150, 5.0), (200, 5.0)]
            .iter()
            .map(|(at, v)| sample(&registry, util, 0, *at, *v))
            .collect();
        let fired = run(&mut watcher, &events);
        assert_eq!(fired.len(), 1, "{fired:?}");
        assert_eq!(fired[0].at_ns, 150_000_000);
        // Busy again, then a new spell: one more.
        let again: Vec<Event> = [(300, 95.0), (400, 1.0), (500, 1.0), (600, 1.0)]
            .iter()
            .map(|(at, v)| sample(&registry, util, 0, *at, *v))
            .collect();
        let fired = run(&mut watcher, &again);
        assert_eq!(
            fired.iter().map(|f| f.at_ns).collect::<Vec<_>>(),
            vec![500_000_000]
        );
        // Another counter's low values are not utilisation.
        let other = [
            sample(&registry, "Power (W)", 1, 700, 0.0),
            sample(&registry, "Power (W)", 1, 900, 0.0),
        ];
        assert!(run(&mut watcher, &other).is_empty());
    }

    #[test]
    fn a_counter_fires_when_it_changes_not_on_its_first_value() {
        let registry = Registry::new();
        let mut watcher = Watcher::new(&rules(&["name=e; when=ecc changes"]), &registry);
        let ecc = crate::backend::nvml::ECC_ERRORS;
        let events = [
            sample(&registry, ecc, 0, 0, 2.0),
            sample(&registry, ecc, 1, 0, 0.0),
            sample(&registry, ecc, 0, 10, 2.0),
            sample(&registry, ecc, 1, 20, 1.0),
            sample(&registry, ecc, 1, 30, 1.0),
        ];
        let fired = run(&mut watcher, &events);
        assert_eq!(fired.len(), 1, "{fired:?}");
        assert_eq!(fired[0].at_ns, 20_000_000);
        assert!(fired[0].value.contains("GPU 1"), "{}", fired[0].value);
    }

    #[test]
    fn an_xid_fires_when_the_count_changes_naming_the_gpu_and_code() {
        let registry = Registry::new();
        let mut watcher = Watcher::new(&rules(&["name=x; when=xid"]), &registry);
        let (count, code) = (
            crate::backend::nvml::XID_ERRORS,
            crate::backend::nvml::LAST_XID,
        );
        let ecc = crate::backend::nvml::ECC_ERRORS;
        // (counter, GPU, ms, value); the code is sampled before its count.
        let samples = [
            (count, 0, 0, 0.0),
            (count, 1, 0, 0.0),
            (count, 1, 10, 0.0),
            // Another counter's change is not an XID.
            (ecc, 1, 15, 3.0),
            (code, 1, 20, 79.0),
            (count, 1, 20, 1.0),
            (count, 1, 30, 1.0),
            (count, 0, 30, 0.0),
            (code, 0, 40, 999.0),
            (count, 0, 40, 1.0),
            (code, 1, 50, 31.0),
            (count, 1, 50, 2.0),
        ];
        let events: Vec<Event> = samples
            .iter()
            .map(|(name, gpu, at, value)| sample(&registry, name, *gpu, *at, *value))
            .collect();
        let fired = run(&mut watcher, &events);
        let seen: Vec<(u64, &str)> = fired.iter().map(|f| (f.at_ns, f.value.as_str())).collect();
        assert_eq!(
            seen,
            vec![
                (20_000_000, "GPU 1 XID 79 (1 error since the agent started)"),
                (
                    40_000_000,
                    "GPU 0 XID unknown (1 error since the agent started)"
                ),
                (
                    50_000_000,
                    "GPU 1 XID 31 (2 errors since the agent started)"
                ),
            ]
        );
    }

    #[test]
    fn a_step_fires_past_the_factor_times_the_median_of_the_steps_before() {
        let registry = Registry::new();
        let mut watcher = Watcher::new(&rules(&["name=s; when=step > 3x median(4)"]), &registry);
        // Too few steps yet to judge the long first one.
        let mut events = vec![step(0, 0, 500)];
        events.extend((1..6).map(|n| step(n, 500 + n as u64 * 50, 50)));
        events.push(step(6, 900, 140));
        events.push(step(7, 1040, 160));
        events.push(step(8, 1200, 50));
        let fired = run(&mut watcher, &events);
        assert_eq!(fired.len(), 1, "{fired:?}");
        assert_eq!(fired[0].at_ns, 1_200_000_000);
        assert!(fired[0].value.starts_with("step 7 "), "{}", fired[0].value);
    }

    fn span(registry: &Registry, name: &str, thread: u64, at_ms: u64, length_ms: u64) -> Event {
        Event::new(
            at_ms * 1_000_000,
            length_ms * 1_000_000,
            Device::Host,
            thread,
            registry.intern(name),
            Payload::Plain,
        )
    }

    #[test]
    fn a_span_fires_past_the_factor_times_the_median_of_its_names_before() {
        let registry = Registry::new();
        let mut watcher = Watcher::new(
            &rules(&["name=s; when=span step_* > 3x median(3)"]),
            &registry,
        );
        // NVTX ranges `step_<i>` on thread 7, with other spans between
        // them that must not count, and the same names on thread 8 timed
        // apart.
        let mut events = Vec::new();
        for i in 0..4u64 {
            events.push(span(&registry, &format!("step_{i}"), 7, i * 100, 40));
            events.push(span(&registry, "forward", 7, i * 100 + 5, 500));
            events.push(span(&registry, "other_step", 7, i * 100 + 6, 900));
        }
        events.push(span(&registry, "step_4", 8, 400, 300));
        events.push(span(&registry, "step_4", 7, 400, 110));
        events.push(span(&registry, "step_5", 7, 600, 20));
        assert!(run(&mut watcher, &events).is_empty());
        let fired = run(&mut watcher, &[span(&registry, "step_6", 7, 700, 150)]);
        assert_eq!(fired.len(), 1, "{fired:?}");
        assert_eq!(fired[0].at_ns, 850_000_000);
        assert!(
            fired[0]
                .value
                .starts_with("span \"step_6\" took 150.000 ms"),
            "{}",
            fired[0].value
        );
    }

    #[test]
    fn the_filter_picks_only_what_some_rule_looks_at() {
        let registry = Registry::new();
        let util = crate::backend::nvml::SM_UTILIZATION;
        let events = [
            sample(&registry, util, 0, 0, 50.0),
            sample(&registry, "Power (W)", 0, 0, 300.0),
            step(1, 10, 50),
            span(&registry, "step_1", 7, 10, 40),
            span(&registry, "step_1", 7, 60, 0),
            span(&registry, "forward", 7, 10, 40),
        ];
        let picked = |texts: &[&str]| {
            let watcher = Watcher::new(&rules(texts), &registry);
            let mut wanted = Vec::new();
            watcher
                .filter(&registry)
                .pick(&mut events.iter(), &mut wanted);
            wanted
                .iter()
                .map(|e| events.iter().position(|x| x == e).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(picked(&["name=u; when=util < 20% for 1s"]), vec![0]);
        assert_eq!(picked(&["name=s; when=step > 3x median(4)"]), vec![2]);
        assert_eq!(
            picked(&["name=n; when=span step_* > 3x median(4)"]),
            vec![3]
        );
        assert_eq!(
            picked(&[
                "name=c; when=counter Power (W) changes",
                "name=n; when=span forward > 3x median(4)"
            ]),
            vec![1, 5]
        );
        assert!(picked(&["name=d; when=dropped"]).is_empty());
    }

    #[test]
    fn rules_that_do_not_watch_events_leave_the_watcher_idle() {
        let registry = Registry::new();
        let watcher = Watcher::new(
            &rules(&["name=d; when=dropped", "name=x; when=explicit"]),
            &registry,
        );
        assert!(watcher.is_idle());
    }
}
