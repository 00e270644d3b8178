//! Triggers against the real binary: each kind of rule fires at the moment
//! its condition is met (the mock's slow step and utilisation dip, an ECC
//! error and an XID error from the NVML stand-in, drops in a tiny ring, an explicit
//! `devtrace trigger`) exactly once, the saved
//! session holds the flight recorder's events from before the firing with
//! the rule, value and time in its Task Environment, cool-down and hourly
//! cap hold and are counted in Monitor and the metrics, and a bad rule is
//! refused naming its bad part.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::xspace::read::{event_name, event_start_ps, find_stat, read_xspace, StatValue};
use tonic::Code;

/// Longest wait for a trigger's session; the conditions are met within a
/// few seconds of the agent's start.
const PATIENCE: Duration = Duration::from_secs(60);

use devtrace::backend::nvml::{ECC_ERRORS, SM_UTILIZATION};

/// An agent on the mock with `rules`, saving into `<dir>/plugins/profile`.
struct Armed {
    agent: AgentProcess,
    _dir: tempfile::TempDir,
    logdir: PathBuf,
    repository: PathBuf,
}

fn armed(rules: &[&str], extra: &[&str]) -> Armed {
    armed_with_env(rules, extra, &[])
}

fn armed_with_env(rules: &[&str], extra: &[&str], env: &[(&str, &Path)]) -> Armed {
    armed_in(tempfile::tempdir().unwrap(), rules, extra, env)
}

/// As [`armed_with_env`], in `dir` (which a test may have put things in).
fn armed_in(
    dir: tempfile::TempDir,
    rules: &[&str],
    extra: &[&str],
    env: &[(&str, &Path)],
) -> Armed {
    let logdir = dir.path().to_path_buf();
    let repository = logdir.join("plugins").join("profile");
    let (root, repo) = (path_text(&logdir), path_text(&repository));
    let mut args = vec![
        "--mock-rate",
        "20000",
        "--allow-root",
        &root,
        "--trigger-repository",
        &repo,
    ];
    for rule in rules {
        args.extend(["--trigger", rule]);
    }
    args.extend_from_slice(extra);
    Armed {
        agent: AgentProcess::start_with_env(&args, env),
        _dir: dir,
        logdir,
        repository,
    }
}

fn path_text(path: &Path) -> String {
    path.to_str().unwrap().to_string()
}

/// The trace files of the sessions in `repository`, by session name.
fn sessions(repository: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(repository) else {
        return Vec::new();
    };
    let mut found: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|session| {
            let trace = std::fs::read_dir(session.path())
                .ok()?
                .filter_map(Result::ok)
                .map(|f| f.path())
                .find(|p| p.to_string_lossy().ends_with(".xplane.pb"))?;
            Some((session.file_name().to_string_lossy().into_owned(), trace))
        })
        .collect();
    found.sort();
    found
}

