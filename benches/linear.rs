//! Decode-time linear kernels on the benchmark model's shapes (Qwen2.5-0.5B:
//! hidden 896, intermediate 4864, vocab 151936), at M = 1 and M = 16, on
//! every path this CPU runs. Throughput is the bytes of bf16 weights streamed.
//!
//! `cargo bench --bench linear -- --warm-up-time 1 --measurement-time 2`
//! (`FASTLLM_BENCH_PATHS=avx512,avx512bf16` limits the paths). The smaller
//! matrices stay in the last-level cache between iterations here, so their
//! figures exceed DRAM bandwidth; `benches/linear_vs_torch.py` streams
//! from DRAM.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::linear::{available_paths, linear_with_path, Dst, Src};
use half::bf16;

/// (name, N, K) of the model's matrix products.
const SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 1152, 896),
    ("o_proj", 896, 896),
    ("gate_up", 9728, 896),
    ("down", 896, 4864),
    ("lm_head", 151936, 896),
];

fn bench_linear(c: &mut Criterion) {
    let paths = match std::env::var("FASTLLM_BENCH_PATHS") {
        Ok(v) => v
            .split(',')
            .filter_map(fastllm::linear::Path::parse)
            .collect(),
        Err(_) => available_paths(),
    };
    for (name, n, k) in SHAPES {
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 7919) % 255) as f32 / 255.0 - 0.5))
            .collect();
        let bias: Vec<bf16> = vec![bf16::from_f32(0.25); n];
        let mut group = c.benchmark_group(format!("linear/{name}"));
        group.throughput(Throughput::Bytes((n * k * 2) as u64));
        for m in [1usize, 16] {
            let x: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32(((i * 31) % 17) as f32 / 17.0 - 0.5))
                .collect();
            let mut out = vec![bf16::ZERO; m * n];
            for &path in &paths {
                group.bench_function(BenchmarkId::new(path.name(), format!("m{m}")), |b| {
                    b.iter(|| {
                        linear_with_path(
                            path,
                            Dst::Bf16(&mut out),
                            Src::Bf16(black_box(&x)),
                            Src::Bf16(&w),
                            Some(Src::Bf16(&bias)),
                            m,
                            n,
                            k,
                        )
                        .unwrap_or_else(|e| panic!("{e}"));
                        black_box(&out);
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench_linear
}
criterion_main!(benches);
