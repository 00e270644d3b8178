//! Files touched with the caller's rights: the agent runs as root, and the
//! directories under `--allow-root` are shared, so a capture, a session or a
//! tool request touches files there as the user who asked, never as root.
//! Each such file operation runs on a thread of its own whose filesystem
//! uid, gid and groups are the caller's (`setfsuid`, `setfsgid` and the raw
//! `setgroups` call, all of which change only the calling thread; with a
//! filesystem uid other than 0 the kernel also drops the thread's
//! filesystem capabilities). The kernel then decides, as it would for the
//! caller: a directory the caller cannot enter is not listed, a file it
//! cannot read is not read, and what it may write is written as its own.
//!
//! Who the caller is comes from the kernel too
//! ([`crate::protocol::caller`]); a caller known only by its address (on
//! another host) acts as `nobody`.

use std::cell::Cell;
use std::ffi::CString;
use std::io;

use crate::protocol::caller::Caller;

/// The user anonymous callers act as, when this host has no `nobody`.
const NOBODY: u32 = 65_534;

/// Most supplementary groups looked up for a user.
const MAX_GROUPS: usize = 256;

/// A user's filesystem credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

thread_local! {
    /// The uid this thread acts as, when it is an acting thread.
    static ACTING: Cell<Option<u32>> = const { Cell::new(None) };
}

impl Credentials {
    /// What `caller` acts with: none (the agent's own) for root and the
    /// agent's own user; its user's for another local caller; `nobody`'s
    /// for a caller on another host (named by a certificate or not) or one
    /// the kernel could not name.
    pub fn of_caller(caller: &Caller) -> Option<Credentials> {
        if caller.is_agents_equal() {
            return None;
        }
        match *caller {
            Caller::User { uid, .. } => Some(Credentials::of_user(uid)),
            Caller::Agent => None,
            Caller::Certificate(_) | Caller::Remote(_) | Caller::Unknown => {
                Some(Credentials::nobody())
            }
        }
    }

    /// `uid` with its primary group and supplementary groups from the
    /// user database; a uid it does not list gets no groups but its own
    /// number (as `nobody`'s group when that is missing too).
    pub fn of_user(uid: u32) -> Credentials {
        match user_entry(Lookup::Uid(uid)) {
            Some(entry) => Credentials {
                uid,
                gid: entry.gid,
                groups: group_list(&entry.name, entry.gid),
            },
            None => Credentials {
                uid,
                gid: NOBODY,
                groups: Vec::new(),
            },
        }
    }

    fn nobody() -> Credentials {
        match user_entry(Lookup::Name(c"nobody")) {
            Some(entry) => Credentials::of_user(entry.uid),
            None => Credentials {
                uid: NOBODY,
                gid: NOBODY,
                groups: Vec::new(),
            },
        }
    }

    /// Runs `work` with these credentials, on a thread of its own (at once
    /// on this one when it already acts as this user), and returns what it
    /// returned; an error when the credentials could not be taken on (the
    /// agent lacks CAP_SETUID or CAP_SETGID).
    pub fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> io::Result<T> {
        if ACTING.with(Cell::get) == Some(self.uid) {
            return Ok(work());
        }
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    self.take_on()?;
                    ACTING.with(|acting| acting.set(Some(self.uid)));
                    Ok(work())
                })
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("a file operation panicked")))
        })
    }

    /// Makes this thread's filesystem credentials these, and checks that
    /// they took.
    fn take_on(&self) -> io::Result<()> {
        let refused = |what: &str| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "cannot act as uid {} ({what}): the agent needs CAP_SETUID and CAP_SETGID \
                     to touch files as its callers",
                    self.uid
                ),
            )
        };
        // The raw call: glibc's setgroups changes every thread's.
        // SAFETY: a valid array of `len` gids.
        let rc =
            unsafe { libc::syscall(libc::SYS_setgroups, self.groups.len(), self.groups.as_ptr()) };
        if rc != 0 {
            return Err(refused("its groups"));
        }
        // setfsuid and setfsgid answer the previous value; asking again
        // with an impossible one reads the current.
        // SAFETY: plain syscalls on this thread.
        unsafe {
            libc::setfsgid(self.gid);
            if libc::setfsgid(u32::MAX) as u32 != self.gid {
                return Err(refused("its group"));
            }
            libc::setfsuid(self.uid);
            if libc::setfsuid(u32::MAX) as u32 != self.uid {
                return Err(refused("its user"));
            }
        }
        Ok(())
    }
}

