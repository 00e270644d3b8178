//! The code a target runs to load the library: one page, written into the
//! target and entered with every register as the target had it but the
//! instruction pointer. It saves everything the call may change (flags,
//! every general register, the whole extended state with `xsave`), calls
//! `dlopen(path, RTLD_NOW)` on an aligned stack below the red zone, writes
//! the result and a done word where the agent reads them, restores
//! everything and jumps to where the target was. It needs no tracer once
//! entered: an agent killed after the switch leaves the target to finish it
//! alone.
//!
//! Layout: code from offset 0, then at [`DATA`] the words the code reads
//! (the function to call, where to resume) and writes (result, done), and
//! the path.

/// Size of the page the trampoline lives in.
pub const PAGE: usize = 4096;
/// Offset of the data the code reads and writes.
pub const DATA: usize = 0x800;
const FUNCTION: usize = DATA;
const RESUME: usize = DATA + 0x08;
/// Offset of `dlopen`'s result.
pub const RESULT: usize = DATA + 0x10;
/// Offset of the word set to [`DONE`] once the call returned.
pub const DONE_WORD: usize = DATA + 0x18;
const PATH: usize = DATA + 0x20;
/// The done word's value once the call returned.
pub const DONE: u32 = 0x600d_1dea;
/// The longest path the page holds (with its NUL).
pub const MAX_PATH: usize = PAGE - PATH;

const RTLD_NOW: u32 = 2;
/// Bytes below the stack pointer that leaf code may use without moving it.
const RED_ZONE: u32 = 128;

/// Machine code with RIP-relative references to the page's data.
struct Code {
    bytes: Vec<u8>,
}

