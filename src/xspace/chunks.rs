//! Traces too large for one protobuf message (2 GiB), stored as XProf reads
//! them: `<host>.xplane.riegeli`, a Riegeli/records file ([`crate::xspace::riegeli`])
//! whose records are XSpace chunks, each a valid XSpace holding part of the
//! trace.
//!
//! Splitting works on the encoded bytes, without decoding events: planes
//! go whole into a chunk while they fit, a larger plane is cut between its
//! lines and a larger line between its events. Every piece of a plane
//! repeats the plane's id, name, metadata and stats, every piece of a line
//! its id, names and timestamp, as TensorFlow's own chunking does, so each
//! chunk stands on its own. Reading merges the chunks back the way XProf
//! does: planes by name, lines by id (events appended in chunk order),
//! metadata by name.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::ops::Range;

use prost::Message;

use crate::proto::tensorflow::profiler::{x_event, x_stat, XLine, XPlane, XSpace, XStat};
use crate::xspace::riegeli::{self, ChunkGrant, FileWriter, RiegeliError};

use super::builder::field;
use super::merge::FreshIds;
use super::read::{Malformed, WireReader, WireValue};
use super::wire::{varint_len, Writer};

/// Suffix of chunked trace files.
pub const RIEGELI_SUFFIX: &str = ".xplane.riegeli";

/// Longest host part of a trace's file name: the longest name it is given
/// is `<host>.xplane.riegeli`, and a file name holds at most 255 bytes
/// (`NAME_MAX` on every Linux file system).
pub const LONGEST_HOST_PART: usize = 255 - RIEGELI_SUFFIX.len();

/// Largest chunk whatever the limit: chunks are compressed several at a
/// time, and each is held whole while it is.
pub const MAX_CHUNK_BYTES: usize = 64 << 20;

/// Bytes a nested message adds to its fields, at most (key and length).
const MESSAGE_OVERHEAD: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    #[error(transparent)]
    Malformed(#[from] Malformed),
    #[error(transparent)]
    Riegeli(#[from] RiegeliError),
    #[error("chunk {index} is not an XSpace: {source}")]
    Decode {
        index: usize,
        source: prost::DecodeError,
    },
    #[error("chunk {index} decodes to {bytes} bytes, more than may be held: {why}")]
    Refused {
        index: usize,
        bytes: u64,
        why: String,
    },
    #[error(
        "merging chunk {index} into those before it takes {bytes} bytes more, more than may be \
         held: {why}"
    )]
    MergeRefused {
        index: usize,
        bytes: u64,
        why: String,
    },
}

/// A trace stored as Riegeli chunks of XSpace.
pub struct ChunkedTrace {
    file: FileWriter,
}

impl ChunkedTrace {
    /// Splits the encoded XSpace `space` into chunks of at most about
    /// `limit` bytes (and [`MAX_CHUNK_BYTES`]) and compresses them.
    pub fn encode(space: &[u8], limit: usize) -> Result<ChunkedTrace, ChunkError> {
        let plans = Splitter::split(space, limit.clamp(1, MAX_CHUNK_BYTES))?;
        let mut file = FileWriter::default();
        file.write_records(
            plans.iter().map(|parts| materialize(space, parts)),
            compression_threads(),
        )?;
        Ok(ChunkedTrace { file })
    }

    /// Adds `warning` to the trace's warnings: one more chunk, holding it
    /// alone, so nothing written before changes.
    pub fn append_warning(&mut self, warning: &str) -> Result<(), ChunkError> {
        let mut chunk = Writer::default();
        chunk.text(field::SPACE_WARNINGS, warning);
        self.file.write_record(&chunk.into_bytes())?;
        Ok(())
    }

    pub fn chunks(&self) -> u64 {
        self.file.records()
    }

    /// The `.xplane.riegeli` file.
    pub fn bytes(&self) -> &[u8] {
        self.file.bytes()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.file.into_bytes()
    }
}

impl AsRef<[u8]> for ChunkedTrace {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

/// Threads that compress chunks: half the cores (the others belong to the
/// host's workload), at most eight.
fn compression_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    (cores / 2).clamp(1, 8)
}

/// A chunked trace read back as one XSpace, and how many chunks it had.
pub fn decode(file: &[u8]) -> Result<(XSpace, usize), ChunkError> {
    decode_records(riegeli::records(file))
}

/// As [`decode`], drawing from `grant` what each chunk decompresses to and
/// what each decodes to before it does: the most it holds is granted.
pub fn decode_within(file: &[u8], grant: ChunkGrant<'_>) -> Result<(XSpace, usize), ChunkError> {
    decode_records(riegeli::records_within(file, grant))
}

