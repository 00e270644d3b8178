//! Finding exported symbols in a 64-bit ELF shared object (the target's
//! libc): its dynamic symbol table, read with every offset and size checked
//! against the file, since the file is the target's and the target may be
//! anyone's.

/// Why a symbol was not found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    #[error("not a 64-bit little-endian ELF file for x86-64")]
    NotElf64,
    #[error("its section headers lie outside the file")]
    Truncated,
    #[error("it has no dynamic symbol table")]
    NoDynsym,
    #[error("it exports no {0}")]
    Missing(String),
}

const SHT_DYNSYM: u32 = 11;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const EM_X86_64: u16 = 62;

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

/// One section header's type, offset, size, link and entry size.
struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: usize,
    entry_size: usize,
}

fn section(file: &[u8], index: usize) -> Option<Section> {
    let table = usize_at(file, 0x28)?;
    let entry = usize::from(u16_at(file, 0x3A)?);
    if entry < 0x40 {
        return None;
    }
    let at = table.checked_add(index.checked_mul(entry)?)?;
    // The header's 64 bytes lie in the file, so no field's offset overflows.
    file.get(at..at.checked_add(0x40)?)?;
    Some(Section {
        kind: u32_at(file, at + 0x04)?,
        offset: usize_at(file, at + 0x18)?,
        size: usize_at(file, at + 0x20)?,
        link: usize::try_from(u32_at(file, at + 0x28)?).ok()?,
        entry_size: usize_at(file, at + 0x38)?,
    })
}

/// The value (offset from the load base) of the exported function `name`
/// in `file`, the default version when there are several.
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
    if file.get(..4) != Some(b"\x7fELF")
        || file.get(4) != Some(&2)
        || file.get(5) != Some(&1)
        || u16_at(file, 0x12) != Some(EM_X86_64)
    {
        return Err(ElfError::NotElf64);
    }
    let count = usize::from(u16_at(file, 0x3C).ok_or(ElfError::Truncated)?);
    let dynsym = (0..count)
        .map(|i| section(file, i).ok_or(ElfError::Truncated))
        .find(|s| s.as_ref().map_or(true, |s| s.kind == SHT_DYNSYM))
        .ok_or(ElfError::NoDynsym)??;
    let strings = section(file, dynsym.link).ok_or(ElfError::Truncated)?;
    let symbols = file
        .get(
            dynsym.offset
                ..dynsym
                    .offset
                    .checked_add(dynsym.size)
                    .ok_or(ElfError::Truncated)?,
        )
        .ok_or(ElfError::Truncated)?;
    let names = file
        .get(
            strings.offset
                ..strings
                    .offset
                    .checked_add(strings.size)
                    .ok_or(ElfError::Truncated)?,
        )
        .ok_or(ElfError::Truncated)?;
    if dynsym.entry_size < 24 {
        return Err(ElfError::Truncated);
    }
    for symbol in symbols.chunks_exact(dynsym.entry_size) {
        let Some(name_at) = u32_at(symbol, 0).and_then(|n| usize::try_from(n).ok()) else {
            continue;
        };
        let info = symbol[4];
        let defined = u16_at(symbol, 6).is_some_and(|index| index != 0);
        let value = u64_at(symbol, 8).unwrap_or(0);
        if info & 0xf != kind || !defined || value == 0 {
            continue;
        }
        let Some(rest) = names.get(name_at..) else {
            continue;
        };
        let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
        if &rest[..end] == name.as_bytes() {
            return Ok(value);
        }
    }
    Err(ElfError::Missing(name.to_string()))
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
