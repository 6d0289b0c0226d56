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
            CoreError::Internal(m) => PyRuntimeError::new_err(m),
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
    /// The CUDA ordinal of a CUDA tensor (`tensor.device.index`).
    pub device_index: Option<i64>,
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
        let device_obj = obj.getattr("device")?;
        let device: String = device_obj.getattr("type")?.extract()?;
        let device_index: Option<i64> = device_obj.getattr("index")?.extract()?;
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let strides: Vec<isize> = obj.call_method0("stride")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        Ok(TensorArg {
            name,
            ptr,
            dtype,
            device,
            device_index,
            shape,
            strides,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks device, dtype, rank and C-contiguity in one call.
    pub fn check(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        if self.device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CPU tensor, got device '{}'",
                self.name, self.device
            )));
        }
        self.expect_layout(dtypes, ndim, 0)
    }

    /// As `check`, for a tensor on a CUDA device.
    pub fn expect_cuda(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        self.expect_cuda_device()?;
        self.expect_layout(dtypes, ndim, 0)
    }

    /// As `expect_cuda`, but rows (dimension 0) may be any stride apart, as in
    /// a view of a fused projection; the other dimensions are contiguous.
    pub fn expect_cuda_rows(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        self.expect_cuda_device()?;
        self.expect_layout(dtypes, ndim, 1)
    }

    fn expect_cuda_device(&self) -> PyResult<()> {
        if self.device != "cuda" || self.device_index.is_none() {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CUDA tensor, got device '{}'",
                self.name, self.device
            )));
        }
        Ok(())
    }

    /// The CUDA ordinal, checked to be the same as `other`'s.
    pub fn same_device(&self, other: &TensorArg) -> PyResult<i32> {
        if self.device != other.device || self.device_index != other.device_index {
            return Err(PyValueError::new_err(format!(
                "{}: on device {}:{:?}, but {} is on {}:{:?}",
                self.name,
                self.device,
                self.device_index,
                other.name,
                other.device,
                other.device_index
            )));
        }
        Ok(self.device_index.unwrap_or(0) as i32)
    }

    /// Stride of dimension 0 in elements (the row pitch of `expect_cuda_rows`).
    pub fn row_stride(&self) -> i64 {
        self.strides.first().copied().unwrap_or(0) as i64
    }

    /// Dtype, rank and contiguity of the dimensions from `free_leading` on.
    fn expect_layout(&self, dtypes: &[DType], ndim: usize, free_leading: usize) -> PyResult<&Self> {
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
            if dim < free_leading {
                if size > 1 && stride < expected {
                    return Err(PyValueError::new_err(format!(
                        "{}: rows must not overlap (dimension {} has stride {}, rows are {} long)",
                        self.name, dim, stride, expected
                    )));
                }
                continue;
            }
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
    /// `check` must have checked dtype (matching `T`) and contiguity, and the
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
    kc.check(&[DType::F32, DType::BF16], 4)?;
    vc.check(&[DType::F32, DType::BF16], 4)?;
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
        t.check(&[DType::F32, DType::BF16], 3)?;
        expect_same_dtype(t, &kc)?;
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
    q.check(&[DType::F32, DType::BF16], 3)?;
    expect_same_dtype(&q, &kc)?;
    q.expect_dim(2, shape.head_size, "head_size of the cache")?;
    let num_heads = q.shape[1];
    if num_heads == 0 || num_heads % shape.num_kv_heads.max(1) != 0 {
        return Err(PyValueError::new_err(format!(
            "query: num_heads ({num_heads}) must be a positive multiple of the cache's num_kv_heads ({})",
            shape.num_kv_heads
        )));
    }
    o.check(&[DType::F32, DType::BF16], 3)?;
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
    bt.check(&[DType::I32], 2)?;
    sl.check(&[DType::I32], 1)?;
    sl.expect_dim(0, bt.shape[0], "num_seqs of block_tables")?;
    qsl.check(&[DType::I32], 1)?;
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

// ---- end sampling ----

// ---- cuda kernels ----

/// The `nvidia-cuda-nvrtc` wheel's library folders, from `fastllm.nvrtc`.
fn nvrtc_wheel_dirs(py: Python<'_>) -> Vec<String> {
    py.import("fastllm.nvrtc")
        .and_then(|m| m.call_method0("wheel_library_dirs"))
        .and_then(|v| v.extract())
        .unwrap_or_default()
}

/// The NVRTC library: `nvrtc_path` if given, else the documented search.
fn load_nvrtc(
    py: Python<'_>,
    nvrtc_path: Option<&str>,
) -> PyResult<&'static crate::cuda::nvrtc::Nvrtc> {
    let dirs = nvrtc_wheel_dirs(py);
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
    let dirs = nvrtc_wheel_dirs(py);
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
    let dirs = nvrtc_wheel_dirs(py);
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
    stream: usize,
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
    let device = one_device(&[&kc, &vc, &q, &o, &bt, &sl, &qsl])?;
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

// ---- end cuda kernels ----

// ---- linear ----

/// Borrows a checked bf16 / f32 tensor as a kernel source.
///
/// # Safety
/// As `TensorArg::slice`: `expect` has checked the dtype and contiguity.
unsafe fn linear_src(t: &TensorArg) -> crate::linear::Src<'_> {
    match t.dtype {
        DType::BF16 => crate::linear::Src::Bf16(t.slice::<half::bf16>()),
        _ => crate::linear::Src::F32(t.slice::<f32>()),
    }
}