fn decode_records(mut records: riegeli::Records<'_>) -> Result<(XSpace, usize), ChunkError> {
    let mut merged = ChunkMerge::default();
    let mut chunks = 0;
    while let Some(record) = records.next() {
        let record = record?;
        let decoded = super::footprint::decoded_bytes(&record)?;
        records.draw(decoded).map_err(|why| ChunkError::Refused {
            index: chunks,
            bytes: decoded,
            why,
        })?;
        let chunk = XSpace::decode(record.as_slice()).map_err(|source| ChunkError::Decode {
            index: chunks,
            source,
        })?;
        let indexed = ChunkMerge::index_bytes(&chunk);
        records
            .draw(indexed)
            .map_err(|why| ChunkError::MergeRefused {
                index: chunks,
                bytes: indexed,
                why,
            })?;
        merged.add(chunk);
        chunks += 1;
    }
    Ok((merged.finish(), chunks))
}

/// What a chunk is made of: spans of the trace's bytes, and messages put
/// together from spans (the pieces of planes and lines).
#[derive(Clone, Debug)]
enum Part {
    Span(Range<usize>),
    Message {
        field: u32,
        parts: Vec<Part>,
        /// Encoded length of `parts`.
        length: usize,
    },
}

impl Part {
    fn message(field: u32, parts: Vec<Part>) -> Part {
        let length = parts.iter().map(Part::encoded_len).sum();
        Part::Message {
            field,
            parts,
            length,
        }
    }

    fn encoded_len(&self) -> usize {
        match self {
            Part::Span(range) => range.len(),
            Part::Message { field, length, .. } => {
                varint_len(u64::from(*field) << 3) + varint_len(*length as u64) + length
            }
        }
    }
}

/// Appends `range`, joined to the span before it when they touch.
fn push_span(parts: &mut Vec<Part>, range: Range<usize>) {
    if let Some(Part::Span(last)) = parts.last_mut() {
        if last.end == range.start {
            last.end = range.end;
            return;
        }
    }
    parts.push(Part::Span(range));
}

fn materialize(bytes: &[u8], parts: &[Part]) -> Vec<u8> {
    let mut out = Writer::with_capacity(parts.iter().map(Part::encoded_len).sum());
    write_parts(&mut out, bytes, parts);
    out.into_bytes()
}

fn write_parts(out: &mut Writer, bytes: &[u8], parts: &[Part]) {
    for part in parts {
        match part {
            Part::Span(range) => out.raw(&bytes[range.clone()]),
            Part::Message {
                field,
                parts,
                length,
            } => {
                out.message_prefix(*field, *length);
                write_parts(out, bytes, parts);
            }
        }
    }
}

/// One field of an encoded message, by where it lies in the whole buffer.
struct Field {
    number: u64,
    whole: Range<usize>,
    /// Where the contents of a length-delimited field lie.
    contents: Option<Range<usize>>,
}

/// The fields of the message at `message` of `bytes`.
fn fields(
    bytes: &[u8],
    message: Range<usize>,
) -> impl Iterator<Item = Result<Field, Malformed>> + '_ {
    let end = message.end;
    let mut reader = WireReader(&bytes[message]);
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed {
            return None;
        }
        let start = end - reader.0.len();
        match reader.next_field() {
            Ok(None) => None,
            Ok(Some((number, value))) => {
                let field_end = end - reader.0.len();
                let contents = match value {
                    WireValue::Bytes(contents) => Some(field_end - contents.len()..field_end),
                    WireValue::Scalar => None,
                };
                Some(Ok(Field {
                    number,
                    whole: start..field_end,
                    contents,
                }))
            }
            Err(error) => {
                failed = true;
                Some(Err(error))
            }
        }
    })
}

/// A message's fields split into those named `number` (length-delimited)
/// and the rest, kept as spans.
fn separate(
    bytes: &[u8],
    message: Range<usize>,
    number: u32,
) -> Result<(Vec<Part>, Vec<Field>), Malformed> {
    let mut rest = Vec::new();
    let mut matching = Vec::new();
    for field in fields(bytes, message) {
        let field = field?;
        if field.number == u64::from(number) && field.contents.is_some() {
            matching.push(field);
        } else {
            push_span(&mut rest, field.whole);
        }
    }
    Ok((rest, matching))
}

fn parts_len(parts: &[Part]) -> usize {
    parts.iter().map(Part::encoded_len).sum()
}

/// Room for the contents of a piece whose `header` is repeated in each:
/// the limit less the header, but never less than half the limit (a header
/// as large as the limit makes pieces exceed it rather than be empty).
fn piece_budget(limit: usize, header: &[Part]) -> usize {
    limit
        .saturating_sub(parts_len(header) + MESSAGE_OVERHEAD)
        .max(limit / 2)
        .max(1)
}

/// Lays out the chunks of one encoded XSpace.
struct Splitter<'b> {
    bytes: &'b [u8],
    limit: usize,
    done: Vec<Vec<Part>>,
    current: Vec<Part>,
    current_len: usize,
}

