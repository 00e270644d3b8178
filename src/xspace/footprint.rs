//! What decoding an encoded XSpace takes in memory, found by walking its
//! wire format without decoding it. A trace's size says little of that: an
//! empty plane is 2 bytes on the wire and a couple of hundred decoded, so a
//! file that anyone who can write under a repository put there can make
//! decoding it take a hundred times its size. Readers that serve others
//! draw this from their memory budget before they decode.

use std::mem::size_of;

use super::read::{Malformed, WireReader, WireValue};
use crate::proto::tensorflow::profiler::{
    XEvent, XEventMetadata, XLine, XPlane, XStat, XStatMetadata,
};

/// What the allocator keeps beside each allocation.
const ALLOCATION: u64 = 16;

/// A decoded map entry's own bytes beside its key and value: hashbrown's
/// control byte, rounded up.
const MAP_ENTRY: u64 = 8;

/// The bytes decoding the XSpace `bytes` takes at most: every message,
/// string and repeated field, repeated fields and maps at twice their
/// length (what growing by pushing leaves them at, at worst).
pub fn decoded_bytes(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let (mut planes, mut strings) = (Repeated::of::<XPlane>(), Repeated::of::<String>());
    let mut total = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        let WireValue::Bytes(contents) = value else {
            continue;
        };
        match field {
            1 => total = total.saturating_add(planes.add(plane(contents)?)),
            2..=4 => total = total.saturating_add(strings.add(text(contents))),
            _ => {}
        }
    }
    Ok(total
        .saturating_add(planes.vectors())
        .saturating_add(strings.vectors()))
}

/// The elements of one repeated field (or map) of a message: how many, for
/// the vector (or map) holding them.
struct Repeated {
    element: u64,
    count: u64,
}

impl Repeated {
    fn of<T>() -> Repeated {
        Repeated {
            element: size_of::<T>() as u64,
            count: 0,
        }
    }

    /// One more element; what it holds beyond its own place is passed
    /// through.
    fn add(&mut self, held: u64) -> u64 {
        self.count += 1;
        held
    }

    /// The vector itself: twice its elements, and its allocation.
    fn vectors(&self) -> u64 {
        self.held_at(self.element)
    }

    /// The same elements held in a map: key and value beside a control
    /// byte, at twice their number.
    fn maps(&self, key: u64) -> u64 {
        self.held_at(self.element + key + MAP_ENTRY)
    }

    fn held_at(&self, each: u64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        self.count
            .saturating_mul(each)
            .saturating_mul(2)
            .saturating_add(ALLOCATION)
    }
}

/// A string's or bytes' own allocation.
fn text(contents: &[u8]) -> u64 {
    if contents.is_empty() {
        0
    } else {
        contents.len() as u64 + ALLOCATION
    }
}

fn plane(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut lines = Repeated::of::<XLine>();
    let mut event_metadata = Repeated::of::<XEventMetadata>();
    let mut stat_metadata = Repeated::of::<XStatMetadata>();
    let mut stats = Repeated::of::<XStat>();
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        let WireValue::Bytes(contents) = value else {
            continue;
        };
        let more = match field {
            2 => text(contents),
            3 => lines.add(line(contents)?),
            4 => event_metadata.add(map_value(contents, event_metadata_of)?),
            5 => stat_metadata.add(map_value(contents, stat_metadata_of)?),
            6 => stats.add(stat(contents)?),
            _ => 0,
        };
        held = held.saturating_add(more);
    }
    let key = size_of::<i64>() as u64;
    Ok([
        held,
        lines.vectors(),
        event_metadata.maps(key),
        stat_metadata.maps(key),
        stats.vectors(),
    ]
    .into_iter()
    .fold(0, u64::saturating_add))
}

/// What the value of a map entry (key 1, value 2) holds.
fn map_value(
    entry: &[u8],
    value_of: fn(&[u8]) -> Result<u64, Malformed>,
) -> Result<u64, Malformed> {
    let mut fields = WireReader(entry);
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        if let (2, WireValue::Bytes(contents)) = (field, value) {
            held = held.saturating_add(value_of(contents)?);
        }
    }
    Ok(held)
}

fn line(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut events = Repeated::of::<XEvent>();
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        let WireValue::Bytes(contents) = value else {
            continue;
        };
        let more = match field {
            2 | 11 => text(contents),
            4 => events.add(event(contents)?),
            _ => 0,
        };
        held = held.saturating_add(more);
    }
    Ok(held.saturating_add(events.vectors()))
}

