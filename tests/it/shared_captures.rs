//! Concurrent captures of one window share one build of its trace; captures
//! of other windows build their own.

use crate::common;

use common::{now_ns, request, space_of, AgentProcess};
use devtrace::proto::tensorflow::ProfileRequest;

/// A capture of `duration_ms` from `start_ns`, in a session of its own.
fn capture_of(start_ns: u64, duration_ms: u64, session: &str) -> ProfileRequest {
    let mut request = request(duration_ms, session);
    if let Some(options) = request.opts.as_mut() {
        options.start_timestamp_ns = start_ns;
    }
    request
}

/// The trace bytes of a reply that carries them as tool data.
fn trace_bytes(reply: &devtrace::proto::tensorflow::ProfileResponse) -> Vec<u8> {
    assert_eq!(reply.tool_data.len(), 1, "one trace as tool data");
    reply.tool_data[0].data.to_vec()
}

/// The "traces built" line of a level-2 Monitor.
async fn build_counts(agent: &AgentProcess) -> String {
    let text = agent.monitor(10).await.data;
    text.lines()
        .find(|line| line.starts_with("traces built:"))
        .unwrap_or_else(|| panic!("no build counts in Monitor: {text}"))
        .to_string()
}

#[tokio::test]
async fn captures_of_one_window_share_one_build_and_other_windows_do_not() {
    let agent = AgentProcess::start(&[]);
    // Far enough ahead that all requests are in before the window ends.
    let start_ns = now_ns() + 1_000_000_000;
    let same = capture_of(start_ns, 200, "fanned");
    let (first, second, other) = tokio::join!(
        agent.profile(same.clone()),
        agent.profile(same),
        agent.profile(capture_of(start_ns + 50_000_000, 200, "other")),
    );
    let (first, second, other) = (
        trace_bytes(&first),
        trace_bytes(&second),
        trace_bytes(&other),
    );
    assert!(!first.is_empty());
    assert_eq!(first, second, "captures of one window get the same trace");
    assert_ne!(first, other, "another window is its own trace");
    assert_eq!(
        build_counts(&agent).await,
        "traces built: 2; captures that shared another's build: 1"
    );
}

/// Waits until the agent has a capture in progress (one holding capture
/// memory: a capture registers once it has its memory).
async fn until_capturing(agent: &AgentProcess) {
    while !agent
        .monitor(10)
        .await
        .data
        .contains("captures in progress: 1")
    {}
}

#[tokio::test]
async fn a_capture_over_the_memory_budget_waits_and_says_so() {
    let agent = AgentProcess::start(&["--capture-memory", "1KiB"]);
    let mut client = agent.client().await;
    let request = capture_of(now_ns(), 1500, "holder");
    let holder = tokio::spawn(async move { client.profile(request).await.unwrap().into_inner() });
    until_capturing(&agent).await;
    let waiter = space_of(&agent.profile(capture_of(now_ns(), 100, "waiter")).await);
    let holder = space_of(&holder.await.unwrap());
    let waited = |space: &devtrace::proto::tensorflow::profiler::XSpace| {
        space
            .warnings
            .iter()
            .any(|w| w.contains("waited") && w.contains("--capture-memory"))
    };
    assert!(waited(&waiter), "{:?}", waiter.warnings);
    assert!(!waited(&holder), "{:?}", holder.warnings);
}

#[tokio::test]
async fn a_capture_whose_deadline_passes_while_waiting_fails_saying_why() {
    let agent = AgentProcess::start(&["--capture-memory", "1KiB"]);
    let mut client = agent.client().await;
    let request = capture_of(now_ns(), 3000, "holder");
    let holder = tokio::spawn(async move { client.profile(request).await.map(|_| ()) });
    until_capturing(&agent).await;
    let mut request = tonic::Request::new(capture_of(now_ns(), 100, "late"));
    request.set_timeout(std::time::Duration::from_secs(1));
    let status = agent
        .client()
        .await
        .profile(request)
        .await
        .expect_err("no memory before its deadline");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("--capture-memory"), "{status:?}");
    assert!(
        holder.await.unwrap().is_ok(),
        "the holder still gets its trace"
    );
}
