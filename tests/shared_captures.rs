//! Concurrent captures of one window share one build of its trace; captures
//! of other windows build their own.

mod common;

use common::{now_ns, request, AgentProcess};
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
    reply.tool_data[0].data.clone()
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
