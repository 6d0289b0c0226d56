"""Type stubs for the compiled Rust core, ``fastllm._core``."""

from collections.abc import Sequence

import torch
from torch import Tensor

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""

# ---- probe and platform ----

def get_device_count() -> int:
    """Number of usable CUDA devices, 0 without a GPU; runs the isolated, cached probe."""

def cpu_features() -> dict[str, bool]:
    """CPU features detected at run time: avx2, fma, avx512f, avx512bf16, amx_tile, amx_bf16, amx_permitted, amx."""

def _probe() -> dict[str, object]:
    """The probe report as a dict (available, device_count, devices, driver_version, library, reason)."""

def _probe_child() -> None:
    """Entry point of the probe child process: probes, prints the protocol on stdout, exits the process."""

def _init_driver() -> int:
    """Initialises the driver in this process once the isolated probe succeeded; returns its device count."""

# ---- kv: block pool ----

class BlockPool:
    """Paged KV-cache block pool with reference counts and a prefix cache.

    Full blocks registered with ``register_full_block`` are keyed by a hash
    chaining their parent's hash and their token ids; lookups verify the stored
    tokens. Unreferenced cached blocks stay reusable until an allocation needs
    them, evicted least recently used first. Misuse raises ``ValueError``;
    running out of blocks raises ``MemoryError``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        """A pool of ``num_blocks`` free blocks of ``block_size`` tokens."""
    @property
    def num_blocks(self) -> int:
        """Number of blocks in the pool."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones plus evictable cached ones."""
    def allocate(self) -> int:
        """A block with reference count 1 and no cached content; evicts the LRU cached block if needed."""
    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks at once, all or nothing (``MemoryError`` leaves the pool unchanged)."""
    def incref(self, block_id: int) -> None:
        """Adds a reference (sharing, or a prefix-cache hit on an evictable block)."""
    def free(self, block_id: int) -> None:
        """Drops one reference; at zero a cached block becomes evictable, any other free."""
    def ref_count(self, block_id: int) -> int:
        """The block's reference count."""
    def match_prefix(self, token_ids: Sequence[int], group: int = 0) -> list[int]:
        """Ids of the longest run of cached full blocks matching the start of
        ``token_ids`` in layer group ``group``'s chain."""
    def register_full_block(
        self,
        block_id: int,
        parent_block_id: int | None,
        token_ids: Sequence[int],
        group: int = 0,
    ) -> None:
        """Registers a referenced full block holding ``token_ids`` after
        ``parent_block_id`` (None: the first block of layer group ``group``'s chain)."""
    def copy_on_write(self, block_id: int) -> int:
        """A private copy target for a shared block (new id, old one decref'd), else the block itself."""
    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache currently points at this block."""
    def stats(self) -> dict[str, int]:
        """free_blocks, cached_blocks, hits, queries, evictions."""
    def reset_prefix_cache(self) -> bool:
        """Drops every cache entry unless a cached block is referenced; returns whether it did."""

# ---- attention ----

def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new K/V rows into their cache slots (a negative slot skips the token).

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype
    (float32 or bfloat16); caches: ``[num_blocks, num_kv_heads, block_size, head_size]``,
    or an 8-bit cache (``kv_cache_dtype="int8"``): int8 ``[..., head_size + 4]``, each
    row quantized as it is stored (``attention_torch.quantize_rows``), and then
    ``key``/``value`` may be float32 or bfloat16;
    ``slot_mapping``: int64 ``[num_tokens]``, ``slot = block_id * block_size + offset``.
    Raises ValueError on a wrong dtype, shape, device or layout, or a slot out of range.
    """

