//! Kernel launches through the driver API.
//!
//! On top of [`Driver`] (already initialised by the probe gate), this layer
//! resolves the few launch entry points, retains each device's primary
//! context (the one torch uses, so pointers from torch tensors are valid in
//! it), compiles each kernel file once per device with NVRTC (a CUBIN for the
//! device's exact architecture, PTX as a fallback), loads it with
//! `cuModuleLoadData`, and launches with `cuLaunchKernel` on a stream handle
//! the caller passes (torch's current stream). Every call is a `Result` whose
//! error names the CUDA call and the error.

use std::ffi::{c_char, c_uint, c_void, CString};
use std::sync::Mutex;

use super::driver::{CuDevice, CuResult, Driver};
use super::kernels;
use super::nvrtc::{self, Output};
use crate::error::{CoreError, CoreResult};

type Handle = *mut c_void;
type FnPrimaryCtxRetain = unsafe extern "C" fn(*mut Handle, CuDevice) -> CuResult;
type FnCtxSetCurrent = unsafe extern "C" fn(Handle) -> CuResult;
type FnModuleLoadData = unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult;
type FnModuleGetFunction = unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult;
type FnLaunchKernel = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;

/// One kernel argument, 8 bytes, 8-aligned; a 4-byte value fills the first
/// four bytes in native order (the driver copies the parameter's size).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug)]
struct Slot([u8; 8]);

/// A kernel's parameters in declaration order.
#[derive(Clone, Debug, Default)]
pub struct Args {
    slots: Vec<Slot>,
}

impl Args {
    /// An empty list.
    pub fn new() -> Args {
        Args::default()
    }

    fn push4(mut self, b: [u8; 4]) -> Args {
        let mut s = [0u8; 8];
        s[..4].copy_from_slice(&b);
        self.slots.push(Slot(s));
        self
    }

    /// A device pointer.
    pub fn ptr(mut self, p: u64) -> Args {
        self.slots.push(Slot(p.to_ne_bytes()));
        self
    }

    /// An `int`.
    pub fn i32(self, v: i32) -> Args {
        self.push4(v.to_ne_bytes())
    }

    /// A `long long`.
    pub fn i64(mut self, v: i64) -> Args {
        self.slots.push(Slot(v.to_ne_bytes()));
        self
    }

    /// A `float`.
    pub fn f32(self, v: f32) -> Args {
        self.push4(v.to_ne_bytes())
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// Grid and block dimensions and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// A loaded kernel and the context it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    function: usize,
    context: usize,
}

struct Device {
    ordinal: i32,
    context: usize,
    arch: u32,
    /// `(file, CUmodule)`.
    modules: Vec<(String, usize)>,
    /// `(file/kernel, CUfunction)`.
    functions: Vec<(String, usize)>,
}

/// The launch entry points and the per-device state.
pub struct Runtime {
    driver: &'static Driver,
    primary_ctx_retain: FnPrimaryCtxRetain,
    ctx_set_current: FnCtxSetCurrent,
    module_load_data: FnModuleLoadData,
    module_get_function: FnModuleGetFunction,
    launch_kernel: FnLaunchKernel,
    devices: Mutex<Vec<Device>>,
}

// SAFETY: the handles are opaque driver handles valid in any thread once the
// context is current; mutable state is behind a Mutex.
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

static RUNTIME: Mutex<Option<&'static Runtime>> = Mutex::new(None);

/// The runtime over an initialised driver, created once per process.
pub fn runtime(driver: &'static Driver) -> CoreResult<&'static Runtime> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = *slot {
        return Ok(r);
    }
    let lib = driver.library();
    // SAFETY: each alias is the documented C signature of the symbol.
    let rt = unsafe {
        Runtime {
            driver,
            primary_ctx_retain: lib.symbol("cuDevicePrimaryCtxRetain")?,
            ctx_set_current: lib.symbol("cuCtxSetCurrent")?,
            module_load_data: lib.symbol("cuModuleLoadData")?,
            module_get_function: lib.symbol("cuModuleGetFunction")?,
            launch_kernel: lib.symbol("cuLaunchKernel")?,
            devices: Mutex::new(Vec::new()),
        }
    };
    let leaked: &'static Runtime = Box::leak(Box::new(rt));
    *slot = Some(leaked);
    Ok(leaked)
}

impl Runtime {
    fn check(&self, call: &str, rc: CuResult) -> CoreResult<()> {
        self.driver.check(call, rc).map_err(CoreError::from)
    }

