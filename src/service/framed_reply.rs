//! Capture replies sent from the trace's own bytes.
//!
//! tonic encodes every reply into a buffer of its own and holds it until the
//! client has read it: for a trace, a copy of the whole trace per capture
//! (32 clients of one 129 MiB window held 4 GB at once). A capture instead
//! frames its reply as a gRPC message whose few bytes of fields lead into
//! the parts of the encoded trace ([`crate::xspace::Encoded`]), shared, not
//! copied, and attaches it to the reply's extensions ([`FramedReply`]).
//! [`FramedRepliesLayer`] then sends those bytes in place of tonic's body,
//! in slices, so that HTTP/2 flow control paces each slice. What the trace
//! needs to stay alive (its build's memory reservation) is held until the
//! last slice is handed to the connection.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;

use crate::protocol::listen;
use crate::xspace::wire::{varint_len, Writer};

/// How much of a part is handed to the connection at a time: small enough
/// that a slow reader holds back little beyond the shared trace, large
/// enough that slicing costs nothing measurable.
const SLICE_BYTES: usize = 1 << 20;

/// Field numbers of `ProfileResponse` and `ProfileToolData`
/// (profiler_service.proto).
const RESPONSE_TOOL_DATA: u32 = 6;
const RESPONSE_EMPTY_TRACE: u32 = 7;
const RESPONSE_XSPACE: u32 = 8;
/// Field numbers of `ProfileSessionDataResponse` (profiler_analysis.proto).
const SESSION_DATA_FORMAT: u32 = 2;
const SESSION_DATA_OUTPUT: u32 = 3;
const TOOL_DATA_NAME: u32 = 1;
const TOOL_DATA_DATA: u32 = 2;

/// One reply, framed for gRPC (an uncompressed flag byte and a big-endian
/// length before the message), as parts sent one after another, and
/// whatever must live until it is sent.
#[derive(Clone)]
pub struct FramedReply {
    parts: Vec<Bytes>,
    _keep_alive: Option<Arc<dyn Any + Send + Sync>>,
}

impl FramedReply {
    /// A `ProfileResponse` carrying one tool's data, `data` one part after
    /// another: `{ tool_data: [{ name, data }], empty_trace }`.
    pub fn tool_data(name: &str, data: &[Bytes], empty_trace: bool) -> FramedReply {
        let data_len: usize = data.iter().map(Bytes::len).sum();
        // Empty fields are left out, as proto3 encoders do.
        let field_if_any = |number: u32, len: usize| {
            if len > 0 {
                field_len(number, len)
            } else {
                0
            }
        };
        let tool_len =
            field_if_any(TOOL_DATA_NAME, name.len()) + field_if_any(TOOL_DATA_DATA, data_len);
        let tail = empty_trace_field(empty_trace);
        let mut head = grpc_prefix(field_len(RESPONSE_TOOL_DATA, tool_len) + tail.len());
        head.message_prefix(RESPONSE_TOOL_DATA, tool_len);
        head.text(TOOL_DATA_NAME, name);
        if data_len > 0 {
            head.message_prefix(TOOL_DATA_DATA, data_len);
        }
        FramedReply::assemble(head, data, tail)
    }

    /// A `ProfileResponse` carrying an encoded XSpace inline, `data` one
    /// part after another: `{ xspace, empty_trace }`, as `emit_xspace` and
    /// `GetSnapshot` ask for it.
    pub fn xspace(data: &[Bytes], empty_trace: bool) -> FramedReply {
        let data_len: usize = data.iter().map(Bytes::len).sum();
        let tail = empty_trace_field(empty_trace);
        let mut head = grpc_prefix(field_len(RESPONSE_XSPACE, data_len) + tail.len());
        head.message_prefix(RESPONSE_XSPACE, data_len);
        FramedReply::assemble(head, data, tail)
    }

    /// A `ProfileSessionDataResponse` carrying a tool's output:
    /// `{ output_format, output }`.
    pub fn session_data(output_format: &str, output: Bytes) -> FramedReply {
        let format_len = if output_format.is_empty() {
            0
        } else {
            field_len(SESSION_DATA_FORMAT, output_format.len())
        };
        let output_len = if output.is_empty() {
            0
        } else {
            field_len(SESSION_DATA_OUTPUT, output.len())
        };
        let mut head = grpc_prefix(format_len + output_len);
        head.text(SESSION_DATA_FORMAT, output_format);
        if !output.is_empty() {
            head.message_prefix(SESSION_DATA_OUTPUT, output.len());
        }
        FramedReply::assemble(head, &[output], Vec::new())
    }

    fn assemble(head: Writer, data: &[Bytes], tail: Vec<u8>) -> FramedReply {
        let mut parts = Vec::with_capacity(data.len() + 2);
        parts.push(Bytes::from(head.into_bytes()));
        parts.extend(data.iter().filter(|part| !part.is_empty()).cloned());
        if !tail.is_empty() {
            parts.push(Bytes::from(tail));
        }
        FramedReply {
            parts,
            _keep_alive: None,
        }
    }

