//! `--spill-dir` and `--spill-size`: where a trace goes while it is built
//! when it outgrows its share of `--capture-memory`. Its finished blocks are
//! appended to a file with no name (nobody else can open, swap or fill it),
//! which is mapped into memory once the build is done and sent from there:
//! the kernel can drop those pages and read them again, so a trace larger
//! than the agent's memory is served instead of refused. The space all spill
//! files take at once is bounded by `--spill-size`; a file's share goes back
//! when the last reply sending its trace is dropped.
//!
//! A directory in memory (tmpfs, ramfs) is refused: spilling there would
//! take the very memory the budget protects.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::memory::MemoryError;
use crate::model::filesystem::Filesystem;
use crate::xspace::grant::Spill;

/// The default `--spill-size`.
pub const DEFAULT_SPILL_SIZE: u64 = 4 << 30;

/// The directory spill files go in, and how much of it they may take.
#[derive(Debug)]
pub struct SpillSpace {
    dir: PathBuf,
    limit: u64,
    used: AtomicU64,
}

impl SpillSpace {
    /// Spilling into `dir`, at most `limit` bytes at once; refused when
    /// `dir` is not a directory or its files live in memory.
    pub fn new(dir: &Path, limit: u64) -> Result<SpillSpace, String> {
        let meta =
            std::fs::metadata(dir).map_err(|e| format!("--spill-dir {}: {e}", dir.display()))?;
        if !meta.is_dir() {
            return Err(format!("--spill-dir {}: not a directory", dir.display()));
        }
        let fs = Filesystem::of(dir).map_err(|e| format!("--spill-dir {}: {e}", dir.display()))?;
        if fs.keeps_files_in_memory() {
            return Err(format!(
                "--spill-dir {}: its files are kept in memory (tmpfs or ramfs), which spilling \
                 is meant to spare; name a directory on a disk, or --spill-size off",
                dir.display()
            ));
        }
        // Writable by the agent (a read-only root filesystem, a directory of
        // another user's): found out now, not by a capture.
        tempfile::tempfile_in(dir).map_err(|e| {
            format!(
                "--spill-dir {}: cannot make a file there: {e}",
                dir.display()
            )
        })?;
        Ok(SpillSpace {
            dir: dir.to_path_buf(),
            limit,
            used: AtomicU64::new(0),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes spill files take now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// A spill for one build, whose memory budget is `budget` bytes (said
    /// when the space is full). The file is made at the first block.
    pub fn file(self: &Arc<Self>, budget: usize) -> SpillFile {
        SpillFile {
            space: Arc::clone(self),
            file: None,
            share: Share {
                space: Arc::clone(self),
                bytes: 0,
            },
            budget,
        }
    }

    fn failed(&self, why: impl std::fmt::Display) -> MemoryError {
        MemoryError::SpillFailed {
            dir: self.dir.display().to_string(),
            why: why.to_string(),
        }
    }
}

/// Bytes of the space one spill file holds, given back when dropped.
#[derive(Debug)]
struct Share {
    space: Arc<SpillSpace>,
    bytes: u64,
}

impl Share {
    fn grow(&mut self, bytes: u64, budget: usize) -> Result<(), MemoryError> {
        let space = &self.space;
        let mut used = space.used.load(Ordering::Relaxed);
        loop {
            let after = used.saturating_add(bytes);
            if after > space.limit {
                return Err(MemoryError::SpillFull {
                    budget,
                    limit: space.limit,
                    dir: space.dir.display().to_string(),
                });
            }
            match space
                .used
                .compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        self.bytes += bytes;
        Ok(())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.space.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One build's spill: see the module documentation.
pub struct SpillFile {
    space: Arc<SpillSpace>,
    file: Option<File>,
    share: Share,
    budget: usize,
}

impl Spill for SpillFile {
    type Error = MemoryError;

    fn append(&mut self, block: &[u8]) -> Result<u64, MemoryError> {
        let at = self.share.bytes;
        self.share.grow(block.len() as u64, self.budget)?;
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                // Unnamed (O_TMPFILE where the filesystem has it): gone with
                // the last handle, whatever becomes of the agent.
                let file =
                    tempfile::tempfile_in(&self.space.dir).map_err(|e| self.space.failed(e))?;
                self.file.insert(file)
            }
        };
        file.write_all(block).map_err(|e| self.space.failed(e))?;
        Ok(at)
    }

    fn finish(self: Box<Self>) -> Result<Bytes, MemoryError> {
        let SpillFile {
            space, file, share, ..
        } = *self;
        let Some(file) = file.filter(|_| share.bytes > 0) else {
            return Ok(Bytes::new());
        };
        // SAFETY: the file has no name and this is its only handle: nothing
        // else can change or truncate it while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| space.failed(e))?;
        if (map.len() as u64) < share.bytes {
            return Err(space.failed(format!(
                "{} of the {} bytes written came back",
                map.len(),
                share.bytes
            )));
        }
        Ok(Bytes::from_owner(Spilled { map, _share: share }))
    }
}

/// A finished spill file, mapped: the trace's spilled blocks, and the share
/// of `--spill-size` they take until the last reply sending them is dropped.
struct Spilled {
    map: memmap2::Mmap,
    _share: Share,
}

impl AsRef<[u8]> for Spilled {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_where_they_were_appended_and_the_space_is_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let space = Arc::new(SpillSpace::new(dir.path(), 1 << 20).unwrap());
        let mut spill = Box::new(space.file(1 << 10));
        assert_eq!(spill.append(b"first").unwrap(), 0);
        assert_eq!(spill.append(&[7; 1000]).unwrap(), 5);
        assert_eq!(space.used(), 1005);
        // Nothing is left with a name in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let bytes = spill.finish().unwrap();
        assert_eq!(&bytes[..5], b"first");
        assert_eq!(&bytes[5..1005], &[7; 1000][..]);
        let part = bytes.slice(5..10);
        drop(bytes);
        assert_eq!(space.used(), 1005, "a part still refers to the file");
        drop(part);
        assert_eq!(space.used(), 0);
    }

    #[test]
    fn a_full_space_refuses_naming_the_flag_and_an_unused_spill_takes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let space = Arc::new(SpillSpace::new(dir.path(), 100).unwrap());
        let mut first = Box::new(space.file(1 << 10));
        first.append(&[1; 60]).unwrap();
        let mut second = Box::new(space.file(1 << 10));
        let refused = second.append(&[2; 60]).unwrap_err();
        assert!(
            refused.to_string().contains("--spill-size (100 bytes)"),
            "{refused}"
        );
        drop(first);
        assert_eq!(space.used(), 0);
        assert_eq!(Box::new(space.file(1)).finish().unwrap().len(), 0);
    }

    #[test]
    fn a_directory_in_memory_or_a_file_is_refused() {
        if let Ok(meta) = std::fs::metadata("/dev/shm") {
            if meta.is_dir() {
                let refused = SpillSpace::new(Path::new("/dev/shm"), 1).unwrap_err();
                assert!(refused.contains("kept in memory"), "{refused}");
            }
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        let refused = SpillSpace::new(file.path(), 1).unwrap_err();
        assert!(refused.contains("not a directory"), "{refused}");
    }
}
