//! Text from others made safe to print: a name or message that came from a
//! trace file, a peer's reply or a directory another user made must not
//! move the terminal's cursor, set its title, clear it, forge a line of a
//! log or reorder what follows it. Control characters, and the Unicode ones
//! that break lines or reorder text, are written as escapes (`\n`,
//! `\u{1b}`).

use std::borrow::Cow;

/// `text` on one line, every control or reordering character escaped.
pub fn printable(text: &str) -> Cow<'_, str> {
    escaped(text, |_| false)
}

/// `text` with its line breaks kept and every other control or reordering
/// character escaped: for messages of several lines of one's own that may
/// quote others' text.
pub fn printable_lines(text: &str) -> Cow<'_, str> {
    escaped(text, |c| c == '\n')
}

fn escaped(text: &str, kept: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(|c| unsafe_to_print(c) && !kept(c)) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !unsafe_to_print(c) || kept(c) {
            out.push(c);
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            _ => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
        }
    }
    Cow::Owned(out)
}

/// Control characters (C0, DEL, C1), line and paragraph separators, and
/// the marks and overrides that change the direction of what follows.
pub fn unsafe_to_print(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}'
                | '\u{2029}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_leave_text_on_one_line_with_nothing_for_a_terminal_to_act_on() {
        assert!(matches!(
            printable("worker-0 µs"),
            Cow::Borrowed("worker-0 µs")
        ));
        assert_eq!(
            printable("host\u{1b}]0;PWNED\u{7}\u{1b}[2J"),
            "host\\u{1b}]0;PWNED\\u{7}\\u{1b}[2J"
        );
        assert_eq!(
            printable("a\r\n2026-01-01 INFO forged\tline"),
            "a\\r\\n2026-01-01 INFO forged\\tline"
        );
        assert_eq!(
            printable("abc\u{202e}fed\u{2028}"),
            "abc\\u{202e}fed\\u{2028}"
        );
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(printable_lines("one\ntwo\u{1b}[31m"), "one\ntwo\\u{1b}[31m");
    }
}
