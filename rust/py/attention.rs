//! CPU paged attention and the KV-cache write.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use half::bf16;

use super::tensor::{DType, TensorArg};
use crate::attention::{
    self, BatchLayout, CacheShape, Element, KvElem, StridedRows, INT8_SCALE_BYTES,
};

/// Fails unless two tensors' memory ranges are disjoint (a kernel reads one while writing the other).
fn expect_disjoint(a: &TensorArg, b: &TensorArg) -> PyResult<()> {
    // The span from the first row to the last: the elements of a contiguous
    // tensor, and what a row-strided view (`check_rows`) reaches.
    let end = |t: &TensorArg| t.ptr + t.row_span() * t.dtype.size();
    if a.row_span() > 0 && b.row_span() > 0 && a.ptr < end(b) && b.ptr < end(a) {
        return Err(PyValueError::new_err(format!(
            "{} and {} must not share memory",
            a.name, b.name
        )));
    }
    Ok(())
}

/// Fails unless `t` has the dtype of `like` (the caches fix the element type).
fn expect_same_dtype(t: &TensorArg, like: &TensorArg) -> PyResult<()> {
    if t.dtype != like.dtype {
        return Err(PyValueError::new_err(format!(
            "{}: dtype {:?} must match {} ({:?})",
            t.name, t.dtype, like.name, like.dtype
        )));
    }
    Ok(())
}

/// Checks the two cache tensors and returns their shape. An int8 cache
/// (`kv_cache_dtype="int8"`) holds rows of `head_size` values followed by
/// their 4-byte scale, so its last dimension is `head_size + 4`.
pub(super) fn cache_shape(kc: &TensorArg, vc: &TensorArg) -> PyResult<CacheShape> {
    kc.check(&[DType::F32, DType::BF16, DType::I8], 4)?;
    vc.check(&[DType::F32, DType::BF16, DType::I8], 4)?;
    expect_same_dtype(vc, kc)?;
    if kc.shape != vc.shape {
        return Err(PyValueError::new_err(format!(
            "value_cache: shape {:?} must match key_cache {:?}",
            vc.shape, kc.shape
        )));
    }
    expect_disjoint(kc, vc)?;
    let extra = if kc.dtype == DType::I8 {
        INT8_SCALE_BYTES
    } else {
        0
    };
    if kc.shape[3] <= extra {
        return Err(PyValueError::new_err(format!(
            "key_cache: an int8 cache's last dimension is head_size + {extra} (the row's scale), got {}",
            kc.shape[3]
        )));
    }
    Ok(CacheShape {
        num_blocks: kc.shape[0],
        num_kv_heads: kc.shape[1],
        block_size: kc.shape[2],
        head_size: kc.shape[3] - extra,
    })
}

/// Fails unless `t` (the query, out, key or value) suits the caches: the
/// caches' dtype, or any float dtype the kernels take when the cache is int8.
fn expect_cache_input(t: &TensorArg, kc: &TensorArg) -> PyResult<()> {
    if kc.dtype == DType::I8 {
        t.check(&[DType::F32, DType::BF16], t.shape.len())?;
        Ok(())
    } else {
        expect_same_dtype(t, kc)
    }
}

/// The tensors that say where a batch's sequences live, checked:
/// `block_tables` (int32 [seqs, max_blocks]), `seq_lens` (int32 [seqs]) and
/// `query_start_loc` (int32 [seqs + 1]).
pub(super) struct BatchArgs {
    block_tables: TensorArg,
    seq_lens: TensorArg,
    query_start_loc: TensorArg,
}

