//! XSpace: building it from events, the conventions XProf relies on, and
//! reading it back for `devtrace inspect` and tests.

pub mod builder;
pub mod conventions;
pub mod read;

pub use builder::{build_xspace, is_empty, CaptureInfo};
