//! The tap between a raw HTTP/2 gRPC client and a real gRPC upstream (an
//! in-process hyper server): bytes, metadata, deadlines, statuses and
//! trailers pass unchanged; failures get the right status; and the agent's
//! captures through `devtrace serve --tap` show steps and eager ops, and a
//! slow step through it fires a slow-step trigger.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use devtrace::event::{Event, Payload};
use devtrace::model::registry::Registry;
use devtrace::ring::{Consumer, DropPolicy, Ring};
use devtrace::tap::decode::{EnqueueRequest, NamedTensor, Operation, QueueItem, RunStepRequest};
use devtrace::tap::{Recorder, Tap, TapStats};
use devtrace::xspace::read::{event_name, find_stat, StatValue};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::sync::mpsc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestBody = BoxBody<Bytes, BoxError>;

/// A body fed from a channel, so tests decide when each frame goes.
struct ChanBody(mpsc::Receiver<Result<Frame<Bytes>, BoxError>>);

impl Body for ChanBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx)
    }
}

fn channel() -> (mpsc::Sender<Result<Frame<Bytes>, BoxError>>, TestBody) {
    let (tx, rx) = mpsc::channel(16);
    (tx, ChanBody(rx).boxed())
}

fn empty() -> TestBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// A gRPC message: the 5-byte prefix and `body`.
fn grpc(compressed: bool, body: &[u8]) -> Bytes {
    let mut out = vec![u8::from(compressed)];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    Bytes::from(out)
}

/// The upstream: echoes every data frame as it arrives (so unary and
/// bidirectional streams work), reports the metadata and deadline it saw, and
/// has paths that fail, reset mid-call or hang until cancelled.
struct Upstream {
    address: SocketAddr,
    cancelled: Arc<AtomicUsize>,
}

async fn upstream() -> Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let cancelled = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&cancelled);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let counter = Arc::clone(&counter);
                    async move { Ok::<_, std::convert::Infallible>(handle(request, counter)) }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Upstream { address, cancelled }
}

fn handle(
    request: Request<hyper::body::Incoming>,
    cancelled: Arc<AtomicUsize>,
) -> Response<TestBody> {
    let path = request.uri().path().to_owned();
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .map_or("none".to_owned(), |v| v.to_str().unwrap_or("?").to_owned())
    };
    let saw_timeout = header("grpc-timeout");
    let meta = header("x-meta");
    let mut response = Response::builder()
        .header("content-type", "application/grpc")
        .header("x-reply-meta", meta);
    match path.as_str() {
        "/test.Echo/Fail" => {
            return response
                .header("grpc-status", "7")
                .header("grpc-message", "denied%20here")
                .body(empty())
                .unwrap();
        }
        "/test.Echo/Hang" => {
            let (tx, body) = channel();
            tokio::spawn(async move {
                tx.closed().await;
                cancelled.fetch_add(1, Ordering::SeqCst);
            });
            return response.body(body).unwrap();
        }
        _ => {}
    }
    if let Some(code) = request.headers().get("x-body-status") {
        // A RunStepResponse with `status_code` set and gRPC status OK, as
        // TensorFlow sends with store_errors_in_response_body.
        let code: u8 = code.to_str().unwrap().parse().unwrap();
        let (tx, body) = channel();
        tokio::spawn(async move {
            let _ = tx.send(Ok(Frame::data(grpc(false, &[0x18, code])))).await;
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            let _ = tx.send(Ok(Frame::trailers(trailers))).await;
        });
        return response.body(body).unwrap();
    }
    let reset = path == "/test.Echo/Reset";
    // A slow call: the echo waits this long before its first frame.
    let delay = request
        .headers()
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map(Duration::from_millis);
    let (tx, body) = channel();
    let mut incoming = request.into_body();
    tokio::spawn(async move {
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        while let Some(frame) = incoming.frame().await {
            let Ok(frame) = frame else { return };
            if let Ok(data) = frame.into_data() {
                if tx.send(Ok(Frame::data(data))).await.is_err() {
                    return;
                }
                if reset {
                    // Let the data go out before the stream is reset.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let _ = tx.send(Err("reset by the test".into())).await;
                    return;
                }
            }
        }
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("x-trailer", HeaderValue::from_static("done"));
        trailers.insert(
            "x-saw-timeout",
            HeaderValue::from_str(&saw_timeout).unwrap(),
        );
        let _ = tx.send(Ok(Frame::trailers(trailers))).await;
    });
    response = response.header("x-streaming", "yes");
    response.body(body).unwrap()
}

