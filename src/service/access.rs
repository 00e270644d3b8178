//! Who may act on what runs in the agent: a capture in progress (stopped
//! by `Terminate`) and a continuous profiling session (its snapshots and
//! its stop) belong to the caller that started them. Admins (root, the
//! agent's own user, members of `--admin-group`, and clients whose
//! certificate names one of `--admin-client`) may act on anything; anyone
//! else on what is theirs: the same uid for a local caller, the same
//! certificate name or else the same address for one on another host. A
//! caller the kernel could not name owns nothing and may act on nothing of
//! anyone's.
//!
//! What a capture holds follows from who asks too ([`Access::scope_of`]):
//! admins capture the whole host, any other local user their own
//! processes; a caller on another host that is not an admin gets nothing
//! unless `--remote-callers host` lets it see the whole host.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::backend::Scope;
use crate::protocol::caller::{Caller, Owner};
use crate::repository::acting::Credentials;

/// What callers on other hosts that are not admins may capture
/// (`--remote-callers`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RemoteCallers {
    /// Nothing: their captures and sessions are refused.
    #[default]
    Refuse,
    /// The whole host, as an admin does: anyone who can reach the
    /// listener (use it on a network only trusted clients reach, or with
    /// TLS client certificates).
    Host,
}

/// How long whether a uid is in `--admin-group` is remembered.
const MEMBERSHIP_TTL: Duration = Duration::from_secs(10);

/// Uids whose membership is remembered at most, so that callers of many
/// uids cannot grow it.
const MAX_REMEMBERED: usize = 1024;

/// See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// `--admin-group`'s gid.
    admin_gid: Option<u32>,
    /// `--admin-client`: certificate names of admins.
    admin_clients: Vec<String>,
    remote_callers: RemoteCallers,
    /// Whether each uid was in `--admin-group`, and when that was read:
    /// the user database is read once per uid and ten seconds, not per
    /// call.
    membership: Arc<Mutex<HashMap<u32, (bool, Instant)>>>,
}

impl Access {
    pub fn new(admin_gid: Option<u32>, admin_clients: Vec<String>) -> Access {
        Access {
            admin_gid,
            admin_clients,
            ..Access::default()
        }
    }

    /// As it is, with `--remote-callers`.
    pub fn with_remote_callers(mut self, remote_callers: RemoteCallers) -> Access {
        self.remote_callers = remote_callers;
        self
    }

    /// Whose processes a capture asked for by `caller` holds: the whole
    /// host for an admin, a local user's own processes, and for anyone
    /// else the whole host where `--remote-callers host` allows it; else
    /// why not.
    pub fn scope_of(&self, caller: &Caller) -> Result<Scope, String> {
        if self.is_admin(caller) {
            return Ok(Scope::Host);
        }
        match caller {
            Caller::User { uid, .. } => Ok(Scope::User { uid: *uid }),
            Caller::Certificate(_) | Caller::Remote(_)
                if self.remote_callers == RemoteCallers::Host =>
            {
                Ok(Scope::Host)
            }
            Caller::Certificate(_) | Caller::Remote(_) => Err(format!(
                "{caller} is not a user of this host nor an admin: the agent captures nothing \
                 for it (an admin certificate name goes in --admin-client; --remote-callers \
                 host lets callers from other hosts capture the whole host)"
            )),
            Caller::Unknown | Caller::Agent => Err(format!(
                "the kernel could not say who is calling ({caller}): the agent captures \
                 nothing for it"
            )),
        }
    }

    /// Whether local user `uid` is a member of `--admin-group`.
    fn in_admin_group(&self, uid: u32, gid: u32) -> bool {
        let now = Instant::now();
        let mut membership = self.membership.lock();
        if let Some((member, at)) = membership.get(&uid) {
            if now.duration_since(*at) < MEMBERSHIP_TTL {
                return *member;
            }
        }
        let member = Credentials::of_user(uid).groups.contains(&gid);
        if membership.len() >= MAX_REMEMBERED {
            membership.retain(|_, (_, at)| now.duration_since(*at) < MEMBERSHIP_TTL);
            if membership.len() >= MAX_REMEMBERED {
                membership.clear();
            }
        }
        membership.insert(uid, (member, now));
        member
    }

    /// Whether `caller` may act on anything.
    pub fn is_admin(&self, caller: &Caller) -> bool {
        if caller.is_agents_equal() {
            return true;
        }
        match caller {
            Caller::Agent => true,
            Caller::User { uid, .. } => self
                .admin_gid
                .is_some_and(|gid| self.in_admin_group(*uid, gid)),
            Caller::Certificate(name) => self.admin_clients.iter().any(|admin| **admin == **name),
            Caller::Remote(_) | Caller::Unknown => false,
        }
    }

    /// Whether `caller` may act on what `owner` started.
    pub fn may_act_on(&self, caller: &Caller, owner: &Caller) -> bool {
        self.is_admin(caller) || Access::same_owner(caller, owner)
    }

