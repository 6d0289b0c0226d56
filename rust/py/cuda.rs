//! The CUDA kernels: NVRTC compilation and launches on torch's stream.

use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::platform::probe_child_command;
use super::tensor::{DType, TensorArg};
use crate::error::CoreError;

/// The `nvidia-cuda-nvrtc` wheel's library folders, from `fastllm.nvrtc`.
///
/// Any `Exception` there means "no wheel folders" (the search goes on
/// without them); a `KeyboardInterrupt` or `SystemExit` propagates.
fn nvrtc_wheel_dirs(py: Python<'_>) -> PyResult<Vec<String>> {
    let dirs = py
        .import("fastllm.nvrtc")
        .and_then(|m| m.call_method0("wheel_library_dirs"))
        .and_then(|v| v.extract());
    match dirs {
        Ok(dirs) => Ok(dirs),
        Err(err) if err.is_instance_of::<PyException>(py) => Ok(Vec::new()),
        Err(err) => Err(err),
    }
}

/// The NVRTC library: `nvrtc_path` if given, else the documented search.
fn load_nvrtc(
    py: Python<'_>,
    nvrtc_path: Option<&str>,
) -> PyResult<&'static crate::cuda::nvrtc::Nvrtc> {
    let dirs = nvrtc_wheel_dirs(py)?;
    Ok(py.detach(|| crate::cuda::nvrtc::load(nvrtc_path, &dirs))?)
}

/// NVRTC's version `(major, minor)`; loads NVRTC (never the driver).
#[pyfunction]
#[pyo3(signature = (nvrtc_path=None))]
fn nvrtc_version(py: Python<'_>, nvrtc_path: Option<&str>) -> PyResult<(i32, i32)> {
    Ok(load_nvrtc(py, nvrtc_path)?.version())
}

/// The path of the NVRTC library the search finds.
#[pyfunction]
#[pyo3(signature = (nvrtc_path=None))]
fn nvrtc_library(py: Python<'_>, nvrtc_path: Option<&str>) -> PyResult<String> {
    Ok(load_nvrtc(py, nvrtc_path)?.path().to_string())
}

/// Compiles CUDA C++ `source` to PTX (or a CUBIN) for `arch` through the disk
/// cache; `common.cuh` of `kernels/` is available to `#include`.
#[pyfunction]
#[pyo3(signature = (source, name, arch, cubin=false, nvrtc_path=None))]
fn nvrtc_compile<'py>(
    py: Python<'py>,
    source: &str,
    name: &str,
    arch: &str,
    cubin: bool,
    nvrtc_path: Option<&str>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use crate::cuda::nvrtc::{compile_cached, parse_arch, Output};
    let arch = parse_arch(arch)?;
    let nvrtc = load_nvrtc(py, nvrtc_path)?;
    let output = if cubin { Output::Cubin } else { Output::Ptx };
    let headers = [crate::cuda::kernels::COMMON_HEADER];
    let image = py.detach(|| compile_cached(nvrtc, source, name, &headers, arch, output, &[]))?;
    Ok(pyo3::types::PyBytes::new(py, &image))
}

/// The embedded kernel sources, by file name.
#[pyfunction]
fn kernel_sources(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (name, src) in crate::cuda::kernels::SOURCES {
        out.set_item(name, src)?;
    }
    Ok(out)
}

/// The launch runtime; initialises the driver (after the isolated probe).
fn cuda_runtime(py: Python<'_>) -> PyResult<&'static crate::cuda::launch::Runtime> {
    let cmd = probe_child_command(py)?;
    Ok(py.detach(|| -> Result<_, CoreError> {
        let driver = crate::cuda::probe::driver(&cmd)?;
        crate::cuda::launch::runtime(driver)
    })?)
}

/// Compiles (through the cache) and loads every kernel file on CUDA device
/// `device`; returns the file names.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn cuda_load_kernels(py: Python<'_>, device: i32) -> PyResult<Vec<String>> {
    let rt = cuda_runtime(py)?;
    let dirs = nvrtc_wheel_dirs(py)?;
    Ok(py.detach(|| rt.load_all(device, &dirs))?)
}

