//! What a workload's injection library (the `inject/` crate) and the agent
//! share besides the ring: where the files live, what they are called, and
//! the metadata file beside each ring.
//!
//! A workload process creates, in the runtime directory, `cuda-P-T.meta`
//! and then `cuda-P-T.ring` (so that the agent, which discovers rings, always
//! finds the metadata there): `P` is its pid as its own pid namespace
//! numbers it and `T` a random tag, so that the processes of two containers,
//! each pid 1 in its own namespace, never want the same names. It holds a
//! shared lock on both files while it lives (see `crate::host_process`).
//! The metadata file is append-only text, one
//! record per line, written with one `write` per record, so a reader sees
//! whole records followed at most by a partial one it reads again later.
//! Strings are percent-escaped, so a record never holds a space or newline
//! of its own.
//!
//! Events in the ring carry names as ids local to the process; `name`
//! records say what each id means.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::device::DeviceInfo;

/// Where rings and metadata live unless `DEVTRACE_RUNTIME_DIR` says otherwise.
pub const DEFAULT_RUNTIME_DIR: &str = "/run/devtrace";
/// The environment variable both sides read for the runtime directory.
pub const RUNTIME_DIR_ENV: &str = "DEVTRACE_RUNTIME_DIR";
/// The agent stops reading a metadata file beyond this size.
pub const MAX_META_BYTES: u64 = 64 << 20;

/// Bytes of a metadata file read in one call, so that one pass over the
/// workloads holds little whatever each file holds.
pub const MAX_META_READ: u64 = 1 << 20;

/// The longest metadata line kept; a longer one is skipped as malformed,
/// so that a file without newlines is never held whole.
pub const MAX_META_LINE: usize = 64 << 10;

/// Host lines of a workload that are not threads (stream ids and thread ids
/// never reach this range): what CUPTI reports without a thread.
pub const SYNTHETIC_LINE_BASE: u64 = 0xf000_0000;
pub const LINE_MEMORY: u64 = SYNTHETIC_LINE_BASE | 1;
pub const LINE_SYNCHRONIZATION: u64 = SYNTHETIC_LINE_BASE | 2;
pub const LINE_OVERHEAD: u64 = SYNTHETIC_LINE_BASE | 3;

/// The file beside a library `devtrace attach` staged that names the
/// runtime directory (the attached process's environment names none).
pub const ATTACH_RUNTIME_DIR_FILE: &str = "runtime-dir";

/// The runtime directory from the environment, or the default.
pub fn runtime_dir() -> PathBuf {
    std::env::var_os(RUNTIME_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_RUNTIME_DIR), PathBuf::from)
}

/// The two files of one workload process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadFiles {
    pub ring: PathBuf,
    pub meta: PathBuf,
}

impl WorkloadFiles {
    /// New names in `dir` for the process that its namespace calls `pid`.
    pub fn new(dir: &Path, pid: u32) -> WorkloadFiles {
        WorkloadFiles::named(dir, pid, random_tag())
    }

    pub fn named(dir: &Path, pid: u32, tag: u64) -> WorkloadFiles {
        let stem = format!("cuda-{pid}-{tag:016x}");
        WorkloadFiles {
            ring: dir.join(format!("{stem}.ring")),
            meta: dir.join(format!("{stem}.meta")),
        }
    }

    /// The files whose ring is at `ring`.
    pub fn of_ring(ring: &Path) -> WorkloadFiles {
        WorkloadFiles {
            ring: ring.to_path_buf(),
            meta: ring.with_extension("meta"),
        }
    }
}

/// What a file name in the runtime directory says it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileName {
    /// A ring of the process its namespace calls `pid`.
    Ring {
        pid: u32,
    },
    /// A ring named as libraries before per-namespace names did
    /// (`cuda-P.ring`), which this agent cannot use.
    OlderRing {
        pid: u32,
    },
    Meta {
        pid: u32,
    },
}