/// How a user is looked up.
enum Lookup<'a> {
    Uid(u32),
    Name(&'a std::ffi::CStr),
}

/// The name the user database gives `uid`, if any.
pub fn user_name(uid: u32) -> Option<String> {
    user_entry(Lookup::Uid(uid)).map(|entry| entry.name.to_string_lossy().into_owned())
}

/// A user as the user database lists it.
struct UserEntry {
    name: CString,
    uid: u32,
    gid: u32,
}

/// A user's name, uid and primary group, from the user database.
fn user_entry(lookup: Lookup) -> Option<UserEntry> {
    // SAFETY: passwd is plain data; getpw*_r fill it.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; 4096];
    let mut found = std::ptr::null_mut();
    // SAFETY: valid pointers and the buffer's length.
    let rc = unsafe {
        match lookup {
            Lookup::Uid(uid) => libc::getpwuid_r(
                uid,
                &mut entry,
                buffer.as_mut_ptr(),
                buffer.len(),
                &mut found,
            ),
            Lookup::Name(name) => libc::getpwnam_r(
                name.as_ptr(),
                &mut entry,
                buffer.as_mut_ptr(),
                buffer.len(),
                &mut found,
            ),
        }
    };
    if rc != 0 || found.is_null() || entry.pw_name.is_null() {
        return None;
    }
    // SAFETY: getpw*_r filled the name into `buffer`, NUL-terminated.
    let name = unsafe { std::ffi::CStr::from_ptr(entry.pw_name) }.to_owned();
    Some(UserEntry {
        name,
        uid: entry.pw_uid,
        gid: entry.pw_gid,
    })
}

/// The groups `name` belongs to, `gid` among them.
fn group_list(name: &CString, gid: u32) -> Vec<u32> {
    let mut groups = vec![0 as libc::gid_t; MAX_GROUPS];
    let mut count = MAX_GROUPS as libc::c_int;
    // SAFETY: valid pointers; `count` is the array's length.
    let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
    if rc < 0 {
        // More than MAX_GROUPS: the primary group alone.
        return vec![gid];
    }
    groups.truncate(count.max(0) as usize);
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::caller::Transport;

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn the_agents_own_user_acts_as_itself_and_others_as_themselves() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let local = |uid| Caller::User {
            uid,
            transport: Transport::Tcp,
        };
        assert_eq!(Credentials::of_caller(&local(me)), None);
        let other = Credentials::of_caller(&local(me + 4242)).expect("another user");
        assert_eq!(other.uid, me + 4242);
        let remote = Credentials::of_caller(&Caller::Remote([10, 0, 0, 7].into())).unwrap();
        assert_eq!(
            Credentials::of_caller(&Caller::Unknown),
            Some(remote.clone())
        );
        assert_ne!(remote.uid, 0);
    }

    /// A file made while acting is the caller's, a directory only root may
    /// enter is closed to it, and the agent's own thread is left as it was.
    #[test]
    fn files_are_touched_with_the_callers_rights_on_its_thread_alone() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if !is_root() {
            eprintln!("skipped: needs root to act as another user");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let closed = dir.path().join("closed");
        std::fs::create_dir(&closed).unwrap();
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
        let nobody = Credentials {
            uid: NOBODY,
            gid: NOBODY,
            groups: Vec::new(),
        };
        let made = dir.path().join("made");
        nobody.run(|| std::fs::write(&made, b"x")).unwrap().unwrap();
        assert_eq!(std::fs::metadata(&made).unwrap().uid(), NOBODY);
        let denied = nobody
            .run(|| std::fs::write(closed.join("in"), b"x"))
            .unwrap()
            .unwrap_err();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied);
        // This thread still writes there as root.
        std::fs::write(closed.join("in"), b"x").unwrap();
    }
}
