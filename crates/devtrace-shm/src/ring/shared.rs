//! Shared placement of a ring: files and memfds mapped `MAP_SHARED`, header
//! validation, the control word, and liveness of the processes using a ring.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::layout::{RingHeader, RingLayout, Slot, CLOCK_REALTIME_NS, LAYOUT_VERSION, RING_MAGIC};
use super::{DropPolicy, Region, Ring, RingError};

/// Control flag: the agent has a capture running; producers should record.
pub const CONTROL_CAPTURE: u32 = 1;
/// Control flag, with [`CONTROL_CAPTURE`]: a capture asked for every API
/// call to be recorded, not only those that place work on the timeline. A
/// library that does not know it records as it always did.
pub const CONTROL_ALL_API_RECORDS: u32 = 2;
/// Control flag: record the GPU's kernels, copies and memsets (and nothing
/// costlier) between captures too, so that the flight recorder holds the
/// GPU's past (`serve --cuda-record always`). A library that does not know
/// it records during captures alone, as it always did.
pub const CONTROL_RECORD_ALWAYS: u32 = 4;
/// Control flag, with [`CONTROL_CAPTURE`]: the timeline's API calls are to
/// be recorded by CUPTI's API activity records rather than timed by the
/// library's own Callback API subscriber (`serve --cuda-api-records
/// timeline-cupti`). A library that does not know it records as it always
/// did.
pub const CONTROL_CUPTI_API_RECORDS: u32 = 8;

/// The control word of a ring: flags set by the agent, and a generation that
/// changes with every [`Ring::set_control`], so a producer that polls can tell
/// that something changed even when the flags end up the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    pub flags: u32,
    pub generation: u32,
}

impl Control {
    pub(super) fn from_word(word: u64) -> Control {
        Control {
            flags: word as u32,
            generation: (word >> 32) as u32,
        }
    }

    pub fn capture(self) -> bool {
        self.flags & CONTROL_CAPTURE != 0
    }

    pub fn all_api_records(self) -> bool {
        self.flags & CONTROL_ALL_API_RECORDS != 0
    }

    pub fn record_always(self) -> bool {
        self.flags & CONTROL_RECORD_ALWAYS != 0
    }

    pub fn cupti_api_records(self) -> bool {
        self.flags & CONTROL_CUPTI_API_RECORDS != 0
    }
}

fn io_error(op: &'static str, path: &Path, error: io::Error) -> RingError {
    RingError::Io {
        op,
        path: path.display().to_string(),
        kind: error.kind(),
        message: error.to_string(),
    }
}

/// Whether process `pid` exists and is not a zombie. Pid 0 is never alive.
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => alive_in_stat(&stat),
        Err(error) if error.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: signal 0 only checks that the process exists.
            let result = unsafe { libc::kill(pid as libc::pid_t, 0) };
            result == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        }
    }
}

/// Whether a `/proc/<pid>/stat` text is of a process that has not exited:
/// not a zombie (or dead).
pub fn alive_in_stat(stat: &str) -> bool {
    // The state follows the command name, which is in parentheses and may
    // itself contain parentheses and spaces.
    !matches!(
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_whitespace().next()),
        Some("Z" | "X" | "x")
    )
}

impl Region {
    /// Maps `size` bytes of `file` shared, readable and writable. A
    /// `guarded` mapping survives the file shrinking under it (`guard.rs`):
    /// for files another process made.
    fn map_shared(
        file: &File,
        size: usize,
        path: &Path,
        guarded: bool,
    ) -> Result<Region, RingError> {
        // SAFETY: a new shared mapping of a file we hold open; nothing existing
        // is touched. The mapping outlives the descriptor.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io_error("mmap", path, io::Error::last_os_error()));
        }
        let base = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns null here");
        let mut region = Region {
            base,
            size,
            guard: None,
            held: None,
        };
        if guarded {
            region.guard = Some(
                super::guard::Guard::register(base.as_ptr(), size).ok_or_else(|| {
                    RingError::Refused {
                        path: path.display().to_string(),
                        reason: "no guard against the file shrinking could be set up (too many \
                             shared rings open?)"
                            .into(),
                    }
                })?,
            );
        }
        Ok(region)
    }
}

