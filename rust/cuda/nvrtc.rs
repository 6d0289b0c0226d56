//! NVRTC, the CUDA run-time compiler, loaded with `libloading`.
//!
//! Nothing CUDA is linked at build time: libnvrtc is searched, in order, at
//! `FASTLLM_NVRTC` (a file or a folder), in the CUDA toolkit's usual places
//! (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`), under the dynamic loader's
//! names (`libnvrtc.so.13`, `.so.12`, `libnvrtc.so`), and finally in the
//! folders of the `nvidia-cuda-nvrtc` wheel, which the Python side finds with
//! importlib and passes in. A missing NVRTC is an error that says which
//! package to install; a failed compilation carries NVRTC's log.
//!
//! Compiled images are cached on disk (`FASTLLM_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/fastllm/kernels`, else `~/.cache/fastllm/kernels`), keyed
//! by a hash of the sources and options, the architecture, the output kind
//! and the NVRTC version. A cache that cannot be read or written is skipped.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{CoreError, CoreResult};

/// What to install when no NVRTC is found.
pub const INSTALL_HINT: &str = "install it with `pip install nvidia-cuda-nvrtc` (or a CUDA \
     toolkit), or set FASTLLM_NVRTC to the path of libnvrtc";

type NvrtcResult = c_int;
type Program = *mut c_void;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type FnCreate = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type FnDestroy = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
type FnCompile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
type FnSize = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
type FnGet = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
type FnErrorString = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// What NVRTC should produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX for a virtual architecture (`compute_XY`), JIT-compiled by the driver.
    Ptx,
    /// A CUBIN for one real architecture (`sm_XY`), loaded as is.
    Cubin,
}

impl Output {
    fn extension(self) -> &'static str {
        match self {
            Output::Ptx => "ptx",
            Output::Cubin => "cubin",
        }
    }
}

/// A compute capability as NVRTC spells it: `"sm_90"`, `"compute_80"` or `"90"`.
pub fn parse_arch(arch: &str) -> CoreResult<u32> {
    let digits = arch
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_");
    match digits.parse::<u32>() {
        Ok(v) if (30..=1300).contains(&v) => Ok(v),
        _ => Err(CoreError::invalid(format!(
            "arch: expected a compute capability such as 'sm_90', 'compute_80' or '90', got {arch:?}"
        ))),
    }
}

/// An open libnvrtc with the entry points fastllm uses.
pub struct Nvrtc {
    _lib: libloading::Library,
    path: String,
    version: (i32, i32),
    create: FnCreate,
    destroy: FnDestroy,
    compile: FnCompile,
    log_size: FnSize,
    log: FnGet,
    ptx_size: FnSize,
    ptx: FnGet,
    cubin_size: Option<FnSize>,
    cubin: Option<FnGet>,
    error_string: Option<FnErrorString>,
}