/// A tap in this process recording into a small ring we can read.
struct TapUnderTest {
    address: SocketAddr,
    recorder: Arc<Recorder>,
    registry: Arc<Registry>,
    consumer: Consumer,
}

async fn tap_to(upstream: &str) -> TapUnderTest {
    let registry = Registry::new();
    let ring = Ring::new(1, 4096, DropPolicy::DropNewest).unwrap();
    let recorder = Recorder::new(Arc::clone(&registry), ring.producer().unwrap());
    let tap = Tap::bind("127.0.0.1:0", upstream, Arc::clone(&recorder))
        .await
        .unwrap();
    let address = tap.local_addr().unwrap();
    tokio::spawn(tap.run(std::future::pending()));
    TapUnderTest {
        address,
        recorder,
        registry,
        consumer: ring.consumer().unwrap(),
    }
}

impl TapUnderTest {
    /// What the tap recorded of the calls that ended, once decoded.
    fn stats(&self) -> TapStats {
        assert!(
            self.recorder.settle(Duration::from_secs(10)),
            "decoded in time"
        );
        self.recorder.stats()
    }

    fn events(&mut self) -> Vec<Event> {
        assert!(
            self.recorder.settle(Duration::from_secs(10)),
            "decoded in time"
        );
        let mut out = Vec::new();
        self.consumer.drain(&mut out, usize::MAX);
        // The ring's lanes are drained one after another, not in time
        // order: the recorder's threads push on lanes of their own.
        out.sort_by_key(|event| event.start_ns);
        out
    }
}

async fn connect(address: SocketAddr) -> SendRequest<TestBody> {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    sender
}

