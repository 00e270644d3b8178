//! The flight recorder's compact form of a sealed chunk: what lets
//! `--store-size` hold several times the history of 128-byte events.
//!
//! Events are stored sorted by start time (enclosing spans first, the
//! order XProf wants on a line) as the differences that matter:
//! the start as a delta from the previous event's, and every other word as
//! the difference from the same word of the last event of its kind (its
//! device, payload tag and name), written only when it differs. Events of one
//! kind repeat most of their words (a kernel's launch shape, an op's thread
//! and line, a copy's size), so an event usually costs a handful of bytes. The
//! codec works on an event's 16 raw words, so every bit pattern survives the
//! round trip exactly.
//!
//! Layout of one event:
//! - one byte: the index of its kind word (device, tag, name) in a small
//!   table of recent kinds, or [`LITERAL`] followed by the word as a varint;
//! - the start delta, a varint;
//! - a varint mask of which other words differ from the last event of its
//!   kind, then for each, the zigzag varint of the difference.

use crate::event::{Event, EVENT_WORDS};

/// Kinds remembered by index, per chunk.
const KIND_TABLE: usize = 15;
/// The first byte value meaning "the kind word follows".
const LITERAL: u8 = KIND_TABLE as u8;
/// Last events remembered per kind (by a hash of the kind; two kinds that
/// share a place only cost bytes, never correctness).
const CONTEXTS: usize = 1024;
/// The word holding device, tag and name (see [`Event::to_words`]).
const KIND_WORD: usize = 3;
/// The words written against the last event of the same kind, in mask bit
/// order: duration, line, then the payload.
const DIFFERENCED: [usize; EVENT_WORDS - 2] = [1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// A sealed chunk's events, encoded.
#[derive(Debug)]
pub struct CompactEvents {
    bytes: Box<[u8]>,
    count: usize,
    /// The first and last start, when there are events.
    starts: Option<(u64, u64)>,
}

impl CompactEvents {
    /// Encodes the `events` that `keep` accepts, sorted by start time (the
    /// longer of two that start together first; events alike in both keep
    /// the order they came in, as a tap's ops of one request do).
    pub fn encode(events: &[Event], keep: impl Fn(&Event) -> bool) -> CompactEvents {
        // Sorting small keys, not the 128-byte events, moves a fifth of
        // the memory; the index keeps equal events in arrival order. A
        // stable sort, as it finds the sorted runs each producer's events
        // arrive in.
        let mut order: Vec<(u64, std::cmp::Reverse<u64>, u32)> = events
            .iter()
            .enumerate()
            .filter(|(_, e)| keep(e))
            .map(|(index, e)| (e.start_ns, std::cmp::Reverse(e.duration_ns), index as u32))
            .collect();
        order.sort();
        // Room for the longest encoding of every event, so that events are
        // written in place; the pages past what they take are never touched
        // (the zeroed allocation maps them lazily) and are handed back when
        // the buffer is cut to its length.
        let mut out = vec![0u8; order.len() * MAX_ENCODED_EVENT];
        let mut written = 0;
        let mut state = State::new();
        for &(_, _, index) in &order {
            let mut at = Cursor {
                out: &mut out,
                at: written,
            };
            state.encode(&events[index as usize].to_words(), &mut at);
            written = at.at;
        }
        out.truncate(written);
        CompactEvents {
            bytes: out.into_boxed_slice(),
            count: order.len(),
            starts: order.first().zip(order.last()).map(|(f, l)| (f.0, l.0)),
        }
    }

    /// The first and last start time, when there are events.
    pub fn starts(&self) -> Option<(u64, u64)> {
        self.starts
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// The events, in the order [`CompactEvents::encode`] sorted them.
    pub fn iter(&self) -> Decoder<'_> {
        Decoder {
            bytes: &self.bytes,
            at: 0,
            left: self.count,
            state: State::new(),
        }
    }
}

/// What encoder and decoder both remember while walking one chunk.
struct State {
    previous_start: u64,
    kinds: [u64; KIND_TABLE],
    last_of_kind: Box<[[u64; EVENT_WORDS]]>,
}

impl State {
    fn new() -> State {
        State {
            previous_start: 0,
            kinds: [u64::MAX; KIND_TABLE],
            last_of_kind: vec![[0u64; EVENT_WORDS]; CONTEXTS].into_boxed_slice(),
        }
    }

    fn encode(&mut self, words: &[u64; EVENT_WORDS], out: &mut Cursor<'_>) {
        let kind = words[KIND_WORD];
        let place = kind_place(kind);
        if self.kinds[place] == kind {
            out.byte(place as u8);
        } else {
            out.byte(LITERAL);
            out.varint(kind);
            self.kinds[place] = kind;
        }
        out.varint(words[0].wrapping_sub(self.previous_start));
        self.previous_start = words[0];
        let last = &mut self.last_of_kind[context(kind)];
        let mut mask = 0u64;
        for (bit, &word) in DIFFERENCED.iter().enumerate() {
            if words[word] != last[word] {
                mask |= 1 << bit;
            }
        }
        out.varint(mask);
        while mask != 0 {
            let word = DIFFERENCED[mask.trailing_zeros() as usize];
            mask &= mask - 1;
            out.varint(zigzag(words[word].wrapping_sub(last[word])));
        }
        *last = *words;
    }
}

/// The longest encoded event: the kind byte and word, the start delta and
/// the mask, and every differenced word, each varint at most 10 bytes.
pub(crate) const MAX_ENCODED_EVENT: usize = 1 + 10 * (3 + DIFFERENCED.len());

/// Where the next byte of a chunk's encoding goes, in a buffer sized for
/// the longest encodings: no growth checks on the collector's hottest loop.
struct Cursor<'o> {
    out: &'o mut [u8],
    at: usize,
}

