"""fastllm's models against transformers, and the loader's handling of bad checkpoints.

Each architecture is a tiny random model built with transformers (the reference,
test-only), saved with ``save_pretrained`` and loaded with fastllm's loader. Its
logits, computed step by step over a paged KV cache, are compared with
transformers' full forward pass over each whole sequence.

Tolerances:
* float32: |ours - ref| <= 1e-4 * max(1, max|ref|) + 1e-4 * |ref| per logit
  (the two implementations sum in different orders; observed error ~1e-6).
* bfloat16 (ours in bf16, transformers in float32): max |ours - ref| <= 3% of
  max|ref|; the arg-max agrees on at least 80% of positions, and where it does
  not, our top token's reference logit is within 3% of max|ref| of the best one
  (a near tie). bf16 keeps 8 mantissa bits; transformers itself in bf16 is off
  by ~1.5% of max|ref| on these models, as are we. Where transformers' own
  bf16 error is larger (Gemma's soft-capped logits span a narrow range), the
  bound is 1.5x that error.
"""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from fastllm.config import ModelConfig  # noqa: E402
from fastllm.layers.linear import pack_linears, should_pack  # noqa: E402
from fastllm.models import ARCHITECTURES, get_model_class  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 512
# head_dim 64: a size every attention backend supports.
LLAMA_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32 * 2,
    max_position_embeddings=256,
)


