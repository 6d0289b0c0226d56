// Shared helpers of fastllm's CUDA kernels, compiled by NVRTC with no headers
// but NVRTC's builtins: 16-bit floats are raw bit patterns converted by hand
// (f16 through PTX `cvt`, bf16 by rounding to nearest even), so no CUDA
// toolkit header is needed at run time.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct f16 { u16 bits; };
struct bf16 { u16 bits; };

#define FLT_MAX_ 3.402823466e+38f
#define NEG_INF_ __int_as_float(0xff800000)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float v) {
    u32 u = __float_as_uint(v);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
        r.bits = (u16)(u >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16 from_float<f16>(float v) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

// Rounds an f32 through T and back: the value torch would hold after an op in T.
template <typename T> __device__ __forceinline__ float round_to(float v) {
    return to_float(from_float<T>(v));
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide reductions; every thread gets the result. `scratch` holds 32
// values; blockDim.x must be a multiple of 32. Safe to call back to back.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF_;
    return warp_max(v);
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