def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of packed new tokens over the paged KV cache, written into ``out``.

    ``query``/``out``: ``[num_tokens, num_heads, head_size]`` in the caches' dtype
    (any of float32 / bfloat16 over an int8 cache, whose rows are widened with
    their scales);
    ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; ``seq_lens``: int32
    ``[num_seqs]`` (context length including the new tokens); ``query_start_loc``:
    int32 ``[num_seqs + 1]``. Sequence ``i``'s new tokens are the last of its
    ``seq_lens[i]`` tokens and attend causally; ``sliding_window > 0`` limits a
    query at position ``p`` to keys in ``(p - sliding_window, p]``; ``softcap > 0``
    replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``.
    ``sinks`` (float32 ``[num_heads]``, gpt-oss's attention sinks): head ``h``'s
    ``sinks[h]`` joins the softmax denominator as one more score with no value
    row (``-inf``: none for that head); NaN or ``+inf`` is a ``ValueError``.
    """

def encoder_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    scale: float,
    band: int = 0,
) -> None:
    """Bidirectional attention of an encoder's packed inputs, written into ``out``.

    ``query``/``out``: ``[num_tokens, num_heads, head_size]``; ``key``/``value``:
    ``[num_tokens, num_kv_heads, head_size]``; all float32 or all bfloat16, and
    the inputs' rows may be any stride apart (views of a fused projection).
    ``lengths``: the packed inputs' token counts in order; each token sees every
    token of its own input, or with ``band > 0`` those at most ``band`` positions
    away. ``scale`` multiplies the scores.
    """

def layer_norm(
    out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> None:
    """``out [rows, dim] = LayerNorm(x + residual) * weight + bias`` over the last
    dimension, normalised in float32 and rounded once (the sum ``x + residual``
    rounded to the dtype first, as torch adds); ``residual`` and ``bias`` optional;
    one dtype (float32 or bfloat16), contiguous, on the thread team."""

def gelu(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = gelu(x)`` elementwise, the exact (erf) GELU; one dtype (float32 or
    bfloat16), any shape, contiguous, on the thread team."""

# ---- sampling ----

class SamplingBatch:
    """One step's sampling parameters, one row per logits row, built once and read
    by ``sample`` (and by the CUDA sampler, field by field).

    Per-row lists have one value per row (``temperature`` sets the count);
    ``prompt_tokens`` / ``output_tokens`` are flat int32 CPU tensors indexed by
    ``rows + 1`` offsets (empty histories when omitted). ``sampled_logprob``
    (default all True): whether ``sample`` computes a row's sampled token's raw
    logprob and rank; a row without them and without ``num_logprobs`` gets NaN
    and 0 (two passes over its logits saved). Errors name the field.
    """

    def __init__(
        self,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        repetition_penalty: Sequence[float],
        frequency_penalty: Sequence[float],
        presence_penalty: Sequence[float],
        seed: Sequence[int] | None = None,
        position: Sequence[int] | None = None,
        prompt_tokens: Tensor | None = None,
        prompt_offsets: Sequence[int] | None = None,
        output_tokens: Tensor | None = None,
        output_offsets: Sequence[int] | None = None,
        num_logprobs: Sequence[int] | None = None,
        sampled_logprob: Sequence[bool] | None = None,
    ) -> None: ...
    @property
    def rows(self) -> int:
        """Rows in the batch."""
    @property
    def temperature(self) -> list[float]: ...
    @property
    def top_k(self) -> list[int]: ...
    @property
    def top_p(self) -> list[float]: ...
    @property
    def min_p(self) -> list[float]: ...
    @property
    def repetition_penalty(self) -> list[float]: ...
    @property
    def frequency_penalty(self) -> list[float]: ...
    @property
    def presence_penalty(self) -> list[float]: ...
    @property
    def seed(self) -> list[int]: ...
    @property
    def position(self) -> list[int]: ...
    @property
    def num_logprobs(self) -> list[int]: ...
    @property
    def sampled_logprob(self) -> list[bool]: ...
    @property
    def prompt_tokens(self) -> list[int]: ...
    @property
    def prompt_offsets(self) -> list[int]: ...
    @property
    def output_tokens(self) -> list[int]: ...
    @property
    def output_offsets(self) -> list[int]: ...

def sample(
    logits: Tensor, batch: SamplingBatch
) -> tuple[list[int], list[float], list[int], list[list[tuple[int, float]]]]:
    """Samples one token per row; returns (tokens, their raw logprobs, their ranks, top-N (id, logprob) per row).

    ``logits`` is float32 ``[B, V]``, CPU, contiguous, read only; ``batch`` has B rows.
    Order (vLLM's): logprobs of the raw logits, penalties, greedy if temperature < 1e-5,
    temperature, min_p, top-k, top-p, then an exponential race whose randomness is a
    function of (seed, position, token) only.
    """

def sampling_support(logits: Tensor, batch: SamplingBatch) -> list[list[int]]:
    """The ascending token ids each row may draw after penalties and filters (debugging aid)."""

def token_logprobs(
    logits: Tensor, tokens: Sequence[int], top: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Prompt logprobs: row r of float32 logits ``[T, V]`` (CPU, contiguous) predicts
    ``tokens[r]``; per row (its raw logprob, its rank, the ``top`` largest raw
    (id, logprob), ties by lower id), computed as ``sample`` reports a sampled token's.
    Rows run in parallel. A token outside the vocabulary or a row count other than
    ``len(tokens)`` is a ``ValueError``."""

def sampling_uniform(seed: int, position: int, token: int) -> float:
    """The sampler's counter-based uniform draw in (0, 1) for (seed, position, token)."""

# ---- structured outputs ----

def validate_structured(
    kind: str, value: str | Sequence[str] | None = None, whitespace_flexible: bool = True
) -> None:
    """Checks that a constraint compiles, without a tokenizer. ``kind``: json (a
    schema's JSON text), json_object, regex, choice (a list of strings) or
    grammar (Lark). A ValueError names the field, and for a schema the path of
    an unsupported keyword."""

class GrammarVocabulary:
    """One tokenizer's token trie and grammar compiler, built once per process per
    (tokenizer.json, EOS ids, model vocabulary), with its cache of compiled grammars."""

    def __init__(
        self, tokenizer_json: bytes, eos_token_ids: Sequence[int], vocab_size: int
    ) -> None: ...
    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's logits per row)."""
    @property
    def cached_grammars(self) -> int:
        """How many compiled grammars are cached."""
    def token_bytes(self, token: int) -> bytes:
        """The byte string of a token (special tokens start with 0xFF)."""
    def start(
        self, kind: str, value: str | Sequence[str] | None = None, whitespace_flexible: bool = True
    ) -> GrammarMatcher:
        """A fresh grammar state for a constraint (compiled on first use, then cached)."""

class GrammarMatcher:
    """One sequence's position in its grammar."""

    def consume(self, token: int) -> None:
        """Advances by one token; a ValueError if the grammar does not allow it."""
    def rollback(self, n: int) -> None:
        """Steps back over the last ``n`` consumed tokens."""
    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position."""
    def allowed_tokens(self) -> list[int]:
        """The token ids allowed next, ascending (EOS exactly when the grammar accepts)."""
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match."""
    @property
    def is_finished(self) -> bool:
        """Whether nothing but EOS may follow (complete, or failed)."""
    @property
    def num_consumed(self) -> int:
        """Tokens consumed so far."""
    @property
    def error(self) -> str | None:
        """The grammar engine's error, if it met one."""

def apply_grammar_masks(
    logits: Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]
) -> None:
    """Writes -inf, in place, into the logits of row ``rows[i]`` (float32 CPU
    ``[R, V]``) that ``matchers[i]`` does not allow; masks computed in parallel."""

def grammar_bitmask(matchers: Sequence[GrammarMatcher], vocab: int) -> bytes:
    """The allowed tokens of each matcher as ``len(matchers)`` rows of
    ``ceil(vocab / 32)`` little-endian int32 words (token i at bit i % 32 of
    word i // 32): the mask handed to the CUDA sampler."""

# ---- cuda kernels ----
# NVRTC and the CUDA kernels of ``kernels/``. ``nvrtc_*`` never touch the
# driver; ``cuda_*`` initialise it (after the isolated probe succeeded) and
# launch on the given stream handle (``torch.cuda.current_stream().cuda_stream``).
# Tensors must be CUDA tensors on one device; errors name the argument.

def nvrtc_version(nvrtc_path: str | None = None) -> tuple[int, int]:
    """NVRTC's (major, minor); searches FASTLLM_NVRTC, the CUDA toolkit, the loader, the NVRTC wheel."""

def nvrtc_library(nvrtc_path: str | None = None) -> str:
    """The path of the libnvrtc the search finds (RuntimeError naming the package if none)."""

def nvrtc_compile(
    source: str, name: str, arch: str, cubin: bool = False, nvrtc_path: str | None = None
) -> bytes:
    """Compiles CUDA C++ to PTX (compute_XY) or a CUBIN (sm_XY) through the disk cache; errors carry NVRTC's log."""

def kernel_sources() -> dict[str, str]:
    """The embedded sources of ``kernels/*.cu`` by file name (``common.cuh`` is included for them)."""

def cuda_load_kernels(device: int = 0) -> list[str]:
    """Compiles (CUBIN for the device's architecture, cached) and loads every kernel file on ``device``."""

def cuda_reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    stream: int,
) -> None:
    """Stores key/value [T, kv_heads, head] (rows may be strided) into int64 ``slot_mapping`` slots; slots < 0 or past the cache are skipped."""

