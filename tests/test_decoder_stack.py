"""The decoder stack (``_core.DecoderStack``): a Llama-family model's decoder
layers in one Rust call per step, against the same model run layer by layer.

Both paths run the same kernels with the same roundings, so the contract is
bit-identity: every logit of every step equal (``torch.equal``), for float32,
bfloat16 and quantized weights, on Llama, Llama 3 rope, Mistral (sliding
window), Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied head), Granite (its
multipliers), SmolLM3 (NoPE layers), OLMo 2 (output norms only, q/k norms
over the whole projections), Gemma 2 and 3 (four norms, GeGLU, soft-caps,
local rotary tables), Qwen3-MoE, Qwen2-MoE, Mixtral, Granite MoE and gpt-oss
(mixture-of-experts layers, a dense one between them, a shared expert,
attention sinks), and
the hybrids LFM2 (short convolutions) and Qwen3.5 (Gated DeltaNet, gated
attention), over prefill, chunked prefill beside decode, and decode of
several sequences with shuffled block tables; and in the engine, over the
block tables of KV groups whose layers share cache tensors. The layer-by-layer path is itself checked against transformers
in ``test_models.py`` (which runs the stack too, as the engine does).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import LLM, SamplingParams, _core  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.layers.linear import pack_linears, should_pack  # noqa: E402
from fastllm.layers.quantization import quantize_model  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402
from test_models import VOCAB, _build  # noqa: E402

pytestmark = pytest.mark.skipif(
    not should_pack("cpu", torch.float32), reason="the stack runs packed CPU models"
)

# The mixtures of experts (``tests/test_moe_models.py``'s configs): Qwen3-MoE
# with a dense layer between sparse ones, Qwen2-MoE with a shared expert,
# Mixtral with a window, Granite MoE with Granite's multipliers, gpt-oss
# (sinks, biases, windowed and full layers, the clamped SwiGLU; top 2 and 1).
MOE_NAMES = ["qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "gpt_oss", "gpt_oss_top1"]
# LFM2's short-convolution layers beside its attention layers
# (``tests/test_hybrid_models.py``'s configs: one attention layer or two,
# convolution biases, an MoE version with a dense layer first).
LFM2_NAMES = ["lfm2", "lfm2_bias", "lfm2_moe", "lfm2_moe_plain"]
# Qwen3.5's Gated DeltaNet and gated-attention layers (the same file's
# configs: the default pattern, attention first with biases and 2 taps, MoE;
# and the text part of the multimodal checkpoints, "_vl").
QWEN3_5_NAMES = ["qwen3_5", "qwen3_5_pattern", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"]
# Granite 4.0's Mamba-2 layers around an attention layer, with Granite's
# multipliers; and with experts beside the dense MLP (its ungated shared expert).
GRANITE4_NAMES = ["granite4_h", "granite4_h_moe"]
HYBRID_NAMES = LFM2_NAMES + QWEN3_5_NAMES + GRANITE4_NAMES
NAMES = [
    "llama",
    "llama3-rope",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "granite",
    "granite4",  # Granite's multipliers, linearly scaled rotary, a tied head
    "granite4-nope",  # ... and without rotary
    "smollm3",  # NoPE layers, a windowed layer
    "olmo2",  # output norms only, q/k norms over the whole projections
    # Gemma: four norms, GeGLU, soft-capped scores (Gemma 2), local layers
    # in their own KV group, with their own rotary tables (Gemma 3).
    "gemma2",
    "gemma3",
    "gemma3_vl",  # the text part of a Gemma3ForConditionalGeneration checkpoint
    *MOE_NAMES,
    *HYBRID_NAMES,
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import copy

    from test_moe_models import CONFIGS as MOE_CONFIGS
    from test_moe_models import build as build_moe

    out = {}
    for name in NAMES:
        folder = str(tmp_path_factory.mktemp(f"stack-{name}"))
        if name in MOE_NAMES:
            config = copy.deepcopy(MOE_CONFIGS[name])
            config.vocab_size = VOCAB
            build_moe(config, folder, seed=5)
        elif name == "gemma3_vl":
            _build("gemma3", folder, seed=5)
            _as_gemma3_multimodal(folder)
        elif name.endswith("_vl"):
            from test_hybrid_models import build_multimodal

            build_multimodal(name.removesuffix("_vl"), folder, tie=False, seed=5)
        elif name in HYBRID_NAMES:
            from test_hybrid_models import CONFIGS as HYBRID_CONFIGS

            _build("", folder, 5, HYBRID_CONFIGS[name])
        else:
            _build(name, folder, seed=5)
        out[name] = folder
    return out


def _as_gemma3_multimodal(folder: str) -> None:
    """Rewrites a saved Gemma 3 text model in place as a
    ``Gemma3ForConditionalGeneration`` checkpoint: its config under
    ``text_config``, its weights under ``model.language_model.``."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        text = json.load(f)
    text.pop("architectures", None)
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {**text, "model_type": "gemma3_text"},
        "vision_config": {"model_type": "siglip_vision_model"},
        "tie_word_embeddings": text.get("tie_word_embeddings", True),
    }
    with open(path, "w") as f:
        json.dump(config, f)
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    prefix = "model.language_model."
    renamed = {(prefix + k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}
    save_file(renamed, weights)


def _load(folder: str, dtype: torch.dtype, quant: str | None) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(folder)
    model = load_model(config, folder, dtype, "cpu")
    if quant is None:
        pack_linears(model)
    else:
        quantize_model(model, quant, config.vocab_size)
    return model


def _run(model: torch.nn.Module, dtype: torch.dtype, fuse: bool, plan: list[list[int]], seqs):
    """Feeds ``seqs`` through ``model`` in steps of ``plan`` (tokens per
    sequence per step); returns every step's logits."""
    runner = PagedRunner(model, dtype, seed=11, fuse=fuse)
    assert runner.fused == fuse
    done = [0] * len(seqs)
    out = []
    for sizes in plan:
        chunks = []
        for i, size in enumerate(sizes):
            size = min(size, len(seqs[i]) - done[i])
            if size > 0:
                chunks.append((i, seqs[i][done[i] : done[i] + size]))
                done[i] += size
        if chunks:
            out.extend(runner.step(chunks))
    return out


def _sequences(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PLAN = [[6, 1, 9], [1, 3, 2], [2, 1, 1]] + [[1, 1, 1]] * 12


@pytest.mark.parametrize("quant", [None, "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_stack_is_bit_identical_to_the_layers(name, dtype, quant, folders) -> None:
    seqs = _sequences([18, 12, 16], seed=3)
    fused = _run(_load(folders[name], dtype, quant), dtype, True, PLAN, seqs)
    layers = _run(_load(folders[name], dtype, quant), dtype, False, PLAN, seqs)
    assert len(fused) == len(layers) > 0
    for i, (a, b) in enumerate(zip(fused, layers, strict=True)):
        assert torch.isfinite(a).all(), f"{name} {dtype} {quant} output {i}"
        assert torch.equal(a, b), f"{name} {dtype} {quant} output {i}: {(a - b).abs().max()}"


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    chunk=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
def test_stack_matches_the_layers_on_random_schedules(lengths, chunk, seed, folders) -> None:
    """Random sequence counts, lengths and prefill chunk sizes (then decode)."""
    seqs = _sequences(lengths, seed)
    plan = [[chunk] * len(seqs)] * (30 // chunk + 1) + [[1] * len(seqs)] * 4
    name = NAMES[seed % len(NAMES)]
    dtype = torch.bfloat16
    fused = _run(_load(folders[name], dtype, None), dtype, True, plan, seqs)
    layers = _run(_load(folders[name], dtype, None), dtype, False, plan, seqs)
    for a, b in zip(fused, layers, strict=True):
        assert torch.equal(a, b)


def test_engine_uses_the_stack_and_the_switch_turns_it_off(folders, monkeypatch) -> None:
    """``LLM`` runs the stack by default; ``FASTLLM_CPU_FUSED=0`` runs the
    layers one by one, with the same tokens and logprobs."""
    folder = folders["qwen2"]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": s} for s in _sequences([9, 4, 21], seed=8)]
    results = _fused_and_layers(folder, prompts, params, monkeypatch)
    assert results["1"] == results["0"]
    monkeypatch.setenv("FASTLLM_CPU_FUSED", "maybe")
    with pytest.raises(ValueError, match="FASTLLM_CPU_FUSED"):
        LLM(folder, skip_tokenizer_init=True, max_model_len=64)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_engine_stack_with_kv_groups_matches_the_layers(name, folders, monkeypatch) -> None:
    """Gemma in the engine: its local layers keep their blocks in a KV group
    of their own (blocks out of the window freed), sharing cache tensors
    with the global layers at other blocks; the stack reads each group's
    tables and gives the tokens and logprobs of the layers run one by one,
    over prompts and outputs several windows long."""
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": s} for s in _sequences([9, 4, 27], seed=4)]

    def check(runner) -> None:
        groups = {layer.kv_group for layer in runner.model.attention_layers()}
        assert len(groups) > 1, groups  # the local layers' blocks apart from the global ones

    results = _fused_and_layers(folders[name], prompts, params, monkeypatch, check, block_size=4)
    assert results["1"] == results["0"]


def _fused_and_layers(folder, prompts, params, monkeypatch, check=None, **kw) -> dict:
    """``{"1": ..., "0": ...}``: each prompt's greedy tokens and logprobs from
    an ``LLM`` of ``folder`` with ``FASTLLM_CPU_FUSED`` 1 (the stack) and 0
    (the layers), each runner checked by ``check``."""
    results = {}
    for value in ("1", "0"):
        monkeypatch.setenv("FASTLLM_CPU_FUSED", value)
        llm = LLM(folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64, **kw)
        runner = llm.llm_engine.runner
        assert runner.fused_layers == (value == "1")
        if check is not None:
            check(runner)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[value] = [
            (
                o.outputs[0].token_ids,
                [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs],
            )
            for o in outs
        ]
    return results


def _layer_dict(model: torch.nn.Module, i: int) -> dict:
    layer = model.model.layers[i]
    a, m = layer.self_attn, layer.mlp
    return {
        "input_norm": layer.input_layernorm.weight,
        "post_norm": layer.post_attention_layernorm.weight,
        "q_norm": None,
        "k_norm": None,
        "qkv": a.qkv_proj.packed,
        "o": a.o_proj.packed,
        "gate_up": m.gate_up_proj.packed,
        "down": m.down_proj.packed,
        "key_cache": a.attn.k_cache,
        "value_cache": a.attn.v_cache,
        "sliding_window": 0,
    }


def test_bad_stacks_and_steps_are_clear_errors(folders) -> None:
    model = _load(folders["llama"], torch.float32, None)
    PagedRunner(model, torch.float32, fuse=False)
    c = model.config
    kw = dict(
        hidden_size=c.hidden_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rotary_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        eps=1e-6,
        scale=c.head_dim**-0.5,
    )
    good = [_layer_dict(model, 0), _layer_dict(model, 1)]
    stack = _core.DecoderStack(good, **kw)
    assert stack.num_layers == 2
    cases = [
        ({"qkv": None}, r"layers\[1\]: qkv: expected a PackedLinear or QuantizedLinear"),
        ({"o": good[0]["qkv"]}, r"layers\[1\]\.o: expected a \[128, 256\] weight"),
        ({"post_norm": torch.ones(7)}, r"layers\[1\]: post_norm: dimension 0 must be 128"),
        (
            {"input_norm": torch.ones(128, dtype=torch.bfloat16)},
            r"layers\[1\]: input_norm: expected dtype",
        ),
        ({"q_norm": torch.ones(c.head_dim)}, r"q_norm, k_norm: give both or neither"),
        ({"mlp_act": "swiglu_oai"}, r"mlp_act: expected 'silu' or 'gelu_tanh', got swiglu_oai"),
        ({"mlp_act": "relu"}, r"mlp_act: expected 'silu' or 'gelu_tanh', got relu"),
        ({"logit_softcap": -1.0}, r"logit_softcap: must be a positive number or 0"),
        (
            {"key_cache": good[0]["key_cache"]},
            r"layers\[1\]: its KV cache or state shares memory with layer 0",
        ),
        ({"value_cache": torch.zeros(3, 2, 4, 64)}, r"value_cache: shape .* must match key_cache"),
        ({"sinks": torch.zeros(3)}, r"layers\[1\]\.sinks: expected 4 elements, got 3"),
        ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, r"sinks: expected dtype"),
    ]
    for change, message in cases:
        bad = [good[0], {**good[1], **change}]
        with pytest.raises(ValueError, match=message):
            _core.DecoderStack(bad, **kw)
    missing = {k: v for k, v in good[1].items() if k != "down"}
    with pytest.raises(ValueError, match=r"layers\[1\]: missing key 'down'"):
        _core.DecoderStack([good[0], missing], **kw)
    with pytest.raises(ValueError, match="layers: expected at least one layer"):
        _core.DecoderStack([], **kw)
    with pytest.raises(ValueError, match="rotary_dim"):
        _core.DecoderStack(good, **{**kw, "rotary_dim": 3})
    x = torch.zeros(2, 100)
    cos = torch.zeros(2, c.head_dim // 2)
    meta = (
        torch.tensor([4, 5]),
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="x: dimension 1 must be 128"):
        stack.forward(x, cos, cos, *meta)
    x = torch.zeros(2, 128)
    with pytest.raises(ValueError, match="cos: dimension 1 must be 32"):
        stack.forward(x, torch.zeros(2, 5), cos, *meta)
    with pytest.raises(ValueError, match="slot_mapping: dimension 0 must be 2"):
        stack.forward(x, cos, cos, torch.tensor([4]), *meta[1:])
    with pytest.raises(ValueError, match="slot_mapping: token 1 has slot 9999"):
        stack.forward(x, cos, cos, torch.tensor([4, 9999]), *meta[1:])
    stack.forward(x, cos, cos, *meta)  # a good step after the bad ones
    assert torch.isfinite(x).all()


def test_every_fused_architecture_is_checked_here(folders) -> None:
    """Every architecture the stack fuses is among this file's configs, and
    every Llama-family architecture is either fused (and so checked here) or
    refused by the stack, never fused unchecked."""
    from fastllm.models import ARCHITECTURES
    from fastllm.models.llama_stack import FUSED_ARCHITECTURES

    checked = {ModelConfig.from_pretrained(folders[n]).architecture for n in NAMES}
    assert checked >= FUSED_ARCHITECTURES
    modules = ("llama", "moe", "hybrid", "gemma")
    modules = tuple(f"fastllm.models.{m}" for m in modules)
    family = {a for a, (module, _) in ARCHITECTURES.items() if module in modules}
    assert family >= FUSED_ARCHITECTURES


def test_the_stack_refuses_an_architecture_it_does_not_implement(folders) -> None:
    from fastllm.models.llama_stack import why_not

    model = _load(folders["llama"], torch.float32, None)
    model.config.architecture = "SomeNewLlamaFamilyForCausalLM"
    assert "does not implement" in why_not(model)


def test_attention_sinks_in_the_stack(folders) -> None:
    """Sink logits (gpt-oss's) set on any attention run in the stack, bit
    for bit as layer by layer; sinks of -inf are no sinks."""
    from fastllm.models.llama_stack import why_not

    seqs = _sequences([9, 5], seed=3)
    plan = [[6, 5], [3, 0], [1, 1]]
    model = _load(folders["llama"], torch.float32, None)
    want = _run(model, torch.float32, True, plan, seqs)
    attn = list(model.attention_layers())[1]
    attn.sinks = torch.full((attn.num_heads,), float("-inf"))
    assert why_not(model) is None
    got = _run(model, torch.float32, True, plan, seqs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    attn.sinks = torch.linspace(-1.0, 3.0, attn.num_heads)
    fused = _run(model, torch.float32, True, plan, seqs)
    layers = _run(model, torch.float32, False, plan, seqs)
    assert all(torch.equal(a, b) for a, b in zip(fused, layers))
    assert not torch.equal(fused[-1], want[-1])


def _hybrid_stack_arguments(folder: str) -> tuple:
    """A float32 hybrid model from ``folder`` fused by the runner, with the
    layer dicts and keywords ``llama_stack.build_hybrid`` gives its stack."""
    from fastllm.models.llama_stack import build_hybrid

    model = _load(folder, torch.float32, None)
    PagedRunner(model, torch.float32, fuse=True)
    assert model.decoder_stack is not None
    captured: dict = {}
    real = _core.DecoderStack

    def capture(layers, **kw):
        captured.update(layers=layers, kw=kw)
        return real(layers, **kw)

    _core.DecoderStack = capture
    try:
        build_hybrid(model)
    finally:
        _core.DecoderStack = real
    return model, captured["layers"], captured["kw"]


def _one_token_step(model, hidden: int) -> tuple:
    """Hidden states, rotary table and attention metadata of a one-token step
    of one sequence at slot 4 (block 1)."""
    meta = (
        torch.tensor([4]),
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    return torch.zeros(1, hidden), torch.zeros(1, model.rotary.rotary_dim // 2), meta


def test_bad_convolution_layers_are_clear_errors(folders) -> None:
    """LFM2's convolution layers in the stack: a misshapen weight or state,
    states sharing memory, a stack of convolutions alone, and a step without
    ``state_slots`` are errors naming them."""
    model, layers, kw = _hybrid_stack_arguments(folders["lfm2"])
    stack = model.decoder_stack
    assert stack.num_layers == 4
    conv = next(i for i, d in enumerate(layers) if d.get("conv_in_proj") is not None)
    h = kw["hidden_size"]
    cases = [
        ({"conv_weight": torch.zeros(h, 1)}, r"conv_weight: expected 2 to 8 taps, got 1"),
        ({"conv_state": torch.zeros(4, h, 5)}, r"conv_state: dimension 2 must be 2"),
        ({"conv_bias": torch.zeros(h + 1)}, r"conv_bias: dimension 0 must be"),
        ({"conv_out_proj": layers[conv]["conv_in_proj"]}, r"conv_out_proj: expected a \[64, 64\]"),
    ]
    for change, message in cases:
        bad = [*layers[:conv], {**layers[conv], **change}, *layers[conv + 1 :]]
        with pytest.raises(ValueError, match=rf"layers\[{conv}\]\S* ?{message}"):
            _core.DecoderStack(bad, **kw)
    other = next(i for i, d in enumerate(layers) if i != conv and d.get("conv_state") is not None)
    shared = [dict(d) for d in layers]
    shared[other]["conv_state"] = layers[conv]["conv_state"]
    with pytest.raises(ValueError, match="its KV cache or state shares memory"):
        _core.DecoderStack(shared, **kw)
    convs = [d for d in layers if d.get("conv_in_proj") is not None]
    with pytest.raises(ValueError, match="expected at least one attention layer"):
        _core.DecoderStack(convs, **kw)
    x, cos, meta = _one_token_step(model, h)
    with pytest.raises(ValueError, match="state_slots: required by the recurrent"):
        stack.forward(x, cos, cos, *meta)
    with pytest.raises(ValueError, match="state_slots: slot 99 of sequence 0 is outside"):
        stack.forward(x, cos, cos, *meta, torch.tensor([99]))


def test_bad_delta_net_layers_are_clear_errors(folders) -> None:
    """Qwen3.5's Gated DeltaNet layers in the stack: misshapen weights,
    parameters or states, states sharing memory, and steps without (or with
    bad) ``state_slots`` are errors naming them."""
    model, layers, kw = _hybrid_stack_arguments(folders["qwen3_5"])
    i = next(j for j, d in enumerate(layers) if d.get("delta_in_proj") is not None)
    d = layers[i]
    slots, hv, dk, dv = d["delta_state"].shape
    channels = d["delta_conv_weight"].shape[0]
    assert layers[-1]["attn_output_gate"] and layers[-1]["q_norm"].dtype == torch.float32
    cases = [
        (
            {"delta_conv_weight": torch.zeros(channels, 1)},
            r"delta_conv_weight: expected 2 to 8 taps",
        ),
        ({"delta_conv_weight": torch.zeros(channels + 1, 4)}, r"delta_conv_weight: \d+ channels"),
        ({"delta_conv_state": torch.zeros(slots, channels, 2)}, r"delta_conv_state: dimension 2"),
        ({"delta_a_log": torch.zeros(hv + 1)}, r"delta_a_log: dimension 0 must be"),
        (
            {"delta_dt_bias": torch.zeros(hv, dtype=torch.bfloat16)},
            r"delta_dt_bias: expected dtype",
        ),
        ({"delta_norm": torch.zeros(dv + 1)}, r"delta_norm: dimension 0 must be"),
        ({"delta_state": torch.zeros(slots + 1, hv, dk, dv)}, r"delta_state: expected \[slots"),
        ({"delta_out_proj": d["delta_in_proj"]}, r"delta_out_proj: expected a \["),
        ({"delta_in_proj": d["delta_out_proj"]}, r"delta_in_proj: expected a \["),
    ]
    for change, message in cases:
        bad = [*layers[:i], {**d, **change}, *layers[i + 1 :]]
        with pytest.raises(ValueError, match=rf"layers\[{i}\]\S* ?{message}"):
            _core.DecoderStack(bad, **kw)
    other = next(j for j, e in enumerate(layers) if j != i and e.get("delta_state") is not None)
    shared = [dict(e) for e in layers]
    shared[other]["delta_state"] = d["delta_state"]
    with pytest.raises(ValueError, match="its KV cache or state shares memory"):
        _core.DecoderStack(shared, **kw)
    h = kw["hidden_size"]
    x, cos, meta = _one_token_step(model, h)
    stack = model.decoder_stack
    with pytest.raises(ValueError, match="state_slots: required by the recurrent"):
        stack.forward(x, cos, cos, *meta)
    for e in layers:
        for key in ("delta_state", "delta_conv_state"):
            if e.get(key) is not None:
                e[key].zero_()
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(0))
    before = d["delta_state"].clone()
    with pytest.raises(ValueError, match=f"state_slots: slot {slots} of sequence 0 is outside"):
        stack.forward(x, cos, cos, *meta, torch.tensor([slots]))
    assert torch.equal(d["delta_state"], before)  # nothing ran
    stack.forward(x, cos, cos, *meta, torch.tensor([0]))
    assert torch.isfinite(x).all() and not torch.equal(d["delta_state"], before)


def test_bad_mamba2_layers_are_clear_errors(folders) -> None:
    """Granite 4.0's Mamba-2 layers in the stack: misshapen weights,
    parameters or states, and states sharing memory are errors naming them."""
    _, layers, kw = _hybrid_stack_arguments(folders["granite4_h"])
    i = next(j for j, d in enumerate(layers) if d.get("mamba_in_proj") is not None)
    d = layers[i]
    slots, heads, n, p = d["mamba_state"].shape
    channels = d["mamba_conv_weight"].shape[0]
    cases = [
        ({"mamba_conv_weight": torch.zeros(channels, 1)}, r"mamba_conv_weight: expected 2 to 8"),
        ({"mamba_conv_weight": torch.zeros(channels + 2, 4)}, r"mamba_conv_weight: \d+ channels"),
        ({"mamba_groups": 3}, r"mamba_conv_weight: \d+ channels"),
        ({"mamba_conv_bias": torch.zeros(channels + 1)}, r"mamba_conv_bias: dimension 0"),
        ({"mamba_conv_state": torch.zeros(slots, channels, 2)}, r"mamba_conv_state: dimension 2"),
        ({"mamba_a_log": torch.zeros(heads + 1)}, r"mamba_a_log: dimension 0 must be"),
        ({"mamba_d": torch.zeros(heads, dtype=torch.bfloat16)}, r"mamba_d: expected dtype"),
        ({"mamba_norm": torch.zeros(heads * p + 1)}, r"mamba_norm: dimension 0 must be"),
        ({"mamba_state": torch.zeros(slots + 1, heads, n, p)}, r"mamba_state: expected \[slots"),
        ({"mamba_out_proj": d["mamba_in_proj"]}, r"mamba_out_proj: expected a \["),
        ({"mamba_in_proj": d["mamba_out_proj"]}, r"mamba_in_proj: expected a \["),
    ]
    for change, message in cases:
        bad = [*layers[:i], {**d, **change}, *layers[i + 1 :]]
        with pytest.raises(ValueError, match=rf"layers\[{i}\]\S* ?{message}"):
            _core.DecoderStack(bad, **kw)
    other = next(j for j, e in enumerate(layers) if j != i and e.get("mamba_state") is not None)
    shared = [dict(e) for e in layers]
    shared[other]["mamba_state"] = d["mamba_state"]
    with pytest.raises(ValueError, match="its KV cache or state shares memory"):
        _core.DecoderStack(shared, **kw)