/// Waits until `repository` holds `count` sessions; panics past PATIENCE.
pub(crate) fn wait_for_sessions(repository: &Path, count: usize) -> Vec<(String, PathBuf)> {
    let started = Instant::now();
    loop {
        let found = sessions(repository);
        if found.len() >= count {
            return found;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "{} of {count} trigger sessions after {PATIENCE:?}",
            found.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Monitor's line for `rule`.
async fn counts_line(agent: &AgentProcess, rule: &str) -> String {
    let text = agent.monitor(50).await.data;
    let prefix = format!("trigger {rule}: ");
    text.lines()
        .find(|line| line.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in Monitor:\n{text}"))
        .to_string()
}

/// The number after `what` in a counts line ("fired 1, ...").
fn count_of(line: &str, what: &str) -> u64 {
    let at = line
        .find(what)
        .unwrap_or_else(|| panic!("{what:?} in {line:?}"))
        + what.len();
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count after {what:?} in {line:?}"))
}

/// Waits until Monitor shows `rule` held back (by cool-down) at least
/// `held` times.
async fn wait_until_held(agent: &AgentProcess, rule: &str, held: u64) -> String {
    let started = Instant::now();
    loop {
        let line = counts_line(agent, rule).await;
        if count_of(&line, "held back ") >= held {
            return line;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "never held back {held}: {line}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `rule` was held back `held` times, then checks that it
/// fired once and saved one session.
async fn assert_fired_once_then_held(armed: &Armed, rule: &str, held: u64) {
    let line = wait_until_held(&armed.agent, rule, held).await;
    assert_eq!(count_of(&line, "fired "), 1, "{line}");
    assert_eq!(sessions(&armed.repository).len(), 1);
}

/// A saved trace and what its Task Environment says about the trigger.
struct Saved {
    space: XSpace,
    fired_at_ns: u64,
    rule: String,
    value: String,
}

fn saved(path: &Path) -> Saved {
    // A saved window holds the whole host: kept from other users.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).unwrap().permissions().mode();
    assert_eq!(mode & 0o007, 0, "{} is mode {mode:o}", path.display());
    let space = read_xspace(path).expect("reading the saved trace");
    let env = plane(&space, "Task Environment");
    let text = |name: &str| match find_stat(env, &env.stats, name) {
        Some(StatValue::Str(text)) => text,
        other => panic!("{name}: {other:?}"),
    };
    let fired_at_ns = text("trigger.fired_at_ns").parse().expect("a time");
    assert!(text("trigger.fired_at").ends_with('Z'));
    let (rule, value) = (text("trigger.rule"), text("trigger.value"));
    Saved {
        space,
        fired_at_ns,
        rule,
        value,
    }
}

/// Waits for the first session and reads its trace.
fn first_saved(repository: &Path) -> Saved {
    let found = wait_for_sessions(repository, 1);
    saved(&found[0].1)
}

/// Every event of `plane_name` named `name`: (start, end) Unix ns and its
/// `value` stat when it has one.
fn timed(space: &XSpace, plane_name: &str, name: &str) -> Vec<(u64, u64, Option<f64>)> {
    let (start, _) = window_of(space);
    let plane = plane(space, plane_name);
    plane
        .lines
        .iter()
        .flat_map(|line| line.events.iter().map(move |event| (line, event)))
        .filter(|(_, event)| event_name(plane, event) == name)
        .map(|(line, event)| {
            let begin = start + (event_start_ps(line.timestamp_ns, event) / 1000) as u64;
            let value = match find_stat(plane, &event.stats, "value") {
                Some(StatValue::Double(v)) => Some(v),
                _ => None,
            };
            (begin, begin + (event.duration_ps / 1000) as u64, value)
        })
        .collect()
}

/// The saved window is `[fire - before, fire + after]`.
fn assert_window(saved: &Saved, before: Duration, after: Duration) {
    let fired = saved.fired_at_ns;
    let (start, stop) = window_of(&saved.space);
    assert_eq!(start, fired - before.as_nanos() as u64);
    assert_eq!(stop, fired + after.as_nanos() as u64 + 1);
}

/// Steps in the first half of the window's part before the firing: the
/// trace holds the past, not only what followed the firing.
fn assert_steps_long_before(saved: &Saved) {
    let (start, _) = window_of(&saved.space);
    let halfway = start + (saved.fired_at_ns - start) / 2;
    let early = timed(&saved.space, "/host:CPU", "train")
        .iter()
        .filter(|(begin, _, _)| (start..halfway).contains(begin))
        .count();
    assert!(
        early > 0,
        "no step in the first half of the window before the firing"
    );
}

/// The mock's steps in a saved trace, and the start of the one slow step,
/// at whose end the firing must be.
fn assert_fired_at_the_one_slow_step(saved: &Saved) -> (Vec<(u64, u64, Option<f64>)>, u64) {
    let steps = timed(&saved.space, "/host:CPU", "train");
    let longest = steps.iter().map(|(b, e, _)| e - b).max().unwrap();
    let slow: Vec<_> = steps.iter().filter(|(b, e, _)| e - b == longest).collect();
    assert_eq!(slow.len(), 1, "{steps:?}");
    assert_eq!(slow[0].1, saved.fired_at_ns, "fires at the slow step's end");
    let start = slow[0].0;
    (steps, start)
}

#[tokio::test]
async fn a_slow_step_fires_once_at_its_end_and_the_trace_holds_the_steps_before() {
    let rule = "name=slow-step; when=step > 3x median(10); before=2s; after=300ms";
    let armed = armed(&[rule], &["--mock-slow-step", "2s"]);
    let found = wait_for_sessions(&armed.repository, 1);
    let (session, trace) = &found[0];
    assert!(session.ends_with("_slow-step"), "{session}");
    let saved = saved(trace);
    assert_eq!(saved.rule, rule);
    assert!(saved.value.starts_with("step "), "{}", saved.value);
    assert_window(&saved, Duration::from_secs(2), Duration::from_millis(300));
    assert_steps_long_before(&saved);
    let (steps, slow_start) = assert_fired_at_the_one_slow_step(&saved);
    assert!(steps.iter().filter(|(_, e, _)| *e < slow_start).count() >= 10);

    let line = counts_line(&armed.agent, "slow-step").await;
    assert_eq!(count_of(&line, "fired "), 1, "{line}");
    assert_eq!(sessions(&armed.repository).len(), 1);
    // Listed like any other session.
    let listed = devtrace(args(&["sessions", &path_text(&armed.logdir)])).await;
    assert!(
        text(&listed.stdout).contains(session.as_str()),
        "{}",
        text(&listed.stdout)
    );
}

#[tokio::test]
async fn a_slow_span_fires_by_its_name_once_at_its_end() {
    // The mock's steps are spans named `train`; timed here by name, as an
    // injected workload's NVTX ranges are. `tra*` also matches only them.
    let rule =
        "name=slow-span; when=span tra* > 3x median(10); before=2s; after=300ms; cooldown=0s";
    let armed = armed(&[rule], &["--mock-slow-step", "2s"]);
    let saved = first_saved(&armed.repository);
    assert!(
        saved.value.starts_with("span \"train\" took "),
        "{}",
        saved.value
    );
    assert_window(&saved, Duration::from_secs(2), Duration::from_millis(300));
    assert_steps_long_before(&saved);
    assert_fired_at_the_one_slow_step(&saved);
    // No cool-down: a second firing would be counted, not held. Steps
    // after the slow one pass as normal again.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let line = counts_line(&armed.agent, "slow-span").await;
    assert_eq!(count_of(&line, "fired "), 1, "{line}");
}

/// The SM utilisation samples of GPU 0 in a saved trace: (time, value).
fn utilisation(saved: &Saved) -> Vec<(u64, f64)> {
    let mut samples: Vec<(u64, f64)> = timed(&saved.space, "/device:GPU:0", SM_UTILIZATION)
        .into_iter()
        .map(|(at, _, value)| (at, value.expect("a counter value")))
        .collect();
    samples.sort_by_key(|(at, _)| *at);
    samples
}

#[tokio::test]
async fn low_utilisation_fires_once_after_its_duration_and_the_other_gpu_is_held() {
    let rule = "name=idle-gpu; when=utilization < 20% for 400ms; before=1500ms; after=200ms";
    let armed = armed(&[rule], &["--mock-utilization-dip", "2s+1500ms"]);
    let saved = first_saved(&armed.repository);
    assert!(saved.value.contains("below 20%"), "{}", saved.value);
    let samples = utilisation(&saved);
    let first_low = samples
        .iter()
        .find(|(_, v)| *v < 20.0)
        .expect("low samples in the trace")
        .0;
    // Fired by the sample 400 ms into the spell, not before, not later.
    assert_eq!(saved.fired_at_ns - first_low, 400_000_000);
    assert!(
        samples.iter().any(|(at, v)| *at < first_low && *v > 20.0),
        "busy before the dip"
    );
    assert_window(
        &saved,
        Duration::from_millis(1500),
        Duration::from_millis(200),
    );
    assert_steps_long_before(&saved);
    assert!(samples
        .iter()
        .filter(|(at, _)| *at >= first_low)
        .all(|(_, v)| *v < 20.0));
    // Both GPUs dip together: the second firing meets the cool-down.
    assert_fired_once_then_held(&armed, "idle-gpu", 1).await;
}

#[tokio::test]
async fn a_counter_change_fires_once_at_the_change_and_the_cooldown_holds_the_rest() {
    let rule = "name=util-change; when=counter SM utilization (%) changes; before=1s; after=100ms";
    let armed = armed(&[rule], &["--mock-utilization-dip", "2s+1s"]);
    let saved = first_saved(&armed.repository);
    assert!(
        saved.value.contains("changed from 92 to 3"),
        "{}",
        saved.value
    );
    let samples = utilisation(&saved);
    let first_low = samples
        .iter()
        .find(|(_, v)| *v < 20.0)
        .expect("the change")
        .0;
    assert_eq!(saved.fired_at_ns, first_low);
    assert!(samples.iter().filter(|(at, _)| *at < first_low).count() >= 5);
    assert_window(&saved, Duration::from_secs(1), Duration::from_millis(100));
    // Two GPUs change into the dip and two out of it: one firing, three held.
    assert_fired_once_then_held(&armed, "util-change", 3).await;
}

#[tokio::test]
async fn dropped_events_fire_once_and_the_cooldown_holds_the_rest() {
    let rule = "name=lossy; when=dropped; before=1s; after=100ms";
    // A ring of 16 slots a lane cannot hold the mock's bursts.
    let armed = armed(&[rule], &["--ring-capacity", "16"]);
    let saved = first_saved(&armed.repository);
    assert!(saved.value.contains("events dropped"), "{}", saved.value);
    assert_window(&saved, Duration::from_secs(1), Duration::from_millis(100));
    // Drops start with the agent: only what came before the firing is there.
    let steps = timed(&saved.space, "/host:CPU", "train");
    assert!(
        steps.iter().any(|(begin, _, _)| *begin < saved.fired_at_ns),
        "{steps:?}"
    );
    assert_fired_once_then_held(&armed, "lossy", 1).await;
}

/// An agent on the NVML stand-in, sampling every 20 ms, with one rule.
struct OnNvml {
    armed: Armed,
    /// The stand-in's settings file, for the test to script errors.
    control: PathBuf,
    _control_dir: tempfile::TempDir,
}

/// Starts an agent on the NVML stand-in with `settings` and `rule`, and
/// gives it the history a window before a firing holds.
async fn armed_on_nvml(rule: &str, settings: &str) -> OnNvml {
    let library = build_standin("nvml.c", "libnvidia-ml.so.1");
    let control_dir = tempfile::tempdir().unwrap();
    let control = control_dir.path().join("nvml.ctl");
    std::fs::write(&control, settings).unwrap();
    let nvml = [
        "--backend",
        "nvml",
        "--nvml-library",
        library.to_str().unwrap(),
        "--nvml-idle-interval",
        "20ms",
    ];
    let armed = armed_with_env(&[rule], &nvml, &[("DEVTRACE_NVML_STANDIN", &control)]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    OnNvml {
        armed,
        control,
        _control_dir: control_dir,
    }
}

#[tokio::test]
async fn an_ecc_error_through_nvml_fires_once_at_the_sample_that_shows_it() {
    let rule = "name=ecc; when=ecc changes; before=1s; after=100ms";
    let OnNvml {
        armed,
        control,
        _control_dir,
    } = armed_on_nvml(rule, "gpus=1\necc=0\n").await;
    std::fs::write(&control, "gpus=1\necc=2\n").unwrap();
    let saved = first_saved(&armed.repository);
    assert!(
        saved
            .value
            .contains(&format!("{ECC_ERRORS} changed from 0 to 2")),
        "{}",
        saved.value
    );
    assert_window(&saved, Duration::from_secs(1), Duration::from_millis(100));
    let samples = timed(&saved.space, "/device:GPU:0", ECC_ERRORS);
    let first_error = samples
        .iter()
        .filter(|(_, _, value)| *value == Some(2.0))
        .map(|(at, _, _)| *at)
        .min()
        .expect("samples of the error");
    assert_eq!(saved.fired_at_ns, first_error);
    let clean_before = samples
        .iter()
        .filter(|(at, _, value)| *at < first_error && *value == Some(0.0))
        .count();
    assert!(
        clean_before >= 10,
        "{clean_before} clean samples before the error"
    );
    // A second change meets the cool-down.
    std::fs::write(&control, "gpus=1\necc=3\n").unwrap();
    assert_fired_once_then_held(&armed, "ecc", 1).await;
}

#[tokio::test]
async fn an_xid_error_through_nvml_fires_once_and_the_trace_names_it() {
    // No cool-down: a second firing for the same XID would be saved too.
    let rule = "name=xid; when=xid; before=1s; after=100ms; cooldown=0s";
    let OnNvml {
        armed,
        control,
        _control_dir,
    } = armed_on_nvml(rule, "gpus=2\n").await;
    let scripted_at = now_ns();
    std::fs::write(&control, "gpus=2\nxid=79\nxid_gpu=1\n").unwrap();
    let first = first_saved(&armed.repository);
    assert_eq!(
        first.value,
        "GPU 1 XID 79 (1 error since the agent started)"
    );
    assert!(
        first.fired_at_ns >= scripted_at,
        "fired {} ns before the XID was scripted",
        scripted_at - first.fired_at_ns
    );
    assert_window(&first, Duration::from_secs(1), Duration::from_millis(100));
    let instants = timed(&first.space, "/device:GPU:1", "XID 79");
    assert_eq!(instants.len(), 1, "{instants:?}");
    assert_eq!(instants[0].0, first.fired_at_ns, "fires at the XID");
    assert!(timed(&first.space, "/device:GPU:0", "XID 79").is_empty());
    let clean_before = timed(&first.space, "/device:GPU:1", "XID errors")
        .iter()
        .filter(|(at, _, value)| *at < first.fired_at_ns && *value == Some(0.0))
        .count();
    assert!(clean_before >= 10, "{clean_before} samples before the XID");

    // A new XID fires again and is named; the first fired only once.
    std::fs::write(&control, "gpus=2\nxid=31\nxid_gpu=1\n").unwrap();
    let found = wait_for_sessions(&armed.repository, 2);
    let second = saved(&found[1].1);
    assert_eq!(
        second.value,
        "GPU 1 XID 31 (2 errors since the agent started)"
    );
    assert!(second.fired_at_ns > first.fired_at_ns);
    let line = counts_line(&armed.agent, "xid").await;
    assert_eq!(count_of(&line, "fired "), 2, "{line}");
    assert_eq!(sessions(&armed.repository).len(), 2);
}

#[tokio::test]
async fn explicit_firings_save_the_past_within_the_cooldown_and_the_hourly_cap() {
    let watchdog =
        "name=watchdog; when=explicit; before=1s; after=100ms; cooldown=0s; max-per-hour=2";
    let careful = "name=careful; when=explicit; before=1s; after=0s; cooldown=1h";
    let armed = armed(&[watchdog, careful], &[]);
    // Enough history for the window before the first firing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fire_with_reason = |reason: &'static str| {
        devtrace(args(&[
            "trigger",
            "watchdog",
            "--agent",
            &armed.agent.address,
            "--reason",
            reason,
        ]))
    };
    let out = fire_with_reason("loss is NaN").await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("trigger watchdog fired at "));
    armed
        .agent
        .fire_trigger("watchdog")
        .await
        .expect("the second of two an hour");
    let capped = armed.agent.fire_trigger("watchdog").await.unwrap_err();
    assert_eq!(capped.code(), Code::ResourceExhausted);
    assert!(
        capped.message().contains("max-per-hour"),
        "{}",
        capped.message()
    );
    armed
        .agent
        .fire_trigger("careful")
        .await
        .expect("the first");
    let cooling = armed.agent.fire_trigger("careful").await.unwrap_err();
    assert_eq!(cooling.code(), Code::ResourceExhausted);
    assert!(
        cooling.message().contains("cooldown"),
        "{}",
        cooling.message()
    );
    let unknown = armed.agent.fire_trigger("nope").await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    assert!(
        unknown.message().contains("watchdog, careful"),
        "{}",
        unknown.message()
    );
    // Longer than any rule's name can be: refused as such, not looked up.
    let too_long = "n".repeat(devtrace::trigger::rule::MAX_NAME + 1);
    let refused = armed.agent.fire_trigger(&too_long).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let out = devtrace(args(&["trigger", "nope", "--agent", &armed.agent.address])).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no trigger rule is named \"nope\""),
        "{}",
        text(&out.stderr)
    );
    // A reason goes into logs and traces: no line breaks or escapes in it.
    let out = fire_with_reason("bad\nline\x1b[31m").await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("must not contain control characters"),
        "{}",
        text(&out.stderr)
    );
    // A rule saves the whole host: a local user who is no admin, whose own
    // captures hold only their processes, may not fire one.
    if is_root() {
        let out = std::process::Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--",
                BIN,
            ])
            .args(["trigger", "watchdog", "--agent", &armed.agent.address])
            .output()
            .expect("setpriv runs");
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("may not fire a trigger"),
            "{}",
            text(&out.stderr)
        );
    }

    let found = wait_for_sessions(&armed.repository, 3);
    assert_eq!(found.len(), 3, "{found:?}");
    let traces: Vec<Saved> = found.iter().map(|(_, path)| saved(path)).collect();
    let with_reason = traces
        .iter()
        .filter(|s| s.value == "fired explicitly: loss is NaN")
        .count();
    assert_eq!(with_reason, 1);
    for trace in &traces {
        let after = if trace.rule == careful { 0 } else { 100 };
        assert_window(trace, Duration::from_secs(1), Duration::from_millis(after));
        assert_steps_long_before(trace);
    }
    let line = counts_line(&armed.agent, "watchdog").await;
    assert_eq!(count_of(&line, "fired "), 2, "{line}");
    assert_eq!(count_of(&line, "(cooldown) and "), 1, "{line}");
}

