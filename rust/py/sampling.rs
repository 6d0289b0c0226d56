//! The CPU sampler.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::tensor::{DType, TensorArg};

/// One step's sampling parameters: one row per logits row, built once by the
/// model runner and read by the CPU sampler (and, field by field, by the CUDA
/// one). Token histories are copied in, so the batch owns everything it holds.
#[pyclass(name = "SamplingBatch", module = "fastllm._core", frozen)]
pub(crate) struct SamplingBatch {
    params: Vec<crate::sampling::SamplingParams>,
    prompt_tokens: Vec<i32>,
    prompt_offsets: Vec<usize>,
    output_tokens: Vec<i32>,
    output_offsets: Vec<usize>,
}

/// A flat int32 token history (a 1-D torch tensor) copied into a `Vec`.
fn token_history(name: &'static str, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<i32>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    let t = TensorArg::extract(name, obj)?;
    t.check(&[DType::I32], 1)?;
    // SAFETY: checked just above (CPU, int32, contiguous); copied before return.
    Ok(unsafe { t.slice::<i32>() }.to_vec())
}

#[pymethods]
impl SamplingBatch {
    #[new]
    #[pyo3(signature = (
        *,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        seed=None,
        position=None,
        prompt_tokens=None,
        prompt_offsets=None,
        output_tokens=None,
        output_offsets=None,
        num_logprobs=None,
        sampled_logprob=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: Vec<f32>,
        top_k: Vec<i64>,
        top_p: Vec<f32>,
        min_p: Vec<f32>,
        repetition_penalty: Vec<f32>,
        frequency_penalty: Vec<f32>,
        presence_penalty: Vec<f32>,
        seed: Option<Vec<u64>>,
        position: Option<Vec<u64>>,
        prompt_tokens: Option<&Bound<'_, PyAny>>,
        prompt_offsets: Option<Vec<usize>>,
        output_tokens: Option<&Bound<'_, PyAny>>,
        output_offsets: Option<Vec<usize>>,
        num_logprobs: Option<Vec<usize>>,
        sampled_logprob: Option<Vec<bool>>,
    ) -> PyResult<SamplingBatch> {
        let rows = temperature.len();
        let check = |name: &str, len: usize| -> PyResult<()> {
            if len != rows {
                return Err(PyValueError::new_err(format!(
                    "{name}: expected {rows} values (one per row, as temperature), got {len}"
                )));
            }
            Ok(())
        };
        check("top_k", top_k.len())?;
        check("top_p", top_p.len())?;
        check("min_p", min_p.len())?;
        check("repetition_penalty", repetition_penalty.len())?;
        check("frequency_penalty", frequency_penalty.len())?;
        check("presence_penalty", presence_penalty.len())?;
        for (name, v) in [
            ("seed", seed.as_ref().map(Vec::len)),
            ("position", position.as_ref().map(Vec::len)),
            ("num_logprobs", num_logprobs.as_ref().map(Vec::len)),
            ("sampled_logprob", sampled_logprob.as_ref().map(Vec::len)),
        ] {
            if let Some(len) = v {
                check(name, len)?;
            }
        }
        let params = (0..rows)
            .map(|r| crate::sampling::SamplingParams {
                temperature: temperature[r],
                top_k: top_k[r],
                top_p: top_p[r],
                min_p: min_p[r],
                repetition_penalty: repetition_penalty[r],
                frequency_penalty: frequency_penalty[r],
                presence_penalty: presence_penalty[r],
                seed: seed.as_ref().map_or(0, |s| s[r]),
                position: position.as_ref().map_or(0, |p| p[r]),
                num_logprobs: num_logprobs.as_ref().map_or(0, |n| n[r]),
                sampled_logprob: sampled_logprob.as_ref().is_none_or(|w| w[r]),
            })
            .collect();
        let prompt_tokens = token_history("prompt_tokens", prompt_tokens)?;
        let output_tokens = token_history("output_tokens", output_tokens)?;
        Ok(SamplingBatch {
            params,
            prompt_offsets: prompt_offsets.unwrap_or_else(|| vec![0; rows + 1]),
            output_offsets: output_offsets.unwrap_or_else(|| vec![0; rows + 1]),
            prompt_tokens,
            output_tokens,
        })
    }

    /// Rows in the batch.
    #[getter]
    fn rows(&self) -> usize {
        self.params.len()
    }

    #[getter]
    fn temperature(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.temperature).collect()
    }

    #[getter]
    fn top_k(&self) -> Vec<i64> {
        self.params.iter().map(|p| p.top_k).collect()
    }

    #[getter]
    fn top_p(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.top_p).collect()
    }

    #[getter]
    fn min_p(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.min_p).collect()
    }

    #[getter]
    fn repetition_penalty(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.repetition_penalty).collect()
    }

    #[getter]
    fn frequency_penalty(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.frequency_penalty).collect()
    }

    #[getter]
    fn presence_penalty(&self) -> Vec<f32> {
        self.params.iter().map(|p| p.presence_penalty).collect()
    }

    #[getter]
    fn seed(&self) -> Vec<u64> {
        self.params.iter().map(|p| p.seed).collect()
    }

    #[getter]
    fn position(&self) -> Vec<u64> {
        self.params.iter().map(|p| p.position).collect()
    }

    #[getter]
    fn num_logprobs(&self) -> Vec<usize> {
        self.params.iter().map(|p| p.num_logprobs).collect()
    }

    #[getter]
    fn sampled_logprob(&self) -> Vec<bool> {
        self.params.iter().map(|p| p.sampled_logprob).collect()
    }

    #[getter]
    fn prompt_tokens(&self) -> Vec<i32> {
        self.prompt_tokens.clone()
    }

    #[getter]
    fn prompt_offsets(&self) -> Vec<usize> {
        self.prompt_offsets.clone()
    }

    #[getter]
    fn output_tokens(&self) -> Vec<i32> {
        self.output_tokens.clone()
    }

    #[getter]
    fn output_offsets(&self) -> Vec<usize> {
        self.output_offsets.clone()
    }
}