def cuda_paged_attention(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    stream: int,
    sinks: Tensor | None = None,
) -> None:
    """Paged attention with the contract of ``paged_attention`` (f32/f16/bf16, head_size <= 512, ``sinks`` float32 ``[num_heads]`` on the same device), into ``out``."""

def cuda_rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float, stream: int) -> None:
    """``out = weight * T(x * rsqrt(mean(x^2) + eps))`` for x [rows, dim] (rows may be strided)."""

def cuda_rotary(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, stream: int) -> None:
    """Neox rotary of x [T, heads, head] by cos/sin [T, half] (x's dtype) into contiguous ``out``; dims past 2*half copied."""

def cuda_silu_and_mul(out: Tensor, x: Tensor, stream: int) -> None:
    """``out = T(silu(x[:, :d])) * x[:, d:]`` for x [rows, 2d] into ``out`` [rows, d]."""

def cuda_sample(
    logits: Tensor,
    fparams: Tensor,
    iparams: Tensor,
    prompt_tokens: Tensor,
    prompt_offsets: Tensor,
    output_tokens: Tensor,
    output_offsets: Tensor,
    w_workspace: Tensor,
    count_workspace: Tensor,
    out_token: Tensor,
    out_logprob: Tensor,
    out_rank: Tensor,
    stream: int,
) -> None:
    """The CPU sampler's semantics and random draw on the GPU, one block per row of float32 ``logits`` [B, V].

    ``fparams`` float32 [B, 6]: temperature, top_p, min_p, repetition, frequency,
    presence; ``iparams`` int64 [B, 3]: top_k, seed (u64 bits), position; token
    histories int32 with int64 [B + 1] offsets; workspaces [B, V] float32 / int32
    (or [0, V] when no row needs one: ``w`` for rows that are not plain greedy,
    ``count`` for rows with penalties and a history);
    outputs int32 / float32 / int32 [B]: token, its raw logprob, its rank.
    """

