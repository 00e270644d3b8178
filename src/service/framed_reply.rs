//! Capture replies sent from one encoded gRPC message.
//!
//! tonic encodes every reply into a buffer of its own and holds it until the
//! client has read it. For a trace that is a copy of the whole trace per
//! capture: 32 clients of one 129 MiB window held 4 GB at once. A capture
//! instead encodes its reply once, as the length-prefixed gRPC message, and
//! attaches it to the reply's extensions ([`FramedReply`]); captures sharing
//! a build share that message. [`FramedRepliesLayer`] then sends those bytes
//! in place of tonic's body, in slices, so that HTTP/2 flow control paces
//! each slice and nothing is copied per client. What the message needs to
//! stay alive (its build's memory reservation) is held until the last slice
//! is handed to the connection.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use prost::Message;

/// How much of a message is handed to the connection at a time: small
/// enough that a slow reader holds back little beyond the shared message,
/// large enough that slicing costs nothing measurable.
const SLICE_BYTES: usize = 1 << 20;

/// One reply's message, framed for gRPC (an uncompressed flag byte and a
/// big-endian length before the encoded message), and whatever must live
/// until it is sent.
#[derive(Clone)]
pub struct FramedReply {
    framed: Bytes,
    _keep_alive: Option<Arc<dyn Any + Send + Sync>>,
}

impl FramedReply {
    /// Frames `message`: one copy of it, however many replies send it.
    pub fn encode(message: &impl Message) -> FramedReply {
        let length = message.encoded_len();
        let mut framed = BytesMut::with_capacity(5 + length);
        framed.put_u8(0);
        // The caller keeps replies under `MAX_REPLY_BYTES` (i32::MAX).
        framed.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
        message
            .encode(&mut framed)
            .unwrap_or_else(|_| unreachable!("the buffer was sized by encoded_len"));
        FramedReply {
            framed: framed.freeze(),
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

    /// The framed message's size.
    pub fn len(&self) -> usize {
        self.framed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.framed.is_empty()
    }

    /// Attaches the reply to `response`, whose own message is then not sent.
    pub fn attach<T>(self, response: &mut tonic::Response<T>) {
        response.extensions_mut().insert(self);
    }
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
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            if let Some(reply) = response.extensions_mut().remove::<FramedReply>() {
                *response.body_mut() = tonic::body::Body::new(FramedBody::new(reply));
            }
            Ok(response)
        })
    }
}

/// The body of a framed reply: its slices, then the OK status.
struct FramedBody {
    rest: Bytes,
    reply: Option<FramedReply>,
}

impl FramedBody {
    fn new(reply: FramedReply) -> FramedBody {
        FramedBody {
            rest: reply.framed.clone(),
            reply: Some(reply),
        }
    }
}

impl http_body::Body for FramedBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if !self.rest.is_empty() {
            let take = self.rest.len().min(SLICE_BYTES);
            let slice = self.rest.split_to(take);
            return Poll::Ready(Some(Ok(Frame::data(slice))));
        }
        // Every slice is with the connection: what they came from may go.
        if self.reply.take().is_none() {
            return Poll::Ready(None);
        }
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.reply.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::{ProfileResponse, ProfileToolData};
    use http_body_util::BodyExt;

    fn reply_of(size: usize) -> ProfileResponse {
        ProfileResponse {
            tool_data: vec![ProfileToolData {
                name: "xplane.pb".into(),
                data: Bytes::from(vec![7u8; size]),
            }],
            empty_trace: false,
            xspace: None,
        }
    }

    #[tokio::test]
    async fn the_body_is_the_framed_message_then_an_ok_status() {
        let message = reply_of(3 * SLICE_BYTES + 5);
        let framed = FramedReply::encode(&message);
        let collected = FramedBody::new(framed).collect().await.unwrap();
        let status = collected.trailers().and_then(|t| t.get("grpc-status"));
        assert_eq!(status.map(|s| s.as_bytes()), Some(&b"0"[..]));
        let bytes = collected.to_bytes();
        assert_eq!(bytes[0], 0, "uncompressed");
        let length = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        assert_eq!(length, bytes.len() - 5);
        assert_eq!(ProfileResponse::decode(&bytes[5..]).unwrap(), message);
    }

    #[tokio::test]
    async fn what_the_reply_keeps_alive_lives_until_the_last_slice_is_out() {
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(());
        let framed = FramedReply::encode(&reply_of(2 * SLICE_BYTES)).keeping(Arc::clone(&owner));
        let mut body = FramedBody::new(framed);
        while let Some(frame) = body.frame().await {
            if frame.unwrap().is_data() {
                assert_eq!(Arc::strong_count(&owner), 2);
            }
        }
        assert_eq!(Arc::strong_count(&owner), 1);
    }
}
