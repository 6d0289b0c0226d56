//! The block pool: allocation, reference counts, prefix cache, LRU eviction.

use std::collections::HashMap;

use super::hash::{ChainHash, ChainHasher, KeyBuildHasher};
use super::list::{Links, List};
use crate::error::{CoreError, CoreResult};

/// Index of a block in the pool (`0..num_blocks`).
pub type BlockId = u32;

/// Counters reported by `BlockPool::stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks `allocate` can hand out now (free plus evictable cached ones).
    pub free_blocks: usize,
    /// Blocks currently in the prefix cache, referenced or not.
    pub cached_blocks: usize,
    /// Full blocks found by `match_prefix`, summed over calls.
    pub hits: u64,
    /// Full blocks asked for by `match_prefix`, summed over calls.
    pub queries: u64,
    /// Cached blocks dropped from the cache to satisfy an allocation.
    pub evictions: u64,
}

/// Per-block bookkeeping; the block's token ids live in `BlockPool::tokens`.
#[derive(Clone, Copy, Debug)]
struct Block {
    ref_count: u32,
    /// Chained hash, set while the block is registered as a full block.
    hash: Option<ChainHash>,
    /// Hash of the block it follows (`ChainHash::ROOT` for a first block).
    parent_hash: ChainHash,
    /// Whether the cache map points at this block (`hash` is then set).
    cached: bool,
}

impl Block {
    const FRESH: Block = Block {
        ref_count: 0,
        hash: None,
        parent_hash: ChainHash::ROOT,
        cached: false,
    };
}

/// A fixed pool of `num_blocks` KV-cache blocks of `block_size` tokens each.
///
/// Every block is in exactly one of three states:
/// * referenced (`ref_count > 0`), owned by one or more sequences;
/// * free: unreferenced and holding no cached content (in `free`);
/// * evictable: unreferenced but in the prefix cache (in `lru`, least
///   recently freed first), reusable by a prefix hit until an allocation
///   needs its memory.
///
/// Allocation, free and a cache hit's `incref` are O(1): the two lists are
/// intrusive (links stored per block in a flat `Vec`).
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<Block>,
    links: Vec<Links>,
    free: List,
    lru: List,
    cache: HashMap<ChainHash, BlockId, KeyBuildHasher>,
    /// Token ids of registered blocks, `block_size` per block.
    tokens: Vec<u32>,
    hasher: ChainHasher,
    hits: u64,
    queries: u64,
    evictions: u64,
}