fn event(bytes: &[u8]) -> Result<u64, Malformed> {
    stats_in(bytes, 4)
}

/// What the stats in field `stats_field` of a message hold, with the
/// vector holding them.
fn stats_in(bytes: &[u8], stats_field: u64) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut stats = Repeated::of::<XStat>();
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        if let (true, WireValue::Bytes(contents)) = (field == stats_field, value) {
            held = held.saturating_add(stats.add(stat(contents)?));
        }
    }
    Ok(held.saturating_add(stats.vectors()))
}

fn stat(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        if let (5 | 6, WireValue::Bytes(contents)) = (field, value) {
            // A value set twice keeps the last; the first is freed.
            held = text(contents);
        }
    }
    Ok(held)
}

fn event_metadata_of(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut stats = Repeated::of::<XStat>();
    let mut children = Repeated::of::<i64>();
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        let more = match (field, value) {
            (2..=4, WireValue::Bytes(contents)) => text(contents),
            (5, WireValue::Bytes(contents)) => stats.add(stat(contents)?),
            // Packed: one id per varint, each ending in a byte below 0x80.
            (6, WireValue::Bytes(contents)) => {
                for _ in contents.iter().filter(|byte| **byte < 0x80) {
                    children.add(0);
                }
                0
            }
            (6, WireValue::Scalar) => children.add(0),
            _ => 0,
        };
        held = held.saturating_add(more);
    }
    Ok(held
        .saturating_add(stats.vectors())
        .saturating_add(children.vectors()))
}

fn stat_metadata_of(bytes: &[u8]) -> Result<u64, Malformed> {
    let mut fields = WireReader(bytes);
    let mut held = 0u64;
    while let Some((field, value)) = fields.next_field()? {
        if let (2 | 3, WireValue::Bytes(contents)) = (field, value) {
            held = held.saturating_add(text(contents));
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::XSpace;
    use prost::Message;

    /// A plane of `lines` lines of `events` events with a stat each.
    fn space(lines: usize, events: usize) -> XSpace {
        let stat = XStat {
            metadata_id: 1,
            value: Some(crate::proto::tensorflow::profiler::x_stat::Value::StrValue(
                "a stat's text".into(),
            )),
        };
        let event = XEvent {
            metadata_id: 1,
            duration_ps: 1000,
            stats: vec![stat],
            ..XEvent::default()
        };
        XSpace {
            planes: vec![XPlane {
                name: "/host:CPU".into(),
                lines: (0..lines)
                    .map(|id| XLine {
                        id: id as i64,
                        name: format!("line {id}"),
                        events: vec![event.clone(); events],
                        ..XLine::default()
                    })
                    .collect(),
                ..XPlane::default()
            }],
            warnings: vec!["a warning".into()],
            ..XSpace::default()
        }
    }

    /// The estimate is never below what the decoded messages themselves
    /// take, and grows with them as they do.
    #[test]
    fn the_estimate_covers_the_decoded_messages() {
        let small = decoded_bytes(&space(2, 10).encode_to_vec()).unwrap();
        let large = decoded_bytes(&space(20, 1000).encode_to_vec()).unwrap();
        let least = |lines: u64, events: u64| {
            lines * size_of::<XLine>() as u64
                + lines * events * (size_of::<XEvent>() + size_of::<XStat>() + 13) as u64
        };
        assert!(small >= least(2, 10), "{small}");
        assert!(large >= least(20, 1000), "{large}");
        assert!(large < 4 * least(20, 1000), "{large}");
    }

    /// A file of empty planes, 2 bytes each, takes a hundred times its
    /// size decoded: the estimate says so.
    #[test]
    fn empty_planes_are_counted_at_their_decoded_size() {
        let bytes = [0x0a, 0x00].repeat(1000);
        let estimate = decoded_bytes(&bytes).unwrap();
        assert!(estimate >= 1000 * size_of::<XPlane>() as u64, "{estimate}");
        assert!(estimate > 50 * bytes.len() as u64, "{estimate}");
        assert_eq!(XSpace::decode(bytes.as_slice()).unwrap().planes.len(), 1000);
    }

    #[test]
    fn a_truncated_message_is_malformed() {
        let bytes = space(2, 10).encode_to_vec();
        assert!(decoded_bytes(&bytes[..bytes.len() - 3]).is_err());
        assert_eq!(decoded_bytes(&[]).unwrap(), 0);
    }
}
