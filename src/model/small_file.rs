//! Files an operator names (a configuration, a certificate or key, a trace
//! to inspect): read whole, but only when the name is a regular file and
//! at most up to a bound, so that `/dev/zero` or a FIFO in its
//! place is refused at once instead of growing the agent by gigabytes or
//! hanging its start. The name is looked at before it is opened (opening
//! some devices does something), and the file opened is checked again.

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The contents of the regular file at `path`, of at most `limit` bytes.
pub fn read(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let not_regular = || io::Error::new(io::ErrorKind::InvalidInput, "not a regular file");
    // Links are followed, as the operator chose them (Kubernetes mounts
    // secrets through them).
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    // Non-blocking, so that a FIFO swapped in since is refused below
    // rather than waited on.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        return Err(not_regular());
    }
    let too_large = || {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("larger than {limit} bytes, the most read from such a file"),
        )
    };
    if metadata.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    // It may have grown since it was looked at.
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// As [`read`], as UTF-8 text.
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_within_the_bound_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "listen = \"x\"\n").unwrap();
        assert_eq!(read_text(&path, 64).unwrap(), "listen = \"x\"\n");
        let refused = read(&path, 4).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::FileTooLarge);
    }

    #[test]
    fn devices_and_fifos_are_refused_without_reading_or_waiting() {
        let refused = read(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidInput);
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let refused = read(&fifo, 1 << 20).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidInput);
        assert!(read(dir.path(), 1 << 20).is_err());
    }
}