/// Borrows a checked bf16 / f32 tensor as a kernel destination.
///
/// # Safety
/// As `TensorArg::slice_mut`: `expect` has checked the dtype and contiguity,
/// and nothing else reads or writes the tensor during the call.
unsafe fn linear_dst(t: &TensorArg) -> crate::linear::Dst<'_> {
    match t.dtype {
        DType::BF16 => crate::linear::Dst::Bf16(t.slice_mut::<half::bf16>()),
        _ => crate::linear::Dst::F32(t.slice_mut::<f32>()),
    }
}

/// Byte range of a tensor's elements.
fn byte_range(t: &TensorArg) -> (usize, usize) {
    (t.ptr, t.ptr + t.numel() * t.dtype.size())
}

/// Rejects `out` sharing memory with an input (the kernel reads weights and
/// bias while other threads write `out`).
fn check_no_overlap(out: &TensorArg, other: &TensorArg) -> PyResult<()> {
    let (a0, a1) = byte_range(out);
    let (b0, b1) = byte_range(other);
    if a0 < b1 && b0 < a1 {
        return Err(PyValueError::new_err(format!(
            "{}: must not share memory with {}",
            out.name, other.name
        )));
    }
    Ok(())
}

/// out = x @ weight^T (+ bias): x [M, K], weight [N, K], bias [N], out [M, N].
#[pyfunction]
#[pyo3(signature = (out, x, weight, bias=None, path=None))]
fn linear(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    path: Option<&str>,
) -> PyResult<()> {
    let floats = [DType::BF16, DType::F32];
    let weight = TensorArg::extract("weight", weight)?;
    weight.check(&floats, 2)?;
    let (n, k) = (weight.shape[0], weight.shape[1]);
    let x = TensorArg::extract("x", x)?;
    x.check(&floats, 2)?;
    x.expect_dim(1, k, "in_features of weight")?;
    let m = x.shape[0];
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], 2)?;
    out.expect_dim(0, m, "rows of x")?;
    out.expect_dim(1, n, "out_features of weight")?;
    let bias = match bias {
        Some(b) if !b.is_none() => {
            let b = TensorArg::extract("bias", b)?;
            b.check(&floats, 1)?;
            b.expect_dim(0, n, "out_features of weight")?;
            check_no_overlap(&out, &b)?;
            Some(b)
        }
        _ => None,
    };
    check_no_overlap(&out, &x)?;
    check_no_overlap(&out, &weight)?;
    let path = match path {
        Some(name) => Some(crate::linear::check_path(name).map_err(PyValueError::new_err)?),
        None => None,
    };
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, ws, bs) = unsafe {
        let dst = linear_dst(&out);
        (
            dst,
            linear_src(&x),
            linear_src(&weight),
            bias.as_ref().map(|b| linear_src(b)),
        )
    };
    py.detach(move || match path {
        Some(p) => crate::linear::linear_with_path(p, dst, xs, ws, bs, m, n, k),
        None => crate::linear::linear(dst, xs, ws, bs, m, n, k),
    })?;
    Ok(())
}

/// Names of the linear kernel paths this CPU runs.
#[pyfunction]
fn linear_paths() -> Vec<&'static str> {
    crate::linear::available_paths()
        .iter()
        .map(|p| p.name())
        .collect()
}

/// The path `linear` uses when none is named, for `m` rows of bf16 (or f32) x.
#[pyfunction]
#[pyo3(signature = (m=1, x_bf16=true))]
fn linear_default_path(m: usize, x_bf16: bool) -> PyResult<&'static str> {
    Ok(crate::linear::default_path(m, x_bf16)?.name())
}

