//! What every layer above speaks of and nothing here depends on: units as
//! people write them, moments as they read them, where events sit on the
//! timeline, the registry of names and devices events refer to, the
//! processes of the host as it sees them, whose a capture is, and the work
//! under way that a stopping agent waits for. (The
//! event words, the ring, the clock and the workload files, shared with
//! the injection library, are the `devtrace-shm` crate's.)

pub mod calendar;
pub mod filesystem;
pub mod glob;
pub mod host_process;
pub mod memory_limit;
pub mod printable;
pub mod registry;
pub mod scope;
pub mod small_file;
pub mod timeline;
pub mod under_way;
pub mod units;