impl FileName {
    pub fn parse(file_name: &str) -> Option<FileName> {
        let (stem, is_ring) = if let Some(stem) = file_name.strip_suffix(".ring") {
            (stem, true)
        } else {
            (file_name.strip_suffix(".meta")?, false)
        };
        let rest = stem.strip_prefix("cuda-")?;
        match rest.split_once('-') {
            Some((pid, tag)) => {
                let pid = parse_decimal(pid)?;
                let tag_ok = tag.len() == 16 && tag.bytes().all(|b| b.is_ascii_hexdigit());
                if !tag_ok {
                    return None;
                }
                Some(if is_ring {
                    FileName::Ring { pid }
                } else {
                    FileName::Meta { pid }
                })
            }
            None if is_ring => parse_decimal(rest).map(|pid| FileName::OlderRing { pid }),
            None => None,
        }
    }
}

/// Only plain digits: `+1` or `01` would give two names for one pid.
fn parse_decimal(text: &str) -> Option<u32> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical.then(|| text.parse().ok()).flatten()
}

/// 64 random bits from the kernel; the clock where `getrandom` fails (a
/// tag only has to differ between processes, not be secret).
fn random_tag() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: writes at most 8 bytes into an 8-byte buffer.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), 8, libc::GRND_NONBLOCK) };
    if got == 8 {
        u64::from_ne_bytes(bytes)
    } else {
        crate::clock::now_ns() ^ (u64::from(std::process::id()) << 40)
    }
}

/// One line of a metadata file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaRecord {
    /// The process and its command line (arguments joined by spaces).
    Process { pid: u32, command: String },
    /// What a process-local name id stands for.
    Name { id: u32, text: String },
    /// Facts about a GPU the process uses, by its CUDA ordinal (which
    /// `CUDA_VISIBLE_DEVICES` renumbers per process), with the physical
    /// GPU's UUID in NVML's form (`GPU-xxxxxxxx-...`) when CUPTI gave one.
    Device {
        ordinal: u16,
        uuid: Option<String>,
        info: DeviceInfo,
    },
    /// Records CUPTI dropped in this process so far (a running total).
    Dropped { total: u64 },
    /// Something went wrong in the library; it went quiet afterwards.
    Error { message: String },
    /// Something the trace should mention; the library goes on.
    Warning { message: String },
    /// The libcupti the library loaded: its API version and where it came
    /// from.
    Cupti { version: u32, origin: String },
    /// Another CUPTI user in the process took the activity stream at
    /// `at_ns` (`CLOCK_REALTIME`); `seen` when its calls were seen, so its
    /// end will be reported with [`MetaRecord::Resumed`].
    Displaced { at_ns: u64, seen: bool },
    /// The library has the activity stream again from `at_ns`.
    Resumed { at_ns: u64 },
    /// The library was asked to capture and records from `at_ns` on (CUPTI
    /// takes a while to start): the process's GPU activity between the
    /// request and then is missing.
    Recording { at_ns: u64 },
    /// The library finalized CUPTI at `at_ns` after a capture: from then on
    /// the process's CUDA calls cost what they did before it.
    Detached { at_ns: u64 },
    /// From `at_ns` on, the library records the driver and runtime API
    /// calls of `set`.
    ApiRecords { at_ns: u64, set: ApiRecordSet },
    /// The timeline's API calls made from `from_ns` to `to_ns` are missing:
    /// the subscriber that timed them ([`ApiRecordSet::TimelineTimed`])
    /// stopped doing so, for `cause`; at `to_ns` CUPTI's records took over,
    /// or another profiler took the activity stream too.
    Untimed {
        from_ns: u64,
        to_ns: u64,
        cause: UntimedCause,
    },
    /// The GPU work of `launches` launch calls made from `from_ns` on never
    /// came back from CUPTI, nor that of any later launch, up to the end
    /// of the capture at `to_ns`.
    Unanswered {
        from_ns: u64,
        to_ns: u64,
        launches: u64,
    },
    /// CUPTI's records were forced back at `at_ns` while `kernels` kernels
    /// and `other` copies and memsets were still running or waiting to
    /// run: their records came back unfinished, without an end, and are
    /// not in the ring. The earliest of them that had started did so at
    /// `from_ns` (`at_ns` when none had).
    Unfinished {
        from_ns: u64,
        at_ns: u64,
        kernels: u64,
        other: u64,
    },
}

