//! The packed-weight GEMM (`PackedLinear`).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::tensor::{check_no_overlap, kernel_dst, kernel_src, DType, TensorArg};
use crate::layers::decoder::LinearWeight;

/// A linear layer's weight (and bias) packed for the CPU GEMM kernel.
#[pyclass(name = "PackedLinear", module = "fastllm._core", frozen)]
pub(super) struct PyPackedLinear {
    inner: Arc<crate::gemm::PackedWeight>,
    path: crate::cpu::Path,
}

impl PyPackedLinear {
    /// The weights and path, shared (the decoder stack runs them too).
    pub(super) fn weight(&self) -> LinearWeight {
        LinearWeight::Float(self.inner.clone(), self.path)
    }
}

#[pymethods]
impl PyPackedLinear {
    /// Packs `weight` [out_features, in_features] (bf16 or f32, CPU) and
    /// `bias` [out_features]; `path` names a kernel path (default: fastest).
    #[new]
    #[pyo3(signature = (weight, bias=None, path=None))]
    fn new(
        py: Python<'_>,
        weight: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        path: Option<&str>,
    ) -> PyResult<Self> {
        let floats = [DType::BF16, DType::F32];
        let weight = TensorArg::extract("weight", weight)?;
        weight.check(&floats, 2)?;
        let (n, k) = (weight.shape[0], weight.shape[1]);
        let bias = bias_arg(bias, n)?;
        let path = match path {
            Some(name) => crate::cpu::check_path(name).map_err(PyValueError::new_err)?,
            None => crate::gemm::default_path(),
        };
        // SAFETY: both tensors were checked (dtype, CPU, contiguity, shape)
        // and the caller keeps them alive during the call.
        let (ws, bs) = unsafe { (kernel_src(&weight), bias.as_ref().map(|b| kernel_src(b))) };
        let inner = py.detach(move || crate::gemm::PackedWeight::pack(ws, bs, n, k))?;
        Ok(PyPackedLinear {
            inner: Arc::new(inner),
            path,
        })
    }

    /// out [M, out_features] = x [M, in_features] @ weight^T + bias.
    fn forward(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (n, k) = (self.inner.out_features(), self.inner.in_features());
        let (out, x, m) = linear_args(out, x, n, k)?;
        // SAFETY: x and out were checked (dtype, CPU, contiguity, shape) and
        // share no memory; the caller keeps them alive.
        let (dst, xs) = unsafe { (kernel_dst(&out), kernel_src(&x)) };
        let (w, path) = (&self.inner, self.path);
        py.detach(move || crate::gemm::gemm_with_path(path, dst, xs, w, m))?;
        Ok(())
    }

    #[getter]
    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    #[getter]
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }

    /// Bytes of packed weights.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// "bfloat16" or "float32": how the weights are stored.
    #[getter]
    fn weight_dtype(&self) -> &'static str {
        if self.inner.is_bf16() {
            "bfloat16"
        } else {
            "float32"
        }
    }

    /// The kernel path this layer runs.
    #[getter]
    fn path(&self) -> &'static str {
        self.path.name()
    }

    fn __repr__(&self) -> String {
        format!(
            "PackedLinear(in_features={}, out_features={}, weight_dtype={}, path={})",
            self.in_features(),
            self.out_features(),
            self.weight_dtype(),
            self.path()
        )
    }
}

/// A linear layer's optional `bias` [n] (bf16 or f32, CPU, contiguous).
pub(super) fn bias_arg(bias: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Option<TensorArg>> {
    match bias {
        Some(b) if !b.is_none() => {
            let b = TensorArg::extract("bias", b)?;
            b.check(&[DType::BF16, DType::F32], 1)?;
            b.expect_dim(0, n, "out_features of weight")?;
            Ok(Some(b))
        }
        _ => Ok(None),
    }
}

/// The `out` [M, n] and `x` [M, k] of a linear layer's forward: bf16 or f32,
/// CPU, contiguous, not overlapping; returns them with M.
pub(super) fn linear_args(
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
) -> PyResult<(TensorArg, TensorArg, usize)> {
    let floats = [DType::BF16, DType::F32];
    let x = TensorArg::extract("x", x)?;
    x.check(&floats, 2)?;
    x.expect_dim(1, k, "in_features")?;
    let m = x.shape[0];
    let out = TensorArg::extract("out", out)?;
    out.check(&floats, 2)?;
    out.expect_dim(0, m, "rows of x")?;
    out.expect_dim(1, n, "out_features")?;
    check_no_overlap(&out, &x)?;
    Ok((out, x, m))
}

/// Names of the GEMM kernel paths this CPU runs.
#[pyfunction]
fn gemm_paths() -> Vec<&'static str> {
    crate::gemm::available_paths()
        .iter()
        .map(|p| p.name())
        .collect()
}

/// The path `PackedLinear` uses when none is named.
#[pyfunction]
fn gemm_default_path() -> &'static str {
    crate::gemm::default_path().name()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPackedLinear>()?;
    m.add_function(wrap_pyfunction!(gemm_default_path, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_paths, m)?)?;
    Ok(())
}