/// Who a shared ring's file belongs to, as `fstat` saw it when the ring was
/// opened: identity that a peer cannot forge by naming files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileIdentity {
    pub uid: u32,
    pub dev: u64,
    pub ino: u64,
}

impl FileIdentity {
    pub fn of(meta: &std::fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            uid: meta.uid(),
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }

    /// Whether both name the same file (owners aside).
    pub fn same_file(self, other: FileIdentity) -> bool {
        (self.dev, self.ino) == (other.dev, other.ino)
    }
}

/// The largest ring a peer can make this process map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenLimits {
    pub lanes: u32,
    pub bytes: u64,
}

impl Default for OpenLimits {
    fn default() -> Self {
        OpenLimits {
            lanes: 256,
            bytes: 4 << 30,
        }
    }
}

/// A file fit to be a ring: a regular file with one link (or a memfd, with
/// none), so that nobody holds it under a second name.
fn check_file(file: &File, path: &Path) -> Result<(u64, FileIdentity), RingError> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().map_err(|e| io_error("stat", path, e))?;
    let refused = |reason: String| RingError::Refused {
        path: path.display().to_string(),
        reason,
    };
    if !meta.file_type().is_file() {
        return Err(refused("not a regular file".into()));
    }
    // A memfd has no link at all.
    if meta.nlink() > 1 {
        return Err(refused(format!("{} links (one expected)", meta.nlink())));
    }
    Ok((meta.len(), FileIdentity::of(&meta)))
}

/// Reads and validates a ring header from the first bytes of `file`, whose
/// size is `file_size`; returns the layout and policy it describes.
fn validate(
    file: &File,
    file_size: u64,
    path: &Path,
    limits: OpenLimits,
) -> Result<(RingLayout, DropPolicy, RingHeader), RingError> {
    let name = || path.display().to_string();
    let needed = RingLayout::header_size() as u64;
    if file_size < needed {
        return Err(RingError::Truncated {
            path: name(),
            size: file_size,
            needed,
        });
    }
    let mut bytes = [0u8; std::mem::size_of::<RingHeader>()];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| io_error("read", path, e))?;
    // SAFETY: RingHeader is plain integers and atomics, valid for any bits;
    // the read copes with the buffer's alignment.
    let header: RingHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    if header.magic != RING_MAGIC {
        return Err(RingError::BadMagic {
            path: name(),
            found: header.magic,
        });
    }
    if header.version != LAYOUT_VERSION {
        return Err(RingError::Version {
            path: name(),
            found: header.version,
            expected: LAYOUT_VERSION,
        });
    }
    let bad = |reason: String| RingError::BadHeader {
        path: name(),
        reason,
    };
    if header.slot_size as usize != std::mem::size_of::<Slot>() {
        return Err(bad(format!(
            "slot size {} (expected {})",
            header.slot_size,
            std::mem::size_of::<Slot>()
        )));
    }
    if header.clock_id != CLOCK_REALTIME_NS {
        return Err(bad(format!(
            "clock {} is not CLOCK_REALTIME",
            header.clock_id
        )));
    }
    let policy = DropPolicy::from_code(header.policy)
        .ok_or_else(|| bad(format!("unknown drop policy {}", header.policy)))?;
    let capacity = header.lane_capacity;
    if !capacity.is_power_of_two() || !(2..=1 << 24).contains(&capacity) {
        return Err(bad(format!("lane capacity {capacity}")));
    }
    if header.lane_count == 0 {
        return Err(bad("no lanes".into()));
    }
    if header.lane_count > limits.lanes {
        return Err(bad(format!(
            "{} lanes (at most {} accepted)",
            header.lane_count, limits.lanes
        )));
    }
    let layout = RingLayout {
        lanes: header.lane_count,
        capacity,
    };
    let total = layout
        .total_size()
        .ok_or_else(|| bad(format!("{} lanes do not fit in memory", layout.lanes)))?
        as u64;
    if total > limits.bytes {
        return Err(bad(format!(
            "{total} bytes (at most {} accepted)",
            limits.bytes
        )));
    }
    if header.total_size != total {
        return Err(bad(format!(
            "recorded size {} but its shape needs {total}",
            header.total_size
        )));
    }
    if file_size < total {
        return Err(RingError::Truncated {
            path: name(),
            size: file_size,
            needed: total,
        });
    }
    if file_size != total {
        return Err(bad(format!("file is {file_size} bytes, the ring {total}")));
    }
    Ok((layout, policy, header))
}

