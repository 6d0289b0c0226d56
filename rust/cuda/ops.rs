//! The launches of each kernel of `kernels/`: grid shapes and parameter
//! lists, from plain device pointers and sizes. Callers (the Python binding)
//! validate tensors; these functions check only what the kernels assume.

use super::launch::{grid_dim, Args, LaunchConfig, Runtime};
use crate::error::{CoreError, CoreResult};

/// Element type of float tensors the kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    BF16,
}

impl Elem {
    fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
        }
    }
}

/// Where to launch: the device ordinal, the stream, the NVRTC wheel folders.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub device: i32,
    pub stream: usize,
    pub wheel_dirs: &'a [String],
}

const Y_LIMIT: usize = 65_535;
const X_LIMIT: usize = i32::MAX as usize;

fn run(
    rt: &Runtime,
    t: Target<'_>,
    file: &str,
    name: &str,
    cfg: LaunchConfig,
    args: &Args,
) -> CoreResult<()> {
    let kernel = rt.kernel(t.device, file, name, t.wheel_dirs)?;
    rt.launch(kernel, cfg, t.stream, args)
}

/// `reshape_and_cache`: token rows of key/value into their cache slots.
#[derive(Clone, Copy, Debug)]
pub struct CacheWrite {
    pub elem: Elem,
    pub key: u64,
    pub value: u64,
    pub key_cache: u64,
    pub value_cache: u64,
    pub slot_mapping: u64,
    pub num_tokens: usize,
    pub key_stride: i64,
    pub value_stride: i64,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub block_size: usize,
    pub num_slots: usize,
}

/// Launches the cache write.
pub fn reshape_and_cache(rt: &Runtime, t: Target<'_>, a: &CacheWrite) -> CoreResult<()> {
    let args = Args::new()
        .ptr(a.key)
        .ptr(a.value)
        .ptr(a.key_cache)
        .ptr(a.value_cache)
        .ptr(a.slot_mapping)
        .i64(a.key_stride)
        .i64(a.value_stride)
        .i32(a.num_kv_heads as i32)
        .i32(a.head_size as i32)
        .i32(a.block_size as i32)
        .i64(a.num_slots as i64);
    let cfg = LaunchConfig {
        grid: (grid_dim(a.num_tokens, "num_tokens", X_LIMIT)?, 1, 1),
        block: (128, 1, 1),
        shared_bytes: 0,
    };
    let name = format!("reshape_and_cache_{}", a.elem.suffix());
    run(rt, t, "cache.cu", &name, cfg, &args)
}

/// Largest head size the attention kernel holds per block.
pub const MAX_HEAD_SIZE: usize = 512;

/// `paged_attention`: the CPU kernel's contract on the GPU.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    pub elem: Elem,
    pub out: u64,
    pub query: u64,
    pub key_cache: u64,
    pub value_cache: u64,
    pub block_tables: u64,
    pub seq_lens: u64,
    pub query_start_loc: u64,
    pub num_tokens: usize,
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    pub scale: f32,
    pub sliding_window: i64,
    /// Soft-cap of the scaled scores (0: none).
    pub softcap: f32,
    /// Device pointer to one f32 sink logit per query head (0: no sinks).
    pub sinks: u64,
}

/// Launches paged attention: one block of 128 threads per (token, head).
pub fn paged_attention(rt: &Runtime, t: Target<'_>, a: &Attention) -> CoreResult<()> {
    if a.head_size == 0 || a.head_size > MAX_HEAD_SIZE {
        return Err(CoreError::invalid(format!(
            "query: head_size must be in 1..={MAX_HEAD_SIZE} on CUDA, got {}",
            a.head_size
        )));
    }
    if a.num_kv_heads == 0 || !a.num_heads.is_multiple_of(a.num_kv_heads) {
        return Err(CoreError::invalid(format!(
            "query: num_heads ({}) must be a multiple of the caches' num_kv_heads ({})",
            a.num_heads, a.num_kv_heads
        )));
    }
    let window = i32::try_from(a.sliding_window.max(0)).unwrap_or(i32::MAX);
    let args = Args::new()
        .ptr(a.out)
        .ptr(a.query)
        .ptr(a.key_cache)
        .ptr(a.value_cache)
        .ptr(a.block_tables)
        .ptr(a.seq_lens)
        .ptr(a.query_start_loc)
        .i32(a.num_seqs as i32)
        .i32(a.num_heads as i32)
        .i32(a.num_kv_heads as i32)
        .i32(a.head_size as i32)
        .i32(a.block_size as i32)
        .i32(a.max_blocks as i32)
        .f32(a.scale)
        .i32(window)
        .f32(a.softcap)
        .ptr(a.sinks);
    let cfg = LaunchConfig {
        grid: (
            grid_dim(a.num_tokens, "num_tokens", X_LIMIT)?,
            grid_dim(a.num_heads, "num_heads", Y_LIMIT)?,
            1,
        ),
        block: (128, 1, 1),
        shared_bytes: 0,
    };
    let name = format!("paged_attention_{}", a.elem.suffix());
    run(rt, t, "attention.cu", &name, cfg, &args)
}

