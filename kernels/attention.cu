// Paged attention with the CPU kernel's contract (rust/attention.rs):
// query/out [num_tokens, num_heads, head_size]; caches [num_blocks,
// num_kv_heads, block_size, head_size]; sequence s owns query rows
// query_start_loc[s]..query_start_loc[s+1], the last q_len of its seq_len
// tokens; query j of s sits at position p = seq_len - q_len + j and attends to
// keys [0, p], or (p - window, p] when window > 0; softcap > 0 replaces each
// scaled score s by softcap * tanh(s / softcap). Grouped-query heads share
// the KV head head / (num_heads / num_kv_heads). sinks (float [num_heads], or
// nullptr for none) are gpt-oss's attention sinks: head h's sinks[h] joins the
// softmax denominator as one more score with no value row (folded into the
// final normalisation; -inf is no sink).
//
// One block per (token, head): keys are processed in tiles of ATT_TILE with an
// online softmax; in a tile each thread scores one key, then each thread
// accumulates its own output dimensions over the tile's values (coalesced
// reads of the value rows). Scores, softmax and sums are f32.
#include "common.cuh"

#define ATT_THREADS 128
#define ATT_TILE 128
#define ATT_MAX_HEAD 512
#define ATT_DIMS (ATT_MAX_HEAD / ATT_THREADS)

template <typename T>
__device__ void paged_attention_impl(T* __restrict__ out, const T* __restrict__ query,
                                     const T* __restrict__ key_cache,
                                     const T* __restrict__ value_cache,
                                     const int* __restrict__ block_tables,
                                     const int* __restrict__ seq_lens,
                                     const int* __restrict__ query_start_loc, int num_seqs,
                                     int num_heads, int num_kv_heads, int head_size,
                                     int block_size, int max_blocks, float scale, int window,
                                     float softcap, const float* __restrict__ sinks) {
    __shared__ float q_s[ATT_MAX_HEAD];
    __shared__ float p_s[ATT_TILE];
    __shared__ i64 row_s[ATT_TILE];
    __shared__ float red[32];

    const int token = blockIdx.x;
    const int head = blockIdx.y;
    const int tid = threadIdx.x;
    T* out_row = out + ((i64)token * num_heads + head) * head_size;

    // The sequence owning this row: the last s with query_start_loc[s] <= token.
    int lo = 0, hi = num_seqs;  // invariant: answer in [lo, hi)
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid;
    }
    const int seq = lo;
    const int q_start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_start;
    const int seq_len = seq_lens[seq];
    const int pos = seq_len - q_len + (token - q_start);
    int key_hi = pos + 1;
    if (key_hi > seq_len) key_hi = seq_len;
    int key_lo = 0;
    if (window > 0 && pos - window + 1 > 0) key_lo = pos - window + 1;
    if (num_seqs <= 0 || token < q_start || token - q_start >= q_len || key_hi <= key_lo) {
        // A row no sequence owns, or an empty key range: zeros, never garbage.
        for (int d = tid; d < head_size; d += blockDim.x) out_row[d] = from_float<T>(0.0f);
        return;
    }

    const int kv_head = head / (num_heads / num_kv_heads);
    const T* q_row = query + ((i64)token * num_heads + head) * head_size;
    for (int d = tid; d < head_size; d += blockDim.x) q_s[d] = to_float(q_row[d]);
    const int* table = block_tables + (i64)seq * max_blocks;

    float m = NEG_INF_;  // running maximum of the scores
    float l = 0.0f;      // running sum of exp(score - m)
    float acc[ATT_DIMS];
#pragma unroll
    for (int j = 0; j < ATT_DIMS; ++j) acc[j] = 0.0f;
    __syncthreads();

    for (int tile = key_lo; tile < key_hi; tile += ATT_TILE) {
        const int n = min(ATT_TILE, key_hi - tile);
        float local_max = NEG_INF_;
        for (int i = tid; i < n; i += blockDim.x) {
            const int key = tile + i;
            const i64 block = table[key / block_size];
            const i64 row = ((block * num_kv_heads + kv_head) * block_size + key % block_size) *
                            head_size;
            row_s[i] = row;
            const T* k_row = key_cache + row;
            float dot = 0.0f;
            for (int d = 0; d < head_size; ++d) dot += q_s[d] * to_float(k_row[d]);
            float s = dot * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            p_s[i] = s;
            local_max = fmaxf(local_max, s);
        }
        const float tile_max = block_max(local_max, red);
        const float new_m = fmaxf(m, tile_max);
        const float alpha = m == NEG_INF_ ? 0.0f : expf(m - new_m);
        float local_sum = 0.0f;
        for (int i = tid; i < n; i += blockDim.x) {
            const float p = expf(p_s[i] - new_m);
            p_s[i] = p;
            local_sum += p;
        }
        const float tile_sum = block_sum(local_sum, red);  // also orders the p_s writes
        l = l * alpha + tile_sum;
        m = new_m;
#pragma unroll
        for (int j = 0; j < ATT_DIMS; ++j) {
            const int d = tid + j * ATT_THREADS;
            if (d < head_size) {
                float a = acc[j] * alpha;
                for (int i = 0; i < n; ++i) a += p_s[i] * to_float(value_cache[row_s[i] + d]);
                acc[j] = a;
            }
        }
        __syncthreads();  // p_s / row_s are rewritten by the next tile
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (sinks != nullptr && l > 0.0f) {
        // One more score s with a zero value: acc / (l + e^(s - m)), rescaled
        // to the sink's maximum when it is the larger.
        const float s = sinks[head];
        if (s > m) {
            const float a = expf(m - s);
            inv = a / (l * a + 1.0f);
        } else {
            inv = 1.0f / (l + expf(s - m));
        }
    }
#pragma unroll
    for (int j = 0; j < ATT_DIMS; ++j) {
        const int d = tid + j * ATT_THREADS;
        if (d < head_size) out_row[d] = from_float<T>(acc[j] * inv);
    }
}

#define DEFINE_ATTENTION(T, SUFFIX)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) paged_attention_##SUFFIX(         \
        T* out, const T* query, const T* key_cache, const T* value_cache,                       \
        const int* block_tables, const int* seq_lens, const int* query_start_loc, int num_seqs, \
        int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks,         \
        float scale, int window, float softcap, const float* sinks) {                           \
        paged_attention_impl<T>(out, query, key_cache, value_cache, block_tables, seq_lens,     \
                                query_start_loc, num_seqs, num_heads, num_kv_heads, head_size,  \
                                block_size, max_blocks, scale, window, softcap, sinks);         \
    }

DEFINE_ATTENTION(float, f32)
DEFINE_ATTENTION(f16, f16)
DEFINE_ATTENTION(bf16, bf16)