impl BatchArgs {
    pub(super) fn extract(
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
    ) -> PyResult<BatchArgs> {
        let bt = TensorArg::extract("block_tables", block_tables)?;
        bt.check(&[DType::I32], 2)?;
        let sl = TensorArg::extract("seq_lens", seq_lens)?;
        sl.check(&[DType::I32], 1)?;
        sl.expect_dim(0, bt.shape[0], "num_seqs of block_tables")?;
        let qsl = TensorArg::extract("query_start_loc", query_start_loc)?;
        qsl.check(&[DType::I32], 1)?;
        qsl.expect_dim(0, bt.shape[0] + 1, "num_seqs + 1")?;
        Ok(BatchArgs {
            block_tables: bt,
            seq_lens: sl,
            query_start_loc: qsl,
        })
    }

    /// The number of sequences.
    pub(super) fn num_seqs(&self) -> usize {
        self.block_tables.shape[0]
    }

    /// The kernel's view of the tensors.
    ///
    /// # Safety
    /// The tensors stay alive and unwritten while the layout is used.
    pub(super) unsafe fn layout(&self) -> BatchLayout<'_> {
        BatchLayout {
            block_tables: self.block_tables.slice::<i32>(),
            max_blocks_per_seq: self.block_tables.shape[1],
            seq_lens: self.seq_lens.slice::<i32>(),
            query_start_loc: self.query_start_loc.slice::<i32>(),
        }
    }
}

/// Stores new K/V rows into their cache slots (a negative slot skips the token).
#[pyfunction]
fn reshape_and_cache(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    key_cache: &Bound<'_, PyAny>,
    value_cache: &Bound<'_, PyAny>,
    slot_mapping: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let k = TensorArg::extract("key", key)?;
    let v = TensorArg::extract("value", value)?;
    let kc = TensorArg::extract("key_cache", key_cache)?;
    let vc = TensorArg::extract("value_cache", value_cache)?;
    let slots = TensorArg::extract("slot_mapping", slot_mapping)?;
    let shape = cache_shape(&kc, &vc)?;
    for t in [&k, &v] {
        t.check(&[DType::F32, DType::BF16], 3)?;
        expect_cache_input(t, &kc)?;
        expect_same_dtype(t, &k)?;
        t.expect_dim(1, shape.num_kv_heads, "num_kv_heads of the cache")?;
        t.expect_dim(2, shape.head_size, "head_size of the cache")?;
        expect_disjoint(t, &kc)?;
        expect_disjoint(t, &vc)?;
    }
    v.expect_dim(0, k.shape[0], "num_tokens of key")?;
    slots.check(&[DType::I64], 1)?;
    slots.expect_dim(0, k.shape[0], "num_tokens of key")?;
    // SAFETY: dtypes, shapes and contiguity are checked above; the caches are
    // disjoint from each other and from the inputs; the tensors outlive the call.
    unsafe {
        match (k.dtype, kc.dtype) {
            (DType::BF16, DType::I8) => cache_rows::<bf16, i8>(py, &k, &v, &kc, &vc, &slots, shape),
            (_, DType::I8) => cache_rows::<f32, i8>(py, &k, &v, &kc, &vc, &slots, shape),
            (DType::BF16, _) => cache_rows::<bf16, bf16>(py, &k, &v, &kc, &vc, &slots, shape),
            _ => cache_rows::<f32, f32>(py, &k, &v, &kc, &vc, &slots, shape),
        }
    }
}

/// `reshape_and_cache` on the checked tensors, for one element type `T`
/// and cache element `C`.
///
/// # Safety
/// As `TensorArg::slice`: the arguments were checked to hold `T` (the
/// caches `C`), contiguous, the caches disjoint from everything else.
unsafe fn cache_rows<T: Element, C: KvElem<T>>(
    py: Python<'_>,
    k: &TensorArg,
    v: &TensorArg,
    kc: &TensorArg,
    vc: &TensorArg,
    slots: &TensorArg,
    shape: CacheShape,
) -> PyResult<()> {
    let (k, v, slots) = (k.slice::<T>(), v.slice::<T>(), slots.slice::<i64>());
    let (kc, vc) = (kc.slice_mut::<C>(), vc.slice_mut::<C>());
    py.detach(|| attention::reshape_and_cache(k, v, kc, vc, slots, shape))?;
    Ok(())
}