    fn device_index(&self, devices: &mut Vec<Device>, ordinal: i32) -> CoreResult<usize> {
        if let Some(i) = devices.iter().position(|d| d.ordinal == ordinal) {
            return Ok(i);
        }
        let count = self.driver.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(CoreError::invalid(format!(
                "CUDA device {ordinal} does not exist ({count} visible)"
            )));
        }
        let dev = self.driver.device(ordinal)?;
        let (major, minor) = self.driver.compute_capability(dev)?;
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, dev)
        })?;
        devices.push(Device {
            ordinal,
            context: ctx as usize,
            arch: (major * 10 + minor) as u32,
            modules: Vec::new(),
            functions: Vec::new(),
        });
        Ok(devices.len() - 1)
    }

    /// The compute capability of device `ordinal` as a number (90 for 9.0).
    pub fn arch(&self, ordinal: i32) -> CoreResult<u32> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let i = self.device_index(&mut devices, ordinal)?;
        Ok(devices[i].arch)
    }

    fn set_current(&self, context: usize) -> CoreResult<()> {
        // SAFETY: `context` is a retained primary context.
        self.check("cuCtxSetCurrent", unsafe {
            (self.ctx_set_current)(context as Handle)
        })
    }

    /// Compiles and loads kernel file `file` on a device unless already loaded.
    fn module(&self, dev: &mut Device, file: &str, wheel_dirs: &[String]) -> CoreResult<usize> {
        if let Some((_, m)) = dev.modules.iter().find(|(f, _)| f == file) {
            return Ok(*m);
        }
        let source = kernels::source(file)?;
        let nvrtc = nvrtc::load(None, wheel_dirs)?;
        let headers = [kernels::COMMON_HEADER];
        // A CUBIN for the exact architecture; PTX when this NVRTC cannot
        // target it (a GPU newer than the compiler).
        let image =
            nvrtc::compile_cached(nvrtc, source, file, &headers, dev.arch, Output::Cubin, &[])
                .or_else(|cubin_err| {
                    nvrtc::compile_cached(nvrtc, source, file, &headers, dev.arch, Output::Ptx, &[])
                        .map_err(|_| cubin_err)
                })?;
        let image = nul_terminated(image);
        self.set_current(dev.context)?;
        let mut module: Handle = std::ptr::null_mut();
        // SAFETY: the image is a complete CUBIN or NUL-terminated PTX.
        let rc = unsafe { (self.module_load_data)(&mut module, image.as_ptr() as *const c_void) };
        self.check("cuModuleLoadData", rc).map_err(|e| {
            CoreError::Cuda(format!(
                "loading {file} (sm_{}) on CUDA device {}: {e}",
                dev.arch, dev.ordinal
            ))
        })?;
        dev.modules.push((file.to_string(), module as usize));
        Ok(module as usize)
    }

    /// Kernel `name` of file `file` on device `ordinal`, compiled and loaded
    /// on first use. `wheel_dirs` are the NVRTC wheel's folders.
    pub fn kernel(
        &self,
        ordinal: i32,
        file: &str,
        name: &str,
        wheel_dirs: &[String],
    ) -> CoreResult<Kernel> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let i = self.device_index(&mut devices, ordinal)?;
        let dev = &mut devices[i];
        let key = format!("{file}/{name}");
        if let Some((_, f)) = dev.functions.iter().find(|(k, _)| *k == key) {
            return Ok(Kernel {
                function: *f,
                context: dev.context,
            });
        }
        let module = self.module(dev, file, wheel_dirs)?;
        let cname = CString::new(name)
            .map_err(|_| CoreError::invalid("kernel name contains a NUL byte"))?;
        let mut function: Handle = std::ptr::null_mut();
        // SAFETY: `module` is loaded; writes one function handle.
        let rc =
            unsafe { (self.module_get_function)(&mut function, module as Handle, cname.as_ptr()) };
        self.check("cuModuleGetFunction", rc)
            .map_err(|e| CoreError::Cuda(format!("kernel {name} of {file}: {e}")))?;
        dev.functions.push((key, function as usize));
        Ok(Kernel {
            function: function as usize,
            context: dev.context,
        })
    }

    /// Compiles and loads every kernel file on device `ordinal`; returns the file names.
    pub fn load_all(&self, ordinal: i32, wheel_dirs: &[String]) -> CoreResult<Vec<String>> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let i = self.device_index(&mut devices, ordinal)?;
        let mut names = Vec::new();
        for (file, _) in kernels::SOURCES {
            self.module(&mut devices[i], file, wheel_dirs)?;
            names.push(file.to_string());
        }
        Ok(names)
    }

    /// Launches `kernel` on `stream` (a `CUstream` handle; 0 is the legacy
    /// default stream). Asynchronous: errors of the kernel itself surface
    /// at the stream's next synchronisation.
    pub fn launch(
        &self,
        kernel: Kernel,
        cfg: LaunchConfig,
        stream: usize,
        args: &Args,
    ) -> CoreResult<()> {
        if cfg.grid.0 == 0 || cfg.grid.1 == 0 || cfg.grid.2 == 0 {
            return Ok(()); // nothing to do; the driver would reject an empty grid
        }
        self.set_current(kernel.context)?;
        let mut slots = args.slots.clone();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.0.as_mut_ptr() as *mut c_void)
            .collect();
        // SAFETY: `params` points at `args.len()` live 8-byte slots, one per
        // kernel parameter in order; the caller matched them to the kernel.
        let rc = unsafe {
            (self.launch_kernel)(
                kernel.function as Handle,
                cfg.grid.0,
                cfg.grid.1,
                cfg.grid.2,
                cfg.block.0,
                cfg.block.1,
                cfg.block.2,
                cfg.shared_bytes,
                stream as Handle,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check("cuLaunchKernel", rc)
    }
}