fn elem_of(t: &TensorArg) -> crate::cuda::ops::Elem {
    match t.dtype {
        DType::F16 => crate::cuda::ops::Elem::F16,
        DType::BF16 => crate::cuda::ops::Elem::BF16,
        _ => crate::cuda::ops::Elem::F32,
    }
}

/// Devices of `ts` must all equal `ts[0]`'s; returns its ordinal.
fn one_device(ts: &[&TensorArg]) -> PyResult<i32> {
    let mut ordinal = 0;
    for t in ts {
        ordinal = t.same_device(ts[0])?;
    }
    Ok(ordinal)
}

/// Runs one launch with the GIL released.
fn launch_with(
    py: Python<'_>,
    device: i32,
    stream: usize,
    f: impl FnOnce(&crate::cuda::launch::Runtime, crate::cuda::ops::Target<'_>) -> Result<(), CoreError>
        + Send,
) -> PyResult<()> {
    let rt = cuda_runtime(py)?;
    let dirs = nvrtc_wheel_dirs(py)?;
    py.detach(|| {
        let target = crate::cuda::ops::Target {
            device,
            stream,
            wheel_dirs: &dirs,
        };
        f(rt, target)
    })?;
    Ok(())
}

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// CUDA cache write: key/value rows into their slots (negative or out-of-range slots skipped).
#[pyfunction]
fn cuda_reshape_and_cache(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    key_cache: &Bound<'_, PyAny>,
    value_cache: &Bound<'_, PyAny>,
    slot_mapping: &Bound<'_, PyAny>,
    stream: usize,
) -> PyResult<()> {
    let kc = TensorArg::extract("key_cache", key_cache)?;
    kc.expect_cuda(FLOATS, 4)?;
    let vc = TensorArg::extract("value_cache", value_cache)?;
    vc.expect_cuda(&[kc.dtype], 4)?;
    for d in 0..4 {
        vc.expect_dim(d, kc.shape[d], "same shape as key_cache")?;
    }
    let (kvh, bs, hd) = (kc.shape[1], kc.shape[2], kc.shape[3]);
    let k = TensorArg::extract("key", key)?;
    k.expect_cuda_rows(&[kc.dtype], 3)?;
    let n = k.shape[0];
    k.expect_dim(1, kvh, "num_kv_heads")?;
    k.expect_dim(2, hd, "head_size")?;
    let v = TensorArg::extract("value", value)?;
    v.expect_cuda_rows(&[kc.dtype], 3)?;
    v.expect_dim(0, n, "num_tokens")?;
    v.expect_dim(1, kvh, "num_kv_heads")?;
    v.expect_dim(2, hd, "head_size")?;
    let s = TensorArg::extract("slot_mapping", slot_mapping)?;
    s.expect_cuda(&[DType::I64], 1)?;
    s.expect_dim(0, n, "num_tokens")?;
    let device = one_device(&[&kc, &vc, &k, &v, &s])?;
    let args = crate::cuda::ops::CacheWrite {
        elem: elem_of(&kc),
        key: k.ptr as u64,
        value: v.ptr as u64,
        key_cache: kc.ptr as u64,
        value_cache: vc.ptr as u64,
        slot_mapping: s.ptr as u64,
        num_tokens: n,
        key_stride: k.row_stride(),
        value_stride: v.row_stride(),
        num_kv_heads: kvh,
        head_size: hd,
        block_size: bs,
        num_slots: kc.shape[0] * bs,
    };
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::reshape_and_cache(rt, t, &args)
    })
}

