//! Redirecting other libraries' calls to CUPTI entry points to this
//! library's, through their global offset tables: what makes interposition
//! work when the CUDA driver loaded this library (`CUDA_INJECTION64_PATH`),
//! where the dynamic linker's own lookup order cannot, because PyTorch and
//! JAX bind to libcupti directly.
//!
//! Every loaded object's PLT (`JUMP_SLOT`) and GOT (`GLOB_DAT`) relocations
//! naming one of the entry points get this library's function instead,
//! where they hold that entry point of the libcupti this library uses: a
//! slot bound to another copy of libcupti in the process (a framework's
//! own `.so.12` beside the `.so.13` found first) stays with it, and so
//! does one not bound yet (which the retargeted exports below cover). A
//! slot in a RELRO segment is made writable for the write and read-only
//! again. libcupti itself (whose internal calls stay as they are) and this
//! library are left alone. Slots already redirected are skipped, so it can
//! run again for libraries loaded later.
//!
//! The loader lists an object (`dl_iterate_phdr`) as soon as it maps it,
//! before it relocates it and makes its RELRO pages read-only: a slot
//! written then, its page made read-only by us, faults the loader's next
//! relocation in that page. So the walk first lists the objects, then
//! opens each again (`dlopen` with `RTLD_NOLOAD`, which waits for a
//! `dlopen` under way to finish, and keeps the object loaded) and only then
//! patches it.
//!
//! Callers that have not bound the names yet are covered at the source
//! ([`retarget_exports`]): libcupti's own dynamic symbol table entries for
//! them are pointed at this library's functions, so that `dlsym` on
//! libcupti's handle (XLA's CUPTI wrapper looks every function up so), and
//! the dynamic linker binding a library loaded later, find them. The real
//! entry points were resolved before (`cupti/library.rs`), and libcupti's
//! already relocated internal calls do not read the table again.

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

/// An entry point, where the libcupti in use has it, and the function
/// calls to it should reach instead.
pub struct Redirect {
    pub name: &'static CStr,
    pub from: usize,
    pub to: usize,
}

/// What a walk over the loaded objects changes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Other objects' GOT slots.
    Callers,
    /// libcupti's dynamic symbol table.
    Exports,
}

struct Walk<'a> {
    redirects: &'a [Redirect],
    own_base: usize,
    target: Target,
    patched: usize,
}

/// Redirects every loaded object's slots for `redirects`; returns how many
/// slots were changed.
pub fn redirect(redirects: &[Redirect]) -> usize {
    walk(redirects, Target::Callers)
}

/// Points libcupti's dynamic symbol table entries for `redirects` at them;
/// returns how many entries were changed.
pub fn retarget_exports(redirects: &[Redirect]) -> usize {
    walk(redirects, Target::Exports)
}

fn walk(redirects: &[Redirect], target: Target) -> usize {
    let mut walk = Walk {
        redirects,
        own_base: super::dl::own_base(),
        target,
        patched: 0,
    };
    let mut listed = Listed {
        objects: Vec::with_capacity(MAX_OBJECTS),
        names: Vec::with_capacity(NAME_BYTES),
    };
    // SAFETY: the callback only copies the loader's description of each
    // object into `listed`'s room, allocating nothing.
    unsafe { libc::dl_iterate_phdr(Some(list), (&mut listed as *mut Listed).cast()) };
    for object in &listed.objects {
        let name = &listed.names[object.name.clone()];
        let Some(held) = Held::open(name) else {
            continue; // unloaded since, or never finished loading
        };
        // The same object as listed (not one loaded at its name since).
        if held.base() != Some(object.base) {
            continue;
        }
        // SAFETY: the program headers of a loaded object, which `held`
        // keeps loaded.
        let phdrs = unsafe { std::slice::from_raw_parts(object.phdrs, usize::from(object.phnum)) };
        let name = CStr::from_bytes_until_nul(name)
            .ok()
            .and_then(|name| name.to_str().ok())
            .unwrap_or("");
        // SAFETY: as above.
        unsafe { patch_loaded(name, object.base, phdrs, &mut walk) };
        drop(held);
    }
    walk.patched
}

/// Most objects one walk looks at, and the bytes of their names: room
/// made before the walk, since the loader's lock is held during it.
const MAX_OBJECTS: usize = 4096;
const NAME_BYTES: usize = 1 << 20;

