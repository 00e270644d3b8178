//! The Riegeli/records file format (github.com/google/riegeli,
//! `doc/riegeli_records_file_format.md`), as far as chunked traces need it:
//! writing files of simple chunks with Brotli-compressed records, and
//! reading simple chunks (uncompressed or Brotli) back. XProf 2.23 and
//! later read `<host>.xplane.riegeli` files whose records are XSpace chunks.
//!
//! A file is a sequence of chunks (a 40-byte header, then data), cut every
//! 64 KiB by a 24-byte block header that points at the chunk it interrupts,
//! so that a reader can find the next chunk after damage. Every header and
//! every chunk's data carries a 64-bit HighwayHash under the format's key.

use std::io::{Read, Write};
use std::ops::Range;

use highway::{HighwayHash, HighwayHasher, Key};
use parking_lot::Mutex;

const BLOCK_SIZE: u64 = 1 << 16;
const BLOCK_HEADER_SIZE: u64 = 24;
const USABLE_BLOCK_SIZE: u64 = BLOCK_SIZE - BLOCK_HEADER_SIZE;
const CHUNK_HEADER_SIZE: usize = 40;
/// 'Riegeli/', 'records\n', twice.
const HASH_KEY: [u64; 4] = [
    0x2f69_6c65_6765_6952,
    0x0a73_6472_6f63_6572,
    0x2f69_6c65_6765_6952,
    0x0a73_6472_6f63_6572,
];

mod chunk_type {
    pub const FILE_SIGNATURE: u8 = b's';
    pub const FILE_METADATA: u8 = b'm';
    pub const PADDING: u8 = b'p';
    pub const SIMPLE: u8 = b'r';
    pub const TRANSPOSED: u8 = b't';
}

mod compression {
    pub const NONE: u8 = 0;
    pub const BROTLI: u8 = b'b';
    pub const ZSTD: u8 = b'z';
    pub const SNAPPY: u8 = b's';
}