/// Checks the optional attention sinks: float32 `[num_heads]`, CPU, contiguous.
fn sinks_arg(sinks: Option<&Bound<'_, PyAny>>, num_heads: usize) -> PyResult<Option<TensorArg>> {
    match sinks {
        Some(s) if !s.is_none() => {
            let s = TensorArg::extract("sinks", s)?;
            s.check(&[DType::F32], 1)?;
            s.expect_dim(0, num_heads, "num_heads of query")?;
            Ok(Some(s))
        }
        _ => Ok(None),
    }
}

/// Attention of packed new tokens over the paged KV cache, written into `out`.
#[pyfunction]
#[pyo3(signature = (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window = 0, softcap = 0.0, sinks = None))]
#[allow(clippy::too_many_arguments)]
fn paged_attention(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key_cache: &Bound<'_, PyAny>,
    value_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    scale: f64,
    sliding_window: i64,
    softcap: f64,
    sinks: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let o = TensorArg::extract("out", out)?;
    let q = TensorArg::extract("query", query)?;
    let kc = TensorArg::extract("key_cache", key_cache)?;
    let vc = TensorArg::extract("value_cache", value_cache)?;
    let batch = BatchArgs::extract(block_tables, seq_lens, query_start_loc)?;
    let shape = cache_shape(&kc, &vc)?;
    q.check(&[DType::F32, DType::BF16], 3)?;
    expect_cache_input(&q, &kc)?;
    q.expect_dim(2, shape.head_size, "head_size of the cache")?;
    let num_heads = q.shape[1];
    if num_heads == 0 || num_heads % shape.num_kv_heads.max(1) != 0 {
        return Err(PyValueError::new_err(format!(
            "query: num_heads ({num_heads}) must be a positive multiple of the cache's num_kv_heads ({})",
            shape.num_kv_heads
        )));
    }
    o.check(&[DType::F32, DType::BF16], 3)?;
    expect_same_dtype(&o, &q)?;
    o.expect_shape_of(&q)?;
    for t in [&q, &kc, &vc] {
        expect_disjoint(&o, t)?;
    }
    let sinks = sinks_arg(sinks, num_heads)?;
    if let Some(s) = &sinks {
        expect_disjoint(&o, s)?;
    }
    if !scale.is_finite() {
        return Err(PyValueError::new_err(format!(
            "scale: must be finite, got {scale}"
        )));
    }
    // SAFETY: dtypes, shapes and contiguity are checked above; `out` is
    // disjoint from every input; the tensors outlive the call.
    unsafe {
        let args = (
            shape,
            num_heads,
            batch.layout(),
            scale as f32,
            sliding_window,
            softcap as f32,
            sinks.as_ref().map(|s| s.slice::<f32>()),
        );
        match (q.dtype, kc.dtype) {
            (DType::BF16, DType::I8) => attend::<bf16, i8>(py, &o, &q, &kc, &vc, args),
            (_, DType::I8) => attend::<f32, i8>(py, &o, &q, &kc, &vc, args),
            (DType::BF16, _) => attend::<bf16, bf16>(py, &o, &q, &kc, &vc, args),
            _ => attend::<f32, f32>(py, &o, &q, &kc, &vc, args),
        }
    }
}

