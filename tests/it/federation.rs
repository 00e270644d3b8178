//! Federation: an agent started with `--upstream` folds another profiler
//! server's trace into its own captures, on one time base; an upstream that
//! is down makes the capture partial, never failed.

use crate::common;

use common::*;
use devtrace::xspace::read::{event_start_ps, find_stat, StatValue};

#[tokio::test]
async fn an_upstream_trace_is_merged_on_our_time_base() {
    let upstream = AgentProcess::start(&["--mock-gpus", "1", "--mock-seed", "7"]);
    let agent = AgentProcess::start(&["--upstream", &format!("grpc://{}", upstream.address)]);
    let reply = agent
        .client()
        .await
        .profile(request(600, "merged"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert!(space.errors.is_empty(), "{:?}", space.errors);

    let names: Vec<&str> = space.planes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "/host:CPU",
            "/device:GPU:0",
            "/device:GPU:1",
            "Task Environment",
            "/device:GPU:2"
        ]
    );
    let host = plane(&space, "/host:CPU");
    let theirs: Vec<_> = host
        .lines
        .iter()
        .filter(|l| l.display_name.starts_with(&upstream.address))
        .collect();
    assert_eq!(theirs.len(), 2, "the upstream's python and copy threads");
    assert!(theirs
        .iter()
        .any(|l| l.display_name == format!("{} python", upstream.address)));
    // Both sides captured the same window, so their events fall inside ours.
    for line in &theirs {
        for event in &line.events {
            let at = event_start_ps(line.timestamp_ns, event);
            assert!(
                (-50_000_000_000..650_000_000_000).contains(&at),
                "event at {at} ps"
            );
        }
        assert!(!line.events.is_empty());
    }
    let python = theirs
        .iter()
        .find(|l| l.display_name.ends_with(" python"))
        .expect("the upstream's python thread");
    assert!(python.events.len() > 1000, "{} events", python.events.len());
    let moved = plane(&space, "/device:GPU:2");
    assert_eq!(moved.id, 2);
    assert_eq!(
        find_stat(moved, &moved.stats, "devtrace_source"),
        Some(StatValue::Str(upstream.address.clone()))
    );
    assert_eq!(
        find_stat(moved, &moved.stats, "devtrace_original_plane"),
        Some(StatValue::Str("/device:GPU:0".into()))
    );
    assert!(moved.lines.iter().any(|l| !l.events.is_empty()));
}

#[tokio::test]
async fn an_upstream_that_is_down_makes_the_capture_partial() {
    let unused = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let agent = AgentProcess::start(&["--upstream", &unused]);
    let reply = agent
        .client()
        .await
        .profile(request(300, "partial"))
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.empty_trace);
    let space = space_of(&reply);
    assert_error_starting(&space, &format!("upstream {unused}: cannot connect"));
    assert!(event_count(&space) > 1000, "our own events are all there");
    // The command line says so, not only the file.
    let logdir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args(["capture", &agent.address, "--duration", "300ms", "--quiet"])
        .arg("--logdir")
        .arg(logdir.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "the trace warns: (error) upstream {unused}: cannot connect"
        )),
        "{said}"
    );
}

/// An upstream that accepts the call and never answers (as a port bound by
/// someone else may) costs the capture its grace past the window, not the
/// minute a call may otherwise take: the trace comes back partial, naming
/// the upstream.
#[tokio::test]
async fn a_silent_upstream_makes_the_capture_partial_within_its_grace() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap().to_string();
    // Accepts, holds every connection open, and says nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming() {
            held.push(stream);
        }
    });
    let agent = AgentProcess::start(&["--upstream", &address]);
    let asked = std::time::Instant::now();
    let reply = agent
        .client()
        .await
        .profile(request(300, "silent"))
        .await
        .unwrap()
        .into_inner();
    let took = asked.elapsed();
    let grace = devtrace::capture::upstream_grace(std::time::Duration::from_millis(300));
    assert!(
        took < grace + std::time::Duration::from_secs(10),
        "answered after {took:?}"
    );
    let space = space_of(&reply);
    assert_error_starting(&space, &format!("upstream {address}: "));
    assert!(event_count(&space) > 1000, "our own events are all there");
}

/// Upstreams that lead back to an agent already asked, itself or one down
/// the chain, are refused at once, saying so: each agent of such a loop
/// asked the next for the same window until every deadline ran out (a 1 s
/// capture took 6 s), and the trace said only that an upstream did not
/// answer.
#[tokio::test]
async fn upstreams_that_loop_are_refused_at_once_naming_the_loop() {
    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string()
    };
    let looped = "came back to the agent that asked for it along --upstream";

    let itself = port();
    let agent = AgentProcess::adopt(AgentProcess::spawn_listening(
        &itself,
        &["--upstream", &format!("grpc://{itself}")],
    ));
    let space = space_of(&agent.profile(request(300, "self")).await);
    assert_error_starting(&space, &format!("upstream {itself}: "));
    let error = &space.errors[0];
    assert!(error.contains(looped), "{error}");
    assert!(event_count(&space) > 1000, "its own events are all there");

    // A asks B, which asks A.
    let (a, b) = (port(), port());
    let agent_a = AgentProcess::spawn_listening(&a, &["--upstream", &b, "--mock-seed", "3"]);
    let agent_b = AgentProcess::spawn_listening(&b, &["--upstream", &a, "--mock-seed", "4"]);
    let (agent_a, _agent_b) = (AgentProcess::adopt(agent_a), AgentProcess::adopt(agent_b));
    let space = space_of(&agent_a.profile(request(300, "pair")).await);
    assert!(
        space
            .errors
            .iter()
            .all(|e| !e.contains(&format!("upstream {b}"))),
        "B answered: {:?}",
        space.errors
    );
    let refused: Vec<&String> = space
        .errors
        .iter()
        .filter(|e| e.contains(&format!("upstream {a}")) && e.contains(looped))
        .collect();
    assert_eq!(refused.len(), 1, "B's call back to A: {:?}", space.errors);

    // An agent reaching its upstream through its own tap is no loop: the
    // tap is a hop of its own.
    let upstream = AgentProcess::start(&["--mock-seed", "5"]);
    let tap = port();
    let agent = AgentProcess::start(&[
        "--tap",
        &format!("{tap}={}", upstream.address),
        "--upstream",
        &format!("grpc://{tap}"),
    ]);
    let space = space_of(&agent.profile(request(300, "tapped")).await);
    assert!(space.errors.is_empty(), "{:?}", space.errors);
    assert!(
        space
            .planes
            .iter()
            .flat_map(|p| &p.lines)
            .any(|l| l.display_name.starts_with(&tap)),
        "the upstream's lines, named after the tap it was reached through"
    );
}
