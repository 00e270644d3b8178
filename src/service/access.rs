//! Who may act on what runs in the agent: a capture in progress (stopped
//! by `Terminate`) and a continuous profiling session (its snapshots and
//! its stop) belong to the caller that started them. Admins (root, the
//! agent's own user, members of `--admin-group`, and clients whose
//! certificate names one of `--admin-client`) may act on anything; anyone
//! else on what is theirs: the same uid for a local caller, the same
//! certificate name or else the same address for one on another host. A
//! caller the kernel could not name owns nothing and may act on nothing of
//! anyone's.

use crate::protocol::caller::{Caller, Owner};
use crate::repository::acting::Credentials;

/// See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// `--admin-group`'s gid.
    admin_gid: Option<u32>,
    /// `--admin-client`: certificate names of admins.
    admin_clients: Vec<String>,
}

impl Access {
    pub fn new(admin_gid: Option<u32>, admin_clients: Vec<String>) -> Access {
        Access {
            admin_gid,
            admin_clients,
        }
    }

    /// Whether `caller` may act on anything.
    pub fn is_admin(&self, caller: &Caller) -> bool {
        // SAFETY: geteuid has no preconditions.
        let agent = unsafe { libc::geteuid() };
        match caller {
            Caller::Agent => true,
            Caller::User { uid, .. } if *uid == 0 || *uid == agent => true,
            Caller::User { uid, .. } => self
                .admin_gid
                .is_some_and(|gid| Credentials::of_user(*uid).groups.contains(&gid)),
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

/// The gid of the group named `name`, for `--admin-group`.
pub fn group_id(name: &str) -> Result<u32, String> {
    let Ok(c_name) = std::ffi::CString::new(name) else {
        return Err(format!("--admin-group {name:?}: not a group name"));
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
        return Err(format!("--admin-group {name}: no such group on this host"));
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
        assert_eq!(group_id("root"), Ok(0));
        assert!(group_id("no-such-group-here").is_err());
    }
}
