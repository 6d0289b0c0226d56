"""Hybrid recurrent families against transformers: Qwen3.5 (Gated DeltaNet
and gated attention) and LFM2 (short convolutions and attention), tiny
random models with the knobs that change the maths (layer patterns, value
heads sharing key heads, key and value head sizes apart, convolution widths
2-4, biases, partial rotary, tied and untied heads), saved with
``save_pretrained`` and loaded by fastllm's loader.

Float32 logits of mixed-length batches, prefilled in chunks split at odd
positions and then decoded, must match transformers' full forward pass of
each sequence alone (``tests/test_models.py``'s tolerance), on the packed
CPU path (the Rust kernels) and the torch path; greedy generation through
``LLM`` must give transformers' tokens and logprobs.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastllm.config import ModelConfig  # noqa: E402
from fastllm.layers.linear import pack_linears  # noqa: E402
from fastllm.layers.moe import SparseMoeBlock  # noqa: E402
from fastllm.layers.ops import RUST_OPS, TORCH_OPS, bind_ops  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402
from test_models import (  # noqa: E402
    VOCAB,
    _build,
    _one_thread,  # noqa: E402, F401 - autouse: one torch thread
    _reference,
    _sequences,
    check_greedy_generation,
)
from test_models import _assert_close_f32 as _close  # noqa: E402

transformers.logging.set_verbosity_error()

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _configs() -> dict[str, object]:
    t = transformers
    return {
        # Three DeltaNet layers then an attention layer (the default
        # pattern); two value heads per key head, Dk != Dv, 4 taps, a
        # quarter of each attention head rotated.
        "qwen3_5": t.Qwen3_5TextConfig(
            **COMMON,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
        ),
        # Attention first, one value head per key head, 2 taps, q/k/v/o
        # biases, half of each head rotated, tied embeddings.
        "qwen3_5_pattern": t.Qwen3_5TextConfig(
            **COMMON,
            head_dim=16,
            intermediate_size=80,
            num_hidden_layers=3,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=2,
            attention_bias=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=True,
        ),
        # One attention layer among convolutions; the MLP width adjusted
        # (2/3, rounded up to a multiple of 32).
        "lfm2": t.Lfm2Config(
            **COMMON,
            intermediate_size=120,
            num_hidden_layers=4,
            full_attn_idxs=[1],
            conv_L_cache=3,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.5,
        ),
        # Biased convolutions of 2 taps, two attention layers, the width as given.
        "lfm2_bias": t.Lfm2Config(
            **COMMON,
            intermediate_size=72,
            num_hidden_layers=3,
            layer_types=["full_attention", "conv", "full_attention"],
            conv_L_cache=2,
            conv_bias=True,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=False,
        ),
        # Qwen3.5-MoE: every MLP sparse (2 of 6 softmax experts, always
        # renormalised) with a gated shared expert of another width; the
        # DeltaNet shapes of "qwen3_5_pattern" with the default layer pattern.
        "qwen3_5_moe": t.Qwen3_5MoeTextConfig(
            **COMMON,
            head_dim=16,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            tie_word_embeddings=False,
        ),
        # LFM2-MoE: one dense layer first, then sparse ones (3 of 8 sigmoid
        # experts chosen with a random expert bias, renormalised, scaled).
        "lfm2_moe": t.Lfm2MoeConfig(
            **COMMON,
            intermediate_size=88,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "conv"],
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=3,
            routed_scaling_factor=1.7,
        ),
        # No expert bias, no renormalisation, every layer sparse, biased
        # convolutions of 2 taps, untied head.
        "lfm2_moe_plain": t.Lfm2MoeConfig(
            **COMMON,
            intermediate_size=72,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            layer_types=["full_attention", "conv", "conv"],
            conv_L_cache=2,
            conv_bias=True,
            num_dense_layers=0,
            num_experts=4,
            num_experts_per_tok=2,
            use_expert_bias=False,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        # Granite 4.0's hybrids (granite-4.0-h-*): Mamba-2 layers around an
        # attention layer with rotary, Granite's multipliers, 4 heads of 32
        # channels in 2 groups of B/C, 8 states, 4 taps with a bias, the
        # dense shared MLP, an untied head; transformers' scan in chunks of 8.
        "granite4_h": t.GraniteMoeHybridConfig(
            **COMMON,
            intermediate_size=96,
            shared_intermediate_size=96,
            num_hidden_layers=4,
            layer_types=["mamba", "mamba", "attention", "mamba"],
            position_embedding_type="rope",
            embedding_multiplier=12.0,
            attention_multiplier=0.03,
            residual_multiplier=0.4,
            logits_scaling=4.0,
            num_local_experts=0,
            mamba_n_heads=4,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
            pad_token_id=0,
            tie_word_embeddings=False,
        ),
        # ... with experts (granite-4.0-h-tiny's layout: 2 of 4 softmax
        # experts beside the shared MLP of another width), no rotary, 8 heads
        # of 8 channels in one group, 16 states, 3 unbiased taps, biased
        # projections, time steps clamped, a tied head.
        "granite4_h_moe": t.GraniteMoeHybridConfig(
            **COMMON,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_hidden_layers=3,
            layer_types=["attention", "mamba", "mamba"],
            position_embedding_type=None,
            embedding_multiplier=6.0,
            attention_multiplier=0.05,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=3,
            mamba_expand=1,
            mamba_conv_bias=False,
            mamba_proj_bias=True,
            mamba_chunk_size=16,
            time_step_limit=(0.0, 1.5),
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
    }


CONFIGS = _configs()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for name, config in CONFIGS.items():
        folder = str(tmp_path_factory.mktemp(name))
        out[name] = (folder, _build("", folder, 0, config))
    return out


def _load(folder: str, rust: bool) -> torch.nn.Module:
    model = load_model(ModelConfig.from_pretrained(folder), folder, torch.float32, "cpu")
    if rust:
        pack_linears(model)
    else:
        bind_ops(model, TORCH_OPS)
    return model


def _expert_biases(model, ref_model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The expert-selection biases of a loaded model and of its transformers
    reference (LFM2-MoE's ``expert_bias`` buffers), in layer order."""
    ours = [
        m.selection_bias
        for m in model.modules()
        if isinstance(m, SparseMoeBlock) and m.selection_bias is not None
    ]
    theirs = [b for n, b in ref_model.named_buffers() if n.endswith("expert_bias")]
    return ours, theirs