/// CUDA paged attention with the CPU kernel's contract, written into `out`.
#[pyfunction]
#[pyo3(signature = (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap, stream, sinks = None))]
#[allow(clippy::too_many_arguments)]
fn cuda_paged_attention(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key_cache: &Bound<'_, PyAny>,
    value_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    scale: f32,
    sliding_window: i64,
    softcap: f32,
    stream: usize,
    sinks: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let kc = TensorArg::extract("key_cache", key_cache)?;
    kc.expect_cuda(FLOATS, 4)?;
    let vc = TensorArg::extract("value_cache", value_cache)?;
    vc.expect_cuda(&[kc.dtype], 4)?;
    for d in 0..4 {
        vc.expect_dim(d, kc.shape[d], "same shape as key_cache")?;
    }
    let q = TensorArg::extract("query", query)?;
    q.expect_cuda(&[kc.dtype], 3)?;
    q.expect_dim(2, kc.shape[3], "the caches' head_size")?;
    let o = TensorArg::extract("out", out)?;
    o.expect_cuda(&[kc.dtype], 3)?;
    for d in 0..3 {
        o.expect_dim(d, q.shape[d], "same shape as query")?;
    }
    let bt = TensorArg::extract("block_tables", block_tables)?;
    bt.expect_cuda(&[DType::I32], 2)?;
    let num_seqs = bt.shape[0];
    let sl = TensorArg::extract("seq_lens", seq_lens)?;
    sl.expect_cuda(&[DType::I32], 1)?;
    sl.expect_dim(0, num_seqs, "num_seqs, the rows of block_tables")?;
    let qsl = TensorArg::extract("query_start_loc", query_start_loc)?;
    qsl.expect_cuda(&[DType::I32], 1)?;
    qsl.expect_dim(0, num_seqs + 1, "num_seqs + 1")?;
    if !scale.is_finite() {
        return Err(PyValueError::new_err(format!(
            "scale: must be finite, got {scale}"
        )));
    }
    if !(softcap.is_finite() && softcap >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "softcap: must be a finite number >= 0 (0: none), got {softcap}"
        )));
    }
    let sinks = match sinks {
        Some(s) if !s.is_none() => {
            let s = TensorArg::extract("sinks", s)?;
            s.expect_cuda(&[DType::F32], 1)?;
            s.expect_dim(0, q.shape[1], "num_heads of query")?;
            Some(s)
        }
        _ => None,
    };
    let mut tensors = vec![&kc, &vc, &q, &o, &bt, &sl, &qsl];
    tensors.extend(sinks.as_ref());
    let device = one_device(&tensors)?;
    let args = crate::cuda::ops::Attention {
        elem: elem_of(&kc),
        out: o.ptr as u64,
        query: q.ptr as u64,
        key_cache: kc.ptr as u64,
        value_cache: vc.ptr as u64,
        block_tables: bt.ptr as u64,
        seq_lens: sl.ptr as u64,
        query_start_loc: qsl.ptr as u64,
        num_tokens: q.shape[0],
        num_seqs,
        num_heads: q.shape[1],
        num_kv_heads: kc.shape[1],
        head_size: kc.shape[3],
        block_size: kc.shape[2],
        max_blocks: bt.shape[1],
        scale,
        sliding_window,
        softcap,
        sinks: sinks.as_ref().map_or(0, |s| s.ptr as u64),
    };
    if num_seqs == 0 {
        return Ok(());
    }
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::paged_attention(rt, t, &args)
    })
}

/// CUDA RMSNorm: `out = weight * T(x * rsqrt(mean(x^2) + eps))` over the last dimension.
#[pyfunction]
fn cuda_rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    stream: usize,
) -> PyResult<()> {
    let xa = TensorArg::extract("x", x)?;
    xa.expect_cuda_rows(FLOATS, 2)?;
    let (rows, dim) = (xa.shape[0], xa.shape[1]);
    let w = TensorArg::extract("weight", weight)?;
    w.expect_cuda(&[xa.dtype], 1)?;
    w.expect_dim(0, dim, "the last dimension of x")?;
    let o = TensorArg::extract("out", out)?;
    o.expect_cuda(&[xa.dtype], 2)?;
    o.expect_dim(0, rows, "rows of x")?;
    o.expect_dim(1, dim, "the last dimension of x")?;
    let device = one_device(&[&xa, &w, &o])?;
    let args = crate::cuda::ops::RmsNorm {
        elem: elem_of(&xa),
        out: o.ptr as u64,
        x: xa.ptr as u64,
        weight: w.ptr as u64,
        rows,
        x_stride: xa.row_stride(),
        dim,
        eps,
    };
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::rms_norm(rt, t, &args)
    })
}