impl SamplingBatch {
    /// The kernel's view of this batch over `logits` [rows, vocab] (checked here).
    fn over<'a>(&'a self, logits: &'a TensorArg) -> PyResult<crate::sampling::Batch<'a>> {
        logits.check(&[DType::F32], 2)?;
        if logits.shape[0] != self.params.len() {
            return Err(PyValueError::new_err(format!(
                "batch: has {} rows, logits has {}",
                self.params.len(),
                logits.shape[0]
            )));
        }
        Ok(crate::sampling::Batch {
            // SAFETY: checked just above; `logits` outlives the returned view.
            logits: unsafe { logits.slice::<f32>() },
            vocab: logits.shape[1],
            params: &self.params,
            prompt_tokens: &self.prompt_tokens,
            prompt_offsets: &self.prompt_offsets,
            output_tokens: &self.output_tokens,
            output_offsets: &self.output_offsets,
        })
    }
}

/// Result of `sample`: tokens, their raw logprobs, their ranks, top-N lists.
type SampleOutput = (Vec<u32>, Vec<f32>, Vec<u32>, Vec<Vec<(u32, f32)>>);

/// Samples one token per row of float32 logits `[B, V]` (see `_core.pyi`).
#[pyfunction]
fn sample(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    batch: &Bound<'_, SamplingBatch>,
) -> PyResult<SampleOutput> {
    let logits = TensorArg::extract("logits", logits)?;
    let batch = batch.get();
    let view = batch.over(&logits)?;
    let samples = py.detach(|| crate::sampling::sample_batch(&view))?;
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

/// Prompt logprobs: row r of float32 logits `[T, V]` predicts `tokens[r]`;
/// its raw logprob, rank and `top` largest raw logprobs (see `_core.pyi`).
#[pyfunction]
fn token_logprobs(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    tokens: Vec<i64>,
    top: usize,
) -> PyResult<Vec<crate::sampling::TokenLogprob>> {
    let logits = TensorArg::extract("logits", logits)?;
    logits.check(&[DType::F32], 2)?;
    let vocab = logits.shape[1];
    // SAFETY: checked just above (CPU, float32, contiguous); used while
    // `logits` lives.
    let x = unsafe { logits.slice::<f32>() };
    Ok(py.detach(|| crate::sampling::token_logprobs(x, vocab, &tokens, top))?)
}

/// The token ids each row may draw after penalties and filters (a debugging aid).
#[pyfunction]
fn sampling_support(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    batch: &Bound<'_, SamplingBatch>,
) -> PyResult<Vec<Vec<u32>>> {
    let logits = TensorArg::extract("logits", logits)?;
    let batch = batch.get();
    let view = batch.over(&logits)?;
    Ok(py.detach(|| crate::sampling::support_batch(&view))?)
}

/// The sampler's uniform draw in (0, 1) for `(seed, position, token)`.
#[pyfunction]
fn sampling_uniform(seed: u64, position: u64, token: u32) -> f64 {
    crate::sampling::uniform(seed, position, token)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SamplingBatch>()?;
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_support, m)?)?;
    m.add_function(wrap_pyfunction!(token_logprobs, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_uniform, m)?)?;
    Ok(())
}