impl Nvrtc {
    /// Opens one library file and resolves its symbols.
    pub fn open(path: &str) -> CoreResult<Nvrtc> {
        // SAFETY: loading runs the library's initialisers; NVRTC's are benign
        // (it needs no GPU and touches no driver).
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| CoreError::Cuda(format!("cannot load {path}: {}", loader_message(&e))))?;
        // SAFETY: each alias is the documented C signature of the symbol.
        unsafe {
            let version: FnVersion = symbol(&lib, path, "nvrtcVersion")?;
            // Opened by a bare name, the loader may pick any file (or one
            // already mapped, e.g. by torch): report the file actually used.
            let resolved = super::driver::resolve_file_of(version as *const c_void)
                .unwrap_or_else(|| path.to_string());
            let nvrtc = Nvrtc {
                path: resolved,
                version: (0, 0),
                create: symbol(&lib, path, "nvrtcCreateProgram")?,
                destroy: symbol(&lib, path, "nvrtcDestroyProgram")?,
                compile: symbol(&lib, path, "nvrtcCompileProgram")?,
                log_size: symbol(&lib, path, "nvrtcGetProgramLogSize")?,
                log: symbol(&lib, path, "nvrtcGetProgramLog")?,
                ptx_size: symbol(&lib, path, "nvrtcGetPTXSize")?,
                ptx: symbol(&lib, path, "nvrtcGetPTX")?,
                cubin_size: symbol(&lib, path, "nvrtcGetCUBINSize").ok(),
                cubin: symbol(&lib, path, "nvrtcGetCUBIN").ok(),
                error_string: symbol(&lib, path, "nvrtcGetErrorString").ok(),
                _lib: lib,
            };
            let (mut major, mut minor) = (0, 0);
            nvrtc.check("nvrtcVersion", version(&mut major, &mut minor))?;
            Ok(Nvrtc {
                version: (major, minor),
                ..nvrtc
            })
        }
    }

    /// The file the library was loaded from (resolved through the loader).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `(major, minor)`, e.g. `(13, 2)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    fn check(&self, call: &str, rc: NvrtcResult) -> CoreResult<()> {
        if rc == 0 {
            return Ok(());
        }
        let name = self
            .error_string
            // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
            .map(|f| unsafe { f(rc) })
            .filter(|p| !p.is_null())
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_else(|| "unknown NVRTC error".into());
        Err(CoreError::Cuda(format!("{call} failed: {name} ({rc})")))
    }

    /// Compiles `source` (named `name` in diagnostics, with `headers` as
    /// `(include name, contents)`) for compute capability `arch` (e.g. 90).
    /// A failed compilation is an error carrying NVRTC's log.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        headers: &[(&str, &str)],
        arch: u32,
        output: Output,
        extra_options: &[&str],
    ) -> CoreResult<Vec<u8>> {
        let cstr = |s: &str, what: &str| {
            CString::new(s).map_err(|_| CoreError::invalid(format!("{what} contains a NUL byte")))
        };
        let src = cstr(source, "source")?;
        let cname = cstr(name, "name")?;
        let header_src: Vec<CString> = headers
            .iter()
            .map(|(_, s)| cstr(s, "a header"))
            .collect::<CoreResult<_>>()?;
        let header_names: Vec<CString> = headers
            .iter()
            .map(|(n, _)| cstr(n, "a header name"))
            .collect::<CoreResult<_>>()?;
        let header_src_ptrs: Vec<*const c_char> = header_src.iter().map(|s| s.as_ptr()).collect();
        let header_name_ptrs: Vec<*const c_char> =
            header_names.iter().map(|s| s.as_ptr()).collect();
        let arch_flag = match output {
            Output::Ptx => format!("--gpu-architecture=compute_{arch}"),
            Output::Cubin => format!("--gpu-architecture=sm_{arch}"),
        };
        let mut options = vec![cstr(&arch_flag, "arch")?, cstr("--std=c++17", "option")?];
        for o in extra_options {
            options.push(cstr(o, "option")?);
        }
        let option_ptrs: Vec<*const c_char> = options.iter().map(|s| s.as_ptr()).collect();

        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer stays alive for the call; counts match the arrays.
        let rc = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                headers.len() as c_int,
                header_src_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            )
        };
        self.check("nvrtcCreateProgram", rc)?;
        let result = self.compile_program(prog, name, arch, output, &option_ptrs);
        // SAFETY: `prog` was created above and is destroyed exactly once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn compile_program(
        &self,
        prog: Program,
        name: &str,
        arch: u32,
        output: Output,
        options: &[*const c_char],
    ) -> CoreResult<Vec<u8>> {
        // SAFETY: `prog` is a live program; the options outlive the call.
        let rc = unsafe { (self.compile)(prog, options.len() as c_int, options.as_ptr()) };
        if rc != 0 {
            let log = self.read(prog, self.log_size, self.log).unwrap_or_default();
            let log = String::from_utf8_lossy(&log);
            let err = self
                .check("nvrtcCompileProgram", rc)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(CoreError::Cuda(format!(
                "compiling {name} for sm_{arch} with NVRTC {}.{} ({}): {err}\n{}",
                self.version.0,
                self.version.1,
                self.path,
                log.trim_end_matches('\0').trim()
            )));
        }
        match output {
            Output::Ptx => self.read(prog, self.ptx_size, self.ptx),
            Output::Cubin => match (self.cubin_size, self.cubin) {
                (Some(size), Some(get)) => self.read(prog, size, get),
                _ => Err(CoreError::Cuda(format!(
                    "{} has no nvrtcGetCUBIN: NVRTC {}.{} is too old to produce CUBINs",
                    self.path, self.version.0, self.version.1
                ))),
            },
        }
    }

    fn read(&self, prog: Program, size: FnSize, get: FnGet) -> CoreResult<Vec<u8>> {
        let mut n: usize = 0;
        // SAFETY: writes one size_t.
        self.check("nvrtcGet*Size", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: `buf` has exactly the size NVRTC reported.
            self.check("nvrtcGet*", unsafe {
                get(prog, buf.as_mut_ptr() as *mut c_char)
            })?;
        }
        // PTX and logs end with a NUL that is not part of the text.
        if buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(buf)
    }
}

