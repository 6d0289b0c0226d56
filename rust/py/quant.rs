//! The quantized-weight GEMM (`QuantizedLinear`).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::linear::{bias_arg, linear_class};
use super::tensor::{check_no_overlap, kernel_dst, kernel_src, DType, TensorArg};
use crate::cpu::IntPath;
use crate::linear::{LinearWeight, OnPath};
use crate::quant::gguf::BlockType;
use crate::quant::{QuantFormat, QuantWeight};

/// A linear layer's weight quantized to 8 or 4 bits for the integer kernels.
#[pyclass(name = "QuantizedLinear", module = "fastllm._core", frozen)]
pub(super) struct PyQuantizedLinear {
    kernel: OnPath<QuantWeight, IntPath>,
}

impl PyQuantizedLinear {
    /// The weights and path, shared (the decoder stack runs them too).
    pub(super) fn weight(&self) -> LinearWeight {
        Arc::new(self.kernel.clone())
    }

    fn adopt(inner: QuantWeight, path: IntPath) -> Self {
        PyQuantizedLinear {
            kernel: OnPath {
                weight: Arc::new(inner),
                path,
            },
        }
    }
}

fn parse(format: &str, path: Option<&str>) -> PyResult<(QuantFormat, IntPath)> {
    let format = QuantFormat::parse(format).map_err(PyValueError::new_err)?;
    let path = match path {
        Some(name) => IntPath::check(name).map_err(PyValueError::new_err)?,
        None => crate::quant::default_path(),
    };
    Ok((format, path))
}

linear_class!(PyQuantizedLinear, {
    /// Quantizes `weight` [out_features, in_features] (bf16 or f32, CPU) to
    /// `format` ("q8_0", "q4_0", "iq4_nl" or "q4_1"); `bias` [out_features] stays in
    /// f32. `path` names an integer kernel path (default: fastest).
    #[new]
    #[pyo3(signature = (weight, bias=None, format="q8_0", path=None))]
    fn new(
        py: Python<'_>,
        weight: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        format: &str,
        path: Option<&str>,
    ) -> PyResult<Self> {
        let (format, path) = parse(format, path)?;
        let weight = TensorArg::extract("weight", weight)?;
        weight.check(&[DType::BF16, DType::F32], 2)?;
        let (n, k) = (weight.shape[0], weight.shape[1]);
        let bias = bias_arg(bias, n)?;
        // SAFETY: both tensors were checked (dtype, CPU, contiguity, shape)
        // and the caller keeps them alive during the call.
        let (ws, bs) = unsafe { (kernel_src(&weight), bias.as_ref().map(|b| kernel_src(b))) };
        let inner = py.detach(move || QuantWeight::quantize(format, ws, bs, n, k))?;
        Ok(PyQuantizedLinear::adopt(inner, path))
    }

    /// Adopts weights already quantized in GGUF's block layout: `blocks` is
    /// a uint8 tensor of out_features rows of in_features / 32 blocks, or a
    /// list of such tensors of whole rows (a fused matrix's parts, in order).
    #[staticmethod]
    #[pyo3(signature = (blocks, out_features, in_features, format, bias=None, path=None))]
    fn from_blocks(
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        out_features: usize,
        in_features: usize,
        format: &str,
        bias: Option<&Bound<'_, PyAny>>,
        path: Option<&str>,
    ) -> PyResult<Self> {
        let (format, path) = parse(format, path)?;
        let args: Vec<TensorArg> = match blocks.cast::<PyList>() {
            Ok(list) => list
                .iter()
                .map(|item| TensorArg::extract("blocks", &item))
                .collect::<PyResult<_>>()?,
            Err(_) => vec![TensorArg::extract("blocks", blocks)?],
        };
        for a in &args {
            a.check(&[DType::U8], a.shape.len().max(1))?;
        }
        let bias = bias_arg(bias, out_features)?;
        // SAFETY: every part and the bias were checked (dtype, CPU,
        // contiguous, shape) and the caller keeps them alive during the call.
        let parts: Vec<&[u8]> = args.iter().map(|a| unsafe { a.slice::<u8>() }).collect();
        // SAFETY: as above.
        let bs = bias.as_ref().map(|b| unsafe { kernel_src(b) });
        let inner = py.detach(move || {
            QuantWeight::from_block_parts(format, &parts, bs, out_features, in_features)
        })?;
        Ok(PyQuantizedLinear::adopt(inner, path))
    }

    /// Adopts panels packed earlier (`write_panel_file`'s bytes for a layer of
    /// the same format and shape): `panels` is a 64-byte aligned uint8
    /// tensor, typically a view of a mapped file, read where it lies. The
    /// layer keeps the tensor, whose memory must not change.
    #[staticmethod]
    #[pyo3(signature = (panels, out_features, in_features, format, bias=None, path=None))]
    fn from_panels(
        panels: &Bound<'_, PyAny>,
        out_features: usize,
        in_features: usize,
        format: &str,
        bias: Option<&Bound<'_, PyAny>>,
        path: Option<&str>,
    ) -> PyResult<Self> {
        let (format, path) = parse(format, path)?;
        let arg = TensorArg::extract("panels", panels)?;
        arg.check(&[DType::U8], arg.shape.len().max(1))?;
        let bias = bias_arg(bias, out_features)?;
        let owner: Arc<dyn Send + Sync> = Arc::new(panels.clone().unbind());
        // SAFETY: the tensor and the bias were checked (dtype, CPU,
        // contiguous); the layer keeps the tensor alive through `owner` and
        // the caller promises its memory does not change.
        let inner = unsafe {
            let bs = bias.as_ref().map(|b| kernel_src(b));
            QuantWeight::from_panels(
                format,
                arg.slice::<u8>(),
                owner,
                bs,
                out_features,
                in_features,
            )
        }?;
        Ok(PyQuantizedLinear::adopt(inner, path))
    }

    /// out [T, in_features] = rows `ids` [T] (int64) of the weight,
    /// dequantized: the lookup of an embedding table tied to this weight.
    fn embed(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = TensorArg::extract("ids", ids)?;
        ids.check(&[DType::I64], 1)?;
        let t = ids.shape[0];
        let k = self.kernel.weight.in_features();
        let out = TensorArg::extract("out", out)?;
        out.check(&[DType::BF16, DType::F32], 2)?;
        out.expect_dim(0, t, "len(ids)")?;
        out.expect_dim(1, k, "in_features")?;
        // SAFETY: checked (dtype, CPU, contiguity, shape); distinct tensors.
        let (ids, dst) = unsafe { (ids.slice::<i64>(), kernel_dst(&out)) };
        let w = &self.kernel.weight;
        py.detach(move || w.embed(ids, dst))?;
        Ok(())
    }

    /// The weights in GGUF's block layout (rows padded to whole groups).
    fn to_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.kernel.weight.to_blocks())
    }

    /// "q8_0", "q4_0" or "iq4_nl".
    #[getter]
    fn format(&self) -> &'static str {
        self.kernel.weight.format().name()
    }

    fn __repr__(&self) -> String {
        format!(
            "QuantizedLinear(in_features={}, out_features={}, format={}, path={})",
            self.in_features(),
            self.out_features(),
            self.format(),
            self.path()
        )
    }
});