fn request(path: &str, headers: &[(&str, &str)], body: TestBody) -> Request<TestBody> {
    let mut builder = Request::builder()
        .method("POST")
        .uri(format!("http://tap{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(body).unwrap()
}

/// What a client saw of one call.
struct Reply {
    headers: HeaderMap,
    data: Vec<u8>,
    trailers: HeaderMap,
}

impl Reply {
    /// grpc-status from the trailers, or the headers of a trailers-only reply.
    fn status(&self) -> u32 {
        self.trailers
            .get("grpc-status")
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .expect("a grpc-status")
    }
}

async fn unary(
    sender: &mut SendRequest<TestBody>,
    path: &str,
    headers: &[(&str, &str)],
    message: Bytes,
) -> Reply {
    let body = http_body_util::Full::new(message)
        .map_err(|never| match never {})
        .boxed();
    let response = sender
        .send_request(request(path, headers, body))
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let collected = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the reply in time")
        .unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    Reply {
        headers: parts.headers,
        data: collected.to_bytes().to_vec(),
        trailers,
    }
}

#[tokio::test]
async fn unary_calls_pass_bytes_metadata_deadlines_and_trailers_unchanged() {
    let upstream = upstream().await;
    let mut tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let message = grpc(false, b"\x0a\x03abc hello");
    let reply = unary(
        &mut client,
        "/test.Echo/Unary",
        &[("x-meta", "m-1"), ("grpc-timeout", "5S")],
        message.clone(),
    )
    .await;
    assert_eq!(reply.data, message);
    assert_eq!(reply.status(), 0);
    assert_eq!(reply.headers["x-reply-meta"], "m-1");
    assert_eq!(reply.trailers["x-trailer"], "done");
    assert_eq!(reply.trailers["x-saw-timeout"], "5S");

    // No deadline from the client: none reaches the upstream.
    let reply = unary(&mut client, "/test.Echo/Unary", &[], message.clone()).await;
    assert_eq!(reply.trailers["x-saw-timeout"], "none");
    assert_eq!(reply.headers["x-reply-meta"], "none");

    // A failing status and its message come back as the upstream sent them.
    let reply = unary(&mut client, "/test.Echo/Fail", &[], message.clone()).await;
    assert_eq!(reply.status(), 7);
    assert_eq!(reply.headers["grpc-message"], "denied%20here");
    assert!(reply.data.is_empty());

    let stats = tap.stats();
    assert_eq!(stats.calls, 3);
    assert_eq!(stats.failed, 1);
    let rpcs: Vec<_> = tap
        .events()
        .into_iter()
        .filter_map(|e| match e.payload() {
            Payload::Rpc(rpc) => Some(rpc),
            _ => None,
        })
        .collect();
    assert_eq!(rpcs.len(), 3);
    assert_eq!(rpcs[0].request_bytes, message.len() as u64);
    assert_eq!(rpcs[0].response_bytes, message.len() as u64);
    assert_eq!(rpcs[2].status, 7);
}

fn enqueue(context_id: u64, ops: &[(i64, &str)]) -> Bytes {
    let request = EnqueueRequest {
        context_id,
        queue: ops
            .iter()
            .map(|(id, name)| QueueItem {
                handle_to_decref: None,
                operation: Some(Operation {
                    id: *id,
                    name: (*name).into(),
                    device: "/job:localhost/replica:0/task:0/device:CPU:0".into(),
                }),
                send_tensor: None,
            })
            .collect(),
    };
    grpc(false, &request.encode_to_vec())
}

#[tokio::test]
async fn bidirectional_streams_interleave_and_their_ops_are_recorded() {
    let upstream = upstream().await;
    let mut tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let (tx, body) = channel();
    let response = client
        .send_request(request(
            "/tensorflow.eager.EagerService/StreamingEnqueue",
            &[],
            body,
        ))
        .await
        .unwrap();
    assert_eq!(response.headers()["x-streaming"], "yes");
    let mut replies = response.into_body();
    // Each message is echoed before the next is sent: nothing is buffered
    // until the end of the stream.
    let messages = [
        enqueue(77, &[(1, "MatMul"), (2, "AddV2")]),
        enqueue(77, &[(3, "Relu")]),
    ];
    let mut echoed = Vec::new();
    for message in &messages {
        // Split the message over two frames: the tap reassembles copies only.
        let (a, b) = message.split_at(3);
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(a))))
            .await
            .unwrap();
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(b))))
            .await
            .unwrap();
        let mut got = Vec::new();
        while got.len() < message.len() {
            let frame = tokio::time::timeout(Duration::from_secs(5), replies.frame())
                .await
                .expect("an echo before the stream ends")
                .unwrap()
                .unwrap();
            got.extend_from_slice(&frame.into_data().unwrap());
        }
        assert_eq!(got, message.as_ref());
        echoed.extend(got);
    }
    // The ops are in the ring while the stream is still open (an eager
    // context keeps its StreamingEnqueue open for its whole life).
    let events = tap.events();
    let snapshot = tap.registry.snapshot();
    let ops: Vec<(String, i64)> = events
        .into_iter()
        .filter_map(|e| match e.payload() {
            Payload::EagerOp {
                op_id, context_id, ..
            } => {
                assert_eq!(context_id, 77);
                Some((snapshot.name(e.name()).to_owned(), op_id))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        ops,
        vec![
            ("MatMul".to_owned(), 1),
            ("AddV2".to_owned(), 2),
            ("Relu".to_owned(), 3)
        ]
    );
    drop(tx);
    let rest = replies.collect().await.unwrap();
    assert_eq!(rest.trailers().unwrap()["grpc-status"], "0");
    assert!(rest.to_bytes().is_empty());
    assert_eq!(
        echoed.len(),
        messages.iter().map(|m| m.len()).sum::<usize>()
    );
    assert_eq!(tap.stats().eager_ops, 3);
}

#[tokio::test]
async fn run_steps_are_numbered_per_session_and_garbage_is_forwarded_and_counted() {
    let upstream = upstream().await;
    let mut tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let step = |session: &str| {
        let request = RunStepRequest {
            session_handle: session.into(),
            feed: vec![NamedTensor { name: "x:0".into() }],
            fetch: vec!["y:0".into(), "z:0".into()],
            target: vec!["train".into()],
            partial_run_handle: String::new(),
        };
        grpc(false, &request.encode_to_vec())
    };
    for session in ["a", "b", "a", "a"] {
        let message = step(session);
        let reply = unary(
            &mut client,
            "/tensorflow.MasterService/RunStep",
            &[],
            message.clone(),
        )
        .await;
        assert_eq!(reply.data, message);
    }
    // Undecodable and compressed messages pass untouched, and are counted.
    for message in [
        grpc(false, b"\xff\xff\xff\xff\xff"),
        grpc(true, b"\x1f\x8b zz"),
    ] {
        let reply = unary(
            &mut client,
            "/tensorflow.MasterService/RunStep",
            &[],
            message.clone(),
        )
        .await;
        assert_eq!(reply.data, message);
        assert_eq!(reply.status(), 0);
    }
    let stats = tap.stats();
    // The echoed RunStepRequests do not parse as RunStepResponses (field 3 is
    // a string there, an enum here): 4; the garbage request and its echo: 2;
    // the compressed request and its echo: 2.
    assert_eq!(stats.undecoded, 8);
    assert_eq!(stats.steps, 4);
    let snapshot = tap.registry.snapshot();
    let events = tap.events();
    let steps: Vec<i64> = events
        .iter()
        .filter_map(|e| match e.payload() {
            Payload::Step { step_num } => Some(step_num),
            _ => None,
        })
        .collect();
    assert_eq!(steps, vec![0, 0, 1, 2]);
    let first = events
        .iter()
        .find_map(|e| match e.payload() {
            Payload::Rpc(rpc) => Some(rpc),
            _ => None,
        })
        .unwrap();
    assert_eq!(snapshot.name(first.session), "a");
    assert_eq!(snapshot.name(first.fetches), "y:0,z:0");
    assert_eq!(snapshot.name(first.targets), "train");
    // A step that failed inside an OK response is recorded with its code.
    let reply = unary(
        &mut client,
        "/tensorflow.MasterService/RunStep",
        &[("x-body-status", "3")],
        step("a"),
    )
    .await;
    assert_eq!(reply.status(), 0, "forwarded as sent");
    let failed = tap
        .events()
        .into_iter()
        .find_map(|e| match e.payload() {
            Payload::Rpc(rpc) => Some(rpc),
            _ => None,
        })
        .unwrap();
    assert_eq!(failed.status, 3);
    assert!(snapshot
        .line_name(devtrace::event::Device::Host, events[0].line)
        .unwrap()
        .starts_with("tap #1 "));
}

#[tokio::test]
async fn messages_over_four_mebibytes_pass() {
    let upstream = upstream().await;
    let tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let big: Vec<u8> = (0..(6 << 20)).map(|i: u32| (i % 251) as u8).collect();
    for path in ["/test.Echo/Unary", "/tensorflow.MasterService/RunStep"] {
        let message = grpc(false, &big);
        let reply = unary(&mut client, path, &[], message.clone()).await;
        assert_eq!(reply.status(), 0);
        assert!(
            reply.data == message,
            "{path}: {} bytes back",
            reply.data.len()
        );
    }
}

#[tokio::test]
async fn an_unreachable_upstream_is_unavailable_and_the_tap_keeps_serving() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let tap = tap_to(&address.to_string()).await;
    let mut client = connect(tap.address).await;
    for _ in 0..2 {
        let reply = unary(&mut client, "/test.Echo/Unary", &[], grpc(false, b"x")).await;
        assert_eq!(reply.status(), 14);
        let message = reply.headers["grpc-message"].to_str().unwrap();
        assert!(message.contains("unavailable"), "{message}");
    }
    assert_eq!(tap.stats().failed, 2);
}

