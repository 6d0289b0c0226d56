//! The only file that knows PyO3: conversions, GIL release, error mapping.
//!
//! Kernels receive plain slices built from torch tensors' data pointers after
//! `TensorArg` has checked dtype, device, shape and contiguity.

use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use half::bf16;

use crate::attention::{self, BatchLayout, CacheShape};
use crate::error::CoreError;
use crate::kv::{BlockId, BlockPool};

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

// ---- probe and platform ----

/// The command that runs the isolated probe child: this Python interpreter,
/// isolated (`-I -S`), loading this very extension file by path and calling
/// `_probe_child`. A fresh process (spawn, not fork) is safe whatever threads
/// the parent runs.
fn probe_child_command(py: Python<'_>) -> PyResult<Vec<String>> {
    let exe: String = py.import("sys")?.getattr("executable")?.extract()?;
    if exe.is_empty() {
        return Err(PyRuntimeError::new_err(
            "sys.executable is empty, so the CUDA probe child cannot be started",
        ));
    }
    let file: String = py.import("fastllm._core")?.getattr("__file__")?.extract()?;
    let code = "import sys, importlib.util as u\n\
                s = u.spec_from_file_location('fastllm._core', sys.argv[1])\n\
                m = u.module_from_spec(s)\n\
                s.loader.exec_module(m)\n\
                m._probe_child()\n";
    Ok(vec![
        exe,
        "-I".into(),
        "-S".into(),
        "-c".into(),
        code.into(),
        file,
    ])
}

/// Runs the probe (cached), with the GIL released while a child runs.
fn run_probe(py: Python<'_>) -> crate::cuda::ProbeReport {
    match probe_child_command(py) {
        Ok(cmd) => py.detach(|| crate::cuda::probe::probe(&cmd)),
        Err(e) => crate::cuda::ProbeReport::unavailable(format!(
            "could not prepare the CUDA probe child: {e}"
        )),
    }
}

/// The probe report as a dict (the fields of `fastllm.ProbeReport`).
#[pyfunction]
fn _probe(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let report = run_probe(py);
    let out = PyDict::new(py);
    out.set_item("available", report.available)?;
    out.set_item("device_count", report.device_count())?;
    let devices = PyList::empty(py);
    for d in &report.devices {
        let dev = PyDict::new(py);
        dev.set_item("index", d.index)?;
        dev.set_item("name", &d.name)?;
        dev.set_item("total_memory", d.total_memory)?;
        dev.set_item("compute_capability", d.compute_capability)?;
        devices.append(dev)?;
    }
    out.set_item("devices", devices)?;
    out.set_item("driver_version", report.driver_version)?;
    out.set_item("library", report.library)?;
    out.set_item("reason", report.reason)?;
    Ok(out)
}

/// Number of usable CUDA devices; 0 without a GPU. Goes through the isolated probe.
#[pyfunction]
fn get_device_count(py: Python<'_>) -> usize {
    run_probe(py).device_count()
}

/// Entry point of the probe child process: probes, prints the report, exits.
#[pyfunction]
fn _probe_child() {
    #[cfg(unix)]
    {
        // A crashing driver should not spend seconds writing a core file.
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: setrlimit only reads the struct.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    }
    let mut out = std::io::stdout().lock();
    crate::cuda::probe::child_main(&mut out);
    drop(out);
    // The report is out: skip interpreter and driver teardown, whose
    // destructors this probe has no reason to trust.
    #[cfg(unix)]
    // SAFETY: _exit ends the process immediately; stdout was flushed.
    unsafe {
        libc::_exit(0)
    };
    #[cfg(not(unix))]
    std::process::exit(0);
}

/// Initialises the driver in this process, only after the isolated probe
/// succeeded; returns the device count this process sees.
#[pyfunction]
fn _init_driver(py: Python<'_>) -> PyResult<i32> {
    let cmd = probe_child_command(py)?;
    let count = py.detach(|| -> Result<i32, CoreError> {
        let driver = crate::cuda::probe::driver(&cmd)?;
        Ok(driver.device_count()?)
    })?;
    Ok(count)
}