#[tokio::test]
async fn a_stopping_agent_saves_the_firings_it_can_and_names_those_it_cannot() {
    let soon = "name=soon; when=explicit; before=1s; after=500ms";
    let late = "name=late; when=explicit; before=1s; after=100s";
    let dir = tempfile::tempdir().unwrap();
    let repository = dir.path().join("plugins").join("profile");
    let log = dir.path().join("agent.log");
    let (root, repo) = (path_text(dir.path()), path_text(&repository));
    let child = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .args(["--metrics-listen", "off", "--log-level", "warn"])
        .args(["--mock-rate", "20000", "--allow-root", &root])
        .args([
            "--trigger-repository",
            &repo,
            "--trigger",
            soon,
            "--trigger",
            late,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("starting devtrace serve");
    let mut agent = AgentProcess::adopt(child);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Fired from other processes: a connection of this test's own would
    // keep the stopping agent waiting for it.
    for rule in ["soon", "late"] {
        let out = devtrace(args(&["trigger", rule, "--agent", &agent.address])).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    // Stopped before either window has ended.
    let status = agent.stop_with_sigterm(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let found = sessions(&repository);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].0.ends_with("_soon"), "{found:?}");
    assert_window(
        &saved(&found[0].1),
        Duration::from_secs(1),
        Duration::from_millis(500),
    );
    let log = std::fs::read_to_string(&log).unwrap();
    let abandoned: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("stopped before its window could be saved"))
        .collect();
    assert_eq!(abandoned.len(), 1, "{log}");
    assert!(abandoned[0].contains("rule=late"), "{log}");
}

/// `devtrace serve --backend mock <extra>`, which must fail at once; its
/// standard error.
fn refused(extra: &[&str]) -> String {
    let out = serve_to_end(&[&["--backend", "mock"], extra].concat());
    assert!(!out.status.success(), "{extra:?} was accepted");
    text(&out.stderr)
}

#[test]
fn a_bad_rule_or_repository_is_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let root = path_text(dir.path());
    let repository = path_text(&dir.path().join("plugins/profile"));
    let stderr = refused(&["--trigger", "name=slow; when=step > 3 median(20)"]);
    assert!(
        stderr.contains("in \"3\": a factor of at least 1"),
        "{stderr}"
    );
    let stderr = refused(&[
        "--trigger",
        "name=slow; when=step > 3x median(20); afterwards=2s",
    ]);
    assert!(
        stderr.contains("in \"afterwards=2s\": unknown key"),
        "{stderr}"
    );
    // A usage error, as other flags that need one another are.
    let alone = serve_to_end(&["--backend", "mock", "--trigger", "name=w; when=explicit"]);
    assert_eq!(alone.status.code(), Some(2));
    let stderr = text(&alone.stderr);
    assert!(
        stderr.contains("required arguments were not provided")
            && stderr.contains("--trigger-repository"),
        "{stderr}"
    );
    let outside = [
        "--trigger",
        "name=w; when=explicit",
        "--trigger-repository",
        "/tmp",
    ];
    let stderr = refused(&[&outside[..], &["--allow-root", &root]].concat());
    assert!(
        stderr.contains("must lie inside an --allow-root"),
        "{stderr}"
    );
    let twice = [
        "--allow-root",
        &root,
        "--trigger-repository",
        &repository,
        "--trigger",
        "name=w; when=explicit",
        "--trigger",
        "name=w; when=dropped",
    ];
    assert!(refused(&twice).contains("another rule is named \"w\""));
    let too_far = [
        "--allow-root",
        &root,
        "--trigger-repository",
        &repository,
        "--trigger",
        "name=w; when=explicit; before=10m",
    ];
    assert!(refused(&too_far).contains("--store-retention"));
    // Each within the 5 s held, both together past what is held when the
    // session is saved, once `after` has passed (the start of `before`
    // was lost from the saved session without a word but the trace's).
    let together = [
        "--allow-root",
        &root,
        "--trigger-repository",
        &repository,
        "--store-retention",
        "5s",
        "--trigger",
        "name=w; when=explicit; before=3s; after=2s",
    ];
    let stderr = refused(&together);
    assert!(
        stderr.contains("before=3s and after=2s reach 5s back when the session is saved")
            && stderr.contains("(--store-retention 5s, less 1.25s for the trace's build)"),
        "{stderr}"
    );
}