// SAFETY: the function pointers are plain C entry points; NVRTC documents its
// API as thread safe for distinct programs.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

unsafe fn symbol<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> CoreResult<T> {
    match lib.get::<T>(name) {
        Ok(sym) => Ok(*sym),
        Err(e) => Err(CoreError::Cuda(format!(
            "{path} has no symbol {name} ({}): it is not a usable NVRTC",
            loader_message(&e)
        ))),
    }
}

fn loader_message(err: &libloading::Error) -> String {
    use std::error::Error;
    match err.source() {
        Some(source) => source.to_string(),
        None => err.to_string(),
    }
}

/// The libnvrtc files in `dir`, newest version first (`libnvrtc.so.13`
/// before `libnvrtc.so.12`; `libnvrtc-builtins` excluded).
pub fn libraries_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(Vec<u32>, String)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name
                .strip_prefix("libnvrtc.so")
                .or_else(|| name.strip_prefix("nvrtc64_").map(|_| ""))?;
            let version: Vec<u32> = rest
                .split('.')
                .filter(|p| !p.is_empty())
                .map(|p| p.parse().unwrap_or(0))
                .collect();
            Some((version, e.path().to_string_lossy().into_owned()))
        })
        .collect();
    found.sort_by(|a, b| b.cmp(a));
    found.into_iter().map(|(_, p)| p).collect()
}

/// Where to look for libnvrtc, in order. `explicit` is `FASTLLM_NVRTC` (or a
/// caller's path): a file is used as is, a folder is searched. When it is
/// given, nothing else is tried, so a wrong setting is reported, not hidden.
pub fn candidates(
    explicit: Option<&str>,
    cuda_home: Option<&str>,
    wheel_dirs: &[String],
) -> Vec<String> {
    if let Some(p) = explicit.filter(|p| !p.trim().is_empty()) {
        let path = Path::new(p);
        if path.is_dir() {
            return libraries_in(path);
        }
        return vec![p.to_string()];
    }
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(home) = cuda_home.filter(|h| !h.trim().is_empty()) {
        dirs.push(Path::new(home).join("lib64"));
        dirs.push(Path::new(home).join("lib"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for d in &dirs {
        out.extend(libraries_in(d));
    }
    if cfg!(windows) {
        out.extend(["nvrtc64_130_0.dll", "nvrtc64_120_0.dll"].map(String::from));
    } else {
        out.extend(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"].map(String::from));
    }
    for d in wheel_dirs {
        out.extend(libraries_in(Path::new(d)));
    }
    out
}

/// Opens the first candidate that loads; the error lists every attempt and
/// says what to install.
pub fn open_first(candidates: &[String], explicit: Option<&str>) -> CoreResult<Nvrtc> {
    let mut failures = Vec::new();
    for c in candidates {
        match Nvrtc::open(c) {
            Ok(n) => return Ok(n),
            Err(e) => failures.push(e.to_string()),
        }
    }
    let tried = if failures.is_empty() {
        "no candidate library was found".to_string()
    } else {
        failures.join("; ")
    };
    let setting = match explicit {
        Some(p) => format!(" (FASTLLM_NVRTC / nvrtc_path = {p})"),
        None => String::new(),
    };
    Err(CoreError::Cuda(format!(
        "NVRTC (the CUDA run-time compiler) could not be loaded{setting}: {tried}; {INSTALL_HINT}"
    )))
}

static LOADED: Mutex<Vec<(Vec<String>, &'static Nvrtc)>> = Mutex::new(Vec::new());

/// The NVRTC for these search settings, opened once per process and reused.
/// `explicit` overrides `FASTLLM_NVRTC`.
pub fn load(explicit: Option<&str>, wheel_dirs: &[String]) -> CoreResult<&'static Nvrtc> {
    let env = std::env::var("FASTLLM_NVRTC").ok();
    let explicit = explicit.map(str::to_string).or(env);
    let cuda_home = std::env::var("CUDA_HOME")
        .ok()
        .or_else(|| std::env::var("CUDA_PATH").ok());
    let list = candidates(explicit.as_deref(), cuda_home.as_deref(), wheel_dirs);
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, n)) = loaded.iter().find(|(k, _)| *k == list) {
        return Ok(n);
    }
    let nvrtc: &'static Nvrtc = Box::leak(Box::new(open_first(&list, explicit.as_deref())?));
    loaded.push((list, nvrtc));
    Ok(nvrtc)
}

/// A 128-bit FNV-1a digest (two 64-bit lanes) as 32 hex digits: stable across
/// Rust versions and platforms, which `DefaultHasher` does not promise.
pub fn digest(parts: &[&[u8]]) -> String {
    let mut a: u64 = 0xcbf2_9ce4_8422_2325;
    let mut b: u64 = 0x8422_2325_cbf2_9ce4;
    for part in parts {
        for &byte in part.iter().chain((part.len() as u64).to_le_bytes().iter()) {
            a = (a ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            b = (b ^ byte as u64)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(5);
        }
    }
    format!("{a:016x}{b:016x}")
}

/// The kernel cache folder: `FASTLLM_CACHE_DIR`, else the XDG cache, else `~/.cache`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("FASTLLM_CACHE_DIR") {
        return Some(d);
    }
    let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("fastllm").join("kernels"))
}

