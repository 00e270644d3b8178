//! A small JSON writer: the tools print large documents with fields in a
//! fixed order and numbers formatted exactly (protobuf's JSON printer for the
//! memory profile), which a generic serializer does not give.

use std::fmt::Write;

/// Appends `s` as a JSON string literal, escaped exactly as protobuf's JSON
/// printer (`json_internal::JsonWriter::WriteEscapedUtf8`) escapes: the JSON
/// escapes, `\uXXXX` for controls, `<`, `>` and the invisible or formatting
/// code points it lists, surrogate pairs above U+FFFF.
pub fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '"' => out.push_str("\\\""),
            '\u{c}' => out.push_str("\\f"),
            '\u{8}' => out.push_str("\\b"),
            '\\' => out.push_str("\\\\"),
            c if must_escape(c as u32) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn must_escape(c: u32) -> bool {
    const SINGLE: [u32; 12] = [
        '<' as u32, '>' as u32, 0xfeff, 0xfff9, 0xfffa, 0xfffb, 0x00ad, 0x06dd, 0x070f, 0x17b4,
        0x17b5, 0xe0001,
    ];
    const RANGES: [(u32, u32); 9] = [
        (0x0000, 0x001f),
        (0x007f, 0x009f),
        (0x0600, 0x0603),
        (0x200b, 0x200f),
        (0x2028, 0x202e),
        (0x2060, 0x2064),
        (0x206a, 0x206f),
        (0x1d173, 0x1d17a),
        (0xe0020, 0xe007f),
    ];
    SINGLE.contains(&c) || RANGES.iter().any(|&(lo, hi)| (lo..=hi).contains(&c))
}

/// A finite double as the shortest text that reads back to the same value;
/// NaN and infinities (which JSON lacks) as `null`.
pub fn number(out: &mut String, v: f64) {
    if v.is_finite() {
        if v == v.trunc() && v.abs() < 1e15 {
            let _ = write!(out, "{}", v as i64);
        } else {
            let _ = write!(out, "{v}");
        }
    } else {
        out.push_str("null");
    }
}

/// A double as protobuf's JSON printer writes it: `SimpleDtoa` (`%.15g`, or
/// `%.17g` when 15 digits do not read back to the same value), and the
/// strings `"NaN"`, `"Infinity"`, `"-Infinity"` for non-finite values.
pub fn proto_double(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("\"NaN\"");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 {
            "\"Infinity\""
        } else {
            "\"-Infinity\""
        });
    } else {
        let short = format_g(v, 15);
        if short.parse::<f64>().ok() == Some(v) {
            out.push_str(&short);
        } else {
            out.push_str(&format_g(v, 17));
        }
    }
}

/// C's `printf("%.<precision>g", v)` for finite `v`.
pub fn format_g(v: f64, precision: usize) -> String {
    let precision = precision.max(1);
    if v == 0.0 {
        return if v.is_sign_negative() { "-0" } else { "0" }.to_string();
    }
    // Scientific form rounded to `precision` significant digits gives the
    // exponent %g decides on.
    let scientific = format!("{:.*e}", precision - 1, v);
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i64 = exponent.parse().unwrap_or(0);
    if exponent < -4 || exponent >= precision as i64 {
        let mantissa = trim_fraction(mantissa);
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    } else {
        let decimals = (precision as i64 - 1 - exponent).max(0) as usize;
        trim_fraction(&format!("{v:.decimals$}")).to_string()
    }
}

fn trim_fraction(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

/// Writes `{"k": v, ...}` with commas handled; call [`Object::key`] before
/// each value and [`Object::end`] at the end.
pub struct Object<'o> {
    out: &'o mut String,
    first: bool,
}

impl<'o> Object<'o> {
    pub fn new(out: &'o mut String) -> Self {
        out.push('{');
        Object { out, first: true }
    }

    /// Writes the key (and the comma before it) and returns the buffer for
    /// the value.
    pub fn key(&mut self, key: &str) -> &mut String {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        string(self.out, key);
        self.out.push(':');
        self.out
    }

    pub fn str(&mut self, key: &str, value: &str) {
        let out = self.key(key);
        string(out, value);
    }

    pub fn raw(&mut self, key: &str, value: impl std::fmt::Display) {
        let out = self.key(key);
        let _ = write!(out, "{value}");
    }

    pub fn num(&mut self, key: &str, value: f64) {
        let out = self.key(key);
        number(out, value);
    }

    pub fn end(self) {
        self.out.push('}');
    }
}

/// Writes `[v, ...]`; call [`Array::item`] before each value.
pub struct Array<'o> {
    out: &'o mut String,
    first: bool,
}

impl<'o> Array<'o> {
    pub fn new(out: &'o mut String) -> Self {
        out.push('[');
        Array { out, first: true }
    }

    pub fn item(&mut self) -> &mut String {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        self.out
    }

    pub fn end(self) {
        self.out.push(']');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proto(v: f64) -> String {
        let mut out = String::new();
        proto_double(&mut out, v);
        out
    }

    #[test]
    fn doubles_print_like_protobuf() {
        assert_eq!(proto(0.0), "0");
        assert_eq!(proto(1.0), "1");
        assert_eq!(proto(0.5), "0.5");
        assert_eq!(proto(0.0628850953716363), "0.0628850953716363");
        assert_eq!(proto(0.13912633930547175), "0.13912633930547175");
        let printed = "0.045320856823454138";
        assert_eq!(proto(printed.parse().expect("double")), printed);
        assert_eq!(proto(1e-5), "1e-05");
        assert_eq!(proto(0.1 + 0.2), "0.30000000000000004");
        assert_eq!(proto(0.0001), "0.0001");
        assert_eq!(proto(1e15), "1e+15");
        assert_eq!(proto(123456789012345.0), "123456789012345");
        assert_eq!(proto(-2.5), "-2.5");
        assert_eq!(proto(f64::NAN), "\"NaN\"");
        assert_eq!(proto(f64::NEG_INFINITY), "\"-Infinity\"");
    }

    #[test]
    fn format_g_matches_c() {
        assert_eq!(format_g(100000.0, 6), "100000");
        assert_eq!(format_g(1000000.0, 6), "1e+06");
        assert_eq!(format_g(0.00001234, 3), "1.23e-05");
        assert_eq!(format_g(9.9999, 2), "10");
        assert_eq!(format_g(-0.0, 15), "-0");
    }

    #[test]
    fn strings_and_objects() {
        let mut out = String::new();
        let mut o = Object::new(&mut out);
        o.str("a", "x\"<\n\u{1}é&\u{1d173}");
        o.raw("b", 3);
        o.num("c", 0.25);
        o.num("d", f64::NAN);
        let mut a = Array::new(o.key("e"));
        a.item().push('1');
        a.item().push('2');
        a.end();
        o.end();
        assert_eq!(
            out,
            r#"{"a":"x\"\u003c\n\u0001é&\ud834\udd73","b":3,"c":0.25,"d":null,"e":[1,2]}"#
        );
    }
}
