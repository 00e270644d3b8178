//! The contract between the devtrace agent and the processes it traces,
//! which are two separately built and loaded binaries: the shared-memory
//! event ring and its layout version ([`ring`]), the event words it carries
//! ([`event`]), the clock both sides stamp with ([`clock`]), the workload's
//! metadata and file names ([`workload`], [`device`]) and the lock a
//! workload holds on its files while it lives ([`lock`]), and the libcupti
//! releases whose records the injection library reads ([`cupti`]).
//!
//! It depends on no runtime, RPC or command-line crate: the injection
//! library links it into every traced job.

pub mod clock;
pub mod cupti;
pub mod device;
pub mod event;
pub mod lock;
pub mod ring;
pub mod workload;