/// Brotli quality of written chunks. TensorFlow's own writer uses 6; on
/// XSpace, 5 compresses within 1% of it and a quarter faster (about
/// 25 MB/s per core, 6x smaller), and the client waits for it.
const BROTLI_QUALITY: u32 = 5;
/// Brotli's default window (4 MiB), which every decoder accepts.
const BROTLI_WINDOW_LOG: u32 = 22;
const BROTLI_BUFFER: usize = 1 << 16;
/// Buffer reserved up front for a decompressed block, whatever size its
/// prefix claims; larger blocks grow as they are read.
const MAX_RESERVE: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RiegeliError {
    #[error("not a Riegeli/records file: it does not begin with the file signature")]
    NoSignature,
    #[error("corrupted Riegeli/records file: {what} at byte {at}")]
    Corrupted { what: &'static str, at: u64 },
    #[error("truncated Riegeli/records file: the chunk at byte {at} runs past its end")]
    Truncated { at: u64 },
    #[error("the chunk at byte {at} is {what}, which devtrace does not read (it reads simple chunks, uncompressed or Brotli)")]
    Unsupported { at: u64, what: String },
    #[error("Brotli: {0}")]
    Brotli(std::io::Error),
    #[error("the chunk at byte {at} decompresses to {bytes} bytes, more than may be held: {why}")]
    Refused { at: u64, bytes: u64, why: String },
}

/// What reading chunks may hold: asked for each chunk's decompressed bytes
/// before it is decompressed, and told when they are let go of. A grant's
/// refusal is said as text.
pub type ChunkGrant<'g> = &'g mut dyn super::Grant<Refusal = String>;

fn hash(bytes: &[u8]) -> u64 {
    HighwayHasher::new(Key(HASH_KEY)).hash64(bytes)
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A varint64 at the start of `bytes`, and the bytes after it.
fn take_varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

/// Where a chunk beginning at `begin` ends: after its header, data and the
/// block headers among them, and far enough that it spans at least one byte
/// per record and does not end inside or right after a block header.
fn chunk_end(begin: u64, data_size: u64, num_records: u64) -> u64 {
    let with_headers = |pos: u64, size: u64| {
        let blocks = (size + (pos + USABLE_BLOCK_SIZE - 1) % BLOCK_SIZE) / USABLE_BLOCK_SIZE;
        pos + size + blocks * BLOCK_HEADER_SIZE
    };
    let possible_boundary = |pos: u64| {
        let remaining = BLOCK_SIZE - 1 - (pos + BLOCK_SIZE - 1) % BLOCK_SIZE;
        pos + remaining.saturating_sub(USABLE_BLOCK_SIZE - 1)
    };
    with_headers(begin, CHUNK_HEADER_SIZE as u64 + data_size)
        .max(possible_boundary(begin + num_records))
}

/// A chunk ready to be placed in a file.
struct Chunk {
    chunk_type: u8,
    num_records: u64,
    decoded_data_size: u64,
    data: Vec<u8>,
}

impl Chunk {
    fn header(&self) -> [u8; CHUNK_HEADER_SIZE] {
        let mut header = [0u8; CHUNK_HEADER_SIZE];
        header[8..16].copy_from_slice(&(self.data.len() as u64).to_le_bytes());
        header[16..24].copy_from_slice(&hash(&self.data).to_le_bytes());
        let type_and_count = u64::from(self.chunk_type) | (self.num_records << 8);
        header[24..32].copy_from_slice(&type_and_count.to_le_bytes());
        header[32..40].copy_from_slice(&self.decoded_data_size.to_le_bytes());
        let header_hash = hash(&header[8..]);
        header[..8].copy_from_slice(&header_hash.to_le_bytes());
        header
    }

    /// A simple chunk of one record, Brotli-compressed.
    fn simple(record: &[u8]) -> Result<Chunk, RiegeliError> {
        let mut sizes = Vec::new();
        put_varint(&mut sizes, record.len() as u64);
        let sizes = brotli_block(&sizes)?;
        let values = brotli_block(record)?;
        let mut data = Vec::with_capacity(1 + 10 + sizes.len() + values.len());
        data.push(compression::BROTLI);
        put_varint(&mut data, sizes.len() as u64);
        data.extend_from_slice(&sizes);
        data.extend_from_slice(&values);
        Ok(Chunk {
            chunk_type: chunk_type::SIMPLE,
            num_records: 1,
            decoded_data_size: record.len() as u64,
            data,
        })
    }
}

/// `bytes` Brotli-compressed, prefixed with their size as the format wants.
fn brotli_block(bytes: &[u8]) -> Result<Vec<u8>, RiegeliError> {
    let mut out = Vec::with_capacity(bytes.len() / 4 + 16);
    put_varint(&mut out, bytes.len() as u64);
    let mut writer =
        brotli::CompressorWriter::new(out, BROTLI_BUFFER, BROTLI_QUALITY, BROTLI_WINDOW_LOG);
    writer.write_all(bytes).map_err(RiegeliError::Brotli)?;
    writer.flush().map_err(RiegeliError::Brotli)?;
    Ok(writer.into_inner())
}

/// A Riegeli/records file being written in memory: it begins with the file
/// signature, and each record added is a chunk of its own.
pub struct FileWriter {
    out: Vec<u8>,
    records: u64,
}

impl Default for FileWriter {
    fn default() -> Self {
        let mut writer = FileWriter {
            out: Vec::new(),
            records: 0,
        };
        writer.push(&Chunk {
            chunk_type: chunk_type::FILE_SIGNATURE,
            num_records: 0,
            decoded_data_size: 0,
            data: Vec::new(),
        });
        writer
    }
}

impl FileWriter {
    /// Appends one record (compressed here, on the calling thread).
    pub fn write_record(&mut self, record: &[u8]) -> Result<(), RiegeliError> {
        self.push(&Chunk::simple(record)?);
        Ok(())
    }

    /// Appends `records`, compressing up to `threads` of them at once (each
    /// chunk is compressed on its own) and placing them in their order.
    pub fn write_records<I>(&mut self, records: I, threads: usize) -> Result<(), RiegeliError>
    where
        I: Iterator<Item = Vec<u8>> + Send,
    {
        struct Shared<'w, I> {
            source: std::iter::Enumerate<I>,
            /// Compressed chunks waiting for those before them.
            ready: std::collections::BTreeMap<usize, Chunk>,
            next: usize,
            writer: &'w mut FileWriter,
            failed: Option<RiegeliError>,
        }
        let shared = Mutex::new(Shared {
            source: records.enumerate(),
            ready: Default::default(),
            next: 0,
            writer: self,
            failed: None,
        });
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| loop {
                    let Some((index, record)) = ({
                        let mut shared = shared.lock();
                        if shared.failed.is_some() {
                            None
                        } else {
                            shared.source.next()
                        }
                    }) else {
                        return;
                    };
                    let chunk = Chunk::simple(&record);
                    drop(record);
                    let mut shared = shared.lock();
                    match chunk {
                        Ok(chunk) => {
                            shared.ready.insert(index, chunk);
                            while let Some(chunk) = {
                                let next = shared.next;
                                shared.ready.remove(&next)
                            } {
                                shared.writer.push(&chunk);
                                shared.next += 1;
                            }
                        }
                        Err(error) => shared.failed = Some(error),
                    }
                });
            }
        });
        match shared.into_inner().failed {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// The file's bytes so far: a complete file after every record.
    pub fn bytes(&self) -> &[u8] {
        &self.out
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.out
    }

    fn push(&mut self, chunk: &Chunk) {
        let begin = self.out.len() as u64;
        let end = chunk_end(begin, chunk.data.len() as u64, chunk.num_records);
        self.interleave(&chunk.header(), begin, end);
        self.interleave(&chunk.data, begin, end);
        let padding = end - self.out.len() as u64;
        if padding > 0 {
            self.interleave(&vec![0; padding as usize], begin, end);
        }
        debug_assert_eq!(self.out.len() as u64, end, "padding overran the chunk");
        self.records += chunk.num_records;
    }

    /// Appends `bytes` of the chunk `begin..end`, with a block header
    /// wherever a block starts.
    fn interleave(&mut self, mut bytes: &[u8], begin: u64, end: u64) {
        while !bytes.is_empty() {
            let pos = self.out.len() as u64;
            if pos.is_multiple_of(BLOCK_SIZE) {
                let mut header = [0u8; BLOCK_HEADER_SIZE as usize];
                header[8..16].copy_from_slice(&(pos - begin).to_le_bytes());
                header[16..24].copy_from_slice(&(end - pos).to_le_bytes());
                let header_hash = hash(&header[8..]);
                header[..8].copy_from_slice(&header_hash.to_le_bytes());
                self.out.extend_from_slice(&header);
            }
            let room = (BLOCK_SIZE - self.out.len() as u64 % BLOCK_SIZE) as usize;
            let (now, later) = bytes.split_at(room.min(bytes.len()));
            self.out.extend_from_slice(now);
            bytes = later;
        }
    }
}

