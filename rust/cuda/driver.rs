//! The CUDA driver API loaded at run time with `libloading`.
//!
//! Three layers, so that later code (module loading, kernel launches) can add
//! symbols on top without touching the probe:
//! - [`DriverLibrary`]: an open shared library that resolves any symbol by
//!   name as a `Result` naming the missing symbol;
//! - [`CudaError`] and [`check`]: a `CUresult` turned into an error carrying
//!   the call, the CUDA error name and its number;
//! - [`Driver`]: the handful of entry points the probe needs, each wrapped in a
//!   thin function that returns `Result`.
//!
//! Nothing here panics: a missing library, a missing symbol or a failing call
//! is always a value the caller can report.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;

use crate::error::{CoreError, CoreResult};

/// `CUresult`: 0 is success, anything else an error code.
pub type CuResult = c_int;
/// `CUdevice`: an ordinal handle.
pub type CuDevice = c_int;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// Bytes offered to `cuDeviceGetName`; the driver may fill all of them
/// without a terminating NUL, so the name is read with an explicit bound.
pub const DEVICE_NAME_CAPACITY: usize = 256;

/// Library names tried, in order, when `FASTLLM_LIBCUDA` is not set.
/// `os` is `std::env::consts::OS`; macOS has no CUDA driver at all.
pub fn candidate_names(os: &str) -> &'static [&'static str] {
    match os {
        "windows" => &["nvcuda.dll"],
        "macos" | "ios" => &[],
        _ => &["libcuda.so.1", "libcuda.so"],
    }
}

/// Names of the error codes a probe is likely to meet, used only when the
/// driver cannot name a code itself (`cuGetErrorName` missing or failing).
pub fn fallback_error_name(code: CuResult) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        102 => "CUDA_ERROR_DEVICE_NOT_LICENSED",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// A failed driver call: which call, the driver's name for the code, the code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError {
    /// The driver entry point that failed, e.g. `cuInit`.
    pub call: String,
    /// The code's name (`CUDA_ERROR_NO_DEVICE`), if it could be found.
    pub name: Option<String>,
    /// The raw `CUresult`.
    pub code: CuResult,
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{} failed: {} ({})", self.call, name, self.code),
            None => write!(
                f,
                "{} failed: unknown CUDA error ({})",
                self.call, self.code
            ),
        }
    }
}

impl From<CudaError> for CoreError {
    fn from(err: CudaError) -> CoreError {
        CoreError::Cuda(err.to_string())
    }
}

/// An open driver library. Symbols are resolved on demand, each lookup a
/// `Result` whose error names the symbol and the library.
pub struct DriverLibrary {
    lib: libloading::Library,
    path: String,
}

impl DriverLibrary {
    /// Opens one library by file name or path.
    ///
    /// Loading runs the library's initialisers: callers that cannot trust
    /// the library (the probe) do this in a child process.
    pub fn open(path: &str) -> CoreResult<DriverLibrary> {
        // SAFETY: loading a library runs its constructors; that risk is what
        // the isolated probe child exists to absorb.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => Ok(DriverLibrary {
                lib,
                path: path.to_string(),
            }),
            Err(e) => Err(CoreError::Cuda(format!(
                "cannot load {path}: {}",
                loader_message(&e)
            ))),
        }
    }

    /// Opens the first library of `names` that loads; the error lists every
    /// attempt.
    pub fn open_first(names: &[&str]) -> CoreResult<DriverLibrary> {
        if names.is_empty() {
            return Err(CoreError::Cuda(
                "there is no CUDA driver library on this platform".into(),
            ));
        }
        let mut failures = Vec::new();
        for name in names {
            match DriverLibrary::open(name) {
                Ok(lib) => return Ok(lib),
                Err(e) => failures.push(e.to_string()),
            }
        }
        Err(CoreError::Cuda(failures.join("; ")))
    }

    /// The name or path the library was opened with.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Resolves `name` as a value of type `T` (a function pointer type).
    ///
    /// # Safety
    /// `T` must be the exact C type of the symbol; calling a pointer of the
    /// wrong signature is undefined behaviour.
    pub unsafe fn symbol<T: Copy>(&self, name: &str) -> CoreResult<T> {
        match self.lib.get::<T>(name) {
            Ok(sym) => Ok(*sym),
            Err(e) => Err(CoreError::Cuda(format!(
                "{} has no symbol {name} ({}): it is not a usable CUDA driver",
                self.path,
                loader_message(&e)
            ))),
        }
    }

    /// The file the dynamic loader actually mapped for this library (found
    /// from the address of `symbol`), or the name it was opened with.
    pub fn resolved_path(&self, symbol: *const c_void) -> String {
        resolve_file_of(symbol).unwrap_or_else(|| self.path.clone())
    }
}