/// Sizes `file` for `layout`, maps it and writes a fresh header; `held` is
/// the file again, locked, when the ring should keep it.
fn initialise(
    file: &File,
    path: &Path,
    layout: RingLayout,
    policy: DropPolicy,
    held: Option<File>,
) -> Result<Arc<Ring>, RingError> {
    let size = layout.total_size().expect("checked by shape");
    allocate(file, size, path)?;
    let mut region = Region::map_shared(file, size, path, false)?;
    region.held = held;
    // SAFETY: the file was just created and sized; nobody else can reach it
    // until it is linked under its final name (or its descriptor is passed on).
    unsafe { Ring::write_header(&region, layout, policy) };
    Ok(Ring::from_region(region, layout, policy, false))
}

/// Gives `file` all `size` bytes of storage now. A file merely sized
/// (`ftruncate`) is sparse: its pages are found only when first written,
/// and a full filesystem (a container's 64 MiB `/dev/shm`, an `emptyDir`
/// with a size limit) then answers a producer's store with SIGBUS, which
/// kills the traced process. Allocated up front, a full filesystem is an
/// error here instead. (glibc writes the blocks itself where the
/// filesystem has no `fallocate`.)
fn allocate(file: &File, size: usize, path: &Path) -> Result<(), RingError> {
    let length = libc::off_t::try_from(size).map_err(|_| RingError::BadHeader {
        path: path.display().to_string(),
        reason: format!("{size} bytes do not fit in a file offset"),
    })?;
    loop {
        // SAFETY: a descriptor this function borrows; no memory is passed.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, length) } {
            0 => return Ok(()),
            libc::EINTR => continue,
            code => {
                return Err(io_error(
                    "allocate",
                    path,
                    io::Error::from_raw_os_error(code),
                ))
            }
        }
    }
}

/// The temporary name a ring file is prepared under, unique to this process
/// and call: `.<name>.<pid>-<n>.tmp`.
fn temp_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}-{n}.tmp", std::process::id()))
}

/// Opens a ring file another process may have placed: no symlink is
/// followed, and nothing blocks (a FIFO in the ring's place cannot stall the
/// open; `check_file` then refuses it). Returns the file, its size and who
/// it belongs to.
fn open_ring_file(path: &Path) -> Result<(File, u64, FileIdentity), RingError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io_error("open", path, e))?;
    let (size, identity) = check_file(&file, path)?;
    Ok((file, size, identity))
}

/// A second descriptor of `file`, holding a shared lock on it.
fn hold_shared(file: &File, path: &Path) -> Result<File, RingError> {
    let held = file.try_clone().map_err(|e| io_error("dup", path, e))?;
    crate::lock::hold_shared(&held).map_err(|e| io_error("lock", path, e))?;
    Ok(held)
}

/// Whether `name` is that of a temporary ring file.
fn is_temp_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let Some((ring, id)) = rest.rsplit_once('.') else {
        return false;
    };
    let numbers = id
        .split_once('-')
        .is_some_and(|(pid, n)| pid.parse::<u32>().is_ok() && n.parse::<u32>().is_ok());
    numbers && ring.ends_with(".ring")
}

/// How long a temporary ring file may lie unlocked before it counts as left
/// by a creator that died: between its creation and its lock, it is too.
const TEMP_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

