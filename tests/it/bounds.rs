//! What a peer can make the agent hold, through connections it opens and
//! requests it never finishes: connections past one peer's bound (a local
//! user's, another host's address) are closed at once, silent connections do not make the health probes wait,
//! a call's body must arrive within its deadline, and one connection may
//! open so many calls at once. The agent keeps serving others throughout.

use crate::common;

use std::time::Duration;

use common::raw_call::{connect_as, half_sent_call, read_reply, RawCall};
use common::*;
use devtrace::protocol::listen::Limits;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Whether a connection was closed by the agent (not left open).
async fn closed(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 64];
    loop {
        let patience = devtrace::protocol::listen::FIRST_BYTES_DEADLINE * 3;
        match tokio::time::timeout(patience, stream.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // The server's HTTP/2 settings, on a connection it kept.
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

/// Whether this test may connect as other users (it needs root).
fn cannot_act_as_others() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: needs root to connect as another user");
    }
    !root
}

/// A local user past its bound is refused, on 127.0.0.1 as any other
/// local user: each is bounded as itself (before, every local caller on
/// TCP shared 127.0.0.1's place, and one user's connections locked the
/// others out).
#[tokio::test(flavor = "multi_thread")]
async fn connections_past_one_peers_bound_are_closed_and_others_are_still_served() {
    if cannot_act_as_others() {
        return;
    }
    let (agent, metrics) = AgentProcess::start_with_metrics(&["--mock-rate", "1000"], &[]);
    let Limits { per_peer, .. } = devtrace::service::CONNECTION_LIMITS;
    let mut held = Vec::new();
    for _ in 0..per_peer {
        let mut stream = connect_as(65534, &agent.address).await;
        // The HTTP/2 preface and no more: the connection has spoken, so it
        // keeps its place past the first-bytes deadline however slow the
        // rest of the test.
        tokio::io::AsyncWriteExt::write_all(&mut stream, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("writing the preface");
        held.push(stream);
    }
    let mut past = Vec::new();
    for _ in 0..4 {
        past.push(connect_as(65534, &agent.address).await);
    }
    for stream in &mut past {
        assert!(
            closed(stream).await,
            "a connection past the peer's bound was kept"
        );
    }
    // Another local user (this one, root) is served meanwhile.
    let space = space_of(&agent.profile(request(200, "bounds")).await);
    assert!(!space.planes.is_empty());
    let (_, text) =
        http_get_within(&metrics, "/metrics", Some(Duration::from_secs(10))).expect("metrics");
    let refused = metric_value(
        &text,
        "devtrace_connections_refused_total",
        &[("listener", "grpc"), ("bound", "peer")],
    );
    assert_eq!(refused, Some(4.0), "{text}");
    let open =
        metric_value(&text, "devtrace_connections_open", &[("listener", "grpc")]).unwrap_or(0.0);
    assert!(open >= per_peer as f64, "{open} open: {text}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread")]
async fn silent_connections_to_the_metrics_port_do_not_make_the_probes_wait() {
    if cannot_act_as_others() {
        return;
    }
    let (_agent, metrics) = AgentProcess::start_with_metrics(&["--mock-rate", "1000"], &[]);
    // More silent connections than the endpoint serves at once used to
    // hold every place for the 10 s header deadline, and probes queued.
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(connect_as(65534, &metrics).await);
    }
    for _ in 0..5 {
        let (status, reply) = http_get_within(&metrics, "/healthz", Some(Duration::from_secs(2)))
            .expect("the probe answered within its 2 s timeout");
        assert_eq!(status, 200, "{reply}");
    }
    let (_, text) =
        http_get_within(&metrics, "/metrics", Some(Duration::from_secs(10))).expect("metrics");
    let per_peer = devtrace::telemetry::http::LIMITS.per_peer;
    let refused = metric_value(
        &text,
        "devtrace_connections_refused_total",
        &[("listener", "metrics"), ("bound", "peer")],
    );
    assert_eq!(refused, Some((100 - per_peer) as f64), "{text}");
    drop(silent);
}