/// Compiles through the disk cache: a hit returns the stored image, a miss
/// compiles and stores it (write to a temporary file, then rename).
pub fn compile_cached(
    nvrtc: &Nvrtc,
    source: &str,
    name: &str,
    headers: &[(&str, &str)],
    arch: u32,
    output: Output,
    extra_options: &[&str],
) -> CoreResult<Vec<u8>> {
    let mut parts: Vec<&[u8]> = vec![source.as_bytes(), name.as_bytes()];
    for (n, s) in headers {
        parts.push(n.as_bytes());
        parts.push(s.as_bytes());
    }
    for o in extra_options {
        parts.push(o.as_bytes());
    }
    let key = digest(&parts);
    let (major, minor) = nvrtc.version();
    let stem = name.trim_end_matches(".cu");
    let file = format!(
        "{stem}-sm{arch}-nvrtc{major}.{minor}-{key}.{}",
        output.extension()
    );
    let path = cache_dir().map(|d| d.join(file));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let image = nvrtc.compile(source, name, headers, arch, output, extra_options)?;
    if let Some(p) = &path {
        store(p, &image);
    }
    Ok(image)
}

/// Best effort: a cache that cannot be written only costs a recompile.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_spellings() {
        assert_eq!(parse_arch("sm_90").unwrap(), 90);
        assert_eq!(parse_arch("compute_80").unwrap(), 80);
        assert_eq!(parse_arch(" 86 ").unwrap(), 86);
        assert!(parse_arch("sm_x").unwrap_err().to_string().contains("arch"));
        assert!(parse_arch("7").is_err());
    }

    #[test]
    fn libraries_are_found_newest_first() {
        let dir = std::env::temp_dir().join(format!("fastllm-nvrtc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "libnvrtc.so.12",
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.2",
            "other.so",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let found = libraries_in(&dir);
        let names: Vec<String> = found
            .iter()
            .map(|p| {
                Path::new(p)
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(names, ["libnvrtc.so.13", "libnvrtc.so.12"]);
        // An explicit folder is searched and nothing else is tried.
        let got = candidates(Some(dir.to_str().unwrap()), Some("/opt/cuda"), &[]);
        assert_eq!(got.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn candidate_order() {
        let got = candidates(
            None,
            Some("/nonexistent-cuda"),
            &["/nonexistent-wheel".into()],
        );
        if !cfg!(windows) {
            assert!(got.ends_with(&[
                "libnvrtc.so.13".into(),
                "libnvrtc.so.12".into(),
                "libnvrtc.so".into()
            ]));
        }
        assert_eq!(
            candidates(Some("/x/libnvrtc.so.99"), None, &[]),
            ["/x/libnvrtc.so.99"]
        );
    }

    #[test]
    fn missing_nvrtc_names_the_package() {
        let err = match open_first(
            &["/nonexistent/libnvrtc.so.13".into()],
            Some("/nonexistent"),
        ) {
            Ok(_) => panic!("a missing NVRTC loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("pip install nvidia-cuda-nvrtc"), "{err}");
        assert!(err.contains("/nonexistent/libnvrtc.so.13"), "{err}");
        let err = match open_first(&[], None) {
            Ok(_) => panic!("nothing loaded something"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("no candidate library"), "{err}");
    }

    #[test]
    fn digests_are_stable_and_sensitive() {
        assert_eq!(digest(&[b"abc"]), digest(&[b"abc"]));
        assert_ne!(digest(&[b"abc"]), digest(&[b"abd"]));
        // Part boundaries matter: ("ab", "c") is not ("a", "bc").
        assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
        assert_eq!(digest(&[]).len(), 32);
    }
}
