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
use crate::protocol::MAX_REQUEST_BYTES;

/// How long a request's body may take to arrive after its headers.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const GRPC_PREFIX: usize = 5;

/// Bytes all request bodies being received may hold at once: the large
/// ones' pool and the small ones'.
pub const BODY_MEMORY: usize = LARGE_BODY_MEMORY + SMALL_BODY_MEMORY;

/// Bytes the request bodies larger than [`SMALL_BODY`] may hold at once.
pub const LARGE_BODY_MEMORY: usize = 56 << 20;

/// Bytes the large request bodies being received from one peer may hold
/// at once: four requests of the largest size accepted.
pub const BODY_MEMORY_PER_PEER: usize = 16 << 20;

/// The largest body counted in the small bodies' pool. Honest requests
/// are this small (a `ProfileRequest`, a session naming 1,024 hosts), and
/// their own pool keeps them served while peers hold the large one full.
pub const SMALL_BODY: usize = 64 << 10;

/// Bytes the small request bodies may hold at once.
pub const SMALL_BODY_MEMORY: usize = 8 << 20;

/// Bytes the small request bodies from one peer may hold at once.
pub const SMALL_BODY_MEMORY_PER_PEER: usize = 1 << 20;

/// The two pools request bodies draw from: a body counts in the small one
/// while it is at most [`SMALL_BODY`], and moves to the large one if it
/// grows past it.
#[derive(Debug)]
pub struct BodyBudget {
    small: Shares,
    large: Shares,
}

/// Which pool a body holds its bytes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Small,
    Large,
}

impl BodyBudget {
    /// The pools the agent serves with.
    pub fn new() -> BodyBudget {
        BodyBudget::with_limits(
            Shares::new(SMALL_BODY_MEMORY, SMALL_BODY_MEMORY_PER_PEER),
            Shares::new(LARGE_BODY_MEMORY, BODY_MEMORY_PER_PEER),
        )
    }

    fn with_limits(small: Shares, large: Shares) -> BodyBudget {
        BodyBudget { small, large }
    }

    /// Bytes held in both pools.
    pub fn held(&self) -> usize {
        self.small.held() + self.large.held()
    }

    /// Grows a body of `peer` holding `held` bytes in `pool` to `holds`,
    /// moving it to the large pool when it passes [`SMALL_BODY`]; on
    /// refusal, nothing changes, and the message says which bound.
    fn grow(&self, peer: Peer, pool: &mut Pool, held: usize, holds: usize) -> Result<(), String> {
        let refused = |shares: &Shares, over: Over, which: &str| {
            let (whose, bound) = match over {
                Over::All => ("all callers", shares.limit()),
                Over::Peer => ("this caller", shares.per_peer()),
            };
            format!(
                "the {which} request bodies this agent is receiving from {whose} hold {bound} \
                 bytes, the most it holds for them; send the request again"
            )
        };
        match *pool {
            Pool::Small if holds <= SMALL_BODY => self
                .small
                .take(peer, holds - held)
                .map_err(|over| refused(&self.small, over, "small")),
            Pool::Small => {
                self.large
                    .take(peer, holds)
                    .map_err(|over| refused(&self.large, over, "large"))?;
                self.small.give_back(peer, held);
                *pool = Pool::Large;
                Ok(())
            }
            Pool::Large => self
                .large
                .take(peer, holds - held)
                .map_err(|over| refused(&self.large, over, "large")),
        }
    }

    fn give_back(&self, peer: Peer, pool: Pool, held: usize) {
        match pool {
            Pool::Small => self.small.give_back(peer, held),
            Pool::Large => self.large.give_back(peer, held),
        }
    }
}

impl Default for BodyBudget {
    fn default() -> BodyBudget {
        BodyBudget::new()
    }
}

/// Who sent a request: the peer its listener admitted its connection as.
fn peer_of(extensions: &http::Extensions) -> Peer {
    listen::connection_of(extensions).map_or(Peer::Unknown, |connection| connection.peer)
}

/// The tower layer that bounds every request body of the routes it wraps.
#[derive(Clone, Debug)]
pub struct BoundedBodiesLayer {
    budget: Arc<BodyBudget>,
    deadline: Duration,
}