/// STREAM-triad memory bandwidth in GB/s over f32 arrays of `bytes` each.
#[pyfunction]
#[pyo3(signature = (bytes=200_000_000, repeats=5))]
fn stream_triad_gbs(py: Python<'_>, bytes: usize, repeats: usize) -> PyResult<f64> {
    Ok(py.detach(|| crate::linear::stream_triad_gbs(bytes, repeats))?)
}

// ---- end linear ----

// ---- packed linear (gemm) ----

/// A linear layer's weight (and bias) packed for the CPU GEMM kernel.
#[pyclass(name = "PackedLinear", module = "fastllm._core", frozen)]
struct PyPackedLinear {
    inner: crate::gemm::PackedWeight,
    path: crate::linear::Path,
}

#[pymethods]
impl PyPackedLinear {
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
        let bias = match bias {
            Some(b) if !b.is_none() => {
                let b = TensorArg::extract("bias", b)?;
                b.check(&floats, 1)?;
                b.expect_dim(0, n, "out_features of weight")?;
                Some(b)
            }
            _ => None,
        };
        let path = match path {
            Some(name) => crate::linear::check_path(name).map_err(PyValueError::new_err)?,
            None => crate::gemm::default_path(),
        };
        // SAFETY: both tensors were checked (dtype, CPU, contiguity, shape)
        // and the caller keeps them alive during the call.
        let (ws, bs) = unsafe { (linear_src(&weight), bias.as_ref().map(|b| linear_src(b))) };
        let inner = py.detach(move || crate::gemm::PackedWeight::pack(ws, bs, n, k))?;
        Ok(PyPackedLinear { inner, path })
    }

    /// out [M, out_features] = x [M, in_features] @ weight^T + bias.
    fn forward(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let floats = [DType::BF16, DType::F32];
        let (n, k) = (self.inner.out_features(), self.inner.in_features());
        let x = TensorArg::extract("x", x)?;
        x.check(&floats, 2)?;
        x.expect_dim(1, k, "in_features")?;
        let m = x.shape[0];
        let out = TensorArg::extract("out", out)?;
        out.check(&floats, 2)?;
        out.expect_dim(0, m, "rows of x")?;
        out.expect_dim(1, n, "out_features")?;
        check_no_overlap(&out, &x)?;
        // SAFETY: x and out were checked (dtype, CPU, contiguity, shape) and
        // share no memory; the caller keeps them alive.
        let (dst, xs) = unsafe {
            let dst = match out.dtype {
                DType::BF16 => crate::linear::Dst::Bf16(out.slice_mut::<half::bf16>()),
                _ => crate::linear::Dst::F32(out.slice_mut::<f32>()),
            };
            (dst, linear_src(&x))
        };
        let (w, path) = (&self.inner, self.path);
        py.detach(move || crate::gemm::gemm_with_path(path, dst, xs, w, m))?;
        Ok(())
    }

    #[getter]
    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    #[getter]
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }

    /// Bytes of packed weights.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// "bfloat16" or "float32": how the weights are stored.
    #[getter]
    fn weight_dtype(&self) -> &'static str {
        if self.inner.is_bf16() {
            "bfloat16"
        } else {
            "float32"
        }
    }

    /// The kernel path this layer runs.
    #[getter]
    fn path(&self) -> &'static str {
        self.path.name()
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
}

/// The path `PackedLinear` uses when none is named.
#[pyfunction]
fn gemm_default_path() -> &'static str {
    crate::gemm::default_path().name()
}

// ---- end packed linear ----

// ---- layers (RMSNorm, SiLU-and-mul) ----

/// out [rows, dim] = RMSNorm(x [rows, dim]) * weight [dim]; one dtype.
#[pyfunction]
fn rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], 2)?;
    let dim = x.shape[1];
    let weight = TensorArg::extract("weight", weight)?;
    weight.check(&[x.dtype], 1)?;
    weight.expect_dim(0, dim, "the last dimension of x")?;
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], 2)?;
    out.expect_dim(0, x.shape[0], "rows of x")?;
    out.expect_dim(1, dim, "the last dimension of x")?;
    check_no_overlap(&out, &x)?;
    check_no_overlap(&out, &weight)?;
    // SAFETY: all three were checked (dtype, CPU, contiguity, shape) and out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, ws) = unsafe {
        let dst = linear_dst(&out);
        (dst, linear_src(&x), linear_src(&weight))
    };
    py.detach(move || crate::layers::rms_norm(dst, xs, ws, eps, dim))?;
    Ok(())
}

