//! Memory a trace build draws as it grows: the builder asks its [`Grant`]
//! for every byte before it comes to hold it, so that whoever runs the build
//! (a capture, under `--capture-memory`) bounds it by construction rather
//! than by a guess made before the build. A grant that can give no more may
//! offer a [`Spill`]: the build then moves its finished blocks out of memory
//! and goes on with what it holds.

use std::convert::Infallible;

use bytes::Bytes;

/// What a build may hold.
pub trait Grant {
    /// Why a grant can give no more.
    type Refusal;

    /// Grants `bytes` more, or refuses (counting nothing); a refused build
    /// stops and lets go of what it holds, unless it can spill.
    fn take(&mut self, bytes: usize) -> Result<(), Self::Refusal>;

    /// Counts `bytes` taken before as let go of: they stay granted, for
    /// what the build draws next.
    fn let_go(&mut self, bytes: usize);

    /// Somewhere to move the build's finished blocks once [`Grant::take`]
    /// refuses, if there is such a place; asked at most once per build.
    fn spill(&mut self) -> Option<Box<dyn Spill<Error = Self::Refusal> + Send>> {
        None
    }
}

/// Where a build puts finished blocks of its trace that memory cannot hold:
/// appended one after another, and read back as one buffer once the build is
/// done (a file mapped into memory, whose pages the kernel may drop and read
/// again, unlike the build's own).
pub trait Spill {
    type Error;

    /// Appends `block`; returns where it starts.
    fn append(&mut self, block: &[u8]) -> Result<u64, Self::Error>;

    /// Everything appended, as one buffer.
    fn finish(self: Box<Self>) -> Result<Bytes, Self::Error>;
}

/// A grant without bound: for traces built outside any budget (tests,
/// tools re-encoding what they already hold).
pub struct Unlimited;

impl Grant for Unlimited {
    type Refusal = Infallible;

    fn take(&mut self, _bytes: usize) -> Result<(), Infallible> {
        Ok(())
    }

    fn let_go(&mut self, _bytes: usize) {}
}

/// A grant whose refusals are said as text, for readers that take any
/// grant as one type ([`super::riegeli::ChunkGrant`]).
pub struct Said<'g, G>(pub &'g mut G);

impl<G: Grant> Grant for Said<'_, G>
where
    G::Refusal: std::fmt::Display,
{
    type Refusal = String;

    fn take(&mut self, bytes: usize) -> Result<(), String> {
        self.0.take(bytes).map_err(|refusal| refusal.to_string())
    }

    fn let_go(&mut self, bytes: usize) {
        self.0.let_go(bytes);
    }
}

/// A grant that counts what is held through it, so that a reader done with
/// one part of its work lets go of all that part drew.
pub struct Tally<'g, G> {
    grant: &'g mut G,
    held: usize,
}

impl<'g, G: Grant> Tally<'g, G> {
    pub fn new(grant: &'g mut G) -> Tally<'g, G> {
        Tally { grant, held: 0 }
    }

    /// Bytes held through it now.
    pub fn held(&self) -> usize {
        self.held
    }
}

impl<G: Grant> Grant for Tally<'_, G> {
    type Refusal = G::Refusal;

    fn take(&mut self, bytes: usize) -> Result<(), G::Refusal> {
        self.grant.take(bytes)?;
        self.held = self.held.saturating_add(bytes);
        Ok(())
    }

    fn let_go(&mut self, bytes: usize) {
        let bytes = bytes.min(self.held);
        self.held -= bytes;
        self.grant.let_go(bytes);
    }
}

/// A grant that gives nothing: for a reader whose budget is all held now,
/// which then reads nothing it would have to hold.
pub struct Nothing;

impl Grant for Nothing {
    type Refusal = &'static str;

    fn take(&mut self, _bytes: usize) -> Result<(), &'static str> {
        Err("the memory budget is all held now")
    }

    fn let_go(&mut self, _bytes: usize) {}
}

/// A grant of at most `limit` bytes at once, named in its refusals: for a
/// reader with no budget of its own (a command run by hand) whose files may
/// claim far more than the machine holds.
pub struct Bounded {
    limit: usize,
    held: usize,
    /// What `limit` is, as a refusal says it.
    what: String,
}

impl Bounded {
    pub fn new(limit: usize, what: impl Into<String>) -> Bounded {
        Bounded {
            limit,
            held: 0,
            what: what.into(),
        }
    }
}

impl Grant for Bounded {
    type Refusal = String;

    fn take(&mut self, bytes: usize) -> Result<(), String> {
        let held = self.held.saturating_add(bytes);
        if held > self.limit {
            return Err(format!("more than {} ({} bytes)", self.what, self.limit));
        }
        self.held = held;
        Ok(())
    }

    fn let_go(&mut self, bytes: usize) {
        self.held = self.held.saturating_sub(bytes);
    }
}
