//! Paged attention benchmarks: decode at batch 1 / 16 / 64 and context
//! 128 / 1024 / 4096 (14 query heads, 2 KV heads, head size 64, block size 16,
//! bf16 cache, one f32 point), and a 512-token prefill.
//!
//! `cargo bench --bench attention -- --warm-up-time 1 --measurement-time 2`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::attention::{paged_attention, BatchLayout, CacheShape, Element};
use half::bf16;

const HEADS: usize = 14;
const KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 64;
const BLOCK: usize = 16;

/// Inputs of one call: caches with shuffled blocks, per-sequence layout, query.
struct Setup<T> {
    shape: CacheShape,
    key_cache: Vec<T>,
    value_cache: Vec<T>,
    block_tables: Vec<i32>,
    max_blocks: usize,
    seq_lens: Vec<i32>,
    query_start_loc: Vec<i32>,
    query: Vec<T>,
}

/// Deterministic values in [-1, 1).
fn noise(n: usize, seed: u64) -> impl Iterator<Item = f32> {
    let mut s = seed | 1;
    (0..n).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    })
}

fn setup<T: Element>(batch: usize, ctx: usize, q_len: usize) -> Setup<T> {
    let max_blocks = ctx.div_ceil(BLOCK);
    let shape = CacheShape {
        num_blocks: batch * max_blocks,
        num_kv_heads: KV_HEADS,
        block_size: BLOCK,
        head_size: HEAD_SIZE,
    };
    // A fixed stride permutation scatters each sequence's blocks over the pool.
    let n = shape.num_blocks;
    let stride = (1..n)
        .rev()
        .find(|s| gcd(*s, n) == 1 && *s * 3 < n * 2)
        .unwrap_or(1);
    let block_tables = (0..n).map(|i| ((i * stride) % n) as i32).collect();
    let num_tokens = batch * q_len;
    Setup {
        shape,
        key_cache: noise(shape.numel(), 1).map(T::from_f32).collect(),
        value_cache: noise(shape.numel(), 2).map(T::from_f32).collect(),
        block_tables,
        max_blocks,
        seq_lens: vec![ctx as i32; batch],
        query_start_loc: (0..=batch).map(|i| (i * q_len) as i32).collect(),
        query: noise(num_tokens * HEADS * HEAD_SIZE, 3)
            .map(T::from_f32)
            .collect(),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn run<T: Element>(s: &Setup<T>, out: &mut [T]) {
    let batch = BatchLayout {
        block_tables: &s.block_tables,
        max_blocks_per_seq: s.max_blocks,
        seq_lens: &s.seq_lens,
        query_start_loc: &s.query_start_loc,
    };
    let scale = 1.0 / (HEAD_SIZE as f32).sqrt();
    if let Err(e) = paged_attention(
        out,
        &s.query,
        &s.key_cache,
        &s.value_cache,
        s.shape,
        HEADS,
        batch,
        scale,
        0,
        0.0,
        None,
    ) {
        panic!("paged_attention failed: {e}");
    }
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_attention");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for batch in [1usize, 16, 64] {
        for ctx in [128usize, 1024, 4096] {
            let s = setup::<bf16>(batch, ctx, 1);
            let mut out = s.query.clone();
            group.throughput(Throughput::Elements((batch * ctx) as u64));
            group.bench_function(
                BenchmarkId::new("bf16", format!("b{batch}_ctx{ctx}")),
                |b| b.iter(|| run(&s, &mut out)),
            );
        }
    }
    let s = setup::<f32>(16, 1024, 1);
    let mut out = s.query.clone();
    group.throughput(Throughput::Elements(16 * 1024));
    group.bench_function(BenchmarkId::new("f32", "b16_ctx1024"), |b| {
        b.iter(|| run(&s, &mut out))
    });
    group.finish();
}

fn prefill(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefill_attention");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let s = setup::<bf16>(1, 512, 512);
    let mut out = s.query.clone();
    group.throughput(Throughput::Elements(512));
    group.bench_function("bf16_512", |b| b.iter(|| run(&s, &mut out)));
    group.finish();
}

criterion_group!(benches, decode, prefill);
criterion_main!(benches);