/// The loaded objects as `dl_iterate_phdr` listed them.
struct Listed {
    objects: Vec<ListedObject>,
    /// Their names, NUL-terminated, one after another.
    names: Vec<u8>,
}

struct ListedObject {
    /// Where its name (with the NUL) lies in [`Listed::names`].
    name: std::ops::Range<usize>,
    base: usize,
    phdrs: *const libc::Elf64_Phdr,
    phnum: u16,
}

/// `dl_iterate_phdr`'s callback: notes each object, in the room made for
/// them (one past it waits for the next walk). A panic here must not
/// unwind into the loader (it would abort the workload), so it ends the
/// walk instead.
///
/// # Safety
/// `info` is the loader's description of one object and `data` our
/// `Listed`.
unsafe extern "C" fn list(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    crate::ffi::guard("the loaded-object walk", 1, || {
        // SAFETY: as the caller promises.
        let (info, listed) = unsafe { (&*info, &mut *data.cast::<Listed>()) };
        let name: &[u8] = if info.dlpi_name.is_null() {
            b"\0"
        } else {
            // SAFETY: a NUL-terminated path owned by the loader.
            unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes_with_nul()
        };
        let start = listed.names.len();
        if listed.objects.len() == listed.objects.capacity()
            || start + name.len() > listed.names.capacity()
        {
            return 0;
        }
        listed.names.extend_from_slice(name);
        listed.objects.push(ListedObject {
            name: start..start + name.len(),
            base: info.dlpi_addr as usize,
            phdrs: info.dlpi_phdr,
            phnum: info.dlpi_phnum,
        });
        0
    })
}

/// A loaded object opened again, so that the loader has finished loading
/// it and keeps it loaded until this is dropped.
struct Held(*mut c_void);

