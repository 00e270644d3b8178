//! devtrace: a device-tracing agent for machine-learning hosts.
//!
//! Backends stream timestamped [`event::Event`]s into a lock-free
//! [`ring::Ring`]; the [`recorder::collect::Collector`] drains it into the
//! flight recorder ([`recorder::Store`]); the services in [`service`] turn
//! capture requests of TensorFlow's profiler protocol into windows over the
//! recorder, which [`capture`] builds into XSpace traces ([`xspace`]) that
//! XProf opens. See `ARCHITECTURE.md`.

// In the order of the layers (see `layers.rs`), from the bottom.
pub mod agent;
pub mod analysis;
pub mod attach;
pub mod backend;
pub mod capture;
pub mod cli;
pub mod doctor;
pub mod elf;
pub mod fleet;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod layers;
pub mod model;
pub mod protocol;
pub mod recorder;
pub mod repository;
pub mod service;
pub mod tap;
pub mod telemetry;
pub mod tools;
pub mod trigger;
pub mod xspace;

// The shared-memory contract with the injection library, as the agent's
// own modules.
pub use devtrace_shm::{clock, event, ring, workload};

/// Types generated from `proto/`.
pub mod proto {
    pub mod devtrace {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("devtrace");
    }
    pub mod tensorflow {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("tensorflow");
        pub mod profiler {
            #![allow(clippy::all, missing_docs)]
            tonic::include_proto!("tensorflow.profiler");
        }
    }
}