/// PTX must end with a NUL for `cuModuleLoadData`; a CUBIN is unaffected by one.
fn nul_terminated(mut image: Vec<u8>) -> Vec<u8> {
    if image.last() != Some(&0) {
        image.push(0);
    }
    image
}

/// Grid dimension check: CUDA allows 2^31 - 1 blocks in x, 65535 in y and z.
pub fn grid_dim(n: usize, what: &str, limit: usize) -> CoreResult<u32> {
    if n > limit {
        return Err(CoreError::invalid(format!(
            "{what}: {n} exceeds the CUDA grid limit {limit}"
        )));
    }
    Ok(n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_8_byte_slots_in_native_order() {
        let a = Args::new()
            .ptr(0x1122_3344_5566_7788)
            .i32(-2)
            .f32(1.5)
            .i64(-3);
        assert_eq!(a.len(), 4);
        assert_eq!(a.slots[0].0, 0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&a.slots[1].0[..4], &(-2i32).to_ne_bytes());
        assert_eq!(&a.slots[2].0[..4], &1.5f32.to_ne_bytes());
        assert_eq!(a.slots[3].0, (-3i64).to_ne_bytes());
        assert_eq!(std::mem::align_of::<Slot>(), 8);
    }

    #[test]
    fn ptx_gets_a_terminating_nul() {
        assert_eq!(nul_terminated(b"ptx".to_vec()), b"ptx\0");
        assert_eq!(nul_terminated(b"ptx\0".to_vec()), b"ptx\0");
    }

    #[test]
    fn grid_limits() {
        assert_eq!(grid_dim(5, "rows", 65535).unwrap(), 5);
        assert!(grid_dim(70000, "rows", 65535)
            .unwrap_err()
            .to_string()
            .contains("rows"));
    }
}
