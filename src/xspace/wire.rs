//! A minimal protobuf wire-format writer for building XSpace bytes directly,
//! without an intermediate message tree: a trace of millions of events then
//! costs one pass and one buffer.
//!
//! Nested messages are written in place: [`Writer::begin`] reserves a padded
//! length varint and [`Writer::end`] fills it in. Padded varints (continuation
//! bits set on leading groups) are valid protobuf that every parser accepts;
//! when a message outgrows its reservation the bytes are shifted to fit.

const WIRE_VARINT: u8 = 0;
const MAX_VARINT: usize = 10;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;

/// A field's key: its number and wire type.
#[inline]
fn key_word(field: u32, wire: u8) -> u64 {
    (u64::from(field) << 3) | u64::from(wire)
}

/// Where an open nested message's length goes.
#[derive(Clone, Copy, Debug)]
pub struct Open {
    at: usize,
    width: usize,
}

#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(bytes: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(bytes),
        }
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes allocated: what the writer holds.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    #[inline]
    fn varint(&mut self, value: u64) {
        // One capacity check per varint instead of one per byte: this is the
        // innermost loop of trace encoding.
        self.buf.reserve(MAX_VARINT);
        // SAFETY: MAX_VARINT bytes were just reserved.
        unsafe { self.varint_unchecked(value) };
    }

    /// Writes `value` as a varint into the spare capacity.
    ///
    /// # Safety
    /// At least [`MAX_VARINT`] bytes of spare capacity.
    #[inline]
    unsafe fn varint_unchecked(&mut self, mut value: u64) {
        let start = self.buf.len();
        let spare = &mut self.buf.spare_capacity_mut()[..MAX_VARINT];
        let mut n = 0;
        while value >= 0x80 {
            spare[n].write((value as u8) | 0x80);
            value >>= 7;
            n += 1;
        }
        spare[n].write(value as u8);
        // SAFETY: the n + 1 bytes after `start` were initialised just above,
        // within the capacity the caller reserved.
        unsafe { self.buf.set_len(start + n + 1) };
    }

    #[inline]
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(key_word(field, wire));
    }

    /// An unsigned varint field, written even when zero (oneof members).
    #[inline]
    pub fn uint(&mut self, field: u32, value: u64) {
        self.key(field, WIRE_VARINT);
        self.varint(value);
    }

    /// An int64 field (negative values take ten bytes, as in protobuf).
    #[inline]
    pub fn int(&mut self, field: u32, value: i64) {
        self.uint(field, value as u64);
    }

    /// An int64 field omitted when zero (plain proto3 scalars).
    #[inline]
    pub fn int_nonzero(&mut self, field: u32, value: i64) {
        if value != 0 {
            self.int(field, value);
        }
    }

    #[inline]
    pub fn double(&mut self, field: u32, value: f64) {
        self.key(field, WIRE_FIXED64);
        self.buf.extend_from_slice(&value.to_le_bytes());
    }

    pub fn bytes(&mut self, field: u32, value: &[u8]) {
        self.key(field, WIRE_LEN);
        self.varint(value.len() as u64);
        self.buf.extend_from_slice(value);
    }

    /// A nested message of two varint fields, `{1: first, second_field:
    /// second}`, with its length computed up front: the shape of every
    /// numeric XStat, the commonest message in a trace.
    #[inline]
    pub fn pair(&mut self, field: u32, first: u64, second_field: u32, second: u64) {
        let length = 2 + varint_len(first) + varint_len(second);
        // One capacity check for the whole stat: its key and length, two
        // keys and two values.
        self.buf.reserve(6 * MAX_VARINT);
        // SAFETY: each call below writes at most MAX_VARINT bytes of the
        // room reserved above.
        unsafe {
            self.varint_unchecked(key_word(field, WIRE_LEN));
            self.varint_unchecked(length as u64);
            self.varint_unchecked(key_word(1, WIRE_VARINT));
            self.varint_unchecked(first);
            self.varint_unchecked(key_word(second_field, WIRE_VARINT));
            self.varint_unchecked(second);
        }
    }

    /// Like [`Writer::pair`] with a fixed64 second field (a double).
    #[inline]
    pub fn pair_double(&mut self, field: u32, first: u64, second_field: u32, second: f64) {
        let length = 1 + varint_len(first) + 1 + 8;
        self.key(field, WIRE_LEN);
        self.varint(length as u64);
        self.key(1, WIRE_VARINT);
        self.varint(first);
        self.double(second_field, second);
    }

    /// The key and length of a nested message whose `length` bytes of
    /// fields follow (written with [`Writer::raw`] and the like).
    pub fn message_prefix(&mut self, field: u32, length: usize) {
        self.key(field, WIRE_LEN);
        self.varint(length as u64);
    }

    /// Bytes that are already encoded fields of the current message.
    pub fn raw(&mut self, encoded: &[u8]) {
        self.buf.extend_from_slice(encoded);
    }

    /// A string field omitted when empty.
    pub fn text(&mut self, field: u32, value: &str) {
        if !value.is_empty() {
            self.bytes(field, value.as_bytes());
        }
    }

    /// Opens a nested message whose length is expected to fit `width` bytes
    /// of varint (2 for small messages, 5 for anything up to 4 GiB).
    #[inline]
    pub fn begin(&mut self, field: u32, width: usize) -> Open {
        self.key(field, WIRE_LEN);
        let at = self.buf.len();
        self.buf.resize(at + width, 0);
        Open { at, width }
    }

    /// Closes a message opened with [`Writer::begin`].
    #[inline]
    pub fn end(&mut self, open: Open) {
        let length = self.buf.len() - open.at - open.width;
        let needed = varint_len(length as u64);
        if needed > open.width {
            let extra = needed - open.width;
            self.buf
                .splice(open.at..open.at, std::iter::repeat_n(0, extra));
            write_padded(&mut self.buf[open.at..open.at + needed], length);
        } else {
            write_padded(&mut self.buf[open.at..open.at + open.width], length);
        }
    }
}

