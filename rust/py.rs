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

// ---- sampling ----

/// Per-row sampling arguments as received from Python, checked for length.
#[allow(clippy::too_many_arguments)]
fn sampling_params(
    rows: usize,
    temperature: &[f32],
    top_k: &[i64],
    top_p: &[f32],
    min_p: &[f32],
    repetition_penalty: &[f32],
    frequency_penalty: &[f32],
    presence_penalty: &[f32],
    seed: Option<&[u64]>,
    position: Option<&[u64]>,
    num_logprobs: Option<&[usize]>,
) -> PyResult<Vec<crate::sampling::SamplingParams>> {
    let check = |name: &str, len: usize| -> PyResult<()> {
        if len != rows {
            return Err(PyValueError::new_err(format!(
                "{name}: expected {rows} values (one per logits row), got {len}"
            )));
        }
        Ok(())
    };
    check("temperature", temperature.len())?;
    check("top_k", top_k.len())?;
    check("top_p", top_p.len())?;
    check("min_p", min_p.len())?;
    check("repetition_penalty", repetition_penalty.len())?;
    check("frequency_penalty", frequency_penalty.len())?;
    check("presence_penalty", presence_penalty.len())?;
    for (name, v) in [
        ("seed", seed.map(<[u64]>::len)),
        ("position", position.map(<[u64]>::len)),
    ] {
        if let Some(len) = v {
            check(name, len)?;
        }
    }
    if let Some(n) = num_logprobs {
        check("num_logprobs", n.len())?;
    }
    Ok((0..rows)
        .map(|r| crate::sampling::SamplingParams {
            temperature: temperature[r],
            top_k: top_k[r],
            top_p: top_p[r],
            min_p: min_p[r],
            repetition_penalty: repetition_penalty[r],
            frequency_penalty: frequency_penalty[r],
            presence_penalty: presence_penalty[r],
            seed: seed.map_or(0, |s| s[r]),
            position: position.map_or(0, |p| p[r]),
            num_logprobs: num_logprobs.map_or(0, |n| n[r]),
        })
        .collect())
}

/// The checked logits `[B, V]` and the flat int32 token histories.
struct SamplerTensors {
    logits: TensorArg,
    prompt_tokens: TensorArg,
    output_tokens: TensorArg,
}

impl SamplerTensors {
    fn extract(
        logits: &Bound<'_, PyAny>,
        prompt_tokens: &Bound<'_, PyAny>,
        output_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<SamplerTensors> {
        let logits = TensorArg::extract("logits", logits)?;
        logits.expect(&[DType::F32], 2)?;
        let prompt_tokens = TensorArg::extract("prompt_tokens", prompt_tokens)?;
        prompt_tokens.expect(&[DType::I32], 1)?;
        let output_tokens = TensorArg::extract("output_tokens", output_tokens)?;
        output_tokens.expect(&[DType::I32], 1)?;
        Ok(SamplerTensors {
            logits,
            prompt_tokens,
            output_tokens,
        })
    }

    fn rows(&self) -> usize {
        self.logits.shape[0]
    }

    /// # Safety
    /// The tensors were checked by `extract` and must outlive the batch.
    unsafe fn batch<'a>(
        &'a self,
        params: &'a [crate::sampling::SamplingParams],
        prompt_offsets: &'a [usize],
        output_offsets: &'a [usize],
    ) -> crate::sampling::Batch<'a> {
        crate::sampling::Batch {
            logits: self.logits.slice::<f32>(),
            vocab: self.logits.shape[1],
            params,
            prompt_tokens: self.prompt_tokens.slice::<i32>(),
            prompt_offsets,
            output_tokens: self.output_tokens.slice::<i32>(),
            output_offsets,
        }
    }
}

/// Result of `sample`: tokens, their raw logprobs, their ranks, top-N lists.
type SampleOutput = (Vec<u32>, Vec<f32>, Vec<u32>, Vec<Vec<(u32, f32)>>);

/// Samples one token per row of float32 logits `[B, V]` (see `_core.pyi`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sample(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    temperature: Vec<f32>,
    top_k: Vec<i64>,
    top_p: Vec<f32>,
    min_p: Vec<f32>,
    repetition_penalty: Vec<f32>,
    frequency_penalty: Vec<f32>,
    presence_penalty: Vec<f32>,
    seed: Vec<u64>,
    position: Vec<u64>,
    prompt_tokens: &Bound<'_, PyAny>,
    prompt_offsets: Vec<usize>,
    output_tokens: &Bound<'_, PyAny>,
    output_offsets: Vec<usize>,
    num_logprobs: Vec<usize>,
) -> PyResult<SampleOutput> {
    let tensors = SamplerTensors::extract(logits, prompt_tokens, output_tokens)?;
    let params = sampling_params(
        tensors.rows(),
        &temperature,
        &top_k,
        &top_p,
        &min_p,
        &repetition_penalty,
        &frequency_penalty,
        &presence_penalty,
        Some(&seed),
        Some(&position),
        Some(&num_logprobs),
    )?;
    // SAFETY: checked by `SamplerTensors::extract`; the tensors are borrowed
    // from the call's arguments and stay alive until it returns.
    let batch = unsafe { tensors.batch(&params, &prompt_offsets, &output_offsets) };
    let samples = py.detach(|| crate::sampling::sample_batch(&batch))?;
    let mut out: SampleOutput = (
        Vec::with_capacity(samples.len()),
        Vec::with_capacity(samples.len()),
        Vec::with_capacity(samples.len()),
        Vec::with_capacity(samples.len()),
    );
    for s in samples {
        out.0.push(s.token);
        out.1.push(s.logprob);
        out.2.push(s.rank);
        out.3.push(s.top_logprobs);
    }
    Ok(out)
}

/// The token ids each row may draw after penalties and filters (a debugging aid).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sampling_support(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    temperature: Vec<f32>,
    top_k: Vec<i64>,
    top_p: Vec<f32>,
    min_p: Vec<f32>,
    repetition_penalty: Vec<f32>,
    frequency_penalty: Vec<f32>,
    presence_penalty: Vec<f32>,
    prompt_tokens: &Bound<'_, PyAny>,
    prompt_offsets: Vec<usize>,
    output_tokens: &Bound<'_, PyAny>,
    output_offsets: Vec<usize>,
) -> PyResult<Vec<Vec<u32>>> {
    let tensors = SamplerTensors::extract(logits, prompt_tokens, output_tokens)?;
    let params = sampling_params(
        tensors.rows(),
        &temperature,
        &top_k,
        &top_p,
        &min_p,
        &repetition_penalty,
        &frequency_penalty,
        &presence_penalty,
        None,
        None,
        None,
    )?;
    // SAFETY: as in `sample`.
    let batch = unsafe { tensors.batch(&params, &prompt_offsets, &output_offsets) };
    Ok(py.detach(|| crate::sampling::support_batch(&batch))?)
}

/// The sampler's uniform draw in (0, 1) for `(seed, position, token)`.
#[pyfunction]
fn sampling_uniform(seed: u64, position: u64, token: u32) -> f64 {
    crate::sampling::uniform(seed, position, token)
}

// ---- end sampling ----

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    // Each part of the core registers its functions and classes below.
    // sampling
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_support, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_uniform, m)?)?;
    Ok(())
}
