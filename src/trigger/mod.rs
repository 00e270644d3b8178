//! Triggers: rules that save the flight recorder's past when something goes
//! wrong, as a session like any capture's.
//!
//! As each chunk reaches the flight recorder, the collector picks out the
//! few events the rules look at ([`watch::Filter`]: counter samples, step
//! markers, named spans) and hands them to the rules' thread over a bounded
//! queue (a full queue drops the batch and counts it, never waits); that
//! thread evaluates them ([`watch`]) and, every [`LOOK_EVERY`], compares the
//! agent's drop totals. An
//! explicit firing comes from the `devtrace.Trigger` service. Every firing
//! passes its rule's cool-down and hourly cap ([`limit`]) and is then saved
//! by a task of its own: it waits until `fire + after` has passed and the
//! events have arrived, builds `[fire - before, fire + after]` from the
//! flight recorder like a capture of the past, and writes
//! `<repository>/<timestamp>_<rule>/<host>.xplane.pb` with the rule, the
//! value and the time in the trace's Task Environment. Nothing a capture
//! waits on is held meanwhile.

pub mod limit;
pub mod rule;
pub mod watch;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, TrySendError};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{debug, info, warn};

use crate::agent::Agent;
use crate::capture::Captures;
use crate::clock;
use crate::model::calendar::{session_timestamp_at, utc_text};
use crate::recorder::Window;
use crate::repository::Folder;
use limit::{Held, Limit};
use rule::{Condition, Rule};
use watch::{Firing, Watcher};

/// How often the watcher looks at new events and drop totals.
pub const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Longest reason an explicit firing may give.
pub const MAX_REASON: usize = 1024;

/// A firing that was refused.
#[derive(Debug, thiserror::Error)]
pub enum FireError {
    #[error("no trigger rule is named {name:?} (this agent's rules: {known})")]
    NotFound { name: String, known: String },
    #[error("trigger {name:?} did not fire: {held}")]
    Held { name: String, held: Held },
}

/// A firing that was accepted: when it fired, and when its trace is due.
#[derive(Clone, Debug)]
pub struct Fired {
    pub at_ns: u64,
    pub window: Window,
    /// Where the session is saved.
    pub repository: String,
}

/// How often one rule fired, was held back, and saved (the counts
/// telemetry reports).
pub use crate::telemetry::RuleCounts as Counts;

struct Armed {
    rule: Rule,
    limit: Mutex<Limit>,
    counts: Counts,
}

/// A save set off and not yet done: its rule, when it fired, its task,
/// and the session it took once it has.
struct Pending {
    rule: usize,
    at_ns: u64,
    task: tokio::task::JoinHandle<()>,
    session: Arc<Mutex<Option<Taken>>>,
}

/// A session a save took as its firing came, before its window ended: one
/// the agent is killed before it fills is found empty at the next start,
/// and the firing counted as lost rather than forgotten.
struct Taken {
    /// `None`: the session could not be made (its trace goes to the
    /// unsent directory), but the firing still counts once.
    folder: Option<Folder>,
    name: String,
}

/// See the module documentation.
pub struct Triggers {
    rules: Vec<Armed>,
    captures: Arc<Captures>,
    repository: Folder,
    runtime: tokio::runtime::Handle,
    pending: Mutex<Vec<Pending>>,
    /// Where a save that cannot be written is kept (`--unsent-dir`).
    unsent_dir: std::path::PathBuf,
    /// Events picked for the rules that the rules' thread fell too far
    /// behind to take.
    unevaluated: AtomicU64,
    /// How long a session must have held nothing before a sweep takes it
    /// for a save an agent was killed during: longer than a save of the
    /// longest rule takes, so that the saves in progress of another agent
    /// sharing the repository (with the same rules) are left alone.
    empty_after: Duration,
}

/// What a save takes past its rule's `after`: waiting for capture memory
/// (up to a minute), building and writing, with room to spare.
const SAVE_SLACK: Duration = Duration::from_secs(120);

