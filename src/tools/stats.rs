//! Stat access with XProf's accessor semantics (`XStatVisitor`): a stat's
//! *name* is its `XStatMetadata.name`, and each accessor reads exactly one
//! oneof case, returning the type's default for any other case.
//!
//! | accessor | reads |
//! |---|---|
//! | [`int_value`] | `int64_value` only |
//! | [`uint_value`] | `uint64_value` only |
//! | [`int_or_uint_value`] | `uint64_value`, else `int64_value` |
//! | [`double_value`] | `double_value` only |
//! | [`str_or_ref_value`] | `str_value`, or the name of the stat metadata a `ref_value` names |

use crate::proto::tensorflow::profiler::{x_stat, XPlane, XStat};

/// Name of a stat (its metadata's name), "" when the metadata is unknown.
pub fn stat_name<'p>(plane: &'p XPlane, stat: &XStat) -> &'p str {
    plane
        .stat_metadata
        .get(&stat.metadata_id)
        .map_or("", |m| m.name.as_str())
}

/// `XStatVisitor::IntValue`.
pub fn int_value(stat: &XStat) -> i64 {
    match stat.value {
        Some(x_stat::Value::Int64Value(v)) => v,
        _ => 0,
    }
}

/// `XStatVisitor::UintValue`.
pub fn uint_value(stat: &XStat) -> u64 {
    match stat.value {
        Some(x_stat::Value::Uint64Value(v)) => v,
        _ => 0,
    }
}

/// `XStatVisitor::IntOrUintValue`.
pub fn int_or_uint_value(stat: &XStat) -> u64 {
    match stat.value {
        Some(x_stat::Value::Uint64Value(v)) => v,
        _ => int_value(stat) as u64,
    }
}

/// `XStatVisitor::DoubleValue`.
pub fn double_value(stat: &XStat) -> f64 {
    match stat.value {
        Some(x_stat::Value::DoubleValue(v)) => v,
        _ => 0.0,
    }
}

/// `XStatVisitor::StrOrRefValue`.
pub fn str_or_ref_value<'p>(plane: &'p XPlane, stat: &'p XStat) -> &'p str {
    match &stat.value {
        Some(x_stat::Value::StrValue(s)) => s,
        Some(x_stat::Value::RefValue(id)) => plane
            .stat_metadata
            .get(&(*id as i64))
            .map_or("", |m| m.name.as_str()),
        _ => "",
    }
}

/// The first stat called `name` in `stats` (`XStatsOwner::GetStat`).
pub fn get<'s>(plane: &XPlane, stats: &'s [XStat], name: &str) -> Option<&'s XStat> {
    stats.iter().find(|s| stat_name(plane, s) == name)
}

/// A stat value for display, references resolved.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<'p> {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(&'p str),
    Bytes(usize),
}

/// The value of `stat` whatever its oneof case; `None` when unset.
pub fn value<'p>(plane: &'p XPlane, stat: &'p XStat) -> Option<Value<'p>> {
    Some(match stat.value.as_ref()? {
        x_stat::Value::Int64Value(v) => Value::Int(*v),
        x_stat::Value::Uint64Value(v) => Value::Uint(*v),
        x_stat::Value::DoubleValue(v) => Value::Double(*v),
        x_stat::Value::StrValue(_) | x_stat::Value::RefValue(_) => {
            Value::Str(str_or_ref_value(plane, stat))
        }
        x_stat::Value::BytesValue(b) => Value::Bytes(b.len()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::XStatMetadata;

    fn plane() -> XPlane {
        let mut plane = XPlane::default();
        for (id, name) in [(1, "bytes_allocated"), (2, "GPU_0_bfc")] {
            plane.stat_metadata.insert(
                id,
                XStatMetadata {
                    id,
                    name: name.into(),
                    description: String::new(),
                },
            );
        }
        plane
    }

    #[test]
    fn accessors_read_only_their_own_case() {
        let plane = plane();
        let int = XStat {
            metadata_id: 1,
            value: Some(x_stat::Value::Int64Value(-5)),
        };
        let uint = XStat {
            metadata_id: 1,
            value: Some(x_stat::Value::Uint64Value(7)),
        };
        let reference = XStat {
            metadata_id: 1,
            value: Some(x_stat::Value::RefValue(2)),
        };
        assert_eq!(int_value(&int), -5);
        assert_eq!(int_value(&uint), 0);
        assert_eq!(uint_value(&uint), 7);
        assert_eq!(int_or_uint_value(&uint), 7);
        assert_eq!(int_or_uint_value(&int), -5i64 as u64);
        assert_eq!(double_value(&int), 0.0);
        assert_eq!(str_or_ref_value(&plane, &reference), "GPU_0_bfc");
        assert_eq!(str_or_ref_value(&plane, &int), "");
        assert_eq!(stat_name(&plane, &int), "bytes_allocated");
        assert!(get(&plane, std::slice::from_ref(&uint), "bytes_allocated").is_some());
        assert!(get(&plane, &[uint], "nope").is_none());
    }
}
