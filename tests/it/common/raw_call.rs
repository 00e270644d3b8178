//! `Profile` calls over a bare HTTP/2 connection, for what tonic's client
//! never does: stop sending a body half way, or stop reading a reply.

use std::net::SocketAddr;

use bytes::Bytes;
use tokio::net::{TcpSocket, TcpStream};

/// A call started on a connection of its own: the connection, the reply to
/// come and the request body's stream.
pub struct RawCall {
    pub client: h2::client::SendRequest<Bytes>,
    pub response: h2::client::ResponseFuture,
    pub body: h2::SendStream<Bytes>,
}

/// A connection to `to` from the loopback address `from` (127.0.0.0/8 is
/// all loopback), so that the agent sees another peer than the test's
/// other calls, which come from 127.0.0.1.
pub async fn connect_from(uid: u32, from: [u8; 4], to: &str) -> TcpStream {
    let to: SocketAddr = to.parse().expect("an address");
    // The socket is its maker's: the agent names (and bounds) a local
    // caller by the owner of its end.
    let user = devtrace::repository::acting::Credentials {
        uid,
        gid: uid,
        groups: Vec::new(),
    };
    let socket = user
        .run(|| {
            let socket = TcpSocket::new_v4()?;
            socket.bind(SocketAddr::from((from, 0)))?;
            Ok::<_, std::io::Error>(socket)
        })
        .expect("acting as the user")
        .expect("a socket bound to a loopback address");
    socket.connect(to).await.expect("connecting")
}

/// Starts a `Profile` call to the agent at `address` and sends `first` as
/// the start of its body, leaving the body open.
pub async fn start_profile_call(address: &str, first: Bytes) -> RawCall {
    let io = TcpStream::connect(address).await.expect("connecting");
    start_profile_call_on(io, address, first).await
}

/// Starts a `Profile` call whose body stops after `sent` of the `claimed`
/// bytes its gRPC frame announces, from the loopback address `from`, as
/// user `uid`.
pub async fn half_sent_call_from(
    uid: u32,
    from: [u8; 4],
    address: &str,
    claimed: u32,
    sent: usize,
) -> RawCall {
    let io = connect_from(uid, from, address).await;
    start_profile_call_on(io, address, half_frame(claimed, sent)).await
}

/// Starts a `Profile` call whose body stops after `sent` of the `claimed`
/// bytes its gRPC frame announces.
pub async fn half_sent_call(address: &str, claimed: u32, sent: usize) -> RawCall {
    start_profile_call(address, half_frame(claimed, sent)).await
}

/// The start of a gRPC frame announcing `claimed` bytes, `sent` of them.
fn half_frame(claimed: u32, sent: usize) -> Bytes {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&claimed.to_be_bytes());
    frame.resize(5 + sent, 0x08);
    Bytes::from(frame)
}

/// As [`start_profile_call`], on the connection `io`.
async fn start_profile_call_on(io: TcpStream, address: &str, first: Bytes) -> RawCall {
    let (client, connection) = h2::client::handshake(io).await.expect("HTTP/2");
    tokio::spawn(connection);
    let mut client = client.ready().await.expect("ready");
    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{address}/tensorflow.ProfilerService/Profile"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a request");
    let (response, mut body) = client.send_request(request, false).expect("a stream");
    body.send_data(first, false).expect("sending");
    RawCall {
        client,
        response,
        body,
    }
}

/// `message` framed as one uncompressed gRPC message.
pub fn grpc_frame(message: &impl prost::Message) -> Bytes {
    let encoded = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    frame.extend_from_slice(&encoded);
    Bytes::from(frame)
}

/// Reads a reply's whole body, giving its flow-control window back as it
/// goes, and returns its message bytes (past the gRPC prefix) and its gRPC
/// status.
pub async fn read_reply(response: h2::client::ResponseFuture) -> (Vec<u8>, tonic::Status) {
    let response = response.await.expect("a response");
    let headers = response.headers().clone();
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.expect("reply data");
        let _ = body.flow_control().release_capacity(data.len());
        bytes.extend_from_slice(&data);
    }
    let status = match tonic::Status::from_header_map(&headers) {
        Some(status) => status,
        None => {
            let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
            tonic::Status::from_header_map(&trailers).expect("a grpc-status")
        }
    };
    (bytes.get(5..).unwrap_or_default().to_vec(), status)
}

/// A connection to `to` whose socket belongs to `uid`: made on a thread
/// whose filesystem uid is `uid`, as a process of that user would make it,
/// so that the agent takes its caller to be that user. Needs root.
pub async fn connect_as(uid: u32, to: &str) -> TcpStream {
    let to: SocketAddr = to.parse().expect("an address");
    let user = devtrace::repository::acting::Credentials {
        uid,
        gid: uid,
        groups: Vec::new(),
    };
    let stream = user
        .run(|| std::net::TcpStream::connect(to))
        .expect("acting as the user")
        .expect("connecting");
    stream.set_nonblocking(true).expect("non-blocking");
    TcpStream::from_std(stream).expect("a tokio stream")
}

/// One unary call of `path` (`/package.Service/Method`) carrying `message`
/// on the connection `io`: the reply's message bytes and its status.
pub async fn unary_on(
    io: TcpStream,
    address: &str,
    path: &str,
    message: &impl prost::Message,
) -> (Vec<u8>, tonic::Status) {
    unary_with_headers(io, address, path, message, &[]).await
}

/// As [`unary_on`], with `headers` too (a `grpc-timeout` no client of
/// tonic's would also enforce itself).
pub async fn unary_with_headers(
    io: TcpStream,
    address: &str,
    path: &str,
    message: &impl prost::Message,
    headers: &[(&str, &str)],
) -> (Vec<u8>, tonic::Status) {
    let (client, connection) = h2::client::handshake(io).await.expect("HTTP/2");
    tokio::spawn(connection);
    let mut client = client.ready().await.expect("ready");
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{address}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(()).expect("a request");
    let (response, mut body) = client.send_request(request, false).expect("a stream");
    body.send_data(grpc_frame(message), true).expect("sending");
    read_reply(response).await
}

/// A NewSession made as `uid` over a connection of that user's: the
/// call answers OK, and this is its reply.
pub async fn new_session_as(
    uid: u32,
    address: &str,
    request: &devtrace::proto::tensorflow::NewProfileSessionRequest,
) -> devtrace::proto::tensorflow::NewProfileSessionResponse {
    let io = connect_as(uid, address).await;
    let path = "/tensorflow.ProfileAnalysis/NewSession";
    let (reply, status) = unary_on(io, address, path, request).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    prost::Message::decode(&reply[..]).expect("a NewSession reply")
}