/// Why the timeline's calls went unrecorded for a while.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UntimedCause {
    /// Another CUPTI user took the subscriber (or finalized CUPTI).
    Taken,
    /// CUPTI never called the subscriber while kernels were recorded.
    Silent,
    /// CUPTI wrote no record of the calls selected one by one for it to
    /// record, while it recorded kernels.
    Unselected,
}

impl UntimedCause {
    fn word(self) -> &'static str {
        match self {
            UntimedCause::Taken => "taken",
            UntimedCause::Silent => "silent",
            UntimedCause::Unselected => "unselected",
        }
    }

    fn from_word(word: &str) -> Option<UntimedCause> {
        [
            UntimedCause::Taken,
            UntimedCause::Silent,
            UntimedCause::Unselected,
        ]
        .into_iter()
        .find(|cause| cause.word() == word)
    }
}

/// Which driver and runtime API calls a capture records, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiRecordSet {
    /// Only the calls that place work on the timeline (launches, copies,
    /// memsets, allocations and frees).
    Timeline,
    /// The timeline's calls, timed by the library's Callback API subscriber
    /// instead of CUPTI's API records (the cheaper way).
    TimelineTimed,
    /// Every call, as a capture asked.
    All,
    /// Every call, because the libcupti cannot select calls one by one (it
    /// lacks the entry points, or recorded none of the calls selected).
    AllUnselectable,
}

impl ApiRecordSet {
    fn word(self) -> &'static str {
        match self {
            ApiRecordSet::Timeline => "timeline",
            ApiRecordSet::TimelineTimed => "timeline-timed",
            ApiRecordSet::All => "all",
            ApiRecordSet::AllUnselectable => "all-unselectable",
        }
    }

    fn from_word(word: &str) -> Option<ApiRecordSet> {
        [
            ApiRecordSet::Timeline,
            ApiRecordSet::TimelineTimed,
            ApiRecordSet::All,
            ApiRecordSet::AllUnselectable,
        ]
        .into_iter()
        .find(|set| set.word() == word)
    }

    /// What the set holds, for the trace.
    pub fn describe(self) -> &'static str {
        match self {
            ApiRecordSet::Timeline => {
                "timeline: API calls that launch kernels or graphs, copy, set, allocate or free \
                 memory (others, such as cuCtxSynchronize, are left out: ProfileOptions.\
                 device_tracer_level 2 or serve --cuda-api-records all records every call)"
            }
            ApiRecordSet::TimelineTimed => {
                "timeline, timed by devtrace's Callback API subscriber rather than recorded by \
                 CUPTI (the cheaper way): API calls that launch kernels or graphs, copy, set, \
                 allocate or free memory (others are left out: ProfileOptions.\
                 device_tracer_level 2 or serve --cuda-api-records all records every call)"
            }
            ApiRecordSet::All => "all: every driver and runtime API call",
            ApiRecordSet::AllUnselectable => {
                "all: every driver and runtime API call (this libcupti cannot select calls one \
                 by one: it has no cuptiActivityEnableDriverApi and cuptiActivityEnableRuntimeApi, \
                 or it recorded none of the calls selected with them)"
            }
        }
    }
}

fn escape(text: &str) -> String {
    escape_bytes(text.as_bytes())
}