/// Runs the block conversion `f(blocks, out)` without the GIL, once
/// `blocks` (uint8) and `out` (`out_dtype`, whose elements are `T`) are
/// checked (CPU, contiguous) and known not to share memory.
fn convert_blocks<T: Send>(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    out_dtype: DType,
    f: impl FnOnce(&[u8], &mut [T]) -> crate::error::CoreResult<()> + Send,
) -> PyResult<()> {
    let blocks = TensorArg::extract("blocks", blocks)?;
    blocks.check(&[DType::U8], blocks.shape.len().max(1))?;
    let out = TensorArg::extract("out", out)?;
    out.check(&[out_dtype], out.shape.len().max(1))?;
    check_no_overlap(&out, &blocks)?;
    // SAFETY: both checked (dtype, CPU, contiguous), distinct; the caller
    // keeps them alive during the call, and `T` is `out_dtype`'s element.
    let (src, dst) = unsafe { (blocks.slice::<u8>(), out.slice_mut::<T>()) };
    py.detach(move || f(src, dst))?;
    Ok(())
}

/// Dequantizes GGUF blocks of `block_type` ("Q4_K", "Q6_K", "Q5_0", ...;
/// see `gguf_block_types`) from `blocks` (uint8) into `out` (float32,
/// exactly the blocks' values).
#[pyfunction]
fn dequantize_gguf(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    block_type: &str,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let kind = BlockType::parse(block_type).map_err(PyValueError::new_err)?;
    convert_blocks(py, blocks, out, DType::F32, move |src, dst: &mut [f32]| {
        crate::quant::gguf::dequantize(kind, src, dst)
    })
}

/// The `count` strings of a GGUF string array at byte `offset` of `data`
/// (uint8): (list of str, the offset after them). Invalid UTF-8 is
/// replaced (U+FFFD), as some vocabularies hold partial characters.
#[pyfunction]
fn gguf_strings<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    offset: usize,
    count: usize,
) -> PyResult<(Bound<'py, PyList>, usize)> {
    let data = TensorArg::extract("data", data)?;
    data.check(&[DType::U8], 1)?;
    // SAFETY: checked (uint8, CPU, contiguous); the caller keeps it alive.
    let bytes = unsafe { data.slice::<u8>() };
    let (ranges, end) = crate::quant::gguf::string_array(bytes, offset, count)?;
    let list = PyList::empty(py);
    for (a, b) in ranges {
        list.append(String::from_utf8_lossy(&bytes[a..b]))?;
    }
    Ok((list, end))
}