impl Triggers {
    /// Arms `rules`, saving into `repository` through `captures`, and starts
    /// the watcher (it ends when the returned value is dropped). Must be
    /// called within the Tokio runtime that saves run on.
    pub fn start(
        rules: Vec<Rule>,
        agent: &Arc<Agent>,
        captures: Arc<Captures>,
        repository: Folder,
        unsent_dir: std::path::PathBuf,
    ) -> std::io::Result<Arc<Triggers>> {
        let watcher = Watcher::new(&rules, agent.registry());
        let longest_after = rules
            .iter()
            .map(|rule| rule.after)
            .max()
            .unwrap_or_default();
        let empty_after = crate::repository::ABANDONED_AFTER.max(longest_after + SAVE_SLACK);
        let dropped_rules: Vec<usize> = rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.condition == Condition::Dropped)
            .map(|(index, _)| index)
            .collect();
        let triggers = Arc::new(Triggers {
            rules: rules
                .into_iter()
                .map(|rule| Armed {
                    limit: Mutex::new(Limit::new(rule.cooldown, rule.max_per_hour)),
                    rule,
                    counts: Counts::default(),
                })
                .collect(),
            captures,
            unsent_dir,
            // A saved window holds the whole host: not for other users.
            repository: repository
                .kept_from_others()
                .map_err(std::io::Error::other)?,
            runtime: tokio::runtime::Handle::current(),
            pending: Mutex::new(Vec::new()),
            unevaluated: AtomicU64::new(0),
            empty_after,
        });
        // Before the agent serves, on a thread outside the async runtime (a
        // bucket is asked through a runtime of its own, which cannot be
        // entered from within another).
        std::thread::scope(|scope| {
            scope.spawn(|| triggers.clear_abandoned_saves());
        });
        // What a save killed just before this start left is not old enough
        // yet to be told from one in progress: look again once it is.
        let later = Arc::downgrade(&triggers);
        let again_after = triggers.empty_after + Duration::from_secs(5);
        triggers.runtime.spawn(async move {
            tokio::time::sleep(again_after).await;
            if let Some(triggers) = later.upgrade() {
                let _ = tokio::task::spawn_blocking(move || triggers.clear_abandoned_saves()).await;
            }
        });
        let arrivals = if watcher.is_idle() {
            None
        } else {
            Some(tap_arrivals(agent, &watcher, &triggers)?)
        };
        if arrivals.is_some() || !dropped_rules.is_empty() {
            let weak = Arc::downgrade(&triggers);
            let agent = Arc::clone(agent);
            std::thread::Builder::new()
                .name("devtrace-trigger".into())
                .spawn(move || watch_loop(weak, &agent, watcher, arrivals, dropped_rules))?;
        }
        Ok(triggers)
    }

    /// Fires rule `name` now, as `devtrace trigger NAME` asks, with the
    /// caller's `reason` as the value.
    pub fn fire(self: &Arc<Self>, name: &str, reason: &str) -> Result<Fired, FireError> {
        let Some(index) = self.rules.iter().position(|armed| armed.rule.name == name) else {
            let known: Vec<&str> = self.rules.iter().map(|a| a.rule.name.as_str()).collect();
            return Err(FireError::NotFound {
                name: name.to_string(),
                known: known.join(", "),
            });
        };
        let value = if reason.is_empty() {
            "fired explicitly".to_string()
        } else {
            format!("fired explicitly: {reason}")
        };
        let firing = Firing {
            rule: index,
            at_ns: clock::now_ns(),
            value,
        };
        self.offer(firing).map_err(|held| FireError::Held {
            name: name.to_string(),
            held,
        })
    }

    /// Why a save cannot land in the repository, when that can be told
    /// without writing (a read-only mount, a directory the agent's user may
    /// not write; a bucket is not asked). It looks at the file system:
    /// call it off the async runtime.
    pub fn unwritable_repository(&self) -> Option<String> {
        let Folder::Local(local) = &self.repository else {
            return None;
        };
        let path = local.path();
        let (existing, writable) = crate::model::filesystem::writable_part(&path);
        (!writable).then(|| {
            format!(
                "{} is not writable by the agent's user: the save will fail, and its trace be \
                 kept under {}",
                existing.display(),
                self.unsent_dir.display()
            )
        })
    }

    /// Each rule's name and counts.
    pub fn counts(&self) -> impl Iterator<Item = (&str, &Counts)> {
        self.rules
            .iter()
            .map(|armed| (armed.rule.name.as_str(), &armed.counts))
    }

    /// One line per rule with its counts, as Monitor shows them.
    pub fn summary(&self) -> String {
        self.summary_text()
    }

    fn summary_text(&self) -> String {
        let unevaluated = self.unevaluated.load(Ordering::Relaxed);
        let behind = (unevaluated > 0).then(|| {
            format!(
                "triggers: {unevaluated} events arrived faster than the rules could look at them\n"
            )
        });
        self.counts()
            .map(|(name, counts)| {
                let load = |value: &AtomicU64| value.load(Ordering::Relaxed);
                format!(
                    "trigger {name}: fired {}, held back {} (cooldown) and {} (max-per-hour), \
                     saved {}, failed {}, lost {} (an earlier agent killed while saving)\n",
                    load(&counts.fired),
                    load(&counts.held_cooldown),
                    load(&counts.held_hourly_cap),
                    load(&counts.saved),
                    load(&counts.failed),
                    load(&counts.lost)
                )
            })
            .chain(behind)
            .collect()
    }

    /// Passes a firing through its rule's limits and, if they let it, sets
    /// off its save.
    fn offer(self: &Arc<Self>, firing: Firing) -> Result<Fired, Held> {
        let armed = &self.rules[firing.rule];
        let admitted = armed.limit.lock().admit(firing.at_ns);
        if let Err(held) = admitted {
            let counter = match held {
                Held::CoolingDown { .. } => &armed.counts.held_cooldown,
                Held::HourlyCap { .. } => &armed.counts.held_hourly_cap,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            debug!(rule = %armed.rule.name, value = %firing.value, %held, "trigger held back");
            return Err(held);
        }
        armed.counts.fired.fetch_add(1, Ordering::Relaxed);
        let rule = &armed.rule;
        let window = Window {
            start_ns: firing.at_ns.saturating_sub(clock::duration_ns(rule.before)),
            // Closed at fire + after: the event that fired is in.
            stop_ns: firing
                .at_ns
                .saturating_add(clock::duration_ns(rule.after))
                .saturating_add(1),
        };
        let (rule, at_ns) = (firing.rule, firing.at_ns);
        let triggers = Arc::clone(self);
        let session = Arc::new(Mutex::new(None));
        let taken = Arc::clone(&session);
        // Held while the task is set off, so that a save that is quick to
        // end is not looked for before it is listed.
        let mut pending = self.pending.lock();
        let task = self
            .runtime
            .spawn(async move { triggers.save(firing, window, taken).await });
        pending.retain(|save| !save.task.is_finished());
        pending.push(Pending {
            rule,
            at_ns,
            task,
            session,
        });
        Ok(Fired {
            at_ns,
            window,
            repository: self.repository.display(),
        })
    }

    /// How many firings are being saved now (waiting for their `after`, or
    /// writing).
    pub fn saves_in_progress(&self) -> usize {
        self.pending
            .lock()
            .iter()
            .filter(|save| !save.task.is_finished())
            .count()
    }

    /// At shutdown: lets the saves in progress finish by `deadline`, and
    /// names those that cannot, so that no firing is lost unsaid.
    pub async fn finish(&self, deadline: tokio::time::Instant) {
        let pending = std::mem::take(&mut *self.pending.lock());
        // The looks at what landed share one short grace past the deadline.
        let looked_by = deadline + Duration::from_secs(2);
        for save in pending {
            let mut task = save.task;
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
                // A save that took its session back has finished its write
                // and counted itself, whichever way it went.
                let Some(taken) = save.session.lock().take() else {
                    continue;
                };
                // Its write, on the blocking pool, may have landed as the
                // grace ran out: a trace in the session is saved. (A bucket
                // that stalls is not waited on for long.)
                let landed = match taken.folder.clone() {
                    Some(folder) => {
                        let look = tokio::task::spawn_blocking(move || {
                            crate::fleet::session_traces(&folder)
                                .is_ok_and(|traces| !traces.is_empty())
                        });
                        tokio::time::timeout_at(looked_by, look)
                            .await
                            .is_ok_and(|looked| looked.unwrap_or(false))
                    }
                    None => false,
                };
                let counts = &self.rules[save.rule].counts;
                if landed {
                    counts.saved.fetch_add(1, Ordering::Relaxed);
                    info!(
                        rule = %self.rules[save.rule].rule.name,
                        session = %taken.name,
                        "trigger fired; its window was saved as the agent stopped"
                    );
                    continue;
                }
                // Counted as failed here, not as lost at the next start.
                // A bucket that stalled the look stalls this too.
                let releasing = tokio::task::spawn_blocking(move || release(&taken));
                let _ = tokio::time::timeout_at(looked_by, releasing).await;
                counts.failed.fetch_add(1, Ordering::Relaxed);
                warn!(
                    rule = %self.rules[save.rule].rule.name,
                    fired_at = %utc_text(save.at_ns),
                    "trigger fired but the agent stopped before its window could be saved"
                );
            }
        }
    }

    /// Clears what saves an earlier agent was killed in the middle of left
    /// in the repository (unfinished files; sessions with nothing in them),
    /// counting each lost save against its rule and saying so in the log:
    /// a firing that was never saved is reported, not forgotten.
    fn clear_abandoned_saves(&self) {
        let in_use: Vec<String> = self
            .pending
            .lock()
            .iter()
            .filter_map(|save| Some(save.session.lock().as_ref()?.name.clone()))
            .collect();
        // Only sessions named as saves name theirs are looked at: an empty
        // directory of another maker is not a lost firing.
        let leave = |session: &str| {
            in_use.iter().any(|name| name == session) || rule_of_session(session).is_none()
        };
        let abandoned = match self
            .repository
            .remove_abandoned(Some(self.empty_after), &leave)
        {
            Ok(abandoned) => abandoned,
            // A repository not made yet holds nothing an earlier agent left.
            Err(crate::repository::StorageError::NotFound { .. }) => return,
            Err(error) => {
                warn!(%error, "could not look for saves an earlier agent left unfinished");
                return;
            }
        };
        if !abandoned.unfinished_files.is_empty() {
            info!(
                files = ?abandoned.unfinished_files,
                "removed unfinished trace files an earlier agent left in the trigger repository"
            );
        }
        for session in &abandoned.empty_sessions {
            let rule = rule_of_session(session).and_then(|names| {
                names
                    .into_iter()
                    .find_map(|name| self.rules.iter().find(|armed| armed.rule.name == name))
            });
            if let Some(armed) = rule {
                armed.counts.lost.fetch_add(1, Ordering::Relaxed);
            }
            warn!(
                %session,
                rule = rule.map_or("(no longer armed)", |armed| armed.rule.name.as_str()),
                "a trigger firing was not saved: an earlier agent was stopped while saving it; \
                 its empty session was removed"
            );
        }
    }

    async fn save(&self, firing: Firing, window: Window, taken: Arc<Mutex<Option<Taken>>>) {
        let armed = &self.rules[firing.rule];
        let rule = &armed.rule;
        let fail = |error: &dyn std::fmt::Display| {
            armed.counts.failed.fetch_add(1, Ordering::Relaxed);
            warn!(
                rule = %rule.name,
                value = %firing.value,
                %error,
                "trigger fired but its trace could not be saved"
            );
        };
        let base = base_name(&firing, rule);
        // Taken from the start, so that a stop while the session is being
        // made (a stalled bucket) counts and names this firing too.
        *taken.lock() = Some(Taken {
            folder: None,
            name: base.clone(),
        });
        let repository = self.repository.clone();
        let made =
            tokio::task::spawn_blocking(move || repository.create_session(&base, true)).await;
        // A session that cannot be made still has its window saved: kept
        // under the unsent directory, named as the session would have been.
        let (session, destination) = match made {
            Ok(Ok((folder, name))) => (name, Ok(folder)),
            Ok(Err(error)) => (base_name(&firing, rule), Err(error.to_string())),
            Err(error) => (base_name(&firing, rule), Err(error.to_string())),
        };
        let counted_by_stop = {
            let mut taken = taken.lock();
            match taken.as_mut() {
                Some(taken) => {
                    taken.folder = destination.clone().ok();
                    taken.name = session.clone();
                    false
                }
                None => true,
            }
        };
        if counted_by_stop {
            // A stopping agent counted this firing while its session was
            // being made: the session it made goes back.
            let unfilled = Taken {
                folder: destination.ok(),
                name: session,
            };
            let _ = tokio::task::spawn_blocking(move || release(&unfilled)).await;
            return;
        }
        let properties = vec![
            ("trigger.name".to_string(), rule.name.clone()),
            ("trigger.rule".to_string(), rule.text.clone()),
            ("trigger.value".to_string(), firing.value.clone()),
            ("trigger.fired_at_ns".to_string(), firing.at_ns.to_string()),
            ("trigger.fired_at".to_string(), utc_text(firing.at_ns)),
        ];
        let saved = self
            .captures
            .save_window(
                window,
                &session,
                properties,
                destination.clone().map(|_| self.repository.clone()),
                &self.unsent_dir,
            )
            .await;
        let taken = taken.lock().take();
        // Taken by a stopping agent's `finish`, which counts this save.
        if taken.is_none() {
            return;
        }
        match saved {
            Ok(path) => {
                armed.counts.saved.fetch_add(1, Ordering::Relaxed);
                info!(
                    rule = %rule.name,
                    value = %firing.value,
                    fired_at = %utc_text(firing.at_ns),
                    %path,
                    "trigger fired; the flight recorder's window around it is saved"
                );
            }
            Err(error) => {
                fail(&error);
                if let Some(taken) = taken {
                    let _ = tokio::task::spawn_blocking(move || release(&taken)).await;
                }
            }
        }
    }
}

