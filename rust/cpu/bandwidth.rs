//! The memory bandwidth the kernels' threads can reach: the yardstick the
//! memory-bound kernels (batch-1 GEMM, decode attention) are measured against.

use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};

/// STREAM-triad bandwidth (`a = b + s * c`, f32 arrays of `bytes` each) on
/// the private pool, in GB/s (10^9 bytes, counting 3 arrays per pass); best
/// of `repeats` passes after one warm-up pass, as STREAM reports.
pub fn stream_triad_gbs(bytes: usize, repeats: usize) -> CoreResult<f64> {
    let len = bytes / 4;
    if len == 0 {
        return Err(CoreError::invalid("bytes: must be at least 4"));
    }
    let threads = crate::cpu::threads::num_threads();
    let chunk = len.div_ceil(threads * 8).max(4096);
    let mut a: Vec<f32> = Vec::new();
    let mut b: Vec<f32> = Vec::new();
    let mut c: Vec<f32> = Vec::new();
    for v in [&mut a, &mut b, &mut c] {
        v.try_reserve_exact(len).map_err(|_| {
            CoreError::Exhausted(format!("stream triad: cannot allocate {bytes} bytes"))
        })?;
    }
    let s = 3.0f32;
    let mut best = f64::INFINITY;
    crate::cpu::threads::install(|| {
        // First touch on the pool's threads, chunk by chunk.
        a.resize(len, 0.0);
        b.resize(len, 1.0);
        c.resize(len, 2.0);
        for pass in 0..repeats.max(1) + 1 {
            let t0 = std::time::Instant::now();
            a.par_chunks_mut(chunk)
                .zip(b.par_chunks(chunk))
                .zip(c.par_chunks(chunk))
                .for_each(|((a, b), c)| {
                    for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                        *a = b + s * c;
                    }
                });
            let dt = t0.elapsed().as_secs_f64();
            if pass > 0 {
                best = best.min(dt);
            }
        }
    });
    std::hint::black_box(&a);
    Ok(3.0 * (len * 4) as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triad_measures_something_positive() {
        let gbs = stream_triad_gbs(1 << 20, 2).unwrap();
        assert!(gbs.is_finite() && gbs > 0.0);
        assert!(stream_triad_gbs(0, 1).is_err());
    }
}
