// The batched sampler with the CPU sampler's semantics (rust/sampling.rs),
// one block per row. Order: raw log-probabilities -> penalties -> greedy if
// temperature < 1e-5 -> temperature -> min_p -> top-k -> top-p -> exponential
// race. The race uses the CPU's counter-based draw bit for bit:
//   row_key = mix64(mix64(seed + G) + (position + 1) * G)
//   u       = ((mix64(row_key + (token + 1) * G) >> 12) + 0.5) * 2^-52
//   key     = (double)w - log(-log(u)),   token = argmax key, ties -> lowest id
// and the filters use the CPU's polynomial exp (`fast_exp`, f32, no FMA), so
// the kept set and the drawn token match the CPU given identical logits (up
// to rounding of f64 sums that sit exactly on a top-p boundary).
//
// Selections avoid sorting: the k-th largest tempered logit and the top-p
// boundary are found by bisection over the bit patterns of the values, each
// step one block-wide count or f64 mass reduction (deterministic order).
#include "common.cuh"

#define GOLDEN 0x9E3779B97F4A7C15ull
#define PROMPT_BIT 0x40000000

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 row_key(u64 seed, u64 position) {
    return mix64(mix64(seed + GOLDEN) + (position + 1) * GOLDEN);
}

__device__ __forceinline__ double unit(u64 key, u32 token) {
    const u64 h = mix64(key + ((u64)token + 1) * GOLDEN);
    return ((double)(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
}

// NaN -> -inf, +inf -> FLT_MAX.
__device__ __forceinline__ float sanitize(float v) {
    if (v != v) return NEG_INF_;
    return v > FLT_MAX_ ? FLT_MAX_ : v;
}

// The CPU sampler's exp, operation for operation (no contraction into FMA).
__device__ __forceinline__ float fast_exp(float x) {
    const float LN2_HI = 0.6933594f;
    const float LN2_LO = -2.1219444e-4f;
    const float SHIFTER = 12582912.0f;
    const float LOG2E = 1.44269504088896340736f;
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float kf = __fsub_rn(__fadd_rn(__fmul_rn(xc, LOG2E), SHIFTER), SHIFTER);
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(kf, LN2_HI)), __fmul_rn(kf, LN2_LO));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 5.0000001e-1f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    const float scale = __uint_as_float(((u32)((int)kf + 127)) << 23);
    return x < -87.0f ? 0.0f : __fmul_rn(y, scale);
}