/// Whether `bytes` begin with the file signature every Riegeli/records
/// file begins with (its first 64 bytes).
pub fn begins_with_signature(bytes: &[u8]) -> bool {
    let signature = FileWriter::default().into_bytes();
    bytes.starts_with(&signature)
}

/// The records of a Riegeli/records file, in order. Chunks other than
/// records (signature, metadata, padding) are passed over.
pub struct Records<'f> {
    file: &'f [u8],
    pos: u64,
    /// Records of the chunk read last, still to be handed out.
    pending: std::vec::IntoIter<Vec<u8>>,
    failed: bool,
    grant: Option<ChunkGrant<'f>>,
    /// Bytes of the chunk read last drawn from the grant, let go of when
    /// the next is read.
    drawn: usize,
}

/// Reads the records of `file`.
pub fn records(file: &[u8]) -> Records<'_> {
    Records {
        file,
        pos: 0,
        pending: Vec::new().into_iter(),
        failed: false,
        grant: None,
        drawn: 0,
    }
}

/// Reads the records of `file`, drawing what each chunk decompresses to
/// from `grant` before decompressing it (a file's sizes are anyone's who
/// could write it: 350 bytes can claim, and inflate to, 32 MiB).
pub fn records_within<'f>(file: &'f [u8], grant: ChunkGrant<'f>) -> Records<'f> {
    let mut records = records(file);
    records.grant = Some(grant);
    records
}