impl Code {
    fn emit(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    /// `opcode` followed by a 32-bit displacement to `target` (an offset
    /// in the page), relative to the end of the instruction, which has
    /// `trailing` bytes after the displacement.
    fn rip_relative(&mut self, opcode: &[u8], target: usize, trailing: &[u8]) {
        self.emit(opcode);
        let end = self.bytes.len() + 4 + trailing.len();
        let displacement = target as i64 - end as i64;
        self.emit(&(displacement as i32).to_le_bytes());
        self.emit(trailing);
    }
}

/// Pushed after the flags, in this order; popped in reverse.
const SAVED: [&[u8]; 15] = [
    &[0x50],       // rax
    &[0x51],       // rcx
    &[0x52],       // rdx
    &[0x53],       // rbx
    &[0x55],       // rbp
    &[0x56],       // rsi
    &[0x57],       // rdi
    &[0x41, 0x50], // r8
    &[0x41, 0x51], // r9
    &[0x41, 0x52], // r10
    &[0x41, 0x53], // r11
    &[0x41, 0x54], // r12
    &[0x41, 0x55], // r13
    &[0x41, 0x56], // r14
    &[0x41, 0x57], // r15
];

/// The page: code that saves an `xsave_bytes` extended state (CPUID leaf
/// 0xD's size for the features the OS enabled), calls the function at
/// `function` with `path`, and resumes at `resume`. None when the path
/// does not fit.
pub fn page(function: u64, resume: u64, path: &[u8], xsave_bytes: u32) -> Option<Vec<u8>> {
    if path.contains(&0) || path.len() + 1 > MAX_PATH {
        return None;
    }
    let code = code(xsave_bytes);
    debug_assert!(code.len() <= DATA);
    let mut page = vec![0u8; PAGE];
    page[..code.len()].copy_from_slice(&code);
    page[FUNCTION..FUNCTION + 8].copy_from_slice(&function.to_le_bytes());
    page[RESUME..RESUME + 8].copy_from_slice(&resume.to_le_bytes());
    page[PATH..PATH + path.len()].copy_from_slice(path);
    Some(page)
}

/// The trampoline's instructions (see the module documentation).
fn code(xsave_bytes: u32) -> Vec<u8> {
    let mut code = Code { bytes: Vec::new() };
    // lea rsp, [rsp - 128]: past the red zone, flags untouched.
    code.emit(&[0x48, 0x8D, 0x64, 0x24, 0x80]);
    code.emit(&[0x9C]); // pushfq
    for push in SAVED {
        code.emit(push);
    }
    code.emit(&[0x48, 0x89, 0xE5]); // mov rbp, rsp
                                    // sub rsp, xsave_bytes; and rsp, -64 (xsave's alignment).
    code.emit(&[0x48, 0x81, 0xEC]);
    code.emit(&xsave_bytes.to_le_bytes());
    code.emit(&[0x48, 0x83, 0xE4, 0xC0]);
    // The area's header (bytes 512-575) must be zero but for what xsave
    // writes there, or xrstor faults: the stack holds whatever it held.
    code.emit(&[0x31, 0xC0]); // xor eax, eax
    for offset in (512u32..576).step_by(8) {
        code.emit(&[0x48, 0x89, 0x84, 0x24]); // mov [rsp + offset], rax
        code.emit(&offset.to_le_bytes());
    }
    code.emit(&[0xB8, 0xFF, 0xFF, 0xFF, 0xFF]); // mov eax, -1
    code.emit(&[0xBA, 0xFF, 0xFF, 0xFF, 0xFF]); // mov edx, -1
    code.emit(&[0x48, 0x0F, 0xAE, 0x24, 0x24]); // xsave64 [rsp]
    code.emit(&[0xFC]); // cld, as the calling convention wants
    code.rip_relative(&[0x48, 0x8D, 0x3D], PATH, &[]); // lea rdi, [path]
    code.emit(&[0xBE]); // mov esi, RTLD_NOW
    code.emit(&RTLD_NOW.to_le_bytes());
    code.rip_relative(&[0x48, 0x8B, 0x05], FUNCTION, &[]); // mov rax, [function]
    code.emit(&[0xFF, 0xD0]); // call rax
    code.rip_relative(&[0x48, 0x89, 0x05], RESULT, &[]); // mov [result], rax
    code.rip_relative(&[0xC7, 0x05], DONE_WORD, &DONE.to_le_bytes()); // mov dword [done], DONE
    code.emit(&[0xB8, 0xFF, 0xFF, 0xFF, 0xFF]); // mov eax, -1
    code.emit(&[0xBA, 0xFF, 0xFF, 0xFF, 0xFF]); // mov edx, -1
    code.emit(&[0x48, 0x0F, 0xAE, 0x2C, 0x24]); // xrstor64 [rsp]
    code.emit(&[0x48, 0x89, 0xEC]); // mov rsp, rbp
    for push in SAVED.iter().rev() {
        // pop: the same register, opcode 0x58 + r for 0x50 + r.
        let mut pop = push.to_vec();
        if let Some(last) = pop.last_mut() {
            *last += 8;
        }
        code.emit(&pop);
    }
    code.emit(&[0x9D]); // popfq
                        // lea rsp, [rsp + 128]
    code.emit(&[0x48, 0x8D, 0xA4, 0x24]);
    code.emit(&RED_ZONE.to_le_bytes());
    code.rip_relative(&[0xFF, 0x25], RESUME, &[]); // jmp [resume]
    code.bytes
}

/// The size of the `xsave` area for the extended state this machine's OS
/// enabled (CPUID leaf 0xD, sub-leaf 0, EBX), rounded to 64 bytes; none on
/// a CPU or OS without XSAVE.
pub fn xsave_bytes() -> Option<u32> {
    let features = std::arch::x86_64::__cpuid(1);
    const XSAVE: u32 = 1 << 26;
    const OSXSAVE: u32 = 1 << 27;
    if features.ecx & (XSAVE | OSXSAVE) != XSAVE | OSXSAVE {
        return None;
    }
    // Leaf 0xD exists where XSAVE does.
    let leaf = std::arch::x86_64::__cpuid_count(0xD, 0);
    Some(leaf.ebx.max(576).div_ceil(64) * 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_holds_its_code_before_its_data_and_refuses_paths_that_do_not_fit() {
        let xsave = xsave_bytes().expect("x86-64 Linux has XSAVE");
        let page = page(0x1111, 0x2222, b"/tmp/lib.so", xsave).unwrap();
        assert_eq!(page.len(), PAGE);
        assert_eq!(&page[FUNCTION..FUNCTION + 8], &0x1111u64.to_le_bytes());
        assert_eq!(&page[RESUME..RESUME + 8], &0x2222u64.to_le_bytes());
        assert_eq!(&page[PATH..PATH + 12], b"/tmp/lib.so\0");
        assert_eq!(&page[RESULT..DONE_WORD + 4], &[0; 12]);
        // Ends with `jmp [resume]`, whose displacement reaches it.
        let code_end = code(xsave).len();
        assert_eq!(&page[..code_end], &code(xsave)[..]);
        let jmp = code_end - 6;
        assert_eq!(&page[jmp..jmp + 2], &[0xFF, 0x25]);
        let displacement = i32::from_le_bytes(page[jmp + 2..jmp + 6].try_into().unwrap());
        assert_eq!((code_end as i64 + i64::from(displacement)) as usize, RESUME);
        assert!(super::page(1, 2, &vec![b'x'; MAX_PATH], 1024).is_none());
        assert!(super::page(1, 2, b"a\0b", 1024).is_none());
        assert_eq!(xsave % 64, 0);
    }
}
