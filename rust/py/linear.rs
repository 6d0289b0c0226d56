//! What the two linear-layer classes share (`PackedLinear`, float panels;
//! `QuantizedLinear`, quantized panels): their arguments' checks, their
//! `forward`, and the methods every linear weight has, written once in
//! `linear_class!` over `linear::LinearKernel`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::gemm::PyPackedLinear;
use super::quant::PyQuantizedLinear;
use super::tensor::{check_no_overlap, kernel_dst, kernel_src, DType, TensorArg};
use crate::linear::{LinearKernel, LinearWeight};

/// The shared weight of a `PackedLinear` or `QuantizedLinear` (`key` names
/// the argument in the error for anything else).
pub(super) fn linear_weight(obj: &Bound<'_, PyAny>, key: &str) -> PyResult<LinearWeight> {
    if let Ok(p) = obj.cast::<PyPackedLinear>() {
        return Ok(p.get().weight());
    }
    if let Ok(q) = obj.cast::<PyQuantizedLinear>() {
        return Ok(q.get().weight());
    }
    Err(PyValueError::new_err(format!(
        "{key}: expected a PackedLinear or QuantizedLinear"
    )))
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

/// `out [M, out_features] = x [M, in_features] @ weight^T + bias` for any
/// linear weight, without the GIL.
pub(super) fn forward(
    py: Python<'_>,
    kernel: &dyn LinearKernel,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (n, k) = (kernel.out_features(), kernel.in_features());
    let (out, x, m) = linear_args(out, x, n, k)?;
    // SAFETY: x and out were checked (dtype, CPU, contiguity, shape) and
    // share no memory; the caller keeps them alive.
    let (dst, xs) = unsafe { (kernel_dst(&out), kernel_src(&x)) };
    py.detach(move || kernel.forward(dst, xs, m))?;
    Ok(())
}

/// The `#[pymethods]` of a linear-layer class whose `kernel` field is a
/// `linear::OnPath`: `forward`, `in_features`, `out_features`, `nbytes`,
/// `path`, and the class's own methods given as `{ ... }`.
macro_rules! linear_class {
    ($class:ident, { $($own:tt)* }) => {
        #[pymethods]
        impl $class {
            /// out [M, out_features] = x [M, in_features] @ weight^T + bias.
            fn forward(
                &self,
                py: Python<'_>,
                out: &Bound<'_, PyAny>,
                x: &Bound<'_, PyAny>,
            ) -> PyResult<()> {
                super::linear::forward(py, &self.kernel, out, x)
            }

            #[getter]
            fn in_features(&self) -> usize {
                crate::linear::LinearKernel::in_features(&self.kernel)
            }

            #[getter]
            fn out_features(&self) -> usize {
                crate::linear::LinearKernel::out_features(&self.kernel)
            }

            /// Bytes of packed weights (and scales).
            #[getter]
            fn nbytes(&self) -> usize {
                crate::linear::LinearKernel::nbytes(&self.kernel)
            }

            /// The kernel path this layer runs.
            #[getter]
            fn path(&self) -> &'static str {
                crate::linear::LinearKernel::path_name(&self.kernel)
            }

            $($own)*
        }
    };
}

pub(super) use linear_class;