/// The dynamic loader's own words (`dlerror`), which libloading keeps as the
/// error's source, or its summary when there is none.
fn loader_message(err: &libloading::Error) -> String {
    use std::error::Error;
    match err.source() {
        Some(source) => source.to_string(),
        None => err.to_string(),
    }
}

#[cfg(unix)]
pub(crate) fn resolve_file_of(addr: *const c_void) -> Option<String> {
    if addr.is_null() {
        return None;
    }
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(not(unix))]
pub(crate) fn resolve_file_of(_addr: *const c_void) -> Option<String> {
    None
}

type FnInit = unsafe extern "C" fn(c_uint) -> CuResult;
type FnDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type FnDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult;
type FnDeviceTotalMem = unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult;
type FnDeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult;
type FnGetErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The driver entry points the probe uses, resolved once.
pub struct Driver {
    lib: DriverLibrary,
    cu_init: FnInit,
    cu_driver_get_version: FnDriverGetVersion,
    cu_device_get_count: FnDeviceGetCount,
    cu_device_get: FnDeviceGet,
    cu_device_get_name: FnDeviceGetName,
    cu_device_total_mem: FnDeviceTotalMem,
    cu_device_get_attribute: FnDeviceGetAttribute,
    // Optional: without it errors are named from a small built-in table.
    cu_get_error_name: Option<FnGetErrorName>,
}

impl Driver {
    /// Resolves the probe's symbols from an open library; the first missing
    /// one is the error.
    pub fn new(lib: DriverLibrary) -> CoreResult<Driver> {
        // SAFETY: each type alias is the documented C signature of the symbol.
        unsafe {
            Ok(Driver {
                cu_init: lib.symbol("cuInit")?,
                cu_driver_get_version: lib.symbol("cuDriverGetVersion")?,
                cu_device_get_count: lib.symbol("cuDeviceGetCount")?,
                cu_device_get: lib.symbol("cuDeviceGet")?,
                cu_device_get_name: lib.symbol("cuDeviceGetName")?,
                cu_device_total_mem: lib.symbol("cuDeviceTotalMem_v2")?,
                cu_device_get_attribute: lib.symbol("cuDeviceGetAttribute")?,
                cu_get_error_name: lib.symbol("cuGetErrorName").ok(),
                lib,
            })
        }
    }

    /// The library the entry points come from; later code resolves further
    /// symbols through it.
    pub fn library(&self) -> &DriverLibrary {
        &self.lib
    }

    /// The file that was actually mapped (a full path even when the library
    /// was opened by bare name).
    pub fn library_path(&self) -> String {
        self.lib.resolved_path(self.cu_init as *const c_void)
    }

    /// Turns a `CUresult` into `Ok(())` or a [`CudaError`] naming `call`.
    pub fn check(&self, call: &str, code: CuResult) -> Result<(), CudaError> {
        check(call, code, |c| self.error_name(c))
    }

