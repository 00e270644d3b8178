//! Finding exported symbols in a 64-bit ELF shared object (a process's
//! libc, the CUDA driver library): its dynamic symbol table, read with every
//! offset and size checked against the file, since the file is a process's
//! and the process may be anyone's. A file is read a piece at a time (the
//! header, the section headers, the symbol table and its strings), never
//! mapped: a file truncated while mapped would fault the reader.

use std::borrow::Cow;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Why a symbol was not found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    #[error("not a 64-bit little-endian ELF file for this machine")]
    NotElf64,
    #[error("its section headers lie outside the file")]
    Truncated,
    #[error("it has no dynamic symbol table")]
    NoDynsym,
    #[error("its dynamic symbol table is larger than {} MiB", MAX_TABLE_BYTES >> 20)]
    TooLarge,
    #[error("it exports no {0}")]
    Missing(String),
}

const SHT_DYNSYM: u32 = 11;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const STB_WEAK: u8 = 2;
const EM_X86_64: u16 = 62;
const EM_AARCH64: u16 = 183;

/// The most bytes read for one table (section headers, symbols, their
/// names). A CUDA driver's symbol table is well under a megabyte.
const MAX_TABLE_BYTES: usize = 64 << 20;

/// Where a file's bytes come from: all in memory, or read from the file a
/// piece at a time.
trait Source {
    /// `len` bytes at `at`, or `None` where they are not all in the file.
    fn piece(&self, at: usize, len: usize) -> Option<Cow<'_, [u8]>>;
}

impl Source for [u8] {
    fn piece(&self, at: usize, len: usize) -> Option<Cow<'_, [u8]>> {
        self.get(at..at.checked_add(len)?).map(Cow::Borrowed)
    }
}

impl Source for File {
    fn piece(&self, at: usize, len: usize) -> Option<Cow<'_, [u8]>> {
        // Nothing is allocated for bytes the file does not have.
        let size = self.metadata().ok()?.len();
        let end = u64::try_from(at.checked_add(len)?).ok()?;
        if len > MAX_TABLE_BYTES || end > size {
            return None;
        }
        let mut bytes = vec![0; len];
        self.read_exact_at(&mut bytes, u64::try_from(at).ok()?)
            .ok()?;
        Some(Cow::Owned(bytes))
    }
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn usize_at(bytes: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64_at(bytes, at)?).ok()
}

/// One section header's type, address, offset, size, link and entry size.
struct Section {
    kind: u32,
    address: u64,
    offset: usize,
    size: usize,
    link: usize,
    entry_size: usize,
}

impl Section {
    fn read(headers: &[u8], index: usize, entry: usize) -> Option<Section> {
        let at = index.checked_mul(entry)?;
        let header = headers.get(at..at.checked_add(0x40)?)?;
        Some(Section {
            kind: u32_at(header, 0x04)?,
            address: u64_at(header, 0x10)?,
            offset: usize_at(header, 0x18)?,
            size: usize_at(header, 0x20)?,
            link: usize::try_from(u32_at(header, 0x28)?).ok()?,
            entry_size: usize_at(header, 0x38)?,
        })
    }
}

/// A file's dynamic symbols, the strings that name them and the section
/// headers they point into.
struct DynamicSymbols<'a> {
    symbols: Cow<'a, [u8]>,
    names: Cow<'a, [u8]>,
    entry_size: usize,
    headers: Cow<'a, [u8]>,
    header_size: usize,
}

/// A symbol defined in the file.
struct Symbol<'a> {
    name: &'a [u8],
    value: u64,
    section: usize,
    weak: bool,
}