def _configs() -> dict[str, object]:
    t = transformers
    c = dict(LLAMA_COMMON)
    c["hidden_size"] = 128
    granite4 = dict(
        c,
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        num_local_experts=0,
        shared_intermediate_size=c["intermediate_size"],
        layer_types=["attention"] * c["num_hidden_layers"],
        mamba_n_heads=2,
        mamba_d_head="auto",
        pad_token_id=0,
    )
    return {
        "llama": t.LlamaConfig(**c),
        "llama3-rope": t.LlamaConfig(
            **{**c, "max_position_embeddings": 512},
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small, so the scaled band covers some of the tiny model's frequencies.
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
        "llama-linear-rope": t.LlamaConfig(
            **c, rope_scaling={"rope_type": "linear", "factor": 4.0}
        ),
        "mistral": t.MistralConfig(**c, sliding_window=5),
        "qwen2": t.Qwen2Config(**c),
        # Granite 3's multipliers, all away from 1 (the values of its 2B/8B configs), with biases.
        "granite": t.GraniteConfig(
            **c,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            attention_bias=True,
            mlp_bias=True,
            pad_token_id=0,
        ),
        # Granite 4.0, attention-only and dense (granite-4.0-micro's layout): the
        # MLP as shared_mlp, rotary linearly scaled, the head tied ...
        "granite4": t.GraniteMoeHybridConfig(
            **granite4,
            position_embedding_type="rope",
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            tie_word_embeddings=True,
        ),
        # ... and without rotary embedding (position_embedding_type None).
        "granite4-nope": t.GraniteMoeHybridConfig(**granite4, position_embedding_type=None),
        # Phi-3: fused q/k/v and gate/up as stored, partial rotary (Phi-4-mini's 0.75),
        # a sliding window on every layer.
        "phi3": t.Phi3Config(
            **{k: v for k, v in c.items() if k != "head_dim"},
            partial_rotary_factor=0.75,
            sliding_window=5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        # OLMo 2: post-norm blocks, q/k norms over whole projections, attention biases.
        "olmo2": t.Olmo2Config(**c, attention_bias=True, pad_token_id=0),
        # SmolLM3: layer 0 without rotary embedding (NoPE), layer 1 with it and a
        # sliding window shorter than the test sequences.
        "smollm3": t.SmolLM3Config(
            **c,
            no_rope_layers=[0, 1],
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        # Gemma 2: every soft-cap small enough to bind, a query scalar that is not
        # the head size, a window shorter than the sequences on the local layers
        # (the default alternation: local, global, local).
        "gemma2": t.Gemma2Config(
            **{**c, "num_hidden_layers": 3},
            query_pre_attn_scalar=48,
            sliding_window=5,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            pad_token_id=0,
        ),
        # Gemma 3: an unusual local/global pattern, local layers with their own
        # rotary base, linear rope scaling on the global layer only, q/k norms
        # and a final soft-cap.
        "gemma3": t.Gemma3TextConfig(
            **{**c, "num_hidden_layers": 4},
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            sliding_window=5,
            query_pre_attn_scalar=48,
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            pad_token_id=0,
        ),
        "qwen3": t.Qwen3Config(**c, tie_word_embeddings=True),
        # YaRN as Qwen3's long-context configs set it (defaults for the rest) ...
        "qwen3-yarn": t.Qwen3Config(
            **c,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # ... and with every field set (DeepSeek-style mscale pair, ramp bounds, no truncation).
        "llama-yarn": t.LlamaConfig(
            **c,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
            },
        ),
        # Dynamic NTK: the default frequencies up to max_position_embeddings.
        "llama-dynamic": t.LlamaConfig(
            **c, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
        ),
        "phi": t.PhiConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
        ),
        "gpt2": t.GPT2Config(
            vocab_size=VOCAB,
            n_embd=128,
            n_layer=2,
            n_head=2,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
    }


CONFIGS = _configs()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are O(1) and biases nonzero (HF inits
    them to 0); norm scales near 1 (Gemma and Qwen3.5 store ``w`` of their ``1 + w``)."""
    g = torch.Generator().manual_seed(seed)
    zero_centered = model.config.model_type.startswith(("gemma", "qwen3_5"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = any(k in name for k in ("norm", "ln_", "layernorm"))
            if is_norm and name.endswith("weight"):
                # Qwen3.5's gated head norm (``linear_attn.norm``) scales by w itself
                plain = not zero_centered or name.endswith("linear_attn.norm.weight")
                p.copy_(float(plain) + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2-MoE's selection bias (zeros at init)
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def _build(name: str, folder: str, seed: int = 0, config: object = None) -> torch.nn.Module:
    """Builds, randomizes and saves the reference model (``CONFIGS[name]``
    unless ``config`` is given); returns it (float32, eval)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config or CONFIGS[name], attn_implementation="eager"
    )
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: a thread pool only adds wake-up latency (100x on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    """Every reference model saved once for the module: name -> (folder, model)."""
    out = {}
    for name in CONFIGS:
        folder = str(tmp_path_factory.mktemp(name))
        out[name] = (folder, _build(name, folder))
    return out


def _sequences(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _reference(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits [len, vocab] for each whole sequence (no cache, no padding)."""
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float() for s in seqs]


def _assert_close_f32(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(
        ours, ref, atol=1e-4 * scale, rtol=1e-4, msg=lambda m: f"{what}: {m}"
    )


def check_greedy_generation(folder: str, ref_model: torch.nn.Module, name: str) -> None:
    """Through ``LLM`` (a mixed batch, the engine's schedule): greedy tokens
    equal transformers' and each step's top-3 logprobs equal the reference's
    log-softmax at that position (float32)."""
    from fastllm import LLM, SamplingParams

    prompts = _sequences(3, [6, 11, 3])
    llm = LLM(model=folder, dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = ref_model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )[0, len(prompt) :].tolist()
        c = out.outputs[0]
        assert c.token_ids == ref, name
        (logits,) = _reference(ref_model, [prompt + ref[:-1]])
        ref_lp = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)
        for step, top in enumerate(c.logprobs):
            assert len(top) >= 3
            for token, lp in top.items():
                assert abs(lp.logprob - ref_lp[step, token].item()) <= 1e-4, (name, step)


def _load(folder: str, dtype: torch.dtype = torch.float32, pack: bool = True) -> torch.nn.Module:
    """The model as the engine runs it: packed for the Rust GEMM where the
    engine would pack it (the CPU default on x86 with AVX2 or AVX-512)."""
    model = load_model(ModelConfig.from_pretrained(folder), folder, dtype, "cpu")
    if pack and should_pack("cpu", dtype):
        pack_linears(model)
    return model


LENGTHS = [7, 13, 1, 17, 4]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_prefill_matches_transformers(name: str, saved: dict) -> None:
    folder, ref_model = saved[name]
    seqs = _sequences(1, LENGTHS)
    ref = _reference(ref_model, seqs)
    model = _load(folder)
    runner = PagedRunner(model, torch.float32)
    logits = runner.step(list(enumerate(seqs)))
    for i, (ours, expected) in enumerate(zip(logits, ref, strict=True)):
        _assert_close_f32(ours, expected, f"{name} sequence {i}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefix_then_chunks_then_decode_matches_transformers(name: str, saved: dict) -> None:
    """Prefill a prefix, then mixed steps (chunked prefill beside decode), then pure decode."""
    folder, ref_model = saved[name]
    seqs = _sequences(2, [19, 12, 23])
    ref = _reference(ref_model, seqs)
    model = _load(folder)
    runner = PagedRunner(model, torch.float32, seed=3)
    done = [0, 0, 0]
    prefix = [5, 1, 9]
    chunk_plan = [
        [1, 3, 2],
        [1, 3, 2],
        [2, 1, 1],
    ]  # steps with max_query_len > 1 after a cached prefix

    def run(sizes: list[int]) -> None:
        chunks = []
        for i, size in enumerate(sizes):
            size = min(size, len(seqs[i]) - done[i])
            if size > 0:
                chunks.append((i, seqs[i][done[i] : done[i] + size]))
        outputs = runner.step(chunks)
        for (i, tokens), ours in zip(chunks, outputs, strict=True):
            expected = ref[i][done[i] : done[i] + len(tokens)]
            _assert_close_f32(ours, expected, f"{name} sequence {i} positions {done[i]}..")
            done[i] += len(tokens)

    run(prefix)
    for sizes in chunk_plan:
        run(sizes)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        run([1, 1, 1])  # one token per sequence: the decode path
    assert done == [len(s) for s in seqs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_op_table_chosen_at_load_and_torch_table_matches(name: str, saved: dict) -> None:
    """A CPU float32 model gets the Rust op table in every layer, float16 the
    torch one; rebinding the torch table (what CUDA falls back to) gives the
    reference's logits too, prefill then decode."""
    from fastllm.layers.ops import RUST_OPS, TORCH_OPS, LayerOps, bind_ops

    folder, ref_model = saved[name]

    def tables(model: torch.nn.Module) -> set[str]:
        return {
            m.ops.backend for m in model.modules() if isinstance(getattr(m, "ops", None), LayerOps)
        }

    model = _load(folder, pack=False)
    assert tables(model) == {RUST_OPS.backend}
    assert tables(_load(folder, torch.float16, pack=False)) == {TORCH_OPS.backend}
    bind_ops(model, TORCH_OPS)
    assert tables(model) == {TORCH_OPS.backend}
    seqs = _sequences(6, [11, 5])
    ref = _reference(ref_model, seqs)
    runner = PagedRunner(model, torch.float32)
    prefill = runner.step([(i, s[:-1]) for i, s in enumerate(seqs)])
    decode = runner.step([(i, s[-1:]) for i, s in enumerate(seqs)])
    for i, expected in enumerate(ref):
        _assert_close_f32(torch.cat([prefill[i], decode[i]]), expected, f"{name} torch ops {i}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_close_to_float32_reference(name: str, saved: dict) -> None:
    folder, ref_model = saved[name]
    seqs = _sequences(4, [9, 16, 3])
    ref = _reference(ref_model, seqs)
    model = _load(folder, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    runner = PagedRunner(model, torch.bfloat16)
    prefill = runner.step([(i, s[:-2]) for i, s in enumerate(seqs)])
    decode1 = runner.step([(i, s[-2:-1]) for i, s in enumerate(seqs)])
    decode2 = runner.step([(i, s[-1:]) for i, s in enumerate(seqs)])
    ours = torch.cat(
        [torch.cat([a, b, c]) for a, b, c in zip(prefill, decode1, decode2, strict=True)]
    )
    assert ours.dtype == torch.float32
    expected = torch.cat(ref)
    scale = expected.abs().max().item()
    # transformers' own error in bfloat16: a soft-capped head (Gemma) squeezes
    # the logits' range, so 3% of it is less than bf16's rounding upstream.
    ref_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    own = (torch.cat(_reference(ref_bf16, seqs)) - expected).abs().max().item()
    tol = max(0.03 * scale, 1.5 * own)
    err = (ours - expected).abs().max().item()
    assert err <= tol, f"{name}: max abs diff {err} (logit scale {scale}, reference bf16 {own})"
    top = ours.argmax(-1)
    agree = (top == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"{name}: top-1 agrees on only {agree:.0%} of positions"
    # Where the top-1 differs, it is a near tie in the reference.
    gap = expected.max(-1).values - expected.gather(1, top[:, None])[:, 0]
    assert gap.max().item() <= tol, f"{name}: top-1 off by {gap.max().item()}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_checkpoint_run_in_float32(name: str, saved: dict, tmp_path) -> None:
    """A bf16 checkpoint run in float32 (``dtype="auto"`` on a CPU without
    native bf16) keeps its matrices packed as bf16, half the bytes, and gives
    transformers' float32 tokens and logprobs on the same (bf16) weights."""
    _, ref_model = saved[name]
    folder = str(tmp_path / name)
    copy.deepcopy(ref_model).to(torch.bfloat16).save_pretrained(folder)
    # transformers reads the same files in float32 (its buffers, such as the
    # rotary frequencies, computed afresh rather than rounded to bf16).
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = _load(folder)
    if should_pack("cpu", torch.float32):
        packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
        assert packed and all(p.weight_dtype == "bfloat16" for p in packed), name
        assert model.packed_head.weight_dtype == "bfloat16", name
    check_greedy_generation(folder, ref32, name)


def test_prompts_without_kv_cache(saved: dict) -> None:
    """Before the runner assigns caches (a profiling run), whole prompts still attend correctly."""
    from fastllm.forward_context import AttentionMetadata, set_context

    folder, ref_model = saved["mistral"]
    seqs = _sequences(8, [9, 4])
    model = _load(folder)
    assert all(layer.k_cache is None for layer in model.attention_layers())
    set_context(
        AttentionMetadata(
            slot_mapping=torch.arange(13),
            block_tables=torch.zeros(2, 1, dtype=torch.int32),
            seq_lens=torch.tensor([9, 4], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 9, 13], dtype=torch.int32),
            max_query_len=9,
            max_seq_len=9,
        )
    )
    try:
        with torch.inference_mode():
            hidden = model(torch.tensor(seqs[0] + seqs[1]), torch.tensor([*range(9), *range(4)]))
            logits = model.compute_logits(hidden)
    finally:
        set_context(None)
    ref = _reference(ref_model, seqs)
    _assert_close_f32(logits[:9], ref[0], "uncached sequence 0")
    _assert_close_f32(logits[9:], ref[1], "uncached sequence 1")


def test_sliding_window_changes_the_result(saved: dict) -> None:
    """The Mistral test model's window (5) is shorter than its sequences, so it matters."""
    folder, ref_model = saved["mistral"]
    seq = _sequences(5, [15])[0]
    config = ModelConfig.from_pretrained(folder)
    assert config.sliding_window == 5
    config.sliding_window = None
    full = load_model(config, folder, torch.float32, "cpu")
    windowed = _load(folder)
    a = PagedRunner(full, torch.float32).step([(0, seq)])[0]
    b = PagedRunner(windowed, torch.float32).step([(0, seq)])[0]
    _assert_close_f32(b, _reference(ref_model, [seq])[0], "mistral windowed")
    assert not torch.allclose(a[6:], b[6:], atol=1e-3)
    torch.testing.assert_close(a[:5], b[:5])  # identical while the window covers everything


def test_each_family_option_matters(saved: dict) -> None:
    """The options these configs exercise change the logits (so the equality
    with transformers above tests them): each Granite multiplier set back to
    1, SmolLM3's NoPE layer given its rotary embedding, the SmolLM3, Phi-3
    and Gemma windows removed, each Gemma soft-cap removed, Gemma's query
    scalar set to the head size, Gemma 3's local rotary base set to the
    global one, its global rope scaling removed, its layer pattern changed."""
    seq = _sequences(7, [15])[0]

    def logits(name: str, **changes) -> torch.Tensor:
        folder = saved[name][0]
        config = ModelConfig.from_pretrained(folder)
        for key, value in changes.items():
            config.hf[key] = value
            if hasattr(config, key):
                setattr(config, key, value)
        model = load_model(config, folder, torch.float32, "cpu")
        return PagedRunner(model, torch.float32).step([(0, seq)])[0]

    for name, variants in {
        "granite": [
            {"embedding_multiplier": 1.0},
            {"attention_multiplier": 32**-1.0},
            {"residual_multiplier": 1.0},
            {"logits_scaling": 1.0},
        ],
        "smollm3": [{"no_rope_layers": [1, 1]}, {"sliding_window": None}],
        "phi3": [{"sliding_window": None}],
        "gemma2": [
            {"sliding_window": None},
            {"attn_logit_softcapping": None},
            {"final_logit_softcapping": None},
            {"query_pre_attn_scalar": 64},
        ],
        "gemma3": [
            {"sliding_window": None},
            {"final_logit_softcapping": None},
            {"query_pre_attn_scalar": 64},
            {"rope_scaling": None},
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            {"layer_types": ["full_attention"] + ["sliding_attention"] * 3},
        ],
    }.items():
        base = logits(name)
        _assert_close_f32(base, _reference(saved[name][1], [seq])[0], name)
        for change in variants:
            assert not torch.allclose(base, logits(name, **change), atol=1e-3), (name, change)


@pytest.mark.parametrize("name", ["qwen3-yarn", "llama-yarn"])
def test_yarn_changes_the_result(name: str, saved: dict) -> None:
    """YaRN's frequencies and attention factor change these models' logits
    (so the equality with transformers above tests them)."""
    folder, ref_model = saved[name]
    seq = _sequences(9, [15])[0]
    config = ModelConfig.from_pretrained(folder)
    assert config.rope_scaling["rope_type"] == "yarn"
    yarn = PagedRunner(_load(folder), torch.float32).step([(0, seq)])[0]
    _assert_close_f32(yarn, _reference(ref_model, [seq])[0], name)
    config.rope_scaling = None
    plain = load_model(config, folder, torch.float32, "cpu")
    assert not torch.allclose(
        yarn, PagedRunner(plain, torch.float32).step([(0, seq)])[0], atol=1e-3
    )


# ---- loader ----


def test_sharded_checkpoint(tmp_path, saved: dict) -> None:
    ref_model = saved["llama"][1]
    folder = str(tmp_path / "sharded")
    ref_model.save_pretrained(folder, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 2
    seqs = _sequences(6, [6, 11])
    logits = PagedRunner(_load(folder), torch.float32).step(list(enumerate(seqs)))
    for ours, expected in zip(logits, _reference(ref_model, seqs), strict=True):
        _assert_close_f32(ours, expected, "sharded")


def test_tied_embeddings_without_lm_head_tensor(saved: dict) -> None:
    for name in ("qwen3", "gpt2"):
        folder = saved[name][0]
        tensors = load_file(os.path.join(folder, "model.safetensors"))
        assert "lm_head.weight" not in tensors
        model = _load(folder)
        assert model.compute_logits(torch.zeros(1, 128)).shape == (1, VOCAB)


def test_gpt2_checkpoint_without_transformer_prefix(tmp_path, saved: dict) -> None:
    """The original GPT-2 checkpoints name tensors "h.0..." instead of "transformer.h.0..."."""
    src, ref_model = saved["gpt2"]
    folder = tmp_path / "gpt2-old"
    folder.mkdir()
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)  # old causal-mask buffer: ignored
    save_file(renamed, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    seq = _sequences(7, [10])
    ours = PagedRunner(_load(str(folder)), torch.float32).step([(0, seq[0])])[0]
    _assert_close_f32(ours, _reference(ref_model, seq)[0], "gpt2 old names")


def _copy_folder(src: str, dst) -> str:
    dst.mkdir()
    for n in os.listdir(src):
        (dst / n).write_bytes(open(os.path.join(src, n), "rb").read())
    return str(dst)


def test_missing_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        ModelConfig.from_pretrained(str(tmp_path / "nope"))


def test_malformed_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ValueError, match="'vocab_size'"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_config_fields(saved: dict) -> None:
    gpt2 = ModelConfig.from_pretrained(saved["gpt2"][0])
    assert (gpt2.hidden_size, gpt2.num_hidden_layers, gpt2.num_attention_heads) == (128, 2, 2)
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings, gpt2.head_dim) == (512, 256, 64)
    assert gpt2.tie_word_embeddings and gpt2.eos_token_ids == [0] and gpt2.sliding_window is None
    llama3 = ModelConfig.from_pretrained(saved["llama3-rope"][0])
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"
    assert llama3.rope_theta == 500000.0 and llama3.torch_dtype == "float32"
    phi = ModelConfig.from_pretrained(saved["phi"][0])
    assert phi.partial_rotary_factor == 0.5 and phi.num_key_value_heads == 2
    qwen2 = ModelConfig.from_pretrained(saved["qwen2"][0])
    assert qwen2.sliding_window is None  # the field is set but use_sliding_window is false


def test_legacy_config_layout_and_generation_eos(tmp_path) -> None:
    """Older configs: top-level rope_theta / rope_scaling / partial_rotary_factor; eos lists."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
        "rope_theta": 1000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 6],
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [6, 7], "bos_token_id": 1})
    )
    c = ModelConfig.from_pretrained(str(tmp_path))
    assert c.eos_token_ids == [5, 6, 7] and c.bos_token_id == 1
    assert c.rope_theta == 1000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.torch_dtype == "bfloat16"
    assert not c.tie_word_embeddings


def test_unsupported_architecture(tmp_path, saved: dict) -> None:
    cfg = json.load(open(os.path.join(saved["llama"][0], "config.json")))
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError) as e:
        load_model(config, str(tmp_path), torch.float32, "cpu")
    msg = str(e.value)
    assert "Unsupported architecture 'MambaForCausalLM'" in msg
    assert all(a in msg for a in ARCHITECTURES)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        get_model_class("Nope")


def test_unsupported_rope_type(saved: dict) -> None:
    hf = json.load(open(os.path.join(saved["llama"][0], "config.json")))
    hf["rope_parameters"] = {"rope_type": "fancy", "factor": 4.0, "rope_theta": 10000.0}
    config = ModelConfig.from_dict(hf)
    with pytest.raises(
        ValueError, match="unsupported rope scaling type 'fancy'; supported: default"
    ):
        load_model(config, "unused", torch.float32, "cpu", load_format="dummy")


def test_no_safetensors_file(tmp_path, saved: dict) -> None:
    (tmp_path / "config.json").write_text(
        open(os.path.join(saved["llama"][0], "config.json")).read()
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no safetensors weights found.*pytorch_model.bin"):
        _load(str(tmp_path))


def test_truncated_safetensors(tmp_path, saved: dict) -> None:
    folder = _copy_folder(saved["llama"][0], tmp_path / "cut")
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 1000])
    with pytest.raises(
        ValueError, match="corrupt or truncated safetensors file .*model.safetensors"
    ):
        _load(folder)
    # A header that claims more than the file holds.
    (header_len,) = struct.unpack("<Q", data[:8])
    open(path, "wb").write(data[: 8 + header_len // 2])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors file"):
        _load(folder)


def test_wrong_shape_and_missing_tensor(tmp_path, saved: dict) -> None:
    src = saved["qwen2"][0]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    bad = tmp_path / "bad"
    folder = _copy_folder(src, bad)
    name = "model.layers.1.self_attn.k_proj.bias"
    save_file({**tensors, name: torch.zeros(3)}, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}'.* has shape \[3\], expected \[128\]"):
        _load(folder)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.weight"}
    save_file(missing, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        _load(folder)


def test_extra_tensors_are_ignored(tmp_path, saved: dict) -> None:
    src = saved["llama"][0]
    folder = _copy_folder(src, tmp_path / "extra")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    model = _load(folder, pack=False)
    expected = tensors["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.weight[:256], expected)


def test_dummy_load_format(tmp_path, saved: dict) -> None:
    (tmp_path / "config.json").write_text(
        open(os.path.join(saved["qwen2"][0], "config.json")).read()
    )
    config = ModelConfig.from_pretrained(str(tmp_path))
    a = load_model(config, str(tmp_path), torch.bfloat16, "cpu", load_format="dummy")
    b = load_model(config, str(tmp_path), torch.bfloat16, "cpu", load_format="dummy")
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen2"])
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in ref.parameters())
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.dtype == torch.bfloat16 and pa.device.type == "cpu"
        assert torch.equal(pa, pb), na
    assert torch.equal(a.model.norm.weight, torch.ones(128, dtype=torch.bfloat16))
    logits = PagedRunner(a, torch.bfloat16).step([(0, [1, 2, 3])])[0]
    assert logits.shape == (3, VOCAB) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="'auto', 'safetensors', 'dummy'"):
        load_model(config, str(tmp_path), torch.float32, "cpu", load_format="pt")


def test_every_architecture_is_tested() -> None:
    """Each registered architecture has a config here, or in
    ``tests/test_moe_models.py`` (the mixture-of-experts families) or
    ``tests/test_hybrid_models.py`` (the hybrid recurrent ones)."""
    from test_hybrid_models import CONFIGS as HYBRID_CONFIGS
    from test_moe_models import CONFIGS as MOE_CONFIGS

    configs = [*CONFIGS.values(), *MOE_CONFIGS.values(), *HYBRID_CONFIGS.values()]
    tested = {type(c).__name__.replace("TextConfig", "").replace("Config", "") for c in configs}
    assert {a.split("For")[0].replace("LMHeadModel", "") for a in ARCHITECTURES} <= tested


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_with_legacy_config(tmp_path, prefix: str) -> None:
    """A ``Gemma3ForConditionalGeneration`` folder runs as its text model:
    the ``text_config`` (listing only some fields, the rest at the family's
    defaults; the older rope fields ``rope_theta`` / ``rope_local_base_freq``
    / ``rope_scaling`` and ``sliding_window_pattern`` instead of
    ``layer_types``) and the weights under either prefix the checkpoints use
    (the vision tower's tensors are not read)."""
    text = dict(LLAMA_COMMON, num_hidden_layers=4, head_dim=256, num_attention_heads=2)
    text.update(num_key_value_heads=1, hidden_size=128, vocab_size=VOCAB)
    reference = transformers.Gemma3TextConfig(
        **text,
        sliding_window=5,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        pad_token_id=0,
    )
    torch.manual_seed(0)
    ref_model = transformers.Gemma3ForCausalLM(reference)
    _randomize(ref_model, 5)
    ref_model = ref_model.float().eval()
    assert reference.layer_types[:2] == ["sliding_attention", "full_attention"]
    tensors = {
        (prefix + k[len("model.") :]) if k.startswith("model.") else k: v.contiguous()
        for k, v in ref_model.state_dict().items()
        if k != "lm_head.weight"  # tied
    }
    tensors["model.vision_tower.patch_embedding.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    # The fields a released config lists; head_dim 256, query_pre_attn_scalar
    # 256, rope_local_base_freq 1e4 and tied embeddings come from the defaults.
    listed = {k: v for k, v in text.items() if k != "head_dim"}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            **listed,
            "model_type": "gemma3_text",
            "sliding_window": 5,
            "sliding_window_pattern": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.eos_token_ids == [1, 106] and mc.head_dim == 256
    assert mc.layer_attention_types() == reference.layer_types
    model = _load(str(tmp_path))
    seqs = _sequences(11, [15, 6])
    logits = PagedRunner(model, torch.float32).step(list(enumerate(seqs)))
    for i, (ours, expected) in enumerate(zip(logits, _reference(ref_model, seqs), strict=True)):
        _assert_close_f32(ours, expected, f"gemma3 multimodal layout {prefix} sequence {i}")


def test_gemma2_default_layer_pattern_and_bad_layer_types(tmp_path, saved: dict) -> None:
    """A Gemma 2 config without ``layer_types`` alternates from a local first
    layer (as its checkpoints assume); a malformed ``layer_types`` names the field."""
    folder = _copy_folder(saved["gemma2"][0], tmp_path / "g2")
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg.pop("layer_types") == ["sliding_attention", "full_attention", "sliding_attention"]
    (tmp_path / "g2" / "config.json").write_text(json.dumps(cfg))
    seq = _sequences(12, [14])[0]
    ours = PagedRunner(_load(folder), torch.float32).step([(0, seq)])[0]
    _assert_close_f32(ours, _reference(saved["gemma2"][1], [seq])[0], "gemma2 default pattern")
    cfg["layer_types"] = ["sliding_attention", "local"]
    (tmp_path / "g2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types must list 3"):
        _load(folder)


def _phi3_longrope(folder: str, seed: int, **rope) -> torch.nn.Module:
    """A Phi-3 with LongRoPE over a 16-token original context (Phi-3.5 /
    Phi-4-mini's layout: factors per rotary frequency, the original context
    at the config's top level), saved to ``folder``."""
    g = torch.Generator().manual_seed(seed)
    half = 12  # head_dim 32, partial_rotary_factor 0.75: 24 rotary dims
    config = transformers.Phi3Config(
        **{k: v for k, v in LLAMA_COMMON.items() if k != "head_dim"},
        partial_rotary_factor=0.75,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(half, generator=g)).tolist(),
            **rope,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}])
def test_phi3_longrope_matches_transformers(tmp_path, rope: dict) -> None:
    """LongRoPE: with the engine's context past the original one (the default,
    max_position_embeddings 256 > 16) every position rotates by the long
    factors, as the reference does for any sequence longer than 16 tokens:
    prefill, chunks and decode equal to it on such sequences. With the
    context limited to the original (``max_model_len`` 16) the short factors
    serve, equal to the reference on sequences within it. The two sets and
    the attention factor each change the logits."""
    from fastllm.layers.rotary import limit_positions

    folder = str(tmp_path / "phi3")
    ref_model = _phi3_longrope(folder, 3, **rope)
    config = ModelConfig.from_pretrained(folder)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 16
    long_seqs = _sequences(13, [40, 23])
    ref = _reference(ref_model, long_seqs)
    runner = PagedRunner(_load(folder), torch.float32)
    first = runner.step([(0, long_seqs[0][:30]), (1, long_seqs[1][:5])])
    second = runner.step([(0, long_seqs[0][30:31]), (1, long_seqs[1][5:])])
    rest = runner.step([(0, long_seqs[0][31:])])
    _assert_close_f32(torch.cat([first[0], second[0], rest[0]]), ref[0], "longrope seq 0")
    _assert_close_f32(torch.cat([first[1], second[1]]), ref[1], "longrope seq 1")

    short_seq = _sequences(14, [16])[0]
    short_model = _load(folder)
    limit_positions(short_model, 16)
    short = PagedRunner(short_model, torch.float32).step([(0, short_seq)])[0]
    _assert_close_f32(short, _reference(ref_model, [short_seq])[0], "longrope short factors")
    long_on_short = PagedRunner(_load(folder), torch.float32).step([(0, short_seq)])[0]
    assert not torch.allclose(short, long_on_short, atol=1e-3)
    config.rope_scaling["attention_factor"] = 1.0
    plain = load_model(config, folder, torch.float32, "cpu")
    limit_positions(plain, 16)
    assert not torch.allclose(
        short, PagedRunner(plain, torch.float32).step([(0, short_seq)])[0], atol=1e-3
    )


def test_longrope_factor_lists_are_checked(tmp_path) -> None:
    folder = str(tmp_path / "phi3")
    _phi3_longrope(folder, 4)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    params = cfg.get("rope_parameters") or cfg["rope_scaling"]
    params["long_factor"] = params["long_factor"][:-1]
    (tmp_path / "phi3" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="long_factor must list 12 numbers"):
        _load(folder)


def _fake_quantized(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy of the reference whose matrices (embeddings included) went
    through ``fmt`` and back with the ``gguf`` package's quantizers (llama.cpp's
    own Python library): the weights a quantized fastllm model computes with."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[fmt.upper()]
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim == 2:
                a = p.detach().numpy().astype(np.float32)
                back = quants.dequantize(quants.quantize(a, kind), kind).reshape(a.shape)
                p.copy_(torch.from_numpy(back))
    return out


@pytest.mark.parametrize(
    "name", ["llama", "granite", "smollm3", "olmo2", "phi3", "gemma2", "gemma3"]
)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_families_quantized_match_the_quantized_reference(
    name: str, quantization: str, saved: dict
) -> None:
    """``quantization="int8"``/``"int4"`` on each family: every matrix (the
    head included) runs the integer kernels, and the logits are those of the
    reference with the same weights quantized and dequantized, up to the
    kernels' 8-bit activations, whose error is of the order of 8-bit weights':
    within 1.5x what quantizing the weights moves the reference for int8, a
    third of it for int4 (and 2% of the logit scale where that is less). Gemma's
    four norms per block make it the most sensitive family."""
    from fastllm import _core
    from fastllm.layers.quantization import QUANTIZATION_FORMATS, quantize_model

    folder, ref_model = saved[name]
    fmt = QUANTIZATION_FORMATS[quantization]
    model = load_model(ModelConfig.from_pretrained(folder), folder, torch.float32, "cpu")
    quantize_model(model, fmt, VOCAB)
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(isinstance(m.packed, _core.QuantizedLinear) for m in linears)
    assert isinstance(model.packed_head, _core.QuantizedLinear)
    seqs = _sequences(15, [12, 9])
    ours = torch.cat(PagedRunner(model, torch.float32).step(list(enumerate(seqs))))
    ref = torch.cat(_reference(ref_model, seqs))
    same_weights = torch.cat(_reference(_fake_quantized(ref_model, fmt), seqs))
    moved = (same_weights - ref).abs().max().item()
    err = (ours - same_weights).abs().max().item()
    share = 1.5 if quantization == "int8" else 1 / 3
    assert err <= max(share * moved, 0.02 * ref.abs().max().item()), (err, moved)