/// The name of a firing's session before a suffix makes it free:
/// `<YYYY_MM_DD_HH_MM_SS>_<rule>`.
fn base_name(firing: &Firing, rule: &Rule) -> String {
    format!("{}_{}", session_timestamp_at(firing.at_ns), rule.name)
}

/// Gives back the session a save took and did not fill.
fn release(taken: &Taken) {
    let Some(folder) = &taken.folder else {
        return;
    };
    if let Err(error) = folder.release_session() {
        warn!(session = %taken.name, %error, "could not give back an unsaved firing's session");
    }
}

/// The rule a save's session is named after (`<YYYY_MM_DD_HH_MM_SS>_<rule>`,
/// `_2`, `_3`, ... appended when taken): the name as it stands, then
/// without such a suffix, the likelier first. `None` for a name of
/// another shape: not a save's.
fn rule_of_session(session: &str) -> Option<Vec<&str>> {
    const TIMESTAMP: &[u8] = b"dddd_dd_dd_dd_dd_dd_";
    let stamped = session.len() > TIMESTAMP.len()
        && TIMESTAMP
            .iter()
            .zip(session.as_bytes())
            .all(|(shape, byte)| match shape {
                b'd' => byte.is_ascii_digit(),
                other => byte == other,
            });
    let named = session.get(TIMESTAMP.len()..).filter(|_| stamped)?;
    let mut names = vec![named];
    if let Some((rule, n)) = named.rsplit_once('_') {
        if !rule.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
            names.push(rule);
        }
    }
    Some(names)
}