/// Escapes ASCII controls, space, DEL and `%`; other bytes (UTF-8 included)
/// stay as they are.
fn escape_bytes(bytes: &[u8]) -> String {
    let mut out = Vec::with_capacity(bytes.len());
    for &byte in bytes {
        if byte <= b' ' || byte == b'%' || byte == 0x7f {
            out.extend_from_slice(format!("%{byte:02X}").as_bytes());
        } else {
            out.push(byte);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn unescape(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

impl MetaRecord {
    /// The record as one line, newline included.
    pub fn encode(&self) -> String {
        match self {
            MetaRecord::Process { pid, command } => format!("process {pid} {}\n", escape(command)),
            MetaRecord::Name { id, text } => format!("name {id} {}\n", escape(text)),
            MetaRecord::Device {
                ordinal,
                uuid,
                info,
            } => format!(
                "device {ordinal} {} {} {}.{} {} {} {} {} {}\n",
                escape(&info.vendor),
                escape(&info.model),
                info.compute_capability.0,
                info.compute_capability.1,
                info.core_count,
                info.clock_rate_khz,
                info.memory_bytes,
                info.memory_bandwidth_bytes_per_s,
                // "-" stands for no UUID, so a UUID that is "-" is escaped.
                uuid.as_deref().map_or_else(
                    || "-".to_string(),
                    |uuid| if uuid == "-" {
                        "%2D".into()
                    } else {
                        escape(uuid)
                    }
                )
            ),
            MetaRecord::Dropped { total } => format!("dropped {total}\n"),
            MetaRecord::Error { message } => format!("error {}\n", escape(message)),
            MetaRecord::Warning { message } => format!("warning {}\n", escape(message)),
            MetaRecord::Cupti { version, origin } => {
                format!("cupti {version} {}\n", escape(origin))
            }
            MetaRecord::Displaced { at_ns, seen } => {
                // "probe": found without seeing the other user's calls (the
                // word older libraries wrote; kept so that both ends agree).
                format!(
                    "displaced {at_ns} {}\n",
                    if *seen { "seen" } else { "probe" }
                )
            }
            MetaRecord::Resumed { at_ns } => format!("resumed {at_ns}\n"),
            MetaRecord::Recording { at_ns } => format!("recording {at_ns}\n"),
            MetaRecord::Detached { at_ns } => format!("detached {at_ns}\n"),
            MetaRecord::ApiRecords { at_ns, set } => {
                format!("api-records {at_ns} {}\n", set.word())
            }
            MetaRecord::Untimed {
                from_ns,
                to_ns,
                cause,
            } => format!("untimed {from_ns} {to_ns} {}\n", cause.word()),
            MetaRecord::Unanswered {
                from_ns,
                to_ns,
                launches,
            } => format!("unanswered {from_ns} {to_ns} {launches}\n"),
            MetaRecord::Unfinished {
                from_ns,
                at_ns,
                kernels,
                other,
            } => format!("unfinished {from_ns} {at_ns} {kernels} {other}\n"),
        }
    }

    /// Reads one line (without its newline); `None` for anything malformed.
    pub fn decode(line: &str) -> Option<MetaRecord> {
        let mut fields = line.split(' ');
        let record = match fields.next()? {
            "process" => MetaRecord::Process {
                pid: fields.next()?.parse().ok()?,
                command: unescape(fields.next()?)?,
            },
            "name" => MetaRecord::Name {
                id: fields.next()?.parse().ok()?,
                text: unescape(fields.next()?)?,
            },
            "device" => {
                let ordinal = fields.next()?.parse().ok()?;
                let vendor = unescape(fields.next()?)?;
                let model = unescape(fields.next()?)?;
                let (major, minor) = fields.next()?.split_once('.')?;
                MetaRecord::Device {
                    ordinal,
                    info: DeviceInfo {
                        vendor,
                        model,
                        compute_capability: (major.parse().ok()?, minor.parse().ok()?),
                        core_count: fields.next()?.parse().ok()?,
                        clock_rate_khz: fields.next()?.parse().ok()?,
                        memory_bytes: fields.next()?.parse().ok()?,
                        memory_bandwidth_bytes_per_s: fields.next()?.parse().ok()?,
                    },
                    // Absent in records of older libraries.
                    uuid: match fields.next() {
                        None | Some("-") => None,
                        Some(uuid) => Some(unescape(uuid)?),
                    },
                }
            }
            "dropped" => MetaRecord::Dropped {
                total: fields.next()?.parse().ok()?,
            },
            "error" => MetaRecord::Error {
                message: unescape(fields.next()?)?,
            },
            "warning" => MetaRecord::Warning {
                message: unescape(fields.next()?)?,
            },
            "cupti" => MetaRecord::Cupti {
                version: fields.next()?.parse().ok()?,
                origin: unescape(fields.next()?)?,
            },
            "displaced" => MetaRecord::Displaced {
                at_ns: fields.next()?.parse().ok()?,
                seen: match fields.next()? {
                    "seen" => true,
                    "probe" => false,
                    _ => return None,
                },
            },
            "resumed" => MetaRecord::Resumed {
                at_ns: fields.next()?.parse().ok()?,
            },
            "recording" => MetaRecord::Recording {
                at_ns: fields.next()?.parse().ok()?,
            },
            "detached" => MetaRecord::Detached {
                at_ns: fields.next()?.parse().ok()?,
            },
            "api-records" => MetaRecord::ApiRecords {
                at_ns: fields.next()?.parse().ok()?,
                set: ApiRecordSet::from_word(fields.next()?)?,
            },
            "untimed" => MetaRecord::Untimed {
                from_ns: fields.next()?.parse().ok()?,
                to_ns: fields.next()?.parse().ok()?,
                cause: UntimedCause::from_word(fields.next()?)?,
            },
            "unanswered" => MetaRecord::Unanswered {
                from_ns: fields.next()?.parse().ok()?,
                to_ns: fields.next()?.parse().ok()?,
                launches: fields.next()?.parse().ok()?,
            },
            "unfinished" => MetaRecord::Unfinished {
                from_ns: fields.next()?.parse().ok()?,
                at_ns: fields.next()?.parse().ok()?,
                kernels: fields.next()?.parse().ok()?,
                other: fields.next()?.parse().ok()?,
            },
            _ => return None,
        };
        fields.next().is_none().then_some(record)
    }
}

/// The library's side: appends records to a metadata file.
pub struct MetaWriter {
    file: File,
}

impl MetaWriter {
    /// Creates `path` (mode 0600), locked for as long as the writer lives;
    /// an existing file is refused.
    pub fn create(path: &Path) -> io::Result<MetaWriter> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        crate::lock::hold_shared(&file)?;
        Ok(MetaWriter { file })
    }

    /// Appends one record with a single write.
    pub fn write(&mut self, record: &MetaRecord) -> io::Result<()> {
        self.file.write_all(record.encode().as_bytes())
    }
}

/// Opens `path`, a file another user may have placed, for reading: no
/// symlink is followed, nothing blocks, and only a regular file owned by
/// `owner` is accepted (checked on the open descriptor, not the name).
fn open_untrusted(path: &Path, owner: u32) -> io::Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let metadata = file.metadata()?;
    if !metadata.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    if metadata.uid() != owner {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "owned by uid {}, not by uid {owner} who owns the ring",
                metadata.uid()
            ),
        ));
    }
    Ok(file)
}

