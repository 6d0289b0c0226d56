// Fused elementwise layers, each replacing a chain of torch ops. Every kernel
// rounds where the torch expression it replaces rounds (each op of a 16-bit
// dtype computes in f32 and rounds to the dtype), so results agree with torch
// up to the last ulp of transcendental functions and reduction order.
#include "common.cuh"

// RMSNorm over rows of `x` ([rows, dim], rows `x_stride` apart) into `out`
// ([rows, dim], contiguous): out = w * T(x * rsqrt(mean(x^2) + eps)), as
// fastllm.layers.norm.RMSNorm computes it. One block per row.
template <typename T>
__device__ void rms_norm_impl(T* __restrict__ out, const T* __restrict__ x,
                              const T* __restrict__ weight, i64 x_stride, int dim, float eps) {
    __shared__ float red[32];
    const T* row = x + (i64)blockIdx.x * x_stride;
    T* out_row = out + (i64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_float(row[i]);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float y = round_to<T>(__fmul_rn(to_float(row[i]), r));
        out_row[i] = from_float<T>(__fmul_rn(to_float(weight[i]), y));
    }
}

// Neox-style rotary embedding of x ([tokens, heads, head_size], tokens
// `x_stride` apart, heads contiguous) into `out` (contiguous, same shape):
// the first 2 * half dims of each head rotate as pairs (d, d + half), the
// rest are copied. cos/sin are [tokens, half] in T, tokens `cs_stride` apart
// (the layer's cos/sin already gathered by position and cast to T).
template <typename T>
__device__ void rotary_impl(T* __restrict__ out, const T* __restrict__ x,
                            const T* __restrict__ cos, const T* __restrict__ sin, i64 x_stride,
                            i64 cs_stride, int heads, int head_size, int half) {
    const i64 t = blockIdx.x;
    const T* xr = x + t * x_stride;
    T* outr = out + t * (i64)heads * head_size;
    const T* c_row = cos + t * cs_stride;
    const T* s_row = sin + t * cs_stride;
    const int total = heads * head_size;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int h = i / head_size;
        const int d = i % head_size;
        const T* xh = xr + (i64)h * head_size;
        float v;
        if (d < half) {
            const float x1 = to_float(xh[d]), x2 = to_float(xh[d + half]);
            const float c = to_float(c_row[d]), s = to_float(s_row[d]);
            v = __fsub_rn(round_to<T>(__fmul_rn(x1, c)), round_to<T>(__fmul_rn(x2, s)));
        } else if (d < 2 * half) {
            const int j = d - half;
            const float x1 = to_float(xh[j]), x2 = to_float(xh[d]);
            const float c = to_float(c_row[j]), s = to_float(s_row[j]);
            v = __fadd_rn(round_to<T>(__fmul_rn(x2, c)), round_to<T>(__fmul_rn(x1, s)));
        } else {
            v = to_float(xh[d]);
        }
        outr[i] = from_float<T>(v);
    }
}

// out[r, i] = T(silu(x[r, i])) * x[r, d + i] for x [rows, 2d] (rows `x_stride`
// apart) and out [rows, d] contiguous; grid (rows, ceil(d / blockDim)).
template <typename T>
__device__ void silu_and_mul_impl(T* __restrict__ out, const T* __restrict__ x, i64 x_stride,
                                  int d) {
    const i64 r = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= d) return;
    const float g = to_float(x[r * x_stride + i]);
    const float u = to_float(x[r * x_stride + d + i]);
    const float s = round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
    out[r * d + i] = from_float<T>(__fmul_rn(s, u));
}

#define DEFINE_LAYERS(T, SUFFIX)                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_##SUFFIX(T* out, const T* x, const T* weight, \
                                                 i64 x_stride, int dim, float eps) {             \
        rms_norm_impl<T>(out, x, weight, x_stride, dim, eps);                                    \
    }                                                                                            \
    extern "C" __global__ void rotary_##SUFFIX(T* out, const T* x, const T* cos, const T* sin,   \
                                               i64 x_stride, i64 cs_stride, int heads,           \
                                               int head_size, int half) {                        \
        rotary_impl<T>(out, x, cos, sin, x_stride, cs_stride, heads, head_size, half);           \
    }                                                                                            \
    extern "C" __global__ void silu_and_mul_##SUFFIX(T* out, const T* x, i64 x_stride, int d) { \
        silu_and_mul_impl<T>(out, x, x_stride, d);                                               \
    }

DEFINE_LAYERS(float, f32)
DEFINE_LAYERS(f16, f16)
DEFINE_LAYERS(bf16, bf16)