/// Batches of picked events waiting for the rules' thread, at most: past
/// them the collector drops what it picked rather than wait, counting it.
const WAITING_BATCHES: usize = 256;

/// Has the collector pick what the rules look at out of every chunk that
/// reaches the flight recorder ([`watch::Filter`]) and hand it to the
/// rules' thread.
fn tap_arrivals(
    agent: &Agent,
    watcher: &Watcher,
    triggers: &Arc<Triggers>,
) -> std::io::Result<Receiver<Vec<crate::event::Event>>> {
    let filter = watcher.filter(agent.registry());
    let (sender, receiver) = sync_channel(WAITING_BATCHES);
    let weak = Arc::downgrade(triggers);
    let tapped = agent.tap_arrivals(Box::new(move |events| {
        let mut wanted = Vec::new();
        filter.pick(events, &mut wanted);
        if wanted.is_empty() {
            return;
        }
        let picked = wanted.len() as u64;
        if let Err(TrySendError::Full(_)) = sender.try_send(wanted) {
            if let Some(triggers) = weak.upgrade() {
                triggers.unevaluated.fetch_add(picked, Ordering::Relaxed);
            }
        }
    }));
    if !tapped {
        return Err(std::io::Error::other(
            "the agent's arrivals are watched already",
        ));
    }
    Ok(receiver)
}

