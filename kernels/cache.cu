// The KV-cache write: key/value rows of the step's tokens stored into their
// slots of the paged cache [num_blocks, num_kv_heads, block_size, head_size].
#include "common.cuh"

// One block per token. `key`/`value` rows are `key_stride` / `value_stride`
// elements apart (views of a fused qkv projection), each row
// [num_kv_heads, head_size] contiguous. A slot outside [0, num_slots) is
// skipped (negative slots mean "padding" by contract).
template <typename T>
__device__ void reshape_and_cache_impl(const T* __restrict__ key, const T* __restrict__ value,
                                       T* __restrict__ key_cache, T* __restrict__ value_cache,
                                       const i64* __restrict__ slot_mapping, i64 key_stride,
                                       i64 value_stride, int num_kv_heads, int head_size,
                                       int block_size, i64 num_slots) {
    const i64 token = blockIdx.x;
    const i64 slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;
    const i64 block = slot / block_size;
    const i64 offset = slot % block_size;
    const int row = num_kv_heads * head_size;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int h = i / head_size;
        const int d = i % head_size;
        const i64 dst = ((block * num_kv_heads + h) * block_size + offset) * head_size + d;
        key_cache[dst] = key[token * key_stride + i];
        value_cache[dst] = value[token * value_stride + i];
    }
}

#define DEFINE_CACHE(T, SUFFIX)                                                                 \
    extern "C" __global__ void reshape_and_cache_##SUFFIX(                                      \
        const T* key, const T* value, T* key_cache, T* value_cache, const i64* slot_mapping,    \
        i64 key_stride, i64 value_stride, int num_kv_heads, int head_size, int block_size,      \
        i64 num_slots) {                                                                        \
        reshape_and_cache_impl<T>(key, value, key_cache, value_cache, slot_mapping, key_stride, \
                                  value_stride, num_kv_heads, head_size, block_size,            \
                                  num_slots);                                                   \
    }

DEFINE_CACHE(float, f32)
DEFINE_CACHE(f16, f16)
DEFINE_CACHE(bf16, bf16)
