//! Configuration as an operator meets it, against the real binary: every
//! flag of `devtrace serve` round-trips through a `--config` file, the
//! command line wins over DEVTRACE_* variables and they over the file,
//! mistakes are named with the key or variable that made them, and
//! `--log-format json` writes one JSON object per line.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;

/// A value away from its default for every flag of `devtrace serve`, as
/// TOML. A flag missing here fails the round trip, which names it.
const SAMPLES: &[(&str, &str)] = &[
    ("listen", r#""127.0.0.2:7009""#),
    ("insecure", "true"),
    ("tls-client-ca", r#""/etc/devtrace/clients-ca.pem""#),
    ("listen-unix", r#""/run/devtrace.sock""#),
    ("admin-group", r#""root""#),
    ("admin-client", r#"["spiffe://cluster/ns/ops/sa/admin"]"#),
    ("remote-callers", r#""host""#),
    ("continuous-timeout", r#""5m""#),
    ("captures-per-caller", "4"),
    ("session-bytes", r#""8GiB""#),
    ("session-bytes-per-hour", r#""32GiB""#),
    ("listen-unix-mode", r#""0660""#),
    ("listen-unix-group", r#""root""#),
    ("session-hosts", r#"["10.0.*:6009", "*.cluster.local:*"]"#),
    ("tls-ca", r#""/etc/devtrace/fleet-ca.pem""#),
    ("tls-cert", r#""/etc/devtrace/agent.pem""#),
    ("tls-key", r#""/etc/devtrace/agent.key""#),
    ("tls-domain", r#""agents.example""#),
    ("max-reply-size", r#""1GiB""#),
    ("capture-memory", r#""1GiB""#),
    ("spill-dir", r#""/var/tmp""#),
    ("spill-size", r#""2GiB""#),
    ("dns-server", r#""10.96.0.10:53""#),
    ("concurrent-hosts", "128"),
    ("backend", r#"["mock", "nvml"]"#),
    ("mock-rate", "1000"),
    ("mock-seed", "7"),
    ("mock-gpus", "4"),
    ("mock-uid", "1001"),
    ("mock-slow-step", r#""8s""#),
    ("mock-utilization-dip", r#""10s+5s""#),
    ("nvml-library", r#""/opt/nvidia/libnvidia-ml.so.1""#),
    ("nvml-interval", r#""20ms""#),
    ("nvml-idle-interval", r#""2s""#),
    ("tpu-library", r#""/opt/tpu/libtpu.so""#),
    ("perf-pid", "[1, 2]"),
    ("perf-interval", r#""50ms""#),
    ("ebpf-attach", r#""always""#),
    ("ebpf-cuda-returns", r#""all""#),
    ("ebpf-hooks", r#"["sched"]"#),
    ("ebpf-pid", "[3]"),
    ("ebpf-cgroup", r#""/sys/fs/cgroup/kubepods.slice""#),
    ("ebpf-comm", r#""python""#),
    ("ebpf-ring-size", r#""8MiB""#),
    ("ebpf-probe-alone-max", "16"),
    (
        "cuda-library",
        r#"["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]"#,
    ),
    ("runtime-dir", r#""/var/run/devtrace-test""#),
    ("cuda-api-records", r#""all""#),
    ("cuda-record", r#""always""#),
    ("cuda-attach", r#"["cmdline=*train.py*"]"#),
    (
        "inject-library",
        r#""/opt/devtrace/lib/libdevtrace_inject.so""#,
    ),
    ("store-retention", r#""5m""#),
    ("store-size", r#""1GiB""#),
    ("ring-capacity", "4096"),
    ("drop-policy", r#""drop-oldest""#),
    (
        "allow-root",
        r#"["/srv/tb", "/srv/tb, with a comma", "s3://traces/team"]"#,
    ),
    ("unsent-dir", r#""/var/lib/devtrace/unsent""#),
    ("max-duration", r#""1m""#),
    ("max-connection-age", r#""30m""#),
    ("chunk-traces-over", r#""256MiB""#),
    ("upstream", r#"["grpc://127.0.0.1:9999"]"#),
    ("hostname", r#""worker-7""#),
    ("tap", r#"["127.0.0.1:2223=127.0.0.1:2222"]"#),
    ("metrics-listen", r#""0.0.0.0:7010""#),
    (
        "trigger",
        r#"["name=slow-step; when=step > 3x median(20); before=5s", "name=watchdog; when=explicit"]"#,
    ),
    ("trigger-repository", r#""/srv/tb/plugins/profile""#),
    ("log-level", r#""debug""#),
    ("log-format", r#""json""#),
];

/// `devtrace <args>` with only `env` in its environment, so that variables
/// of the machine running the tests stay out.
fn devtrace_with(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(BIN);
    command.args(args).env_clear().envs(env.iter().copied());
    command
}

fn devtrace(args: &[&str], env: &[(&str, &str)]) -> Output {
    devtrace_with(args, env).output().expect("running devtrace")
}

/// `devtrace serve --print-config ...`, which must succeed, as a table.
fn effective(args: &[&str], env: &[(&str, &str)]) -> toml::Table {
    let out = devtrace(&[&["serve", "--print-config"], args].concat(), env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .parse()
        .expect("--print-config writes TOML")
}

/// The names of `devtrace serve`'s flags that a file may hold, from the
/// command's own definition.
fn serve_keys() -> Vec<String> {
    let mut command = devtrace::cli::command();
    command.build();
    let serve = command.find_subcommand("serve").expect("serve");
    serve
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        .filter(|long| !["help", "version", "config", "print-config"].contains(long))
        .map(str::to_owned)
        .collect()
}

/// A value as a flag sees it: numbers as their text.
fn as_flag_sees_it(value: &toml::Value) -> toml::Value {
    match value {
        toml::Value::Integer(number) => toml::Value::String(number.to_string()),
        toml::Value::Array(items) => {
            toml::Value::Array(items.iter().map(as_flag_sees_it).collect())
        }
        other => other.clone(),
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn every_serve_flag_round_trips_through_a_config_file() {
    let keys = serve_keys();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|key| !SAMPLES.iter().any(|(name, _)| name == key))
        .collect();
    assert!(
        missing.is_empty(),
        "flags of devtrace serve without a sample value in SAMPLES: {missing:?}"
    );
    let stale: Vec<&str> = SAMPLES
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !keys.iter().any(|key| key == name))
        .collect();
    assert!(stale.is_empty(), "SAMPLES names no flag: {stale:?}");

    let defaults = effective(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let text: String = SAMPLES
        .iter()
        .map(|(key, value)| format!("{key} = {value}\n"))
        .collect();
    let file = write(dir.path(), "every-flag.toml", &text);
    let expected: toml::Table = text.parse().unwrap();
    let printed = effective(&["--config", &file], &[]);

    let mut printed_keys: Vec<&String> = printed.keys().collect();
    let mut all_keys: Vec<&String> = keys.iter().collect();
    printed_keys.sort();
    all_keys.sort();
    assert_eq!(
        printed_keys, all_keys,
        "--print-config shows every flag set"
    );
    for key in &keys {
        let sample = as_flag_sees_it(&expected[key]);
        assert_ne!(
            defaults.get(key).map(as_flag_sees_it),
            Some(sample.clone()),
            "the sample of {key} is its default, so it proves nothing"
        );
        assert_eq!(
            as_flag_sees_it(&printed[key]),
            sample,
            "{key} did not round-trip"
        );
    }

    // The defaults, printed, read back as themselves.
    let out = devtrace(&["serve", "--print-config"], &[]);
    let file = write(
        dir.path(),
        "defaults.toml",
        &String::from_utf8_lossy(&out.stdout),
    );
    assert_eq!(effective(&["--config", &file], &[]), defaults);
}

/// Starts `devtrace serve` with only `env` and returns the IP address it
/// listens on, once it has said so; a connection there must succeed.
fn listening_ip(args: &[&str], env: &[(&str, &str)]) -> String {
    let child = devtrace_with(&[&["serve"], args].concat(), env)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting devtrace serve");
    let agent = AgentProcess::adopt(child);
    std::net::TcpStream::connect(&agent.address).expect("connecting to the agent");
    let (ip, _port) = agent.address.rsplit_once(':').expect("ip:port");
    ip.to_owned()
}

#[test]
fn command_line_beats_environment_beats_file() {
    let dir = tempfile::tempdir().unwrap();
    // Three loopback addresses tell the layers apart.
    let file = write(
        dir.path(),
        "agent.toml",
        "listen = \"127.0.0.3:0\"\nbackend = [\"mock\"]\nmock-rate = 0\nlog-level = \"warn\"\n",
    );
    assert_eq!(listening_ip(&["--config", &file], &[]), "127.0.0.3");
    let from_env = [
        ("DEVTRACE_CONFIG", file.as_str()),
        ("DEVTRACE_LISTEN", "127.0.0.2:0"),
    ];
    assert_eq!(listening_ip(&[], &from_env), "127.0.0.2");
    assert_eq!(
        listening_ip(&["--listen", "127.0.0.1:0"], &from_env),
        "127.0.0.1"
    );

    // A repeatable flag (a comma-separated list in its variable) and a switch.
    let file = write(
        dir.path(),
        "lists.toml",
        "backend = [\"nvml\"]\ninsecure = true\n",
    );
    let only_file = effective(&["--config", &file], &[]);
    assert_eq!(only_file["backend"], toml::Value::from(vec!["nvml"]));
    assert_eq!(only_file["insecure"], toml::Value::Boolean(true));
    let env = [
        ("DEVTRACE_BACKEND", "mock, perf"),
        ("DEVTRACE_INSECURE", "false"),
    ];
    let over_file = effective(&["--config", &file], &env);
    assert_eq!(
        over_file["backend"],
        toml::Value::from(vec!["mock", "perf"])
    );
    assert_eq!(over_file["insecure"], toml::Value::Boolean(false));
    let over_env = effective(&["--config", &file, "--backend", "tpu", "--insecure"], &env);
    assert_eq!(over_env["backend"], toml::Value::from(vec!["tpu"]));
    assert_eq!(over_env["insecure"], toml::Value::Boolean(true));

    // --print-config says where each value came from.
    let out = devtrace(&["serve", "--print-config", "--config", &file], &env);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("backend = [\"mock\", \"perf\"]  # from DEVTRACE_BACKEND"),
        "{text}"
    );
}

/// `devtrace serve --config FILE` (or with `env`) must fail as a usage
/// error, with every one of `needles` in its message.
fn refused(file_text: Option<&str>, env: &[(&str, &str)], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["serve".to_owned()];
    if let Some(text) = file_text {
        args.push("--config".into());
        args.push(write(dir.path(), "agent.toml", text));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = devtrace(&args, env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{needle:?} missing from:\n{stderr}"
        );
    }
    if file_text.is_some() {
        assert!(stderr.contains(args[2]), "the file is not named:\n{stderr}");
    }
}

#[test]
fn an_unknown_key_or_a_bad_value_is_named() {
    refused(
        Some("lisen = \"127.0.0.1:6009\"\nrun_time_dir = \"/run/devtrace\"\n"),
        &[],
        &[
            "unknown keys",
            "\"lisen\" (did you mean \"listen\"?)",
            "\"run_time_dir\" (did you mean \"runtime-dir\"?)",
        ],
    );
    refused(
        Some("[serve]\nlisten = \"127.0.0.1:6009\"\n"),
        &[],
        &["\"serve\" (a table: flags go at the top level"],
    );
    refused(
        Some("store-size = \"lots\"\n"),
        &[],
        &["store-size = \"lots\": \"lots\" is not a size"],
    );
    refused(
        Some("backend = [\"cuda\", \"gpu\"]\n"),
        &[],
        &["backend = [\"cuda\", \"gpu\"]: \"gpu\" is not a possible value (one of auto, mock,"],
    );
    refused(
        Some("insecure = \"yes\"\n"),
        &[],
        &["insecure = \"yes\": a switch is true or false"],
    );
    refused(Some("listen = \n"), &[], &["TOML parse error at line 1"]);
    refused(
        None,
        &[("DEVTRACE_MOCK_GPUS", "100")],
        &["DEVTRACE_MOCK_GPUS=\"100\": 100 is not in 1..=64"],
    );
    refused(
        None,
        &[("DEVTRACE_CONFIG", "/nonexistent/devtrace.toml")],
        &["DEVTRACE_CONFIG /nonexistent/devtrace.toml: No such file or directory"],
    );
}

#[test]
fn a_trigger_table_in_the_file_is_a_trigger_rule() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "agent.toml",
        "[[trigger]]\nname = \"slow-step\"\nwhen = \"step > 3x median(20)\"\nmax-per-hour = 2\n\n\
         [[trigger]]\nname = \"watchdog\"\nwhen = \"explicit\"\n",
    );
    let printed = effective(&["--config", &file, "--trigger-repository", "/tb"], &[]);
    let rules: Vec<devtrace::trigger::rule::Rule> = printed["trigger"]
        .as_array()
        .expect("trigger is a list")
        .iter()
        .map(|rule| {
            rule.as_str()
                .expect("a rule")
                .parse()
                .expect("a rule that parses")
        })
        .collect();
    let names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["slow-step", "watchdog"]);
    assert_eq!(rules[0].max_per_hour, 2);
    assert_eq!(
        rules[0].condition,
        devtrace::trigger::rule::Condition::SlowStep {
            factor: 3.0,
            steps: 20
        }
    );
    // The flag's form works in the file and in the variable too.
    let printed = effective(
        &["--trigger-repository", "/tb"],
        &[(
            "DEVTRACE_TRIGGER",
            "name=a; when=dropped,name=b; when=explicit",
        )],
    );
    assert_eq!(printed["trigger"].as_array().map(Vec::len), Some(2));
}

#[test]
fn a_bad_trigger_rule_is_named_with_its_bad_part() {
    refused(
        Some(
            "[[trigger]]\nname = \"fine\"\nwhen = \"explicit\"\n\n\
             [[trigger]]\nname = \"slow\"\nwhen = \"step > 3 median(20)\"\n",
        ),
        &[],
        &[
            "agent.toml: [[trigger]]: table 2: ",
            "in \"3\": a factor of at least 1",
        ],
    );
    refused(
        Some("[[trigger]]\nname = \"slow\"\nwhen = \"explicit\"\nbefore = [1]\n"),
        &[],
        &["agent.toml: [[trigger]]: table 1: before: a value here is a string"],
    );
    // A rule needs somewhere to save to, like any other flag it needs.
    refused(
        None,
        &[("DEVTRACE_TRIGGER", "name=fine; when=explicit")],
        &["--trigger-repository"],
    );
    refused(
        None,
        &[(
            "DEVTRACE_TRIGGER",
            "name=slow; when=step > 3x median(20); befor=1s",
        )],
        &[
            "DEVTRACE_TRIGGER=",
            "in \"befor=1s\": unknown key \"befor\"",
        ],
    );
}

/// Runs `devtrace <args>` until it logs a line `wanted` accepts, checking
/// that every line before is a JSON object with the fields log collectors
/// read, then kills it.
fn json_log_until(
    args: &[&str],
    env: &[(&str, &str)],
    wanted: impl Fn(&serde_json::Value) -> bool,
) {
    let mut child = devtrace_with(args, env)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting devtrace");
    let stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut seen = Vec::new();
    for line in stderr.lines() {
        let line = line.expect("reading the log");
        let object: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|error| panic!("{error}: not JSON: {line:?}"));
        for field in ["timestamp", "level", "message", "target"] {
            assert!(object.get(field).is_some(), "{field} missing from {line}");
        }
        if wanted(&object) {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        seen.push(line);
    }
    let _ = child.wait();
    panic!("the line wanted never came; the log:\n{}", seen.join("\n"));
}

#[test]
fn log_format_json_writes_one_object_per_line() {
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "mock",
        "--log-format",
        "json",
    ];
    // The event's own fields sit beside the message.
    json_log_until(&args, &[], |line| {
        line["message"] == "backend" && line["backend"] == "mock" && line["level"] == "INFO"
    });

    // From the environment, for another subcommand too.
    let args = [
        "tap",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:1",
        "--summary-every",
        "100ms",
    ];
    json_log_until(&args, &[("DEVTRACE_LOG_FORMAT", "json")], |line| {
        line["message"] == "tap summary" && line["calls"] == 0
    });

    // The failure that ends a command is one such object too, whatever
    // the filter lets through.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = held.local_addr().unwrap().to_string();
    let out = devtrace(
        &["serve", "--listen", &address, "--backend", "mock"],
        &[
            ("DEVTRACE_LOG_FORMAT", "json"),
            ("DEVTRACE_LOG_LEVEL", "off"),
            ("DEVTRACE_METRICS_LISTEN", "off"),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().expect("a last word");
    let line: serde_json::Value = serde_json::from_str(last).expect("a JSON object");
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("cannot listen on {address}"))),
        "{line}"
    );
    assert!(line["timestamp"].is_string() && line["target"] == "devtrace");

    // So is a usage error, found before the log is set up, however JSON
    // was asked for: on the command line, in the environment or in the
    // file that holds the mistake.
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "typo.toml",
        "log-format = \"json\"\nlisen = \"x\"\n",
    );
    for (args, env) in [
        (
            vec!["serve", "--log-format", "json", "--store-size", "lots"],
            vec![],
        ),
        (
            vec!["serve", "--store-size", "lots"],
            vec![("DEVTRACE_LOG_FORMAT", "json")],
        ),
        (vec!["serve", "--config", file.as_str()], vec![]),
    ] {
        let out = devtrace(&args, &env);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line: serde_json::Value = serde_json::from_str(stderr.trim())
            .unwrap_or_else(|e| panic!("{args:?} {env:?}: {e}: {stderr}"));
        assert_eq!(line["level"], "ERROR", "{line}");
        let message = line["message"].as_str().unwrap();
        assert!(
            message.contains("lots") || message.contains("lisen"),
            "{message}"
        );
    }
}

/// A RUST_LOG that is not a filter is a usage error, as a bad
/// --log-level is.
#[test]
fn a_bad_rust_log_is_a_usage_error() {
    let out = devtrace(&["sessions", "/nonexistent"], &[("RUST_LOG", "devtrace=[")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("RUST_LOG=\"devtrace=[\" is not a log filter"));
}

/// --print-config shows what a run would log with: a RUST_LOG that
/// overrides --log-level is named beside it, and a bad one is refused as a
/// run refuses it.
#[test]
fn print_config_names_an_overriding_rust_log_and_refuses_a_bad_one() {
    let out = devtrace(&["serve", "--print-config"], &[("RUST_LOG", "debug")]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("log-level = \"info\"\n# but RUST_LOG=\"debug\" is set, and overrides it"),
        "{stdout}"
    );

    let out = devtrace(&["serve", "--print-config"], &[("RUST_LOG", "devtrace=[")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("RUST_LOG=\"devtrace=[\" is not a log filter"));
    assert!(out.stdout.is_empty());
}