impl Held {
    /// Opens the object named `name` (NUL-terminated; empty: the main
    /// program) only if it is loaded, waiting for a `dlopen` under way.
    fn open(name: &[u8]) -> Option<Held> {
        let name = CStr::from_bytes_until_nul(name).ok()?;
        let path = if name.is_empty() {
            std::ptr::null()
        } else {
            name.as_ptr()
        };
        // SAFETY: a NUL-terminated name (or null: the main program);
        // RTLD_NOLOAD loads nothing new.
        let handle = unsafe { libc::dlopen(path, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        (!handle.is_null()).then_some(Held(handle))
    }

    /// Its load base (`l_addr` of its `link_map`).
    fn base(&self) -> Option<usize> {
        /// The public head of glibc's `struct link_map` (`<link.h>`).
        #[repr(C)]
        struct LinkMap {
            addr: usize,
        }
        let mut map: *const LinkMap = std::ptr::null();
        // SAFETY: a handle of dlopen's; RTLD_DI_LINKMAP writes a pointer.
        let rc = unsafe {
            libc::dlinfo(
                self.0,
                libc::RTLD_DI_LINKMAP,
                (&mut map as *mut *const LinkMap).cast(),
            )
        };
        // SAFETY: the loader's link_map of an object held open.
        (rc == 0 && !map.is_null()).then(|| unsafe { (*map).addr })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: a handle of dlopen's, closed once.
        unsafe { libc::dlclose(self.0) };
    }
}

/// Patches one loaded object, relocated and held open: its slots, or, for
/// the libcupti in use, its exports.
///
/// # Safety
/// `phdrs` are the program headers of the object loaded at `base`, held
/// loaded by the caller.
unsafe fn patch_loaded(name: &str, base: usize, phdrs: &[libc::Elf64_Phdr], walk: &mut Walk) {
    // The libcupti in use is the object its functions lie in, whatever its
    // file is called; another copy of libcupti, or a library merely named
    // like one, is an object like any other (its slots are redirected only
    // where they hold the functions of the libcupti in use).
    let in_use = walk
        .redirects
        .iter()
        .any(|redirect| segment_of(redirect.from, base, phdrs).is_some());
    if name.contains("linux-vdso") || in_use != (walk.target == Target::Exports) {
        return;
    }
    if walk.target == Target::Exports {
        let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
            return;
        };
        // SAFETY: the dynamic section and program headers of a loaded object.
        unsafe {
            patch_exports(
                base,
                (base + dynamic.p_vaddr as usize) as *const Dyn,
                phdrs,
                walk,
            )
        };
        return;
    }
    // This library's own slots stay as they are. It is known by its load
    // base; the main program's base is 0 (and so is an unknown own base),
    // which never counts as a match.
    if base != 0 && base == walk.own_base {
        return;
    }
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return;
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

/// What one object's dynamic section says where to find (addresses; 0
/// where it has none).
#[derive(Default)]
struct Tables {
    strtab: usize,
    symtab: usize,
    jmprel: usize,
    pltrelsz: usize,
    rela: usize,
    relasz: usize,
    hash: usize,
    gnu_hash: usize,
}

/// Reads the dynamic section of the object loaded at `base`.
///
/// # Safety
/// `dynamic` is that object's loaded dynamic section.
unsafe fn tables(base: usize, dynamic: *const Dyn) -> Tables {
    let mut t = Tables::default();
    let mut entry = dynamic;
    // SAFETY: entries up to DT_NULL belong to the section.
    unsafe {
        while (*entry).tag != DT_NULL {
            let value = (*entry).value;
            match (*entry).tag {
                DT_STRTAB => t.strtab = absolute(base, value),
                DT_SYMTAB => t.symtab = absolute(base, value),
                DT_JMPREL => t.jmprel = absolute(base, value),
                DT_PLTRELSZ => t.pltrelsz = value as usize,
                DT_RELA => t.rela = absolute(base, value),
                DT_RELASZ => t.relasz = value as usize,
                DT_HASH => t.hash = absolute(base, value),
                DT_GNU_HASH => t.gnu_hash = absolute(base, value),
                _ => {}
            }
            entry = entry.add(1);
        }
    }
    t
}

/// # Safety
/// `dynamic` is the dynamic section of the object loaded at `base`, and
/// `relro` its RELRO range.
unsafe fn patch_object(
    base: usize,
    dynamic: *const Dyn,
    relro: Option<(usize, usize)>,
    walk: &mut Walk,
) {
    // SAFETY: as the caller promises.
    let Tables {
        strtab,
        symtab,
        jmprel,
        pltrelsz,
        rela,
        relasz,
        ..
    } = unsafe { tables(base, dynamic) };
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
            // SAFETY: the relocation's symbol, in this object's table.
            let symbol = unsafe { &*(symtab as *const Sym).add(index) };
            // SAFETY: its name, a NUL-terminated string of the string table.
            let name =
                unsafe { CStr::from_ptr((strtab + symbol.name as usize) as *const libc::c_char) };
            let Some(redirect) = walk.redirects.iter().find(|r| r.name == name) else {
                continue;
            };
            let slot = (base + relocation.offset as usize) as *mut usize;
            // Only a slot bound to the libcupti in use: not one bound to
            // another copy, nor one not bound yet (or redirected already).
            // SAFETY: the GOT slot of this relocation.
            if unsafe { slot.read_volatile() } != redirect.from {
                continue;
            }
            // SAFETY: as above; `relro` is this object's RELRO range.
            if unsafe { write_slot(slot, redirect.to, relro) } {
                walk.patched += 1;
            }
        }
    }
}

/// Writes one slot, making its page writable for the write when it lies in
/// a RELRO segment (read-only after relocation). A caller on another thread
/// calling through the slot meanwhile jumps to the old or the new function:
/// the write is one aligned word, and both forward to libcupti.
///
/// # Safety
/// `slot` is an aligned GOT slot of a loaded object whose RELRO range, if
/// it has one, is `relro`.
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

const DT_HASH: i64 = 4;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const PT_LOAD: u32 = 1;

/// How many entries a dynamic symbol table has, from its hash table (the
/// ELF header's section table is not loaded).
///
/// # Safety
/// `hash` (DT_HASH) or `gnu_hash` (DT_GNU_HASH), when not 0, are the loaded
/// hash tables of one object.
unsafe fn symbol_count(hash: usize, gnu_hash: usize) -> usize {
    if hash != 0 {
        // SAFETY: DT_HASH starts with nbucket and nchain (u32); nchain is the
        // number of symbols.
        return unsafe { (hash as *const u32).add(1).read() } as usize;
    }
    if gnu_hash == 0 {
        return 0;
    }
    // SAFETY: a GNU hash table: nbuckets, symoffset, bloom size, bloom
    // shift, the bloom words (8 bytes each on 64-bit), the buckets, then
    // one chain word per symbol from symoffset on, the last of each chain
    // with its low bit set.
    unsafe {
        let header = gnu_hash as *const u32;
        let nbuckets = header.read() as usize;
        let symoffset = header.add(1).read() as usize;
        let bloom_words = header.add(2).read() as usize;
        let buckets = (gnu_hash + 16 + bloom_words * 8) as *const u32;
        let chains = buckets.add(nbuckets);
        let last_start = (0..nbuckets)
            .map(|i| buckets.add(i).read() as usize)
            .max()
            .unwrap_or(0);
        if last_start < symoffset {
            return symoffset;
        }
        let mut index = last_start;
        while chains.add(index - symoffset).read() & 1 == 0 {
            index += 1;
        }
        index + 1
    }
}

