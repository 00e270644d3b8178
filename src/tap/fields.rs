//! Keeps chosen top-level fields of a protobuf message as its bytes pass,
//! so that a message whose record needs a few small fields (a `RunStep`'s
//! session handle, fetches and targets) costs neither holding nor parsing
//! the tensors around them.
//!
//! [`FieldFilter`] reads the wire format incrementally, from pieces of any
//! size: each field's key and length, then its value, copied when the field
//! is kept and skipped otherwise. What it keeps is a valid encoding of the
//! same message without the other fields, which the partial protos decode as
//! they would the whole message.

use bytes::{BufMut, Bytes, BytesMut};

/// The longest varint (a key, a length, a value).
const MAX_VARINT: usize = 10;

/// One message's bytes, filtered as they arrive.
#[derive(Debug)]
pub struct FieldFilter {
    keep: &'static [u32],
    /// The message's length.
    length: u64,
    /// Message bytes not yet seen.
    remaining: u64,
    /// Most bytes kept before the message counts as undecodable.
    keep_limit: usize,
    kept: BytesMut,
    state: State,
    broken: bool,
}

#[derive(Debug)]
enum State {
    /// A key varint, its bytes so far.
    Key(Varint),
    /// The length varint of a length-delimited field.
    Length { keep: bool, varint: Varint },
    /// A varint value.
    Value { keep: bool, length: usize },
    /// `left` bytes of a fixed-size or length-delimited value.
    Bytes { keep: bool, left: u64 },
}

#[derive(Clone, Copy, Debug, Default)]
struct Varint {
    raw: [u8; MAX_VARINT],
    length: usize,
}

impl Varint {
    /// Adds a byte; the value once it is complete.
    fn push(&mut self, byte: u8) -> Result<Option<u64>, ()> {
        if self.length == MAX_VARINT {
            return Err(());
        }
        self.raw[self.length] = byte;
        self.length += 1;
        if byte & 0x80 != 0 {
            return Ok(None);
        }
        let value = self.raw[..self.length]
            .iter()
            .rev()
            .fold(0u64, |value, byte| value << 7 | u64::from(byte & 0x7f));
        Ok(Some(value))
    }

    fn bytes(&self) -> &[u8] {
        &self.raw[..self.length]
    }
}

impl FieldFilter {
    /// A filter for a message of `length` bytes keeping the fields numbered
    /// in `keep`, up to `keep_limit` bytes of them.
    pub fn new(keep: &'static [u32], length: u64, keep_limit: usize) -> FieldFilter {
        FieldFilter {
            keep,
            length,
            remaining: length,
            keep_limit,
            kept: BytesMut::new(),
            state: State::Key(Varint::default()),
            broken: false,
        }
    }

    /// Reads the message's next bytes from `data`; returns how many were
    /// its (the rest belongs to what follows the message).
    pub fn feed(&mut self, data: &[u8]) -> usize {
        let mine = usize::try_from(self.remaining).map_or(data.len(), |r| r.min(data.len()));
        self.remaining -= mine as u64;
        let mut at = 0;
        while at < mine && !self.broken {
            at += self.step(&data[at..mine]);
        }
        mine
    }

    /// The message's length.
    pub fn length(&self) -> u64 {
        self.length
    }

    /// Message bytes not yet seen.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The whole message has passed.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// The kept fields, or `None` when the message was not protobuf (or
    /// kept more than the limit). Call once [`FieldFilter::is_done`].
    pub fn finish(self) -> Option<Bytes> {
        let ended_on_a_field = matches!(&self.state, State::Key(varint) if varint.length == 0);
        (!self.broken && ended_on_a_field).then(|| self.kept.freeze())
    }

    /// Consumes some of `data` (at least one byte) in the current state.
    fn step(&mut self, data: &[u8]) -> usize {
        match &mut self.state {
            State::Bytes { keep, left } => {
                let take = usize::try_from(*left).map_or(data.len(), |l| l.min(data.len()));
                let keep = *keep;
                *left -= take as u64;
                if *left == 0 {
                    self.state = State::Key(Varint::default());
                }
                if keep {
                    self.keep_bytes(&data[..take]);
                }
                take
            }
            State::Value { keep, length } => {
                let byte = data[0];
                *length += 1;
                let keep = *keep;
                if *length > MAX_VARINT {
                    self.broken = true;
                } else if byte & 0x80 == 0 {
                    self.state = State::Key(Varint::default());
                }
                if keep {
                    self.keep_bytes(&[byte]);
                }
                1
            }
            State::Key(varint) => {
                match varint.push(data[0]) {
                    Err(()) => self.broken = true,
                    Ok(None) => {}
                    Ok(Some(key)) => {
                        let raw = *varint;
                        self.start_field(key, raw.bytes());
                    }
                }
                1
            }
            State::Length { keep, varint } => {
                let keep = *keep;
                match varint.push(data[0]) {
                    Err(()) => self.broken = true,
                    Ok(None) => {}
                    Ok(Some(length)) => {
                        let raw = *varint;
                        if keep {
                            self.keep_bytes(raw.bytes());
                        }
                        self.state = if length == 0 {
                            State::Key(Varint::default())
                        } else {
                            State::Bytes { keep, left: length }
                        };
                    }
                }
                1
            }
        }
    }