#[tokio::test]
async fn firings_and_held_ones_are_counted_in_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let root = path_text(dir.path());
    let repository = path_text(&dir.path().join("plugins/profile"));
    let (agent, metrics) = AgentProcess::start_with_metrics(
        &[
            "--allow-root",
            &root,
            "--trigger-repository",
            &repository,
            "--trigger",
            "name=watchdog; when=explicit; before=200ms; after=0s; cooldown=1h",
        ],
        &[],
    );
    agent
        .fire_trigger("watchdog")
        .await
        .expect("the first firing");
    agent.fire_trigger("watchdog").await.unwrap_err();
    let (status, text) = http_get(&metrics, "/metrics");
    assert_eq!(status, 200);
    for line in [
        "devtrace_trigger_firings_total{rule=\"watchdog\"} 1",
        "devtrace_trigger_suppressed_total{rule=\"watchdog\",reason=\"cooldown\"} 1",
        "devtrace_trigger_suppressed_total{rule=\"watchdog\",reason=\"max_per_hour\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }
}

/// What an agent killed in the middle of a save leaves (its session made,
/// its file unfinished or not begun) is cleared when the next one starts,
/// and each such firing is counted as lost against its rule: never a
/// temporary file or an empty session forever, never a firing forgotten.
#[tokio::test]
async fn saves_an_earlier_agent_was_killed_during_are_cleared_and_counted_lost() {
    let dir = tempfile::tempdir().unwrap();
    let repository = dir.path().join("plugins").join("profile");
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    let age = |path: &Path| {
        std::fs::File::open(path)
            .unwrap()
            .set_modified(an_hour_ago)
            .unwrap()
    };
    // Killed before its file was begun, and while writing it.
    let before_file = repository.join("2026_01_01_00_00_00_soon");
    let while_writing = repository.join("2026_01_01_00_00_01_soon_2");
    for session in [&before_file, &while_writing] {
        std::fs::create_dir_all(session).unwrap();
    }
    let unfinished = while_writing.join(".127.0.0.1_1.xplane.pb.4242.0.tmp");
    std::fs::write(&unfinished, b"half a trace").unwrap();
    age(&unfinished);
    // A finished save of a rule no longer armed, and a session just made.
    let finished = repository.join("2026_01_01_00_00_02_other");
    std::fs::create_dir_all(&finished).unwrap();
    std::fs::write(finished.join("host.xplane.pb"), b"a trace").unwrap();
    let just_made = repository.join("2026_01_01_00_00_03_soon");
    std::fs::create_dir_all(&just_made).unwrap();
    // Not named as a save: someone else's, not a lost firing.
    let others = repository.join("myempty");
    std::fs::create_dir_all(&others).unwrap();
    for session in [&before_file, &while_writing, &finished, &others] {
        age(session);
    }
    let armed = armed_in(
        dir,
        &["name=soon; when=explicit; before=1s; after=500ms"],
        &[],
        &[],
    );
    let line = counts_line(&armed.agent, "soon").await;
    assert_eq!(count_of(&line, "lost "), 2, "{line}");
    assert!(!before_file.exists() && !while_writing.exists());
    assert!(finished.join("host.xplane.pb").exists() && just_made.exists());
    assert!(
        others.exists(),
        "a directory not named as a save was removed"
    );
}