/// `paged_attention` on the checked tensors, for one element type `T` and
/// cache element `C`; `args` are
/// (cache shape, query heads, batch layout, scale, sliding window, soft-cap,
/// sinks).
///
/// # Safety
/// As `TensorArg::slice`: the tensors were checked to hold `T`, contiguous,
/// `o` disjoint from the others.
unsafe fn attend<T: Element, C: KvElem<T>>(
    py: Python<'_>,
    o: &TensorArg,
    q: &TensorArg,
    kc: &TensorArg,
    vc: &TensorArg,
    (shape, num_heads, batch, scale, window, cap, sinks): (
        CacheShape,
        usize,
        BatchLayout<'_>,
        f32,
        i64,
        f32,
        Option<&[f32]>,
    ),
) -> PyResult<()> {
    let (o, q) = (o.slice_mut::<T>(), q.slice::<T>());
    let (kc, vc) = (kc.slice::<C>(), vc.slice::<C>());
    py.detach(|| {
        attention::paged_attention(
            o, q, kc, vc, shape, num_heads, batch, scale, window, cap, sinks,
        )
    })?;
    Ok(())
}

/// Bidirectional attention of an encoder's packed inputs, written into
/// `out` (`[num_tokens, num_heads, head_size]`, contiguous). `query`,
/// `key`, `value`: `[num_tokens, heads, head_size]` whose rows may be any
/// stride apart (views of a fused projection); `lengths`: the inputs'
/// token counts in order; `band > 0`: a token sees keys at most `band`
/// positions away.
#[pyfunction]
#[pyo3(signature = (out, query, key, value, lengths, scale, band = 0))]
#[allow(clippy::too_many_arguments)]
fn encoder_attention(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    lengths: Vec<usize>,
    scale: f64,
    band: usize,
) -> PyResult<()> {
    let o = TensorArg::extract("out", out)?;
    let q = TensorArg::extract("query", query)?;
    let k = TensorArg::extract("key", key)?;
    let v = TensorArg::extract("value", value)?;
    o.check(&[DType::F32, DType::BF16], 3)?;
    for t in [&q, &k, &v] {
        t.check_rows(&[DType::F32, DType::BF16], 3)?;
        expect_same_dtype(t, &o)?;
        t.expect_dim(0, o.shape[0], "num_tokens of out")?;
        t.expect_dim(2, o.shape[2], "head_size of out")?;
        expect_disjoint(&o, t)?;
    }
    if q.shape != o.shape {
        return Err(PyValueError::new_err(format!(
            "out: shape {:?} must match query {:?}",
            o.shape, q.shape
        )));
    }
    if k.shape != v.shape {
        return Err(PyValueError::new_err(format!(
            "value: shape {:?} must match key {:?}",
            v.shape, k.shape
        )));
    }
    let heads = (q.shape[1], k.shape[1], q.shape[2]);
    let (o, q, k, v) = (&o, &q, &k, &v);
    // SAFETY: dtypes and row layouts are checked above; `out` is disjoint
    // from the inputs; the tensors outlive the call.
    unsafe {
        match o.dtype {
            DType::BF16 => encode::<bf16>(py, (o, q, k, v), heads, &lengths, scale, band),
            _ => encode::<f32>(py, (o, q, k, v), heads, &lengths, scale, band),
        }
    }
}

/// `encoder_attention` on the checked tensors, for one element type.
///
/// # Safety
/// As `TensorArg::rows_slice`: the tensors were checked to hold `T`, rows
/// contiguous, `out` disjoint from the others.
unsafe fn encode<T: Element>(
    py: Python<'_>,
    (o, q, k, v): (&TensorArg, &TensorArg, &TensorArg, &TensorArg),
    heads: (usize, usize, usize),
    lengths: &[usize],
    scale: f64,
    band: usize,
) -> PyResult<()>
where
    f32: KvElem<T>,
{
    unsafe fn rows<T>(t: &TensorArg) -> StridedRows<'_, T> {
        let (data, stride) = t.rows_slice::<T>();
        StridedRows { data, stride }
    }
    let (q, k, v) = (rows::<T>(q), rows::<T>(k), rows::<T>(v));
    let o = o.slice_mut::<T>();
    py.detach(|| attention::encoder_attention(o, q, k, v, heads, lengths, scale as f32, band))?;
    Ok(())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encoder_attention, m)?)?;
    m.add_function(wrap_pyfunction!(reshape_and_cache, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    Ok(())
}
