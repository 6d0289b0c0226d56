//! The only file that knows PyO3: conversions, GIL release, error mapping.
//!
//! Kernels receive plain slices built from torch tensors' data pointers after
//! `TensorArg` has checked dtype, device, shape and contiguity.

use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::CoreError;

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        match err {
            CoreError::InvalidArgument(m) => PyValueError::new_err(m),
            CoreError::Exhausted(m) => PyMemoryError::new_err(m),
            CoreError::Cuda(m) => PyRuntimeError::new_err(m),
            CoreError::Os(m) => PyOSError::new_err(m),
        }
    }
}

/// Element types the kernels accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    BF16,
    F16,
    I32,
    I64,
}

impl DType {
    fn from_torch(name: &str) -> Option<DType> {
        match name {
            "torch.float32" => Some(DType::F32),
            "torch.bfloat16" => Some(DType::BF16),
            "torch.float16" => Some(DType::F16),
            "torch.int32" => Some(DType::I32),
            "torch.int64" => Some(DType::I64),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }
}

/// A torch tensor seen from Rust: pointer, dtype, device, shape, strides.
/// Built only through `TensorArg::extract`, which reads torch's own accessors.
#[allow(dead_code)]
pub(crate) struct TensorArg {
    pub name: &'static str,
    pub ptr: usize,
    pub dtype: DType,
    pub device: String,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
}

#[allow(dead_code)]
impl TensorArg {
    /// Reads a torch tensor's metadata; `name` is used in every error message.
    pub fn extract(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<TensorArg> {
        let dtype_name: String = obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .map_err(|_| PyValueError::new_err(format!("{name}: expected a torch.Tensor")))?
            .to_string();
        let dtype = DType::from_torch(&dtype_name).ok_or_else(|| {
            PyValueError::new_err(format!("{name}: unsupported dtype {dtype_name}"))
        })?;
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let strides: Vec<isize> = obj.call_method0("stride")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        Ok(TensorArg {
            name,
            ptr,
            dtype,
            device,
            shape,
            strides,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks device, dtype, rank and C-contiguity in one call.
    pub fn expect(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        if self.device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CPU tensor, got device '{}'",
                self.name, self.device
            )));
        }
        if !dtypes.contains(&self.dtype) {
            return Err(PyValueError::new_err(format!(
                "{}: expected dtype {:?}, got {:?}",
                self.name, dtypes, self.dtype
            )));
        }
        if self.shape.len() != ndim {
            return Err(PyValueError::new_err(format!(
                "{}: expected {} dimensions, got shape {:?}",
                self.name, ndim, self.shape
            )));
        }
        let mut expected: isize = 1;
        for (dim, (&size, &stride)) in self.shape.iter().zip(&self.strides).enumerate().rev() {
            if size > 1 && stride != expected {
                return Err(PyValueError::new_err(format!(
                    "{}: must be contiguous (dimension {} has stride {}, expected {})",
                    self.name, dim, stride, expected
                )));
            }
            expected *= size as isize;
        }
        if self.numel() > 0 && self.ptr == 0 {
            return Err(PyValueError::new_err(format!(
                "{}: null data pointer",
                self.name
            )));
        }
        Ok(self)
    }

    /// Checks the size of one dimension.
    pub fn expect_dim(&self, dim: usize, size: usize, what: &str) -> PyResult<()> {
        if self.shape[dim] != size {
            return Err(PyValueError::new_err(format!(
                "{}: dimension {} must be {} ({}), got {}",
                self.name, dim, size, what, self.shape[dim]
            )));
        }
        Ok(())
    }

    /// A read-only slice over the tensor's elements.
    ///
    /// # Safety
    /// `expect` must have checked dtype (matching `T`) and contiguity, and the
    /// tensor must stay alive and unaliased by writers while the slice is used.
    pub unsafe fn slice<T>(&self) -> &[T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.size());
        if self.numel() == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr as *const T, self.numel())
    }

    /// A mutable slice over the tensor's elements.
    ///
    /// # Safety
    /// As `slice`, and no other slice may alias this tensor's memory.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T>(&self) -> &mut [T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.size());
        if self.numel() == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut T, self.numel())
    }
}

