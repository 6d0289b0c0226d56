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
//!
//! `quant_ceiling/*` (x86-64 with AVX2 and FMA) times the instruction mixes
//! alone, on one thread, from registers and L1: f32 FMA (8 multiply-adds an
//! instruction, what the float GEMM's tile is made of), the exact int8 x int8
//! step of the paths without VNNI (`vpsignb`, `vpmaddubsw`, `vpmaddwd`,
//! `vpaddd`: 32 multiply-adds) and the 4-bit step whose pair sums stay in i16
//! (`vpmaddubsw`, `vpaddw`). Their ratio is the most an integer kernel can
//! gain over the float one on that CPU (`cargo bench --bench quant_gemm --
//! quant_ceiling`).

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

/// The instruction mixes of the float and integer tiles, 8 independent
/// accumulators each, operands loaded from a 2 KiB table (so no step can be
/// computed once for all). Returns a checksum.
#[cfg(target_arch = "x86_64")]
mod ceiling {
    use std::arch::x86_64::*;

    /// Steps of one call.
    pub const STEPS: usize = 1 << 16;

    #[repr(align(32))]
    pub struct Table(pub [u8; 2048]);

    macro_rules! eight {
        ($acc:ident, $zero:expr, |$a:ident, $p:ident| $step:expr) => {{
            let mut $acc = [$zero; 8];
            for it in 0..STEPS / 8 {
                let base = (it & 7) * 256;
                for (i, $a) in $acc.iter_mut().enumerate() {
                    let $p = base + 32 * i;
                    *$a = $step;
                }
            }
            $acc
        }};
    }

    /// f32 FMA: 8 multiply-adds a step.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma(t: &Table) -> f32 {
        let x = _mm256_set1_ps(0.5);
        let f = t.0.as_ptr() as *const f32;
        let acc = eight!(acc, _mm256_setzero_ps(), |a, p| _mm256_fmadd_ps(
            _mm256_load_ps(f.add(p / 4)),
            x,
            *a
        ));
        acc.iter().map(|v| _mm256_cvtss_f32(*v)).sum()
    }

    /// Exact int8 x int8 without VNNI: 32 multiply-adds a step.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn int8(t: &Table) -> i32 {
        let (x, ax, one) = (
            _mm256_set1_epi8(-77),
            _mm256_set1_epi8(77),
            _mm256_set1_epi16(1),
        );
        let w = t.0.as_ptr();
        let acc = eight!(acc, _mm256_setzero_si256(), |a, p| {
            let s = _mm256_sign_epi8(_mm256_load_si256(w.add(p) as *const __m256i), x);
            _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, s), one))
        });
        acc.iter().map(|v| _mm256_cvtsi256_si32(*v)).sum()
    }

    /// 4-bit weights, pair sums kept in i16: 32 multiply-adds a step.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn pairs(t: &Table) -> i32 {
        let x = _mm256_set1_epi8(-77);
        let w = t.0.as_ptr();
        let acc = eight!(acc, _mm256_setzero_si256(), |a, p| {
            let q = _mm256_and_si256(
                _mm256_load_si256(w.add(p) as *const __m256i),
                _mm256_set1_epi8(15),
            );
            _mm256_add_epi16(*a, _mm256_maddubs_epi16(q, x))
        });
        acc.iter().map(|v| _mm256_cvtsi256_si32(*v)).sum()
    }
}

fn bench_ceiling(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let mut table = ceiling::Table([0; 2048]);
        for (i, b) in table.0.iter_mut().enumerate() {
            *b = (i * 37 % 251) as u8;
        }
        let mut group = c.benchmark_group("quant_ceiling");
        let steps = ceiling::STEPS as u64;
        group.throughput(Throughput::Elements(8 * steps));
        // SAFETY (all three): AVX2 and FMA were detected above.
        group.bench_function("f32_fma", |b| {
            b.iter(|| unsafe { ceiling::fma(black_box(&table)) })
        });
        group.throughput(Throughput::Elements(32 * steps));
        group.bench_function("int8_maddubs_maddwd", |b| {
            b.iter(|| unsafe { ceiling::int8(black_box(&table)) })
        });
        group.bench_function("int4_pairs_i16", |b| {
            b.iter(|| unsafe { ceiling::pairs(black_box(&table)) })
        });
        group.finish();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c;
}

criterion_group!(benches, bench_quant, bench_ceiling);
criterion_main!(benches);