pub(crate) fn varint_len(value: u64) -> usize {
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

/// Writes `value` as a varint of exactly `out.len()` bytes.
fn write_padded(out: &mut [u8], mut value: usize) {
    let last = out.len() - 1;
    for (i, byte) in out.iter_mut().enumerate() {
        let group = (value & 0x7f) as u8;
        value >>= 7;
        *byte = if i == last { group } else { group | 0x80 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{x_stat, XLine, XStat};
    use prost::Message;

    #[test]
    fn padded_and_grown_lengths_decode_like_prost_output() {
        let mut w = Writer::default();
        let line = w.begin(3, 5);
        w.int(1, 7);
        w.text(2, "python");
        // A nested message that outgrows its 2-byte reservation.
        for i in 0..3000 {
            let stat = w.begin(4, 2);
            let inner = w.begin(4, 2);
            w.uint(1, i);
            w.int(4, -1);
            w.end(inner);
            w.end(stat);
        }
        w.end(line);
        let bytes = w.into_bytes();
        let decoded = crate::proto::tensorflow::profiler::XPlane::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded.lines.len(), 1);
        let XLine {
            id, name, events, ..
        } = &decoded.lines[0];
        assert_eq!((*id, name.as_str(), events.len()), (7, "python", 3000));
        assert_eq!(
            events[2999].stats,
            vec![XStat {
                metadata_id: 2999,
                value: Some(x_stat::Value::Int64Value(-1)),
            }]
        );
    }

    #[test]
    fn pairs_decode_as_stats() {
        let mut w = Writer::default();
        w.pair(4, 300, 4, (-5i64) as u64);
        w.pair_double(4, 2, 2, 0.5);
        let event =
            crate::proto::tensorflow::profiler::XEvent::decode(w.into_bytes().as_slice()).unwrap();
        assert_eq!(
            event.stats,
            vec![
                XStat {
                    metadata_id: 300,
                    value: Some(x_stat::Value::Int64Value(-5)),
                },
                XStat {
                    metadata_id: 2,
                    value: Some(x_stat::Value::DoubleValue(0.5)),
                },
            ]
        );
    }

    #[test]
    fn varint_lengths() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(16_383), 2);
        assert_eq!(varint_len(16_384), 3);
    }
}
