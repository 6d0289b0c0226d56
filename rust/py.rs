//! The only file that knows PyO3: conversions, GIL release, error mapping.
//!
//! Kernels receive plain slices built from torch tensors' data pointers after
//! `TensorArg` has checked dtype, device, shape and contiguity.

use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

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

// ---- linear ----

/// Borrows a checked bf16 / f32 tensor as a kernel source.
///
/// # Safety
/// As `TensorArg::slice`: `expect` has checked the dtype and contiguity.
unsafe fn linear_src(t: &TensorArg) -> crate::linear::Src<'_> {
    match t.dtype {
        DType::BF16 => crate::linear::Src::Bf16(t.slice::<half::bf16>()),
        _ => crate::linear::Src::F32(t.slice::<f32>()),
    }
}

/// Byte range of a tensor's elements.
fn byte_range(t: &TensorArg) -> (usize, usize) {
    (t.ptr, t.ptr + t.numel() * t.dtype.size())
}

/// Rejects `out` sharing memory with an input (the kernel reads weights and
/// bias while other threads write `out`).
fn check_no_overlap(out: &TensorArg, other: &TensorArg) -> PyResult<()> {
    let (a0, a1) = byte_range(out);
    let (b0, b1) = byte_range(other);
    if a0 < b1 && b0 < a1 {
        return Err(PyValueError::new_err(format!(
            "{}: must not share memory with {}",
            out.name, other.name
        )));
    }
    Ok(())
}

/// out = x @ weight^T (+ bias): x [M, K], weight [N, K], bias [N], out [M, N].
#[pyfunction]
#[pyo3(signature = (out, x, weight, bias=None, path=None))]
fn linear(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    path: Option<&str>,
) -> PyResult<()> {
    let floats = [DType::BF16, DType::F32];
    let weight = TensorArg::extract("weight", weight)?;
    weight.expect(&floats, 2)?;
    let (n, k) = (weight.shape[0], weight.shape[1]);
    let x = TensorArg::extract("x", x)?;
    x.expect(&floats, 2)?;
    x.expect_dim(1, k, "in_features of weight")?;
    let m = x.shape[0];
    let out = TensorArg::extract("out", out)?;
    out.expect(&[x.dtype], 2)?;
    out.expect_dim(0, m, "rows of x")?;
    out.expect_dim(1, n, "out_features of weight")?;
    let bias = match bias {
        Some(b) if !b.is_none() => {
            let b = TensorArg::extract("bias", b)?;
            b.expect(&floats, 1)?;
            b.expect_dim(0, n, "out_features of weight")?;
            check_no_overlap(&out, &b)?;
            Some(b)
        }
        _ => None,
    };
    check_no_overlap(&out, &x)?;
    check_no_overlap(&out, &weight)?;
    let path = match path {
        Some(name) => Some(crate::linear::check_path(name).map_err(PyValueError::new_err)?),
        None => None,
    };
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, ws, bs) = unsafe {
        let dst = match out.dtype {
            DType::BF16 => crate::linear::Dst::Bf16(out.slice_mut::<half::bf16>()),
            _ => crate::linear::Dst::F32(out.slice_mut::<f32>()),
        };
        (
            dst,
            linear_src(&x),
            linear_src(&weight),
            bias.as_ref().map(|b| linear_src(b)),
        )
    };
    py.detach(move || match path {
        Some(p) => crate::linear::linear_with_path(p, dst, xs, ws, bs, m, n, k),
        None => crate::linear::linear(dst, xs, ws, bs, m, n, k),
    })?;
    Ok(())
}

/// Names of the linear kernel paths this CPU runs.
#[pyfunction]
fn linear_paths() -> Vec<&'static str> {
    crate::linear::available_paths()
        .iter()
        .map(|p| p.name())
        .collect()
}

/// The path `linear` uses when none is named, for `m` rows of bf16 (or f32) x.
#[pyfunction]
#[pyo3(signature = (m=1, x_bf16=true))]
fn linear_default_path(m: usize, x_bf16: bool) -> PyResult<&'static str> {
    Ok(crate::linear::default_path(m, x_bf16)?.name())
}

/// STREAM-triad memory bandwidth in GB/s over f32 arrays of `bytes` each.
#[pyfunction]
#[pyo3(signature = (bytes=200_000_000, repeats=5))]
fn stream_triad_gbs(py: Python<'_>, bytes: usize, repeats: usize) -> PyResult<f64> {
    Ok(py.detach(|| crate::linear::stream_triad_gbs(bytes, repeats))?)
}

// ---- end linear ----

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    // Each part of the core registers its functions and classes below.
    m.add_function(wrap_pyfunction!(linear, m)?)?;
    m.add_function(wrap_pyfunction!(linear_paths, m)?)?;
    m.add_function(wrap_pyfunction!(linear_default_path, m)?)?;
    m.add_function(wrap_pyfunction!(stream_triad_gbs, m)?)?;
    Ok(())
}
