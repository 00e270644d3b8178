//! Trigger rules as operators write them, in `--trigger` and in a config
//! file's `[[trigger]]` tables: `;`-separated `key=value` fields.
//!
//! ```text
//! name=slow-step; when=step > 3x median(20); before=10s; after=2s; cooldown=5m; max-per-hour=6
//! ```
//!
//! Only `name` and `when` are required. A rule that does not parse is
//! refused with the field (and within `when`, the word) that is wrong.

use std::fmt;
use std::time::Duration;

use crate::backend::nvml;
use crate::model::units::parse_duration;

/// Defaults of the optional fields.
pub const DEFAULT_BEFORE: Duration = Duration::from_secs(10);
pub const DEFAULT_AFTER: Duration = Duration::from_secs(2);
pub const DEFAULT_COOLDOWN: Duration = Duration::from_secs(300);
pub const DEFAULT_MAX_PER_HOUR: u32 = 6;

/// Bounds that keep one rule from asking for what no agent holds.
const MAX_BEFORE: Duration = Duration::from_secs(3600);
const MAX_AFTER: Duration = Duration::from_secs(600);
/// The longest rule name, in bytes (names are ASCII); the Trigger service
/// refuses a longer one as invalid, since no rule can have it.
pub const MAX_NAME: usize = 64;
/// Steps a median is taken over, at most (the history is kept per line).
const MAX_MEDIAN_STEPS: usize = 1000;

/// What makes a rule fire.
#[derive(Clone, Debug, PartialEq)]
pub enum Condition {
    /// Some GPU's SM utilisation samples stay below `percent` for `for_`.
    UtilizationBelow { percent: f64, for_: Duration },
    /// A counter track (NVML's ECC errors, throttle reasons, or any named
    /// one) changes value on some GPU.
    CounterChanges { counter: String },
    /// A GPU reports an XID error (NVML's `XID errors` count changes).
    Xid,
    /// A step marker lasts more than `factor` times the median of the
    /// `steps` before it on the same line.
    SlowStep { factor: f64, steps: usize },
    /// A span named `name` (an NVTX range of an injected workload, a
    /// framework op, any span) lasts more than `factor` times the median of
    /// the `steps` spans of that name before it on its line.
    SlowSpan {
        name: SpanName,
        factor: f64,
        steps: usize,
    },
    /// Events are lost anywhere (rings, backends, the agent).
    Dropped,
    /// Only `devtrace trigger NAME` (the Trigger service's Fire) fires it.
    Explicit,
}

/// Counter names NVML's backend samples, by the short names rules use.
const COUNTER_ALIASES: &[(&str, &str)] = &[
    ("ecc", nvml::ECC_ERRORS),
    ("throttle", nvml::THROTTLE_REASONS),
];

/// Which spans a `span NAME > ...` rule times: one name, or every name
/// with a prefix (`step_*`, as NVTX ranges numbered per step are named).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpanName {
    Exactly(String),
    StartingWith(String),
}

impl SpanName {
    fn parse(text: &str) -> Result<SpanName, RuleError> {
        match text.strip_suffix('*') {
            Some(prefix) if !prefix.is_empty() && !prefix.contains('*') => {
                Ok(SpanName::StartingWith(prefix.to_string()))
            }
            None if !text.is_empty() && !text.contains('*') => Ok(SpanName::Exactly(text.into())),
            _ => Err(bad(
                text,
                "a span name, or a prefix ending in * (step_*); no other wildcards",
            )),
        }
    }

    pub fn matches(&self, name: &str) -> bool {
        match self {
            SpanName::Exactly(exact) => name == exact,
            SpanName::StartingWith(prefix) => name.starts_with(prefix.as_str()),
        }
    }
}

/// One parsed rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub name: String,
    pub condition: Condition,
    /// How much of the past a firing saves, and of what follows.
    pub before: Duration,
    pub after: Duration,
    /// No second firing within this of the last.
    pub cooldown: Duration,
    /// No more firings than this in any hour.
    pub max_per_hour: u32,
    /// The rule as written, for the saved trace and the log.
    pub text: String,
}

/// A rule that does not parse: the part that is wrong, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("in {part:?}: {reason}")]
pub struct RuleError {
    pub part: String,
    pub reason: String,
}

fn bad(part: &str, reason: impl Into<String>) -> RuleError {
    RuleError {
        part: part.trim().to_string(),
        reason: reason.into(),
    }
}

impl std::str::FromStr for Rule {
    type Err = RuleError;