/// The agent's side: reads what was appended since the last call.
pub struct MetaReader {
    offset: u64,
    partial: Vec<u8>,
    malformed: u64,
    /// Bytes read at most ([`MAX_META_BYTES`]).
    limit: u64,
    /// Bytes of the file beyond `limit`, as last seen.
    cut: u64,
    /// Inside a line too long to keep, until its newline.
    skipping: bool,
    /// Whether malformed lines were reported.
    malformed_reported: bool,
}

impl Default for MetaReader {
    fn default() -> MetaReader {
        MetaReader::with_limit(MAX_META_BYTES)
    }
}

impl MetaReader {
    /// A reader that stops at `limit` bytes instead of [`MAX_META_BYTES`].
    pub fn with_limit(limit: u64) -> MetaReader {
        MetaReader {
            offset: 0,
            partial: Vec::new(),
            malformed: 0,
            limit,
            cut: 0,
            skipping: false,
            malformed_reported: false,
        }
    }

    /// Records appended since the previous call; stops at the limit
    /// ([`MAX_META_BYTES`]), and the first call that finds the file past it
    /// adds a [`MetaRecord::Warning`] saying how much is not read.
    /// Malformed lines are counted and skipped.
    ///
    /// The runtime directory is writable by every user, so the file is
    /// opened without following a symlink and without blocking (a FIFO
    /// would stall the reader forever), and must be a regular file owned by
    /// `owner`, the uid of the ring it describes.
    pub fn read_new(&mut self, path: &Path, owner: u32) -> io::Result<Vec<MetaRecord>> {
        let mut file = open_untrusted(path, owner)?;
        let length = file.metadata()?.len();
        let size = length.min(self.limit);
        let mut records = Vec::new();
        if size > self.offset {
            file.seek(SeekFrom::Start(self.offset))?;
            let mut bytes = Vec::new();
            file.take((size - self.offset).min(MAX_META_READ))
                .read_to_end(&mut bytes)?;
            self.offset += bytes.len() as u64;
            records = self.absorb(&bytes);
        }
        let beyond = length.saturating_sub(self.limit);
        if beyond > 0 && self.cut == 0 {
            records.push(MetaRecord::Warning {
                message: format!(
                    "its metadata file {} outgrew the {} bytes the agent reads; the {beyond} \
                     bytes beyond them and all appended later are not read (names, devices and \
                     errors recorded there are missing)",
                    path.display(),
                    self.limit
                ),
            });
        }
        self.cut = self.cut.max(beyond);
        Ok(records)
    }