/// `rms_norm`: rows of x normalised and scaled into out.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub elem: Elem,
    pub out: u64,
    pub x: u64,
    pub weight: u64,
    pub rows: usize,
    pub x_stride: i64,
    pub dim: usize,
    pub eps: f32,
}

/// Launches RMSNorm: one block per row.
pub fn rms_norm(rt: &Runtime, t: Target<'_>, a: &RmsNorm) -> CoreResult<()> {
    let args = Args::new()
        .ptr(a.out)
        .ptr(a.x)
        .ptr(a.weight)
        .i64(a.x_stride)
        .i32(a.dim as i32)
        .f32(a.eps);
    let threads = if a.dim >= 1024 { 1024 } else { 256 };
    let cfg = LaunchConfig {
        grid: (grid_dim(a.rows, "rows", X_LIMIT)?, 1, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    };
    let name = format!("rms_norm_{}", a.elem.suffix());
    run(rt, t, "layers.cu", &name, cfg, &args)
}

/// `rotary`: neox-style rotation of x by gathered cos/sin into out.
#[derive(Clone, Copy, Debug)]
pub struct Rotary {
    pub elem: Elem,
    pub out: u64,
    pub x: u64,
    pub cos: u64,
    pub sin: u64,
    pub tokens: usize,
    pub x_stride: i64,
    pub cs_stride: i64,
    pub heads: usize,
    pub head_size: usize,
    pub half: usize,
}

/// Launches the rotary embedding: one block per token.
pub fn rotary(rt: &Runtime, t: Target<'_>, a: &Rotary) -> CoreResult<()> {
    if 2 * a.half > a.head_size {
        return Err(CoreError::invalid(format!(
            "cos: rotary half {} is more than half the head size {}",
            a.half, a.head_size
        )));
    }
    let args = Args::new()
        .ptr(a.out)
        .ptr(a.x)
        .ptr(a.cos)
        .ptr(a.sin)
        .i64(a.x_stride)
        .i64(a.cs_stride)
        .i32(a.heads as i32)
        .i32(a.head_size as i32)
        .i32(a.half as i32);
    let cfg = LaunchConfig {
        grid: (grid_dim(a.tokens, "tokens", X_LIMIT)?, 1, 1),
        block: (256, 1, 1),
        shared_bytes: 0,
    };
    let name = format!("rotary_{}", a.elem.suffix());
    run(rt, t, "layers.cu", &name, cfg, &args)
}

/// `silu_and_mul`: silu of the first half of each row times the second.
#[derive(Clone, Copy, Debug)]
pub struct SiluAndMul {
    pub elem: Elem,
    pub out: u64,
    pub x: u64,
    pub rows: usize,
    pub x_stride: i64,
    pub d: usize,
}

/// Launches SiLU-and-multiply: grid (rows, ceil(d / 256)).
pub fn silu_and_mul(rt: &Runtime, t: Target<'_>, a: &SiluAndMul) -> CoreResult<()> {
    let args = Args::new()
        .ptr(a.out)
        .ptr(a.x)
        .i64(a.x_stride)
        .i32(a.d as i32);
    let cfg = LaunchConfig {
        grid: (
            grid_dim(a.rows, "rows", X_LIMIT)?,
            grid_dim(a.d.div_ceil(256), "d / 256", Y_LIMIT)?,
            1,
        ),
        block: (256, 1, 1),
        shared_bytes: 0,
    };
    let name = format!("silu_and_mul_{}", a.elem.suffix());
    run(rt, t, "layers.cu", &name, cfg, &args)
}

/// `sample_rows`: the batched sampler, one block of 1024 threads per row.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub logits: u64,
    pub rows: usize,
    pub vocab: usize,
    pub fparams: u64,
    pub iparams: u64,
    pub prompt_tokens: u64,
    pub prompt_offsets: u64,
    pub output_tokens: u64,
    pub output_offsets: u64,
    pub w_workspace: u64,
    pub count_workspace: u64,
    pub out_token: u64,
    pub out_logprob: u64,
    pub out_rank: u64,
}

/// Launches the sampler.
pub fn sample(rt: &Runtime, t: Target<'_>, a: &Sample) -> CoreResult<()> {
    if a.vocab == 0 || a.vocab > i32::MAX as usize {
        return Err(CoreError::invalid(format!(
            "logits: vocabulary size must be in 1..2^31, got {}",
            a.vocab
        )));
    }
    let args = Args::new()
        .ptr(a.logits)
        .i32(a.vocab as i32)
        .ptr(a.fparams)
        .ptr(a.iparams)
        .ptr(a.prompt_tokens)
        .ptr(a.prompt_offsets)
        .ptr(a.output_tokens)
        .ptr(a.output_offsets)
        .ptr(a.w_workspace)
        .ptr(a.count_workspace)
        .ptr(a.out_token)
        .ptr(a.out_logprob)
        .ptr(a.out_rank);
    let cfg = LaunchConfig {
        grid: (grid_dim(a.rows, "rows", X_LIMIT)?, 1, 1),
        block: (1024, 1, 1),
        shared_bytes: 0,
    };
    run(rt, t, "sampler.cu", "sample_rows", cfg, &args)
}
