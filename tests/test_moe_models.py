"""Mixture-of-experts families against transformers: tiny random models with
the knobs that change routing (top-k 1-3 of 4-8 experts, ``norm_topk_prob``
both ways, shared experts, dense layers mixed in, sliding windows, clipped
q/k/v), saved with ``save_pretrained`` and loaded by fastllm's loader.

Float32 logits of mixed-length batches, prefilled and then decoded over the
paged cache, must match transformers' full forward pass of each sequence
alone (the tolerance of ``tests/test_models.py``), on the packed CPU path
(the Rust router and grouped-expert kernel) and the torch path; greedy
generation through ``LLM`` must give transformers' tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastllm import _core  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.layers.linear import pack_linears  # noqa: E402
from fastllm.layers.moe import SparseMoeBlock  # noqa: E402
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
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _configs() -> dict[str, object]:
    t = transformers
    return {
        # 8 experts, top 2 renormalised, a dense layer between sparse ones.
        "qwen3_moe": t.Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        # top 3 of 4 unnormalised, every second layer sparse.
        "qwen3_moe_step": t.Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
        # A gated shared expert; q/k/v biases.
        "qwen2_moe": t.Qwen2MoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        # Top 2 of 4, renormalised, a sliding window shorter than the prompts.
        "mixtral": t.MixtralConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
        # Top 1 of 5, whole-projection q/k norms, clipped q/k/v.
        "olmoe": t.OlmoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=5,
            num_experts_per_tok=1,
            clip_qkv=0.9,
        ),
        # Top 2 of 8, renormalised (OLMoE's other setting).
        "olmoe_norm": t.OlmoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        # Granite's four multipliers over top-2-of-4 routing, stacked experts.
        "granitemoe": t.GraniteMoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
            residual_multiplier=0.7,
            logits_scaling=3.0,
        ),
        # Sinks, sliding (window 6) and full layers alternating, a biased
        # router, experts with biases, the clamped SwiGLU clamping often.
        "gpt_oss": t.GptOssConfig(
            **COMMON,
            num_hidden_layers=3,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=6,
            swiglu_limit=0.6,
        ),
        # Top 1 of 4 (one expert's softmax weight is 1), the default SwiGLU limit.
        "gpt_oss_top1": t.GptOssConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=1,
            sliding_window=4,
        ),
    }


CONFIGS = _configs()


def build(config: object, folder: str, seed: int = 0) -> torch.nn.Module:
    """The reference model of ``config``, randomized and saved to ``folder``
    (``tests/test_models.py``'s builder)."""
    return _build("", folder, seed, config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for name, config in CONFIGS.items():
        folder = str(tmp_path_factory.mktemp(name))
        out[name] = (folder, build(config, folder))
    return out


def _load(folder: str, pack: bool) -> torch.nn.Module:
    model = load_model(ModelConfig.from_pretrained(folder), folder, torch.float32, "cpu")
    if pack:
        pack_linears(model)
    return model


def _prefill_then_decode(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position: the prompts but their last 3 tokens in one
    mixed-length step, then those tokens decoded one step at a time."""
    runner = PagedRunner(model, torch.float32)
    first = runner.step([(i, s[:-3]) for i, s in enumerate(seqs)])
    out = [[f] for f in first]
    for t in (3, 2, 1):
        for i, logits in enumerate(runner.step([(i, [s[-t]]) for i, s in enumerate(seqs)])):
            out[i].append(logits)
    return [torch.cat(parts) for parts in out]


@pytest.mark.parametrize("pack", [True, False], ids=["rust", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, pack: bool, saved: dict) -> None:
    folder, ref_model = saved[name]
    seqs = _sequences(1, [14, 9, 21, 5])
    ref = _reference(ref_model, seqs)
    model = _load(folder, pack)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for i, (ours, expected) in enumerate(zip(_prefill_then_decode(model, seqs), ref, strict=True)):
        _close(ours, expected, f"{name} sequence {i}")
    # The packed model ran the Rust kernel; the other never built it.
    assert all((b.kernel is not None) == pack for b in blocks)
    if pack:
        assert isinstance(blocks[0].kernel, _core.MoeBlock)


def test_each_routing_option_matters(saved: dict) -> None:
    """Flipping ``norm_topk_prob``, the top-k or the shared expert's gate
    changes the logits: the options are read, not ignored."""
    folder, ref_model = saved["qwen2_moe"]
    seqs = _sequences(2, [12])
    base = _reference(ref_model, seqs)[0]
    for change in ({"norm_topk_prob": True}, {"num_experts_per_tok": 3}):
        config = copy.deepcopy(CONFIGS["qwen2_moe"])
        for k, v in change.items():
            setattr(config, k, v)
        other = build(config, folder + "-changed")
        ref = _reference(other, seqs)[0]
        assert (ref - base).abs().max() > 1e-3, change
        ours = _prefill_then_decode(_load(folder + "-changed", True), seqs)[0]
        _close(ours, ref, f"qwen2_moe with {change}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name: str, saved: dict) -> None:
    folder, ref_model = saved[name]
    check_greedy_generation(folder, ref_model, name)


def test_quantized_experts_run_the_integer_kernels(saved: dict) -> None:
    """``quantization="int8"``: every expert is a ``QuantizedLinear`` and the
    router stays float; the logits stay close to the float model's."""
    from fastllm.layers.quantization import QUANTIZATION_FORMATS, quantize_model

    folder, ref_model = saved["qwen3_moe"]
    model = _load(folder, pack=False)
    quantize_model(model, QUANTIZATION_FORMATS["int8"], VOCAB)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert all(isinstance(e.gate_up_proj.packed, _core.QuantizedLinear) for e in block.experts)
    assert block.gate.weight is not None and block.gate.weight.dtype == torch.float32
    seqs = _sequences(4, [10, 7])
    ours = torch.cat(_prefill_then_decode(model, seqs))
    ref = torch.cat(_reference(ref_model, seqs))
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_stacked_expert_checkpoint(tmp_path, saved: dict) -> None:
    """Experts stored stacked (``mlp.experts.gate_up_proj`` [experts, 2 x inter,
    hidden], ``down_proj`` [experts, hidden, inter]) load as the same model."""
    from safetensors.torch import load_file, save_file

    folder, ref_model = saved["mixtral"]
    state = load_file(f"{folder}/model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for i in range(CONFIGS["mixtral"].num_hidden_layers):
        p = f"model.layers.{i}.block_sparse_moe"
        n = CONFIGS["mixtral"].num_local_experts
        w = [
            [state.pop(f"{p}.experts.{j}.{k}.weight") for j in range(n)] for k in ("w1", "w3", "w2")
        ]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w[0], w[1], strict=True)]
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(w[2])
        out[f"model.layers.{i}.mlp.gate.weight"] = state.pop(f"{p}.gate.weight")
    save_file({**state, **out}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{folder}/config.json").read())
    seqs = _sequences(5, [9])
    ours = _prefill_then_decode(_load(str(tmp_path), True), seqs)[0]
    _close(ours, _reference(ref_model, seqs)[0], "stacked experts")


def _mxfp4_checkpoint(folder: str, dst) -> None:
    """gpt-oss's ``folder`` saved as the released checkpoints are: every
    expert matrix in MXFP4 (quantized by the ``gguf`` package, then laid out
    as ``*_blocks`` [experts, rows, groups, 16], codes 2i / 2i + 1 in byte i's
    low / high nibble, and ``*_scales`` [experts, rows, groups] of E8M0
    exponents), ``quantization_config`` naming ``mxfp4``."""
    import json

    import numpy as np
    from safetensors.torch import load_file, save_file

    gguf = pytest.importorskip("gguf")
    state = load_file(f"{folder}/model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state.pop(name).transpose(1, 2).contiguous().numpy()  # [experts, out, in]
        q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)
        q = q.reshape(*rows.shape[:2], -1, 17)
        codes = np.concatenate([q[..., 1:] & 15, q[..., 1:] >> 4], axis=-1)  # 32 in order
        state[f"{name}_blocks"] = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))
        state[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads(open(f"{folder}/config.json").read())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_runs_its_experts_as_stored(tmp_path, saved: dict) -> None:
    """A gpt-oss checkpoint with MXFP4 experts (as released): every expert
    is a ``QuantizedLinear`` in ``mxfp4`` holding exactly the weights that
    transformers dequantizes from the same files (gate and up de-interleaved),
    and the logits stay close to transformers' on them (the experts' int8
    activations being the only difference)."""
    folder, _ = saved["gpt_oss"]
    _mxfp4_checkpoint(folder, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
    ).eval()
    model = _load(str(tmp_path), True)
    for i, layer in enumerate(model.model.layers):
        theirs = ref.model.layers[i].mlp.experts
        for j, expert in enumerate(layer.mlp.experts):
            for proj, want in (
                ("gate_up_proj", theirs.gate_up_proj[j].t()),
                ("down_proj", theirs.down_proj[j].t()),
            ):
                table = getattr(expert, proj).packed
                assert isinstance(table, _core.QuantizedLinear) and table.format == "mxfp4"
                rows = torch.empty(table.out_features, table.in_features)
                table.embed(rows, torch.arange(table.out_features))
                if proj == "gate_up_proj":
                    want = torch.cat([want[0::2], want[1::2]])
                assert torch.equal(rows, want), (i, j, proj)
            assert torch.equal(expert.gate_up_proj.bias, _deinterleaved(theirs, j))
    seqs = _sequences(6, [14, 9, 21])
    ours = torch.cat(_prefill_then_decode(model, seqs))
    want = torch.cat(_reference(ref, seqs))
    assert (ours - want).abs().max() <= 0.05 * want.abs().max()
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(
        ValueError, match="checkpoint's mxfp4 weights .* not on device 'meta': pass device='cpu'"
    ):
        load_model(ModelConfig.from_pretrained(str(tmp_path)), str(tmp_path), torch.float32, "meta")
    from fastllm import LLM
    from fastllm.loading import quantization_name

    llm = LLM(
        str(tmp_path),
        dtype="float32",
        quantization="int8",
        max_model_len=64,
        skip_tokenizer_init=True,
    )
    assert "quantization='mxfp4' (the checkpoint's experts, as stored), other layers " in repr(llm)
    assert quantization_name(llm.llm_engine.loaded) == "mxfp4+q8_0"


def _deinterleaved(experts, j: int) -> torch.Tensor:
    b = experts.gate_up_proj_bias[j]
    return torch.cat([b[0::2], b[1::2]])


def test_bad_moe_config(tmp_path, saved: dict) -> None:
    import json
    import shutil

    folder, _ = saved["qwen3_moe"]
    for change, needle in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers"),
    ):
        dst = tmp_path / needle / str(change[needle])
        shutil.copytree(folder, dst)
        config = json.loads((dst / "config.json").read_text())
        config.update(change)
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=needle):
            load_model(ModelConfig.from_pretrained(str(dst)), str(dst), torch.float32, "cpu")


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step", "qwen2_moe", "mixtral"])
def test_weights_per_token_count_the_experts_a_token_uses(name: str, saved: dict) -> None:
    """``mlp_weights_per_token`` (what ``fastllm bench`` divides the
    bandwidth by) against the model's own modules: each sparse layer's
    router, shared expert and ``top_k`` experts, each dense layer whole."""
    from fastllm.models.moe import mlp_weights_per_token

    folder, _ = saved[name]
    model = _load(folder, pack=False)
    expected = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            one = sum(p.numel() for p in mlp.experts[0].parameters())
            rest = [mlp.gate, mlp.shared_expert, mlp.shared_expert_gate]
            expected += mlp.top_k * one + sum(
                p.numel() for m in rest if m is not None for p in m.parameters()
            )
        else:
            expected += sum(p.numel() for p in mlp.parameters())
    assert mlp_weights_per_token(model.config) == expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_stack_takes_the_families_it_implements(name: str, saved: dict) -> None:
    """Qwen3-MoE, Qwen2-MoE, Mixtral, Granite MoE and gpt-oss (its sinks,
    windows and biased experts) run as one ``_core.DecoderStack`` once packed
    (their logits above came from it); the others say why they do not."""
    from fastllm.models.llama_stack import why_not

    folder, _ = saved[name]
    model = _load(folder, pack=True)
    runner = PagedRunner(model, torch.float32)  # gives the layers their caches
    reason = why_not(model)
    if name.startswith(("qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "gpt_oss")):
        assert reason is None and runner.fused
    else:
        assert reason is not None and "does not implement" in reason
