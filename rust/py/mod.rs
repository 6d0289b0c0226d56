//! The only module that knows PyO3: conversions, GIL release, error
//! mapping, one file per topic. Each file registers its own functions and
//! classes; this one holds the `CoreError` mapping and the module itself.
//!
//! Kernels receive plain slices built from torch tensors' data pointers after
//! `TensorArg` (`tensor.rs`) has checked dtype, device, shape and contiguity.

use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::error::CoreError;

mod attention;
mod cuda;
mod gemm;
mod kv;
mod layers;
mod linear;
mod llama;
mod moe;
mod platform;
mod quant;
mod recurrent;
mod sampling;
mod structured;
mod tensor;

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        match err {
            CoreError::InvalidArgument(m) => PyValueError::new_err(m),
            CoreError::Exhausted(m) => PyMemoryError::new_err(m),
            CoreError::Cuda(m) => PyRuntimeError::new_err(m),
            CoreError::Os(m) => PyOSError::new_err(m),
            CoreError::Internal(m) => PyRuntimeError::new_err(m),
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    platform::register(m)?;
    cuda::register(m)?;
    kv::register(m)?;
    attention::register(m)?;
    sampling::register(m)?;
    structured::register(m)?;
    gemm::register(m)?;
    layers::register(m)?;
    quant::register(m)?;
    llama::register(m)?;
    moe::register(m)?;
    recurrent::register(m)?;
    Ok(())
}