/// The watcher thread: new events to the watching rules, drop totals to
/// the `dropped` rules (`dropped_rules`, by index), until the triggers are
/// dropped.
fn watch_loop(
    triggers: Weak<Triggers>,
    agent: &Agent,
    mut watcher: Watcher,
    arrivals: Option<Receiver<Vec<crate::event::Event>>>,
    dropped_rules: Vec<usize>,
) {
    let mut dropped = agent.dropped_total();
    let mut unevaluated = 0;
    let mut fired = Vec::new();
    let mut next_look = std::time::Instant::now() + LOOK_EVERY;
    loop {
        let wait = next_look.saturating_duration_since(std::time::Instant::now());
        let batch = match &arrivals {
            Some(arrivals) => match arrivals.recv_timeout(wait) {
                Ok(batch) => Some(batch),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            },
            None => {
                std::thread::sleep(wait);
                None
            }
        };
        let Some(triggers) = triggers.upgrade() else {
            return;
        };
        for event in batch.iter().flatten() {
            watcher.observe(event, &mut fired);
        }
        if std::time::Instant::now() >= next_look {
            next_look = std::time::Instant::now() + LOOK_EVERY;
            if !dropped_rules.is_empty() {
                let total = agent.dropped_total();
                if total > dropped {
                    let at_ns = clock::now_ns();
                    let value = format!(
                        "{} events dropped ({total} since the agent started)",
                        total - dropped
                    );
                    fired.extend(dropped_rules.iter().map(|&rule| Firing {
                        rule,
                        at_ns,
                        value: value.clone(),
                    }));
                }
                dropped = total;
            }
            let behind = triggers.unevaluated.load(Ordering::Relaxed);
            if behind > unevaluated {
                warn!(
                    events = behind - unevaluated,
                    "trigger rules fell behind the events arriving; these were not evaluated"
                );
                unevaluated = behind;
            }
        }
        for firing in fired.drain(..) {
            // Held firings are counted and logged where they are held.
            let _ = triggers.offer(firing);
        }
    }
}