    /// A field's key has passed: what follows is its value.
    fn start_field(&mut self, key: u64, raw_key: &[u8]) {
        let number = key >> 3;
        let keep = u32::try_from(number).is_ok_and(|n| self.keep.contains(&n));
        if number == 0 {
            self.broken = true;
            return;
        }
        if keep {
            self.keep_bytes(raw_key);
        }
        self.state = match key & 7 {
            0 => State::Value { keep, length: 0 },
            1 => State::Bytes { keep, left: 8 },
            2 => State::Length {
                keep,
                varint: Varint::default(),
            },
            5 => State::Bytes { keep, left: 4 },
            // Groups (3, 4) are not in TensorFlow's protos; 6 and 7 are not
            // wire types.
            _ => {
                self.broken = true;
                State::Key(Varint::default())
            }
        };
    }

    fn keep_bytes(&mut self, bytes: &[u8]) {
        if self.kept.len() + bytes.len() > self.keep_limit {
            self.broken = true;
        } else {
            self.kept.put_slice(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tap::decode::{sample_run_step, NamedTensor, RunStepRequest};
    use prost::Message;

    const RUN_STEP_KEPT: &[u32] = &[1, 3, 4, 6];

    fn filtered(message: &[u8], keep: &'static [u32], piece: usize) -> Option<Bytes> {
        let mut filter = FieldFilter::new(keep, message.len() as u64, 1 << 20);
        for chunk in message.chunks(piece) {
            assert_eq!(filter.feed(chunk), chunk.len());
        }
        assert!(filter.is_done());
        filter.finish()
    }

    #[test]
    fn kept_fields_decode_as_the_whole_message_did_from_any_split() {
        let mut request = sample_run_step();
        request.feed = vec![NamedTensor {
            name: "x".repeat(100_000),
        }];
        let whole = request.encode_to_vec();
        for piece in [1, 2, 3, 7, 4096, whole.len()] {
            let kept = filtered(&whole, RUN_STEP_KEPT, piece).expect("protobuf");
            assert!(kept.len() < 200, "{} bytes kept", kept.len());
            let decoded = RunStepRequest::decode(kept).unwrap();
            assert_eq!(
                (decoded.session_handle, decoded.fetch, decoded.target),
                (
                    request.session_handle.clone(),
                    request.fetch.clone(),
                    request.target.clone()
                ),
                "pieces of {piece}"
            );
            assert!(decoded.feed.is_empty());
        }
    }

    #[test]
    fn every_wire_type_is_kept_or_skipped_whole() {
        let mut message = Vec::new();
        prost::encoding::uint64::encode(2, &300, &mut message);
        prost::encoding::fixed64::encode(3, &7, &mut message);
        prost::encoding::fixed32::encode(4, &9, &mut message);
        prost::encoding::string::encode(5, &"kept".to_string(), &mut message);
        prost::encoding::bytes::encode(6, &vec![1u8; 1000], &mut message);
        prost::encoding::string::encode(7, &String::new(), &mut message);
        let mut expected = Vec::new();
        prost::encoding::fixed64::encode(3, &7, &mut expected);
        prost::encoding::string::encode(5, &"kept".to_string(), &mut expected);
        prost::encoding::string::encode(7, &String::new(), &mut expected);
        for piece in [1, 5, 64] {
            let kept = filtered(&message, &[3, 5, 7], piece).expect("protobuf");
            assert_eq!(kept.as_ref(), expected.as_slice(), "pieces of {piece}");
        }
    }

    #[test]
    fn bytes_that_are_not_protobuf_are_refused() {
        // Wire type 7; a varint of 11 bytes; a field cut off by the
        // message's end; field number 0.
        assert_eq!(filtered(&[0x0f, 0x00], &[1], 1), None);
        assert_eq!(
            filtered(
                &[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
                &[1],
                3
            ),
            None
        );
        assert_eq!(filtered(&[0x0a, 0x05, b'a'], &[1], 1), None);
        assert_eq!(filtered(&[0x02, 0x00], &[1], 1), None);
        // Kept fields beyond the limit.
        let mut message = Vec::new();
        prost::encoding::bytes::encode(1, &vec![0u8; 100], &mut message);
        let mut filter = FieldFilter::new(&[1], message.len() as u64, 50);
        filter.feed(&message);
        assert_eq!(filter.finish(), None);
    }

    #[test]
    fn bytes_past_the_message_are_left_for_what_follows() {
        let mut filter = FieldFilter::new(&[1], 2, 1 << 20);
        assert_eq!(filter.feed(&[0x08, 0x01, 0x00, 0x05]), 2);
        assert!(filter.is_done());
        assert_eq!(filter.finish().as_deref(), Some(&[0x08u8, 0x01][..]));
    }
}