    fn from_str(text: &str) -> Result<Rule, RuleError> {
        let mut name = None;
        let mut condition = None;
        let mut before = DEFAULT_BEFORE;
        let mut after = DEFAULT_AFTER;
        let mut cooldown = DEFAULT_COOLDOWN;
        let mut max_per_hour = DEFAULT_MAX_PER_HOUR;
        let mut seen: Vec<&str> = Vec::new();
        for field in text.split(';').filter(|f| !f.trim().is_empty()) {
            let (key, value) = field.split_once('=').ok_or_else(|| {
                bad(
                    field,
                    "a field is key=value (name, when, before, after, cooldown, max-per-hour)",
                )
            })?;
            let (key, value) = (key.trim(), value.trim());
            if seen.contains(&key) {
                return Err(bad(field, format!("{key} is given twice")));
            }
            match key {
                "name" => name = Some(parse_name(field, value)?),
                "when" => condition = Some(parse_condition(value)?),
                "before" => before = parse_bounded(field, value, MAX_BEFORE)?,
                "after" => after = parse_bounded(field, value, MAX_AFTER)?,
                "cooldown" => {
                    cooldown = parse_duration(value).map_err(|e| bad(field, e.to_string()))?
                }
                "max-per-hour" => {
                    max_per_hour = value
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad(field, "a whole number of firings, at least 1"))?
                }
                _ => {
                    return Err(bad(
                        field,
                        format!(
                            "unknown key {key:?}; the keys are name, when, before, after, \
                             cooldown and max-per-hour"
                        ),
                    ))
                }
            }
            seen.push(key);
        }
        let name = name.ok_or_else(|| bad(text, "the rule has no name=NAME"))?;
        let condition = condition.ok_or_else(|| {
            bad(
                text,
                "the rule has no when=CONDITION (utilization < 20% for 30s, ecc changes, \
                 step > 3x median(20), span NAME > 3x median(20), dropped, explicit)",
            )
        })?;
        if before.is_zero() && after.is_zero() {
            return Err(bad(
                text,
                "before and after are both 0: the trace would be empty",
            ));
        }
        Ok(Rule {
            name,
            condition,
            before,
            after,
            cooldown,
            max_per_hour,
            text: text.trim().to_string(),
        })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A rule's name names its sessions: letters, digits, `-`, `_`, `.`.
fn parse_name(field: &str, value: &str) -> Result<String, RuleError> {
    let valid = !value.is_empty()
        && value.len() <= MAX_NAME
        && !value.starts_with('.')
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        return Err(bad(
            field,
            format!(
                "a name is 1 to {MAX_NAME} ASCII letters, digits, '-', '_' or '.', not starting with '.'"
            ),
        ));
    }
    Ok(value.to_string())
}

fn parse_bounded(field: &str, value: &str, most: Duration) -> Result<Duration, RuleError> {
    let duration = parse_duration(value).map_err(|e| bad(field, e.to_string()))?;
    if duration > most {
        return Err(bad(field, format!("at most {}s", most.as_secs())));
    }
    Ok(duration)
}

/// The `when=` part: one of the conditions [`Condition`] lists.
fn parse_condition(text: &str) -> Result<Condition, RuleError> {
    let words: Vec<&str> = text.split_whitespace().collect();
    match words.as_slice() {
        ["explicit"] => Ok(Condition::Explicit),
        ["dropped"] => Ok(Condition::Dropped),
        ["xid"] | ["xid", "changes"] => Ok(Condition::Xid),
        [alias, "changes"] if COUNTER_ALIASES.iter().any(|(a, _)| a == alias) => {
            let counter = COUNTER_ALIASES
                .iter()
                .find(|(a, _)| a == alias)
                .map(|(_, name)| name.to_string())
                .unwrap_or_default();
            Ok(Condition::CounterChanges { counter })
        }
        ["counter", .., "changes"] if words.len() > 2 => Ok(Condition::CounterChanges {
            counter: words[1..words.len() - 1].join(" "),
        }),
        ["utilization" | "util", "<", percent, "for", duration] => {
            let percent = percent
                .strip_suffix('%')
                .and_then(|p| p.parse::<f64>().ok())
                .filter(|p| (0.0..=100.0).contains(p))
                .ok_or_else(|| bad(percent, "a percentage from 0% to 100%"))?;
            let for_ = parse_duration(duration).map_err(|e| bad(duration, e.to_string()))?;
            Ok(Condition::UtilizationBelow { percent, for_ })
        }
        ["step", ">", factor, median] => {
            let (factor, steps) = slower_than(factor, median)?;
            Ok(Condition::SlowStep { factor, steps })
        }
        ["span", .., ">", factor, median] if words.len() > 4 => {
            let name = SpanName::parse(&words[1..words.len() - 3].join(" "))?;
            let (factor, steps) = slower_than(factor, median)?;
            Ok(Condition::SlowSpan {
                name,
                factor,
                steps,
            })
        }
        _ => Err(bad(
            text,
            "unknown condition; one of: utilization < PERCENT% for DURATION, ecc changes, \
             throttle changes, xid, counter NAME changes, step > FACTORx median(N), \
             span NAME > FACTORx median(N), dropped, explicit",
        )),
    }
}