/// A call whose client gives up before the upstream answers at all ends
/// (cancelled) rather than stay open: a stopping tap waited for such calls
/// in vain, and named them cut off.
#[tokio::test]
async fn a_call_given_up_before_the_upstream_answers_is_not_left_open() {
    // Accepts, and never says a word of HTTP/2.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming() {
            held.push(stream);
        }
    });
    let tap = tap_to(&address.to_string()).await;
    let mut client = connect(tap.address).await;
    let call = unary(&mut client, "/test.Echo/Unary", &[], grpc(false, b"x"));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err(),
        "no answer"
    );
    // It reached the tap, which holds it open while the upstream is silent.
    assert_eq!(tap.recorder.calls_in_progress(), 1);
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while tap.recorder.calls_in_progress() > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(tap.recorder.calls_in_progress(), 0);
}

/// A tap whose upstream leads back to itself answers FAILED_PRECONDITION,
/// naming the loop, instead of forwarding each call to itself until the
/// client gives up.
#[tokio::test]
async fn a_tap_forwarding_to_itself_refuses_the_call_it_sees_again() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = free.local_addr().unwrap().to_string();
    drop(free);
    let registry = Registry::new();
    let ring = Ring::new(1, 4096, DropPolicy::DropNewest).unwrap();
    let recorder = Recorder::new(Arc::clone(&registry), ring.producer().unwrap());
    let tap = Tap::bind(&address, &address, Arc::clone(&recorder))
        .await
        .unwrap();
    tokio::spawn(tap.run(std::future::pending()));
    let mut client = connect(address.parse().unwrap()).await;
    let reply = unary(&mut client, "/test.Echo/Unary", &[], grpc(false, b"x")).await;
    assert_eq!(reply.status(), 9);
    let message = reply.headers["grpc-message"].to_str().unwrap();
    assert!(
        message.contains("came back to the tap that forwarded it"),
        "{message}"
    );
}