/// The CPU features the kernels choose from, detected at run time.
#[pyfunction]
fn cpu_features(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (name, value) in crate::cpu::features().as_pairs() {
        out.set_item(name, value)?;
    }
    Ok(out)
}

// ---- end probe and platform ----
// ---- kv: block pool ----

/// Token ids from Python, checked to fit the pool's 32-bit storage.
fn token_ids_arg(tokens: Vec<i64>) -> PyResult<Vec<u32>> {
    tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            u32::try_from(t).map_err(|_| {
                PyValueError::new_err(format!(
                    "token_ids[{i}]: token id {t} is out of range (0 to {})",
                    u32::MAX
                ))
            })
        })
        .collect()
}

/// Paged KV-cache block pool with reference counts and a prefix cache.
#[pyclass(name = "BlockPool", module = "fastllm._core")]
struct PyBlockPool {
    inner: BlockPool,
}

impl PyBlockPool {
    /// A block id from Python: negative or too large ids get the same
    /// "unknown block id" error as the pool's own check, not an OverflowError.
    fn id(&self, id: i64) -> PyResult<BlockId> {
        BlockId::try_from(id)
            .ok()
            .filter(|&i| (i as usize) < self.inner.num_blocks())
            .ok_or_else(|| {
                let n = self.inner.num_blocks();
                PyValueError::new_err(format!(
                    "unknown block id {id}: the pool has {n} blocks (ids 0 to {})",
                    n - 1
                ))
            })
    }
}

#[pymethods]
impl PyBlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true))]
    fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> PyResult<Self> {
        Ok(PyBlockPool {
            inner: BlockPool::new(num_blocks, block_size, enable_prefix_caching)?,
        })
    }

    /// Number of blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// Blocks `allocate` can hand out now: free ones plus evictable cached ones.
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    /// A block with reference count 1 and no cached content; evicts the LRU cached block if needed.
    fn allocate(&mut self) -> PyResult<BlockId> {
        Ok(self.inner.allocate()?)
    }

    /// `n` blocks at once, all or nothing.
    fn allocate_many(&mut self, n: i64) -> PyResult<Vec<BlockId>> {
        let n = usize::try_from(n)
            .map_err(|_| PyValueError::new_err(format!("n must be non-negative, got {n}")))?;
        Ok(self.inner.allocate_many(n)?)
    }

    /// Adds a reference (sharing, or a prefix-cache hit on an evictable block).
    fn incref(&mut self, block_id: i64) -> PyResult<()> {
        Ok(self.inner.incref(self.id(block_id)?)?)
    }

    /// Drops one reference; at zero a cached block becomes evictable, any other free.
    fn free(&mut self, block_id: i64) -> PyResult<()> {
        Ok(self.inner.free(self.id(block_id)?)?)
    }

    /// The block's reference count.
    fn ref_count(&self, block_id: i64) -> PyResult<u32> {
        Ok(self.inner.ref_count(self.id(block_id)?)?)
    }

    /// Ids of the longest run of cached full blocks matching the start of `token_ids`.
    fn match_prefix(&mut self, token_ids: Vec<i64>) -> PyResult<Vec<BlockId>> {
        Ok(self.inner.match_prefix(&token_ids_arg(token_ids)?))
    }

    /// Registers a referenced full block holding `token_ids` after `parent_block_id`.
    #[pyo3(signature = (block_id, parent_block_id, token_ids))]
    fn register_full_block(
        &mut self,
        block_id: i64,
        parent_block_id: Option<i64>,
        token_ids: Vec<i64>,
    ) -> PyResult<()> {
        let tokens = token_ids_arg(token_ids)?;
        Ok(self.inner.register_full_block(
            self.id(block_id)?,
            parent_block_id.map(|p| self.id(p)).transpose()?,
            &tokens,
        )?)
    }

    /// A private copy target for a shared block (new id, old one decref'd), else the block itself.
    fn copy_on_write(&mut self, block_id: i64) -> PyResult<BlockId> {
        Ok(self.inner.copy_on_write(self.id(block_id)?)?)
    }

    /// Whether the prefix cache currently points at this block.
    fn is_cached(&self, block_id: i64) -> PyResult<bool> {
        Ok(self.inner.is_cached(self.id(block_id)?)?)
    }

    /// free_blocks, cached_blocks, hits, queries, evictions.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("free_blocks", s.free_blocks)?;
        d.set_item("cached_blocks", s.cached_blocks)?;
        d.set_item("hits", s.hits)?;
        d.set_item("queries", s.queries)?;
        d.set_item("evictions", s.evictions)?;
        Ok(d)
    }

    /// Drops every cache entry unless a cached block is referenced; returns whether it did.
    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "BlockPool(num_blocks={}, block_size={}, free_blocks={}, cached_blocks={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            s.free_blocks,
            s.cached_blocks
        )
    }
}

