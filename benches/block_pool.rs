//! Block pool: allocate / free churn, eviction, prefix lookup and registration.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use fastllm::kv::{BlockId, BlockPool};

const NUM_BLOCKS: usize = 4096;
const BLOCK_SIZE: usize = 16;
const PROMPT_TOKENS: usize = 2048;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 151_936)
        .collect()
}

/// Allocates and registers one block per full block of `tokens`.
fn fill(pool: &mut BlockPool, tokens: &[u32]) -> Vec<BlockId> {
    let mut ids: Vec<BlockId> = Vec::new();
    for chunk in tokens.chunks_exact(BLOCK_SIZE) {
        let id = pool.allocate().unwrap();
        pool.register_full_block(id, ids.last().copied(), chunk, 0)
            .unwrap();
        ids.push(id);
    }
    ids
}

fn churn(c: &mut Criterion) {
    let mut pool = BlockPool::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap();
    c.bench_function("block_pool/allocate_free_x32", |b| {
        b.iter(|| {
            let ids = pool.allocate_many(32).unwrap();
            for id in ids {
                pool.free(black_box(id)).unwrap();
            }
        })
    });

    // Every block cached and unreferenced: each allocation evicts the LRU one.
    let mut pool = BlockPool::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap();
    let mut seed = 0;
    while pool.stats().cached_blocks < NUM_BLOCKS {
        for id in fill(&mut pool, &prompt(seed)) {
            pool.free(id).unwrap();
        }
        seed += 1;
    }
    let mut chunk = prompt(u32::MAX)[..BLOCK_SIZE].to_vec();
    c.bench_function("block_pool/evict_register_free", |b| {
        b.iter(|| {
            let id = pool.allocate().unwrap();
            chunk[0] = chunk[0].wrapping_add(1);
            pool.register_full_block(id, None, &chunk, 0).unwrap();
            pool.free(id).unwrap();
        })
    });
}

fn prefix_lookup(c: &mut Criterion) {
    let mut pool = BlockPool::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap();
    let tokens = prompt(7);
    for id in fill(&mut pool, &tokens).into_iter().rev() {
        pool.free(id).unwrap();
    }
    // Other cached prompts so the map is not trivially small.
    for seed in 100..120 {
        for id in fill(&mut pool, &prompt(seed)).into_iter().rev() {
            pool.free(id).unwrap();
        }
    }
    c.bench_function("block_pool/match_prefix_2048_hit", |b| {
        b.iter(|| {
            let hit = pool.match_prefix(black_box(&tokens), 0);
            assert_eq!(hit.len(), PROMPT_TOKENS / BLOCK_SIZE);
            hit
        })
    });
    let miss = prompt(12345);
    c.bench_function("block_pool/match_prefix_2048_miss", |b| {
        b.iter(|| pool.match_prefix(black_box(&miss), 0))
    });
    // The engine's hit path: lookup, then take a reference to every hit.
    c.bench_function("block_pool/match_incref_free_2048", |b| {
        b.iter(|| {
            let hit = pool.match_prefix(black_box(&tokens), 0);
            for &id in &hit {
                pool.incref(id).unwrap();
            }
            for &id in hit.iter().rev() {
                pool.free(id).unwrap();
            }
        })
    });
}

fn register(c: &mut Criterion) {
    let tokens = prompt(3);
    let mut base = BlockPool::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap();
    let ids = base.allocate_many(PROMPT_TOKENS / BLOCK_SIZE).unwrap();
    c.bench_function("block_pool/register_2048_tokens", |b| {
        b.iter_batched(
            || base.clone(),
            |mut pool| {
                let mut parent = None;
                for (&id, chunk) in ids.iter().zip(tokens.chunks_exact(BLOCK_SIZE)) {
                    pool.register_full_block(id, parent, chunk, 0).unwrap();
                    parent = Some(id);
                }
                pool
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, churn, prefix_lookup, register);
criterion_main!(benches);