impl Cursor<'_> {
    fn byte(&mut self, byte: u8) {
        self.out[self.at] = byte;
        self.at += 1;
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.byte((value as u8) | 0x80);
            value >>= 7;
        }
        self.byte(value as u8);
    }
}

/// Where the kind table keeps `kind`.
fn kind_place(kind: u64) -> usize {
    (kind.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) as usize % KIND_TABLE
}

/// Which last-event context `kind` uses.
fn context(kind: u64) -> usize {
    (kind.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize % CONTEXTS
}

/// Decodes a chunk's events in order.
pub struct Decoder<'c> {
    bytes: &'c [u8],
    at: usize,
    left: usize,
    state: State,
}

impl Decoder<'_> {
    fn varint(&mut self) -> u64 {
        let mut value = 0u64;
        let mut shift = 0;
        // The bytes were written by `encode` in this process; a cut varint
        // reads as what it has.
        while let Some(&byte) = self.bytes.get(self.at) {
            self.at += 1;
            if shift < 64 {
                value |= u64::from(byte & 0x7f) << shift;
            }
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
        value
    }
}

impl Iterator for Decoder<'_> {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let code = *self.bytes.get(self.at)?;
        self.at += 1;
        let kind = if code == LITERAL {
            let kind = self.varint();
            self.state.kinds[kind_place(kind)] = kind;
            kind
        } else {
            self.state.kinds[usize::from(code) % KIND_TABLE]
        };
        let start = self.state.previous_start.wrapping_add(self.varint());
        self.state.previous_start = start;
        let mut mask = self.varint() & ((1 << DIFFERENCED.len()) - 1);
        let place = context(kind);
        while mask != 0 {
            let bit = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let delta = unzigzag(self.varint());
            let word = &mut self.state.last_of_kind[place][DIFFERENCED[bit]];
            *word = word.wrapping_add(delta);
        }
        let words = &mut self.state.last_of_kind[place];
        words[0] = start;
        words[KIND_WORD] = kind;
        Some(Event::from_words(words))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// Small differences either way as small numbers.
fn zigzag(delta: u64) -> u64 {
    let signed = delta as i64;
    ((signed << 1) ^ (signed >> 63)) as u64
}