    /// The same reply, keeping `owner` alive until it has been sent.
    pub fn keeping(self, owner: Arc<dyn Any + Send + Sync>) -> FramedReply {
        FramedReply {
            _keep_alive: Some(owner),
            ..self
        }
    }

    /// Attaches the reply to `response`, whose own message is then not sent.
    pub fn attach<T>(self, response: &mut tonic::Response<T>) {
        response.extensions_mut().insert(self);
    }
}

/// Bytes a length-delimited field of `len` bytes takes, key and length
/// included: lengths come first, as the gRPC prefix and each nested
/// message state them.
fn field_len(number: u32, len: usize) -> usize {
    varint_len(u64::from(number) << 3) + varint_len(len as u64) + len
}

/// `empty_trace`, when set (proto3 leaves a false bool out).
fn empty_trace_field(empty_trace: bool) -> Vec<u8> {
    let mut tail = Writer::default();
    if empty_trace {
        tail.uint(RESPONSE_EMPTY_TRACE, 1);
    }
    tail.into_bytes()
}

/// A writer holding the gRPC prefix of a `message_len`-byte message: an
/// uncompressed flag byte and the big-endian length.
fn grpc_prefix(message_len: usize) -> Writer {
    let mut head = Writer::with_capacity(128);
    head.raw(&[0]);
    // The caller keeps replies under `MAX_REPLY_BYTES` (i32::MAX).
    head.raw(&u32::try_from(message_len).unwrap_or(u32::MAX).to_be_bytes());
    head
}

/// Sends the [`FramedReply`] a response carries instead of its body.
#[derive(Clone, Default)]
pub struct FramedRepliesLayer;

impl<S> tower_layer::Layer<S> for FramedRepliesLayer {
    type Service = FramedReplies<S>;

    fn layer(&self, inner: S) -> FramedReplies<S> {
        FramedReplies { inner }
    }
}

/// See [`FramedRepliesLayer`].
#[derive(Clone)]
pub struct FramedReplies<S> {
    inner: S,
}

impl<S, B> tower_service::Service<http::Request<B>> for FramedReplies<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let closer = listen::connection_of(request.extensions()).map(|c| c.closer.clone());
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            if let Some(reply) = response.extensions_mut().remove::<FramedReply>() {
                let body = FramedBody::new(reply);
                if let Some(closer) = closer {
                    body.give_up_after(send_deadline(body.len), closer);
                }
                *response.body_mut() = tonic::body::Body::new(body);
            }
            Ok(response)
        })
    }
}

/// How long a reply may take to be read: a base for any reply, and time for
/// its bytes at [`SLOWEST_READER`]. A client that reads slower than that (or
/// not at all) holds its trace, and its share of `--capture-memory`, no
/// longer: its connection is closed.
pub fn send_deadline(bytes: usize) -> std::time::Duration {
    SEND_DEADLINE_BASE + std::time::Duration::from_secs((bytes / SLOWEST_READER) as u64)
}

/// See [`send_deadline`].
pub const SEND_DEADLINE_BASE: std::time::Duration = std::time::Duration::from_secs(20);

/// Bytes a second the slowest reader a reply waits for reads.
pub const SLOWEST_READER: usize = 1 << 20;

/// A slice handed to the connection, holding what it came from (and the
/// reply's share of memory, and its deadline's watch) until the connection
/// has written it and let it go.
struct InFlight {
    bytes: Bytes,
    _sending: Option<Arc<()>>,
    _keep_alive: Option<Arc<dyn Any + Send + Sync>>,
}

impl AsRef<[u8]> for InFlight {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// The body of a framed reply: its parts in slices, then the OK status.
struct FramedBody {
    /// The part being sent, what is left of it.
    current: Bytes,
    /// The parts after it, in order.
    next: std::vec::IntoIter<Bytes>,
    /// Bytes in all.
    len: usize,
    /// Held until every part is with the connection.
    keep_alive: Option<Arc<dyn Any + Send + Sync>>,
    /// Held while it is being sent: its watchdog's sign that it is not yet.
    sending: Option<Arc<()>>,
    /// The trailers are sent.
    done: bool,
}

impl FramedBody {
    fn new(reply: FramedReply) -> FramedBody {
        FramedBody {
            current: Bytes::new(),
            len: reply.parts.iter().map(Bytes::len).sum(),
            next: reply.parts.into_iter(),
            keep_alive: reply._keep_alive,
            sending: Some(Arc::new(())),
            done: false,
        }
    }

    /// Closes the connection (and so drops this body, and what it keeps
    /// alive) if the body is still being sent after `deadline`.
    fn give_up_after(&self, deadline: std::time::Duration, closer: listen::Closer) {
        let Some(sending) = self.sending.as_ref().map(Arc::downgrade) else {
            return;
        };
        tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            if sending.upgrade().is_some() {
                tracing::warn!(
                    deadline_s = deadline.as_secs(),
                    "a reply was not read within its deadline; its connection is closed"
                );
                closer.close();
            }
        });
    }
}

