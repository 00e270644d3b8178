//! The TPU backend: a shim over libtpu's PJRT profiler extension.
//!
//! libtpu is loaded with `dlopen`; `GetPjrtApi` gives the PJRT API, whose
//! extension chain holds the profiler extension (type 1) and through it
//! `PLUGIN_Profiler_Api` (create, start, stop, collect_data, destroy and the
//! error accessors). A capture creates a profiler with the request's
//! serialized `ProfileOptions`, starts it for the window, stops it, collects
//! the XSpace libtpu recorded and merges its planes (`/device:TPU:n`, ...)
//! into the agent's trace.
//!
//! libtpu serves only the process that owns the TPU. Use this backend when
//! the agent owns it (a profiling host, or a job that runs inside the agent's
//! process); when a JAX or TensorFlow workload owns the TPU, start that
//! workload's profiler server (`jax.profiler.start_server(9999)`) and give
//! the agent `--upstream grpc://127.0.0.1:9999` instead.

use std::ffi::{c_char, c_int, c_void, OsString};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{
    Backend, BackendContext, BackendError, Capabilities, CaptureEnd, Health, SessionSource,
};
use crate::recorder::Window;

/// Where libtpu is looked for when no path is given.
pub const DEFAULT_LIBRARY: &str = "libtpu.so";
/// `PJRT_Extension_Type` of the profiler extension.
const PROFILER_EXTENSION: c_int = 1;
/// `PLUGIN_Profiler_Api` of PLUGIN_PROFILER_VERSION 1 is this long; newer
/// ones append functions.
const PROFILER_API_SIZE: usize = 80;

#[repr(C)]
struct ExtensionBase {
    struct_size: usize,
    kind: c_int,
    next: *const ExtensionBase,
}

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *const ExtensionBase,
    major: c_int,
    minor: c_int,
}

/// The head of `PJRT_Api`; the shim reads nothing past it.
#[repr(C)]
struct PjrtApiHead {
    struct_size: usize,
    extension_start: *const ExtensionBase,
    version: ApiVersion,
}

#[repr(C)]
struct ProfilerExtension {
    base: ExtensionBase,
    profiler_api: *const ProfilerApi,
    traceme_context_id: i64,
}

/// Opaque plugin types.
#[repr(C)]
struct PluginError {
    _private: [u8; 0],
}
#[repr(C)]
struct PluginProfiler {
    _private: [u8; 0],
}

#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    private: *mut c_void,
    error: *mut PluginError,
}
#[repr(C)]
struct ErrorMessageArgs {
    struct_size: usize,
    private: *mut c_void,
    error: *const PluginError,
    message: *const c_char,
    message_size: usize,
}
#[repr(C)]
struct CreateArgs {
    struct_size: usize,
    options: *const c_char,
    options_size: usize,
    profiler: *mut PluginProfiler,
}
#[repr(C)]
struct ProfilerArgs {
    struct_size: usize,
    profiler: *mut PluginProfiler,
}
#[repr(C)]
struct CollectDataArgs {
    struct_size: usize,
    profiler: *mut PluginProfiler,
    buffer: *mut u8,
    buffer_size_in_bytes: usize,
}

type ErrorFn<A> = unsafe extern "C" fn(*mut A) -> *mut PluginError;

