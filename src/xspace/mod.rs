//! XSpace: building it from events, the conventions XProf relies on, and
//! reading it back for `devtrace inspect` and tests.

pub mod builder;
pub mod conventions;
pub mod merge;
pub mod read;
mod wire;

pub use builder::{append_warning, build_xspace, encode_xspace, is_empty, CaptureInfo, Encoded};
