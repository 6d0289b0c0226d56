//! Chained block hashes for the prefix cache.
//!
//! A full block's hash is `H(parent's hash, its token ids)`, so equal hashes
//! mean equal whole prefixes, not just equal blocks. `H` is two independently
//! keyed SipHash-1-3 lanes (keys drawn at random per pool), 128 bits in all:
//! accidental collisions are out of reach and crafted ones need the secret
//! keys. Lookups still compare the stored token ids and parent hash, so even
//! a collision could only cost a cache miss, never return another prefix's KV.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

/// The chained hash of a full block (two 64-bit lanes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ChainHash(pub u64, pub u64);

impl ChainHash {
    /// The "parent" of the first block of every sequence (of group 0).
    pub const ROOT: ChainHash = ChainHash(0, 0);

    /// The "parent" of the first block of a sequence's table in layer group
    /// `group` (``ROOT`` for group 0): the groups' chains never meet, so
    /// one pool caches the same tokens once per group, each with its own KV.
    pub fn root(group: u32) -> ChainHash {
        ChainHash(0, u64::from(group))
    }
}

/// Computes chained hashes with this pool's random keys.
#[derive(Clone, Debug)]
pub(crate) struct ChainHasher {
    lanes: [RandomState; 2],
}

impl ChainHasher {
    /// A hasher with fresh random keys.
    pub fn new() -> ChainHasher {
        ChainHasher {
            lanes: [RandomState::new(), RandomState::new()],
        }
    }

    /// `H(parent, tokens)`: the hash of a full block that follows `parent`.
    pub fn hash(&self, parent: ChainHash, tokens: &[u32]) -> ChainHash {
        // SipHash is fastest fed long byte runs: lay the tokens out as
        // little-endian bytes, 64 at a time, on the stack.
        let mut buf = [0u8; 256];
        let start = |keys: &RandomState| {
            let mut h = keys.build_hasher();
            h.write_u64(parent.0);
            h.write_u64(parent.1);
            h
        };
        let (mut a, mut b) = (start(&self.lanes[0]), start(&self.lanes[1]));
        for run in tokens.chunks(buf.len() / 4) {
            let bytes = &mut buf[..run.len() * 4];
            for (dst, &t) in bytes.chunks_exact_mut(4).zip(run) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            a.write(bytes);
            b.write(bytes);
        }
        ChainHash(a.finish(), b.finish())
    }
}

/// A `Hasher` for maps keyed by `ChainHash`: the key is already uniformly
/// random, so it only folds the two lanes instead of hashing them again.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = self.0.rotate_left(32) ^ x;
    }
}

/// Builds `KeyHasher`s for `HashMap<ChainHash, _>`.
pub(crate) type KeyBuildHasher = BuildHasherDefault<KeyHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_parent_and_every_token() {
        let h = ChainHasher::new();
        let base = h.hash(ChainHash::ROOT, &[1, 2, 3, 4]);
        assert_eq!(base, h.hash(ChainHash::ROOT, &[1, 2, 3, 4]));
        assert_ne!(base, h.hash(ChainHash::ROOT, &[1, 2, 3, 5]));
        assert_ne!(base, h.hash(ChainHash::ROOT, &[2, 1, 3, 4]));
        let child = h.hash(base, &[1, 2, 3, 4]);
        assert_ne!(child, base);
        let other_parent = h.hash(ChainHash::ROOT, &[9, 9, 9, 9]);
        assert_ne!(child, h.hash(other_parent, &[1, 2, 3, 4]));
        assert_ne!(base.0, base.1, "the two lanes use different keys");
    }
}
