//! `s3://bucket/prefix` and `gs://bucket/prefix`: parsing them strictly and
//! telling whether one lies inside another. Keys are taken literally (no
//! percent-decoding), split on `/` into segments, and `.`, `..`, empty
//! segments and control characters are refused, so that two spellings never
//! name the same objects and a prefix match on segments is a containment
//! check.

use std::fmt;

/// Which object store a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// Amazon S3 and S3-compatible servers (`s3://`).
    S3,
    /// Google Cloud Storage (`gs://`).
    Gcs,
}

impl Provider {
    fn scheme(self) -> &'static str {
        match self {
            Provider::S3 => "s3",
            Provider::Gcs => "gs",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    #[error("{url}: unsupported scheme {scheme:?} (object storage is s3:// or gs://)")]
    UnsupportedScheme { url: String, scheme: String },
    #[error("{url}: {problem:?} is not a bucket name (letters, digits, '-', '_' and '.')")]
    Bucket { url: String, problem: String },
    #[error("{url}: {problem}")]
    Key { url: String, problem: String },
}

/// Longest bucket name accepted (GCS allows 222 with dots, S3 63).
const MAX_BUCKET_LEN: usize = 222;

/// A bucket and a key prefix in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectUrl {
    pub provider: Provider,
    pub bucket: String,
    /// The prefix's segments; none for the whole bucket.
    pub segments: Vec<String>,
}

/// The scheme of `text` when it looks like `scheme://...`.
pub fn scheme_of(text: &str) -> Option<&str> {
    let (scheme, _) = text.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(scheme)
}

impl ObjectUrl {
    /// Parses `s3://bucket/a/b` or `gs://bucket/a/b`; `None` when `text`
    /// names no scheme at all (a local path).
    pub fn parse(text: &str) -> Result<Option<ObjectUrl>, UrlError> {
        let Some(scheme) = scheme_of(text) else {
            return Ok(None);
        };
        let provider = match scheme {
            "s3" => Provider::S3,
            "gs" => Provider::Gcs,
            other => {
                return Err(UrlError::UnsupportedScheme {
                    url: text.to_string(),
                    scheme: other.to_string(),
                })
            }
        };
        let rest = &text[scheme.len() + 3..];
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket_ok = !bucket.is_empty()
            && bucket.len() <= MAX_BUCKET_LEN
            && bucket
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && bucket != "."
            && bucket != "..";
        if !bucket_ok {
            return Err(UrlError::Bucket {
                url: text.to_string(),
                problem: bucket.to_string(),
            });
        }
        let key_problem = |problem: &str| UrlError::Key {
            url: text.to_string(),
            problem: problem.to_string(),
        };
        // One trailing slash is how people write a directory.
        let key = key.strip_suffix('/').unwrap_or(key);
        let mut segments = Vec::new();
        if !key.is_empty() {
            for segment in key.split('/') {
                match segment {
                    "" => return Err(key_problem("contains an empty path segment ('//')")),
                    "." | ".." => return Err(key_problem("contains '.' or '..' as a segment")),
                    _ if segment.chars().any(char::is_control) => {
                        return Err(key_problem("contains control characters"))
                    }
                    _ => segments.push(segment.to_string()),
                }
            }
        }
        Ok(Some(ObjectUrl {
            provider,
            bucket: bucket.to_string(),
            segments,
        }))
    }

    /// The segments of `other` below `self`, when `other` lies in the same
    /// bucket of the same provider at or below `self`'s prefix.
    pub fn relative<'o>(&self, other: &'o ObjectUrl) -> Option<&'o [String]> {
        if self.provider != other.provider || self.bucket != other.bucket {
            return None;
        }
        other.segments.strip_prefix(self.segments.as_slice())
    }

    /// The URL one segment further down.
    pub fn join(&self, segment: &str) -> ObjectUrl {
        let mut joined = self.clone();
        joined.segments.push(segment.to_string());
        joined
    }

    /// The key prefix, segments joined with `/`.
    pub fn key(&self) -> String {
        self.segments.join("/")
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.provider.scheme(), self.bucket)?;
        for segment in &self.segments {
            write!(f, "/{segment}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> ObjectUrl {
        ObjectUrl::parse(text).unwrap().unwrap()
    }

    #[test]
    fn urls_parse_into_provider_bucket_and_segments() {
        let parsed = url("s3://traces/team/run1/");
        assert_eq!(parsed.provider, Provider::S3);
        assert_eq!(parsed.bucket, "traces");
        assert_eq!(parsed.segments, ["team", "run1"]);
        assert_eq!(parsed.to_string(), "s3://traces/team/run1");
        assert_eq!(url("gs://b").segments, Vec::<String>::new());
        assert_eq!(url("gs://b/").to_string(), "gs://b");
        assert_eq!(ObjectUrl::parse("/var/lib/traces").unwrap(), None);
        assert_eq!(ObjectUrl::parse("relative/dir").unwrap(), None);
    }

    #[test]
    fn malformed_urls_are_refused() {
        for bad in [
            "s3://",
            "s3:///key",
            "s3://bu@cket/x",
            "s3://host:9000/x",
            "s3://../x",
            "s3://b/a//c",
            "s3://b/a/../c",
            "s3://b/./c",
            "s3://b/..",
            "gs://b/a\nb",
        ] {
            assert!(ObjectUrl::parse(bad).is_err(), "{bad} was accepted");
        }
        assert!(matches!(
            ObjectUrl::parse("http://b/x"),
            Err(UrlError::UnsupportedScheme { .. })
        ));
        assert!(matches!(
            ObjectUrl::parse("S3://b/x"),
            Err(UrlError::UnsupportedScheme { .. })
        ));
    }

    #[test]
    fn containment_is_by_whole_segments_bucket_and_provider() {
        let root = url("s3://traces/team");
        let inside = url("s3://traces/team/run1/plugins/profile");
        assert_eq!(
            root.relative(&inside).unwrap(),
            ["run1", "plugins", "profile"]
        );
        assert_eq!(root.relative(&root).unwrap(), &[] as &[String]);
        for outside in [
            "s3://traces/team2/run1",
            "s3://traces/tea",
            "s3://traces",
            "s3://traces-evil/team/run1",
            "s3://traces.evil/team",
            "gs://traces/team/run1",
        ] {
            assert_eq!(root.relative(&url(outside)), None, "{outside}");
        }
        assert!(url("gs://b").relative(&url("gs://b/any/thing")).is_some());
    }
}