    /// The driver's name for an error code, falling back to a built-in table.
    pub fn error_name(&self, code: CuResult) -> Option<String> {
        if let Some(get_name) = self.cu_get_error_name {
            let mut ptr: *const c_char = std::ptr::null();
            // SAFETY: cuGetErrorName writes a pointer to a static string.
            let rc = unsafe { get_name(code, &mut ptr) };
            if rc == 0 && !ptr.is_null() {
                // SAFETY: the driver returns a NUL-terminated static string.
                let name = unsafe { CStr::from_ptr(ptr) };
                return Some(name.to_string_lossy().into_owned());
            }
        }
        fallback_error_name(code).map(str::to_string)
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> Result<(), CudaError> {
        // SAFETY: plain FFI call with a flags value of 0.
        let rc = unsafe { (self.cu_init)(0) };
        self.check("cuInit", rc)
    }

    /// `cuDriverGetVersion`: e.g. 12040 for CUDA 12.4.
    pub fn driver_version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.cu_driver_get_version)(&mut v) };
        self.check("cuDriverGetVersion", rc).map(|_| v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.cu_device_get_count)(&mut n) };
        self.check("cuDeviceGetCount", rc).map(|_| n)
    }

    /// `cuDeviceGet`: the handle of device `ordinal`.
    pub fn device(&self, ordinal: i32) -> Result<CuDevice, CudaError> {
        let mut dev: CuDevice = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.cu_device_get)(&mut dev, ordinal) };
        self.check("cuDeviceGet", rc).map(|_| dev)
    }

    /// `cuDeviceGetName`, read within the buffer even without a NUL.
    pub fn device_name(&self, dev: CuDevice) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; DEVICE_NAME_CAPACITY];
        // SAFETY: the driver writes at most `len` bytes into `buf`.
        let rc = unsafe {
            (self.cu_device_get_name)(buf.as_mut_ptr(), DEVICE_NAME_CAPACITY as c_int, dev)
        };
        self.check("cuDeviceGetName", rc)?;
        let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
        Ok(name_from_buffer(&bytes))
    }

    /// `cuDeviceTotalMem_v2`, in bytes.
    pub fn total_memory(&self, dev: CuDevice) -> Result<u64, CudaError> {
        let mut bytes: usize = 0;
        // SAFETY: writes one size_t.
        let rc = unsafe { (self.cu_device_total_mem)(&mut bytes, dev) };
        self.check("cuDeviceTotalMem_v2", rc).map(|_| bytes as u64)
    }

    /// `cuDeviceGetAttribute`.
    pub fn attribute(&self, attr: c_int, dev: CuDevice) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.cu_device_get_attribute)(&mut v, attr, dev) };
        self.check("cuDeviceGetAttribute", rc).map(|_| v)
    }

    /// The compute capability `(major, minor)`.
    pub fn compute_capability(&self, dev: CuDevice) -> Result<(i32, i32), CudaError> {
        let major = self.attribute(ATTR_COMPUTE_CAPABILITY_MAJOR, dev)?;
        let minor = self.attribute(ATTR_COMPUTE_CAPABILITY_MINOR, dev)?;
        Ok((major, minor))
    }
}

/// Turns a `CUresult` into `Ok(())` or a [`CudaError`]; `name_of` names codes.
pub fn check(
    call: &str,
    code: CuResult,
    name_of: impl FnOnce(CuResult) -> Option<String>,
) -> Result<(), CudaError> {
    if code == 0 {
        return Ok(());
    }
    Err(CudaError {
        call: call.to_string(),
        name: name_of(code),
        code,
    })
}

/// A C string read from a fixed buffer: up to the first NUL, or the whole
/// buffer when there is none; invalid UTF-8 is replaced, not trusted.
pub fn name_from_buffer(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_names_per_platform() {
        assert_eq!(candidate_names("linux"), ["libcuda.so.1", "libcuda.so"]);
        assert_eq!(candidate_names("windows"), ["nvcuda.dll"]);
        assert!(candidate_names("macos").is_empty());
    }

    #[test]
    fn errors_carry_call_name_and_number() {
        let err = check("cuInit", 100, |_| Some("CUDA_ERROR_NO_DEVICE".into())).unwrap_err();
        assert_eq!(err.to_string(), "cuInit failed: CUDA_ERROR_NO_DEVICE (100)");
        let err = check("cuDeviceGet", 12345, |_| None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cuDeviceGet failed: unknown CUDA error (12345)"
        );
        assert!(check("cuInit", 0, |_| None).is_ok());
        let core: CoreError = err.into();
        assert!(matches!(core, CoreError::Cuda(m) if m.contains("12345")));
    }

    #[test]
    fn fallback_names_cover_common_codes() {
        assert_eq!(fallback_error_name(100), Some("CUDA_ERROR_NO_DEVICE"));
        assert_eq!(
            fallback_error_name(35),
            Some("CUDA_ERROR_INSUFFICIENT_DRIVER")
        );
        assert_eq!(fallback_error_name(-7), None);
    }

    #[test]
    fn names_without_nul_are_bounded() {
        assert_eq!(name_from_buffer(b"H200\0garbage"), "H200");
        assert_eq!(name_from_buffer(b"ABCD"), "ABCD");
        assert_eq!(name_from_buffer(b""), "");
        assert_eq!(name_from_buffer(&[0x41, 0xff, 0x42]), "A\u{fffd}B");
    }

    #[test]
    fn missing_library_is_an_error_naming_it() {
        let err = match DriverLibrary::open("/nonexistent/libcuda-fastllm-test.so") {
            Ok(_) => panic!("a missing library loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("/nonexistent/libcuda-fastllm-test.so"),
            "{err}"
        );
        let err = match DriverLibrary::open_first(&[]) {
            Ok(_) => panic!("an empty candidate list loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("no CUDA driver library"), "{err}");
    }
}
