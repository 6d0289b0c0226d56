//! Sampler throughput on `[batch, 151936]` logits with typical settings
//! (temperature 0.8, top_k 50, top_p 0.9), with and without penalties
//! (repetition 1.1, frequency 0.1, presence 0.1 over 256 history tokens).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastllm::sampling::{sample_batch, Batch, SamplingParams};

const VOCAB: usize = 151_936;
const HISTORY: usize = 256;

/// Deterministic pseudo-random logits shaped like a language model's: mostly
/// noise around 0 with a handful of large values.
fn logits(rows: usize) -> Vec<f32> {
    let mut state = 0x1234_5678_9ABC_DEF0u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..rows * VOCAB)
        .map(|_| {
            let u = next();
            let base = (u - 0.5) * 8.0;
            if u > 0.9995 {
                base + 15.0
            } else {
                base
            }
        })
        .collect()
}

fn bench_sampler(c: &mut Criterion) {
    let mut group = c.benchmark_group("sampler");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(2));
    for &rows in &[1usize, 8, 64] {
        let logits = logits(rows);
        let history: Vec<i32> = (0..rows * HISTORY)
            .map(|i| ((i * 7919) % VOCAB) as i32)
            .collect();
        let offsets: Vec<usize> = (0..=rows).map(|r| r * HISTORY).collect();
        let empty_offsets = vec![0usize; rows + 1];
        for penalties in [false, true] {
            let params: Vec<SamplingParams> = (0..rows)
                .map(|r| SamplingParams {
                    temperature: 0.8,
                    top_k: 50,
                    top_p: 0.9,
                    repetition_penalty: if penalties { 1.1 } else { 1.0 },
                    frequency_penalty: if penalties { 0.1 } else { 0.0 },
                    presence_penalty: if penalties { 0.1 } else { 0.0 },
                    seed: r as u64,
                    position: 100,
                    ..Default::default()
                })
                .collect();
            let batch = Batch {
                logits: &logits,
                vocab: VOCAB,
                params: &params,
                prompt_tokens: if penalties { &history } else { &[] },
                prompt_offsets: if penalties { &offsets } else { &empty_offsets },
                output_tokens: if penalties { &history } else { &[] },
                output_offsets: if penalties { &offsets } else { &empty_offsets },
            };
            group.throughput(Throughput::Elements(rows as u64));
            let name = if penalties { "penalties" } else { "plain" };
            group.bench_with_input(BenchmarkId::new(name, rows), &batch, |b, batch| {
                b.iter(|| black_box(sample_batch(black_box(batch))))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_sampler);
criterion_main!(benches);