# ---- platform: memory bandwidth ----

def stream_triad_gbs(bytes: int = 200_000_000, repeats: int = 5) -> float:
    """STREAM-triad bandwidth in GB/s (best pass) over f32 arrays of ``bytes`` each, on the Rust pool."""

# ---- packed linear (GEMM) ----

class PackedLinear:
    """A linear layer's weight (and bias) packed once for the CPU GEMM kernel.

    ``weight`` [out_features, in_features] and ``bias`` [out_features]: bf16 or
    f32, contiguous, on the CPU; bf16 weights stay bf16, and so do f32 weights
    whose every element is a bf16 value (``weight_dtype`` says which: the same
    values in half the bytes, multiplied in f32 as before). ``path`` names a
    kernel (one of ``gemm_paths()``; avx512bf16 runs the avx512 kernel, except
    bf16 weights against bf16 inputs, which use ``vdpbf16ps``);
    default: ``gemm_default_path()``. Packing releases the GIL.
    """

    in_features: int
    out_features: int
    nbytes: int
    weight_dtype: str
    path: str

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str | None = None
    ) -> None: ...
    def forward(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Writes ``x @ weight.T + bias`` into ``out`` [M, out_features] (bf16 or
        f32, any mix with x's dtype); x [M, in_features]. Releases the GIL."""

def gemm_paths() -> list[str]:
    """Names of the GEMM kernel paths this CPU runs (subset of scalar, avx2, avx512, avx512bf16)."""

def gemm_default_path() -> str:
    """The kernel ``PackedLinear`` runs when none is named: the fastest this CPU has."""

def simd_path() -> str:
    """The SIMD path the kernels other than the GEMMs (attention, sampling,
    norms, activations) run on: the fastest this CPU runs, or the one
    ``FASTLLM_CPU_SIMD_PATH`` named when they first ran (read once per
    process); a ``ValueError`` naming the switch when its value now names no
    path this CPU runs."""

# ---- quantized linear (integer GEMM) ----

class QuantizedLinear:
    """A linear layer's weight quantized for the CPU's integer kernels.

    ``format``: "q8_0", "q4_0", "iq4_nl", "q4_1" or "mxfp4" (GGUF's blocks: 32 inputs
    per f16 scale, and an f16 minimum for "q4_1"). ``weight`` [out_features, in_features] bf16 or f32 on the CPU is
    quantized (round to nearest; rows padded to whole groups); ``bias`` stays
    f32. ``path`` names an integer kernel path (one of ``quant_paths()``);
    default: ``quant_default_path()``. Releases the GIL.
    """

    in_features: int
    out_features: int
    nbytes: int
    format: str
    path: str

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        format: str = "q8_0",
        path: str | None = None,
    ) -> None: ...
    @staticmethod
    def from_blocks(
        blocks: torch.Tensor | list[torch.Tensor],
        out_features: int,
        in_features: int,
        format: str,
        bias: torch.Tensor | None = None,
        path: str | None = None,
    ) -> QuantizedLinear:
        """Adopts GGUF blocks bit for bit: ``blocks`` uint8, out_features rows of
        in_features / 32 blocks, or a list of such tensors of whole rows (the
        parts of a fused matrix, in order)."""
    @staticmethod
    def from_panels(
        panels: torch.Tensor,
        out_features: int,
        in_features: int,
        format: str,
        bias: torch.Tensor | None = None,
        path: str | None = None,
    ) -> QuantizedLinear:
        """Adopts panels packed earlier (what ``write_panel_file`` wrote for a layer of
        the same format and shape): a 64-byte aligned uint8 tensor, read where
        it lies (e.g. a view of a mapped file); the layer keeps it, and its
        memory must not change."""
    def forward(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Writes ``x @ weight.T + bias`` into ``out`` [M, out_features] (bf16 or f32);
        x [M, in_features] is quantized to int8 per group of 32. Releases the GIL."""
    def embed(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """Writes rows ``ids`` (int64 [T]) of the weight, dequantized, into ``out``
        [T, in_features]: an embedding table tied to this weight."""
    def to_blocks(self) -> bytes:
        """The weights as GGUF blocks (rows padded to whole groups)."""

class DecoderStack:
    """Every decoder layer of a Llama-family (or Gemma, LFM2, Qwen3.5) model, run in one call
    per step.

    ``layers``: one dict per layer with ``input_norm``, ``post_norm``
    ([hidden], or None: no norm), ``q_norm``, ``k_norm`` ([head_dim], or the whole
    projection's width, or None; both or neither),
    ``qkv``, ``o``, ``gate_up``, ``down`` (``PackedLinear`` or
    ``QuantizedLinear``, biases inside; shared, not copied), or instead of
    ``gate_up`` / ``down`` a ``moe`` (a ``MoeBlock``), ``key_cache``,
    ``value_cache`` ([blocks, kv_heads, block_size, head_dim]) and
    ``sliding_window`` (0: none); optionally ``logit_softcap`` (0: none),
    ``kv_group`` (its slots and block tables: the step's ``group_*`` entry;
    layers of different groups may share a cache tensor), ``local_rotary``
    (turned by the step's local tables), ``rotary`` (default True; False: no rotation,
    SmolLM3's NoPE layers), ``mixer_out_norm`` / ``mlp_out_norm``
    (Gemma's norms of the attention and MLP outputs before the residual add),
    ``sinks`` (float32 [num_heads]: gpt-oss's sink logits, or None)
    and ``mlp_act`` ("silu" or "gelu_tanh"). Norms and caches share one dtype (bf16 or
    f32); the stack keeps every tensor alive and checks them all here. A
    short-convolution layer (LFM2) gives instead of the attention keys
    ``conv_in_proj`` [3H, H], ``conv_weight`` [H, taps], ``conv_bias`` ([H]
    or None), ``conv_out_proj`` [H, H] and ``conv_state`` [slots, H, taps - 1]
    (the model's dtype). A Gated DeltaNet layer (Qwen3.5) gives ``delta_in_proj``
    [C + Hv Dv + 2 Hv, H] (q, k, v, z, b, a; C = 2 Hk Dk + Hv Dv),
    ``delta_conv_weight`` [C, taps], ``delta_conv_state`` [slots, C, taps - 1] (the
    model's dtype), ``delta_a_log`` and ``delta_dt_bias`` ([Hv] float32), ``delta_norm``
    [Dv], ``delta_out_proj`` [H, Hv Dv] and ``delta_state`` [slots, Hv, Dk, Dv]
    (float32). ``attn_output_gate`` (default False): ``qkv`` yields each query head
    followed by its output gate (Qwen3.5). In a bf16 model a norm weight may be float32:
    that norm runs in float32 and rounds once. At least one layer attends. ``dtype``: the
    model's (torch.bfloat16 or torch.float32; default the first input norm's).
    """

    num_layers: int

    def __init__(
        self,
        layers: list[dict[str, object]],
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        intermediate_size: int,
        eps: float,
        scale: float,
        residual_multiplier: float = 1.0,
        dtype: torch.dtype | None = None,
    ) -> None: ...
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        state_slots: torch.Tensor | None = None,
        cos_local: torch.Tensor | None = None,
        sin_local: torch.Tensor | None = None,
        group_slot_mappings: list[torch.Tensor] | None = None,
        group_block_tables: list[torch.Tensor] | None = None,
    ) -> None:
        """Runs every layer on ``x`` [tokens, hidden] in place: RMSNorm,
        q/k/v (+ per-head q/k norm), rotary (``cos`` / ``sin`` [tokens,
        rotary_dim / 2]), the cache write at ``slot_mapping`` (int64), paged
        attention (int32 ``block_tables`` / ``seq_lens`` / ``query_start_loc``),
        output projection and residual (or a short convolution or Gated
        DeltaNet over the state slot of each sequence, ``state_slots`` int64
        [seqs], required with recurrent layers), RMSNorm, SiLU-gated MLP and residual; the
        same kernels and roundings as the layer-by-layer ops. ``cos_local`` / ``sin_local``:
        the tables of the ``local_rotary`` layers (default ``cos`` / ``sin``);
        ``group_slot_mappings`` / ``group_block_tables``: per KV group (entry 0 unread: the
        step's own), the slots and tables of the layers of that ``kv_group``. Releases the
        GIL."""

def quant_paths() -> list[str]:
    """Names of the integer kernel paths this CPU runs (subset of scalar, avx2, avxvnni,
    avx512, avx512vnni)."""

def quant_default_path() -> str:
    """The path ``QuantizedLinear`` runs when none is named: the fastest this CPU has, or
    the one ``FASTLLM_CPU_INT_PATH`` named when it first ran (read once per process); a
    ``ValueError`` naming the switch when its value now names no path this CPU runs."""

def quant_formats() -> list[str]:
    """Names of the quantized formats."""

def write_panel_file(fd: int, head: bytes, tables: list[tuple[QuantizedLinear, int]]) -> None:
    """Writes a packed-weight file to the open file descriptor ``fd``: ``head`` at
    offset 0, then each layer's ``nbytes`` bytes of panels at its offset
    (increasing, not overlapping; a ValueError otherwise), zeros between them,
    in whole chunks of 2 MiB at multiples of 2 MiB (so that the page cache
    keeps the file in huge folios). Releases the GIL."""

def dequantize_gguf(blocks: torch.Tensor, block_type: str, out: torch.Tensor) -> None:
    """Dequantizes GGUF blocks of ``block_type`` (``gguf_block_types()``) from
    ``blocks`` (uint8) into ``out`` (float32, exactly the blocks' values)."""

def gguf_to_q8_0(blocks: torch.Tensor, block_type: str, out: torch.Tensor) -> None:
    """Converts GGUF blocks of ``block_type`` (``gguf_block_types()``) to q8_0
    blocks in ``out`` (uint8, 34 bytes per 32 weights), in parallel: exactly
    for Q8_0, Q4_0, Q5_0 and IQ4_NL, otherwise each block dequantized and
    quantized again."""

def gguf_q4_k_to_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Rewrites GGUF Q4_K super-blocks (``blocks``, uint8) as q4_1 blocks in
    ``out`` (uint8, 8 x 20 bytes per super-block): the same codes, each
    sub-block's scale and minimum rounded to f16."""

def mxfp4_from_pairs(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """GGUF MXFP4 blocks (into ``out``, uint8, 17 bytes a block) from ``codes``
    (uint8, 16 bytes a block: codes 2i and 2i + 1 in byte i's low and high
    nibble, as gpt-oss's checkpoints pair them) and ``scales`` (uint8, one E8M0
    exponent a block). Releases the GIL."""

def gguf_block_types() -> list[str]:
    """GGUF block types ``dequantize_gguf`` reads."""

def gguf_strings(data: torch.Tensor, offset: int, count: int) -> tuple[list[str], int]:
    """The ``count`` length-prefixed strings of a GGUF string array at byte
    ``offset`` of ``data`` (uint8): (strings, the offset after them)."""

# ---- layers ----

def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``out = weight * round(x / rms(x))`` over rows: x, out [rows, dim], weight [dim], one dtype
    (bf16 or f32), rounding as the model's torch code. Releases the GIL."""

def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = round(silu(x[:, :d])) * x[:, d:]``: x [rows, 2d], out [rows, d], one dtype
    (bf16 or f32). Releases the GIL."""

def sigmoid_mul(out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> None:
    """``out = x * round(sigmoid(gate))`` elementwise, rounded as torch's
    ``x * torch.sigmoid(gate)``: one dtype (bf16 or f32), one shape. Releases the GIL."""

def gated_rms_norm(
    out: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Qwen3.5's gated head norm: ``out = round(rms_norm(x, weight) * silu(z))``, the norm
    rounded as ``rms_norm``'s, the gate and product in float32; x, z, out [rows, dim],
    weight [dim], one dtype (bf16 or f32). Releases the GIL."""

def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = round(gelu_tanh(x[:, :d])) * x[:, d:]`` (GeGLU, the GELU's tanh
    approximation): x [rows, 2d], out [rows, d], one dtype (bf16 or f32). Releases the GIL."""

def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = round(gelu(x[:, :d])) * x[:, d:]`` (GeGLU with the exact, erf
    GELU): x [rows, 2d], out [rows, d], one dtype (bf16 or f32). Releases the GIL."""

def qkv_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Splits ``qkv`` [T, (h + 2 kv) * d] into ``q`` [T, h, d], ``k`` [T, kv, d] and ``v``
    [T, kv * d], rotating q and k (NeoX halves over the first ``2 * half`` features) with
    ``cos`` / ``sin`` [T, half]; one dtype (bf16 or f32), bit-exact with the torch code.
    Releases the GIL."""

# ---- mixture of experts ----

def moe_route(
    ids: torch.Tensor,
    weights: torch.Tensor,
    logits: torch.Tensor,
    scoring: str = "softmax",
    renormalize: bool = True,
    selection_bias: list[float] | None = None,
    renorm_eps: float = 0.0,
    scale: float = 1.0,
) -> None:
    """Routes tokens: ``logits`` (float32 [T, E]) become scores (``scoring``:
    "softmax", in f32 with the max subtracted, or "sigmoid"); each token's
    ``k = ids.shape[1]`` highest (ties: the lower expert first), chosen on
    ``score + selection_bias[e]`` where a bias is given, go to ``ids``
    (int32 [T, k]) and their (unbiased) scores to ``weights`` (float32
    [T, k]), in descending order of the choice, divided by ``sum +
    renorm_eps`` when ``renormalize``, then multiplied by ``scale``.
    Releases the GIL."""

class MoeBlock:
    """A whole mixture-of-experts block in one call: the router (``router``, a
    float ``PackedLinear`` [experts, H] with float32 logits), each token's
    ``top_k`` best experts by ``scoring`` ("softmax" or "sigmoid"),
    renormalised when ``renormalize`` (``selection_bias``, ``renorm_eps``
    and ``scale`` as ``moe_route``'s), the ``experts`` (a ``MoeExperts``) and,
    given all three, a shared expert added as ``sigmoid(x shared_gate) *
    shared(x)`` (``shared_gate_up`` [2I, H], ``shared_down`` [H, I],
    ``shared_gate`` [1, H], the experts' activation). The fused
    ``DecoderStack`` takes it as a layer's ``moe``."""

    top_k: int
    num_experts: int

    def __init__(
        self,
        router: PackedLinear,
        experts: MoeExperts,
        top_k: int,
        scoring: str = "softmax",
        renormalize: bool = True,
        shared_gate_up: PackedLinear | QuantizedLinear | None = None,
        shared_down: PackedLinear | QuantizedLinear | None = None,
        shared_gate: PackedLinear | None = None,
        selection_bias: list[float] | None = None,
        renorm_eps: float = 0.0,
        scale: float = 1.0,
    ) -> None: ...
    def forward(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Writes the block of ``x`` [T, H] into ``out`` [T, H] (bf16 or f32,
        one dtype). Releases the GIL."""

class MoeExperts:
    """The experts of a mixture-of-experts layer, run on grouped tokens.

    ``gate_up``: per expert a ``PackedLinear`` or ``QuantizedLinear`` [2I, H]
    (gate rows, then up rows); ``down``: per expert one [H, I] (biases
    inside; shared, not copied). ``activation``: "silu" (``silu(gate) * up``),
    "gelu_tanh" (``gelu_tanh(gate) * up``) or "swiglu_oai" (gpt-oss:
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``), rounded as torch in the model's dtype.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    nbytes: int
    path: str

    def __init__(
        self,
        gate_up: Sequence[PackedLinear | QuantizedLinear],
        down: Sequence[PackedLinear | QuantizedLinear],
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None: ...
    def forward(
        self, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """Writes ``sum_j weights[t, j] * expert[ids[t, j]](x[t])`` into ``out``
        [T, H]: ``x`` and ``out`` bf16 or f32 (one dtype), ``ids`` int32 [T, k]
        (every id in 0..num_experts), ``weights`` float32 [T, k]. Only the experts
        that receive a token are read; sums in f32, rounded once. Releases the GIL."""

# ---- recurrent token mixers (hybrid models) ----

def causal_conv1d(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    silu: bool,
) -> None:
    """Depthwise causal convolution of packed sequences (LFM2, Qwen3.5): ``x``, ``out``
    [T, C], ``weight`` [C, K] (K 2..8), ``bias`` [C] or None, ``conv_state`` [S, C, K - 1]
    (the last K - 1 inputs before the call, oldest first), one dtype (bf16 or f32).
    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` (int32
    [num_seqs + 1], from 0 to T) and state ``conv_state[state_slots[i]]`` (int64
    [num_seqs]). ``out[t, c] = bias[c] + sum_j weight[c, j] * xin[t - K + 1 + j, c]``
    over the state followed by the rows, in f32, then ``y * sigmoid(y)`` if ``silu``,
    rounded once; the state becomes the last K - 1 inputs. Releases the GIL."""

def delta_gates(
    g: torch.Tensor,
    beta: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> None:
    """Gated DeltaNet's gates: ``beta = sigmoid(b)`` rounded to b's dtype and
    ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (``g``, ``beta`` [T, H]
    float32); ``a``, ``b`` [T, H] (one dtype, bf16 or f32), ``a_log`` (the model's
    ``A_log``), ``dt_bias`` [H] float32. Releases the GIL."""

def mamba_gates(
    g: torch.Tensor,
    beta: torch.Tensor,
    dt: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lo: float,
    hi: float,
) -> None:
    """Mamba-2's time steps (Granite 4.0): ``beta = clamp(softplus(dt + dt_bias), lo,
    hi)`` and ``g = -exp(A_log) * beta`` (``g``, ``beta`` [T, H] float32) from ``dt``
    [T, H] (bf16 or f32) and ``a_log``, ``dt_bias`` [H] float32: the write strength and
    log decay of ``gated_delta_rule(..., linear=True)``. Releases the GIL."""

def mamba_norm(
    out: torch.Tensor,
    y: torch.Tensor,
    x: torch.Tensor,
    z: torch.Tensor,
    d: torch.Tensor,
    weight: torch.Tensor,
    groups: int,
    eps: float,
) -> None:
    """Mamba-2's gated group norm: ``out = weight * rms_norm_g((y + D x) * silu(z))``
    with ``y`` (the scan), ``x`` (its input), ``z`` (the gate), ``out`` [T, H * P] of one
    dtype (bf16 or f32), ``D`` [H] float32 per head, ``weight`` [H * P]; in float32,
    the RMS over each of ``groups`` slices of a row, rounded once. Releases the GIL."""

def gated_delta_rule(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float,
    l2norm: bool,
    linear: bool = False,
) -> None:
    """Gated DeltaNet (Qwen3.5) over packed sequences, in f32: ``q``, ``k`` [T, Hk, Dk],
    ``v`` [T, Hv, Dv] (one dtype, bf16 or f32; value head h reads q/k head
    ``h // (Hv // Hk)``), ``g`` (log decay, <= 0) and ``beta`` [T, Hv] float32, ``state``
    [S, Hv, Dk, Dv] float32, ``out`` [T, Hv, Dv] in v's dtype. Sequences as in
    ``causal_conv1d``. q and k L2-normalised if ``l2norm``, q times ``scale``; per row
    ``S = exp(g) S; delta = beta (v - S^T k); S += k delta^T; out = S^T q``, and
    ``state[state_slots[i]]`` becomes S after the sequence's last row. Sequences of 3
    rows or more run 16-row chunks (UT transform), shorter ones row by row. With
    ``linear``, Mamba-2's rule (SSD) in place of the delta step: ``S = exp(g) S +
    beta k v^T`` (k = B, v = x, beta = dt, g = dt A, q = C). Releases the GIL."""
