//! The CPU sampler.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::tensor::{DType, TensorArg};

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
        logits.check(&[DType::F32], 2)?;
        let prompt_tokens = TensorArg::extract("prompt_tokens", prompt_tokens)?;
        prompt_tokens.check(&[DType::I32], 1)?;
        let output_tokens = TensorArg::extract("output_tokens", output_tokens)?;
        output_tokens.check(&[DType::I32], 1)?;
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

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_support, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_uniform, m)?)?;
    Ok(())
}