// ---- end kv: block pool ----
// ---- attention ----

/// Fails unless two tensors' memory ranges are disjoint (a kernel reads one while writing the other).
fn expect_disjoint(a: &TensorArg, b: &TensorArg) -> PyResult<()> {
    let end = |t: &TensorArg| t.ptr + t.numel() * t.dtype.size();
    if a.numel() > 0 && b.numel() > 0 && a.ptr < end(b) && b.ptr < end(a) {
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

/// Checks the two cache tensors and returns their shape.
fn cache_shape(kc: &TensorArg, vc: &TensorArg) -> PyResult<CacheShape> {
    kc.expect(&[DType::F32, DType::BF16], 4)?;
    vc.expect(&[DType::F32, DType::BF16], 4)?;
    expect_same_dtype(vc, kc)?;
    if kc.shape != vc.shape {
        return Err(PyValueError::new_err(format!(
            "value_cache: shape {:?} must match key_cache {:?}",
            vc.shape, kc.shape
        )));
    }
    expect_disjoint(kc, vc)?;
    Ok(CacheShape {
        num_blocks: kc.shape[0],
        num_kv_heads: kc.shape[1],
        block_size: kc.shape[2],
        head_size: kc.shape[3],
    })
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
        t.expect(&[DType::F32, DType::BF16], 3)?;
        expect_same_dtype(t, &kc)?;
        t.expect_dim(1, shape.num_kv_heads, "num_kv_heads of the cache")?;
        t.expect_dim(2, shape.head_size, "head_size of the cache")?;
        expect_disjoint(t, &kc)?;
        expect_disjoint(t, &vc)?;
    }
    v.expect_dim(0, k.shape[0], "num_tokens of key")?;
    slots.expect(&[DType::I64], 1)?;
    slots.expect_dim(0, k.shape[0], "num_tokens of key")?;
    // SAFETY: dtypes, shapes and contiguity are checked above; the caches are
    // disjoint from each other and from the inputs; the tensors outlive the call.
    unsafe {
        let slots = slots.slice::<i64>();
        match kc.dtype {
            DType::BF16 => {
                let (k, v) = (k.slice::<bf16>(), v.slice::<bf16>());
                let (kc, vc) = (kc.slice_mut::<bf16>(), vc.slice_mut::<bf16>());
                py.detach(|| attention::reshape_and_cache(k, v, kc, vc, slots, shape))?
            }
            _ => {
                let (k, v) = (k.slice::<f32>(), v.slice::<f32>());
                let (kc, vc) = (kc.slice_mut::<f32>(), vc.slice_mut::<f32>());
                py.detach(|| attention::reshape_and_cache(k, v, kc, vc, slots, shape))?
            }
        }
    }
    Ok(())
}

/// Attention of packed new tokens over the paged KV cache, written into `out`.
#[pyfunction]
#[pyo3(signature = (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window = 0))]
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
) -> PyResult<()> {
    let o = TensorArg::extract("out", out)?;
    let q = TensorArg::extract("query", query)?;
    let kc = TensorArg::extract("key_cache", key_cache)?;
    let vc = TensorArg::extract("value_cache", value_cache)?;
    let bt = TensorArg::extract("block_tables", block_tables)?;
    let sl = TensorArg::extract("seq_lens", seq_lens)?;
    let qsl = TensorArg::extract("query_start_loc", query_start_loc)?;
    let shape = cache_shape(&kc, &vc)?;
    q.expect(&[DType::F32, DType::BF16], 3)?;
    expect_same_dtype(&q, &kc)?;
    q.expect_dim(2, shape.head_size, "head_size of the cache")?;
    let num_heads = q.shape[1];
    if num_heads == 0 || num_heads % shape.num_kv_heads.max(1) != 0 {
        return Err(PyValueError::new_err(format!(
            "query: num_heads ({num_heads}) must be a positive multiple of the cache's num_kv_heads ({})",
            shape.num_kv_heads
        )));
    }
    o.expect(&[DType::F32, DType::BF16], 3)?;
    expect_same_dtype(&o, &kc)?;
    if o.shape != q.shape {
        return Err(PyValueError::new_err(format!(
            "out: shape {:?} must match query {:?}",
            o.shape, q.shape
        )));
    }
    for t in [&q, &kc, &vc] {
        expect_disjoint(&o, t)?;
    }
    bt.expect(&[DType::I32], 2)?;
    sl.expect(&[DType::I32], 1)?;
    sl.expect_dim(0, bt.shape[0], "num_seqs of block_tables")?;
    qsl.expect(&[DType::I32], 1)?;
    qsl.expect_dim(0, bt.shape[0] + 1, "num_seqs + 1")?;
    if !scale.is_finite() {
        return Err(PyValueError::new_err(format!(
            "scale: must be finite, got {scale}"
        )));
    }
    // SAFETY: dtypes, shapes and contiguity are checked above; `out` is
    // disjoint from every input; the tensors outlive the call.
    unsafe {
        let batch = BatchLayout {
            block_tables: bt.slice::<i32>(),
            max_blocks_per_seq: bt.shape[1],
            seq_lens: sl.slice::<i32>(),
            query_start_loc: qsl.slice::<i32>(),
        };
        let scale = scale as f32;
        match kc.dtype {
            DType::BF16 => {
                let (o, q) = (o.slice_mut::<bf16>(), q.slice::<bf16>());
                let (kc, vc) = (kc.slice::<bf16>(), vc.slice::<bf16>());
                py.detach(|| {
                    attention::paged_attention(
                        o,
                        q,
                        kc,
                        vc,
                        shape,
                        num_heads,
                        batch,
                        scale,
                        sliding_window,
                    )
                })?
            }
            _ => {
                let (o, q) = (o.slice_mut::<f32>(), q.slice::<f32>());
                let (kc, vc) = (kc.slice::<f32>(), vc.slice::<f32>());
                py.detach(|| {
                    attention::paged_attention(
                        o,
                        q,
                        kc,
                        vc,
                        shape,
                        num_heads,
                        batch,
                        scale,
                        sliding_window,
                    )
                })?
            }
        }
    }
    Ok(())
}

// ---- end attention ----
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
    m.add_function(wrap_pyfunction!(_probe, m)?)?;
    m.add_function(wrap_pyfunction!(get_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_probe_child, m)?)?;
    m.add_function(wrap_pyfunction!(_init_driver, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    // Each part of the core registers its functions and classes below.
    m.add_class::<PyBlockPool>()?; // kv: block pool
                                   // attention
    m.add_function(wrap_pyfunction!(reshape_and_cache, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    // sampling
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_support, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_uniform, m)?)?;
    Ok(())
}