impl Ring {
    /// Creates a ring in a new file at `path` (mode 0600), mapped shared, for
    /// producers and a consumer in other processes ([`Ring::open_shared`]).
    /// The file is prepared under a temporary name in the same directory and
    /// linked to `path` complete; an existing `path` is never replaced
    /// (`RingError::Io` with kind `AlreadyExists`). The caller removes the
    /// file when done; [`remove_stale_rings`] removes those of dead creators.
    pub fn create_shared(
        path: impl AsRef<Path>,
        lanes: u32,
        capacity: u64,
        policy: DropPolicy,
    ) -> Result<Arc<Ring>, RingError> {
        let path = path.as_ref();
        let layout = Ring::shape(lanes, capacity)?;
        let temp = temp_path(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&temp)
            .map_err(|e| io_error("create", &temp, e))?;
        let held = hold_shared(&file, &temp)?;
        let ring = initialise(&file, &temp, layout, policy, Some(held)).and_then(|ring| {
            // A hard link, unlike rename, fails instead of replacing `path`.
            std::fs::hard_link(&temp, path)
                .map(|()| ring)
                .map_err(|e| io_error("link", path, e))
        });
        let _ = std::fs::remove_file(&temp);
        ring
    }

    /// Opens and maps a ring that another process created, after checking its
    /// file and header: see [`Ring::open_untrusted`], with default limits.
    /// The file stays locked while the ring is open, so that it is not
    /// removed as stale while this process uses it.
    pub fn open_shared(path: impl AsRef<Path>) -> Result<Arc<Ring>, RingError> {
        let path = path.as_ref();
        let (file, size, _) = open_ring_file(path)?;
        let held = hold_shared(&file, path)?;
        Ring::map_validated(&file, size, path, OpenLimits::default(), Some(held))
    }

    /// Opens and maps a ring file that a process the caller does not trust
    /// created. A symbolic link at `path` is refused (ring directories may be
    /// writable by others), as is anything but a regular file with one link
    /// or a ring beyond `limits`. The mapping survives the file shrinking
    /// (the consumer then reports
    /// [`Corruption::Shrunk`](super::Corruption::Shrunk)). Returns the file's
    /// owner and inode, by which the caller should know the ring.
    pub fn open_untrusted(
        path: &Path,
        limits: OpenLimits,
    ) -> Result<(Arc<Ring>, FileIdentity), RingError> {
        let (file, size, identity) = open_ring_file(path)?;
        let ring = Ring::map_validated(&file, size, path, limits, None)?;
        Ok((ring, identity))
    }

    /// Maps a ring from an open descriptor (a memfd received from another
    /// process, say); `path` only names it in errors. Checked as
    /// [`Ring::open_untrusted`] checks files.
    pub fn open_file(file: &File, path: &Path) -> Result<Arc<Ring>, RingError> {
        let (size, _) = check_file(file, path)?;
        Ring::map_validated(file, size, path, OpenLimits::default(), None)
    }

    fn map_validated(
        file: &File,
        size: u64,
        path: &Path,
        limits: OpenLimits,
        held: Option<File>,
    ) -> Result<Arc<Ring>, RingError> {
        let (layout, policy, _) = validate(file, size, path, limits)?;
        let mut region = Region::map_shared(file, size as usize, path, true)?;
        region.held = held;
        Ok(Ring::from_region(region, layout, policy, false))
    }

    /// Creates a ring in an anonymous memfd named `name` (visible only in
    /// `/proc/<pid>/fd`). Returns the ring and the descriptor to hand to
    /// other processes (by `SCM_RIGHTS`, inheritance, or their opening
    /// `/proc/<pid>/fd/<fd>`), who map it with [`Ring::open_file`] or
    /// [`Ring::open_shared`].
    pub fn create_memfd(
        name: &str,
        lanes: u32,
        capacity: u64,
        policy: DropPolicy,
    ) -> Result<(Arc<Ring>, File), RingError> {
        let layout = Ring::shape(lanes, capacity)?;
        let path = Path::new(name);
        let cname = std::ffi::CString::new(name).map_err(|_| RingError::BadHeader {
            path: name.into(),
            reason: "memfd name contains a NUL byte".into(),
        })?;
        // SAFETY: a valid C string; the new descriptor is owned by `file` below.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io_error("memfd_create", path, io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let ring = initialise(&file, path, layout, policy, None)?;
        Ok((ring, file))
    }

    /// The pid of the process that created the ring.
    pub fn creator_pid(&self) -> u32 {
        self.header().creator_pid
    }