/// A firing acknowledged to its client whose agent is killed before the
/// window's end: the session it took at the firing is found empty by the
/// next agent and the firing counted lost, not forgotten. An agent stopped
/// instead counts it as failed itself and gives the session back.
#[tokio::test]
async fn a_firing_whose_agent_dies_before_its_window_ends_is_never_forgotten() {
    let rule = "name=late; when=explicit; before=1s; after=30s";
    let taken = |repository: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(repository)
            .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let wait_for_session = |repository: &Path| -> PathBuf {
        let started = Instant::now();
        loop {
            if let [session] = taken(repository).as_slice() {
                return session.clone();
            }
            assert!(
                started.elapsed() < PATIENCE,
                "no session taken at the firing"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // Killed: the next agent finds the empty session and counts it lost.
    let Armed {
        mut agent,
        _dir: dir,
        repository,
        ..
    } = armed(&[rule], &[]);
    agent.fire_trigger("late").await.expect("the firing");
    let session = wait_for_session(&repository);
    // SAFETY: killing our own child.
    unsafe { libc::kill(agent.pid() as libc::pid_t, libc::SIGKILL) };
    agent
        .wait_for_exit(Duration::from_secs(10))
        .expect("killed");
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::open(&session)
        .unwrap()
        .set_modified(an_hour_ago)
        .unwrap();
    let next = armed_in(dir, &[rule], &[], &[]);
    let line = counts_line(&next.agent, "late").await;
    assert_eq!(count_of(&line, "lost "), 1, "{line}");
    assert!(!session.exists(), "the empty session stays");
    drop(next);

    // Stopped: counted failed by the agent that stops, nothing left behind.
    let mut stopped = armed(&[rule], &[]);
    stopped
        .agent
        .fire_trigger("late")
        .await
        .expect("the firing");
    wait_for_session(&stopped.repository);
    let status = stopped.agent.stop_with_sigterm(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert_eq!(taken(&stopped.repository), Vec::<PathBuf>::new());
}

/// A repository the agent cannot write is said at start, and a firing's
/// save that fails there is kept under `--unsent-dir`, as a session's trace
/// is: the window is gone from the flight recorder soon after, and the save
/// was lost with only a count.
#[tokio::test]
async fn a_save_that_cannot_be_written_is_kept_and_its_repository_named_at_start() {
    use std::os::unix::fs::PermissionsExt;
    // The agent runs as another user, which takes root.
    if !is_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    // Root's, and not writable by the agent's user.
    std::fs::set_permissions(&root, PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let unsent = tempfile::tempdir().unwrap();
    std::fs::set_permissions(unsent.path(), PermissionsExt::from_mode(0o777)).unwrap();
    let log = unsent.path().join("agent.log");
    let repository = root.join("plugins").join("profile");
    let child = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .args(["--metrics-listen", "off", "--log-level", "warn"])
        .args(["--allow-root", &path_text(&root)])
        .args(["--trigger-repository", &path_text(&repository)])
        .args(["--unsent-dir", &path_text(unsent.path())])
        .args(["--trigger", "name=w; when=explicit; before=300ms; after=0s"])
        .args([
            "--trigger",
            "name=late; when=explicit; before=300ms; after=60s",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("starting devtrace serve as nobody");
    let mut agent = AgentProcess::adopt(child);
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains(&format!(
            "{} is not writable by the agent's user: the save will fail, and its trace be kept \
             under",
            root.display()
        )),
        "{said}"
    );
    // The root itself is said too: captures asked to write there fail.
    assert!(
        said.contains(&format!(
            "--allow-root {0}: {0} is not writable by this user: captures asked to write there \
             will fail",
            root.display()
        )),
        "{said}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    agent.fire_trigger("w").await.expect("fired");
    let deadline = Instant::now() + Duration::from_secs(20);
    let kept = loop {
        let kept: Vec<PathBuf> = walk(unsent.path())
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".xplane.pb"))
            .collect();
        if !kept.is_empty() || Instant::now() > deadline {
            break kept;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(kept.len(), 1, "{}", std::fs::read_to_string(&log).unwrap());
    let space = read_xspace(&kept[0]).expect("the kept trace");
    assert!(event_count(&space) > 0);
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("the trace is kept at") && said.contains("rule=w"),
        "{said}"
    );
    // One stopped while it waits for its `after`, with no session made:
    // not lost without a word. Whoever fires it is told at once that its
    // save will not land in the repository (exit status 3).
    let fired = devtrace(vec![
        "trigger".into(),
        "late".into(),
        "--agent".into(),
        agent.address.clone(),
    ])
    .await;
    let told = String::from_utf8_lossy(&fired.stderr);
    assert_eq!(fired.status.code(), Some(3), "{told}");
    assert!(
        told.contains(&format!(
            "warning: {} is not writable by the agent's user: the save will fail, and its trace \
             be kept under {}",
            root.display(),
            unsent.path().display()
        )),
        "{told}"
    );
    assert!(
        String::from_utf8_lossy(&fired.stdout)
            .contains(&format!("around it into {} once", repository.display())),
        "{}",
        String::from_utf8_lossy(&fired.stdout)
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = agent.stop_with_sigterm(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let said = std::fs::read_to_string(&log).unwrap();
    let stopped = said
        .lines()
        .find(|line| line.contains("stopped before its window could be saved"))
        .unwrap_or_else(|| panic!("{said}"));
    assert!(stopped.contains("rule=late"), "{stopped}");
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

/// A trigger repository that is not a logdir's plugins/profile is said at
/// start: its saves would be listed by neither XProf nor `devtrace
/// sessions` pointed at the logdir; one that is says nothing of it.
#[test]
fn a_repository_outside_plugins_profile_is_said_at_start() {
    let logged_with = |repository: &Path, root: &Path| {
        let (mut agent, logged) = spawn_logging(
            std::process::Command::new(BIN)
                .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
                .args(["--metrics-listen", "off", "--allow-root"])
                .arg(root)
                .arg("--trigger-repository")
                .arg(repository)
                .args(["--trigger", "name=w;when=explicit"]),
        );
        agent.stop_with_sigterm(Duration::from_secs(30));
        logged.join().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let said = "is not a logdir's plugins/profile";
    let log = logged_with(dir.path(), dir.path());
    assert!(log.contains(said), "{log}");
    let log = logged_with(&dir.path().join("plugins/profile"), dir.path());
    assert!(!log.contains(said), "{log}");
}