/// Converts GGUF blocks of `block_type` (`gguf_block_types()`) from
/// `blocks` (uint8) to q8_0 blocks in `out` (uint8, 34 bytes per 32
/// weights), in parallel: exactly for Q8_0, Q4_0, Q5_0 and IQ4_NL (a scale
/// times int8 codes), otherwise each block dequantized and quantized again.
#[pyfunction]
fn gguf_to_q8_0(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    block_type: &str,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let kind = BlockType::parse(block_type).map_err(PyValueError::new_err)?;
    convert_blocks(py, blocks, out, DType::U8, move |src, dst: &mut [u8]| {
        crate::quant::gguf::to_q8_0(kind, src, dst)
    })
}

/// Rewrites GGUF Q4_K super-blocks (`blocks`, uint8) as q4_1 blocks in
/// `out` (uint8, 8 * 20 bytes per super-block), for `QuantizedLinear`.
#[pyfunction]
fn gguf_q4_k_to_q4_1(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    convert_blocks(py, blocks, out, DType::U8, crate::quant::gguf::q4_k_to_q4_1)
}

/// GGUF MXFP4 blocks (into `out`, uint8, 17 bytes a block) from `codes`
/// (uint8, 16 bytes a block: codes `2i` and `2i + 1` in byte `i`'s low and
/// high nibble, as gpt-oss's checkpoints pair them) and `scales` (uint8, one
/// E8M0 exponent a block), for `QuantizedLinear.from_blocks(..., "mxfp4")`.
#[pyfunction]
fn mxfp4_from_pairs(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut args = Vec::with_capacity(3);
    for (name, t) in [("codes", codes), ("scales", scales), ("out", out)] {
        let t = TensorArg::extract(name, t)?;
        t.check(&[DType::U8], t.shape.len().max(1))?;
        args.push(t);
    }
    check_no_overlap(&args[2], &args[0])?;
    check_no_overlap(&args[2], &args[1])?;
    // SAFETY: all three checked (uint8, CPU, contiguous), `out` shares memory
    // with neither input; the caller keeps them alive during the call.
    let (c, s, o) = unsafe {
        (
            args[0].slice::<u8>(),
            args[1].slice::<u8>(),
            args[2].slice_mut::<u8>(),
        )
    };
    py.detach(move || crate::quant::gguf::mxfp4_from_pairs(c, s, o))?;
    Ok(())
}

/// GGUF block types `dequantize_gguf` reads.
#[pyfunction]
fn gguf_block_types() -> Vec<&'static str> {
    BlockType::ALL.iter().map(|(_, n)| *n).collect()
}

/// Names of the integer kernel paths this CPU runs.
#[pyfunction]
fn quant_paths() -> Vec<&'static str> {
    IntPath::available().iter().map(|p| p.name()).collect()
}

/// The path `QuantizedLinear` uses when none is named.
#[pyfunction]
fn quant_default_path() -> PyResult<&'static str> {
    crate::cpu::int_path_from_env().map_err(pyo3::exceptions::PyValueError::new_err)?;
    Ok(crate::quant::default_path().name())
}

/// Names of the quantized formats.
#[pyfunction]
fn quant_formats() -> Vec<&'static str> {
    QuantFormat::ALL.iter().map(|f| f.name()).collect()
}

/// Writes a packed-weight file to the open file `fd`: `head` at offset 0,
/// then each layer's panels at its offset (increasing, past the head, not
/// overlapping), zeros between them; in whole chunks of 2 MiB at multiples
/// of 2 MiB (the last one cut at the end), without the GIL.
#[pyfunction]
fn write_panel_file(
    py: Python<'_>,
    fd: i32,
    head: &[u8],
    tables: Vec<(PyRef<'_, PyQuantizedLinear>, u64)>,
) -> PyResult<()> {
    let mut parts: Vec<(u64, &[u8])> = vec![(0, head)];
    for (t, offset) in &tables {
        parts.push((*offset, t.kernel.weight.panel_bytes()));
    }
    for w in parts.windows(2) {
        let end = w[0].0 + w[0].1.len() as u64;
        if w[1].0 < end {
            return Err(PyValueError::new_err(format!(
                "write_panel_file: the table at offset {} overlaps the bytes before it (up to {end})",
                w[1].0
            )));
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        use std::os::unix::io::FromRawFd;
        // SAFETY: the file is the caller's and stays open; ManuallyDrop
        // keeps it from being closed here.
        let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
        py.detach(|| crate::quant::write_chunked(&parts, |at, bytes| file.write_all_at(bytes, at)))
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("write_panel_file: {e}")))
    }
    #[cfg(not(unix))]
    {
        let _ = (py, fd, parts);
        Err(pyo3::exceptions::PyOSError::new_err(
            "write_panel_file: needs a Unix system",
        ))
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyQuantizedLinear>()?;
    m.add_function(wrap_pyfunction!(quant_paths, m)?)?;
    m.add_function(wrap_pyfunction!(quant_default_path, m)?)?;
    m.add_function(wrap_pyfunction!(quant_formats, m)?)?;
    m.add_function(wrap_pyfunction!(write_panel_file, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_gguf, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_block_types, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_strings, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_q4_k_to_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(mxfp4_from_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_to_q8_0, m)?)?;
    Ok(())
}