/// CUDA neox rotary: `out` = x [tokens, heads, head] rotated by cos/sin [tokens, half].
#[pyfunction]
fn cuda_rotary(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    stream: usize,
) -> PyResult<()> {
    let xa = TensorArg::extract("x", x)?;
    xa.expect_cuda_rows(FLOATS, 3)?;
    let (tokens, heads, head_size) = (xa.shape[0], xa.shape[1], xa.shape[2]);
    let c = TensorArg::extract("cos", cos)?;
    c.expect_cuda_rows(&[xa.dtype], 2)?;
    c.expect_dim(0, tokens, "tokens of x")?;
    let s = TensorArg::extract("sin", sin)?;
    s.expect_cuda_rows(&[xa.dtype], 2)?;
    s.expect_dim(0, tokens, "tokens of x")?;
    s.expect_dim(1, c.shape[1], "same width as cos")?;
    if c.row_stride() != s.row_stride() {
        return Err(PyValueError::new_err(format!(
            "sin: row stride {} differs from cos's {}",
            s.row_stride(),
            c.row_stride()
        )));
    }
    let o = TensorArg::extract("out", out)?;
    o.expect_cuda(&[xa.dtype], 3)?;
    for d in 0..3 {
        o.expect_dim(d, xa.shape[d], "same shape as x")?;
    }
    let device = one_device(&[&xa, &c, &s, &o])?;
    let args = crate::cuda::ops::Rotary {
        elem: elem_of(&xa),
        out: o.ptr as u64,
        x: xa.ptr as u64,
        cos: c.ptr as u64,
        sin: s.ptr as u64,
        tokens,
        x_stride: xa.row_stride(),
        cs_stride: c.row_stride(),
        heads,
        head_size,
        half: c.shape[1],
    };
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::rotary(rt, t, &args)
    })
}

/// CUDA SiLU-and-multiply: `out = silu(x[:, :d]) * x[:, d:]` for x [rows, 2d].
#[pyfunction]
fn cuda_silu_and_mul(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    stream: usize,
) -> PyResult<()> {
    let xa = TensorArg::extract("x", x)?;
    xa.expect_cuda_rows(FLOATS, 2)?;
    if xa.shape[1] % 2 != 0 {
        return Err(PyValueError::new_err(format!(
            "x: last dimension must be even, got {}",
            xa.shape[1]
        )));
    }
    let (rows, d) = (xa.shape[0], xa.shape[1] / 2);
    let o = TensorArg::extract("out", out)?;
    o.expect_cuda(&[xa.dtype], 2)?;
    o.expect_dim(0, rows, "rows of x")?;
    o.expect_dim(1, d, "half the last dimension of x")?;
    let device = one_device(&[&xa, &o])?;
    let args = crate::cuda::ops::SiluAndMul {
        elem: elem_of(&xa),
        out: o.ptr as u64,
        x: xa.ptr as u64,
        rows,
        x_stride: xa.row_stride(),
        d,
    };
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::silu_and_mul(rt, t, &args)
    })
}

