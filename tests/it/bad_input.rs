//! Every malformed request field is refused with INVALID_ARGUMENT naming the
//! field, and the agent keeps serving.

use crate::common;

use common::*;
use devtrace::proto::tensorflow::{
    GetSnapshotRequest, MonitorRequest, ProfileRequest, TerminateRequest,
};
use tonic::Code;

fn expect_invalid(
    result: Result<tonic::Response<impl std::fmt::Debug>, tonic::Status>,
    field: &str,
) {
    let status = result.expect_err("must be refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(&format!("{field}: ")),
        "message should name {field}: {}",
        status.message()
    );
}

fn with(mut req: ProfileRequest, change: impl FnOnce(&mut ProfileRequest)) -> ProfileRequest {
    change(&mut req);
    req
}

#[tokio::test]
async fn profile_fields_are_validated() {
    let mut agent = AgentProcess::start(&["--max-duration", "5s"]);
    let mut client = agent.client().await;
    let base = request(100, "ok");
    let cases: Vec<(&str, ProfileRequest)> = vec![
        (
            "opts.duration_ms",
            with(base.clone(), |r| {
                r.opts.as_mut().unwrap().duration_ms = 0;
                r.duration_ms = 0;
            }),
        ),
        (
            "opts.duration_ms",
            with(base.clone(), |r| {
                r.opts.as_mut().unwrap().duration_ms = 10_000
            }),
        ),
        (
            "duration_ms",
            with(base.clone(), |r| {
                r.opts = None;
                r.duration_ms = 0;
            }),
        ),
        (
            "opts.start_timestamp_ns",
            with(base.clone(), |r| {
                r.opts.as_mut().unwrap().start_timestamp_ns = now_ns() + 3_600_000_000_000;
            }),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "a/b".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "..".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "a\\b".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "nul\0".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "bell\u{7}".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "run\u{202e}gpj.exe".into()),
        ),
        (
            "session_id",
            with(base.clone(), |r| r.session_id = "two\u{2028}lines".into()),
        ),
        (
            "host_name",
            with(base.clone(), |r| r.host_name = "../etc".into()),
        ),
        (
            "host_name",
            with(base.clone(), |r| r.host_name = "h/x:1".into()),
        ),
        // A valid name, too long for the trace's file name (with
        // `.xplane.riegeli`): it fell back to an inline reply, leaving an
        // empty session directory.
        (
            "host_name",
            with(base.clone(), |r| r.host_name = "h".repeat(250)),
        ),
        (
            "opts.override_hostname",
            with(base.clone(), |r| {
                r.opts.as_mut().unwrap().override_hostname = "h".repeat(241)
            }),
        ),
        (
            "opts.override_hostname",
            with(base.clone(), |r| {
                r.opts.as_mut().unwrap().override_hostname = "x/y".into();
            }),
        ),
        (
            "repository_root",
            with(base.clone(), |r| r.repository_root = "/tmp/a\0b".into()),
        ),
    ];
    for (field, req) in cases {
        expect_invalid(client.profile(req.clone()).await, field);
        let open_ended = req.duration_ms == 0;
        if !open_ended {
            // Continuous sessions may omit a duration; all else is checked alike.
            expect_invalid(client.start_continuous_profiling(req).await, field);
        }
    }
    expect_invalid(
        client
            .terminate(TerminateRequest {
                session_id: "x/../y".into(),
            })
            .await,
        "session_id",
    );
    expect_invalid(
        client
            .get_snapshot(GetSnapshotRequest {
                snapshot_session_id: "../up".into(),
            })
            .await,
        "snapshot_session_id",
    );
    for (duration_ms, level) in [(0, 1), (10_000, 1), (100, 7)] {
        let result = client
            .monitor(MonitorRequest {
                duration_ms,
                monitoring_level: level,
                timestamp: false,
            })
            .await;
        let field = if level == 7 {
            "monitoring_level"
        } else {
            "duration_ms"
        };
        expect_invalid(result, field);
    }
    // After all that, a good request still works.
    let reply = client.profile(base).await.unwrap().into_inner();
    assert!(!reply.empty_trace);
    assert!(agent.is_running());
}

/// A window that ends after the call's own deadline is refused at once,
/// naming both: its reply could never arrive (the call was dropped at its
/// deadline, the window recorded for no one, and the log said nothing of
/// why).
#[tokio::test]
async fn a_window_ending_after_the_calls_deadline_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let mut later = request(50, "later");
    later.opts.as_mut().unwrap().start_timestamp_ns = now_ns() + 30_000_000_000;
    let mut call = tonic::Request::new(later.clone());
    call.set_timeout(std::time::Duration::from_secs(5));
    let refused = agent.client().await.profile(call).await;
    expect_invalid(refused, "opts");

    let mut session = session_request(dir.path(), &[&agent.address], "later");
    session.request = Some(later);
    let mut call = tonic::Request::new(session);
    call.set_timeout(std::time::Duration::from_secs(5));
    let status = agent
        .analysis()
        .await
        .new_session(call)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("request.opts: the window ends 30.")
            && status.message().contains("after this call's deadline (")
            && status
                .message()
                .contains("s from now, by its grpc-timeout)"),
        "{status:?}"
    );
    assert!(!dir.path().join("later").exists());

    // Within the deadline, served.
    let mut call = tonic::Request::new(request(50, "sooner"));
    call.set_timeout(std::time::Duration::from_secs(5));
    agent.client().await.profile(call).await.expect("served");
}