// (value, index) pairs: larger value wins, ties -> lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}
__device__ __forceinline__ bool better_d(double v, int i, double bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

struct Scratch {
    double d[32];
    float f[32];
    int i[32];
};

__device__ void block_argmax(float& v, int& idx, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { s.f[warp] = v; s.i[warp] = idx; }
    __syncthreads();
    v = lane < warps ? s.f[lane] : NEG_INF_;
    idx = lane < warps ? s.i[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
}

__device__ void block_argmax_d(double& v, int& idx, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better_d(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { s.d[warp] = v; s.i[warp] = idx; }
    __syncthreads();
    v = lane < warps ? s.d[lane] : -__longlong_as_double(0x7ff0000000000000ll);
    idx = lane < warps ? s.i[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better_d(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
}

// Deterministic f64 sum: fixed butterfly per warp, warps in order.
__device__ double block_sum_d(double v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s.d[warp] = v;
    __syncthreads();
    v = lane < warps ? s.d[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ int block_count(int v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s.i[warp] = v;
    __syncthreads();
    v = lane < warps ? s.i[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Float bits mapped so unsigned order is numeric order (-inf lowest).
__device__ __forceinline__ u32 ordered(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unordered(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Is token i in the set before top-p: finite, min_p, top-k.
__device__ __forceinline__ bool kept_before_top_p(float wi, float w_max, float min_p, bool top_k,
                                                  float kth) {
    return wi > NEG_INF_ && fast_exp(wi - w_max) >= min_p && (!top_k || wi >= kth);
}

// fparams [rows, 6]: temperature, top_p, min_p, repetition, frequency, presence.
// iparams [rows, 3]: top_k, seed (u64 bits), position.
// Histories: flat int32 tokens with rows + 1 int64 offsets.
// Workspaces: w [rows, vocab] f32, counts [rows, vocab] i32.
// Outputs: token, its raw log-probability and its rank (1 + strictly larger).
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* __restrict__ logits, int vocab,
                                       const float* __restrict__ fparams,
                                       const i64* __restrict__ iparams,
                                       const int* __restrict__ prompt_tokens,
                                       const i64* __restrict__ prompt_offsets,
                                       const int* __restrict__ output_tokens,
                                       const i64* __restrict__ output_offsets,
                                       float* __restrict__ w_ws, int* __restrict__ count_ws,
                                       int* __restrict__ out_token, float* __restrict__ out_logprob,
                                       int* __restrict__ out_rank) {
    __shared__ Scratch s;
    const i64 r = blockIdx.x;
    const int tid = threadIdx.x, nt = blockDim.x;
    const float* x = logits + r * vocab;

    // Raw statistics: maximum, argmax (lowest id), sum of exp for the log-softmax.
    float raw_max = NEG_INF_;
    int raw_arg = 0x7fffffff;
    for (int i = tid; i < vocab; i += nt) {
        const float v = sanitize(x[i]);
        if (better(v, i, raw_max, raw_arg)) { raw_max = v; raw_arg = i; }
    }
    block_argmax(raw_max, raw_arg, s);
    double se = 0.0;
    if (raw_max > NEG_INF_)
        for (int i = tid; i < vocab; i += nt) se += (double)fast_exp(sanitize(x[i]) - raw_max);
    se = block_sum_d(se, s);

    const float temperature = fparams[r * 6 + 0];
    const float top_p = fparams[r * 6 + 1];
    const float min_p = fparams[r * 6 + 2];
    const float rep = fparams[r * 6 + 3];
    const float freq = fparams[r * 6 + 4];
    const float pres = fparams[r * 6 + 5];
    const i64 top_k = iparams[r * 3 + 0];
    const u64 seed = (u64)iparams[r * 3 + 1];
    const u64 position = (u64)iparams[r * 3 + 2];
    const i64 p_lo = prompt_offsets[r], p_hi = prompt_offsets[r + 1];
    const i64 o_lo = output_offsets[r], o_hi = output_offsets[r + 1];
    const bool greedy = temperature < 1e-5f;
    const bool penalised =
        (rep != 1.0f || freq != 0.0f || pres != 0.0f) && (p_hi > p_lo || o_hi > o_lo);

    int token = raw_arg;
    if (!(greedy && !penalised)) {
        const float t = greedy ? 1.0f : temperature;
        float* w = w_ws + r * vocab;
        int* cnt = count_ws + r * vocab;
        for (int i = tid; i < vocab; i += nt) {
            w[i] = fminf(__fdiv_rn(sanitize(x[i]), t), FLT_MAX_);
            if (penalised) cnt[i] = 0;
        }
        if (penalised) {
            __syncthreads();
            // Token ids outside the vocabulary are ignored (the CPU sampler rejects them).
            for (i64 j = o_lo + tid; j < o_hi; j += nt) {
                const int tok = output_tokens[j];
                if ((u32)tok < (u32)vocab) atomicAdd(&cnt[tok], 1);
            }
            if (rep != 1.0f)
                for (i64 j = p_lo + tid; j < p_hi; j += nt) {
                    const int tok = prompt_tokens[j];
                    if ((u32)tok < (u32)vocab) atomicOr(&cnt[tok], PROMPT_BIT);
                }
            __syncthreads();
            for (int i = tid; i < vocab; i += nt) {
                const int c = cnt[i];
                if (c == 0) continue;
                float z = sanitize(x[i]);
                z = z > 0.0f ? __fdiv_rn(z, rep) : __fmul_rn(z, rep);
                const int n = c & ~PROMPT_BIT;
                if (n > 0) {
                    z = __fsub_rn(z, __fmul_rn(freq, (float)n));
                    z = __fsub_rn(z, pres);
                }
                w[i] = fminf(__fdiv_rn(z, t), FLT_MAX_);
            }
        }
        __syncthreads();
        float w_max = NEG_INF_;
        int w_arg = 0x7fffffff;
        for (int i = tid; i < vocab; i += nt)
            if (better(w[i], i, w_max, w_arg)) { w_max = w[i]; w_arg = i; }
        block_argmax(w_max, w_arg, s);
        if (w_max == NEG_INF_) {
            token = raw_arg;
        } else if (greedy) {
            token = w_arg;
        } else {
            const float mp = min_p > 0.0f ? min_p : 0.0f;
            const bool use_k = top_k > 0 && top_k < (i64)vocab;
            float kth = NEG_INF_;
            if (use_k) {
                // Largest K with #{ordered(w) >= K} >= top_k: the k-th largest value.
                u64 lo = 0, hi = 0xffffffffull;
                while (lo < hi) {
                    const u64 mid = lo + (hi - lo + 1) / 2;
                    int c = 0;
                    for (int i = tid; i < vocab; i += nt) c += ordered(w[i]) >= (u32)mid;
                    if ((i64)block_count(c, s) >= top_k) lo = mid; else hi = mid - 1;
                }
                kth = unordered((u32)lo);
            }
            float boundary = 0.0f;
            if (top_p < 1.0f) {
                // Largest e-value b with mass{kept, e >= b} >= top_p * mass{kept}.
                double total = 0.0;
                for (int i = tid; i < vocab; i += nt) {
                    const float e = fast_exp(w[i] - w_max);
                    if (e > 0.0f && kept_before_top_p(w[i], w_max, mp, use_k, kth)) total += (double)e;
                }
                total = block_sum_d(total, s);
                const double target = (double)top_p * total;
                u32 lo = 0, hi = 0x3f800000u;
                while (lo < hi) {
                    const u32 mid = lo + (hi - lo + 1) / 2;
                    double m = 0.0;
                    for (int i = tid; i < vocab; i += nt) {
                        const float e = fast_exp(w[i] - w_max);
                        if (e > 0.0f && __float_as_uint(e) >= mid &&
                            kept_before_top_p(w[i], w_max, mp, use_k, kth))
                            m += (double)e;
                    }
                    if (block_sum_d(m, s) >= target) lo = mid; else hi = mid - 1;
                }
                boundary = __uint_as_float(lo);
            }
            const u64 key = row_key(seed, position);
            double best = -__longlong_as_double(0x7ff0000000000000ll);
            int best_i = 0x7fffffff;
            for (int i = tid; i < vocab; i += nt) {
                const float wi = w[i];
                if (!kept_before_top_p(wi, w_max, mp, use_k, kth)) continue;
                if (fast_exp(wi - w_max) < boundary) continue;
                const double k = (double)wi - log(-log(unit(key, (u32)i)));
                if (better_d(k, i, best, best_i)) { best = k; best_i = i; }
            }
            block_argmax_d(best, best_i, s);
            token = best_i == 0x7fffffff ? w_arg : best_i;
        }
    }

    const float chosen = sanitize(x[token]);
    int above = 0;
    for (int i = tid; i < vocab; i += nt) above += sanitize(x[i]) > chosen;
    above = block_count(above, s);
    if (tid == 0) {
        out_token[r] = token;
        out_rank[r] = 1 + above;
        out_logprob[r] =
            raw_max == NEG_INF_ ? NEG_INF_ : (float)((double)chosen - ((double)raw_max + log(se)));
    }
}
