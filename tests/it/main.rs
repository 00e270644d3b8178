//! devtrace's integration tests, one binary: each module drives the real
//! `devtrace` binary, the injection library and the stand-ins
//! (`tests/standins/`) as a user or a workload would; `common` holds what
//! they share.

mod common;

mod agent;
mod attach;
mod bad_input;
mod bounds;
mod cli;
mod config;
mod control_plane;
mod cuda;
mod doctor;
mod ebpf;
mod federation;
mod fleet;
mod hostile;
mod large_traces;
mod memory;
mod metrics;
mod nvml;
mod object_storage;
mod perf;
mod quickstart;
mod ring_shm;
mod scoped;
mod sessions;
mod shared_captures;
mod tap;
mod tools;
mod tpu;
mod triggers;