/// The gRPC status a response ends with, as (code, message).
async fn status_of(response: h2::client::ResponseFuture) -> (String, String) {
    let (_, status) = read_reply(response).await;
    (
        (status.code() as i32).to_string(),
        status.message().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_whose_body_never_arrives_whole_fails_at_its_deadline() {
    let agent = AgentProcess::start(&["--mock-rate", "1000"]);
    // The body is held open, unfinished, until the end.
    let RawCall {
        client,
        response,
        body: _body,
    } = half_sent_call(&agent.address, 1 << 20, 1000).await;
    let deadline = devtrace::service::request_bodies::BODY_DEADLINE;
    let (status, message) = tokio::time::timeout(deadline * 3, status_of(response))
        .await
        .expect("the call ended rather than waited for its body");
    // DEADLINE_EXCEEDED, naming the bound.
    assert_eq!(status, "4", "{message}");
    assert!(message.contains("did not arrive within"), "{message}");
    // The server said (in its settings, read by now) how many calls a
    // connection may have open.
    assert_eq!(
        client.current_max_send_streams(),
        devtrace::service::MAX_STREAMS_PER_CONNECTION as usize
    );
    // The agent still captures.
    let space = space_of(&agent.profile(request(200, "bounds")).await);
    assert!(!space.planes.is_empty());
}

/// Bodies one caller holds unfinished share one bound: past it a call
/// fails with RESOURCE_EXHAUSTED naming it, instead of the agent buffering
/// whatever a peer starts to send; the agent keeps serving meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn unfinished_bodies_of_one_caller_hold_at_most_its_share() {
    let agent = AgentProcess::start(&["--mock-rate", "1000"]);
    let share = devtrace::service::request_bodies::BODY_MEMORY_PER_PEER;
    let claimed = (devtrace::service::MAX_REQUEST_BYTES - 5) as u32;
    let sent = claimed as usize - 1000;
    let calls = share / sent + 1;
    let mut pending = Vec::new();
    for _ in 0..calls {
        pending.push(half_sent_call(&agent.address, claimed, sent).await);
    }
    let deadline = devtrace::service::request_bodies::BODY_DEADLINE;
    let mut statuses = Vec::new();
    for RawCall {
        response,
        client: _client,
        body: _body,
    } in pending
    {
        let (status, message) = tokio::time::timeout(deadline * 3, status_of(response))
            .await
            .expect("the call ended");
        statuses.push((status, message));
    }
    let exhausted: Vec<&(String, String)> = statuses.iter().filter(|(s, _)| s == "8").collect();
    assert!(!exhausted.is_empty(), "{statuses:?}");
    assert!(exhausted[0].1.contains("from this caller"), "{statuses:?}");
    // Every other call ran out of time instead: none was served from a
    // body it never finished.
    assert!(
        statuses.iter().all(|(s, _)| s == "8" || s == "4"),
        "{statuses:?}"
    );
    let space = space_of(&agent.profile(request(200, "bounds")).await);
    assert!(!space.planes.is_empty());
}

/// A connection that never speaks does not keep its place: it is closed
/// after its deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_connection_is_closed_after_its_deadline() {
    let agent = AgentProcess::start(&["--mock-rate", "1000"]);
    let mut silent = TcpStream::connect(&agent.address)
        .await
        .expect("connecting");
    assert!(closed(&mut silent).await, "a silent connection was kept");
}

/// No connection keeps its place for good: past `--max-connection-age` an
/// idle one that answers every ping is still asked to go (and goes), while
/// a call in progress on an old connection finishes.
#[tokio::test(flavor = "multi_thread")]
async fn connections_past_their_age_are_sent_away_and_their_calls_finish() {
    let agent = AgentProcess::start(&["--mock-rate", "1000", "--max-connection-age", "1s"]);
    let io = TcpStream::connect(&agent.address)
        .await
        .expect("connecting");
    let (_client, connection) = h2::client::handshake(io).await.expect("HTTP/2");
    // The connection's driver answers the agent's pings for as long as it
    // runs; it ends when the agent closes the connection.
    let idle = tokio::spawn(connection);
    let ended = tokio::time::timeout(Duration::from_secs(15), idle).await;
    assert!(ended.is_ok(), "an idle connection was kept past its age");
    // A capture longer than the age, on one connection, is not cut short.
    let space = space_of(&agent.profile(request(2500, "aged")).await);
    assert!(!space.planes.is_empty());
}