/// Number of threads the Rust kernels use (`FASTLLM_NUM_THREADS` or the cores).
#[pyfunction]
fn num_threads() -> usize {
    crate::threads::num_threads()
}

// ---- probe and platform ----

/// The command that runs the isolated probe child: this Python interpreter,
/// isolated (`-I -S`), loading this very extension file by path and calling
/// `_probe_child`. A fresh process (spawn, not fork) is safe whatever threads
/// the parent runs.
fn probe_child_command(py: Python<'_>) -> PyResult<Vec<String>> {
    let exe: String = py.import("sys")?.getattr("executable")?.extract()?;
    if exe.is_empty() {
        return Err(PyRuntimeError::new_err(
            "sys.executable is empty, so the CUDA probe child cannot be started",
        ));
    }
    let file: String = py.import("fastllm._core")?.getattr("__file__")?.extract()?;
    let code = "import sys, importlib.util as u\n\
                s = u.spec_from_file_location('fastllm._core', sys.argv[1])\n\
                m = u.module_from_spec(s)\n\
                s.loader.exec_module(m)\n\
                m._probe_child()\n";
    Ok(vec![
        exe,
        "-I".into(),
        "-S".into(),
        "-c".into(),
        code.into(),
        file,
    ])
}

/// Runs the probe (cached), with the GIL released while a child runs.
fn run_probe(py: Python<'_>) -> crate::cuda::ProbeReport {
    match probe_child_command(py) {
        Ok(cmd) => py.detach(|| crate::cuda::probe::probe(&cmd)),
        Err(e) => crate::cuda::ProbeReport::unavailable(format!(
            "could not prepare the CUDA probe child: {e}"
        )),
    }
}

/// The probe report as a dict (the fields of `fastllm.ProbeReport`).
#[pyfunction]
fn _probe(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let report = run_probe(py);
    let out = PyDict::new(py);
    out.set_item("available", report.available)?;
    out.set_item("device_count", report.device_count())?;
    let devices = PyList::empty(py);
    for d in &report.devices {
        let dev = PyDict::new(py);
        dev.set_item("index", d.index)?;
        dev.set_item("name", &d.name)?;
        dev.set_item("total_memory", d.total_memory)?;
        dev.set_item("compute_capability", d.compute_capability)?;
        devices.append(dev)?;
    }
    out.set_item("devices", devices)?;
    out.set_item("driver_version", report.driver_version)?;
    out.set_item("library", report.library)?;
    out.set_item("reason", report.reason)?;
    Ok(out)
}

/// Number of usable CUDA devices; 0 without a GPU. Goes through the isolated probe.
#[pyfunction]
fn get_device_count(py: Python<'_>) -> usize {
    run_probe(py).device_count()
}

/// Entry point of the probe child process: probes, prints the report, exits.
#[pyfunction]
fn _probe_child() {
    #[cfg(unix)]
    {
        // A crashing driver should not spend seconds writing a core file.
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: setrlimit only reads the struct.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    }
    let mut out = std::io::stdout().lock();
    crate::cuda::probe::child_main(&mut out);
    drop(out);
    // The report is out: skip interpreter and driver teardown, whose
    // destructors this probe has no reason to trust.
    #[cfg(unix)]
    // SAFETY: _exit ends the process immediately; stdout was flushed.
    unsafe {
        libc::_exit(0)
    };
    #[cfg(not(unix))]
    std::process::exit(0);
}

/// Initialises the driver in this process, only after the isolated probe
/// succeeded; returns the device count this process sees.
#[pyfunction]
fn _init_driver(py: Python<'_>) -> PyResult<i32> {
    let cmd = probe_child_command(py)?;
    let count = py.detach(|| -> Result<i32, CoreError> {
        let driver = crate::cuda::probe::driver(&cmd)?;
        Ok(driver.device_count()?)
    })?;
    Ok(count)
}

/// The CPU features the kernels choose from, detected at run time.
#[pyfunction]
fn cpu_features(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (name, value) in crate::cpu::features().as_pairs() {
        out.set_item(name, value)?;
    }
    Ok(out)
}

// ---- end probe and platform ----

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_probe, m)?)?;
    m.add_function(wrap_pyfunction!(get_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_probe_child, m)?)?;
    m.add_function(wrap_pyfunction!(_init_driver, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    // Each part of the core registers its functions and classes below.
    Ok(())
}