impl<'a> DynamicSymbols<'a> {
    /// Reads the table of `file`, built for one of `machines`.
    fn read<S: Source + ?Sized>(file: &'a S, machines: &[u16]) -> Result<Self, ElfError> {
        let header = file.piece(0, 0x40).ok_or(ElfError::NotElf64)?;
        if header.get(..4) != Some(b"\x7fELF")
            || header.get(4) != Some(&2)
            || header.get(5) != Some(&1)
            || !u16_at(&header, 0x12).is_some_and(|machine| machines.contains(&machine))
        {
            return Err(ElfError::NotElf64);
        }
        let table = usize_at(&header, 0x28).ok_or(ElfError::Truncated)?;
        let entry = usize::from(u16_at(&header, 0x3A).ok_or(ElfError::Truncated)?);
        let count = usize::from(u16_at(&header, 0x3C).ok_or(ElfError::Truncated)?);
        if entry < 0x40 {
            return Err(ElfError::Truncated);
        }
        let headers = file
            .piece(table, count.checked_mul(entry).ok_or(ElfError::Truncated)?)
            .ok_or(ElfError::Truncated)?;
        let section = |index| Section::read(&headers, index, entry).ok_or(ElfError::Truncated);
        let dynsym = (0..count)
            .map(section)
            .find(|s| s.as_ref().map_or(true, |s| s.kind == SHT_DYNSYM))
            .ok_or(ElfError::NoDynsym)??;
        let strings = section(dynsym.link)?;
        if dynsym.entry_size < 24 {
            return Err(ElfError::Truncated);
        }
        if dynsym.size > MAX_TABLE_BYTES || strings.size > MAX_TABLE_BYTES {
            return Err(ElfError::TooLarge);
        }
        Ok(DynamicSymbols {
            symbols: file
                .piece(dynsym.offset, dynsym.size)
                .ok_or(ElfError::Truncated)?,
            names: file
                .piece(strings.offset, strings.size)
                .ok_or(ElfError::Truncated)?,
            entry_size: dynsym.entry_size,
            headers,
            header_size: entry,
        })
    }

    /// Each symbol defined here of type `kind`.
    fn defined(&self, kind: u8) -> impl Iterator<Item = Symbol<'_>> + '_ {
        self.symbols
            .chunks_exact(self.entry_size)
            .filter_map(move |symbol| {
                let name_at = usize::try_from(u32_at(symbol, 0)?).ok()?;
                let info = symbol[4];
                let section = u16_at(symbol, 6)?;
                let value = u64_at(symbol, 8).unwrap_or(0);
                if info & 0xf != kind || section == 0 || value == 0 {
                    return None;
                }
                let rest = self.names.get(name_at..)?;
                let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
                Some(Symbol {
                    name: &rest[..end],
                    value,
                    section: usize::from(section),
                    weak: info >> 4 == STB_WEAK,
                })
            })
    }

    /// Where `symbol`'s first byte lies in the file: its value moved from
    /// its section's address to the section's offset (what a uprobe is
    /// placed by). `None` for a symbol outside its section, or in none.
    fn file_offset(&self, symbol: &Symbol<'_>) -> Option<u64> {
        let section = Section::read(&self.headers, symbol.section, self.header_size)?;
        let within = symbol.value.checked_sub(section.address)?;
        if within >= u64::try_from(section.size).ok()? {
            return None;
        }
        u64::try_from(section.offset).ok()?.checked_add(within)
    }
}

/// The value (offset from the load base) of the exported function `name`
/// in `file` (an x86-64 object), the default version when there are several.
pub fn function_offset(file: &[u8], name: &str) -> Result<u64, ElfError> {
    symbol_offset(file, name, STT_FUNC).map_err(|error| match error {
        ElfError::Missing(name) => ElfError::Missing(format!("function {name}")),
        other => other,
    })
}

/// As [`function_offset`], for the exported variable `name`.
pub fn variable_offset(file: &[u8], name: &str) -> Result<u64, ElfError> {
    symbol_offset(file, name, STT_OBJECT).map_err(|error| match error {
        ElfError::Missing(name) => ElfError::Missing(format!("variable {name}")),
        other => other,
    })
}

/// The value of the exported symbol `name` of type `kind`.
fn symbol_offset(file: &[u8], name: &str, kind: u8) -> Result<u64, ElfError> {
    DynamicSymbols::read(file, &[EM_X86_64])?
        .defined(kind)
        .find(|symbol| symbol.name == name.as_bytes())
        .map(|symbol| symbol.value)
        .ok_or_else(|| ElfError::Missing(name.to_string()))
}

