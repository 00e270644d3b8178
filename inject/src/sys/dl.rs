//! The dynamic loader: opening libraries (handles are kept for the
//! process's life, so an address taken from one never dangles), looking
//! symbols up and typing them, and this library's own place in the loader.

use std::ffi::{c_int, c_void, CStr, CString};

/// `dlopen` of `name` with `flags`, or the loader's error. The reference
/// the call takes is kept for the process's life.
pub fn open(name: &str, flags: c_int) -> Result<*mut c_void, String> {
    let c_name = CString::new(name).map_err(|_| format!("{name}: NUL in name"))?;
    // SAFETY: a valid C string.
    let handle = unsafe { libc::dlopen(c_name.as_ptr(), flags) };
    if handle.is_null() {
        Err(error_text())
    } else {
        Ok(handle)
    }
}

/// Whether a library of that name is loaded, without loading it (the
/// reference the lookup takes is dropped again).
pub fn is_loaded(name: &str) -> bool {
    open(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD).is_ok_and(|handle| {
        // SAFETY: the handle just returned; only the lookup's reference is
        // dropped, the library stays as it was.
        unsafe { libc::dlclose(handle) };
        true
    })
}

/// The loader's last error, as text.
fn error_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated thread-local string.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: not null, so dlerror's NUL-terminated string.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The address of `name` in the library `handle` (or, for
/// `libc::RTLD_DEFAULT`, in the global scope), if it has one.
pub fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let c_name = CString::new(name).ok()?;
    // SAFETY: a handle from `open` (kept for the process's life) or
    // RTLD_DEFAULT, and a valid C string.
    let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
    (!address.is_null()).then_some(address)
}

/// A function's address as the function pointer type `F`.
///
/// # Safety
/// `address` is a function whose C signature `F` spells out, in a library
/// that stays loaded.
pub unsafe fn function<F: Copy>(address: *mut c_void) -> F {
    const {
        assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>());
    }
    // SAFETY: as the caller promises; the sizes are equal.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) }
}

/// This library's file and load base, from any address inside it.
fn own_object() -> Option<(CString, usize)> {
    // SAFETY: dladdr fills `info` for an address of this library; all-zero
    // is a valid Dl_info.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::dladdr(own_object as *const c_void, &mut info) } == 0
        || info.dli_fname.is_null()
    {
        return None;
    }
    // SAFETY: the loader's NUL-terminated path of this library.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_owned();
    Some((path, info.dli_fbase as usize))
}

/// This library's file, as the loader opened it.
pub fn own_path() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    own_object()
        .map(|(path, _)| std::path::PathBuf::from(std::ffi::OsStr::from_bytes(path.as_bytes())))
}

/// This library's load base (0 when it cannot be told).
pub fn own_base() -> usize {
    own_object().map_or(0, |(_, base)| base)
}

/// Adds this library to the process's global symbol scope (the CUDA driver
/// opens it with local scope), so that its exported names can be found.
/// Names already bound, or found earlier in that scope, stay as they are.
pub fn join_global_scope() {
    if let Some((path, _)) = own_object() {
        // SAFETY: RTLD_NOLOAD only changes the flags of the copy already
        // loaded; the extra reference is kept with the library.
        unsafe {
            libc::dlopen(
                path.as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_GLOBAL,
            )
        };
    }
}
