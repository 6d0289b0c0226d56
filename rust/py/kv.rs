//! The KV-cache block pool.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::kv::{BlockId, BlockPool};

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

    /// Ids of the longest run of cached full blocks matching the start of
    /// `token_ids` in layer group `group`'s chain.
    #[pyo3(signature = (token_ids, group = 0))]
    fn match_prefix(&mut self, token_ids: Vec<i64>, group: u32) -> PyResult<Vec<BlockId>> {
        Ok(self.inner.match_prefix(&token_ids_arg(token_ids)?, group))
    }

    /// Registers a referenced full block holding `token_ids` after
    /// `parent_block_id` (None: the first block of layer group `group`'s chain).
    #[pyo3(signature = (block_id, parent_block_id, token_ids, group = 0))]
    fn register_full_block(
        &mut self,
        block_id: i64,
        parent_block_id: Option<i64>,
        token_ids: Vec<i64>,
        group: u32,
    ) -> PyResult<()> {
        let tokens = token_ids_arg(token_ids)?;
        Ok(self.inner.register_full_block(
            self.id(block_id)?,
            parent_block_id.map(|p| self.id(p)).transpose()?,
            &tokens,
            group,
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

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockPool>()
}