#[tokio::test]
async fn an_upstream_reset_mid_call_ends_it_unavailable() {
    let upstream = upstream().await;
    let tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let message = grpc(false, b"partial");
    let reply = unary(&mut client, "/test.Echo/Reset", &[], message.clone()).await;
    assert_eq!(reply.data, message, "what came before the reset arrives");
    assert_eq!(reply.status(), 14);
    // The same client connection still works.
    let reply = unary(&mut client, "/test.Echo/Unary", &[], message.clone()).await;
    assert_eq!(reply.status(), 0);
    assert_eq!(reply.data, message);
}

#[tokio::test]
async fn a_client_cancel_reaches_the_upstream_and_others_are_served() {
    let upstream = upstream().await;
    let tap = tap_to(&upstream.address.to_string()).await;
    let mut client = connect(tap.address).await;
    let (tx, body) = channel();
    let response = client
        .send_request(request("/test.Echo/Hang", &[], body))
        .await
        .unwrap();
    tx.send(Ok(Frame::data(grpc(false, b"wait"))))
        .await
        .unwrap();
    drop(response);
    drop(tx);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while upstream.cancelled.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream never saw the cancel"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut other = connect(tap.address).await;
    let reply = unary(&mut other, "/test.Echo/Unary", &[], grpc(false, b"ok")).await;
    assert_eq!(reply.status(), 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tap.stats().calls < 2 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(tap.stats().failed, 1, "the cancelled call");
}

/// `devtrace serve` (killed when dropped).
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `devtrace serve --tap` in front of `upstream`, with `extra` flags: the
/// process, the agent's address and the tap's.
fn serve_with_tap(upstream: &Upstream, extra: &[&str]) -> (Kill, String, SocketAddr) {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--log-level", "warn"])
        .args(["--metrics-listen", "off", "--mock-rate", "0", "--tap"])
        .arg(format!("127.0.0.1:0={}", upstream.address))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || lines.next().unwrap().unwrap();
    let agent = next()
        .strip_prefix("devtrace listening on ")
        .unwrap()
        .to_owned();
    let tap_line = next();
    let tap_address: SocketAddr = tap_line
        .strip_prefix("devtrace tap listening on ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    (Kill(child), agent, tap_address)
}

#[tokio::test]
async fn serve_tap_captures_show_steps_and_enqueued_ops() {
    let upstream = upstream().await;
    let (_agent, agent, tap_address) = serve_with_tap(&upstream, &[]);
    let channel = tonic::transport::Channel::from_shared(format!("http://{agent}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut profiler =
        devtrace::proto::tensorflow::profiler_service_client::ProfilerServiceClient::new(channel)
            .max_decoding_message_size(usize::MAX);
    let capture = tokio::spawn(async move {
        profiler
            .profile(common::request(1500, "tap"))
            .await
            .unwrap()
            .into_inner()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = connect(tap_address).await;
    for _ in 0..3 {
        let request = RunStepRequest {
            session_handle: "sess".into(),
            fetch: vec!["loss:0".into()],
            ..RunStepRequest::default()
        };
        let reply = unary(
            &mut client,
            "/tensorflow.MasterService/RunStep",
            &[],
            grpc(false, &request.encode_to_vec()),
        )
        .await;
        assert_eq!(reply.status(), 0);
    }
    let reply = unary(
        &mut client,
        "/tensorflow.eager.EagerService/Enqueue",
        &[],
        enqueue(5, &[(10, "MatMul"), (11, "Softmax")]),
    )
    .await;
    assert_eq!(reply.status(), 0);
    let space = space_of(&capture.await.unwrap());
    let host = plane(&space, "/host:CPU");
    let mut steps = Vec::new();
    let mut ops = Vec::new();
    for line in &host.lines {
        for event in &line.events {
            let name = event_name(host, event);
            if let Some(StatValue::Int(step)) = find_stat(host, &event.stats, "step_num") {
                assert_eq!(name, "tensorflow.MasterService/RunStep");
                assert_eq!(find_stat(host, &event.stats, "_r"), Some(StatValue::Int(1)));
                steps.push(step);
            }
            if let Some(StatValue::Int(id)) = find_stat(host, &event.stats, "op_id") {
                let device = find_stat(host, &event.stats, "device");
                assert_eq!(
                    device,
                    Some(StatValue::Str(
                        "/job:localhost/replica:0/task:0/device:CPU:0".into()
                    ))
                );
                ops.push((name.to_owned(), id));
            }
            if name == "tensorflow.MasterService/RunStep"
                && find_stat(host, &event.stats, "grpc_status").is_some()
            {
                assert_eq!(
                    find_stat(host, &event.stats, "session"),
                    Some(StatValue::Str("sess".into()))
                );
            }
        }
    }
    steps.sort();
    assert_eq!(steps, vec![0, 1, 2]);
    assert_eq!(
        ops,
        vec![("MatMul".to_owned(), 10), ("Softmax".to_owned(), 11)]
    );
}

#[tokio::test]
async fn standalone_tap_serves_captures_of_its_own_events() {
    let upstream = upstream().await;
    let (child, tap_address, mut lines) = standalone_tap(
        &upstream,
        &[
            "--profiler-listen",
            "127.0.0.1:0",
            "--summary-every",
            "0",
            "--log-level",
            "warn",
        ],
        Stdio::inherit(),
    );
    let agent_line = lines.next().unwrap().unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    let agent = agent_line
        .strip_prefix("devtrace listening on ")
        .unwrap()
        .to_owned();
    let mut client = connect(tap_address).await;
    let message = grpc(false, b"standalone");
    let reply = unary(&mut client, "/test.Echo/Unary", &[], message.clone()).await;
    assert_eq!(reply.data, message);
    let channel = tonic::transport::Channel::from_shared(format!("http://{agent}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut profiler =
        devtrace::proto::tensorflow::profiler_service_client::ProfilerServiceClient::new(channel)
            .max_decoding_message_size(usize::MAX);
    let mut capture = common::request(300, "standalone");
    if let Some(opts) = capture.opts.as_mut() {
        opts.start_timestamp_ns -= 2_000_000_000;
        opts.duration_ms = 2300;
    }
    capture.duration_ms = 2300;
    let space = space_of(&profiler.profile(capture).await.unwrap().into_inner());
    let host = plane(&space, "/host:CPU");
    let names: Vec<&str> = host
        .lines
        .iter()
        .flat_map(|l| l.events.iter().map(|e| event_name(host, e)))
        .collect();
    assert_eq!(names, vec!["test.Echo/Unary"]);
    // The tap's agent has no device backend: no made-up device planes.
    let devices: Vec<&str> = space
        .planes
        .iter()
        .map(|plane| plane.name.as_str())
        .filter(|name| name.starts_with("/device:"))
        .collect();
    assert!(devices.is_empty(), "{devices:?}");
}

#[tokio::test]
async fn a_slow_run_step_through_the_tap_fires_a_slow_step_trigger() {
    let upstream = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let repository = dir.path().join("plugins/profile");
    let (_agent, _, tap_address) = serve_with_tap(
        &upstream,
        &[
            "--allow-root",
            root,
            "--trigger-repository",
            repository.to_str().unwrap(),
            "--trigger",
            "name=slow-run; when=step > 3x median(5); before=5s; after=100ms",
        ],
    );
    let mut client = connect(tap_address).await;
    let request = RunStepRequest {
        session_handle: "sess".into(),
        fetch: vec!["loss:0".into()],
        ..RunStepRequest::default()
    };
    let message = grpc(false, &request.encode_to_vec());
    for delay in ["20", "20", "20", "20", "20", "20", "300", "20"] {
        let path = "/tensorflow.MasterService/RunStep";
        let reply = unary(&mut client, path, &[("x-delay-ms", delay)], message.clone()).await;
        assert_eq!(reply.status(), 0);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let trace = loop {
        let found = std::fs::read_dir(&repository)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .flat_map(|session| std::fs::read_dir(session.path()).into_iter().flatten())
            .filter_map(Result::ok)
            .map(|file| file.path())
            .find(|path| path.to_string_lossy().ends_with(".xplane.pb"));
        if let Some(trace) = found {
            break trace;
        }
        assert!(std::time::Instant::now() < deadline, "no trigger session");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let space = devtrace::xspace::read::read_xspace(&trace).unwrap();
    let env = plane(&space, "Task Environment");
    let Some(StatValue::Str(value)) = find_stat(env, &env.stats, "trigger.value") else {
        panic!("no trigger.value");
    };
    // The seventh step, the slow one: steps are numbered from 0.
    assert!(value.starts_with("step 6 took "), "{value}");
    let Some(StatValue::Str(fired_at)) = find_stat(env, &env.stats, "trigger.fired_at_ns") else {
        panic!("no trigger.fired_at_ns");
    };
    let fired_at: u64 = fired_at.parse().unwrap();
    let (start, _) = window_of(&space);
    let host = plane(&space, "/host:CPU");
    let mut ends: Vec<u64> = host
        .lines
        .iter()
        .flat_map(|line| line.events.iter().map(move |event| (line, event)))
        .filter(|(_, event)| find_stat(host, &event.stats, "step_num").is_some())
        .map(|(line, event)| {
            let begin = devtrace::xspace::read::event_start_ps(line.timestamp_ns, event);
            start + ((begin + event.duration_ps) / 1000) as u64
        })
        .collect();
    ends.sort_unstable();
    // Six steps before the slow one, which ends at the firing.
    assert_eq!(
        ends.iter().filter(|end| **end < fired_at).count(),
        6,
        "{ends:?}"
    );
    assert!(
        ends.contains(&fired_at),
        "no step ends at the firing: {ends:?}"
    );
}

/// An address that is taken fails the command before it says it listens on
/// any: scripts wait for that line (it came first, then the failure).
#[test]
fn a_busy_address_fails_before_anything_is_announced() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = held.local_addr().unwrap().to_string();
    let serve =
        common::serve_to_end(&["--backend", "mock", "--tap", &format!("{busy}=127.0.0.1:1")]);
    let tap = Command::new(BIN)
        .args([
            "tap",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "127.0.0.1:1",
        ])
        .args(["--profiler-listen", &busy])
        .output()
        .unwrap();
    for out in [serve, tap] {
        let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
        assert!(!out.status.success(), "{stderr}");
        assert!(!stdout.contains("listening"), "{stdout}");
        assert!(stderr.contains("Address already in use"), "{stderr}");
    }
}

/// A stopping tap lets the calls in progress end (up to 10 s), saying so,
/// and a second signal cuts the rest off, saying how many: calls were cut
/// at the first signal, unsaid and uncounted.
#[tokio::test]
async fn a_stopping_tap_lets_calls_in_progress_end_and_names_those_it_cuts() {
    let upstream = upstream().await;
    let (mut child, tap_address, _) = standalone_tap(
        &upstream,
        &["--summary-every", "0", "--log-level", "info"],
        Stdio::piped(),
    );
    let logged = common::read_in_background(child.stderr.take().unwrap());
    let mut slow_client = connect(tap_address).await;
    let slow = tokio::spawn(async move {
        let message = grpc(false, b"slow");
        let reply = unary(
            &mut slow_client,
            "/test.Echo/Unary",
            &[("x-delay-ms", "1500")],
            message.clone(),
        )
        .await;
        (reply.status(), reply.data == message)
    });
    let mut hanging_client = connect(tap_address).await;
    let hanging = tokio::spawn(async move {
        let body = http_body_util::Full::new(grpc(false, b"x"))
            .map_err(|never| match never {})
            .boxed();
        // Its reply held open: the call goes on until the tap cuts it.
        let _reply = hanging_client
            .send_request(request("/test.Echo/Hang", &[], body))
            .await;
        std::future::pending::<()>().await;
    });
    let mut idle_client = connect(tap_address).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = child.id() as libc::pid_t;
    // SAFETY: signalling a child of this test.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(slow.await.unwrap(), (0, true), "the slow call ends whole");
    // A connection open before the stop takes no new call (GOAWAY): the
    // drain would otherwise never end for a client calling every step.
    let body = http_body_util::Full::new(grpc(false, b"late"))
        .map_err(|never| match never {})
        .boxed();
    let late = idle_client
        .send_request(request("/test.Echo/Unary", &[], body))
        .await;
    assert!(late.is_err(), "a call after the stop was taken: {late:?}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    hanging.abort();
    let log = logged.join().unwrap();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        log.contains("taps: waiting at most 10 s for the calls in progress to end")
            && log.contains("calls=2"),
        "{log}"
    );
    let cut = log
        .lines()
        .find(|line| line.contains("taps: stopping with calls still in progress"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(cut.contains("calls=1"), "{cut}");
}

/// `devtrace tap --listen 127.0.0.1:0 --upstream UPSTREAM <extra>`, once it
/// has said where it listens: the child, that address and the rest of its
/// standard output.
fn standalone_tap(
    upstream: &Upstream,
    extra: &[&str],
    stderr: Stdio,
) -> (
    std::process::Child,
    SocketAddr,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut child = Command::new(BIN)
        .args(["tap", "--listen", "127.0.0.1:0", "--upstream"])
        .arg(upstream.address.to_string())
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let tap_line = lines.next().unwrap().unwrap();
    let address = tap_line
        .strip_prefix("devtrace tap listening on ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    (child, address, lines)
}
