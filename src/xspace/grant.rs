//! Memory a trace build draws as it grows: the builder asks its [`Grant`]
//! for every byte before it comes to hold it, so that whoever runs the build
//! (a capture, under `--capture-memory`) bounds it by construction rather
//! than by a guess made before the build.

use std::convert::Infallible;

/// What a build may hold.
pub trait Grant {
    /// Why a grant can give no more.
    type Refusal;

    /// Grants `bytes` more, or refuses; a refused build stops and lets go of
    /// what it holds.
    fn take(&mut self, bytes: usize) -> Result<(), Self::Refusal>;
}

/// A grant without bound: for traces built outside any budget (tests,
/// tools re-encoding what they already hold).
pub struct Unlimited;

impl Grant for Unlimited {
    type Refusal = Infallible;

    fn take(&mut self, _bytes: usize) -> Result<(), Infallible> {
        Ok(())
    }
}
