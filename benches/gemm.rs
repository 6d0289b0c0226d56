//! The packed-weight GEMM (`rust/gemm/`) on the benchmark model's shapes
//! (Qwen2.5-0.5B: hidden 896, intermediate 4864, vocab 151936) at M = 1
//! (batch-1 decode), 64 (a batch-64 decode step) and 512 (a prefill chunk),
//! bf16 weights and x, and the model's CPU elementwise layers
//! (`rust/layers/`). Throughput is multiply-adds for the GEMM (criterion's
//! "elements": divide by 1e9 for GMAC/s, x2 for GFLOPS).
//!
//! `cargo bench --bench gemm -- --warm-up-time 1 --measurement-time 2`
//! (`FASTLLM_BENCH_PATHS=avx2` limits the paths). At M = 1 the smaller
//! matrices stay in the last-level cache between iterations, so their
//! figures exceed DRAM bandwidth.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::cpu::{available_paths, Dst, Path, Src};
use fastllm::gemm::{gemm_with_path, PackedWeight};
use fastllm::layers::{rms_norm, silu_and_mul};
use half::bf16;

/// (name, N, K) of the model's matrix products.
const SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 1152, 896),
    ("o_proj", 896, 896),
    ("gate_up", 9728, 896),
    ("down", 896, 4864),
    ("lm_head", 151936, 896),
];

fn values(len: usize, salt: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_f32((((i + salt) * 7919) % 255) as f32 / 255.0 - 0.5))
        .collect()
}

fn bench_gemm(c: &mut Criterion) {
    let paths: Vec<Path> = match std::env::var("FASTLLM_BENCH_PATHS") {
        Ok(v) => v.split(',').filter_map(Path::parse).collect(),
        Err(_) => available_paths(),
    };
    for (name, n, k) in SHAPES {
        let w = values(n * k, 0);
        let packed = PackedWeight::pack(Src::Bf16(&w), None, n, k).expect("pack");
        let mut group = c.benchmark_group(format!("gemm/{name}"));
        for m in [1usize, 64, 512] {
            if name == "lm_head" && m > 64 {
                continue; // the head only sees the last row of each sequence
            }
            let x = values(m * k, 3);
            let mut out = vec![bf16::ZERO; m * n];
            group.throughput(Throughput::Elements((m * n * k) as u64));
            for &path in &paths {
                group.bench_with_input(BenchmarkId::new(path.name(), m), &m, |b, &m| {
                    b.iter(|| {
                        gemm_with_path(
                            path,
                            Dst::Bf16(&mut out),
                            Src::Bf16(black_box(&x)),
                            &packed,
                            m,
                        )
                        .expect("gemm")
                    })
                });
            }
        }
        group.finish();
    }
}

fn bench_layers(c: &mut Criterion) {
    let (hidden, inter) = (896, 4864);
    let mut group = c.benchmark_group("layers");
    for rows in [1usize, 64, 512] {
        let x = values(rows * 2 * inter, 1);
        let mut out = vec![bf16::ZERO; rows * inter];
        group.throughput(Throughput::Elements((rows * inter) as u64));
        group.bench_with_input(BenchmarkId::new("silu_and_mul", rows), &rows, |b, _| {
            b.iter(|| {
                silu_and_mul(Dst::Bf16(&mut out), Src::Bf16(black_box(&x)), inter).expect("act")
            })
        });
        let h = values(rows * hidden, 2);
        let w = values(hidden, 5);
        let mut out = vec![bf16::ZERO; rows * hidden];
        group.throughput(Throughput::Elements((rows * hidden) as u64));
        group.bench_with_input(BenchmarkId::new("rms_norm", rows), &rows, |b, _| {
            b.iter(|| {
                rms_norm(
                    Dst::Bf16(&mut out),
                    Src::Bf16(black_box(&h)),
                    Src::Bf16(&w),
                    1e-6,
                    hidden,
                )
                .expect("norm")
            })
        });
    }
    group.finish();
}

/// The CPU's f32 FMA peak on one core: 12 independent chains of 512-bit FMAs
/// on registers only (criterion's "elements" are FLOPs). Twice this per core
/// bounds what the FMA tiles can reach (`docs/performance.md`); the
/// `vdpbf16ps` peak beside it bounds the avx512bf16 path's dot-product tile.
fn bench_fma_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if Path::Avx512.is_available() {
        const ITERS: usize = 100_000;
        let mut group = c.benchmark_group("peak");
        group.throughput(Throughput::Elements((ITERS * 12 * 32) as u64));
        group.bench_function("fma512_one_core", |b| {
            // SAFETY: AVX-512F is available (checked above).
            b.iter(|| unsafe { fma_chains(black_box(1.000_001)) })
        });
        if Path::Avx512Bf16.is_available() {
            // The same with `vdpbf16ps`: 64 FLOPs per instruction.
            group.throughput(Throughput::Elements((ITERS * 12 * 64) as u64));
            group.bench_function("dpbf16_512_one_core", |b| {
                // SAFETY: AVX512-BF16 is available (checked above).
                b.iter(|| unsafe { dot_chains(black_box(1.0)) })
            });
        }
        group.finish();
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dot_chains(x: f32) -> f32 {
        use std::arch::x86_64::*;
        let m: __m512bh = std::mem::transmute(_mm512_set1_epi32(x.to_bits() as i32));
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..100_000 {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, m, m);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma_chains(x: f32) -> f32 {
        use std::arch::x86_64::*;
        let (m, a) = (_mm512_set1_ps(x), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..100_000 {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, m, a);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
}

criterion_group!(benches, bench_gemm, bench_layers, bench_fma_peak);
criterion_main!(benches);
