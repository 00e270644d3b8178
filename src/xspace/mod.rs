//! XSpace: building it from events, the conventions XProf relies on,
//! storing traces past protobuf's 2 GiB as chunks, and reading them back
//! for `devtrace inspect` and tests.

pub mod builder;
pub mod chunks;
pub mod merge;
pub mod read;
pub(crate) mod wire;

/// The timeline's names and ids, as the XSpace writer and readers know them.
pub use crate::timeline as conventions;

pub use builder::{append_warning, build_xspace, encode_xspace, is_empty, CaptureInfo, Encoded};