    /// `CLOCK_REALTIME` nanoseconds when the ring was created.
    pub fn created_ns(&self) -> u64 {
        self.header().created_ns
    }

    /// The pid of the process holding the consumer, if one is taken.
    pub fn consumer_pid(&self) -> Option<u32> {
        Some(self.header().consumer_pid.load(Ordering::Acquire)).filter(|pid| *pid != 0)
    }

    /// Says the consumer is alive: bumps the beat (never back to 0, which
    /// means "no beating consumer").
    pub fn beat(&self) {
        let beat = &self.header().consumer_beat;
        if beat.fetch_add(1, Ordering::AcqRel) == u32::MAX {
            beat.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The consumer's beat; 0 while none has beaten.
    pub fn consumer_beat(&self) -> u32 {
        self.header().consumer_beat.load(Ordering::Acquire)
    }

    /// The control word as last set.
    pub fn control(&self) -> Control {
        Control::from_word(self.header().control.0.load(Ordering::Acquire))
    }

    /// Sets the control flags and bumps the generation, and wakes the
    /// producers waiting for it ([`Ring::wait_for_control`]); returns the
    /// new word.
    pub fn set_control(&self, flags: u32) -> Control {
        let word = &self.header().control.0;
        let mut current = word.load(Ordering::Relaxed);
        loop {
            let generation = Control::from_word(current).generation.wrapping_add(1);
            let new = (u64::from(generation) << 32) | u64::from(flags);
            match word.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.wake_control_waiters();
                    return Control::from_word(new);
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// The pid owning each lane (`None` for a free lane).
    pub fn lane_owners(&self) -> Vec<Option<u32>> {
        (0..self.layout.lanes)
            .map(|lane| {
                let owner = self.lane(lane).owner.0.load(Ordering::Acquire);
                (owner != 0).then_some((owner >> 32) as u32)
            })
            .collect()
    }

    /// Frees the lanes whose producer process has exited, so that new
    /// producers can claim them; returns those lanes. What the dead producer
    /// published stays queued and is drained as usual. Lanes owned by this
    /// process are never touched.
    pub fn release_dead_producers(&self) -> Vec<u32> {
        let me = std::process::id();
        let mut released = Vec::new();
        for lane in 0..self.layout.lanes {
            let owner = &self.lane(lane).owner.0;
            let word = owner.load(Ordering::Acquire);
            let pid = (word >> 32) as u32;
            if word == 0 || pid == me || pid_alive(pid) {
                continue;
            }
            if owner
                .compare_exchange(word, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                released.push(lane);
            }
        }
        released
    }
}

/// Removes ring files in `dir` (names ending in `.ring`) that no process
/// holds any more, and temporary files left by creators that died while
/// preparing one. A ring is in use while a process that made it or produces
/// into it holds its shared lock ([`Ring::create_shared`],
/// [`Ring::open_shared`]), which needs no pid and so holds across pid
/// namespaces. Files that are not rings of this layout version are left
/// alone. Returns the paths removed.
pub fn remove_stale_rings(dir: impl AsRef<Path>) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = if is_temp_name(&name) {
            crate::lock::abandoned(&path, TEMP_GRACE)
        } else if name.ends_with(".ring") && entry.file_type()?.is_file() {
            ring_is_stale(&path)
        } else {
            false
        };
        if stale {
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// Whether the ring file at `path` is a ring no process holds.
fn ring_is_stale(path: &Path) -> bool {
    let Some(file) = crate::lock::open_to_ask(path) else {
        return false;
    };
    let Ok((size, _)) = check_file(&file, path) else {
        return false;
    };
    if validate(&file, size, path, OpenLimits::default()).is_err() {
        return false;
    }
    matches!(crate::lock::in_use(&file), Ok(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_follows_the_last_parenthesis() {
        assert!(!alive_in_stat("42 (a) b) Z 1 2"));
        assert!(!alive_in_stat("42 (x) X 1"));
        assert!(alive_in_stat("42 (a) Z) S 1"));
    }

    #[test]
    fn control_word_bumps_its_generation() {
        let ring = Ring::new(1, 4, DropPolicy::DropNewest).unwrap();
        assert_eq!(ring.control(), Control::default());
        let first = ring.set_control(CONTROL_CAPTURE);
        assert!(first.capture());
        assert_eq!(first.generation, 1);
        let second = ring.set_control(CONTROL_CAPTURE);
        assert_eq!((second.flags, second.generation), (CONTROL_CAPTURE, 2));
        assert!(!second.all_api_records());
        let all = ring.set_control(CONTROL_CAPTURE | CONTROL_ALL_API_RECORDS);
        assert!(all.capture() && all.all_api_records());
        assert!(ring.control().all_api_records());
        assert!(!ring.set_control(0).capture());
        assert_eq!(ring.control().generation, 4);
    }

    /// A tmpfs of `bytes` mounted on a new directory, unmounted on drop.
    struct SmallFilesystem(tempfile::TempDir);

    impl SmallFilesystem {
        fn mount(bytes: u64) -> SmallFilesystem {
            let dir = tempfile::tempdir().unwrap();
            let mounted = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
                .arg("devtrace-test")
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(mounted.success(), "mounting a tmpfs needs root");
            SmallFilesystem(dir)
        }
    }

    impl Drop for SmallFilesystem {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.0.path())
                .status();
        }
    }

    #[test]
    fn a_ring_that_does_not_fit_its_filesystem_is_refused_as_it_is_made() {
        let small = SmallFilesystem::mount(1 << 20);
        // 16,384 slots of 136 bytes: about 2.1 MiB, twice the room.
        let path = small.0.path().join("big.ring");
        match Ring::create_shared(&path, 1, 1 << 14, DropPolicy::DropNewest) {
            Err(RingError::Io { op, kind, .. }) => {
                assert_eq!((op, kind), ("allocate", io::ErrorKind::StorageFull))
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a ring larger than its filesystem was made"),
        }
        assert_eq!(std::fs::read_dir(small.0.path()).unwrap().count(), 0);
        // One that fits is made, and every slot of it can be written: its
        // pages were found as it was made, not at a producer's store.
        let ring = Ring::create_shared(&path, 1, 1 << 12, DropPolicy::DropNewest).unwrap();
        let mut producer = ring.producer().unwrap();
        use crate::event::{Device, Event, NameId, Payload};
        let event = Event::new(
            1,
            0,
            Device::Host,
            1,
            NameId(1),
            Payload::Step { step_num: 1 },
        );
        let pushed = (0..1 << 12).filter(|_| producer.push(&event)).count();
        assert_eq!(pushed, 1 << 12);
    }

    #[test]
    fn liveness_of_pids() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
    }

    #[test]
    fn heap_rings_record_their_creator_and_consumer() {
        let ring = Ring::new(2, 4, DropPolicy::DropOldest).unwrap();
        assert_eq!(ring.creator_pid(), std::process::id());
        assert_eq!(ring.consumer_pid(), None);
        let _consumer = ring.consumer().unwrap();
        assert_eq!(ring.consumer_pid(), Some(std::process::id()));
        let _producer = ring.producer().unwrap();
        assert_eq!(ring.lane_owners(), vec![Some(std::process::id()), None]);
        // Our own lanes are never released.
        assert!(ring.release_dead_producers().is_empty());
    }

    #[test]
    fn temp_names_stay_in_the_directory() {
        let temp = temp_path(Path::new("/run/devtrace/7.ring"));
        assert_eq!(temp.parent(), Some(Path::new("/run/devtrace")));
        let name = temp.file_name().unwrap().to_string_lossy().into_owned();
        let prefix = format!(".7.ring.{}-", std::process::id());
        assert!(
            name.starts_with(&prefix) && name.ends_with(".tmp"),
            "{name}"
        );
        assert!(is_temp_name(&name));
        assert_ne!(temp_path(Path::new("/run/devtrace/7.ring")), temp);
        assert!(is_temp_name(".a.ring.12-0.tmp"));
        assert!(!is_temp_name(".a.ring.12.tmp"));
        assert!(!is_temp_name(".a.txt.12-0.tmp"));
        assert!(!is_temp_name("a.ring"));
    }
}
