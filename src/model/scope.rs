//! Whose a capture is: the whole host (root, admins, the agent's own
//! triggers) or one local user's processes. A capture scoped to a user
//! switches tracers on only in that user's processes and its trace keeps
//! only their events; the services decide the scope from who is calling
//! (`crate::service::access`), backends and the trace builder obey it.

use std::fmt;

/// See the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Every process, thread and device of the host.
    Host,
    /// The processes whose user is `uid`, the GPUs they use and nothing
    /// else.
    User { uid: u32 },
}

impl Scope {
    /// A scope no process is in (uid -1 is nobody's): what a request has
    /// until its handler knows who asked.
    pub const NO_ONE: Scope = Scope::User { uid: u32::MAX };

    /// Whether a process of user `uid` is in this scope.
    pub fn covers_user(self, uid: u32) -> bool {
        match self {
            Scope::Host => true,
            Scope::User { uid: own } => own == uid,
        }
    }

    /// The user a scoped capture belongs to; none for the whole host.
    pub fn user(self) -> Option<u32> {
        match self {
            Scope::Host => None,
            Scope::User { uid } => Some(uid),
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Host => f.write_str("the whole host"),
            Scope::User { uid } => write!(f, "the processes of uid {uid}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_scope_covers_that_user_alone_and_the_host_scope_everyone() {
        assert!(Scope::Host.covers_user(0));
        assert!(Scope::Host.covers_user(1001));
        let nobody = Scope::User { uid: 65_534 };
        assert!(nobody.covers_user(65_534));
        assert!(!nobody.covers_user(0));
        assert!(!nobody.covers_user(1001));
        assert_eq!(nobody.user(), Some(65_534));
        assert_eq!(Scope::Host.user(), None);
        assert_eq!(nobody.to_string(), "the processes of uid 65534");
    }
}