impl<'b> Splitter<'b> {
    fn split(bytes: &'b [u8], limit: usize) -> Result<Vec<Vec<Part>>, Malformed> {
        let mut splitter = Splitter {
            bytes,
            limit,
            done: Vec::new(),
            current: Vec::new(),
            current_len: 0,
        };
        let (space_fields, planes) = separate(bytes, 0..bytes.len(), field::SPACE_PLANES)?;
        for plane in planes {
            splitter.plane(plane)?;
        }
        // Host names, errors and warnings once, in the first chunk.
        match splitter.done.first_mut() {
            Some(first) => first.extend(space_fields),
            None => splitter.current.extend(space_fields),
        }
        splitter.flush();
        if splitter.done.is_empty() {
            splitter.done.push(Vec::new());
        }
        Ok(splitter.done)
    }

    fn room(&self) -> usize {
        self.limit.saturating_sub(self.current_len)
    }

    fn add(&mut self, part: Part) {
        self.current_len += part.encoded_len();
        match part {
            Part::Span(range) => push_span(&mut self.current, range),
            message => self.current.push(message),
        }
    }

    fn flush(&mut self) {
        if !self.current.is_empty() {
            self.done.push(std::mem::take(&mut self.current));
        }
        self.current_len = 0;
    }

    fn plane(&mut self, plane: Field) -> Result<(), Malformed> {
        let size = plane.whole.len();
        if size > self.room() {
            self.flush();
        }
        let Some(contents) = plane.contents.filter(|_| size > self.limit) else {
            self.add(Part::Span(plane.whole));
            return Ok(());
        };
        let (header, lines) = separate(self.bytes, contents, field::PLANE_LINES)?;
        let budget = piece_budget(self.limit, &header);
        let piece_of = |lines: Vec<Part>| {
            let mut parts = header.clone();
            parts.extend(lines);
            Part::message(field::SPACE_PLANES, parts)
        };
        let mut piece: Vec<Part> = Vec::new();
        let mut piece_len = 0;
        for line in lines {
            let size = line.whole.len();
            if piece_len + size > budget && !piece.is_empty() {
                self.add(piece_of(std::mem::take(&mut piece)));
                self.flush();
                piece_len = 0;
            }
            if size <= budget {
                push_span(&mut piece, line.whole);
                piece_len += size;
                continue;
            }
            let mut parts = self.line_parts(line, budget)?;
            let last = parts.pop();
            for part in parts {
                self.add(piece_of(vec![part]));
                self.flush();
            }
            if let Some(last) = last {
                piece_len = last.encoded_len();
                piece.push(last);
            }
        }
        // The last piece stays in the current chunk, for the next planes.
        self.add(piece_of(piece));
        Ok(())
    }

    /// A line too large for one piece, as lines of at most `budget` bytes
    /// that each repeat its fields other than events. Its events are
    /// walked, not collected: a line may hold millions.
    fn line_parts(&self, line: Field, budget: usize) -> Result<Vec<Part>, Malformed> {
        let Some(contents) = line.contents else {
            return Ok(vec![Part::Span(line.whole)]);
        };
        let is_event = |field: &Field| {
            field.number == u64::from(field::LINE_EVENTS) && field.contents.is_some()
        };
        let mut header = Vec::new();
        for field in fields(self.bytes, contents.clone()) {
            let field = field?;
            if !is_event(&field) {
                push_span(&mut header, field.whole);
            }
        }
        let budget = piece_budget(budget, &header);
        let part_of = |events: Vec<Part>| {
            let mut parts = header.clone();
            parts.extend(events);
            Part::message(field::PLANE_LINES, parts)
        };
        let mut parts = Vec::new();
        let mut part: Vec<Part> = Vec::new();
        let mut part_len = 0;
        for field in fields(self.bytes, contents) {
            let event = field?;
            if !is_event(&event) {
                continue;
            }
            let size = event.whole.len();
            if part_len + size > budget && !part.is_empty() {
                parts.push(part_of(std::mem::take(&mut part)));
                part_len = 0;
            }
            push_span(&mut part, event.whole);
            part_len += size;
        }
        if !part.is_empty() || parts.is_empty() {
            parts.push(part_of(part));
        }
        Ok(parts)
    }
}

/// Chunks folded into one XSpace as XProf merges the chunks of a trace:
/// host names, errors and warnings not yet there are added; a plane joins
/// the plane of the same name, its metadata matched by name (an entry with
/// a new name gets an id of its own, and references to it follow), its
/// stats added when the plane lacks them; a line joins the line of the
/// same id, its events appended after those already there.
///
/// What has been folded is indexed as it is folded, and a line's events
/// are moved onto its earliest timestamp once, at the end, so that each
/// chunk costs what it holds: a file of a million small chunks, each naming
/// a warning or a plane of its own, or each starting a line a little
/// earlier, would otherwise cost a million times everything before it.
#[derive(Default)]
pub struct ChunkMerge {
    space: XSpace,
    hostnames: TextIndex,
    errors: TextIndex,
    warnings: TextIndex,
    /// Plane name's hash -> its index in `space.planes`, and what the
    /// plane's merging needs to find there.
    planes: HashMap<u64, PlaneIndex>,
    hasher: RandomState,
    /// Whether a chunk has been folded in: the first is taken whole.
    started: bool,
}