impl BoundedBodiesLayer {
    pub fn new(budget: Arc<BodyBudget>, deadline: Duration) -> BoundedBodiesLayer {
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
    budget: Arc<BodyBudget>,
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
                pool: Pool::Small,
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
    budget: Arc<BodyBudget>,
    peer: Peer,
    /// The pool `held` is in.
    pool: Pool,
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
                        // Never accepted, however often sent: said so, not
                        // that the pools are full now.
                        if length as usize > MAX_REQUEST_BYTES {
                            this.done = true;
                            return Poll::Ready(Some(Err(Status::out_of_range(format!(
                                "the request's message is {length} bytes, more than the \
                                 {MAX_REQUEST_BYTES} this agent accepts"
                            )))));
                        }
                    }
                }
                let holds = this.received.max(this.declared.unwrap_or(0));
                let grown = this
                    .budget
                    .grow(this.peer, &mut this.pool, this.held, holds);
                if let Err(message) = grown {
                    this.done = true;
                    return Poll::Ready(Some(Err(Status::resource_exhausted(message))));
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
        self.budget.give_back(self.peer, self.pool, self.held);
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
            caller: crate::protocol::caller::Caller::Unknown,
            closer: Default::default(),
        });
        assert_eq!(peer_of(&extensions), peer(7));
    }

    /// A bounded body over `chunks`, as they would arrive.
    fn body(budget: &Arc<BodyBudget>, chunks: &[&[u8]]) -> BoundedBody {
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
            pool: Pool::Small,
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
        let budget = Arc::new(BodyBudget::with_limits(
            Shares::new(1 << 30, 1 << 30),
            Shares::new(1 << 30, 1 << 30),
        ));
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
        let budget = Arc::new(BodyBudget::with_limits(
            Shares::new(8 << 20, 1 << 20),
            Shares::new(64 << 20, 2 << 20),
        ));
        let length = (3u32 << 20).to_be_bytes();
        let prefix = [0, length[0], length[1], length[2], length[3]];
        let mut bounded = body(&budget, &[&prefix]);
        let refused = bounded.frame().await.expect("a frame").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("this caller"), "{refused:?}");
        assert_eq!(budget.held(), 0);
    }

    /// A length past what the agent ever accepts is out of range, whatever
    /// the pools hold: sending it again would not help.
    #[tokio::test]
    async fn a_declared_length_past_the_largest_request_is_out_of_range() {
        use http_body_util::BodyExt;
        let budget = Arc::new(BodyBudget::new());
        let length = (MAX_REQUEST_BYTES as u32 + 1).to_be_bytes();
        let prefix = [0, length[0], length[1], length[2], length[3]];
        let mut bounded = body(&budget, &[&prefix]);
        let refused = bounded.frame().await.expect("a frame").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::OutOfRange);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn small_bodies_are_served_while_large_ones_fill_their_pool() {
        use http_body_util::BodyExt;
        let budget = Arc::new(BodyBudget::with_limits(
            Shares::new(1 << 20, 1 << 20),
            Shares::new(4 << 20, 4 << 20),
        ));
        // A large body declared to fill the large pool whole.
        let length = ((4u32 << 20) - 5).to_be_bytes();
        let mut large = body(&budget, &[&[0, length[0], length[1], length[2], length[3]]]);
        large.frame().await.expect("a frame").expect("data");
        assert_eq!(budget.large.held(), 4 << 20);
        // A small one still gets in, and counts in its own pool.
        let small_length = 200u32.to_be_bytes();
        let mut small = body(
            &budget,
            &[&[
                0,
                small_length[0],
                small_length[1],
                small_length[2],
                small_length[3],
            ]],
        );
        small.frame().await.expect("a frame").expect("data");
        assert_eq!(budget.small.held(), 205);
        // A second large one is refused naming the large pool.
        let mut refused = body(&budget, &[&[0, length[0], length[1], length[2], length[3]]]);
        let status = refused.frame().await.expect("a frame").unwrap_err();
        assert!(
            status.message().contains("large request bodies"),
            "{status:?}"
        );
        drop((large, small, refused));
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_body_that_grows_past_the_small_bound_moves_to_the_large_pool() {
        use http_body_util::BodyExt;
        let budget = Arc::new(BodyBudget::with_limits(
            Shares::new(1 << 20, 1 << 20),
            Shares::new(4 << 20, 4 << 20),
        ));
        // No prefix read yet: the first bytes count as small.
        let mut growing = body(&budget, &[&[0, 0], &[1, 0, 0]]);
        growing.frame().await.expect("a frame").expect("data");
        assert_eq!((budget.small.held(), budget.large.held()), (2, 0));
        // The prefix declares 64 KiB: with the prefix, past the small bound.
        growing.frame().await.expect("a frame").expect("data");
        assert_eq!(budget.small.held(), 0);
        assert_eq!(budget.large.held(), (1 << 16) + 5);
        drop(growing);
        assert_eq!(budget.held(), 0);
    }
}