#[repr(C)]
struct ProfilerApi {
    struct_size: usize,
    private: *mut c_void,
    error_destroy: unsafe extern "C" fn(*mut ErrorDestroyArgs),
    error_message: unsafe extern "C" fn(*mut ErrorMessageArgs),
    error_get_code: *const c_void,
    create: ErrorFn<CreateArgs>,
    destroy: ErrorFn<ProfilerArgs>,
    start: ErrorFn<ProfilerArgs>,
    stop: ErrorFn<ProfilerArgs>,
    collect_data: ErrorFn<CollectDataArgs>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TpuError {
    #[error("cannot load libtpu from {library:?}: {reason}")]
    Load { library: OsString, reason: String },
    #[error("libtpu at {0:?} exports no GetPjrtApi")]
    NoPjrtApi(OsString),
    #[error("libtpu's PJRT API has no profiler extension")]
    NoProfilerExtension,
    #[error("libtpu's profiler API is {0} bytes, smaller than version 1 ({PROFILER_API_SIZE})")]
    OldProfilerApi(usize),
    #[error("libtpu profiler {step} failed: {message}")]
    Call { step: &'static str, message: String },
    #[error("libtpu returned data that is not an XSpace")]
    NotXSpace,
}

/// A loaded libtpu and its profiler API. The library stays loaded for the
/// life of this value, so the API pointer stays valid.
pub struct TpuProfiler {
    _library: libloading::Library,
    api: *const ProfilerApi,
    /// libtpu runs one profiler session at a time.
    busy: Mutex<()>,
}

// SAFETY: the API is a table of functions that libtpu documents as callable
// from any thread; one session at a time is enforced by `busy`.
unsafe impl Send for TpuProfiler {}
unsafe impl Sync for TpuProfiler {}

impl TpuProfiler {
    /// Loads libtpu and finds its profiler extension.
    pub fn load(library: &OsString) -> Result<TpuProfiler, TpuError> {
        // SAFETY: loading a library runs its initialisers; libtpu's are
        // meant to be run by any process that uses it.
        let lib = unsafe { libloading::Library::new(library) }.map_err(|e| TpuError::Load {
            library: library.clone(),
            reason: e.to_string(),
        })?;
        // SAFETY: the symbol's type is PJRT's `const PJRT_Api* GetPjrtApi(void)`.
        let get_api =
            unsafe { lib.get::<unsafe extern "C" fn() -> *const PjrtApiHead>(b"GetPjrtApi\0") }
                .map_err(|_| TpuError::NoPjrtApi(library.clone()))?;
        // SAFETY: calling GetPjrtApi has no preconditions.
        let api = unsafe { get_api() };
        if api.is_null() {
            return Err(TpuError::NoProfilerExtension);
        }
        // SAFETY: `api` points at a PJRT_Api, whose head is PjrtApiHead; the
        // extension chain is a linked list of PJRT_Extension_Base nodes.
        let mut node = unsafe { (*api).extension_start };
        while !node.is_null() {
            // SAFETY: as above.
            let base = unsafe { &*node };
            if base.kind == PROFILER_EXTENSION
                && base.struct_size >= std::mem::size_of::<ProfilerExtension>()
            {
                // SAFETY: a node of type Profiler is a PJRT_Profiler_Extension.
                let profiler_api = unsafe { (*(node as *const ProfilerExtension)).profiler_api };
                if profiler_api.is_null() {
                    return Err(TpuError::NoProfilerExtension);
                }
                // SAFETY: points at libtpu's static PLUGIN_Profiler_Api.
                let size = unsafe { (*profiler_api).struct_size };
                if size < PROFILER_API_SIZE {
                    return Err(TpuError::OldProfilerApi(size));
                }
                return Ok(TpuProfiler {
                    _library: lib,
                    api: profiler_api,
                    busy: Mutex::new(()),
                });
            }
            node = base.next;
        }
        Err(TpuError::NoProfilerExtension)
    }

    fn api(&self) -> &ProfilerApi {
        // SAFETY: checked non-null and large enough in `load`; lives as long
        // as the library.
        unsafe { &*self.api }
    }

    /// Turns a returned error into a message and frees it.
    fn check(&self, step: &'static str, error: *mut PluginError) -> Result<(), TpuError> {
        if error.is_null() {
            return Ok(());
        }
        let mut args = ErrorMessageArgs {
            struct_size: std::mem::size_of::<ErrorMessageArgs>(),
            private: std::ptr::null_mut(),
            error,
            message: std::ptr::null(),
            message_size: 0,
        };
        // SAFETY: `error` came from this API and is freed only below.
        unsafe { (self.api().error_message)(&mut args) };
        let message = if args.message.is_null() {
            "(no message)".to_string()
        } else {
            // SAFETY: the message lives as long as the error.
            let bytes =
                unsafe { std::slice::from_raw_parts(args.message.cast::<u8>(), args.message_size) };
            String::from_utf8_lossy(bytes).into_owned()
        };
        let mut destroy = ErrorDestroyArgs {
            struct_size: std::mem::size_of::<ErrorDestroyArgs>(),
            private: std::ptr::null_mut(),
            error,
        };
        // SAFETY: as above; the error is not used again.
        unsafe { (self.api().error_destroy)(&mut destroy) };
        Err(TpuError::Call { step, message })
    }

    /// Runs one profiling session: create with `options` (serialized
    /// `ProfileOptions`), start, wait with `during`, stop, collect. Returns
    /// the XSpace bytes libtpu recorded.
    pub fn profile(&self, options: &[u8], during: impl FnOnce()) -> Result<Vec<u8>, TpuError> {
        let _one_at_a_time = self.busy.lock();
        let api = self.api();
        let mut create = CreateArgs {
            struct_size: std::mem::size_of::<CreateArgs>(),
            options: options.as_ptr().cast(),
            options_size: options.len(),
            profiler: std::ptr::null_mut(),
        };
        // SAFETY: the args follow PLUGIN_Profiler_Create_Args; `options`
        // outlives the call.
        self.check("create", unsafe { (api.create)(&mut create) })?;
        let mut session = ProfilerArgs {
            struct_size: std::mem::size_of::<ProfilerArgs>(),
            profiler: create.profiler,
        };
        let result = (|| {
            // SAFETY: `profiler` was created above and is destroyed below.
            self.check("start", unsafe { (api.start)(&mut session) })?;
            during();
            // SAFETY: as above.
            self.check("stop", unsafe { (api.stop)(&mut session) })?;
            let mut collect = CollectDataArgs {
                struct_size: std::mem::size_of::<CollectDataArgs>(),
                profiler: create.profiler,
                buffer: std::ptr::null_mut(),
                buffer_size_in_bytes: 0,
            };
            // One call with no buffer: libtpu serialises into a buffer of its
            // own and returns it (valid until the next collect or destroy).
            // SAFETY: as above.
            self.check("collect_data", unsafe { (api.collect_data)(&mut collect) })?;
            if collect.buffer.is_null() {
                return Ok(Vec::new());
            }
            // SAFETY: libtpu owns `size` bytes at `buffer` until destroy.
            let bytes =
                unsafe { std::slice::from_raw_parts(collect.buffer, collect.buffer_size_in_bytes) };
            Ok(bytes.to_vec())
        })();
        // SAFETY: destroying the profiler created above, once.
        let destroyed = self.check("destroy", unsafe { (api.destroy)(&mut session) });
        let bytes = result?;
        destroyed?;
        Ok(bytes)
    }
}

/// Decodes libtpu's XSpace, tolerating the trailing NUL byte some versions add.
pub fn decode_xspace(bytes: &[u8]) -> Result<crate::proto::tensorflow::profiler::XSpace, TpuError> {
    use crate::proto::tensorflow::profiler::XSpace;
    use prost::Message;
    XSpace::decode(bytes).or_else(|_| match bytes.split_last() {
        Some((0, rest)) => XSpace::decode(rest).map_err(|_| TpuError::NotXSpace),
        _ => Err(TpuError::NotXSpace),
    })
}

#[derive(Clone, Debug)]
pub struct TpuConfig {
    pub library: OsString,
}

impl Default for TpuConfig {
    fn default() -> Self {
        TpuConfig {
            library: std::env::var_os("TPU_LIBRARY_PATH").unwrap_or_else(|| DEFAULT_LIBRARY.into()),
        }
    }
}

/// See the module documentation.
pub struct TpuBackend {
    config: TpuConfig,
    profiler: Option<Arc<TpuProfiler>>,
}

impl TpuBackend {
    pub fn new(config: TpuConfig) -> TpuBackend {
        TpuBackend {
            config,
            profiler: None,
        }
    }
}

impl Backend for TpuBackend {
    fn name(&self) -> &'static str {
        "tpu"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: vec!["TPU activity from libtpu's profiler (per capture)"],
            max_delay: std::time::Duration::ZERO,
            held_until_asked: std::time::Duration::ZERO,
        }
    }

