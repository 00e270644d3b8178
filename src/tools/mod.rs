//! Tool data: pure converters from a decoded [`XSpace`] to what XProf's tools
//! show, for a future `ProfileAnalysis.GetSessionToolData`.
//!
//! - [`memory_profile`]: XProf's `memory_profile` tool, message and JSON as
//!   XProf's own converter (`xplane_to_memory_profile.cc`) produces them.
//! - [`kernel_stats`]: GPU kernels aggregated by launch configuration.
//! - [`trace_viewer`]: Chrome trace-event JSON (Perfetto, `chrome://tracing`)
//!   over a time window, capped at a number of events.
//! - [`overview`]: step times, device busy time, heaviest host ops and kernels.
//!
//! Every converter reads the XSpace only, never mutates it, and reports input
//! it cannot use as a [`ToolError`]. Stats are read the way XProf reads them
//! (see [`stats`]): `IntValue` only from `int64_value`, strings from `str_value`
//! or `ref_value`, and so on, so a trace that XProf misreads is misread here
//! the same way.

use crate::proto::tensorflow::profiler::{XPlane, XSpace};

pub mod group;
pub mod json;
pub mod kernel_stats;
pub mod memory_profile;
pub mod overview;
pub mod stats;
pub mod trace_viewer;

/// Host threads plane; XProf's memory profile reads only this exact name.
pub const HOST_PLANE: &str = "/host:CPU";
/// Prefix of GPU device planes, followed by the ordinal.
pub const GPU_PLANE_PREFIX: &str = "/device:GPU:";
/// Prefix of TPU device planes.
pub const TPU_PLANE_PREFIX: &str = "/device:TPU:";

/// Why a tool could not be computed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ToolError {
    /// The tool reads a plane with this exact name and the XSpace has none.
    #[error("the trace has no plane named {0:?}")]
    MissingPlane(String),
    /// The tool reads planes whose names start with this prefix and there are none.
    #[error("the trace has no {what} plane (no plane name starts with {prefix:?})")]
    NoDevicePlanes {
        what: &'static str,
        prefix: &'static str,
    },
    /// A tool parameter is out of range; the message starts with its name.
    #[error("{name}: {reason}")]
    InvalidParameter { name: &'static str, reason: String },
}

/// The first plane named exactly `name`, as XProf's `FindPlaneWithName`.
pub fn find_plane<'s>(space: &'s XSpace, name: &str) -> Option<&'s XPlane> {
    space.planes.iter().find(|p| p.name == name)
}

/// Planes whose names start with `prefix`, in XSpace order.
pub fn planes_with_prefix<'s>(
    space: &'s XSpace,
    prefix: &'s str,
) -> impl Iterator<Item = &'s XPlane> + 's {
    space
        .planes
        .iter()
        .filter(move |p| p.name.starts_with(prefix))
}

/// GPU planes (`/device:GPU:<n>`), or [`ToolError::NoDevicePlanes`].
pub fn gpu_planes(space: &XSpace) -> Result<Vec<&XPlane>, ToolError> {
    let planes: Vec<&XPlane> = planes_with_prefix(space, GPU_PLANE_PREFIX).collect();
    if planes.is_empty() {
        return Err(ToolError::NoDevicePlanes {
            what: "GPU",
            prefix: GPU_PLANE_PREFIX,
        });
    }
    Ok(planes)
}

/// First and last id of the lines XProf derives from GPU streams
/// (`kThreadIdDerivedMin` = `0xdeadbeef` as int32, and a few hundred after);
/// converters skip them as XProf does.
const DERIVED_LINE_MIN: i64 = 0xdead_beef_u32 as i32 as i64;
const DERIVED_LINE_MAX: i64 = DERIVED_LINE_MIN + 399;

/// True for line ids in XProf's derived range (compared on the low 32 bits).
pub fn is_derived_line(id: i64) -> bool {
    let low = i64::from(id as i32);
    (DERIVED_LINE_MIN..=DERIVED_LINE_MAX).contains(&low)
}

/// `name:Type` framework op names (TensorFlow's `ParseTfOpFullname`
/// `kTensorFlow` category): an op name of `[A-Za-z0-9.][A-Za-z0-9_./>-]*`
/// and an op type of `[A-Z_][A-Za-z0-9_]*`, split at the first ':'.
pub fn parse_tf_op(full_name: &str) -> Option<(&str, &str)> {
    let (name, ty) = full_name.split_once(':')?;
    let mut name_chars = name.chars();
    let name_ok = name_chars
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '.')
        && name_chars.all(|c| c.is_ascii_alphanumeric() || "_./>-".contains(c));
    let mut ty_chars = ty.chars();
    let ty_ok = ty_chars
        .next()
        .is_some_and(|c| c.is_ascii_uppercase() || c == '_')
        && ty_chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    (name_ok && ty_ok).then_some((name, ty))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_lines_are_recognised_on_their_low_bits() {
        assert!(is_derived_line(-559_038_737));
        assert!(is_derived_line(0xdead_beef));
        assert!(is_derived_line(-559_038_737 + 10));
        assert!(!is_derived_line(7));
        assert!(!is_derived_line(i64::MAX));
    }

    #[test]
    fn framework_op_names() {
        assert_eq!(
            parse_tf_op("model/dense/MatMul:MatMul"),
            Some(("model/dense/MatMul", "MatMul"))
        );
        assert_eq!(parse_tf_op("train"), None);
        assert_eq!(parse_tf_op("void f<Eigen::half>(int)"), None);
        assert_eq!(parse_tf_op("a b:MatMul"), None);
        assert_eq!(parse_tf_op("x:matmul"), None);
    }
}