def _chunked_then_decode(
    model: torch.nn.Module, seqs: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Logits of every position: each prompt but its last 3 tokens in two
    chunks (split at an odd position), batched, then those tokens decoded
    one step at a time."""
    runner = PagedRunner(model, dtype)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    cuts = [max(1, (len(s) - 3) // 2) | 1 for s in seqs]
    first = runner.step([(i, s[: min(c, len(s) - 3)]) for i, (s, c) in enumerate(zip(seqs, cuts))])
    second = [(i, s[min(c, len(s) - 3) : -3]) for i, (s, c) in enumerate(zip(seqs, cuts))]
    rest = runner.step([(i, t) for i, t in second if t])
    rest_iter = iter(rest)
    for i, t in second:
        out[i].append(first[i])
        if t:
            out[i].append(next(rest_iter))
    for t in (3, 2, 1):
        for i, logits in enumerate(runner.step([(i, [s[-t]]) for i, s in enumerate(seqs)])):
            out[i].append(logits)
    return [torch.cat(parts) for parts in out]


@pytest.mark.parametrize("rust", [True, False], ids=["rust", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, rust: bool, saved: dict) -> None:
    folder, ref_model = saved[name]
    seqs = _sequences(1, [14, 9, 21, 5])
    ref = _reference(ref_model, seqs)
    model = _load(folder, rust)
    assert model.recurrent_layers()
    assert all(m.ops is (RUST_OPS if rust else TORCH_OPS) for m in model.recurrent_layers())
    for i, (ours, expected) in enumerate(zip(_chunked_then_decode(model, seqs), ref, strict=True)):
        _close(ours, expected, f"{name} sequence {i}")


def test_long_prompt_uses_every_kernel_form(saved: dict) -> None:
    """A 150-token prompt in one step (the delta rule's chunked form) and in
    one-token steps (its recurrent form) both match transformers."""
    folder, ref_model = saved["qwen3_5"]
    (seq,) = _sequences(2, [150])
    (ref,) = _reference(ref_model, [seq])
    model = _load(folder, True)
    runner = PagedRunner(model, torch.float32, num_blocks=128)
    (whole,) = runner.step([(0, seq)])
    _close(whole, ref, "one step")
    runner = PagedRunner(model, torch.float32, num_blocks=128)
    steps = [runner.step([(0, [t])])[0] for t in seq[:40]]
    _close(torch.cat(steps), ref[:40], "token by token")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name: str, saved: dict) -> None:
    folder, ref_model = saved[name]
    check_greedy_generation(folder, ref_model, name)


def test_each_option_matters(saved: dict) -> None:
    """The options are read, not ignored: changing the layer pattern or the
    convolution width changes transformers' logits, and fastllm follows."""
    import copy

    for name, change in (
        ("qwen3_5", {"layer_types": ["linear_attention", "full_attention"] * 2}),
        ("lfm2", {"layer_types": ["conv", "conv", "full_attention", "conv"]}),
        ("qwen3_5_moe", {"num_experts_per_tok": 3}),
        ("lfm2_moe", {"routed_scaling_factor": 1.0}),
        ("lfm2_moe", {"num_dense_layers": 2}),
        ("lfm2_moe", {"norm_topk_prob": False}),
        ("granite4_h", {"layer_types": ["linear_attention"] * 2 + ["full_attention"] * 2}),
        ("granite4_h", {"time_step_limit": (0.0, 0.5)}),
        ("granite4_h", {"mamba_n_groups": 1}),
        ("granite4_h_moe", {"num_experts_per_tok": 3}),
        ("granite4_h_moe", {"position_embedding_type": "rope"}),
    ):
        folder, ref_model = saved[name]
        seqs = _sequences(4, [12])
        base = _reference(ref_model, seqs)[0]
        config = copy.deepcopy(CONFIGS[name])
        for k, v in change.items():
            setattr(config, k, v)
        other = _build("", folder + "-changed", 0, config)
        ref = _reference(other, seqs)[0]
        assert (ref - base).abs().max() > 1e-3, change
        ours = _chunked_then_decode(_load(folder + "-changed", True), seqs)[0]
        _close(ours, ref, f"{name} with {change}")


def test_expert_bias_chooses_the_experts(saved: dict) -> None:
    """LFM2-MoE's ``expert_bias`` changes which experts a token takes (and so
    transformers' logits): zeroing it in the checkpoint moves fastllm's
    logits the same way."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, ref_model = saved["lfm2_moe"]
    seqs = _sequences(21, [12])
    dst = folder + "-no-bias"
    shutil.copytree(folder, dst)
    state = load_file(f"{dst}/model.safetensors")
    biases = [k for k in state if k.endswith("expert_bias")]
    assert len(biases) == 3  # the three sparse layers
    for k in biases:
        state[k] = torch.zeros_like(state[k])
    save_file(state, f"{dst}/model.safetensors", metadata={"format": "pt"})
    import copy

    unbiased = copy.deepcopy(ref_model)
    for layer in unbiased.model.layers[1:]:
        layer.feed_forward.expert_bias.zero_()
    base, ref = _reference(ref_model, seqs)[0], _reference(unbiased, seqs)[0]
    assert (ref - base).abs().max() > 1e-3
    _close(_chunked_then_decode(_load(dst, True), seqs)[0], ref, "lfm2_moe without expert bias")


@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2_moe"])
def test_stacked_expert_checkpoint(name: str, tmp_path, saved: dict) -> None:
    """Experts stored stacked, as transformers 5 holds them
    (``experts.gate_up_proj`` [experts, 2 x inter, hidden], ``down_proj``
    [experts, hidden, inter]), load as the same model."""
    from safetensors.torch import load_file, save_file

    folder, ref_model = saved[name]
    block, names = ("mlp", ("gate_proj", "up_proj", "down_proj"))
    if name.startswith("lfm2"):
        block, names = ("feed_forward", ("w1", "w3", "w2"))
    state = load_file(f"{folder}/model.safetensors")
    n = CONFIGS[name].num_experts
    for i in range(CONFIGS[name].num_hidden_layers):
        p = f"model.layers.{i}.{block}.experts"
        if f"{p}.0.{names[0]}.weight" not in state:
            continue  # a dense layer
        w = [[state.pop(f"{p}.{j}.{k}.weight") for j in range(n)] for k in names]
        state[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w[0], w[1], strict=True)]
        )
        state[f"{p}.down_proj"] = torch.stack(w[2])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{folder}/config.json").read())
    seqs = _sequences(5, [9])
    ours = _chunked_then_decode(_load(str(tmp_path), True), seqs)[0]
    _close(ours, _reference(ref_model, seqs)[0], f"{name}, stacked experts")


def test_bad_hybrid_config(tmp_path, saved: dict) -> None:
    import json
    import shutil

    folder, _ = saved["qwen3_5"]
    for change, needle in (
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ):
        dst = tmp_path / needle / str(len(str(change)))
        shutil.copytree(folder, dst)
        config = json.loads((dst / "config.json").read_text())
        config.update(change)
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=needle):
            load_model(ModelConfig.from_pretrained(str(dst)), str(dst), torch.float32, "cpu")


def test_bad_granite4_config(tmp_path, saved: dict) -> None:
    """Granite 4.0's Mamba-2 fields that cannot describe a model are load
    errors naming the field."""
    import json
    import shutil

    folder, _ = saved["granite4_h"]
    for i, (change, needle) in enumerate(
        (
            ({"layer_types": ["mamba", "conv", "attention", "mamba"]}, "layer_types"),
            ({"layer_types": ["mamba", "attention"]}, "layer_types"),
            ({"mamba_n_heads": 3}, "mamba_n_heads"),
            ({"mamba_n_groups": 3}, "mamba_n_groups"),
            ({"mamba_d_head": 8}, "mamba_d_head"),
            ({"mamba_d_state": 0}, "mamba_d_state"),
            ({"hidden_act": "gelu"}, "hidden_act"),
            ({"time_step_limit": [0.0]}, "time_step_limit"),
            ({"shared_intermediate_size": None}, "shared_intermediate_size"),
        )
    ):
        dst = tmp_path / str(i)
        shutil.copytree(folder, dst)
        config = json.loads((dst / "config.json").read_text())
        config.update(change)
        if change == {"shared_intermediate_size": None}:
            del config["shared_intermediate_size"]
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=needle):
            load_model(ModelConfig.from_pretrained(str(dst)), str(dst), torch.float32, "cpu")


def build_multimodal(name: str, folder: str, tie: bool, seed: int = 3):
    """Saves a ``Qwen3_5ForConditionalGeneration`` (``name`` "qwen3_5") or
    ``Qwen3_5MoeForConditionalGeneration`` ("qwen3_5_moe") checkpoint of
    ``CONFIGS[name]`` with a small vision tower to ``folder`` (the head tied by
    the top-level flag ``tie``); returns the float32 reference model."""
    text = CONFIGS[name].to_dict()
    text["tie_word_embeddings"] = not tie  # the top level decides
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    moe = name.endswith("moe")
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    ref_model = model_class(config)
    from test_models import _randomize

    _randomize(ref_model, seed)
    ref_model = ref_model.float().eval()
    ref_model.save_pretrained(folder)
    return ref_model


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("tie", [False, True])
def test_multimodal_checkpoint_runs_its_text_model(tmp_path, tie: bool, name: str) -> None:
    """A ``Qwen3_5ForConditionalGeneration`` (or ``Qwen3_5MoeFor...``) folder
    (a vision tower beside the text model under ``model.language_model``;
    the head tied by the top-level flag) runs as its text model, equal to
    transformers on text."""
    ref_model = build_multimodal(name, str(tmp_path), tie)
    seqs = _sequences(11, [10, 6])
    ref = _reference(ref_model, seqs)
    model = _load(str(tmp_path), True)
    assert (model.lm_head is None) == tie
    for i, (ours, expected) in enumerate(zip(_chunked_then_decode(model, seqs), ref, strict=True)):
        _close(ours, expected, f"multimodal text part, sequence {i}")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "granite4_h"])
def test_quantized_match_the_quantized_reference(name: str, quantization: str, saved: dict) -> None:
    """``quantization="int8"/"int4"``: every projection of the recurrent and
    attention layers runs the integer kernels, and the logits are those of
    the reference holding the same weights quantized and dequantized, within
    ``tests/test_models.py``'s bound for the families (the kernels' 8-bit
    activations)."""
    from fastllm import _core
    from fastllm.layers.quantization import QUANTIZATION_FORMATS, quantize_model
    from test_models import _fake_quantized

    folder, ref_model = saved[name]
    fmt = QUANTIZATION_FORMATS[quantization]
    model = _load(folder, rust=False)
    bind_ops(model, RUST_OPS)
    quantize_model(model, fmt, VOCAB)
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(isinstance(m.packed, _core.QuantizedLinear) for m in linears)
    seqs = _sequences(15, [12, 9])
    ours = torch.cat(_chunked_then_decode(model, seqs))
    ref = torch.cat(_reference(ref_model, seqs))
    same_weights = torch.cat(_reference(_fake_quantized(ref_model, fmt), seqs))
    moved = (same_weights - ref).abs().max().item()
    err = (ours - same_weights).abs().max().item()
    # The kernels quantize activations to 8 bits at every projection (four
    # per DeltaNet layer), an error floor of about a tenth of the logit
    # scale on these tiny models whatever the weights' format (int4's error
    # to its own reference is no larger than int8's), so the floor is 15%.
    share = 1.5 if quantization == "int8" else 1 / 3
    assert err <= max(share * moved, 0.15 * ref.abs().max().item()), (err, moved)
    assert (ours.argmax(-1) == same_weights.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2_moe", "granite4_h_moe"])
def test_quantized_experts_run_the_integer_kernels(name: str, saved: dict) -> None:
    """``quantization="int8"`` on the hybrid MoE families: every expert (and
    the shared expert) is a ``QuantizedLinear``, the router and LFM2-MoE's
    selection bias stay float32, and the logits stay close to the float
    model's: the median position within the 15% floor of
    ``test_quantized_match_the_quantized_reference`` (8-bit activations at
    every projection of these tiny models; a near-tied expert choice may
    flip at some positions, moving them further)."""
    from fastllm import _core
    from fastllm.layers.quantization import QUANTIZATION_FORMATS, quantize_model

    folder, ref_model = saved[name]
    model = _load(folder, rust=False)
    bind_ops(model, RUST_OPS)
    quantize_model(model, QUANTIZATION_FORMATS["int8"], VOCAB)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        experts = list(block.experts) + [e for e in (block.shared_expert,) if e is not None]
        for e in experts:
            assert isinstance(e.gate_up_proj.packed, _core.QuantizedLinear)
            assert isinstance(e.down_proj.packed, _core.QuantizedLinear)
        assert block.gate.weight.dtype == torch.float32
        assert block.selection_bias is None or block.selection_bias.dtype == torch.float32
        assert block.packed_kernel() is not None
    seqs = _sequences(4, [10, 7])
    ours = torch.cat(_chunked_then_decode(model, seqs))
    ref = torch.cat(_reference(ref_model, seqs))
    err = (ours - ref).abs().amax(-1)
    assert err.median() <= 0.15 * ref.abs().max(), err.tolist()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("rust", [True, False], ids=["rust", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_close_to_float32_reference(name: str, rust: bool, saved: dict) -> None:
    """bfloat16 weights and activations (the delta rule's state stays float32):
    within 3% of the logit scale, or 1.5x transformers' own bfloat16 error,
    of the float32 reference, as every family (``tests/test_models.py``)."""
    import copy

    folder, ref_model = saved[name]
    seqs = _sequences(4, [9, 16, 3])
    expected = torch.cat(_reference(ref_model, seqs))
    model = load_model(ModelConfig.from_pretrained(folder), folder, torch.bfloat16, "cpu")
    # LFM2-MoE's expert_bias stays float32 in a bfloat16 model, bit for bit
    # the checkpoint's (transformers keeps that buffer in float32).
    ours_bias, theirs = _expert_biases(model, ref_model)
    assert len(ours_bias) == len(theirs)
    for a, b in zip(ours_bias, theirs, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), (a, b)
    if rust:
        pack_linears(model)
    else:
        bind_ops(model, TORCH_OPS)
    ours = torch.cat(_chunked_then_decode(model, seqs, torch.bfloat16))
    ref_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    own = (torch.cat(_reference(ref_bf16, seqs)) - expected).abs().max().item()
    tol = max(0.03 * expected.abs().max().item(), 1.5 * own)
    err = (ours - expected).abs().amax(-1)
    if "moe" in name:
        # A token whose k-th and (k+1)-th expert scores are nearly tied
        # (1e-4 apart on lfm2_moe_plain's layer 1, position 3) may take
        # the other expert under bfloat16 rounding, a jump of the logits
        # at that position only: nine positions in ten stay within the bound.
        assert (err <= tol).float().mean() >= 0.9, (name, err.tolist(), own)
    else:
        assert err.max() <= tol, (name, err.max().item(), own)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        # Qwen3.5 without layer_types: every full_attention_interval-th layer attends.
        ("qwen3_5", lambda c: (c.pop("layer_types"), c.update(full_attention_interval=4))),
        # LFM2's first configs: tie_embedding and block_ff_dim, full_attn_idxs.
        (
            "lfm2",
            lambda c: (
                c.update(
                    tie_embedding=c.pop("tie_word_embeddings"),
                    block_ff_dim=c.pop("intermediate_size"),
                ),
                c.pop("layer_types"),
            ),
        ),
        # Granite 4.0 as its releases write it: layers_block_type of "mamba" and
        # "attention", time_step_limit with a JSON Infinity.
        (
            "granite4_h",
            lambda c: c.update(
                layers_block_type=[
                    "mamba" if "linear" in t else "attention" for t in c.pop("layer_types")
                ],
                time_step_limit=[0.0, float("inf")],
            ),
        ),
    ],
    ids=["qwen3_5-interval", "lfm2-old-names", "granite4-release-names"],
)
def test_config_layouts_without_layer_types(name: str, edit, saved: dict, tmp_path) -> None:
    """The same model described the other ways its configs are written loads
    as the same model: logits equal transformers' on the original folder."""
    import json
    import shutil

    folder, ref_model = saved[name]
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    seqs = _sequences(16, [11, 6])
    for i, (ours, expected) in enumerate(
        zip(_chunked_then_decode(_load(str(dst), True), seqs), _reference(ref_model, seqs))
    ):
        _close(ours, expected, f"{name} sequence {i}")