impl Iterator for Records<'_> {
    type Item = Result<Vec<u8>, RiegeliError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(record) = self.pending.next() {
                return Some(Ok(record));
            }
            if let Some(grant) = self.grant.as_mut() {
                grant.let_go(std::mem::take(&mut self.drawn));
            }
            if self.failed || self.pos >= self.file.len() as u64 {
                return None;
            }
            match self.next_chunk() {
                Ok(records) => self.pending = records.into_iter(),
                Err(error) => {
                    self.failed = true;
                    // Whatever is wrong with the first chunk, the file is
                    // not one of ours to read.
                    let first = self.pos == 0;
                    return Some(Err(if first {
                        RiegeliError::NoSignature
                    } else {
                        error
                    }));
                }
            }
        }
    }
}

impl Drop for Records<'_> {
    /// A reader that stops early (at damage, or having found what it
    /// wanted) lets go of the chunk it read last.
    fn drop(&mut self) {
        if let Some(grant) = self.grant.as_mut() {
            grant.let_go(std::mem::take(&mut self.drawn));
        }
    }
}

impl Records<'_> {
    /// Draws `bytes` more from the grant it reads within (what its records
    /// decode to), kept until the whole file is read.
    pub fn draw(&mut self, bytes: u64) -> Result<(), String> {
        match self.grant.as_mut() {
            Some(grant) => grant.take(usize::try_from(bytes).unwrap_or(usize::MAX)),
            None => Ok(()),
        }
    }

    /// Reads the chunk at `self.pos` and moves past it.
    fn next_chunk(&mut self) -> Result<Vec<Vec<u8>>, RiegeliError> {
        let begin = self.pos;
        let (header, after_header) = self.read(begin, CHUNK_HEADER_SIZE as u64)?;
        let word = |i: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&header[i * 8..i * 8 + 8]);
            u64::from_le_bytes(bytes)
        };
        if hash(&header[8..]) != word(0) {
            return Err(RiegeliError::Corrupted {
                what: "chunk header hash mismatch",
                at: begin,
            });
        }
        let data_size = word(1);
        let kind = header[24];
        let num_records = word(3) >> 8;
        let decoded_data_size = word(4);
        if begin == 0 && kind != chunk_type::FILE_SIGNATURE {
            return Err(RiegeliError::NoSignature);
        }
        let (data, _) = self.read(after_header, data_size)?;
        if hash(&data) != word(2) {
            return Err(RiegeliError::Corrupted {
                what: "chunk data hash mismatch",
                at: begin,
            });
        }
        self.pos = chunk_end(begin, data_size, num_records);
        match kind {
            chunk_type::FILE_SIGNATURE | chunk_type::FILE_METADATA | chunk_type::PADDING => {
                Ok(Vec::new())
            }
            chunk_type::SIMPLE => {
                let chunk = SimpleChunk::parse(&data, num_records, decoded_data_size, begin)?;
                if let Some(grant) = self.grant.as_mut() {
                    let bytes = chunk.held_bytes();
                    let held = usize::try_from(bytes).unwrap_or(usize::MAX);
                    grant.take(held).map_err(|why| RiegeliError::Refused {
                        at: begin,
                        bytes,
                        why,
                    })?;
                    self.drawn = held;
                }
                chunk.records()
            }
            chunk_type::TRANSPOSED => Err(RiegeliError::Unsupported {
                at: begin,
                what: "a transposed chunk".into(),
            }),
            other => Err(RiegeliError::Unsupported {
                at: begin,
                what: format!("of unknown type 0x{other:02x}"),
            }),
        }
    }

    /// `size` bytes of a chunk from `pos` on, block headers left out, and
    /// the position after them.
    fn read(&self, mut pos: u64, size: u64) -> Result<(Vec<u8>, u64), RiegeliError> {
        let mut out = Vec::with_capacity(size.min(self.file.len() as u64) as usize);
        let mut left = size;
        while left > 0 {
            if pos.is_multiple_of(BLOCK_SIZE) {
                pos += BLOCK_HEADER_SIZE;
            }
            let run = (BLOCK_SIZE - pos % BLOCK_SIZE).min(left);
            let bytes = to_range(pos, run)
                .and_then(|range| self.file.get(range))
                .ok_or(RiegeliError::Truncated { at: self.pos })?;
            out.extend_from_slice(bytes);
            pos += run;
            left -= run;
        }
        Ok((out, pos))
    }
}

fn to_range(pos: u64, len: u64) -> Option<Range<usize>> {
    let start = usize::try_from(pos).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    Some(start..end)
}

