//! Request checks shared by every RPC. Each failure is an INVALID_ARGUMENT
//! whose message starts with the offending field's name.

use tonic::Status;

/// Longest name accepted for a session or host (a file-name component).
pub const MAX_NAME_LEN: usize = 255;
/// Longest path accepted for a repository root.
pub const MAX_PATH_LEN: usize = 4096;

pub fn invalid(field: &str, problem: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {problem}"))
}

pub fn check_characters(field: &str, value: &str) -> Result<(), Status> {
    if value.contains('\0') {
        return Err(invalid(field, "must not contain NUL"));
    }
    // They would reach logs, terminals and directory listings.
    if value.chars().any(crate::model::printable::unsafe_to_print) {
        return Err(invalid(
            field,
            "must not contain control characters, line separators or marks that reverse text",
        ));
    }
    Ok(())
}

/// A value that becomes one path component (session id, host name): no
/// separators, no `..`, no NUL or control characters.
pub fn name_component(field: &str, value: &str) -> Result<(), Status> {
    check_characters(field, value)?;
    if value.len() > MAX_NAME_LEN {
        return Err(invalid(field, format!("longer than {MAX_NAME_LEN} bytes")));
    }
    if value.contains('/') || value.contains('\\') {
        return Err(invalid(
            field,
            format!("{value:?} must not contain '/' or '\\'"),
        ));
    }
    if value.contains("..") {
        return Err(invalid(field, format!("{value:?} must not contain '..'")));
    }
    // "." names the folder it would be made in.
    if value == "." {
        return Err(invalid(field, "\".\" names no folder of its own"));
    }
    // A name padded by a script's quoting would be a second session
    // beside the one meant, shown alike.
    if value.trim() != value {
        return Err(invalid(
            field,
            format!("{value:?} must not begin or end with white space"),
        ));
    }
    Ok(())
}

/// A path given by the client; whether it may be written is decided by the
/// operator's allowed roots, not here.
pub fn client_path(field: &str, value: &str) -> Result<(), Status> {
    check_characters(field, value)?;
    if value.len() > MAX_PATH_LEN {
        return Err(invalid(field, format!("longer than {MAX_PATH_LEN} bytes")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_refuse_traversal_separators_and_control_characters() {
        for bad in [
            "a/b",
            "a\\b",
            "..",
            ".",
            "x..y",
            "nul\0",
            "tab\t",
            "new\nline",
        ] {
            let status = name_component("session_id", bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(
                status.message().starts_with("session_id: "),
                "{}",
                status.message()
            );
        }
        assert!(name_component("host_name", "10.0.0.2:8466").is_ok());
        assert!(name_component("session_id", "2026_11_21_10_00_00").is_ok());
        assert!(name_component("session_id", " s1").is_err());
        assert!(name_component("session_id", "s1 ").is_err());
        assert!(name_component("session_id", &"x".repeat(256)).is_err());
    }

    #[test]
    fn client_paths_refuse_only_malformed_text() {
        assert!(client_path("repository_root", "relative/logs/plugins/profile").is_ok());
        assert!(client_path("repository_root", "/tmp/a\0b").is_err());
    }
}
