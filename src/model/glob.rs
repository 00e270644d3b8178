//! Patterns with `*` (any run of bytes) and `?` (any one byte), as
//! operators write them for hosts (`--session-hosts`) and processes
//! (`--cuda-attach`).

/// Whether `text` matches `pattern`, iteratively: the last `*` seen is
/// retried one byte further on a mismatch, so matching is linear in
/// practice and never recursive.
pub fn matches(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut retry: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                retry = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match retry {
                Some((star, from)) => {
                    p = star + 1;
                    t = from + 1;
                    retry = Some((star, from + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn stars_and_question_marks_match_runs_and_single_bytes() {
        assert!(matches(b"python*", b"python3"));
        assert!(matches(b"*train.py*", b"python /srv/train.py --steps 10"));
        assert!(matches(b"a?c", b"abc"));
        assert!(!matches(b"a?c", b"ac"));
        assert!(matches(b"*", b""));
        assert!(!matches(b"x", b""));
        // Long runs of stars against long text stay fast.
        let text = vec![b'a'; 10_000];
        assert!(!matches(b"*a*a*a*a*b", &text));
    }
}