/// A simple chunk's parts, their decompressed sizes known (and checked
/// against its header) before anything is decompressed.
struct SimpleChunk<'d> {
    kind: u8,
    sizes: &'d [u8],
    sizes_len: u64,
    values: &'d [u8],
    values_len: u64,
    num_records: u64,
    at: u64,
}

impl<'d> SimpleChunk<'d> {
    fn parse(
        data: &'d [u8],
        num_records: u64,
        decoded_data_size: u64,
        at: u64,
    ) -> Result<SimpleChunk<'d>, RiegeliError> {
        let corrupted = |what| RiegeliError::Corrupted { what, at };
        let (&kind, rest) = data.split_first().ok_or(corrupted("empty simple chunk"))?;
        let (sizes_size, rest) = take_varint(rest).ok_or(corrupted("bad sizes length"))?;
        let sizes_size = usize::try_from(sizes_size)
            .ok()
            .filter(|size| *size <= rest.len())
            .ok_or(corrupted("sizes past the chunk's end"))?;
        let (sizes, values) = rest.split_at(sizes_size);
        let sizes_len = decompressed_len(kind, sizes, at)?;
        let values_len = decompressed_len(kind, values, at)?;
        if values_len != decoded_data_size {
            return Err(corrupted("values of another size than the header says"));
        }
        // A record's size takes one byte at least, ten at most.
        if sizes_len < num_records || sizes_len > num_records.saturating_mul(10) {
            return Err(corrupted("sizes of another length than the records need"));
        }
        Ok(SimpleChunk {
            kind,
            sizes,
            sizes_len,
            values,
            values_len,
            num_records,
            at,
        })
    }

    /// What reading its records holds at most: both parts decompressed
    /// (at up to twice their size while they grow), and the records copied
    /// out of them, each an allocation of its own.
    fn held_bytes(&self) -> u64 {
        const ALLOCATION: u64 = 16;
        let record = std::mem::size_of::<Vec<u8>>() as u64 + ALLOCATION;
        self.sizes_len
            .saturating_mul(2)
            .saturating_add(self.values_len.saturating_mul(3))
            .saturating_add(self.num_records.saturating_mul(record))
    }

    fn records(self) -> Result<Vec<Vec<u8>>, RiegeliError> {
        let at = self.at;
        let corrupted = |what| RiegeliError::Corrupted { what, at };
        let sizes = decompress(self.kind, self.sizes, self.sizes_len, at)?;
        let values = decompress(self.kind, self.values, self.values_len, at)?;
        // No more records than sizes, which are there now.
        let mut records = Vec::with_capacity(usize::try_from(self.num_records).unwrap_or(0));
        let mut sizes = sizes.as_slice();
        let mut values = values.as_slice();
        for _ in 0..self.num_records {
            let (size, rest) = take_varint(sizes).ok_or(corrupted("bad record size"))?;
            sizes = rest;
            let size = usize::try_from(size)
                .ok()
                .filter(|size| *size <= values.len())
                .ok_or(corrupted("record past the chunk's values"))?;
            let (record, rest) = values.split_at(size);
            records.push(record.to_vec());
            values = rest;
        }
        if !sizes.is_empty() || !values.is_empty() {
            return Err(corrupted("more sizes or values than records"));
        }
        Ok(records)
    }
}

/// The size a block of compression `kind` says it decompresses to (its
/// own length, uncompressed).
fn decompressed_len(kind: u8, block: &[u8], at: u64) -> Result<u64, RiegeliError> {
    match kind {
        compression::NONE => Ok(block.len() as u64),
        compression::BROTLI => {
            take_varint(block)
                .map(|(size, _)| size)
                .ok_or(RiegeliError::Corrupted {
                    what: "bad decompressed size",
                    at,
                })
        }
        compression::ZSTD | compression::SNAPPY => Err(RiegeliError::Unsupported {
            at,
            what: format!(
                "{}-compressed",
                if kind == compression::ZSTD {
                    "Zstd"
                } else {
                    "Snappy"
                }
            ),
        }),
        other => Err(RiegeliError::Unsupported {
            at,
            what: format!("compressed with unknown type 0x{other:02x}"),
        }),
    }
}

