//! The command line as a user meets it: capture into a logdir, inspect the
//! file, and clear errors for the usual mistakes.

use crate::common;

use std::process::Command;

use common::*;

fn devtrace(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("running devtrace")
}

#[test]
fn capture_writes_into_the_logdir_and_inspect_summarises_it() {
    let agent = AgentProcess::start(&[]);
    let logdir = tempfile::tempdir().unwrap();
    let address = format!("grpc://{}", agent.address);
    let capture = |extra: &[&str]| {
        let logdir = logdir.path().to_str().unwrap();
        let mut args = vec![
            "capture",
            &address,
            "--duration",
            "500ms",
            "--logdir",
            logdir,
        ];
        args.extend_from_slice(extra);
        args.push("--quiet");
        devtrace(&args)
    };
    let out = capture(&["--session-id", "cli_run"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = logdir
        .path()
        .join("plugins/profile/cli_run")
        .join(format!("{}.xplane.pb", agent.address.replace(':', "_")));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        expected.display().to_string()
    );
    assert!(std::fs::metadata(&expected).unwrap().len() > 10_000);
    // The trace is as open as the user's umask lets it be.
    let private = Command::new("sh")
        .arg("-c")
        .arg(r#"umask 077; exec "$0" "$@""#)
        .arg(BIN)
        .args(["capture", &address, "--duration", "200ms", "--quiet"])
        .args(["--session-id", "private", "--logdir"])
        .arg(logdir.path())
        .output()
        .unwrap();
    assert!(private.status.success(), "{private:?}");
    let private = logdir
        .path()
        .join("plugins/profile/private")
        .join(format!("{}.xplane.pb", agent.address.replace(':', "_")));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&private).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // A reply over --max-reply-size says how to have it after all.
    let out = capture(&["--max-reply-size", "4KiB"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("is more than --max-reply-size allows (4096 bytes); ask again with a larger")
            && said.contains("--delay-back"),
        "{said}"
    );

    let out = devtrace(&["inspect", expected.to_str().unwrap(), "--top", "3"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "plane /host:CPU (id 49)",
        "plane /device:GPU:0 (id 0)",
        "line Stream #7(Compute,Memset)",
        "line python (id 4242)",
        "top events by total time:",
        "train",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // The trace names its machine; sessions and tools name it by its file.
    let file_host = agent.address.replace(':', "_");
    assert!(
        text.starts_with("hosts: ")
            && text
                .lines()
                .nth(1)
                .is_some_and(|line| line.starts_with(&format!("session host: {file_host} (as"))),
        "{text}"
    );

    // The session directory gives the same summary of its one host.
    let session = expected.parent().unwrap();
    let out = devtrace(&["inspect", session.to_str().unwrap(), "--top", "3"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), text);
    // With two hosts, each under its name, and one JSON document each.
    let other = session.join("second_host.xplane.pb");
    std::fs::copy(&expected, &other).unwrap();
    let out = devtrace(&["inspect", session.to_str().unwrap(), "--top", "3"]);
    let both = String::from_utf8_lossy(&out.stdout);
    assert!(
        both.contains(&format!("== {}", expected.display())),
        "{both}"
    );
    assert!(both.contains(&format!("== {}", other.display())), "{both}");
    let out = devtrace(&["inspect", "--json", session.to_str().unwrap()]);
    let documents: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    let field = |name: &str| -> Vec<String> {
        documents
            .iter()
            .map(|doc| doc[name].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(
        field("file"),
        [expected.display().to_string(), other.display().to_string()]
    );
    assert_eq!(field("file_host"), [file_host.as_str(), "second_host"]);
    std::fs::remove_file(&other).unwrap();
    // A reader that stops reading (`| head`) ends the command quietly, as a
    // closed pipe ends other tools.
    for listing in [
        vec!["inspect", expected.to_str().unwrap()],
        vec!["sessions", logdir.path().to_str().unwrap()],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(BIN)
            .args(&listing)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(141), "{listing:?}");
        assert!(
            out.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let empty = tempfile::tempdir().unwrap();
    let out = devtrace(&["inspect", empty.path().to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no trace file"));

    // The same for scripts, with each plane's stats.
    let out = devtrace(&[
        "inspect",
        "--json",
        expected.to_str().unwrap(),
        "--top",
        "3",
    ]);
    assert!(out.status.success());
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(doc["chunks"], 1);
    assert_eq!(doc["top"].as_array().map(Vec::len), Some(3));
    let planes = doc["planes"].as_array().expect("planes");
    let plane = |name: &str| {
        planes
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no plane {name} in {doc}"))
    };
    assert_eq!(plane("/host:CPU")["id"], 49);
    let gpu = plane("/device:GPU:0");
    assert_eq!(gpu["stats"]["core_count"], 108);
    assert_eq!(gpu["stats"]["device_vendor"], "Nvidia");
    assert!(gpu["lines"].as_array().is_some_and(|lines| lines
        .iter()
        .any(|l| l["name"] == "Stream #7(Compute,Memset)")));
    let environment = plane("Task Environment");
    assert!(environment["stats"]["profile_start_time"]
        .as_u64()
        .is_some_and(|t| t > 0));
    assert!(doc["warnings"].is_array() && doc["errors"].is_array());
}

/// Captures never replace one another's traces, a logdir that cannot be
/// written to fails before the window rather than after it, a failed
/// capture leaves no directories behind, and what the trace warns of is
/// said on the command line.
#[test]
fn captures_never_replace_each_other_and_a_bad_logdir_fails_first() {
    let agent = AgentProcess::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("logs");
    let address = format!("grpc://{}", agent.address);
    let capture = |extra: &[&str]| {
        let mut args = vec!["capture", &address, "--duration", "100ms", "--quiet"];
        args.extend_from_slice(extra);
        devtrace(&args)
    };
    let logdir_arg = logdir.to_str().unwrap();
    // Within one second, mostly: each its own session.
    let mut paths = Vec::new();
    for _ in 0..3 {
        let out = capture(&["--logdir", logdir_arg]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        paths.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    paths.sort();
    paths.dedup();
    assert_eq!(paths.len(), 3, "{paths:?}");
    assert!(paths.iter().all(|p| std::path::Path::new(p).is_file()));

    // A session named twice: the second capture is refused before it runs.
    let named = ["--logdir", logdir_arg, "--session-id", "mine"];
    let out = capture(&named);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let bytes = std::fs::read(&first).unwrap();
    let out = capture(&named);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("holds a trace of this host already"),
        "{said}"
    );
    assert!(!said.contains("reply received"), "{said}");
    assert_eq!(std::fs::read(&first).unwrap(), bytes);
    // Held too where the caller may not read it (another user's): refused
    // before the window, not after it by the write.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&first, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args(["capture", &address, "--duration", "100ms", "--quiet"])
        .args(named)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("holds a trace of this host already"),
        "{said}"
    );
    assert!(!said.contains("reply received"), "{said}");

    // A file where the logdir should be: refused before the window.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let out = devtrace(&[
        "capture",
        &address,
        "--duration",
        "5s",
        "--quiet",
        "--logdir",
        file.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("under --logdir"), "{said}");
    assert!(!said.contains("reply received"), "{said}");

    // A capture that fails leaves nothing of its logdir behind.
    let fresh = dir.path().join("fresh");
    let out = devtrace(&[
        "capture",
        "grpc://127.0.0.1:1",
        "--quiet",
        "--logdir",
        fresh.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(!fresh.exists());

    // What the trace warns of is said.
    let out = capture(&["--logdir", logdir_arg, "--attach", "999999"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("the trace warns: process 999999 was not attached"),
        "{said}"
    );
}

#[test]
fn mistakes_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on port 1 of loopback.
    let out = devtrace(&[
        "capture",
        "grpc://127.0.0.1:1",
        "--logdir",
        dir.path().to_str().unwrap(),
        "--quiet",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("cannot reach a profiler server at 127.0.0.1:1"));

    let out = devtrace(&["capture", "grpc://localhost:http", "--logdir", "x"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid address \"grpc://localhost:http\"")
    );
    // A host alone means the default port.
    let out = devtrace(&["capture", "127.0.0.1", "--logdir", "x", "--quiet"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("at 127.0.0.1:6009"));
    // An address of another protocol names the ones that work.
    let out = devtrace(&["capture", "http://127.0.0.1:6009", "--logdir", "x"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("profiler servers speak gRPC; give grpc://"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The trace's host part names a file others can find.
    for hidden in ["", ".x"] {
        let out = devtrace(&[
            "capture",
            "127.0.0.1",
            "--logdir",
            "x",
            "--override-hostname",
            hidden,
        ]);
        assert_eq!(out.status.code(), Some(2));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("would name a hidden file"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // A number alone could mean seconds or milliseconds: neither is guessed.
    for (duration, says) in [
        ("soon", "is not a duration"),
        ("5", "\"5\" has no unit: write 5s or 5ms"),
        // Taken as the value, not as a flag of its own.
        ("-1s", "\"-1s\" is negative: a duration is 0 or more"),
    ] {
        let out = devtrace(&[
            "capture",
            "127.0.0.1:6009",
            "--logdir",
            "x",
            "--duration",
            duration,
        ]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{duration}"
        );
    }

    let garbage = dir.path().join("garbage.xplane.pb");
    std::fs::write(&garbage, b"\xff\xff\xff\xff not a protobuf").unwrap();
    let out = devtrace(&["inspect", garbage.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not an XSpace"));
    let empty = dir.path().join("empty.xplane.pb");
    std::fs::write(&empty, b"").unwrap();
    let out = devtrace(&["inspect", empty.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is empty (0 bytes): not a trace"));

    let out = devtrace(&[
        "inspect",
        dir.path().join("missing.xplane.pb").to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));

    // An address that cannot be one is a usage error before anything
    // starts; one that looks like a host name fails when bound.
    let out = devtrace(&["serve", "--listen", "256.0.0.1:99999"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"99999\" is not a port"));
    let out = devtrace(&[
        "serve",
        "--listen",
        "256.0.0.1:6009",
        "--metrics-listen",
        "off",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen on 256.0.0.1:6009"));
}

/// Values that would start an agent unable to capture, or not start it at
/// all, are usage errors (exit 2) naming the flag, before anything starts.
#[test]
fn values_that_would_make_every_capture_fail_are_usage_errors() {
    for (flag, value, says) in [
        ("--ring-capacity", "0", "--ring-capacity"),
        ("--ring-capacity", "1099511627776", "--ring-capacity"),
        ("--mock-rate", "18446744073709551615", "--mock-rate"),
        ("--store-size", "0", "less than 1MiB"),
        ("--store-retention", "0s", "less than 1s"),
        ("--max-duration", "0s", "less than 1ms"),
        ("--hostname", "a/b", "no '/'"),
        ("--hostname", "..", "cannot name a file"),
        ("--log-level", "devtrace=loud", "not a log filter"),
    ] {
        let out = devtrace(&["serve", flag, value, "--listen", "127.0.0.1:0"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
    }
    // A window longer than the flight recorder keeps would lose its start:
    // it is held to what the recorder keeps, and doctor says so.
    let out = devtrace(&[
        "doctor",
        "--max-duration",
        "10m",
        "--listen",
        "127.0.0.1:0",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor's JSON");
    let finding = report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["item"] == "max duration"))
        .cloned()
        .unwrap_or_else(|| panic!("no max duration finding in {report}"));
    assert_eq!(finding["status"], "warn", "{finding}");
    assert!(
        finding["detail"]
            .as_str()
            .is_some_and(|d| d.contains("captures are held to 115s")),
        "{finding}"
    );
    let agent = AgentProcess::start(&["--max-duration", "10m"]);
    let out = devtrace(&[
        "capture",
        &agent.address,
        "--duration",
        "116s",
        "--logdir",
        "x",
    ]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("exceeds this agent's maximum of 115000 ms"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // RUST_LOG overrides --log-level: one that is not a filter is refused
    // rather than quietly replaced by `info`.
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "devtrace=loud")
        .output()
        .expect("running devtrace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("RUST_LOG=\"devtrace=loud\" is not a log filter"),
        "{stderr}"
    );
}

/// A configuration, certificate or key the agent is given is read only
/// when it is a regular file of sensible size: `/dev/zero` and a FIFO are
/// refused at once (before, the first grew the agent by gigabytes and the
/// second hung its start).
#[test]
fn named_files_that_are_devices_or_fifos_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("config.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    for config in ["/dev/zero", fifo.to_str().unwrap()] {
        let out = devtrace(&["serve", "--config", config]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{config}: {stderr}");
        assert!(stderr.contains("not a regular file"), "{config}: {stderr}");
    }
    let out = devtrace(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        "/dev/zero",
        "--tls-key",
        fifo.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("not a regular file"), "{stderr}");
}

#[test]
fn serve_help_explains_the_flags() {
    let out = devtrace(&["serve", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--backend",
        "--allow-root",
        "--drop-policy",
        "--store-retention",
        "--max-duration",
        "--mock-rate",
    ] {
        assert!(text.contains(flag), "{flag} missing from serve --help");
    }
    // Sectioned, what is recorded first: --backend is not a hundred
    // lines in, after the listening and TLS flags.
    let at = |needle: &str| text.find(needle).unwrap_or(usize::MAX);
    let sections = [
        "\nOptions:\n",
        "\nBackends (what is recorded):\n      --backend ",
        "\nTraces (",
        "\nMemory (",
        "\nListening (",
        "\nTLS (its certificate), and calling other servers (",
    ];
    let places: Vec<usize> = sections.iter().map(|s| at(s)).collect();
    assert!(
        places.windows(2).all(|w| w[0] < w[1] && w[1] != usize::MAX),
        "{places:?}\n{text}"
    );
    // Flags that are not serve's own stay under Options.
    let options = &text[..places[1]];
    for flag in ["--log-level", "--config", "--print-config"] {
        assert!(options.contains(flag), "{flag} not under Options:\n{text}");
    }
}

#[test]
fn the_agent_outlives_a_closed_log_pipe() {
    // The log reader goes away at once (a log shipper that died); the
    // agent's next log lines then fail to write.
    let child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting devtrace serve");
    let mut child = child;
    drop(child.stderr.take());
    let mut agent = AgentProcess::adopt(child);
    let logdir = tempfile::tempdir().unwrap();
    let out = devtrace(&[
        "capture",
        &format!("grpc://{}", agent.address),
        "--duration",
        "300ms",
        "--logdir",
        logdir.path().to_str().unwrap(),
        "--quiet",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(agent.is_running());
}

/// `inspect` of a name that is not a regular file is refused at once: a
/// FIFO hung it, and `/dev/zero` grew it until the kernel killed it (and
/// took other processes' memory on the way).
#[test]
fn inspect_refuses_what_is_not_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("trace.xplane.pb");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string; makes a FIFO in the test's directory.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let mut child = Command::new(BIN)
        .args(["inspect"])
        .arg(&fifo)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            panic!("inspect waited on the FIFO");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    assert!(!status.success());
    let said = text(&out.stderr);
    assert!(said.contains("not a regular file"), "{said}");
}

/// The beginner's wrong ports say what is wrong: nothing listening (is the
/// agent running?) and a gRPC server without the profiler service (its
/// status came with an empty message, and the error ended in a colon).
#[tokio::test]
async fn a_wrong_port_says_what_is_there() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = free.local_addr().unwrap().to_string();
    drop(free);
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().to_str().unwrap();
    let out = devtrace(&["capture", &closed, "--duration", "1s", "--logdir", logdir]);
    assert!(
        text(&out.stderr).contains("is the agent running"),
        "{}",
        text(&out.stderr)
    );

    // A gRPC server of the health service alone.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let args: Vec<String> = ["capture", &address, "--duration", "1s", "--logdir", logdir]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let out = tokio::task::spawn_blocking(move || Command::new(BIN).args(&args).output().unwrap())
        .await
        .unwrap();
    assert!(
        text(&out.stderr).contains("serves no profiler"),
        "{}",
        text(&out.stderr)
    );
}

/// `devtrace monitor` asks the agent period after period and prints each
/// answer; what a server answers is printed escaped; a level the protocol
/// lacks and a server that is not there are clear errors.
#[tokio::test(flavor = "multi_thread")]
async fn monitor_prints_each_period_the_server_measured() {
    let agent = AgentProcess::start(&["--mock-rate", "20000"]);
    let address = agent.address.clone();
    let out = tokio::task::spawn_blocking(move || {
        devtrace(&[
            "monitor",
            &address,
            "--duration",
            "300ms",
            "--count",
            "2",
            "--timestamp",
        ])
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    assert_eq!(printed.matches("timestamp: ").count(), 2, "{printed}");
    assert_eq!(printed.matches(" over 300 ms\n").count(), 2, "{printed}");
    assert!(printed.contains("% busy"), "{printed}");

    // A server that answers at once (this one measures nothing) is asked
    // a period apart all the same: 3 periods of 200 ms take 400 ms at least.
    let hostile = common::bulky::monitoring_host("GPU 0: 1% busy\u{1b}]0;PWNED\u{7}\r").await;
    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        devtrace(&["monitor", &hostile, "--duration", "200ms", "--count", "3"])
    })
    .await
    .unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(400));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    assert_eq!(printed.matches("GPU 0: 1% busy").count(), 3, "{printed}");
    assert!(
        printed.contains("GPU 0: 1% busy\\u{1b}]0;PWNED"),
        "{printed}"
    );
    assert!(!printed.contains(['\u{1b}', '\u{7}', '\r']), "{printed:?}");

    let out = devtrace(&["monitor", &agent.address, "--level", "3"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // The protocol counts whole milliseconds: 1.5ms is not sent as 1.
    let out = devtrace(&["monitor", &agent.address, "--duration", "1.5ms"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("whole milliseconds"),
        "{}",
        text(&out.stderr)
    );
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = free.local_addr().unwrap().to_string();
    drop(free);
    let out = devtrace(&["monitor", &closed]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&closed), "{}", text(&out.stderr));
}

/// A session directory given where a logdir belongs (as XProf is often
/// pointed, showing nothing) is named a session, with the logdir to give;
/// and `tool ... xplane`, whose output is binary, is not written to a
/// terminal.
#[test]
fn a_session_given_for_a_logdir_and_binary_tool_output_are_told_apart() {
    let agent = AgentProcess::start(&[]);
    let logdir = tempfile::tempdir().unwrap();
    let out = devtrace(&[
        "capture",
        &agent.address,
        "--duration",
        "200ms",
        "--session-id",
        "s1",
        "--quiet",
        "--logdir",
        logdir.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = logdir.path().join("plugins/profile/s1");
    let out = devtrace(&["sessions", session.to_str().unwrap()]);
    let said = text(&out.stderr);
    assert!(
        said.contains(&format!(
            "it is a session itself: give its logdir, `devtrace sessions {}`",
            logdir.path().display()
        )),
        "{said}"
    );

    // Standard output a terminal: a pseudo-terminal's other end.
    let (mut main, mut secondary) = (0, 0);
    // SAFETY: out-pointers to two descriptors; no name, settings or size.
    let opened = unsafe {
        libc::openpty(
            &mut main,
            &mut secondary,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(opened, 0);
    // SAFETY: descriptors openpty just made, each owned once.
    let (_main, terminal) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::fs::File::from_raw_fd(main),
            std::fs::File::from_raw_fd(secondary),
        )
    };
    let out = Command::new(BIN)
        .args(["tool", logdir.path().to_str().unwrap(), "s1", "xplane"])
        .stdout(terminal)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("xplane's output is binary: write it to a file with -o FILE"),
        "{}",
        text(&out.stderr)
    );
}

/// Names in a trace file and in a repository are whoever wrote them's:
/// `inspect` and `sessions` print them escaped, so that they cannot set
/// the terminal's title, clear it or forge lines of the listing.
#[test]
fn names_others_wrote_are_printed_escaped() {
    use devtrace::proto::tensorflow::profiler::{XLine, XPlane, XSpace};
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("plugins/profile/esc\u{1b}[2Jsession");
    std::fs::create_dir_all(&session).unwrap();
    let space = XSpace {
        hostnames: vec!["host\u{1b}]0;PWNED\u{7}".into()],
        planes: vec![XPlane {
            name: "/host:CPU\r\nplane forged (id 9): 0 lines, 0 events".into(),
            lines: vec![XLine {
                name: "line\u{202e}".into(),
                ..XLine::default()
            }],
            ..XPlane::default()
        }],
        warnings: vec!["warned\u{1b}[31m".into()],
        ..XSpace::default()
    };
    let file = session.join("h\u{1b}[1m.xplane.pb");
    std::fs::write(&file, space.encode_to_vec()).unwrap();

    let inspected = devtrace(&["inspect", file.to_str().unwrap()]);
    assert!(inspected.status.success(), "{}", text(&inspected.stderr));
    let printed = text(&inspected.stdout);
    assert!(
        printed.contains("hosts: host\\u{1b}]0;PWNED\\u{7}"),
        "{printed}"
    );
    assert!(
        printed.contains("plane /host:CPU\\r\\nplane forged"),
        "{printed}"
    );
    assert!(printed.contains("line line\\u{202e} (id 0)"), "{printed}");
    assert!(printed.contains("session host: h\\u{1b}[1m "), "{printed}");
    assert!(printed.contains("warning: warned\\u{1b}[31m"), "{printed}");

    let listed = devtrace(&["sessions", dir.path().to_str().unwrap()]);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    let printed = text(&listed.stdout);
    assert!(
        printed.starts_with("esc\\u{1b}[2Jsession\thosts: h\\u{1b}[1m\t"),
        "{printed}"
    );
    for output in [&inspected.stdout, &listed.stdout] {
        let output = text(output);
        assert!(
            !output.contains(['\u{1b}', '\r', '\u{7}', '\u{202e}']),
            "{output:?}"
        );
    }
}

/// A file of a few KiB whose chunks decode to tens of gigabytes (empty
/// planes, two bytes each, under Brotli) is refused by `inspect` before it
/// is decoded, naming the machine's memory, rather than taking it.
#[test]
fn inspect_refuses_a_trace_that_decodes_past_the_machines_memory() {
    // One chunk decodes to about 33 GiB: past three quarters of a machine
    // of up to 44 GiB, such as the one CI runs on.
    let limit = devtrace::model::memory_limit::of_this_process();
    if limit.bytes > 44 << 30 {
        eprintln!("skipped: {} is too large to exceed cheaply", limit.source);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut chunks = devtrace::xspace::riegeli::FileWriter::default();
    let empty_planes = [0x0a, 0x00].repeat(96 << 20);
    for _ in 0..2 {
        chunks.write_record(&empty_planes).unwrap();
    }
    drop(empty_planes);
    let file = dir.path().join("h.xplane.riegeli");
    std::fs::write(&file, chunks.into_bytes()).unwrap();
    let out = devtrace(&["inspect", file.to_str().unwrap()]);
    let said = text(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("decodes to") && said.contains("more than three quarters of"),
        "{said}"
    );
}
