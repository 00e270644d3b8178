//! Request bodies received within bounds: every gRPC request's body must
//! arrive whole within [`BODY_DEADLINE`] of its headers, and all bodies
//! being received at once hold at most [`BODY_MEMORY`] bytes. A peer that
//! sends all but the last byte of large messages on many streams (each of
//! which tonic buffers until it is complete) then holds a bounded share of
//! the agent's memory for a bounded time; its calls fail with
//! DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED naming the bound, and other
//! callers are not affected. Requests are small (a `ProfileRequest`, a
//! list of hosts), so honest ones never meet either bound.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;
use tonic::Status;

/// How long a request's body may take to arrive after its headers.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// Bytes all request bodies being received may hold at once.
pub const BODY_MEMORY: usize = 64 << 20;

/// What the request bodies being received hold, together.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: AtomicUsize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Arc<BodyBudget> {
        Arc::new(BodyBudget {
            limit,
            held: AtomicUsize::new(0),
        })
    }

    /// Takes `bytes` from the budget, or none when they do not fit.
    fn take(&self, bytes: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }

    fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
    }

    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
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
        self.inner.call(request.map(|body| {
            tonic::body::Body::new(BoundedBody {
                inner: body,
                budget,
                held: 0,
                deadline: Box::pin(tokio::time::sleep(deadline)),
                allowed: deadline,
                done: false,
            })
        }))
    }
}

/// A request body that holds its bytes in the budget until it is dropped
/// (tonic drops it once the message is decoded), and fails when it takes
/// longer than its deadline.
struct BoundedBody {
    inner: tonic::body::Body,
    budget: Arc<BodyBudget>,
    held: usize,
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
                let bytes = frame.data_ref().map_or(0, Bytes::len);
                if !this.budget.take(bytes) {
                    this.done = true;
                    return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                        "the request bodies this agent is receiving hold {} bytes, its bound \
                         for them; send the request again",
                        this.budget.limit
                    )))));
                }
                this.held += bytes;
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
        self.budget.give_back(self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_holds_what_fits_and_takes_back_what_is_given() {
        let budget = BodyBudget::new(10);
        assert!(budget.take(6));
        assert!(!budget.take(5));
        assert!(budget.take(4));
        budget.give_back(6);
        assert_eq!(budget.held(), 4);
        assert!(budget.take(6));
    }
}