    fn start(&mut self, _context: BackendContext) -> Result<(), BackendError> {
        let profiler =
            TpuProfiler::load(&self.config.library).map_err(|e| BackendError::Unavailable {
                backend: "tpu",
                reason: e.to_string(),
            })?;
        self.profiler = Some(Arc::new(profiler));
        Ok(())
    }

    fn stop(&mut self) {
        self.profiler = None;
    }

    fn health(&self) -> Health {
        match &self.profiler {
            Some(_) => Health::Running {
                detail: format!(
                    "libtpu profiler from {:?}, one session per capture",
                    self.config.library
                ),
            },
            None => Health::Stopped,
        }
    }

    fn session_source(&self) -> Option<Arc<dyn SessionSource>> {
        self.profiler.clone().map(|p| p as Arc<dyn SessionSource>)
    }
}

impl SessionSource for TpuProfiler {
    fn name(&self) -> &'static str {
        "libtpu"
    }

    fn capture(&self, window: Window, options: &[u8], end: &CaptureEnd) -> Result<Vec<u8>, String> {
        // libtpu records from when its session starts: start it with the
        // window, not before.
        if end.sleep_until(window.start_ns) {
            return Err("the capture ended before its window started".into());
        }
        let bytes = self
            .profile(options, || end.wait())
            .map_err(|e| e.to_string())?;
        let space = decode_xspace(&bytes).map_err(|e| e.to_string())?;
        use prost::Message;
        Ok(space.encode_to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::profiler::{XPlane, XSpace};
    use prost::Message;

    #[test]
    fn a_trailing_nul_byte_is_tolerated_and_garbage_is_refused() {
        let space = XSpace {
            planes: vec![XPlane {
                id: 0,
                name: "/device:TPU:0".into(),
                ..XPlane::default()
            }],
            ..XSpace::default()
        };
        let mut bytes = space.encode_to_vec();
        assert_eq!(decode_xspace(&bytes), Ok(space.clone()));
        bytes.push(0);
        assert_eq!(decode_xspace(&bytes), Ok(space));
        assert_eq!(decode_xspace(&[0xff, 0xff, 0xff]), Err(TpuError::NotXSpace));
    }
}