/// Where each of `names` that the shared object `file` (x86-64 or
/// aarch64) exports as a function begins in the file, the offset a uprobe
/// is placed at; in the order of `names`, `None` for those it does not
/// export. As libbpf chooses: a strong definition over a weak one, and
/// none where two strong ones differ.
pub fn exported_function_offsets(
    file: &File,
    names: &[&str],
) -> Result<Vec<Option<u64>>, ElfError> {
    /// Per name: the strong and the weak offsets seen, and whether two
    /// strong ones differed.
    #[derive(Clone, Default)]
    struct Seen {
        strong: Option<u64>,
        weak: Option<u64>,
        ambiguous: bool,
    }
    let table = DynamicSymbols::read(file, &[EM_X86_64, EM_AARCH64])?;
    let mut seen = vec![Seen::default(); names.len()];
    for symbol in table.defined(STT_FUNC) {
        let Some(at) = names
            .iter()
            .position(|wanted| wanted.as_bytes() == symbol.name)
        else {
            continue;
        };
        let Some(offset) = table.file_offset(&symbol) else {
            continue;
        };
        let seen = &mut seen[at];
        if symbol.weak {
            seen.weak.get_or_insert(offset);
        } else if seen.strong.is_some_and(|strong| strong != offset) {
            seen.ambiguous = true;
        } else {
            seen.strong = Some(offset);
        }
    }
    Ok(seen
        .into_iter()
        .map(|seen| {
            if seen.ambiguous {
                None
            } else {
                seen.strong.or(seen.weak)
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's libc, as the loader maps it into this test.
    fn own_libc() -> Vec<u8> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let path = maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .find(|path| path.contains("/libc.so.6") || path.contains("/libc-"))
            .expect("this test links libc");
        std::fs::read(path).unwrap()
    }

    #[test]
    fn dlopen_is_found_in_this_machines_libc_at_its_own_address() {
        let libc = own_libc();
        let offset = function_offset(&libc, "dlopen").unwrap();
        // Where this process's loader put it, against libc's base.
        let base = {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let first = maps
                .lines()
                .find(|l| l.contains("/libc.so.6") || l.contains("/libc-"))
                .unwrap();
            u64::from_str_radix(first.split('-').next().unwrap(), 16).unwrap()
        };
        let dlopen = libc::dlopen as *const () as usize as u64;
        assert_eq!(base + offset, dlopen);
        assert!(matches!(
            function_offset(&libc, "no_such_function_here"),
            Err(ElfError::Missing(_))
        ));
    }

    #[test]
    fn a_variable_is_found_and_a_function_is_no_variable() {
        let libc = own_libc();
        // glibc's own `environ`-like data: `stdout` is an exported object.
        assert!(variable_offset(&libc, "stdout").is_ok_and(|offset| offset > 0));
        assert!(matches!(
            variable_offset(&libc, "dlopen"),
            Err(ElfError::Missing(_))
        ));
    }

    #[test]
    fn exported_functions_are_found_at_their_code_in_the_file() {
        let libc = own_libc();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libc.so.6");
        std::fs::write(&path, &libc).unwrap();
        let file = File::open(&path).unwrap();
        let offsets = exported_function_offsets(
            &file,
            &["dlopen", "no_such_function_here", "stdout", "malloc"],
        )
        .unwrap();
        assert_eq!(offsets[1], None, "not exported");
        assert_eq!(offsets[2], None, "a variable");
        // The bytes at each offset are the function's code as this process
        // runs it.
        for (name, offset, address) in [
            ("dlopen", offsets[0], libc::dlopen as *const () as usize),
            ("malloc", offsets[3], libc::malloc as *const () as usize),
        ] {
            let offset = usize::try_from(offset.unwrap()).unwrap();
            // SAFETY: the function's first 16 bytes are mapped code.
            let running = unsafe { std::slice::from_raw_parts(address as *const u8, 16) };
            assert_eq!(&libc[offset..offset + 16], running, "{name}");
        }
        // Cut short, as a file truncated under the reader would be.
        std::fs::write(&path, &libc[..libc.len() / 2]).unwrap();
        let file = File::open(&path).unwrap();
        assert!(exported_function_offsets(&file, &["dlopen"]).is_err());
        std::fs::write(&path, b"#!/bin/sh\n").unwrap();
        let file = File::open(&path).unwrap();
        assert_eq!(
            exported_function_offsets(&file, &["dlopen"]),
            Err(ElfError::NotElf64)
        );
    }

    #[test]
    fn files_that_lie_about_their_tables_are_refused_without_panicking() {
        let libc = own_libc();
        assert_eq!(
            function_offset(b"\x7fELF", "dlopen"),
            Err(ElfError::NotElf64)
        );
        assert_eq!(function_offset(b"", "dlopen"), Err(ElfError::NotElf64));
        // Every prefix, and the headers pointed past the end.
        for cut in [0x40, 0x1000, libc.len() / 2] {
            assert!(function_offset(&libc[..cut], "dlopen").is_err());
        }
        let mut lying = libc.clone();
        lying[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(function_offset(&lying, "dlopen").is_err());
        let mut lying = libc;
        lying[0x3A..0x3C].copy_from_slice(&0u16.to_le_bytes());
        assert!(function_offset(&lying, "dlopen").is_err());
    }
}