/// CUDA sampler: one token per row of float32 `logits` [rows, vocab] with the CPU sampler's semantics.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_sample(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    fparams: &Bound<'_, PyAny>,
    iparams: &Bound<'_, PyAny>,
    prompt_tokens: &Bound<'_, PyAny>,
    prompt_offsets: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    output_offsets: &Bound<'_, PyAny>,
    w_workspace: &Bound<'_, PyAny>,
    count_workspace: &Bound<'_, PyAny>,
    out_token: &Bound<'_, PyAny>,
    out_logprob: &Bound<'_, PyAny>,
    out_rank: &Bound<'_, PyAny>,
    stream: usize,
) -> PyResult<()> {
    let l = TensorArg::extract("logits", logits)?;
    l.expect_cuda(&[DType::F32], 2)?;
    let (rows, vocab) = (l.shape[0], l.shape[1]);
    let fp = TensorArg::extract("fparams", fparams)?;
    fp.expect_cuda(&[DType::F32], 2)?;
    fp.expect_dim(0, rows, "rows of logits")?;
    fp.expect_dim(
        1,
        6,
        "temperature, top_p, min_p, repetition, frequency, presence",
    )?;
    let ip = TensorArg::extract("iparams", iparams)?;
    ip.expect_cuda(&[DType::I64], 2)?;
    ip.expect_dim(0, rows, "rows of logits")?;
    ip.expect_dim(1, 3, "top_k, seed, position")?;
    let pt = TensorArg::extract("prompt_tokens", prompt_tokens)?;
    pt.expect_cuda(&[DType::I32], 1)?;
    let po = TensorArg::extract("prompt_offsets", prompt_offsets)?;
    po.expect_cuda(&[DType::I64], 1)?;
    po.expect_dim(0, rows + 1, "rows + 1")?;
    let ot = TensorArg::extract("output_tokens", output_tokens)?;
    ot.expect_cuda(&[DType::I32], 1)?;
    let oo = TensorArg::extract("output_offsets", output_offsets)?;
    oo.expect_cuda(&[DType::I64], 1)?;
    oo.expect_dim(0, rows + 1, "rows + 1")?;
    let w = TensorArg::extract("w_workspace", w_workspace)?;
    w.expect_cuda(&[DType::F32], 2)?;
    let c = TensorArg::extract("count_workspace", count_workspace)?;
    c.expect_cuda(&[DType::I32], 2)?;
    // A workspace no row uses may be empty ([0, vocab]): `w` serves rows that
    // are not plain greedy, `count` rows with penalties (the caller knows which).
    for ws in [&w, &c] {
        if ws.shape[0] != 0 {
            ws.expect_dim(0, rows, "rows of logits, or 0 when no row needs it")?;
        }
        ws.expect_dim(1, vocab, "vocab of logits")?;
    }
    let tok = TensorArg::extract("out_token", out_token)?;
    tok.expect_cuda(&[DType::I32], 1)?;
    let lp = TensorArg::extract("out_logprob", out_logprob)?;
    lp.expect_cuda(&[DType::F32], 1)?;
    let rk = TensorArg::extract("out_rank", out_rank)?;
    rk.expect_cuda(&[DType::I32], 1)?;
    for o in [&tok, &lp, &rk] {
        o.expect_dim(0, rows, "rows of logits")?;
    }
    let device = one_device(&[&l, &fp, &ip, &pt, &po, &ot, &oo, &w, &c, &tok, &lp, &rk])?;
    if rows == 0 {
        return Ok(());
    }
    let args = crate::cuda::ops::Sample {
        logits: l.ptr as u64,
        rows,
        vocab,
        fparams: fp.ptr as u64,
        iparams: ip.ptr as u64,
        prompt_tokens: pt.ptr as u64,
        prompt_offsets: po.ptr as u64,
        output_tokens: ot.ptr as u64,
        output_offsets: oo.ptr as u64,
        w_workspace: w.ptr as u64,
        count_workspace: c.ptr as u64,
        out_token: tok.ptr as u64,
        out_logprob: lp.ptr as u64,
        out_rank: rk.ptr as u64,
    };
    launch_with(py, device, stream, move |rt, t| {
        crate::cuda::ops::sample(rt, t, &args)
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for f in [
        wrap_pyfunction!(nvrtc_version, m)?,
        wrap_pyfunction!(nvrtc_library, m)?,
        wrap_pyfunction!(nvrtc_compile, m)?,
        wrap_pyfunction!(kernel_sources, m)?,
        wrap_pyfunction!(cuda_load_kernels, m)?,
        wrap_pyfunction!(cuda_reshape_and_cache, m)?,
        wrap_pyfunction!(cuda_paged_attention, m)?,
        wrap_pyfunction!(cuda_rms_norm, m)?,
        wrap_pyfunction!(cuda_rotary, m)?,
        wrap_pyfunction!(cuda_silu_and_mul, m)?,
        wrap_pyfunction!(cuda_sample, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