/// Most bytes the index grows by per plane, metadata entry, line and text
/// a chunk brings (hash tables at their emptiest after growing, with the
/// plane's five of them), drawn with what the chunk decodes to.
const INDEX_BYTES_PER_PLANE: usize = 1024;
const INDEX_BYTES_PER_ENTRY: usize = 64;

/// One plane's entries by what chunks match them on.
struct PlaneIndex {
    at: usize,
    stat_names: NameIndex,
    event_names: NameIndex,
    /// Metadata ids of the plane's own stats.
    plane_stats: HashSet<i64>,
    lines: HashMap<i64, LineIndex>,
}

/// Where a line is in its plane, and the earliest timestamp of the lines
/// of its id folded into it. Its events stay relative to its own timestamp
/// until [`ChunkMerge::finish`] moves them onto the earliest.
struct LineIndex {
    at: usize,
    earliest_ns: i64,
}

/// One list of texts (host names, errors or warnings) by hash, each hit
/// checked against the list itself.
#[derive(Default)]
struct TextIndex(HashMap<u64, usize>);

/// Metadata ids by the hash of their name, and ids not yet used.
struct NameIndex {
    by_name: HashMap<u64, i64>,
    fresh: FreshIds,
}

impl ChunkMerge {
    /// Folds `chunk` in (see the type's documentation).
    pub fn add(&mut self, chunk: XSpace) {
        if !self.started {
            self.started = true;
            self.take_first(chunk);
            return;
        }
        let hasher = &self.hasher;
        let space = &mut self.space;
        self.hostnames
            .add_new(&mut space.hostnames, chunk.hostnames, hasher);
        self.errors.add_new(&mut space.errors, chunk.errors, hasher);
        self.warnings
            .add_new(&mut space.warnings, chunk.warnings, hasher);
        for plane in chunk.planes {
            let key = self.hash(&plane.name);
            match self.planes.get_mut(&key) {
                Some(index) if self.space.planes[index.at].name == plane.name => {
                    merge_plane(&mut self.space.planes[index.at], index, plane, &self.hasher);
                }
                // Another name of the same hash (never met in practice)
                // keeps its own plane.
                Some(_) => self.space.planes.push(plane),
                None => {
                    let index = PlaneIndex::of(&plane, self.space.planes.len(), &self.hasher);
                    self.planes.insert(key, index);
                    self.space.planes.push(plane);
                }
            }
        }
    }

    /// The merged trace, each line's events on its earliest timestamp.
    pub fn finish(mut self) -> XSpace {
        for plane in self.planes.values() {
            let lines = &mut self.space.planes[plane.at].lines;
            for index in plane.lines.values() {
                let line = &mut lines[index.at];
                if index.earliest_ns < line.timestamp_ns {
                    shift_events(line, line.timestamp_ns.saturating_sub(index.earliest_ns));
                    line.timestamp_ns = index.earliest_ns;
                }
            }
        }
        self.space
    }

    /// Most bytes folding `chunk` in adds to the index, beside the chunk's
    /// own (see [`INDEX_BYTES_PER_PLANE`]).
    pub fn index_bytes(chunk: &XSpace) -> u64 {
        let texts = chunk.hostnames.len() + chunk.errors.len() + chunk.warnings.len();
        let entries: usize = chunk
            .planes
            .iter()
            .map(|plane| {
                plane.stat_metadata.len()
                    + plane.event_metadata.len()
                    + plane.stats.len()
                    + plane.lines.len()
            })
            .sum();
        let bytes = chunk
            .planes
            .len()
            .saturating_mul(INDEX_BYTES_PER_PLANE)
            .saturating_add((texts + entries).saturating_mul(INDEX_BYTES_PER_ENTRY));
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }

    /// The first chunk, as it is (a trace of one chunk reads back exactly
    /// as it was written), indexed for those after it.
    fn take_first(&mut self, chunk: XSpace) {
        self.hostnames = TextIndex::of(&chunk.hostnames, &self.hasher);
        self.errors = TextIndex::of(&chunk.errors, &self.hasher);
        self.warnings = TextIndex::of(&chunk.warnings, &self.hasher);
        for (at, plane) in chunk.planes.iter().enumerate() {
            let key = self.hash(&plane.name);
            if !self.planes.contains_key(&key) {
                let index = PlaneIndex::of(plane, at, &self.hasher);
                self.planes.insert(key, index);
            }
        }
        self.space = chunk;
    }

    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }
}

impl TextIndex {
    /// `list` indexed as it is (of texts repeated, the first).
    fn of(list: &[String], hasher: &RandomState) -> TextIndex {
        let mut index = HashMap::new();
        for (at, text) in list.iter().enumerate() {
            index.entry(hasher.hash_one(text.as_str())).or_insert(at);
        }
        TextIndex(index)
    }

    /// Appends to `list` those of `texts` it lacks, each once.
    fn add_new(&mut self, list: &mut Vec<String>, texts: Vec<String>, hasher: &RandomState) {
        for text in texts {
            let key = hasher.hash_one(text.as_str());
            match self.0.get(&key) {
                Some(&at) if list[at] == text => continue,
                // Another text of the same hash (never met in practice):
                // looked for the slow way, and not indexed.
                Some(_) if list.contains(&text) => continue,
                Some(_) => {}
                None => {
                    self.0.insert(key, list.len());
                }
            }
            list.push(text);
        }
    }
}