/// out [rows, d] = silu(x[:, :d]) * x[:, d:] for x [rows, 2d]; one dtype.
#[pyfunction]
fn silu_and_mul(py: Python<'_>, out: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], 2)?;
    if x.shape[1] % 2 != 0 {
        return Err(PyValueError::new_err(format!(
            "x: the last dimension must be even (gate and up halves), got {}",
            x.shape[1]
        )));
    }
    let d = x.shape[1] / 2;
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], 2)?;
    out.expect_dim(0, x.shape[0], "rows of x")?;
    out.expect_dim(1, d, "half the last dimension of x")?;
    check_no_overlap(&out, &x)?;
    // SAFETY: both were checked (dtype, CPU, contiguity, shape) and share no
    // memory; the caller keeps them alive.
    let (dst, xs) = unsafe {
        let dst = linear_dst(&out);
        (dst, linear_src(&x))
    };
    py.detach(move || crate::layers::silu_and_mul(dst, xs, d))?;
    Ok(())
}

/// Splits qkv [T, (h + 2 kv) * d] into q [T, h, d], k [T, kv, d] and
/// v [T, kv * d], rotating q and k with cos / sin [T, half]; one dtype.
#[pyfunction]
fn qkv_rotary(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    qkv: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let qkv = TensorArg::extract("qkv", qkv)?;
    qkv.check(&[DType::BF16, DType::F32], 2)?;
    let dt = [qkv.dtype];
    let q = TensorArg::extract("q", q)?;
    q.check(&dt, 3)?;
    let (tokens, heads, head_dim) = (q.shape[0], q.shape[1], q.shape[2]);
    let k = TensorArg::extract("k", k)?;
    k.check(&dt, 3)?;
    k.expect_dim(0, tokens, "tokens of q")?;
    k.expect_dim(2, head_dim, "the head size of q")?;
    let kv_heads = k.shape[1];
    let v = TensorArg::extract("v", v)?;
    v.check(&dt, 2)?;
    v.expect_dim(0, tokens, "tokens of q")?;
    v.expect_dim(1, kv_heads * head_dim, "kv heads x head size of k")?;
    qkv.expect_dim(0, tokens, "tokens of q")?;
    qkv.expect_dim(
        1,
        (heads + 2 * kv_heads) * head_dim,
        "(q + 2 kv heads) x head size",
    )?;
    let cos = TensorArg::extract("cos", cos)?;
    cos.check(&dt, 2)?;
    cos.expect_dim(0, tokens, "tokens of q")?;
    let half = cos.shape[1];
    let sin = TensorArg::extract("sin", sin)?;
    sin.check(&dt, 2)?;
    sin.expect_dim(0, tokens, "tokens of q")?;
    sin.expect_dim(1, half, "the width of cos")?;
    for out in [&q, &k, &v] {
        for input in [&qkv, &cos, &sin] {
            check_no_overlap(out, input)?;
        }
    }
    check_no_overlap(&q, &k)?;
    check_no_overlap(&q, &v)?;
    check_no_overlap(&k, &v)?;
    let shape = crate::layers::QkvShape {
        tokens,
        heads,
        kv_heads,
        head_dim,
        half,
    };
    // SAFETY: all six were checked (dtype, CPU, contiguity, shape); the
    // outputs share no memory with each other or the inputs; the caller
    // keeps them alive.
    let (qd, kd, vd, xs, cs, ss) = unsafe {
        (
            linear_dst(&q),
            linear_dst(&k),
            linear_dst(&v),
            linear_src(&qkv),
            linear_src(&cos),
            linear_src(&sin),
        )
    };
    py.detach(move || crate::layers::qkv_rotary(qd, kd, vd, xs, cs, ss, shape))?;
    Ok(())
}

// ---- end layers ----

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
    m.add_class::<PyBlockPool>()?; // kv: block pool
                                   // attention
    m.add_function(wrap_pyfunction!(reshape_and_cache, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    // sampling
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_support, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_uniform, m)?)?;
    // linear
    m.add_function(wrap_pyfunction!(linear, m)?)?;
    m.add_function(wrap_pyfunction!(linear_paths, m)?)?;
    m.add_function(wrap_pyfunction!(linear_default_path, m)?)?;
    m.add_function(wrap_pyfunction!(stream_triad_gbs, m)?)?;
    // packed linear
    m.add_class::<PyPackedLinear>()?;
    m.add_function(wrap_pyfunction!(gemm_default_path, m)?)?;
    // layers
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(qkv_rotary, m)?)?;
    Ok(())
}
