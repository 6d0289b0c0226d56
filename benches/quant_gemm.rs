//! The quantized GEMM (`rust/quant/`) against the bf16 packed GEMM on the
//! benchmark model's shapes (Qwen2.5-0.5B: hidden 896, intermediate 4864)
//! at M = 1 (batch-1 decode), 16 and 128 (batched decode, prefill chunks),
//! for every format and integer path. Throughput is multiply-adds
//! (criterion's "elements": divide by 1e9 for GMAC/s).
//!
//! `cargo bench --bench quant_gemm -- --warm-up-time 1 --measurement-time 2`
//! (`FASTLLM_BENCH_PATHS=avx2,avx512vnni` limits the integer paths,
//! `FASTLLM_BENCH_FORMATS=q8_0` the formats). At M = 1 the matrices may
//! stay in the last-level cache between iterations, so their figures can
//! exceed DRAM bandwidth; `benches/vs_llama_cpp.py` measures whole models.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::cpu::{Dst, IntPath, Src};
use fastllm::gemm::PackedWeight;
use fastllm::quant::{gemm_with_path, QuantFormat, QuantWeight};
use half::bf16;

/// (name, N, K) of the model's matrix products.
const SHAPES: [(&str, usize, usize); 3] = [
    ("qkv", 1152, 896),
    ("gate_up", 9728, 896),
    ("down", 896, 4864),
];

fn values(len: usize, salt: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_f32((((i + salt) * 7919) % 255) as f32 / 255.0 - 0.5))
        .collect()
}

fn listed<T>(var: &str, all: Vec<T>, name: impl Fn(&T) -> &str) -> Vec<T> {
    match std::env::var(var) {
        Ok(v) => {
            let wanted: Vec<String> = v.split(',').map(|s| s.trim().to_lowercase()).collect();
            all.into_iter()
                .filter(|t| wanted.iter().any(|w| w == name(t)))
                .collect()
        }
        Err(_) => all,
    }
}

fn bench_quant(c: &mut Criterion) {
    let paths = listed("FASTLLM_BENCH_PATHS", IntPath::available(), |p| p.name());
    let formats = listed("FASTLLM_BENCH_FORMATS", QuantFormat::ALL.to_vec(), |f| {
        f.name()
    });
    for (name, n, k) in SHAPES {
        let w = values(n * k, 0);
        let float = PackedWeight::pack(Src::Bf16(&w), None, n, k).expect("pack");
        let quantized: Vec<QuantWeight> = formats
            .iter()
            .map(|&f| QuantWeight::quantize(f, Src::Bf16(&w), None, n, k).expect("quantize"))
            .collect();
        let mut group = c.benchmark_group(format!("quant/{name}"));
        for m in [1usize, 16, 128] {
            let x = values(m * k, 3);
            let mut out = vec![bf16::ZERO; m * n];
            group.throughput(Throughput::Elements((m * n * k) as u64));
            group.bench_with_input(BenchmarkId::new("bf16", m), &m, |b, &m| {
                b.iter(|| {
                    fastllm::gemm::gemm(Dst::Bf16(&mut out), Src::Bf16(black_box(&x)), &float, m)
                        .expect("gemm")
                })
            });
            for q in &quantized {
                for &path in &paths {
                    let id = format!("{}/{}", q.format().name(), path.name());
                    group.bench_with_input(BenchmarkId::new(id, m), &m, |b, &m| {
                        b.iter(|| {
                            gemm_with_path(
                                path,
                                Dst::Bf16(&mut out),
                                Src::Bf16(black_box(&x)),
                                q,
                                m,
                            )
                            .expect("gemm")
                        })
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_quant);
criterion_main!(benches);