/// Points the dynamic symbol table entries of one object (libcupti) named
/// by `walk.redirects` at them.
///
/// # Safety
/// `dynamic` and `phdrs` are the dynamic section and program headers of the
/// object loaded at `base`.
unsafe fn patch_exports(
    base: usize,
    dynamic: *const Dyn,
    phdrs: &[libc::Elf64_Phdr],
    walk: &mut Walk,
) {
    // SAFETY: as the caller promises.
    let Tables {
        strtab,
        symtab,
        hash,
        gnu_hash,
        ..
    } = unsafe { tables(base, dynamic) };
    if strtab == 0 || symtab == 0 {
        return;
    }
    // SAFETY: the hash tables of this object.
    let count = unsafe { symbol_count(hash, gnu_hash) };
    for index in 0..count {
        // SAFETY: below the count the hash table gives, an entry of this
        // object's symbol table.
        let symbol = unsafe { (symtab as *mut Sym).add(index) };
        // SAFETY: as above.
        let (name_offset, shndx) = unsafe { ((*symbol).name, (*symbol).shndx) };
        if shndx == 0 {
            continue; // undefined here
        }
        // SAFETY: its name, a NUL-terminated string of the string table.
        let name =
            unsafe { CStr::from_ptr((strtab + name_offset as usize) as *const libc::c_char) };
        let Some(redirect) = walk.redirects.iter().find(|r| r.name == name) else {
            continue;
        };
        // The loader adds the object's base to a symbol's value.
        let value = (redirect.to as u64).wrapping_sub(base as u64);
        // SAFETY: the `value` field of that entry.
        let field = unsafe { std::ptr::addr_of_mut!((*symbol).value) };
        // SAFETY: as above, aligned (Elf64_Sym is 8-aligned).
        if unsafe { field.read_volatile() } == value {
            continue;
        }
        // SAFETY: an aligned u64 inside a loaded segment of this object.
        if unsafe { write_in_segment(field, value, base, phdrs) } {
            walk.patched += 1;
        }
    }
}

/// The loaded segment of the object at `base` that holds `address`.
fn segment_of(
    address: usize,
    base: usize,
    phdrs: &[libc::Elf64_Phdr],
) -> Option<&libc::Elf64_Phdr> {
    phdrs.iter().find(|p| {
        let start = base + p.p_vaddr as usize;
        p.p_type == PT_LOAD && address >= start && address < start + p.p_memsz as usize
    })
}

/// Writes one u64 of a loaded object's read-only segment: the page is made
/// writable for the write, then given the segment's own protection back.
/// (A concurrent lookup reads either the old or the new value: the write
/// is one aligned word.)
///
/// # Safety
/// `field` is an aligned u64 inside a `PT_LOAD` segment of the object
/// loaded at `base` with program headers `phdrs`.
unsafe fn write_in_segment(
    field: *mut u64,
    value: u64,
    base: usize,
    phdrs: &[libc::Elf64_Phdr],
) -> bool {
    let address = field as usize;
    let Some(segment) = segment_of(address, base, phdrs) else {
        return false;
    };
    let mut protection = 0;
    if segment.p_flags & 4 != 0 {
        protection |= libc::PROT_READ;
    }
    if segment.p_flags & 2 != 0 {
        protection |= libc::PROT_WRITE;
    }
    if segment.p_flags & 1 != 0 {
        protection |= libc::PROT_EXEC;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    // An aligned u64 never straddles two pages.
    let page_start = (address & !(page - 1)) as *mut c_void;
    // SAFETY: the page holds this object's segment.
    if unsafe { libc::mprotect(page_start, page, protection | libc::PROT_WRITE) } != 0 {
        return false;
    }
    // SAFETY: aligned, inside the segment, writable now.
    unsafe { field.write_volatile(value) };
    // SAFETY: as above.
    unsafe { libc::mprotect(page_start, page, protection) };
    true
}