    /// Takes the next bytes of the file: the whole lines they complete, as
    /// records; a partial line waits for the rest.
    pub fn absorb(&mut self, mut bytes: &[u8]) -> Vec<MetaRecord> {
        let mut records = Vec::new();
        if self.skipping {
            match bytes.iter().position(|b| *b == b'\n') {
                Some(end) => {
                    bytes = &bytes[end + 1..];
                    self.skipping = false;
                }
                None => return records,
            }
        }
        self.partial.extend_from_slice(bytes);
        let complete = match self.partial.iter().rposition(|b| *b == b'\n') {
            Some(end) => end + 1,
            None => 0,
        };
        for line in self.partial[..complete]
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
        {
            match std::str::from_utf8(line).ok().and_then(MetaRecord::decode) {
                Some(record) => records.push(record),
                None => self.malformed += 1,
            }
        }
        self.partial.drain(..complete);
        if self.partial.len() > MAX_META_LINE {
            self.partial = Vec::new();
            self.skipping = true;
            self.malformed += 1;
        }
        if self.malformed > 0 && !self.malformed_reported {
            self.malformed_reported = true;
            records.push(MetaRecord::Warning {
                message: format!(
                    "its metadata file has malformed lines (or lines over {MAX_META_LINE} \
                     bytes), which are skipped: names or devices recorded there are missing"
                ),
            });
        }
        records
    }

    /// Whether the file grew past what is read ([`MAX_META_BYTES`]).
    pub fn full(&self) -> bool {
        self.offset >= self.limit
    }

    /// Bytes of the file beyond what is read, when last looked at.
    pub fn cut_bytes(&self) -> u64 {
        self.cut
    }

    pub fn malformed(&self) -> u64 {
        self.malformed
    }
}

