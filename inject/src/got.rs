//! Redirecting other libraries' calls to CUPTI entry points to this
//! library's, through their global offset tables: what makes interposition
//! work when the CUDA driver loaded this library (`CUDA_INJECTION64_PATH`),
//! where the dynamic linker's own lookup order cannot, because PyTorch and
//! JAX bind to libcupti directly.
//!
//! Every loaded object's PLT (`JUMP_SLOT`) and GOT (`GLOB_DAT`) relocations
//! naming one of the entry points get this library's function instead. A
//! slot in a RELRO segment is made writable for the write and read-only
//! again. libcupti itself (whose internal calls stay as they are) and this
//! library are left alone. Slots already redirected are skipped, so it can
//! run again for libraries loaded later.

use std::ffi::{c_int, c_void, CStr};

#[cfg(target_arch = "x86_64")]
const JUMP_SLOT: u32 = 7;
#[cfg(target_arch = "x86_64")]
const GLOB_DAT: u32 = 6;
#[cfg(target_arch = "aarch64")]
const JUMP_SLOT: u32 = 1026;
#[cfg(target_arch = "aarch64")]
const GLOB_DAT: u32 = 1025;

const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_JMPREL: i64 = 23;
const PT_DYNAMIC: u32 = 2;
const PT_GNU_RELRO: u32 = 0x6474_e552;

#[repr(C)]
struct Dyn {
    tag: i64,
    value: u64,
}

#[repr(C)]
struct Rela {
    offset: u64,
    info: u64,
    addend: i64,
}

#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

/// An entry point and the function calls to it should reach instead.
pub struct Redirect {
    pub name: &'static CStr,
    pub to: usize,
}

struct Walk<'a> {
    redirects: &'a [Redirect],
    own_base: usize,
    patched: usize,
}

/// Redirects every loaded object's slots for `redirects`; returns how many
/// slots were changed.
pub fn redirect(redirects: &[Redirect]) -> usize {
    let mut walk = Walk {
        redirects,
        own_base: own_base(),
        patched: 0,
    };
    // SAFETY: the callback only reads the loader's structures for each
    // object and writes pointer-sized slots of their GOTs.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut walk as *mut Walk).cast()) };
    walk.patched
}

fn own_base() -> usize {
    // SAFETY: dladdr fills `info` for an address of this library.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(own_base as *const c_void, &mut info) != 0 {
            info.dli_fbase as usize
        } else {
            0
        }
    }
}

/// `dl_iterate_phdr`'s callback: a panic here must not unwind into the
/// loader (it would abort the workload), so it ends the walk instead.
///
/// # Safety
/// `info` is the loader's description of one object and `data` our `Walk`.
unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, size: usize, data: *mut c_void) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: as the caller promises.
        unsafe { visit_object(info, size, data) }
    }))
    .unwrap_or(1)
}

/// # Safety
/// As [`visit`].
unsafe fn visit_object(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: the loader passes a valid `info`; `data` is our `Walk`.
    let (info, walk) = unsafe { (&*info, &mut *data.cast::<Walk>()) };
    let name = if info.dlpi_name.is_null() {
        ""
    } else {
        // SAFETY: a NUL-terminated path owned by the loader.
        unsafe { CStr::from_ptr(info.dlpi_name) }
            .to_str()
            .unwrap_or("")
    };
    if name.contains("libcupti") || name.contains("linux-vdso") {
        return 0;
    }
    // SAFETY: as above; phdrs are the object's program headers.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let base = info.dlpi_addr as usize;
    // This library's own slots stay as they are. It is known by its load
    // base; the main program's base is 0 (and so is an unknown own base),
    // which never counts as a match.
    if base != 0 && base == walk.own_base {
        return 0;
    }
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return 0;
    };
    let relro = phdrs
        .iter()
        .find(|p| p.p_type == PT_GNU_RELRO)
        .map(|p| (base + p.p_vaddr as usize, p.p_memsz as usize));
    // SAFETY: the dynamic section of a loaded object, read up to DT_NULL.
    unsafe {
        patch_object(
            base,
            (base + dynamic.p_vaddr as usize) as *const Dyn,
            relro,
            walk,
        )
    };
    0
}

/// Some loaders leave the dynamic section's addresses unrelocated.
fn absolute(base: usize, value: u64) -> usize {
    let value = value as usize;
    if value < base {
        base + value
    } else {
        value
    }
}

unsafe fn patch_object(
    base: usize,
    dynamic: *const Dyn,
    relro: Option<(usize, usize)>,
    walk: &mut Walk,
) {
    let (mut strtab, mut symtab) = (0, 0);
    let (mut jmprel, mut pltrelsz, mut rela, mut relasz) = (0, 0, 0, 0);
    let mut entry = dynamic;
    // SAFETY: entries up to DT_NULL belong to the section.
    unsafe {
        while (*entry).tag != DT_NULL {
            let value = (*entry).value;
            match (*entry).tag {
                DT_STRTAB => strtab = absolute(base, value),
                DT_SYMTAB => symtab = absolute(base, value),
                DT_JMPREL => jmprel = absolute(base, value),
                DT_PLTRELSZ => pltrelsz = value as usize,
                DT_RELA => rela = absolute(base, value),
                DT_RELASZ => relasz = value as usize,
                _ => {}
            }
            entry = entry.add(1);
        }
    }
    if strtab == 0 || symtab == 0 {
        return;
    }
    for (table, bytes) in [(jmprel, pltrelsz), (rela, relasz)] {
        if table == 0 || bytes == 0 {
            continue;
        }
        let count = bytes / std::mem::size_of::<Rela>();
        // SAFETY: the relocation table of a loaded object.
        let relocations = unsafe { std::slice::from_raw_parts(table as *const Rela, count) };
        for relocation in relocations {
            let kind = (relocation.info & 0xffff_ffff) as u32;
            if kind != JUMP_SLOT && kind != GLOB_DAT {
                continue;
            }
            let index = (relocation.info >> 32) as usize;
            // SAFETY: a symbol of this object's table and its name.
            let symbol = unsafe { &*(symtab as *const Sym).add(index) };
            let name =
                unsafe { CStr::from_ptr((strtab + symbol.name as usize) as *const libc::c_char) };
            let Some(redirect) = walk.redirects.iter().find(|r| r.name == name) else {
                continue;
            };
            let slot = (base + relocation.offset as usize) as *mut usize;
            // SAFETY: the GOT slot of this relocation.
            if unsafe { slot.read_volatile() } == redirect.to {
                continue;
            }
            if unsafe { write_slot(slot, redirect.to, relro) } {
                walk.patched += 1;
            }
        }
    }
}

/// Writes one slot, making its page writable for the write when it lies in
/// a RELRO segment (read-only after relocation).
unsafe fn write_slot(slot: *mut usize, value: usize, relro: Option<(usize, usize)>) -> bool {
    let address = slot as usize;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    // The loader makes whole pages of the RELRO range read-only; the page
    // holding its tail stays writable.
    let protected = relro
        .is_some_and(|(start, len)| address >= start && address < ((start + len) & !(page - 1)));
    let page_start = (address & !(page - 1)) as *mut c_void;
    if protected {
        // SAFETY: the page holds this object's GOT.
        if unsafe { libc::mprotect(page_start, page, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return false;
        }
    }
    // SAFETY: a pointer-sized, aligned GOT slot, writable now.
    unsafe { slot.write_volatile(value) };
    if protected {
        // SAFETY: as above.
        unsafe { libc::mprotect(page_start, page, libc::PROT_READ) };
    }
    true
}
