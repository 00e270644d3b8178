//! Request bodies received within bounds: every gRPC request's body must
//! arrive whole within [`BODY_DEADLINE`] of its headers, the bodies being
//! received from one peer (an address, or a uid on the UNIX socket) hold at
//! most [`BODY_MEMORY_PER_PEER`] bytes, and all of them [`BODY_MEMORY`]. A
//! peer that sends all but the last byte of large messages on many streams
//! (each of which tonic buffers until it is complete) then holds a bounded
//! share of the agent's memory for a bounded time, and its calls fail with
//! DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED naming the bound. Other peers
//! meet the shared bound only when many addresses act together. Requests
//! are small (a `ProfileRequest`, a list of hosts), so honest ones never
//! meet either bound.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;
use tonic::Status;

use crate::protocol::listen;
use crate::protocol::shares::{Over, Peer, Shares};

/// How long a request's body may take to arrive after its headers.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const GRPC_PREFIX: usize = 5;

/// Bytes all request bodies being received may hold at once.
pub const BODY_MEMORY: usize = 64 << 20;

/// Bytes the request bodies being received from one peer may hold at once:
/// four requests of the largest size accepted.
pub const BODY_MEMORY_PER_PEER: usize = 16 << 20;

/// Who sent a request: the peer its listener admitted its connection as.
fn peer_of(extensions: &http::Extensions) -> Peer {
    listen::connection_of(extensions).map_or(Peer::Unknown, |connection| connection.peer)
}

/// The tower layer that bounds every request body of the routes it wraps.
#[derive(Clone, Debug)]
pub struct BoundedBodiesLayer {
    budget: Arc<Shares>,
    deadline: Duration,
}

impl BoundedBodiesLayer {
    pub fn new(budget: Arc<Shares>, deadline: Duration) -> BoundedBodiesLayer {
        BoundedBodiesLayer { budget, deadline }
    }
}

impl<S> tower_layer::Layer<S> for BoundedBodiesLayer {
    type Service = BoundedBodies<S>;

    fn layer(&self, inner: S) -> BoundedBodies<S> {
        BoundedBodies {
            inner,
            budget: Arc::clone(&self.budget),
            deadline: self.deadline,
        }
    }
}

#[derive(Clone, Debug)]
pub struct BoundedBodies<S> {
    inner: S,
    budget: Arc<Shares>,
    deadline: Duration,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for BoundedBodies<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> S::Future {
        let budget = Arc::clone(&self.budget);
        let deadline = self.deadline;
        let peer = peer_of(request.extensions());
        self.inner.call(request.map(|body| {
            tonic::body::Body::new(BoundedBody {
                inner: body,
                budget,
                peer,
                held: 0,
                received: 0,
                prefix: Vec::new(),
                declared: None,
                deadline: Box::pin(tokio::time::sleep(deadline)),
                allowed: deadline,
                done: false,
            })
        }))
    }
}

/// A request body that holds its bytes in the budget until it is dropped
/// (tonic drops it once the message is decoded), and fails when it takes
/// longer than its deadline. tonic sets aside the whole length a message's
/// 5-byte gRPC prefix declares as soon as it reads it, so from then on the
/// body holds that much, not only what has arrived.
struct BoundedBody {
    inner: tonic::body::Body,
    budget: Arc<Shares>,
    peer: Peer,
    /// Taken from the budget.
    held: usize,
    /// Bytes that have arrived.
    received: usize,
    /// The first message's prefix, until its 5 bytes are in.
    prefix: Vec<u8>,
    /// The first message's size with its prefix, once known.
    declared: Option<usize>,
    deadline: Pin<Box<Sleep>>,
    allowed: Duration,
    done: bool,
}

impl Body for BoundedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let data = frame.data_ref().map_or(&[][..], |data| &data[..]);
                this.received = this.received.saturating_add(data.len());
                if this.declared.is_none() {
                    let wanted = (GRPC_PREFIX - this.prefix.len()).min(data.len());
                    this.prefix.extend_from_slice(&data[..wanted]);
                    if this.prefix.len() == GRPC_PREFIX {
                        let length = u32::from_be_bytes([
                            this.prefix[1],
                            this.prefix[2],
                            this.prefix[3],
                            this.prefix[4],
                        ]);
                        this.declared = Some(GRPC_PREFIX + length as usize);
                    }
                }
                let holds = this.received.max(this.declared.unwrap_or(0));
                let bytes = holds - this.held;
                if let Err(over) = this.budget.take(this.peer, bytes) {
                    this.done = true;
                    let (whose, bound) = match over {
                        Over::All => ("all callers", this.budget.limit()),
                        Over::Peer => ("this caller", this.budget.per_peer()),
                    };
                    return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                        "the request bodies this agent is receiving from {whose} hold {bound} \
                         bytes, the most it holds for them; send the request again"
                    )))));
                }
                this.held = holds;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(status))) => {
                this.done = true;
                Poll::Ready(Some(Err(status)))
            }
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.done = true;
                    Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                        "the request's body did not arrive within {} s of its headers",
                        this.allowed.as_secs()
                    )))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for BoundedBody {
    fn drop(&mut self) {
        self.budget.give_back(self.peer, self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(last: u8) -> Peer {
        Peer::Address(std::net::IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_call_is_counted_against_the_peer_its_connection_was_admitted_as() {
        let mut extensions = http::Extensions::new();
        assert_eq!(peer_of(&extensions), Peer::Unknown);
        extensions.insert(listen::ConnectionInfo {
            peer: peer(7),
            closer: Default::default(),
        });
        assert_eq!(peer_of(&extensions), peer(7));
    }

    /// A bounded body over `chunks`, as they would arrive.
    fn body(budget: &Arc<Shares>, chunks: &[&[u8]]) -> BoundedBody {
        let frames: Vec<Result<Frame<Bytes>, Status>> = chunks
            .iter()
            .map(|chunk| Ok(Frame::data(Bytes::copy_from_slice(chunk))))
            .collect();
        BoundedBody {
            inner: tonic::body::Body::new(http_body_util::StreamBody::new(tokio_stream::iter(
                frames,
            ))),
            budget: Arc::clone(budget),
            peer: peer(1),
            held: 0,
            received: 0,
            prefix: Vec::new(),
            declared: None,
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            allowed: Duration::from_secs(3600),
            done: false,
        }
    }

    #[tokio::test]
    async fn a_message_holds_the_length_its_prefix_declares_once_it_is_read() {
        use http_body_util::BodyExt;
        let budget = Arc::new(Shares::new(1 << 30, 1 << 30));
        // The prefix split over two frames, declaring 1 MiB.
        let length = (1u32 << 20).to_be_bytes();
        let first = [0, length[0], length[1]];
        let second = [length[2], length[3], 7, 7];
        let mut bounded = body(&budget, &[&first, &second]);
        bounded.frame().await.expect("a frame").expect("data");
        assert_eq!(budget.held(), 3);
        bounded.frame().await.expect("a frame").expect("data");
        assert_eq!(budget.held(), (1 << 20) + 5);
        drop(bounded);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_declared_length_past_the_callers_share_is_refused_at_once() {
        use http_body_util::BodyExt;
        let budget = Arc::new(Shares::new(64 << 20, 4 << 20));
        let length = (8u32 << 20).to_be_bytes();
        let prefix = [0, length[0], length[1], length[2], length[3]];
        let mut bounded = body(&budget, &[&prefix]);
        let refused = bounded.frame().await.expect("a frame").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("this caller"), "{refused:?}");
        assert_eq!(budget.held(), 0);
    }
}
