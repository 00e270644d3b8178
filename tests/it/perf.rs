//! The perf backend on the real kernel: per-CPU software counters and a
//! chosen process's counters arrive as counter tracks on `/host:CPU`. Counting
//! every CPU needs root; the test says so and skips otherwise.

use crate::common;

use std::process::{Command, Stdio};

use common::*;
use devtrace::xspace::read::{event_name, find_stat, StatValue};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[tokio::test]
async fn cpu_and_process_counters_become_host_counter_tracks() {
    if !is_root() {
        println!("skipped: counting every CPU needs root");
        return;
    }
    // A process that keeps one CPU busy.
    let mut spinner = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .stdout(Stdio::null())
        .spawn()
        .expect("starting a busy process");
    let pid = spinner.id().to_string();
    let agent = AgentProcess::start(&["--backend", "perf", "--perf-pid", &pid]);
    let reply = agent
        .client()
        .await
        .profile(request(500, "perf"))
        .await
        .unwrap()
        .into_inner();
    let _ = spinner.kill();
    let _ = spinner.wait();
    let space = space_of(&reply);
    let host = plane(&space, "/host:CPU");
    let counters = host
        .lines
        .iter()
        .find(|l| l.name == "_counters_")
        .expect("a counter line on /host:CPU");
    let values = |name: &str| -> Vec<f64> {
        counters
            .events
            .iter()
            .filter(|e| event_name(host, e) == name)
            .map(|e| match find_stat(host, &e.stats, "value") {
                Some(StatValue::Double(v)) => v,
                other => panic!("{name}: {other:?}"),
            })
            .collect()
    };
    for name in [
        "cpu0 CPU clock (ms/s)",
        "cpu0 context switches/s",
        "cpu0 page faults/s",
        "cpu0 migrations/s",
    ] {
        let samples = values(name);
        assert!(
            samples.len() >= 10,
            "{name}: {} samples in 500 ms",
            samples.len()
        );
        assert!(samples.iter().all(|v| *v >= 0.0), "{name}: {samples:?}");
    }
    // The busy process runs most of the time (ms of CPU per second).
    let busy = values(&format!("pid {pid} CPU clock (ms/s)"));
    assert!(busy.len() >= 10);
    let mean = busy.iter().sum::<f64>() / busy.len() as f64;
    assert!(mean > 300.0, "a spinning process used {mean:.0} ms/s");
}

#[test]
fn a_process_that_does_not_exist_is_a_clear_error() {
    if !is_root() {
        println!("skipped: counting every CPU needs root");
        return;
    }
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "perf",
            "--perf-pid",
            "999999999",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("perf is not available here: cannot open the CPU clock (ms/s) counter for pid 999999999"), "{stderr}");
}