impl BlockPool {
    /// A pool with every block free.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
    ) -> CoreResult<BlockPool> {
        if num_blocks == 0 || num_blocks >= super::list::NIL as usize {
            return Err(CoreError::invalid(format!(
                "num_blocks must be between 1 and {}, got {num_blocks}",
                super::list::NIL - 1
            )));
        }
        if block_size == 0 {
            return Err(CoreError::invalid("block_size must be at least 1, got 0"));
        }
        let token_slots = if enable_prefix_caching {
            num_blocks.checked_mul(block_size).ok_or_else(|| {
                CoreError::invalid(format!(
                    "num_blocks * block_size overflows ({num_blocks} * {block_size})"
                ))
            })?
        } else {
            0
        };
        let mut links = vec![Links::UNLINKED; num_blocks];
        let mut free = List::new();
        for id in 0..num_blocks as BlockId {
            free.push_back(&mut links, id);
        }
        Ok(BlockPool {
            block_size,
            prefix_caching: enable_prefix_caching,
            blocks: vec![Block::FRESH; num_blocks],
            links,
            free,
            lru: List::new(),
            cache: HashMap::with_capacity_and_hasher(
                if enable_prefix_caching { num_blocks } else { 0 },
                KeyBuildHasher::default(),
            ),
            tokens: vec![0; token_slots],
            hasher: ChainHasher::new(),
            hits: 0,
            queries: 0,
            evictions: 0,
        })
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether full blocks are kept for prefix reuse.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks `allocate` can hand out now: free ones plus evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// A block with reference count 1 and no cached content. Prefers a free
    /// block; otherwise evicts the least recently used unreferenced cached one.
    pub fn allocate(&mut self) -> CoreResult<BlockId> {
        let id = if let Some(id) = self.free.pop_front(&mut self.links) {
            id
        } else if let Some(id) = self.lru.pop_front(&mut self.links) {
            self.evict(id);
            id
        } else {
            return Err(CoreError::Exhausted(format!(
                "no free KV-cache block: all {} blocks are referenced",
                self.blocks.len()
            )));
        };
        let block = &mut self.blocks[id as usize];
        debug_assert!(block.ref_count == 0 && !block.cached && block.hash.is_none());
        block.ref_count = 1;
        Ok(id)
    }

    /// `n` blocks at once, all or nothing: on error the pool is unchanged.
    pub fn allocate_many(&mut self, n: usize) -> CoreResult<Vec<BlockId>> {
        let available = self.num_free_blocks();
        if n > available {
            return Err(CoreError::Exhausted(format!(
                "cannot allocate {n} KV-cache blocks: only {available} of {} are free",
                self.blocks.len()
            )));
        }
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Adds a reference to a referenced block, or revives an evictable cached
    /// one (a prefix-cache hit), taking it out of the LRU list.
    pub fn incref(&mut self, id: BlockId) -> CoreResult<()> {
        let i = self.check_id(id)?;
        let block = &mut self.blocks[i];
        if block.ref_count == 0 {
            if !block.cached {
                return Err(CoreError::invalid(format!(
                    "cannot incref block {id}: it is free and holds no cached content \
                     (allocate a block instead)"
                )));
            }
            block.ref_count = 1;
            self.lru.remove(&mut self.links, id);
            return Ok(());
        }
        block.ref_count = block.ref_count.checked_add(1).ok_or_else(|| {
            CoreError::invalid(format!("reference count of block {id} would overflow"))
        })?;
        Ok(())
    }

    /// Drops one reference. At zero a cached block becomes evictable (most
    /// recently used end of the LRU list); any other block becomes free.
    pub fn free(&mut self, id: BlockId) -> CoreResult<()> {
        let i = self.check_id(id)?;
        let block = &mut self.blocks[i];
        if block.ref_count == 0 {
            return Err(CoreError::invalid(format!(
                "double free of block {id}: its reference count is already 0"
            )));
        }
        block.ref_count -= 1;
        if block.ref_count == 0 {
            if block.cached {
                self.lru.push_back(&mut self.links, id);
            } else {
                // A registered duplicate of another cached block: its
                // registration ends with its last owner.
                block.hash = None;
                self.free.push_front(&mut self.links, id);
            }
        }
        Ok(())
    }

    /// The block's reference count.
    pub fn ref_count(&self, id: BlockId) -> CoreResult<u32> {
        Ok(self.blocks[self.check_id(id)?].ref_count)
    }

    /// Whether the prefix cache currently points at this block.
    pub fn is_cached(&self, id: BlockId) -> CoreResult<bool> {
        Ok(self.blocks[self.check_id(id)?].cached)
    }

    /// Ids of the longest run of cached full blocks whose tokens equal
    /// `tokens[..k * block_size]`, starting from the first block of layer
    /// group `group`'s chain (see `register_full_block`). Reference
    /// counts are not changed; `queries` grows by the number of full blocks in
    /// `tokens` and `hits` by the length of the result.
    pub fn match_prefix(&mut self, tokens: &[u32], group: u32) -> Vec<BlockId> {
        if !self.prefix_caching {
            return Vec::new();
        }
        let bs = self.block_size;
        let full = tokens.len() / bs;
        let mut out = Vec::new();
        let mut parent = ChainHash::root(group);
        for chunk in tokens.chunks_exact(bs) {
            let hash = self.hasher.hash(parent, chunk);
            let Some(&id) = self.cache.get(&hash) else {
                break;
            };
            let block = &self.blocks[id as usize];
            // Verify, so that even a hash collision can only cost a miss.
            if block.parent_hash != parent || self.block_tokens(id) != chunk {
                break;
            }
            out.push(id);
            parent = hash;
        }
        self.queries += full as u64;
        self.hits += out.len() as u64;
        out
    }

    /// Records that referenced block `id` holds exactly `tokens` (one full
    /// block) after `parent` (`None` for a sequence's first block). If an
    /// identical block is already cached, that entry is kept and `id` stays
    /// out of the cache (though children may still name `id` as parent).
    /// A first block starts the chain of layer group `group`: models whose
    /// layers keep separate block tables (sliding-window and full layers)
    /// cache each group's blocks under its own chain. A no-op when prefix
    /// caching is disabled.
    pub fn register_full_block(
        &mut self,
        id: BlockId,
        parent: Option<BlockId>,
        tokens: &[u32],
        group: u32,
    ) -> CoreResult<()> {
        let i = self.check_id(id)?;
        if let Some(p) = parent {
            self.check_id(p)?;
        }
        if tokens.len() != self.block_size {
            return Err(CoreError::invalid(format!(
                "token_ids: a full block has {} token ids, got {}",
                self.block_size,
                tokens.len()
            )));
        }
        if !self.prefix_caching {
            return Ok(());
        }
        if self.blocks[i].ref_count == 0 {
            return Err(CoreError::invalid(format!(
                "cannot register block {id}: it is not referenced by any sequence"
            )));
        }
        let parent_hash = match parent {
            None => ChainHash::root(group),
            Some(p) => self.blocks[p as usize].hash.ok_or_else(|| {
                CoreError::invalid(format!(
                    "cannot register block {id}: its parent block {p} is not registered"
                ))
            })?,
        };
        let hash = self.hasher.hash(parent_hash, tokens);
        let block = &mut self.blocks[i];
        match block.hash {
            Some(h) if h != hash => {
                return Err(CoreError::invalid(format!(
                    "cannot register block {id}: it is already registered with other tokens \
                     or another parent"
                )));
            }
            Some(_) => {}
            None => {
                block.hash = Some(hash);
                block.parent_hash = parent_hash;
                let start = i * self.block_size;
                self.tokens[start..start + self.block_size].copy_from_slice(tokens);
            }
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.cache.entry(hash) {
            slot.insert(id);
            self.blocks[i].cached = true;
        }
        Ok(())
    }

    /// Before writing into a shared block: if `id` has other owners, returns
    /// a fresh block (the caller copies the KV data) and drops this caller's
    /// reference to `id`; otherwise returns `id` itself.
    pub fn copy_on_write(&mut self, id: BlockId) -> CoreResult<BlockId> {
        let i = self.check_id(id)?;
        match self.blocks[i].ref_count {
            0 => Err(CoreError::invalid(format!(
                "cannot copy-on-write block {id}: it is not referenced"
            ))),
            1 => Ok(id),
            _ => {
                let new = self.allocate()?;
                self.blocks[i].ref_count -= 1;
                Ok(new)
            }
        }
    }

    /// Counters: free and cached blocks, prefix hits, queries, evictions.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            free_blocks: self.num_free_blocks(),
            cached_blocks: self.cache.len(),
            hits: self.hits,
            queries: self.queries,
            evictions: self.evictions,
        }
    }

    /// Drops every prefix-cache entry, unless a cached block is referenced;
    /// returns whether it did. Evictable blocks become free.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self
            .cache
            .values()
            .any(|&id| self.blocks[id as usize].ref_count > 0)
        {
            return false;
        }
        while let Some(id) = self.lru.pop_front(&mut self.links) {
            let block = &mut self.blocks[id as usize];
            block.hash = None;
            block.cached = false;
            self.free.push_back(&mut self.links, id);
        }
        self.cache.clear();
        true
    }

    /// Removes an unreferenced cached block (already unlinked) from the cache.
    fn evict(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if let Some(hash) = block.hash.take() {
            self.cache.remove(&hash);
        }
        block.cached = false;
        self.evictions += 1;
    }

    fn block_tokens(&self, id: BlockId) -> &[u32] {
        let start = id as usize * self.block_size;
        &self.tokens[start..start + self.block_size]
    }

    fn check_id(&self, id: BlockId) -> CoreResult<usize> {
        let n = self.blocks.len();
        if (id as usize) < n {
            Ok(id as usize)
        } else {
            Err(CoreError::invalid(format!(
                "unknown block id {id}: the pool has {n} blocks (ids 0 to {})",
                n - 1
            )))
        }
    }

    /// Panics if the lists, states and cache map disagree (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let free = self.free.ids(&self.links);
        let lru = self.lru.ids(&self.links);
        assert_eq!(free.len(), self.free.len());
        assert_eq!(lru.len(), self.lru.len());
        let mut seen = vec![0u8; self.blocks.len()];
        for &id in &free {
            let b = &self.blocks[id as usize];
            assert!(
                b.ref_count == 0 && !b.cached && b.hash.is_none(),
                "free block {id}"
            );
            seen[id as usize] += 1;
        }
        for &id in &lru {
            let b = &self.blocks[id as usize];
            assert!(b.ref_count == 0 && b.cached, "evictable block {id}");
            seen[id as usize] += 1;
        }
        for (id, b) in self.blocks.iter().enumerate() {
            if b.ref_count > 0 {
                seen[id] += 1;
            }
            assert_eq!(seen[id], 1, "block {id} in {} states", seen[id]);
            if b.cached {
                let hash = b.hash.expect("a cached block has a hash");
                assert_eq!(self.cache.get(&hash), Some(&(id as BlockId)));
            }
        }
        assert_eq!(
            self.cache.len(),
            self.blocks.iter().filter(|b| b.cached).count()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg<T: std::fmt::Debug>(r: CoreResult<T>) -> String {
        match r {
            Err(e) => e.to_string(),
            Ok(v) => panic!("expected an error, got Ok({v:?})"),
        }
    }

    /// Allocates a chain of blocks holding `tokens` and registers each full one.
    fn fill(pool: &mut BlockPool, tokens: &[u32]) -> Vec<BlockId> {
        let bs = pool.block_size();
        let mut ids = Vec::new();
        for chunk in tokens.chunks_exact(bs) {
            let id = pool.allocate().unwrap();
            pool.register_full_block(id, ids.last().copied(), chunk, 0)
                .unwrap();
            ids.push(id);
        }
        pool.check_invariants();
        ids
    }

    #[test]
    fn constructor_rejects_empty_shapes() {
        assert!(msg(BlockPool::new(0, 16, true)).contains("num_blocks"));
        assert!(msg(BlockPool::new(4, 0, true)).contains("block_size"));
        let pool = BlockPool::new(4, 16, false).unwrap();
        assert_eq!((pool.num_blocks(), pool.block_size()), (4, 16));
        assert!(!pool.prefix_caching());
    }

    #[test]
    fn allocate_free_and_exhaustion() {
        let mut pool = BlockPool::new(3, 4, true).unwrap();
        let ids = pool.allocate_many(3).unwrap();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2]);
        assert_eq!(pool.num_free_blocks(), 0);
        let err = pool.allocate().unwrap_err();
        assert!(matches!(err, CoreError::Exhausted(_)));
        assert!(err.to_string().contains("all 3 blocks are referenced"));
        pool.free(ids[1]).unwrap();
        assert_eq!(pool.ref_count(ids[1]).unwrap(), 0);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.allocate().unwrap(), ids[1]);
        pool.check_invariants();
    }

    #[test]
    fn allocate_many_is_all_or_nothing() {
        let mut pool = BlockPool::new(4, 4, true).unwrap();
        let first = pool.allocate_many(3).unwrap();
        let err = pool.allocate_many(2).unwrap_err();
        assert!(matches!(err, CoreError::Exhausted(_)));
        assert!(err.to_string().contains("only 1 of 4 are free"));
        assert_eq!(pool.num_free_blocks(), 1);
        for id in first {
            assert_eq!(pool.ref_count(id).unwrap(), 1);
        }
        assert_eq!(pool.allocate_many(0).unwrap(), Vec::<BlockId>::new());
        pool.check_invariants();
    }

    #[test]
    fn misuse_is_an_error_and_leaves_state_intact() {
        let mut pool = BlockPool::new(2, 4, true).unwrap();
        let a = pool.allocate().unwrap();
        pool.free(a).unwrap();
        assert!(msg(pool.free(a)).contains("double free of block"));
        for r in [
            pool.free(7).map(|_| 0),
            pool.incref(7).map(|_| 0),
            pool.ref_count(7),
            pool.is_cached(7).map(u32::from),
            pool.copy_on_write(7),
            pool.register_full_block(7, None, &[1, 2, 3, 4], 0)
                .map(|_| 0),
        ] {
            assert!(msg(r).contains("unknown block id 7: the pool has 2 blocks"));
        }
        assert!(msg(pool.incref(a)).contains("is free and holds no cached content"));
        assert!(msg(pool.copy_on_write(a)).contains("not referenced"));
        assert_eq!(pool.num_free_blocks(), 2);
        pool.check_invariants();
    }

    #[test]
    fn register_rejects_bad_input() {
        let mut pool = BlockPool::new(4, 4, true).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let c = pool.allocate().unwrap();
        pool.free(c).unwrap();
        assert!(msg(pool.register_full_block(a, None, &[1, 2, 3], 0)).contains("got 3"));
        assert!(msg(pool.register_full_block(c, None, &[1, 2, 3, 4], 0)).contains("not referenced"));
        assert!(msg(pool.register_full_block(b, Some(a), &[1, 2, 3, 4], 0))
            .contains("parent block 0 is not registered"));
        assert!(msg(pool.register_full_block(b, Some(9), &[1, 2, 3, 4], 0)).contains("unknown"));
        pool.register_full_block(a, None, &[1, 2, 3, 4], 0).unwrap();
        pool.register_full_block(a, None, &[1, 2, 3, 4], 0).unwrap(); // idempotent
        assert!(msg(pool.register_full_block(a, None, &[1, 2, 3, 5], 0)).contains("already"));
        assert_eq!(pool.stats().cached_blocks, 1);
        pool.check_invariants();
    }

    #[test]
    fn prefix_hit_revives_cached_blocks() {
        let mut pool = BlockPool::new(8, 2, true).unwrap();
        let prompt = [5, 6, 7, 8, 9, 10, 11];
        let ids = fill(&mut pool, &prompt);
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|&id| pool.is_cached(id).unwrap()));
        for &id in ids.iter().rev() {
            pool.free(id).unwrap();
        }
        assert_eq!(pool.num_free_blocks(), 8);
        assert_eq!(pool.stats().cached_blocks, 3);
        pool.check_invariants();

        assert_eq!(pool.match_prefix(&prompt, 0), ids);
        assert_eq!(pool.match_prefix(&[5, 6, 7, 8, 0, 0], 0), ids[..2].to_vec());
        assert_eq!(pool.match_prefix(&[5, 6, 7], 0), ids[..1].to_vec());
        assert_eq!(pool.match_prefix(&[6, 5, 7, 8], 0), Vec::<BlockId>::new());
        // A block matches only after its own parent: [7, 8] alone is no hit.
        assert_eq!(pool.match_prefix(&[7, 8], 0), Vec::<BlockId>::new());
        let s = pool.stats();
        assert_eq!((s.queries, s.hits), (3 + 3 + 1 + 2 + 1, 3 + 2 + 1));

        for &id in &ids {
            pool.incref(id).unwrap();
        }
        assert_eq!(pool.num_free_blocks(), 5);
        pool.incref(ids[0]).unwrap();
        assert_eq!(pool.ref_count(ids[0]).unwrap(), 2);
        pool.check_invariants();
    }

    #[test]
    fn eviction_prefers_free_blocks_then_lru() {
        let mut pool = BlockPool::new(4, 1, true).unwrap();
        let a = fill(&mut pool, &[1]);
        let b = fill(&mut pool, &[2]);
        let c = fill(&mut pool, &[3]);
        // Freed in the order b, a, c: LRU order is b, a, c.
        pool.free(b[0]).unwrap();
        pool.free(a[0]).unwrap();
        pool.free(c[0]).unwrap();
        let fresh = pool.allocate().unwrap();
        assert!(
            ![a[0], b[0], c[0]].contains(&fresh),
            "the never-used block comes first"
        );
        assert_eq!(pool.stats().evictions, 0);
        assert_eq!(pool.allocate().unwrap(), b[0]);
        assert_eq!(pool.stats().evictions, 1);
        assert!(!pool.is_cached(b[0]).unwrap());
        assert_eq!(pool.match_prefix(&[2], 0), Vec::<BlockId>::new());
        // A hit moves `a` out of the LRU list; freeing it puts it at the MRU end.
        pool.incref(a[0]).unwrap();
        pool.free(a[0]).unwrap();
        assert_eq!(pool.allocate().unwrap(), c[0]);
        assert_eq!(pool.allocate().unwrap(), a[0]);
        assert_eq!(pool.stats().evictions, 3);
        assert_eq!(pool.stats().cached_blocks, 0);
        assert!(pool.allocate().is_err());
        pool.check_invariants();
    }

    #[test]
    fn identical_block_keeps_the_existing_entry() {
        let mut pool = BlockPool::new(6, 2, true).unwrap();
        let first = fill(&mut pool, &[1, 2, 3, 4]);
        // A second sequence computed the same prompt before it was cached.
        let d0 = pool.allocate().unwrap();
        pool.register_full_block(d0, None, &[1, 2], 0).unwrap();
        assert!(!pool.is_cached(d0).unwrap());
        let d1 = pool.allocate().unwrap();
        pool.register_full_block(d1, Some(d0), &[3, 4], 0).unwrap();
        assert!(!pool.is_cached(d1).unwrap());
        let d2 = pool.allocate().unwrap();
        pool.register_full_block(d2, Some(d1), &[5, 6], 0).unwrap();
        assert!(
            pool.is_cached(d2).unwrap(),
            "a new block after a duplicate is cached"
        );
        assert_eq!(
            pool.match_prefix(&[1, 2, 3, 4, 5, 6], 0),
            vec![first[0], first[1], d2]
        );
        assert_eq!(pool.stats().cached_blocks, 3);
        // The duplicate is plainly free once released.
        pool.free(d0).unwrap();
        assert_eq!(pool.stats().cached_blocks, 3);
        pool.check_invariants();
    }

    #[test]
    fn lookup_verifies_stored_tokens() {
        let mut pool = BlockPool::new(4, 2, true).unwrap();
        let ids = fill(&mut pool, &[1, 2, 3, 4]);
        // Simulate a hash collision: the entry's stored tokens differ from the
        // ones it is looked up with. The lookup must stop, not return it.
        let start = ids[1] as usize * 2;
        pool.tokens[start] = 99;
        assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 0), vec![ids[0]]);
        pool.blocks[ids[0] as usize].parent_hash = ChainHash(1, 1);
        assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 0), Vec::<BlockId>::new());
    }

    #[test]
    fn layer_groups_cache_the_same_tokens_separately() {
        let mut pool = BlockPool::new(8, 2, true).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.register_full_block(a, None, &[1, 2], 0).unwrap();
        assert_eq!(pool.match_prefix(&[1, 2], 1), Vec::<BlockId>::new());
        pool.register_full_block(b, None, &[1, 2], 1).unwrap();
        assert_eq!(pool.match_prefix(&[1, 2], 0), vec![a]);
        assert_eq!(pool.match_prefix(&[1, 2], 1), vec![b]);
        let c = pool.allocate().unwrap();
        pool.register_full_block(c, Some(b), &[3, 4], 1).unwrap();
        assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 1), vec![b, c]);
        assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 0), vec![a]);
        pool.check_invariants();
    }

    #[test]
    fn copy_on_write_only_copies_shared_blocks() {
        let mut pool = BlockPool::new(2, 4, true).unwrap();
        let a = pool.allocate().unwrap();
        assert_eq!(pool.copy_on_write(a).unwrap(), a);
        pool.incref(a).unwrap();
        let b = pool.copy_on_write(a).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            (pool.ref_count(a).unwrap(), pool.ref_count(b).unwrap()),
            (1, 1)
        );
        // Shared again with nothing left: the error leaves both references.
        pool.incref(a).unwrap();
        assert!(matches!(
            pool.copy_on_write(a),
            Err(CoreError::Exhausted(_))
        ));
        assert_eq!(pool.ref_count(a).unwrap(), 2);
        pool.check_invariants();
    }

    #[test]
    fn reset_only_when_no_cached_block_is_referenced() {
        let mut pool = BlockPool::new(4, 2, true).unwrap();
        let ids = fill(&mut pool, &[1, 2, 3, 4]);
        assert!(!pool.reset_prefix_cache());
        assert_eq!(pool.stats().cached_blocks, 2);
        pool.free(ids[0]).unwrap();
        assert!(!pool.reset_prefix_cache());
        pool.free(ids[1]).unwrap();
        assert!(pool.reset_prefix_cache());
        let s = pool.stats();
        assert_eq!((s.cached_blocks, s.free_blocks, s.evictions), (0, 4, 0));
        assert_eq!(pool.match_prefix(&[1, 2], 0), Vec::<BlockId>::new());
        pool.check_invariants();
    }

    #[test]
    fn disabled_prefix_caching_caches_nothing() {
        let mut pool = BlockPool::new(2, 2, false).unwrap();
        let a = pool.allocate().unwrap();
        pool.register_full_block(a, None, &[1, 2], 0).unwrap();
        assert!(!pool.is_cached(a).unwrap());
        pool.free(a).unwrap();
        assert_eq!(pool.match_prefix(&[1, 2], 0), Vec::<BlockId>::new());
        assert_eq!(
            pool.stats(),
            PoolStats {
                free_blocks: 2,
                ..PoolStats::default()
            }
        );
        assert!(msg(pool.register_full_block(a, None, &[1], 0)).contains("got 1"));
        pool.check_invariants();
    }

    #[test]
    fn random_operations_keep_invariants() {
        let mut pool = BlockPool::new(16, 2, true).unwrap();
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        let mut held: Vec<BlockId> = Vec::new();
        for _ in 0..5000 {
            match next(6) {
                0 | 1 => {
                    if let Ok(id) = pool.allocate() {
                        let parent = held
                            .last()
                            .copied()
                            .filter(|&p| pool.blocks[p as usize].hash.is_some());
                        let toks = [next(3) as u32, next(3) as u32];
                        let _ = pool.register_full_block(id, parent, &toks, 0);
                        held.push(id);
                    }
                }
                2 | 3 if !held.is_empty() => {
                    let id = held.swap_remove(next(held.len() as u64) as usize);
                    pool.free(id).unwrap();
                }
                4 => {
                    let q: Vec<u32> = (0..6).map(|_| next(3) as u32).collect();
                    for id in pool.match_prefix(&q, 0) {
                        pool.incref(id).unwrap();
                        held.push(id);
                    }
                }
                _ => {
                    if let Some(&id) = held.last() {
                        let new = pool.copy_on_write(id);
                        if let Ok(new) = new {
                            if new != id {
                                held.pop();
                                held.push(new);
                            }
                        }
                    }
                }
            }
            pool.check_invariants();
        }
    }
}