impl PlaneIndex {
    fn of(plane: &XPlane, at: usize, hasher: &RandomState) -> PlaneIndex {
        PlaneIndex {
            at,
            stat_names: NameIndex::of(
                plane.stat_metadata.iter().map(|(id, m)| (*id, &*m.name)),
                hasher,
            ),
            event_names: NameIndex::of(
                plane.event_metadata.iter().map(|(id, m)| (*id, &*m.name)),
                hasher,
            ),
            plane_stats: plane.stats.iter().map(|stat| stat.metadata_id).collect(),
            lines: plane
                .lines
                .iter()
                .enumerate()
                .map(|(at, line)| {
                    let earliest_ns = line.timestamp_ns;
                    (line.id, LineIndex { at, earliest_ns })
                })
                .collect(),
        }
    }
}

impl NameIndex {
    /// `entries` (id, name) indexed by name; of two of one name, the
    /// lower id.
    fn of<'a>(entries: impl Iterator<Item = (i64, &'a str)>, hasher: &RandomState) -> NameIndex {
        let mut ids = Vec::new();
        let mut by_name: HashMap<u64, i64> = HashMap::new();
        for (id, name) in entries {
            ids.push(id);
            if !name.is_empty() {
                let entry = by_name.entry(hasher.hash_one(name)).or_insert(id);
                *entry = (*entry).min(id);
            }
        }
        NameIndex {
            by_name,
            fresh: FreshIds::new(ids),
        }
    }
}

/// Matches the entries of `theirs` to those of `ours` by name and adds the
/// others under fresh ids. Returns the mapping and the ids added.
fn match_by_name<T>(
    ours: &mut HashMap<i64, T>,
    index: &mut NameIndex,
    theirs: HashMap<i64, T>,
    name: fn(&T) -> &str,
    set_id: fn(&mut T, i64),
    hasher: &RandomState,
) -> (IdMap, Vec<i64>) {
    let mut map = HashMap::new();
    let mut added = Vec::new();
    // Entries added are matched from the next chunk on: within one chunk,
    // two entries of one name stay two.
    let mut named_later = Vec::new();
    let mut theirs: Vec<(i64, T)> = theirs.into_iter().collect();
    theirs.sort_by_key(|(id, _)| *id);
    for (id, mut entry) in theirs {
        let key = (!name(&entry).is_empty()).then(|| hasher.hash_one(name(&entry)));
        let existing = key
            .and_then(|key| index.by_name.get(&key))
            .filter(|existing| ours.get(existing).is_some_and(|e| name(e) == name(&entry)));
        if let Some(existing) = existing {
            map.insert(id, *existing);
            continue;
        }
        let new = index.fresh.next();
        set_id(&mut entry, new);
        ours.insert(new, entry);
        if let Some(key) = key {
            named_later.push((key, new));
        }
        map.insert(id, new);
        added.push(new);
    }
    for (key, id) in named_later {
        index.by_name.entry(key).or_insert(id);
    }
    (IdMap(map), added)
}

/// Their metadata ids and the ids they have in ours.
struct IdMap(HashMap<i64, i64>);

impl IdMap {
    fn get(&self, id: i64) -> i64 {
        self.0.get(&id).copied().unwrap_or(id)
    }

    fn stats(&self, stats: &mut [XStat]) {
        for stat in stats {
            stat.metadata_id = self.get(stat.metadata_id);
            if let Some(x_stat::Value::RefValue(target)) = &mut stat.value {
                *target = self.get(*target as i64) as u64;
            }
        }
    }
}

fn merge_plane(
    ours: &mut XPlane,
    index: &mut PlaneIndex,
    mut theirs: XPlane,
    hasher: &RandomState,
) {
    let (stats, _) = match_by_name(
        &mut ours.stat_metadata,
        &mut index.stat_names,
        std::mem::take(&mut theirs.stat_metadata),
        |m| &m.name,
        |m, id| m.id = id,
        hasher,
    );
    let (events, added) = match_by_name(
        &mut ours.event_metadata,
        &mut index.event_names,
        std::mem::take(&mut theirs.event_metadata),
        |m| &m.name,
        |m, id| m.id = id,
        hasher,
    );
    for id in added {
        if let Some(metadata) = ours.event_metadata.get_mut(&id) {
            stats.stats(&mut metadata.stats);
            for child in &mut metadata.child_id {
                *child = events.get(*child);
            }
        }
    }
    stats.stats(&mut theirs.stats);
    for stat in theirs.stats {
        if index.plane_stats.insert(stat.metadata_id) {
            ours.stats.push(stat);
        }
    }
    for mut line in theirs.lines {
        for event in &mut line.events {
            event.metadata_id = events.get(event.metadata_id);
            stats.stats(&mut event.stats);
        }
        match index.lines.get_mut(&line.id) {
            Some(entry) => append_line(&mut ours.lines[entry.at], &mut entry.earliest_ns, line),
            None => {
                let at = ours.lines.len();
                let earliest_ns = line.timestamp_ns;
                index.lines.insert(line.id, LineIndex { at, earliest_ns });
                ours.lines.push(line);
            }
        }
    }
}

