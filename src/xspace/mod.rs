//! XSpace: building it from events (by the names and ids XProf relies on,
//! which are [`crate::model::timeline`]'s), merging other servers' traces
//! in, storing traces past protobuf's 2 GiB as Riegeli chunks, and reading
//! them back for `devtrace inspect` and tests.

pub mod builder;
pub mod chunks;
pub mod footprint;
pub mod grant;
pub mod merge;
pub mod read;
pub mod riegeli;
pub mod runs;
pub(crate) mod wire;

pub use builder::{
    append_warning, build_xspace, encode_runs, encode_xspace, is_empty, CaptureInfo, Encoded,
};
pub use grant::{Grant, Unlimited};
