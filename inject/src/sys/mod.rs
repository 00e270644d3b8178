//! Every call this library makes into libc and the dynamic loader, and
//! every write into another loaded object's memory, each wrapped once with
//! the invariant that makes it sound written beside it. The rest of the
//! library calls these and libcupti's and the CUDA driver's entry points,
//! nothing else below Rust.

pub mod dl;
pub mod got;
pub mod process;
