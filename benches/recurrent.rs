//! The recurrent token mixers (`rust/recurrent/`) on Qwen3.5-2B-like shapes:
//! the gated delta rule (16 query/key heads, 16 value heads, head size 128,
//! bf16 inputs, f32 state) at decode (8 sequences x 1 row) and prefill (1
//! sequence x 512 rows), both forms side by side over 1 to 64 rows (where
//! `CHUNKED_MIN_ROWS` comes from), and the causal convolution (6144
//! channels, width 4, bf16) at 1 and 512 rows. Throughput: state elements
//! (`Dk x Dv` per row and value head) and convolution inputs (rows x
//! channels).
//!
//! `cargo bench --bench recurrent -- --warm-up-time 1 --measurement-time 2`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::cpu::{Dst, Src};
use fastllm::recurrent::{
    causal_conv1d, gated_delta_rule_with, ConvShape, DeltaInputs, DeltaOptions, DeltaShape, Form,
    Packed,
};
use half::bf16;

const K_HEADS: usize = 16;
const V_HEADS: usize = 16;
const DIM: usize = 128;
const CHANNELS: usize = 6144;
const WIDTH: usize = 4;

/// Deterministic values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn bf16s(n: usize, seed: u64) -> Vec<bf16> {
    noise(n, seed).into_iter().map(bf16::from_f32).collect()
}

/// One delta-rule call's inputs: `seqs` sequences of `rows` rows.
struct Delta {
    shape: DeltaShape,
    qsl: Vec<i32>,
    slots: Vec<i64>,
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
    out: Vec<bf16>,
}

impl Delta {
    fn new(seqs: usize, rows: usize, v_heads: usize) -> Self {
        let tokens = seqs * rows;
        let k_heads = K_HEADS.min(v_heads);
        let shape = DeltaShape {
            tokens,
            k_heads,
            v_heads,
            k_dim: DIM,
            v_dim: DIM,
            slots: seqs,
        };
        let gates = tokens * v_heads;
        Delta {
            shape,
            qsl: (0..=seqs).map(|i| (i * rows) as i32).collect(),
            slots: (0..seqs as i64).collect(),
            q: bf16s(tokens * k_heads * DIM, 1),
            k: bf16s(tokens * k_heads * DIM, 2),
            v: bf16s(tokens * v_heads * DIM, 3),
            g: noise(gates, 4).iter().map(|x| -0.5 * x.abs()).collect(),
            beta: noise(gates, 5).iter().map(|x| 0.5 + 0.4 * x).collect(),
            state: noise(seqs * v_heads * DIM * DIM, 6)
                .iter()
                .map(|x| 0.1 * x)
                .collect(),
            out: vec![bf16::ZERO; tokens * v_heads * DIM],
        }
    }

    fn run(&mut self, opts: DeltaOptions) {
        let inputs = DeltaInputs {
            q: Src::Bf16(&self.q),
            k: Src::Bf16(&self.k),
            v: Src::Bf16(&self.v),
            g: &self.g,
            beta: &self.beta,
        };
        let packed = Packed {
            query_start_loc: &self.qsl,
            state_slots: &self.slots,
        };
        let scale = (DIM as f32).powf(-0.5);
        let out = Dst::Bf16(&mut self.out);
        gated_delta_rule_with(
            out,
            inputs,
            &mut self.state,
            packed,
            self.shape,
            scale,
            true,
            opts,
        )
        .expect("gated_delta_rule");
    }

    fn elements(&self) -> u64 {
        (self.shape.tokens * self.shape.v_heads * DIM * DIM) as u64
    }
}

fn bench_delta(c: &mut Criterion) {
    let mut group = c.benchmark_group("gated_delta_rule");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (name, seqs, rows) in [("decode_8x1", 8, 1), ("prefill_1x512", 1, 512)] {
        let mut d = Delta::new(seqs, rows, V_HEADS);
        group.throughput(Throughput::Elements(d.elements()));
        group.bench_function(name, |b| b.iter(|| d.run(DeltaOptions::default())));
    }
    group.finish();
}

/// Both forms on one sequence of 1 to 64 rows (two value heads: the
/// single-task cost of each form).
fn bench_forms(c: &mut Criterion) {
    let mut group = c.benchmark_group("delta_forms");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for rows in [1usize, 2, 3, 4, 8, 16, 64] {
        let mut d = Delta::new(1, rows, 2);
        group.throughput(Throughput::Elements(d.elements()));
        for (name, form) in [("recurrent", Form::Recurrent), ("chunked", Form::Chunked)] {
            let opts = DeltaOptions {
                form,
                column_blocks: 1,
                ..DeltaOptions::default()
            };
            group.bench_function(BenchmarkId::new(name, rows), |b| b.iter(|| d.run(opts)));
        }
    }
    group.finish();
}

fn bench_conv(c: &mut Criterion) {
    let mut group = c.benchmark_group("causal_conv1d");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let weight = bf16s(CHANNELS * WIDTH, 7);
    let bias = bf16s(CHANNELS, 8);
    for rows in [1usize, 512] {
        let x = bf16s(rows * CHANNELS, 9);
        let mut out = vec![bf16::ZERO; rows * CHANNELS];
        let mut state = bf16s(CHANNELS * (WIDTH - 1), 10);
        let shape = ConvShape {
            tokens: rows,
            channels: CHANNELS,
            width: WIDTH,
            slots: 1,
        };
        let qsl = [0, rows as i32];
        group.throughput(Throughput::Elements((rows * CHANNELS) as u64));
        group.bench_function(BenchmarkId::new("bf16_silu", rows), |b| {
            b.iter(|| {
                let packed = Packed {
                    query_start_loc: &qsl,
                    state_slots: &[0],
                };
                causal_conv1d(
                    Dst::Bf16(&mut out),
                    Src::Bf16(&x),
                    Src::Bf16(&weight),
                    Some(Src::Bf16(&bias)),
                    Dst::Bf16(&mut state),
                    packed,
                    shape,
                    true,
                )
                .expect("causal_conv1d")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_delta, bench_forms, bench_conv);
criterion_main!(benches);