impl crate::telemetry::ArmedRules for Triggers {
    fn each_rule(&self, each: &mut dyn FnMut(&str, &Counts)) {
        for (name, counts) in self.counts() {
            each(name, counts);
        }
    }

    fn summary(&self) -> String {
        self.summary_text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sessions_named_as_saves_are_saves() {
        assert!(rule_of_session("2026_01_01_00_00_00_soon").is_some());
        assert!(rule_of_session("2026_01_01_00_00_00_soon_2").is_some());
        for other in [
            "myempty",
            "2026_01_01_00_00_00_",
            "2026_01_01_00_00_0x_soon",
            "",
        ] {
            assert!(rule_of_session(other).is_none(), "{other}");
        }
    }

    #[test]
    fn a_saves_session_names_its_rule_with_or_without_a_suffix() {
        assert_eq!(
            rule_of_session("2026_01_01_00_00_00_gpu_2"),
            Some(vec!["gpu_2", "gpu"])
        );
        assert_eq!(
            rule_of_session("2026_01_01_00_00_00_slow"),
            Some(vec!["slow"])
        );
        assert_eq!(
            rule_of_session("2026_01_01_00_00_00_slow_x"),
            Some(vec!["slow_x"])
        );
        assert_eq!(rule_of_session("2026_01_01_00_00_00_"), None);
        assert_eq!(rule_of_session("short"), None);
    }
}