/// A compressed block of compression `kind`, decompressed: `size` bytes
/// ([`decompressed_len`]), never more.
fn decompress(kind: u8, block: &[u8], size: u64, at: u64) -> Result<Vec<u8>, RiegeliError> {
    if kind == compression::NONE {
        return Ok(block.to_vec());
    }
    let corrupted = |what| RiegeliError::Corrupted { what, at };
    let (_, compressed) = take_varint(block).ok_or(corrupted("bad decompressed size"))?;
    let mut out = Vec::with_capacity(
        usize::try_from(size)
            .unwrap_or(MAX_RESERVE)
            .min(MAX_RESERVE),
    );
    // One byte more than announced shows a block that decompresses to more.
    brotli::Decompressor::new(compressed, BROTLI_BUFFER)
        .take(size.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(RiegeliError::Brotli)?;
    if out.len() as u64 != size {
        return Err(corrupted("block of another size than its prefix says"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first 64 bytes of every Riegeli/records file, from the format's
    /// specification.
    const SIGNATURE: [u8; 64] = [
        0x83, 0xaf, 0x70, 0xd1, 0x0d, 0x88, 0x4a, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x91, 0xba, 0xc2, 0x3c, 0x92, 0x87,
        0xe1, 0xa9, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe1, 0x9f, 0x13, 0xc0, 0xe9,
        0xb1, 0xc3, 0x72, 0x73, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00,
    ];

    fn all(file: &[u8]) -> Result<Vec<Vec<u8>>, RiegeliError> {
        records(file).collect()
    }

    /// Bytes that compress poorly, so that records span many blocks.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    #[test]
    fn a_file_begins_with_the_specified_signature() {
        let file = FileWriter::default().into_bytes();
        assert_eq!(file, SIGNATURE);
        assert!(all(&file).unwrap().is_empty());
    }

    #[test]
    fn records_come_back_in_order_across_block_boundaries() {
        let records: Vec<Vec<u8>> = vec![
            b"first".to_vec(),
            Vec::new(),
            noise(200_000, 1),
            vec![7; 300_000],
            noise(65_536 - 100, 2),
            b"last".to_vec(),
        ];
        let mut one_thread = FileWriter::default();
        for record in &records {
            one_thread.write_record(record).unwrap();
        }
        let mut threaded = FileWriter::default();
        threaded
            .write_records(records.clone().into_iter(), 3)
            .unwrap();
        assert_eq!(one_thread.bytes(), threaded.bytes());
        assert_eq!(threaded.records(), records.len() as u64);
        let file = threaded.into_bytes();
        assert!(file.len() as u64 > 4 * BLOCK_SIZE, "spans several blocks");
        assert_eq!(all(&file).unwrap(), records);
    }

    #[test]
    fn chunk_ends_follow_the_specification() {
        // The signature: header after the first block header.
        assert_eq!(chunk_end(0, 0, 0), 64);
        // A chunk that fills its block exactly ends at the boundary...
        assert_eq!(chunk_end(64, BLOCK_SIZE - 64 - 40, 1), BLOCK_SIZE);
        // ...one byte more crosses it and its block header.
        assert_eq!(chunk_end(64, BLOCK_SIZE - 64 - 39, 1), BLOCK_SIZE + 25);
        // Many records in few bytes: a byte per record, never right after a
        // block header.
        assert_eq!(chunk_end(64, 0, BLOCK_SIZE - 64), BLOCK_SIZE);
        assert_eq!(chunk_end(64, 0, BLOCK_SIZE - 63), BLOCK_SIZE + 25);
    }

    /// A file of one uncompressed simple chunk, laid out by hand.
    fn uncompressed(records: &[&[u8]]) -> Vec<u8> {
        let mut data = vec![compression::NONE];
        let mut sizes = Vec::new();
        for record in records {
            put_varint(&mut sizes, record.len() as u64);
        }
        put_varint(&mut data, sizes.len() as u64);
        data.extend_from_slice(&sizes);
        let mut size = 0;
        for record in records {
            data.extend_from_slice(record);
            size += record.len() as u64;
        }
        let mut file = FileWriter::default();
        file.push(&Chunk {
            chunk_type: chunk_type::SIMPLE,
            num_records: records.len() as u64,
            decoded_data_size: size,
            data,
        });
        file.into_bytes()
    }

    #[test]
    fn uncompressed_chunks_of_several_records_are_read() {
        let file = uncompressed(&[b"a", b"bc", b"def"]);
        assert_eq!(
            all(&file).unwrap(),
            vec![b"a".to_vec(), b"bc".to_vec(), b"def".to_vec()]
        );
    }

    #[test]
    fn damage_is_detected_not_read_as_records() {
        let mut file = FileWriter::default();
        file.write_record(&noise(100_000, 3)).unwrap();
        let file = file.into_bytes();

        let mut flipped = file.clone();
        flipped[64 + 40 + 5_000] ^= 1;
        assert!(matches!(
            all(&flipped),
            Err(RiegeliError::Corrupted {
                what: "chunk data hash mismatch",
                at: 64
            })
        ));

        let mut header = file.clone();
        header[64 + 9] ^= 1;
        assert!(matches!(
            all(&header),
            Err(RiegeliError::Corrupted { at: 64, .. })
        ));

        assert!(matches!(
            all(&file[..file.len() - 10]),
            Err(RiegeliError::Truncated { at: 64 })
        ));
        assert!(matches!(
            all(b"not a riegeli file at all, just text that is long enough"),
            Err(RiegeliError::NoSignature)
        ));
    }

    #[test]
    fn other_encodings_are_named_not_misread() {
        let mut file = FileWriter::default();
        file.push(&Chunk {
            chunk_type: chunk_type::TRANSPOSED,
            num_records: 1,
            decoded_data_size: 1,
            data: vec![0; 8],
        });
        let error = all(&file.into_bytes()).unwrap_err();
        assert!(error.to_string().contains("transposed"), "{error}");

        let mut file = FileWriter::default();
        file.push(&Chunk {
            chunk_type: chunk_type::SIMPLE,
            num_records: 1,
            decoded_data_size: 1,
            data: vec![compression::ZSTD, 0],
        });
        let error = all(&file.into_bytes()).unwrap_err();
        assert!(error.to_string().contains("Zstd"), "{error}");
    }

    /// A grant of `left` bytes in all.
    struct Limit {
        left: usize,
        held: usize,
    }

    impl crate::xspace::Grant for Limit {
        type Refusal = String;

        fn take(&mut self, bytes: usize) -> Result<(), String> {
            if self.held + bytes > self.left {
                return Err(format!("{bytes} bytes more than {}", self.left));
            }
            self.held += bytes;
            Ok(())
        }

        fn let_go(&mut self, bytes: usize) {
            self.held -= bytes;
        }
    }

    /// A few hundred bytes that inflate to 8 MiB are drawn at what they
    /// inflate to before they do, and refused past the grant; read within a
    /// grant that holds them, each chunk's bytes are let go of after it.
    #[test]
    fn a_small_chunk_that_inflates_far_is_refused_before_it_does() {
        let mut file = FileWriter::default();
        file.write_record(&vec![0; 8 << 20]).unwrap();
        file.write_record(&vec![0; 8 << 20]).unwrap();
        let file = file.into_bytes();
        assert!(file.len() < 4096, "{} bytes", file.len());

        let mut small = Limit {
            left: 1 << 20,
            held: 0,
        };
        let first = records_within(&file, &mut small).next().unwrap();
        assert!(
            matches!(first, Err(RiegeliError::Refused { bytes, .. }) if bytes >= 16 << 20),
            "{first:?}"
        );
        assert_eq!(small.held, 0);

        let mut enough = Limit {
            left: 32 << 20,
            held: 0,
        };
        let read = records_within(&file, &mut enough)
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(enough.held, 0, "a chunk's bytes are let go of after it");

        // A reader that stops after the first record lets go of its chunk.
        let mut first_only = Limit {
            left: 32 << 20,
            held: 0,
        };
        let mut reading = records_within(&file, &mut first_only);
        assert!(reading.next().unwrap().is_ok());
        drop(reading);
        assert_eq!(first_only.held, 0, "a chunk held by a reader that stopped");
    }

    /// A block whose size prefix says more than the chunk's header is
    /// refused before anything is inflated.
    #[test]
    fn a_block_claiming_more_than_its_header_is_corrupted() {
        let mut chunk = Chunk::simple(b"a record").unwrap();
        chunk.decoded_data_size = 1 << 40;
        let mut file = FileWriter::default();
        file.push(&chunk);
        let error = all(&file.into_bytes()).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("values of another size than the header says"),
            "{error}"
        );
    }
}
