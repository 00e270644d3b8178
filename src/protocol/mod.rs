//! What the profiler protocol's two ends, the services and the clients
//! (`client`, `streaming`, the CLI), agree on beyond the protobuf messages:
//! message size limits and the names of the tool entries a trace travels
//! in. The client side of the protocol ([`client`]) and TLS for both ends
//! ([`tls`]) are here as well.

pub mod caller;
pub mod client;
pub mod listen;
pub mod shares;
pub mod tls;
pub mod unix_socket;
pub mod via;

/// Largest request decoded. Requests are small (a `ProfileRequest`, a list
/// of hosts); without a bound a caller could make the agent hold gigabytes
/// (a billion empty `tools` entries decode to ~24 GB). A larger request is
/// refused with OUT_OF_RANGE before its body is read.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Largest reply sent: real traces run to hundreds of MB and the TensorFlow
/// client accepts up to 2 GiB.
pub const MAX_REPLY_BYTES: usize = i32::MAX as usize;

/// Name of the tool entry that carries the trace back to the client.
pub const XPLANE_TOOL: &str = "xplane.pb";
/// Name of the tool entry that carries a chunked trace back (the client
/// writes it as `<host>.xplane.riegeli`).
pub const RIEGELI_TOOL: &str = "xplane.riegeli";