/// `FACTORx median(N)`: the factor, and N.
fn slower_than(factor: &str, median: &str) -> Result<(f64, usize), RuleError> {
    let factor_value = factor
        .strip_suffix('x')
        .and_then(|f| f.parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f >= 1.0)
        .ok_or_else(|| bad(factor, "a factor of at least 1, written like 3x"))?;
    let steps = median
        .strip_prefix("median(")
        .and_then(|m| m.strip_suffix(')'))
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|n| (1..=MAX_MEDIAN_STEPS).contains(n))
        .ok_or_else(|| {
            bad(
                median,
                format!(
                    "median(N): the median of the last N steps, N from 1 to {MAX_MEDIAN_STEPS}"
                ),
            )
        })?;
    Ok((factor_value, steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Rule, RuleError> {
        text.parse()
    }

    #[test]
    fn every_condition_parses_with_defaults_for_what_is_left_out() {
        let rule = parse("name=slow; when=step > 3x median(20)").unwrap();
        assert_eq!(
            rule.condition,
            Condition::SlowStep {
                factor: 3.0,
                steps: 20
            }
        );
        assert_eq!(
            (rule.before, rule.after, rule.cooldown, rule.max_per_hour),
            (
                DEFAULT_BEFORE,
                DEFAULT_AFTER,
                DEFAULT_COOLDOWN,
                DEFAULT_MAX_PER_HOUR
            )
        );
        let rule = parse(
            "name=idle; when=utilization < 20% for 30s; before=1m; after=0; cooldown=1h; max-per-hour=2",
        )
        .unwrap();
        assert_eq!(
            rule.condition,
            Condition::UtilizationBelow {
                percent: 20.0,
                for_: Duration::from_secs(30)
            }
        );
        assert_eq!(rule.before, Duration::from_secs(60));
        assert_eq!(rule.after, Duration::ZERO);
        assert_eq!(rule.max_per_hour, 2);
        assert_eq!(
            parse("name=e; when=ecc changes").unwrap().condition,
            Condition::CounterChanges {
                counter: nvml::ECC_ERRORS.into()
            }
        );
        assert_eq!(
            parse("name=c; when=counter Power (W) changes")
                .unwrap()
                .condition,
            Condition::CounterChanges {
                counter: "Power (W)".into()
            }
        );
        assert_eq!(
            parse("name=n; when=span step_* > 2.5x median(10)")
                .unwrap()
                .condition,
            Condition::SlowSpan {
                name: SpanName::StartingWith("step_".into()),
                factor: 2.5,
                steps: 10
            }
        );
        assert_eq!(
            parse("name=n; when=span optimizer step > 3x median(5)")
                .unwrap()
                .condition,
            Condition::SlowSpan {
                name: SpanName::Exactly("optimizer step".into()),
                factor: 3.0,
                steps: 5
            }
        );
        assert_eq!(
            parse("name=d; when=dropped").unwrap().condition,
            Condition::Dropped
        );
        assert_eq!(
            parse("when=explicit;name=w").unwrap().condition,
            Condition::Explicit
        );
    }

    #[test]
    fn xid_is_a_condition_of_its_own_and_takes_no_arguments() {
        for text in ["name=x; when=xid", "name=x; when= xid changes ; after=0"] {
            assert_eq!(parse(text).unwrap().condition, Condition::Xid, "{text}");
        }
        assert_eq!(parse("name=x; when=xid 79").unwrap_err().part, "xid 79");
        assert_eq!(parse("name=x; when=xids").unwrap_err().part, "xids");
        assert!(parse("name=x; when=gpu melts")
            .unwrap_err()
            .reason
            .contains("xid"));
    }

    #[test]
    fn a_bad_rule_names_the_bad_part() {
        let part = |text: &str| parse(text).unwrap_err().part;
        assert_eq!(part("name=x; when=step > 3 median(20)"), "3");
        assert_eq!(part("name=x; when=step > 3x median(0)"), "median(0)");
        assert_eq!(part("name=x; when=utilization < 120% for 1s"), "120%");
        assert_eq!(part("name=x; when=utilization < 20% for soon"), "soon");
        assert_eq!(part("name=x; when=gpu melts"), "gpu melts");
        assert_eq!(part("name=x; when=span * > 3x median(5)"), "*");
        assert_eq!(part("name=x; when=span a*b* > 3x median(5)"), "a*b*");
        assert_eq!(part("name=x; when=span fwd > 0.5x median(5)"), "0.5x");
        assert_eq!(
            part("name=x; when=dropped; before=2 weeks"),
            "before=2 weeks"
        );
        assert_eq!(part("name=x; when=dropped; before=2h"), "before=2h");
        assert_eq!(
            part("name=x; when=dropped; max-per-hour=0"),
            "max-per-hour=0"
        );
        assert_eq!(part("name=x; when=dropped; colour=red"), "colour=red");
        assert_eq!(part("name=x; when=dropped; name=y"), "name=y");
        assert_eq!(part("name=../x; when=dropped"), "name=../x");
        assert_eq!(part("name=x; when=dropped; after"), "after");
        assert!(parse("when=dropped").unwrap_err().reason.contains("name"));
        assert!(parse("name=x").unwrap_err().reason.contains("when"));
        assert!(parse("name=x; when=dropped; before=0; after=0").is_err());
    }
}
