//! The packed-weight GEMM (`PackedLinear`); the methods it shares with
//! `QuantizedLinear` are `linear.rs`'s.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::linear::{bias_arg, linear_class};
use super::tensor::{kernel_src, DType, TensorArg};
use crate::cpu::Path;
use crate::gemm::PackedWeight;
use crate::linear::{LinearWeight, OnPath};

/// A linear layer's weight (and bias) packed for the CPU GEMM kernel.
#[pyclass(name = "PackedLinear", module = "fastllm._core", frozen)]
pub(super) struct PyPackedLinear {
    kernel: OnPath<PackedWeight, Path>,
}

impl PyPackedLinear {
    /// The weights and path, shared (the decoder stack runs them too).
    pub(super) fn weight(&self) -> LinearWeight {
        Arc::new(self.kernel.clone())
    }
}

linear_class!(PyPackedLinear, {
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
        let inner = py.detach(move || PackedWeight::pack(ws, bs, n, k))?;
        Ok(PyPackedLinear {
            kernel: OnPath {
                weight: Arc::new(inner),
                path,
            },
        })
    }

    /// "bfloat16" or "float32": how the weights are stored.
    #[getter]
    fn weight_dtype(&self) -> &'static str {
        if self.kernel.weight.is_bf16() {
            "bfloat16"
        } else {
            "float32"
        }
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
});

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

/// The SIMD path the kernels other than the GEMMs (attention, sampling,
/// norms, activations) run on: the fastest this CPU runs, or the one
/// `FASTLLM_CPU_SIMD_PATH` named when they first ran; a `ValueError` naming
/// the switch when its value now names no path this CPU runs.
#[pyfunction]
fn simd_path() -> PyResult<&'static str> {
    crate::cpu::simd_path_from_env().map_err(pyo3::exceptions::PyValueError::new_err)?;
    Ok(crate::cpu::best_path().name())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPackedLinear>()?;
    m.add_function(wrap_pyfunction!(simd_path, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_default_path, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_paths, m)?)?;
    Ok(())
}