    /// Whether `a` and `b` are one owner: the same uid, certificate name or
    /// address. A caller the kernel could not name is nobody's.
    fn same_owner(a: &Caller, b: &Caller) -> bool {
        let owner = a.owner();
        owner != Owner::Unnamed && owner == b.owner()
    }

    /// Whether `a` and `b` count as one caller for per-caller limits: one
    /// owner, or both unnamed (bounded together).
    pub fn same_caller(a: &Caller, b: &Caller) -> bool {
        a.owner() == b.owner()
    }
}

/// The gid of the group named `name` (or given by number), for the flag
/// `flag` (`--admin-group`), which its errors name.
pub fn group_id(flag: &str, name: &str) -> Result<u32, String> {
    if let Ok(gid) = name.parse::<u32>() {
        // (gid_t)-1 means "unchanged" to chown: no group.
        if gid == u32::MAX {
            return Err(format!("{flag} {name}: not a group id"));
        }
        return Ok(gid);
    }
    let Ok(c_name) = std::ffi::CString::new(name) else {
        return Err(format!("{flag} {name:?}: not a group name"));
    };
    // SAFETY: group is plain data; getgrnam_r fills it.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; 16 << 10];
    let mut found = std::ptr::null_mut();
    // SAFETY: valid pointers and the buffer's length.
    let rc = unsafe {
        libc::getgrnam_r(
            c_name.as_ptr(),
            &mut group,
            buffer.as_mut_ptr(),
            buffer.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return Err(format!("{flag} {name}: no such group on this host"));
    }
    Ok(group.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(uid: u32) -> Caller {
        Caller::tcp_user(uid)
    }

    #[test]
    fn owners_act_on_their_own_admins_on_all_and_the_unnamed_on_nothing() {
        let access = Access::default();
        let remote = Caller::Remote([10, 0, 0, 7].into());
        assert!(access.may_act_on(&user(1001), &user(1001)));
        assert!(!access.may_act_on(&user(1001), &user(1002)));
        assert!(access.may_act_on(&user(0), &user(1002)));
        assert!(access.may_act_on(&Caller::Agent, &user(1002)));
        assert!(access.may_act_on(&remote, &remote));
        assert!(!access.may_act_on(&remote, &Caller::Remote([10, 0, 0, 8].into())));
        assert!(!access.may_act_on(&remote, &user(1001)));
        assert!(!access.may_act_on(&Caller::Unknown, &Caller::Unknown));
        assert!(!access.may_act_on(&user(1001), &Caller::Unknown));
        let named = |name: &str| Caller::Certificate(name.into());
        assert!(access.may_act_on(&named("spiffe://a"), &named("spiffe://a")));
        assert!(!access.may_act_on(&named("spiffe://a"), &named("spiffe://b")));
        let with_admin_client = Access::new(None, vec!["spiffe://ops".into()]);
        assert!(with_admin_client.may_act_on(&named("spiffe://ops"), &named("spiffe://b")));
        assert!(!with_admin_client.is_admin(&named("spiffe://b")));
    }

    #[test]
    fn admins_capture_the_host_users_their_own_and_remote_callers_as_configured() {
        let access = Access::new(None, vec!["spiffe://ops".into()]);
        assert_eq!(access.scope_of(&user(0)), Ok(Scope::Host));
        assert_eq!(access.scope_of(&Caller::Agent), Ok(Scope::Host));
        assert_eq!(access.scope_of(&user(1001)), Ok(Scope::User { uid: 1001 }));
        let admin = Caller::Certificate("spiffe://ops".into());
        assert_eq!(access.scope_of(&admin), Ok(Scope::Host));
        let remote = Caller::Remote([10, 0, 0, 7].into());
        let named = Caller::Certificate("spiffe://team".into());
        for caller in [&remote, &named] {
            let refused = access.scope_of(caller).unwrap_err();
            assert!(refused.contains("--remote-callers host"), "{refused}");
        }
        let open = access.clone().with_remote_callers(RemoteCallers::Host);
        assert_eq!(open.scope_of(&remote), Ok(Scope::Host));
        assert_eq!(open.scope_of(&named), Ok(Scope::Host));
        // A caller the kernel could not name gets nothing, whatever is set.
        assert!(open.scope_of(&Caller::Unknown).is_err());
    }

    #[test]
    fn a_member_of_the_admin_group_is_an_admin() {
        // nobody's primary group, which it is a member of.
        let nobody = Credentials::of_user(65_534);
        if nobody.groups.is_empty() {
            eprintln!("skipped: this host lists no user 65534");
            return;
        }
        let access = Access::new(Some(nobody.gid), Vec::new());
        assert!(access.is_admin(&user(65_534)));
        assert!(!Access::default().is_admin(&user(65_534)));
        // A uid the user database does not list is in no group.
        assert!(!access.is_admin(&user(4_000_000)));
        assert_eq!(group_id("--admin-group", "root"), Ok(0));
        assert_eq!(group_id("--admin-group", "1234"), Ok(1234));
        assert_eq!(
            group_id("--listen-unix-group", "no-such-group-here"),
            Err("--listen-unix-group no-such-group-here: no such group on this host".into())
        );
    }
}
