//! devtrace: a device-tracing agent for machine-learning hosts.
//!
//! Backends stream timestamped [`event::Event`]s into a lock-free
//! [`ring::Ring`]; the [`collect::Collector`] drains it into the flight
//! recorder ([`store::Store`]); the services in [`service`] turn capture
//! requests of TensorFlow's profiler protocol into windows over the store and
//! build XSpace traces ([`xspace`]) that XProf opens. See `ARCHITECTURE.md`.

pub mod agent;
pub mod analysis;
pub mod backend;
pub mod beneath;
pub mod calendar;
pub mod capture;
pub mod cli;
pub mod client;
pub mod collect;
#[cfg(test)]
mod fuzz;
pub mod host_process;
pub mod hosts;
#[cfg(test)]
mod layers;
pub mod protocol;
pub mod registry;
pub mod riegeli;
pub mod service;
pub mod session;
pub mod storage;
pub mod store;
pub mod streaming;
pub mod tap;
pub mod telemetry;
pub mod timeline;
pub mod tls;
pub mod tools;
pub mod trigger;
pub mod units;
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