impl http_body::Body for FramedBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        while self.current.is_empty() {
            match self.next.next() {
                Some(part) => self.current = part,
                None => break,
            }
        }
        if !self.current.is_empty() {
            let take = self.current.len().min(SLICE_BYTES);
            let slice = InFlight {
                bytes: self.current.split_to(take),
                _sending: self.sending.clone(),
                _keep_alive: self.keep_alive.clone(),
            };
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(slice)))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        // The body's own hold ends; the slices the connection still buffers
        // hold the rest until they are written.
        self.done = true;
        self.keep_alive = None;
        self.sending = None;
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let left = self.current.len() + self.next.as_slice().iter().map(Bytes::len).sum::<usize>();
        http_body::SizeHint::with_exact(left as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::{ProfileResponse, ProfileToolData};
    use http_body_util::BodyExt;
    use prost::Message;

    fn parts_of(sizes: &[usize]) -> Vec<Bytes> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| Bytes::from(vec![i as u8; size]))
            .collect()
    }

    #[tokio::test]
    async fn the_body_is_the_message_prost_would_send_then_an_ok_status() {
        for (sizes, empty_trace) in [
            (vec![3 * SLICE_BYTES + 5, 0, 17, SLICE_BYTES], false),
            (vec![], true),
            (vec![200], true),
        ] {
            let parts = parts_of(&sizes);
            let framed = FramedReply::tool_data("xplane.pb", &parts, empty_trace);
            let collected = FramedBody::new(framed).collect().await.unwrap();
            let status = collected.trailers().and_then(|t| t.get("grpc-status"));
            assert_eq!(status.map(|s| s.as_bytes()), Some(&b"0"[..]));
            let bytes = collected.to_bytes();
            assert_eq!(bytes[0], 0, "uncompressed");
            let length = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
            assert_eq!(length, bytes.len() - 5);
            let expected = ProfileResponse {
                tool_data: vec![ProfileToolData {
                    name: "xplane.pb".into(),
                    data: parts.concat().into(),
                }],
                empty_trace,
                xspace: None,
            };
            assert_eq!(&bytes[5..], &expected.encode_to_vec()[..]);
        }
    }

    #[tokio::test]
    async fn an_inline_xspace_is_the_message_prost_would_send() {
        use crate::proto::tensorflow::profiler::{XPlane, XSpace};
        let space = XSpace {
            planes: vec![XPlane {
                id: 7,
                name: "/device:GPU:0".into(),
                ..XPlane::default()
            }],
            hostnames: vec!["worker-0".into()],
            ..XSpace::default()
        };
        let encoded = space.encode_to_vec();
        for empty_trace in [false, true] {
            // In parts, as a built trace is.
            let parts = vec![
                Bytes::copy_from_slice(&encoded[..3]),
                Bytes::copy_from_slice(&encoded[3..]),
            ];
            let framed = FramedReply::xspace(&parts, empty_trace);
            let bytes = FramedBody::new(framed).collect().await.unwrap().to_bytes();
            let expected = ProfileResponse {
                tool_data: Vec::new(),
                empty_trace,
                xspace: Some(space.clone()),
            };
            assert_eq!(
                ProfileResponse::decode(&bytes[5..]).expect("decodes"),
                expected
            );
        }
    }

    #[tokio::test]
    async fn a_tools_output_is_the_message_prost_would_send() {
        use crate::proto::tensorflow::ProfileSessionDataResponse;
        for (format, output) in [("json", &b"{\"a\":1}"[..]), ("blob", &b""[..])] {
            let framed = FramedReply::session_data(format, Bytes::copy_from_slice(output));
            let bytes = FramedBody::new(framed).collect().await.unwrap().to_bytes();
            let expected = ProfileSessionDataResponse {
                error_message: String::new(),
                output_format: format.into(),
                output: output.to_vec(),
            };
            assert_eq!(&bytes[5..], &expected.encode_to_vec()[..]);
        }
    }

    #[tokio::test]
    async fn what_the_reply_keeps_alive_lives_until_the_last_slice_is_out() {
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(());
        let parts = parts_of(&[2 * SLICE_BYTES, 10]);
        let framed = FramedReply::tool_data("xplane.pb", &parts, false).keeping(Arc::clone(&owner));
        let mut body = FramedBody::new(framed);
        // The connection may still hold the last slices when the body is
        // done: they keep the owner until they are written.
        let mut buffered = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                assert!(Arc::strong_count(&owner) >= 2);
                buffered.push(data);
            }
        }
        assert!(
            Arc::strong_count(&owner) >= 2,
            "let go while slices were buffered"
        );
        drop(buffered);
        assert_eq!(Arc::strong_count(&owner), 1);
    }

    #[test]
    fn a_reply_shares_the_traces_bytes() {
        let parts = parts_of(&[1 << 16]);
        let framed = FramedReply::tool_data("xplane.pb", &parts, false);
        assert!(framed.parts.iter().any(|p| p.as_ptr() == parts[0].as_ptr()));
    }
}