/// Appends the events of `theirs` to `ours` (the same line), made relative
/// to `ours`' timestamp (an earlier line's events fall before it until
/// [`ChunkMerge::finish`]); `earliest_ns` keeps the earliest timestamp.
fn append_line(ours: &mut XLine, earliest_ns: &mut i64, mut theirs: XLine) {
    let later_by_ns = theirs.timestamp_ns.saturating_sub(ours.timestamp_ns);
    shift_events(&mut theirs, later_by_ns);
    *earliest_ns = (*earliest_ns).min(theirs.timestamp_ns);
    ours.events.append(&mut theirs.events);
    ours.duration_ps = ours.duration_ps.max(theirs.duration_ps);
}

/// Moves `line`'s events `by_ns` later on it.
fn shift_events(line: &mut XLine, by_ns: i64) {
    let by_ps = by_ns.saturating_mul(1000);
    for event in &mut line.events {
        if let Some(x_event::Data::OffsetPs(offset)) = &mut event.data {
            *offset = offset.saturating_add(by_ps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{XEvent, XEventMetadata, XStatMetadata};
    use crate::xspace::read::event_name;

    fn stat(metadata_id: i64, value: x_stat::Value) -> XStat {
        XStat {
            metadata_id,
            value: Some(value),
        }
    }

    /// Adds stat metadata and event metadata of these ids and names.
    fn add_metadata(plane: &mut XPlane, stats: &[(i64, &str)], events: &[(i64, &str)]) {
        plane.stat_metadata.extend(stats.iter().map(|(id, name)| {
            let metadata = XStatMetadata {
                id: *id,
                name: name.to_string(),
                description: String::new(),
            };
            (*id, metadata)
        }));
        plane.event_metadata.extend(events.iter().map(|(id, name)| {
            let metadata = XEventMetadata {
                id: *id,
                name: name.to_string(),
                ..XEventMetadata::default()
            };
            (*id, metadata)
        }));
    }

    /// A plane of `lines` lines of `events` events each, its metadata
    /// written after its lines as devtrace writes it.
    fn plane(id: i64, name: &str, lines: i64, events: i64) -> XPlane {
        let mut plane = XPlane {
            id,
            name: name.into(),
            ..XPlane::default()
        };
        let kernels: Vec<(i64, String)> = (1..=5).map(|id| (id, format!("kernel_{id}"))).collect();
        let kernels: Vec<(i64, &str)> = kernels.iter().map(|(id, n)| (*id, n.as_str())).collect();
        add_metadata(
            &mut plane,
            &[(1, "correlation_id"), (2, "tf_op"), (3, "MatMul:MatMul")],
            &kernels,
        );
        plane.stats.push(stat(1, x_stat::Value::Uint64Value(7)));
        for line in 0..lines {
            plane.lines.push(XLine {
                id: line * 3 + 1,
                display_id: line,
                name: format!("Stream #{line}"),
                timestamp_ns: 1_000 + line,
                duration_ps: 5_000_000,
                events: (0..events)
                    .map(|i| XEvent {
                        metadata_id: i % 5 + 1,
                        data: Some(x_event::Data::OffsetPs(i * 1_000)),
                        duration_ps: 500,
                        stats: vec![
                            stat(1, x_stat::Value::Uint64Value(i as u64)),
                            stat(2, x_stat::Value::RefValue(3)),
                        ],
                    })
                    .collect(),
                ..XLine::default()
            });
        }
        plane
    }

    fn trace() -> XSpace {
        XSpace {
            planes: vec![
                plane(0, "/device:GPU:0", 6, 400),
                plane(1, "/device:GPU:1", 1, 3_000),
                plane(2, "/device:GPU:2", 2, 3),
                plane(3, "/host:CPU", 40, 2),
            ],
            errors: vec!["an error".into()],
            warnings: vec!["a warning".into()],
            hostnames: vec!["worker-0".into()],
        }
    }

    fn chunks_of(file: &[u8]) -> Vec<XSpace> {
        riegeli::records(file)
            .map(|record| XSpace::decode(record.unwrap().as_slice()).unwrap())
            .collect()
    }

    #[test]
    fn chunks_are_each_an_xspace_and_merge_back_into_the_trace() {
        let space = trace();
        let bytes = space.encode_to_vec();
        let limit = 16 << 10;
        let chunked = ChunkedTrace::encode(&bytes, limit).unwrap();
        let chunks = chunks_of(chunked.bytes());
        assert_eq!(chunks.len() as u64, chunked.chunks());
        assert!(chunks.len() > 5, "{} chunks", chunks.len());
        for chunk in &chunks {
            let size = chunk.encoded_len();
            assert!(size <= limit, "a chunk of {size} bytes");
            for plane in &chunk.planes {
                // Each piece of a plane stands on its own.
                assert!(!plane.event_metadata.is_empty() && !plane.stat_metadata.is_empty());
                assert_eq!(plane.stats.len(), 1);
            }
        }
        let pieces = |name: &str| {
            chunks
                .iter()
                .filter(|c| c.planes.iter().any(|p| p.name == name))
                .count()
        };
        // Too large for a chunk: cut between lines, and the one long line
        // between events; the small planes share chunks.
        assert!(pieces("/device:GPU:0") > 1);
        assert!(pieces("/device:GPU:1") > 1);
        assert_eq!(pieces("/device:GPU:2"), 1);
        let shared = chunks
            .iter()
            .find(|c| c.planes.iter().any(|p| p.name == "/device:GPU:2"));
        assert!(shared.is_some_and(|c| c.planes.len() > 1));
        assert_eq!(chunks[0].hostnames, vec!["worker-0"]);
        assert!(chunks[1..].iter().all(|c| c.hostnames.is_empty()));

        let (merged, count) = decode(chunked.bytes()).unwrap();
        assert_eq!(count, chunks.len());
        assert_eq!(merged, space);
    }

    #[test]
    fn a_trace_devtrace_built_reads_back_event_for_event() {
        use crate::backend::mock::{MockConfig, Workload};
        use crate::model::registry::Registry;
        use crate::recorder::Window;
        use crate::xspace::{encode_xspace, CaptureInfo};

        const START: u64 = 1_800_000_000_000_000_000;
        let registry = Registry::new();
        let mut workload = Workload::new(&MockConfig::default(), &registry, START);
        let mut events = Vec::new();
        while workload.next_time_ns() < START + 200_000_000 {
            workload.emit_next(&mut |e| events.push(e));
        }
        let info = CaptureInfo {
            window: Window {
                start_ns: START,
                stop_ns: START + 200_000_000,
            },
            hostname: "worker-0".into(),
            warnings: vec!["a warning".into()],
            ..CaptureInfo::default()
        };
        let encoded = encode_xspace(&events, &registry.snapshot(), &info);
        let whole = XSpace::decode(encoded.contiguous()).unwrap();
        let chunked = ChunkedTrace::encode(&encoded.contiguous(), 8 << 10).unwrap();
        assert!(chunked.chunks() > 10, "{} chunks", chunked.chunks());
        assert!(chunked.bytes().len() < encoded.len() / 3, "compressed");
        let (merged, _) = decode(chunked.bytes()).unwrap();
        assert_eq!(merged, whole);
    }

    #[test]
    fn a_trace_that_fits_is_one_chunk_and_warnings_can_follow() {
        let space = trace();
        let bytes = space.encode_to_vec();
        let mut chunked = ChunkedTrace::encode(&bytes, bytes.len()).unwrap();
        assert_eq!(chunked.chunks(), 1);
        chunked.append_warning("not written: disk full").unwrap();
        let (merged, count) = decode(chunked.bytes()).unwrap();
        assert_eq!(count, 2);
        let mut expected = space;
        expected.warnings.push("not written: disk full".into());
        assert_eq!(merged, expected);
    }

    #[test]
    fn malformed_bytes_are_refused() {
        assert!(matches!(
            ChunkedTrace::encode(&[0x0a, 0xff, 0x01], 1024),
            Err(ChunkError::Malformed(_))
        ));
    }

    /// What is folded stays found from every later chunk: texts already
    /// there are not added again, planes and names join those of earlier
    /// chunks however many chunks came between, while the first chunk is
    /// taken whole and two entries of one name within a chunk stay two.
    #[test]
    fn every_later_chunk_finds_what_earlier_chunks_brought() {
        let space = |warnings: &[&str], planes: Vec<XPlane>| XSpace {
            warnings: warnings.iter().map(|w| w.to_string()).collect(),
            planes,
            ..XSpace::default()
        };
        let named = |name: &str, events: &[(i64, &str)]| {
            let mut plane = XPlane {
                name: name.into(),
                ..XPlane::default()
            };
            add_metadata(&mut plane, &[], events);
            plane
        };
        let mut merging = ChunkMerge::default();
        // The first chunk keeps its repeated warning and its second plane
        // of one name, as it was written.
        merging.add(space(
            &["late", "late"],
            vec![named("/a", &[(1, "x")]), named("/a", &[(1, "y")])],
        ));
        for i in 0..50 {
            merging.add(space(
                &[&format!("w{i}")],
                vec![named(&format!("/p{i}"), &[])],
            ));
        }
        merging.add(space(
            &["late", "w3", "new"],
            vec![
                named("/a", &[(7, "x"), (8, "z"), (9, "z")]),
                named("/p3", &[(2, "q")]),
            ],
        ));
        merging.add(space(&[], vec![named("/a", &[(4, "z")])]));
        let merged = merging.finish();
        assert_eq!(merged.warnings.len(), 2 + 50 + 1);
        assert_eq!(merged.warnings.last().map(String::as_str), Some("new"));
        assert_eq!(merged.planes.len(), 2 + 50);
        let names = |plane: &XPlane| {
            let mut names: Vec<(i64, String)> = plane
                .event_metadata
                .values()
                .map(|m| (m.id, m.name.clone()))
                .collect();
            names.sort();
            names
        };
        // "x" matched the first plane's; the two "z" of one chunk stayed
        // two; the last chunk's "z" found the first of them.
        let first = &merged.planes[0];
        assert_eq!(
            names(first),
            [(1, "x".into()), (2, "z".into()), (3, "z".into())]
        );
        assert_eq!(names(&merged.planes[1]), [(1, "y".into())]);
        assert_eq!(names(&merged.planes[5]), [(1, "q".into())]);
    }

    /// A line folded from chunks that start it earlier and later ends on
    /// the earliest timestamp, every event where it was; a text is added
    /// to each list that lacks it, whatever the others hold.
    #[test]
    fn lines_end_on_their_earliest_timestamp_and_lists_stay_apart() {
        let chunk = |timestamp_ns: i64, offset_ps: i64| XSpace {
            planes: vec![XPlane {
                name: "/device:GPU:0".into(),
                lines: vec![XLine {
                    id: 7,
                    timestamp_ns,
                    events: vec![XEvent {
                        metadata_id: 1,
                        data: Some(x_event::Data::OffsetPs(offset_ps)),
                        ..XEvent::default()
                    }],
                    ..XLine::default()
                }],
                ..XPlane::default()
            }],
            ..XSpace::default()
        };
        let mut merging = ChunkMerge::default();
        let mut first = chunk(1_000, 10);
        first.errors.push("X".into());
        merging.add(first);
        let mut second = chunk(500, 20);
        second.warnings.push("X".into());
        second.hostnames.push("X".into());
        merging.add(second);
        merging.add(chunk(2_000, 30));
        merging.add(chunk(400, 40));
        let merged = merging.finish();
        assert_eq!(merged.errors, ["X"]);
        assert_eq!(merged.warnings, ["X"]);
        assert_eq!(merged.hostnames, ["X"]);
        let line = &merged.planes[0].lines[0];
        assert_eq!(line.timestamp_ns, 400);
        let at: Vec<i64> = line
            .events
            .iter()
            .map(|event| match event.data {
                Some(x_event::Data::OffsetPs(offset)) => line.timestamp_ns * 1000 + offset,
                _ => -1,
            })
            .collect();
        assert_eq!(at, [1_000_010, 500_020, 2_000_030, 400_040]);
    }

    #[test]
    fn chunks_with_their_own_ids_merge_by_name() {
        // As TensorFlow writes chunks of separate captures: each its own ids.
        let mut first = plane(0, "/host:CPU", 1, 2);
        first.event_metadata.retain(|id, _| *id <= 2);
        let mut second = XPlane {
            name: "/host:CPU".into(),
            ..XPlane::default()
        };
        add_metadata(
            &mut second,
            &[(4, "tf_op"), (1, "Conv2D")],
            &[(1, "only_in_second"), (9, "kernel_2")],
        );
        second.lines.push(XLine {
            id: 1,
            timestamp_ns: 900,
            duration_ps: 9_000_000,
            events: [9, 1]
                .into_iter()
                .map(|metadata_id| XEvent {
                    metadata_id,
                    data: Some(x_event::Data::OffsetPs(50_000)),
                    stats: vec![stat(4, x_stat::Value::RefValue(1))],
                    ..XEvent::default()
                })
                .collect(),
            ..XLine::default()
        });
        second.lines.push(XLine {
            id: 77,
            ..XLine::default()
        });
        let mut merging = ChunkMerge::default();
        merging.add(XSpace {
            planes: vec![first],
            ..XSpace::default()
        });
        merging.add(XSpace {
            planes: vec![second],
            ..XSpace::default()
        });
        let merged = merging.finish();
        let plane = &merged.planes[0];
        assert_eq!(merged.planes.len(), 1);
        assert_eq!(
            plane.lines.iter().map(|l| l.id).collect::<Vec<_>>(),
            vec![1, 77]
        );
        let line = &plane.lines[0];
        let names: Vec<&str> = line.events.iter().map(|e| event_name(plane, e)).collect();
        assert_eq!(
            names,
            vec!["kernel_1", "kernel_2", "kernel_2", "only_in_second"]
        );
        // The earlier timestamp wins; every event keeps its time.
        assert_eq!(line.timestamp_ns, 900);
        let starts: Vec<i64> = line
            .events
            .iter()
            .map(|e| crate::xspace::read::event_start_ps(line.timestamp_ns, e))
            .collect();
        assert_eq!(starts, vec![1_000_000, 1_001_000, 950_000, 950_000]);
        assert_eq!(line.duration_ps, 9_000_000);
        // Stats and their ref values follow the names.
        let op = crate::xspace::read::find_stat(plane, &line.events[2].stats, "tf_op");
        assert_eq!(
            op,
            Some(crate::xspace::read::StatValue::Str("Conv2D".into()))
        );
    }
}