/// One record of every kind, with awkward strings: seeds for the agent's
/// fuzzing and for tests of the line form.
#[doc(hidden)]
pub fn sample_records() -> Vec<MetaRecord> {
    vec![
        MetaRecord::Process {
            pid: 42,
            command: "python train.py --lr 0.1 100%\nnext".into(),
        },
        MetaRecord::Name {
            id: 7,
            text: "void kernel<float, 3>(float*, int) · ünïcode".into(),
        },
        MetaRecord::Device {
            ordinal: 1,
            uuid: Some("GPU-5e7a4d1b-0000-4000-8000-000000000003".into()),
            info: DeviceInfo {
                vendor: "Nvidia".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                compute_capability: (9, 0),
                core_count: 132,
                clock_rate_khz: 1_980_000,
                memory_bytes: 80 << 30,
                memory_bandwidth_bytes_per_s: 3_350_000_000_000,
            },
        },
        MetaRecord::Device {
            ordinal: 0,
            uuid: None,
            info: DeviceInfo::default(),
        },
        MetaRecord::Dropped { total: 12 },
        MetaRecord::Error {
            message: "cuptiActivityEnable failed: CUPTI_ERROR_NOT_INITIALIZED".into(),
        },
        MetaRecord::Warning {
            message: "libcupti 13.0 GA has bugs".into(),
        },
        MetaRecord::Displaced {
            at_ns: 1_700_000_000_000_000_000,
            seen: true,
        },
        MetaRecord::Displaced {
            at_ns: 5,
            seen: false,
        },
        MetaRecord::Resumed { at_ns: 6 },
        MetaRecord::Recording { at_ns: 9 },
        MetaRecord::Detached { at_ns: 10 },
        MetaRecord::ApiRecords {
            at_ns: 7,
            set: ApiRecordSet::Timeline,
        },
        MetaRecord::ApiRecords {
            at_ns: 8,
            set: ApiRecordSet::AllUnselectable,
        },
        MetaRecord::ApiRecords {
            at_ns: 11,
            set: ApiRecordSet::TimelineTimed,
        },
        MetaRecord::Untimed {
            from_ns: 12,
            to_ns: 13,
            cause: UntimedCause::Taken,
        },
        MetaRecord::Untimed {
            from_ns: 14,
            to_ns: 15,
            cause: UntimedCause::Silent,
        },
        MetaRecord::Untimed {
            from_ns: 16,
            to_ns: 17,
            cause: UntimedCause::Unselected,
        },
        MetaRecord::Unanswered {
            from_ns: 18,
            to_ns: 19,
            launches: 20,
        },
        MetaRecord::Unfinished {
            from_ns: 21,
            at_ns: 22,
            kernels: 23,
            other: 24,
        },
        MetaRecord::Cupti {
            version: 130001,
            origin: "/venv/site-packages/nvidia/cu13/lib/libcupti.so.13".into(),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_uid() -> u32 {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn metadata_that_is_not_a_regular_file_of_the_owner_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("cuda-1.meta");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path; creates a FIFO no one writes to.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let error = MetaReader::default()
            .read_new(&fifo, own_uid())
            .unwrap_err();
        assert!(error.to_string().contains("not a regular file"), "{error}");
        let target = dir.path().join("secret");
        std::fs::write(&target, "name 1 x\n").unwrap();
        let link = dir.path().join("cuda-2.meta");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(MetaReader::default().read_new(&link, own_uid()).is_err());
        let error = MetaReader::default()
            .read_new(&target, own_uid() + 1)
            .unwrap_err();
        assert!(error.to_string().contains("owned by uid"), "{error}");
    }

    #[test]
    fn records_survive_their_line_form_with_awkward_strings() {
        let records = sample_records();
        // A device record of an older library, without the UUID field.
        assert!(matches!(
            MetaRecord::decode("device 0 Nvidia GPU 9.0 132 1980000 1024 2048"),
            Some(MetaRecord::Device { uuid: None, .. })
        ));
        for record in &records {
            let line = record.encode();
            assert!(
                line.ends_with('\n') && line.matches('\n').count() == 1,
                "{line:?}"
            );
            assert_eq!(
                MetaRecord::decode(line.trim_end_matches('\n')).as_ref(),
                Some(record)
            );
        }
        assert_eq!(MetaRecord::decode("name 1"), None);
        assert_eq!(MetaRecord::decode("name x y"), None);
        assert_eq!(MetaRecord::decode("name 1 a b"), None);
        assert_eq!(MetaRecord::decode("bogus 1"), None);
    }

    #[test]
    fn file_names_carry_the_namespace_pid_and_a_tag() {
        let dir = Path::new("/run/devtrace");
        let files = WorkloadFiles::named(dir, 1, 0xab);
        assert_eq!(
            files.ring,
            Path::new("/run/devtrace/cuda-1-00000000000000ab.ring")
        );
        assert_eq!(WorkloadFiles::of_ring(&files.ring), files);
        let name = |path: &Path| FileName::parse(path.file_name().unwrap().to_str().unwrap());
        assert_eq!(name(&files.ring), Some(FileName::Ring { pid: 1 }));
        assert_eq!(name(&files.meta), Some(FileName::Meta { pid: 1 }));
        // Two processes that are both pid 1 get different names.
        assert_ne!(WorkloadFiles::new(dir, 1), WorkloadFiles::new(dir, 1));
        assert_eq!(
            FileName::parse("cuda-123.ring"),
            Some(FileName::OlderRing { pid: 123 })
        );
        for bad in [
            "cuda-12x-00000000000000ab.ring",
            "cuda-+1-00000000000000ab.ring",
            "cuda-01-00000000000000ab.ring",
            "cuda-1-ab.ring",
            "cuda-1-00000000000000zz.ring",
            "cuda-123.meta",
            "other-1.ring",
            "cuda-99999999999-00000000000000ab.ring",
        ] {
            assert_eq!(FileName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_reader_takes_whole_lines_and_waits_for_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = WorkloadFiles::named(dir.path(), 9, 1).meta;
        let mut writer = MetaWriter::create(&path).unwrap();
        assert!(MetaWriter::create(&path).is_err(), "never replaced");
        writer
            .write(&MetaRecord::Name {
                id: 1,
                text: "a".into(),
            })
            .unwrap();
        let mut raw = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        raw.write_all(b"name 2 b").unwrap();
        let mut reader = MetaReader::default();
        assert_eq!(
            reader.read_new(&path, own_uid()).unwrap(),
            vec![MetaRecord::Name {
                id: 1,
                text: "a".into()
            }]
        );
        raw.write_all(b"c\ngarbage line\n").unwrap();
        let records = reader.read_new(&path, own_uid()).unwrap();
        assert_eq!(
            records[0],
            MetaRecord::Name {
                id: 2,
                text: "bc".into()
            }
        );
        // The first malformed line is reported, once.
        assert!(
            matches!(&records[1], MetaRecord::Warning { message } if message.contains("malformed"))
        );
        assert_eq!(reader.malformed(), 1);
        raw.write_all(b"more garbage\n").unwrap();
        assert!(reader.read_new(&path, own_uid()).unwrap().is_empty());
        assert_eq!(reader.malformed(), 2);
    }

    #[test]
    fn a_file_without_newlines_is_never_held_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = WorkloadFiles::named(dir.path(), 10, 1).meta;
        let mut raw = std::fs::File::create(&path).unwrap();
        raw.write_all(&vec![b'x'; 8 << 20]).unwrap();
        raw.write_all(b"\nname 1 after\n").unwrap();
        let mut reader = MetaReader::default();
        let mut records = Vec::new();
        let mut calls = 0;
        while records
            .iter()
            .all(|r| !matches!(r, MetaRecord::Name { .. }))
        {
            records.extend(reader.read_new(&path, own_uid()).unwrap());
            calls += 1;
            // Each call reads at most MAX_META_READ and keeps at most a line.
            assert!(reader.partial.capacity() <= MAX_META_LINE + MAX_META_READ as usize);
            assert!(calls <= 9, "never got past the long line");
        }
        assert!(calls >= 8, "read in one go: {calls}");
        assert!(records.contains(&MetaRecord::Name {
            id: 1,
            text: "after".into()
        }));
        assert_eq!(reader.malformed(), 1);
    }

    #[test]
    fn a_file_past_the_limit_is_cut_with_a_warning_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = WorkloadFiles::named(dir.path(), 11, 1).meta;
        let mut writer = MetaWriter::create(&path).unwrap();
        let name = |id| MetaRecord::Name {
            id,
            text: "kernel".into(),
        };
        for id in 0..3 {
            writer.write(&name(id)).unwrap();
        }
        let line = name(0).encode().len() as u64;
        // Room for two records; the third is past the limit.
        let mut reader = MetaReader::with_limit(2 * line);
        let records = reader.read_new(&path, own_uid()).unwrap();
        assert_eq!(&records[..2], &[name(0), name(1)]);
        let Some(MetaRecord::Warning { message }) = records.get(2) else {
            panic!("no warning of the cut: {records:?}");
        };
        assert!(
            message.contains(&format!("the {line} bytes beyond")),
            "{message}"
        );
        assert!(
            message.contains("cuda-11-0000000000000001.meta"),
            "{message}"
        );
        assert_eq!(records.len(), 3);
        assert_eq!(reader.cut_bytes(), line);
        writer.write(&name(3)).unwrap();
        assert!(
            reader.read_new(&path, own_uid()).unwrap().is_empty(),
            "warned once"
        );
        assert_eq!(reader.cut_bytes(), 2 * line, "the count follows the file");
    }
}
