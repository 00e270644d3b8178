//! Concurrent captures of one window share one build of its trace; captures
//! of other windows build their own.

use crate::common;

use common::raw_call::{grpc_frame, read_reply, start_profile_call, RawCall};
use common::{http_get, metric_value, now_ns, request, space_of, AgentProcess};
use devtrace::proto::tensorflow::ProfileRequest;
use prost::Message;

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

/// A capture of a past window whose reply its client does not read: its
/// trace, and the capture memory it keeps, stay with the agent until then.
async fn stalled_capture(agent: &AgentProcess, start_ns: u64, duration_ms: u64) -> RawCall {
    let request = capture_of(start_ns, duration_ms, "stalled");
    let mut call = start_profile_call(&agent.address, grpc_frame(&request)).await;
    call.body
        .send_data(bytes::Bytes::new(), true)
        .expect("ending the request");
    call
}

/// Reads a stalled capture's reply to the end: its trace.
async fn trace_of(call: RawCall) -> devtrace::proto::tensorflow::ProfileResponse {
    let (message, status) = read_reply(call.response).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    devtrace::proto::tensorflow::ProfileResponse::decode(&message[..]).expect("a reply")
}

/// Waits until `bytes` or more of the capture budget are held.
async fn until_held(metrics: &str, bytes: f64) {
    loop {
        let (_, text) = http_get(metrics, "/metrics");
        if metric_value(&text, "devtrace_capture_memory_held_bytes", &[]).unwrap_or(0.0) >= bytes {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// An agent whose capture budget holds one 2 s trace of its rate being
/// built, but not a second one beside one already built, and which spills
/// none (a build that may spill reserves only a share of the budget).
fn tight_agent() -> (AgentProcess, String) {
    AgentProcess::start_with_metrics(
        &[
            "--mock-rate",
            "20000",
            "--capture-memory",
            "6MiB",
            "--spill-size",
            "off",
        ],
        &[],
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_capture_waits_for_memory_an_unread_reply_holds_and_says_so() {
    let (agent, metrics) = tight_agent();
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let now = now_ns();
    let holder = stalled_capture(&agent, now - 3_000_000_000, 2000).await;
    until_held(&metrics, 1.0).await;
    // Another window: it builds its own trace, and there is no room for it
    // while the first is unread.
    let waiter = tokio::spawn({
        let mut client = agent.client().await;
        let request = capture_of(now - 2_500_000_000, 2000, "waiter");
        async move { client.profile(request).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "the second capture did not wait");
    let holder = space_of(&trace_of(holder).await);
    let waiter = space_of(
        &waiter
            .await
            .unwrap()
            .expect("the waiter's trace")
            .into_inner(),
    );
    let waited = |space: &devtrace::proto::tensorflow::profiler::XSpace| {
        space
            .warnings
            .iter()
            .any(|w| w.contains("waited") && w.contains("--capture-memory"))
    };
    assert!(waited(&waiter), "{:?}", waiter.warnings);
    assert!(!waited(&holder), "{:?}", holder.warnings);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_capture_whose_deadline_passes_while_waiting_fails_saying_why() {
    let (agent, metrics) = tight_agent();
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let now = now_ns();
    let holder = stalled_capture(&agent, now - 3_000_000_000, 2000).await;
    until_held(&metrics, 1.0).await;
    let mut request = tonic::Request::new(capture_of(now - 2_500_000_000, 2000, "late"));
    request.set_timeout(std::time::Duration::from_secs(1));
    let status = agent
        .client()
        .await
        .profile(request)
        .await
        .expect_err("no memory before its deadline");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("--capture-memory"), "{status:?}");
    let holder = space_of(&trace_of(holder).await);
    assert!(!holder.planes.is_empty(), "the holder still gets its trace");
}

#[tokio::test]
async fn a_window_larger_than_the_whole_budget_is_refused_at_once_naming_it() {
    let agent = AgentProcess::start(&[
        "--mock-rate",
        "100000",
        "--capture-memory",
        "2MiB",
        "--spill-size",
        "off",
    ]);
    let status = agent
        .client()
        .await
        .profile(capture_of(now_ns(), 500, "large"))
        .await
        .expect_err("more than the whole budget");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status
            .message()
            .contains("more than all of --capture-memory"),
        "{status:?}"
    );
    // A window within it is still served.
    let space = space_of(&agent.profile(capture_of(now_ns(), 1, "small")).await);
    assert!(!space.planes.is_empty());
}

/// A client that never reads its reply does not hold its trace, or its
/// share of capture memory, for longer than the reply's deadline: its
/// connection is closed, and the memory given back.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_nobody_reads_is_given_up_at_its_deadline() {
    let (agent, metrics) = tight_agent();
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let holder = stalled_capture(&agent, now_ns() - 3_000_000_000, 2000).await;
    until_held(&metrics, 1.0).await;
    let started = std::time::Instant::now();
    loop {
        let (_, text) = http_get(&metrics, "/metrics");
        if metric_value(&text, "devtrace_capture_memory_held_bytes", &[]) == Some(0.0) {
            break;
        }
        assert!(
            started.elapsed() < devtrace::service::framed_reply::SEND_DEADLINE_BASE * 3,
            "an unread reply still holds its memory"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // Not before its deadline: a slow reader is not cut short.
    assert!(started.elapsed() >= devtrace::service::framed_reply::SEND_DEADLINE_BASE / 2);
    // Its connection is gone: the rest of the reply never comes.
    let read = async {
        let mut body = holder.response.await?.into_body();
        while let Some(data) = body.data().await {
            data?;
        }
        body.trailers().await.map(|_| ())
    };
    assert!(read.await.is_err(), "the unread reply was still sent whole");
    // The agent still captures.
    let space = space_of(&agent.profile(request(200, "after")).await);
    assert!(!space.planes.is_empty());
}
