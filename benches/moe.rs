//! The mixture-of-experts layer (`rust/moe/`) on a small MoE's shapes (64
//! experts, top 8, hidden 1024, expert intermediate 384): batch-1 decode (1
//! token: 8 experts of one row each) and a prefill chunk (128 tokens: every
//! expert about 16 rows), over f32 and bf16 packed weights and q8_0
//! quantized ones, and the router. Throughput is the experts' multiply-adds
//! (criterion's "elements": divide by 1e9 for GMAC/s).
//!
//! `cargo bench --bench moe -- --warm-up-time 1 --measurement-time 2`
//! (`FASTLLM_BENCH_KINDS=bf16,q8_0` limits the weight kinds). At 1 token
//! the 8 experts' weights (19 MB in bf16) may stay in the last-level cache
//! between iterations, so its figures can exceed DRAM bandwidth.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::cpu::{Element, IntPath, Src};
use fastllm::gemm::PackedWeight;
use fastllm::linear::{self, LinearWeight};
use fastllm::moe::{route, ExpertAct, Experts, Rule, Scoring};
use fastllm::quant::{QuantFormat, QuantWeight};
use half::bf16;

const EXPERTS: usize = 64;
const TOP_K: usize = 8;
const HIDDEN: usize = 1024;
const INTER: usize = 384;

fn values(len: usize, salt: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_f32((((i + salt) * 7919) % 255) as f32 / 255.0 - 0.5))
        .collect()
}

/// One weight `[n, k]` of expert `salt` as `kind` ("f32", "bf16", "q8_0").
fn weight(kind: &str, n: usize, k: usize, salt: usize) -> LinearWeight {
    let w = values(n * k, salt);
    match kind {
        "q8_0" => {
            let q = QuantWeight::quantize(QuantFormat::Q8_0, Src::Bf16(&w), None, n, k);
            linear::quantized(Arc::new(q.expect("quantize")), IntPath::best())
        }
        "f32" => {
            let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let p = PackedWeight::pack(Src::F32(&wf), None, n, k).expect("pack");
            linear::float(Arc::new(p), fastllm::gemm::default_path())
        }
        _ => {
            let p = PackedWeight::pack(Src::Bf16(&w), None, n, k).expect("pack");
            linear::float(Arc::new(p), fastllm::gemm::default_path())
        }
    }
}

fn experts(kind: &str) -> Experts {
    let gate_up = (0..EXPERTS)
        .map(|e| weight(kind, 2 * INTER, HIDDEN, 2 * e))
        .collect();
    let down = (0..EXPERTS)
        .map(|e| weight(kind, HIDDEN, INTER, 2 * e + 1))
        .collect();
    Experts::new(gate_up, down, ExpertAct::Silu).expect("experts")
}

/// Each token's 8 distinct experts, spread over all 64; equal weights.
fn routing(tokens: usize) -> (Vec<i32>, Vec<f32>) {
    let ids = (0..tokens)
        .flat_map(|t| (0..TOP_K).map(move |j| ((t * 5 + j * 8) % EXPERTS) as i32))
        .collect();
    (ids, vec![1.0 / TOP_K as f32; tokens * TOP_K])
}

fn run<T: Element>(c: &mut Criterion, ex: &Experts, kind: &str, tokens: usize) {
    let x: Vec<T> = values(tokens * HIDDEN, 3)
        .iter()
        .map(|v| T::from_f32(v.to_f32()))
        .collect();
    let mut out = vec![T::from_f32(0.0); tokens * HIDDEN];
    let (ids, weights) = routing(tokens);
    let mut group = c.benchmark_group("moe/experts");
    let macs = tokens * TOP_K * 3 * INTER * HIDDEN;
    group.throughput(Throughput::Elements(macs as u64));
    group.bench_with_input(BenchmarkId::new(kind, tokens), &tokens, |b, &t| {
        b.iter(|| {
            ex.forward(&mut out, black_box(&x), &ids, &weights, t, TOP_K)
                .expect("forward")
        })
    });
    group.finish();
}

fn bench_experts(c: &mut Criterion) {
    let kinds: Vec<String> = match std::env::var("FASTLLM_BENCH_KINDS") {
        Ok(v) => v.split(',').map(|s| s.trim().to_lowercase()).collect(),
        Err(_) => vec!["f32".into(), "bf16".into(), "q8_0".into()],
    };
    for kind in &kinds {
        // One kind's weights at a time (f32: 300 MB).
        let ex = experts(kind);
        for tokens in [1usize, 128] {
            if kind == "f32" {
                run::<f32>(c, &ex, kind, tokens);
            } else {
                run::<bf16>(c, &ex, kind, tokens);
            }
        }
    }
}

fn bench_route(c: &mut Criterion) {
    let mut group = c.benchmark_group("moe/route");
    for tokens in [1usize, 128] {
        let logits: Vec<f32> = values(tokens * EXPERTS, 5)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let mut ids = vec![0i32; tokens * TOP_K];
        let mut weights = vec![0f32; tokens * TOP_K];
        let rule = Rule::new(TOP_K, Scoring::Softmax, true);
        group.bench_with_input(BenchmarkId::new("softmax", tokens), &tokens, |b, &t| {
            b.iter(|| {
                route(
                    black_box(&logits),
                    t,
                    EXPERTS,
                    &rule,
                    &mut ids,
                    &mut weights,
                )
                .expect("route")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_experts, bench_route);
criterion_main!(benches);
