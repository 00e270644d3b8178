//! The path of a UNIX socket the agent serves on (`--listen-unix`): what
//! is there before it binds (nothing, another kind of file, a socket some
//! server accepts connections on, or a stale one a dead server left), and
//! the socket it put there, which it removes at exit only while that path
//! still holds it, so that an agent that exits never takes another's
//! socket away.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What is at a socket path now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occupant {
    Nothing,
    /// A file, directory or link that is not a socket: never replaced.
    NotASocket,
    /// A socket some server accepts connections on.
    Listening,
    /// A socket no one accepts on (its server died): replaceable.
    Stale,
    /// A socket that could not be connected to for another reason (another
    /// user's, say): whether a server uses it is not known.
    Unknown,
}

/// What is at `path` now. A socket is judged by connecting to it, which
/// a listening server accepts (and sees closed at once).
pub fn occupant(path: &Path) -> Occupant {
    match std::fs::symlink_metadata(path) {
        Err(_) => Occupant::Nothing,
        Ok(metadata) if !metadata.file_type().is_socket() => Occupant::NotASocket,
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Occupant::Listening,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => Occupant::Stale,
            Err(_) => Occupant::Unknown,
        },
    }
}

/// Moves the socket bound at `staged` to `path`: into an empty place
/// only if it is still empty (another server starting at the same moment
/// is not replaced), or over a stale socket.
pub fn put_in_place(staged: &Path, path: &Path, over_stale: bool) -> std::io::Result<()> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    let flags = if over_stale {
        RenameFlags::empty()
    } else {
        RenameFlags::NOREPLACE
    };
    renameat_with(CWD, staged, CWD, path, flags).map_err(std::io::Error::from)
}

/// A socket this process put at `path`.
#[derive(Debug)]
pub struct PlacedSocket {
    path: PathBuf,
    /// The socket file's device and inode once placed.
    identity: (u64, u64),
}

impl PlacedSocket {
    /// The socket now at `path`, just placed there.
    pub fn at(path: &Path) -> std::io::Result<PlacedSocket> {
        let metadata = std::fs::symlink_metadata(path)?;
        Ok(PlacedSocket {
            path: path.to_path_buf(),
            identity: (metadata.dev(), metadata.ino()),
        })
    }

    /// Removes the socket, unless the path holds another file by now (a
    /// second agent that replaced it, a file an operator put there).
    pub fn remove_if_ours(&self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|now| (now.dev(), now.ino()) == self.identity);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_is_told_apart_and_only_its_own_socket_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        assert_eq!(occupant(&path), Occupant::Nothing);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(occupant(&path), Occupant::Listening);
        let placed = PlacedSocket::at(&path).unwrap();
        drop(listener);
        assert_eq!(occupant(&path), Occupant::Stale);
        // Another server's socket took the path (the first one's file
        // kept, so that its inode is not reused): left alone.
        std::fs::rename(&path, dir.path().join("old.sock")).unwrap();
        let _other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        placed.remove_if_ours();
        assert_eq!(occupant(&path), Occupant::Listening);
        // Its own is removed.
        PlacedSocket::at(&path).unwrap().remove_if_ours();
        assert_eq!(occupant(&path), Occupant::Nothing);
        std::fs::write(&path, b"x").unwrap();
        assert_eq!(occupant(&path), Occupant::NotASocket);
        // Into an empty place only while it is empty.
        let staged = dir.path().join("staged.sock");
        let _staged = std::os::unix::net::UnixListener::bind(&staged).unwrap();
        let refused = put_in_place(&staged, &path, false).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::AlreadyExists);
        std::fs::remove_file(&path).unwrap();
        put_in_place(&staged, &path, false).unwrap();
        assert_eq!(occupant(&path), Occupant::Listening);
    }
}
