//! Mutations of byte strings: what turns a valid input into the nearly
//! valid ones decoders get wrong. Each case stacks a few of them.

/// SplitMix64: small, fast, and the same sequence for the same seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers at the edges of their types and of the decoders' limits.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    64 << 20,
    (64 << 20) + 1,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
];

/// Stacks one to four mutations on an input, keeping it under a length.
pub struct Mutator {
    pub rng: Rng,
    max_len: usize,
    /// Tokens of the input's format (keywords, separators, field keys).
    dictionary: &'static [&'static [u8]],
}

impl Mutator {
    pub fn new(seed: u64, max_len: usize, dictionary: &'static [&'static [u8]]) -> Mutator {
        Mutator {
            rng: Rng::new(seed),
            max_len,
            dictionary,
        }
    }

    /// A mutated copy of a corpus entry.
    pub fn next_case(&mut self, corpus: &[Vec<u8>]) -> Vec<u8> {
        let mut input = self.rng.pick(corpus).clone();
        let rounds = 1 + self.rng.below(4);
        for _ in 0..rounds {
            self.mutate(&mut input, corpus);
        }
        input.truncate(self.max_len);
        input
    }

    fn mutate(&mut self, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let len = input.len();
        match self.rng.below(13) {
            0 if len > 0 => {
                let at = self.rng.below(len);
                input[at] ^= 1 << self.rng.below(8);
            }
            1 if len > 0 => {
                let at = self.rng.below(len);
                input[at] = self.rng.byte();
            }
            2 if len > 0 => {
                // A small step up or down, as a length or count off by some.
                let at = self.rng.below(len);
                let delta = 1 + self.rng.below(16) as u8;
                input[at] = if self.rng.below(2) == 0 {
                    input[at].wrapping_add(delta)
                } else {
                    input[at].wrapping_sub(delta)
                };
            }
            3 => {
                let value = *self.rng.pick(INTERESTING);
                let width = *self.rng.pick(&[1usize, 2, 4, 8]);
                // Its low `width` bytes, in either byte order.
                let bytes = if self.rng.below(2) == 0 {
                    value.to_le_bytes()[..width].to_vec()
                } else {
                    value.to_be_bytes()[8 - width..].to_vec()
                };
                self.overwrite(input, &bytes);
            }
            4 => {
                // A protobuf varint of an edge value: lengths, ids, times.
                let mut value = *self.rng.pick(INTERESTING);
                let mut varint = Vec::new();
                while value >= 0x80 {
                    varint.push(value as u8 | 0x80);
                    value >>= 7;
                }
                varint.push(value as u8);
                self.insert(input, &varint);
            }
            5 if len > 0 => input.truncate(self.rng.below(len)),
            6 => {
                let extra: Vec<u8> = (0..1 + self.rng.below(64))
                    .map(|_| self.rng.byte())
                    .collect();
                input.extend_from_slice(&extra);
            }
            7 if len > 0 => {
                let at = self.rng.below(len);
                let end = (at + 1 + self.rng.below(64)).min(len);
                input.drain(at..end);
            }
            8 if len > 0 => {
                // A stretch repeated: a field or record that occurs twice.
                let at = self.rng.below(len);
                let end = (at + 1 + self.rng.below(256)).min(len);
                let chunk = input[at..end].to_vec();
                let times = 1 + self.rng.below(4);
                for _ in 0..times {
                    self.insert(input, &chunk);
                }
            }
            9 if !corpus.is_empty() => {
                // Splice: the head of this input, the tail of another.
                let other = self.rng.pick(corpus);
                let cut = self.rng.below(len + 1);
                let from = self.rng.below(other.len() + 1);
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            10 if !self.dictionary.is_empty() => {
                let token = *self.rng.pick(self.dictionary);
                if self.rng.below(2) == 0 {
                    self.insert(input, token);
                } else {
                    self.overwrite(input, token);
                }
            }
            11 if len > 1 => {
                let a = self.rng.below(len);
                let b = self.rng.below(len);
                input.swap(a, b);
            }
            _ => {
                let byte = self.rng.byte();
                self.insert(input, &[byte]);
            }
        }
    }

    fn insert(&mut self, input: &mut Vec<u8>, bytes: &[u8]) {
        let at = self.rng.below(input.len() + 1);
        input.splice(at..at, bytes.iter().copied());
    }

    fn overwrite(&mut self, input: &mut Vec<u8>, bytes: &[u8]) {
        let at = self.rng.below(input.len() + 1);
        let end = (at + bytes.len()).min(input.len());
        input.splice(at..end, bytes.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_makes_the_same_cases_and_lengths_stay_bounded() {
        let corpus = vec![b"name 1 kernel\n".to_vec(), vec![0x0a, 0x02, 0x08, 0x01]];
        let cases = |seed| {
            let mut mutator = Mutator::new(seed, 32, &[b"device "]);
            (0..200)
                .map(|_| mutator.next_case(&corpus))
                .collect::<Vec<_>>()
        };
        let first = cases(7);
        assert_eq!(first, cases(7));
        assert_ne!(first, cases(8));
        assert!(first.iter().all(|c| c.len() <= 32));
        assert!(first.iter().any(|c| !corpus.contains(c)));
    }
}
