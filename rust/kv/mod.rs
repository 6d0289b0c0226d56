//! Paged KV-cache block pool with prefix caching.
//!
//! The pool hands out fixed-size blocks by id; the engine keeps one block
//! table per sequence and the attention kernels read K/V through it. Blocks
//! are reference counted so sequences can share them (a cached prompt
//! prefix, the `n > 1` children of one prompt), and a full block can be
//! registered under a hash that chains its parent's hash and its token ids.
//! Unreferenced registered blocks stay cached until an allocation needs
//! their memory, evicted least recently used first.

mod hash;
mod list;
mod pool;

pub use pool::{BlockId, BlockPool, PoolStats};