fn unzigzag(value: u64) -> u64 {
    ((value >> 1) as i64 ^ -((value & 1) as i64)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{
        CopyInfo, CopyKind, Device, KernelInfo, MemoryInfo, MemsetInfo, NameId, Payload,
    };

    fn round_trip(events: Vec<Event>) -> CompactEvents {
        let compact = CompactEvents::encode(&events, |_| true);
        let decoded: Vec<Event> = compact.iter().collect();
        assert_eq!(decoded.len(), compact.len());
        // Sorted by start; ties keep no particular order.
        let key = |e: &Event| e.to_words();
        let mut expected = events.clone();
        expected.sort_by_key(key);
        let mut got = decoded.clone();
        got.sort_by_key(key);
        assert_eq!(got, expected);
        assert!(decoded.windows(2).all(|w| w[0].start_ns <= w[1].start_ns));
        compact
    }

    fn every_kind(at: u64, n: u64) -> Vec<Event> {
        let memory = MemoryInfo {
            allocator: NameId(3),
            bytes_allocated: 1 << 30,
            fragmentation: 0.125,
            address: 0x7f00_0000_0000 + n * 4096,
            step_id: -1,
            ..MemoryInfo::default()
        };
        let payloads = [
            Payload::Plain,
            Payload::Step { step_num: -5 },
            Payload::ApiCall {
                correlation_id: n,
                device_ordinal: 1,
            },
            Payload::Kernel(KernelInfo {
                correlation_id: n,
                grid: [128, 1, 1],
                occupancy_pct: 50.0,
                ..KernelInfo::default()
            }),
            Payload::Memcpy(CopyInfo {
                correlation_id: n,
                bytes: 4096,
                kind: CopyKind::DeviceToHost,
                is_async: true,
                tf_op: NameId(9),
            }),
            Payload::Memset(MemsetInfo {
                correlation_id: n,
                bytes: 1,
                is_async: false,
                tf_op: NameId(0),
            }),
            Payload::MemoryAllocation(memory),
            Payload::MemoryDeallocation(memory),
            Payload::Counter { value: -0.0 },
            Payload::CpuSlice {
                pid: 1,
                tid: u32::MAX,
                cpu: 3,
                end_state: 1,
            },
            Payload::OffCpu {
                pid: 1,
                tid: 2,
                state: 0,
                waker_tid: 7,
            },
        ];
        payloads
            .into_iter()
            .enumerate()
            .map(|(i, payload)| {
                let device = if i % 2 == 0 {
                    Device::Gpu(i as u16)
                } else {
                    Device::Host
                };
                Event::new(at + i as u64, n * 10, device, n, NameId(i as u32), payload)
            })
            .collect()
    }

    #[test]
    fn every_kind_and_extreme_values_survive_exactly() {
        let mut events: Vec<Event> = (0..50).flat_map(|n| every_kind(1000 * n, n)).collect();
        // Extremes: any bit pattern is an event.
        let mut wild = [u64::MAX; EVENT_WORDS];
        events.push(Event::from_words(&wild));
        wild[0] = 0;
        events.push(Event::from_words(&wild));
        events.push(Event::from_words(&[0; EVENT_WORDS]));
        events.push(Event::from_words(&std::array::from_fn(|i| {
            0x8000_0000_0000_0000 >> i
        })));
        // Out of order and tied.
        events.push(Event::new(5, 0, Device::Host, 1, NameId(0), Payload::Plain));
        events.push(Event::new(5, 1, Device::Host, 1, NameId(0), Payload::Plain));
        round_trip(events);
        round_trip(Vec::new());
    }

    #[test]
    fn events_that_start_and_end_together_keep_their_order() {
        let mut events: Vec<Event> = (0..1000u32)
            .map(|i| Event::new(7, 3, Device::Host, 1, NameId(1000 - i), Payload::Plain))
            .collect();
        events.push(Event::new(7, 9, Device::Host, 1, NameId(5), Payload::Plain));
        events.push(Event::new(2, 0, Device::Host, 1, NameId(6), Payload::Plain));
        let compact = CompactEvents::encode(&events, |_| true);
        let names: Vec<u32> = compact.iter().map(|e| e.name().0).collect();
        let mut expected = vec![6, 5];
        expected.extend((0..1000u32).map(|i| 1000 - i));
        assert_eq!(names, expected);
    }

    #[test]
    fn more_kinds_than_the_tables_hold_still_round_trip() {
        let events: Vec<Event> = (0..5000u64)
            .map(|i| {
                Event::new(
                    i * 7,
                    i,
                    Device::Gpu((i % 300) as u16),
                    i % 13,
                    NameId((i * 7919 % 100_000) as u32),
                    Payload::ApiCall {
                        correlation_id: i,
                        device_ordinal: (i % 5) as u32,
                    },
                )
            })
            .collect();
        round_trip(events);
    }

    #[test]
    fn repeated_kinds_take_a_few_bytes_each() {
        let events: Vec<Event> = (0..10_000u64)
            .map(|i| {
                Event::new(
                    1_700_000_000_000_000_000 + i * 1000,
                    800 + i % 50,
                    Device::Gpu(0),
                    7,
                    NameId(42),
                    Payload::Kernel(KernelInfo {
                        correlation_id: i,
                        grid: [128, 1, 1],
                        block: [256, 1, 1],
                        registers_per_thread: 32,
                        ..KernelInfo::default()
                    }),
                )
            })
            .collect();
        let compact = round_trip(events);
        let per_event = compact.bytes() as f64 / compact.len() as f64;
        assert!(per_event < 8.0, "{per_event} bytes per event");
    }
}
