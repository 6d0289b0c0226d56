"""Every decoder family at shapes its other tests do not build, against transformers.

The family tests (``test_models.py``, ``test_moe_models.py``,
``test_hybrid_models.py``) each fix one head size (16 or 64) and a few
options. Here a seeded generator draws, per family, the head size (16 to
256, also wider or narrower than hidden / heads), the heads and KV heads
(MQA to 4 queries a KV head), odd widths, the layer count and the family's
options (biases, tied heads, windows, layer patterns, rotary fractions,
routing, DeltaNet and convolution shapes); greedy generation through ``LLM``
in float32 must give transformers' tokens, and each step's top logprobs its
log-softmax (``check_greedy_generation``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models import (  # noqa: E402
    VOCAB,
    _build,
    _one_thread,  # noqa: F401 - autouse: one torch thread
    _sequences,
    check_greedy_generation,
)

transformers.logging.set_verbosity_error()


def _dims(rng: random.Random) -> dict[str, Any]:
    kv = rng.choice([1, 2, 3, 4])
    heads = kv * rng.choice([1, 2, 3, 4])
    return dict(
        vocab_size=VOCAB,
        hidden_size=heads * rng.choice([8, 16, 24, 32, 48]),
        intermediate_size=rng.choice([64, 96, 200, 256, 352]),
        num_hidden_layers=rng.choice([1, 2, 3]),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=rng.choice([16, 32, 48, 64, 80, 96, 128, 256]),
        max_position_embeddings=256,
    )


def _granite_rope(rng: random.Random) -> dict[str, Any]:
    """Granite's rotary: its base, plain or linearly scaled."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rng.choice([1e4, 1e7])}
    if rng.random() < 0.5:
        rope.update(rope_type="linear", factor=rng.choice([2.0, 4.0]))
    return rope


def _dense(family: str, rng: random.Random, c: dict[str, Any]) -> Any:
    t, coin = transformers, lambda p=0.5: rng.random() < p
    if family == "llama":
        return t.LlamaConfig(
            **c, attention_bias=coin(), mlp_bias=coin(), tie_word_embeddings=coin()
        )
    if family == "qwen3":
        return t.Qwen3Config(**c, tie_word_embeddings=coin(), attention_bias=coin())
    if family == "mistral":
        return t.MistralConfig(**c, sliding_window=rng.choice([None, 3, 7]))
    if family == "granite":
        mult = dict(embedding_multiplier=rng.uniform(1, 12), logits_scaling=rng.uniform(1, 8))
        mult.update(
            attention_multiplier=rng.uniform(0.01, 0.2), residual_multiplier=rng.uniform(0.1, 1)
        )
        return t.GraniteConfig(
            **c, **mult, attention_bias=coin(), mlp_bias=coin(), pad_token_id=0,
            tie_word_embeddings=coin(), rope_parameters=_granite_rope(rng),
        )  # fmt: skip
    if family == "granite4":  # attention-only, dense (granite-4.0-micro's layout)
        mult = dict(embedding_multiplier=rng.uniform(1, 12), logits_scaling=rng.uniform(1, 8))
        mult.update(
            attention_multiplier=rng.uniform(0.01, 0.2), residual_multiplier=rng.uniform(0.1, 1)
        )
        return t.GraniteMoeHybridConfig(
            **c, **mult, num_local_experts=0, shared_intermediate_size=c["intermediate_size"],
            layer_types=["attention"] * c["num_hidden_layers"],
            position_embedding_type=rng.choice(["rope", None]), attention_bias=coin(),
            mamba_n_heads=2, mamba_d_head="auto", pad_token_id=0,
            tie_word_embeddings=coin(), rope_parameters=_granite_rope(rng),
        )  # fmt: skip
    if family == "phi3":
        c.pop("head_dim")
        c["hidden_size"] = c["num_attention_heads"] * rng.choice([16, 32, 64])
        return t.Phi3Config(
            **c,
            partial_rotary_factor=rng.choice([0.5, 0.75, 1.0]),
            sliding_window=rng.choice([None, 5, 9]),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=coin(),
        )
    if family == "olmo2":
        return t.Olmo2Config(**c, attention_bias=coin(), pad_token_id=0)
    layers = c["num_hidden_layers"] = rng.choice([2, 3, 4])
    kinds = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(layers)]
    window = rng.choice([3, 5, 9])
    if family == "smollm3":
        nope = [rng.choice([0, 1]) for _ in range(layers)]
        return t.SmolLM3Config(
            **c, no_rope_layers=nope, use_sliding_window=True, sliding_window=window,
            layer_types=kinds, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    if family == "gemma2":
        return t.Gemma2Config(
            **c,
            query_pre_attn_scalar=rng.choice([16, 48, 256]),
            sliding_window=window,
            attn_logit_softcapping=rng.choice([None, 2.0, 50.0]),
            final_logit_softcapping=rng.choice([None, 3.0, 30.0]),
            pad_token_id=0,
        )
    full = rng.choice(
        [
            {"rope_type": "default", "rope_theta": 10000.0},
            {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        ]
    )
    local = {"rope_type": "default", "rope_theta": rng.choice([100.0, 10000.0])}
    return t.Gemma3TextConfig(  # gemma3
        **c,
        layer_types=kinds,
        sliding_window=window,
        query_pre_attn_scalar=rng.choice([16, 48, 256]),
        final_logit_softcapping=rng.choice([None, 3.0]),
        attn_logit_softcapping=rng.choice([None, 5.0]),
        rope_parameters={"full_attention": full, "sliding_attention": local},
        attention_bias=coin(0.3),
        pad_token_id=0,
    )


def _moe(family: str, rng: random.Random, c: dict[str, Any]) -> Any:
    t, coin = transformers, lambda: rng.random() < 0.5
    experts = rng.choice([2, 4, 5, 8])
    route = dict(num_experts_per_tok=rng.randint(1, experts))
    c["intermediate_size"] = rng.choice([32, 48, 96])
    if family == "qwen3_moe":
        dense = [i for i in range(c["num_hidden_layers"]) if rng.random() < 0.3]
        return t.Qwen3MoeConfig(
            **c, **route, num_experts=experts, moe_intermediate_size=rng.choice([16, 24, 64]),
            norm_topk_prob=coin(), decoder_sparse_step=rng.choice([1, 2]),
            mlp_only_layers=dense, tie_word_embeddings=coin(),
        )  # fmt: skip
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(
            **c, **route, num_experts=experts, moe_intermediate_size=rng.choice([16, 24, 64]),
            shared_expert_intermediate_size=rng.choice([16, 40, 64]), norm_topk_prob=coin(),
            decoder_sparse_step=rng.choice([1, 2]), tie_word_embeddings=False,
        )  # fmt: skip
    if family == "mixtral":
        window = rng.choice([None, 4, 8])
        return t.MixtralConfig(**c, **route, num_local_experts=experts, sliding_window=window)
    if family == "olmoe":  # its q norm spans hidden_size: heads of hidden / heads
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
        clip = rng.choice([None, 0.5, 2.0])
        return t.OlmoeConfig(
            **c, **route, num_experts=experts, norm_topk_prob=coin(), clip_qkv=clip
        )
    if family == "granitemoe":
        mult = dict(embedding_multiplier=rng.uniform(1, 8), logits_scaling=rng.uniform(1, 5))
        mult.update(
            attention_multiplier=rng.uniform(0.05, 0.5), residual_multiplier=rng.uniform(0.2, 1)
        )
        return t.GraniteMoeConfig(**c, **route, num_local_experts=experts, **mult)
    kinds = [
        rng.choice(["sliding_attention", "full_attention"]) for _ in range(c["num_hidden_layers"])
    ]
    return t.GptOssConfig(  # gpt_oss
        **c, **route, num_local_experts=experts, sliding_window=rng.choice([3, 6, 10]),
        swiglu_limit=rng.choice([0.5, 7.0]), layer_types=kinds, tie_word_embeddings=coin(),
    )  # fmt: skip


def _hybrid(family: str, rng: random.Random, c: dict[str, Any]) -> Any:
    t, coin = transformers, lambda: rng.random() < 0.5
    layers = c["num_hidden_layers"] = rng.choice([2, 3, 4])
    # one attention layer at least: transformers' generate needs one
    attention = rng.randrange(layers)
    if family.startswith("qwen3_5"):
        key_heads = rng.choice([1, 2, 3])
        kinds = [rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
        kinds[attention] = "full_attention"
        extra = dict(
            layer_types=kinds,
            linear_num_key_heads=key_heads,
            linear_num_value_heads=key_heads * rng.choice([1, 2]),
            linear_key_head_dim=rng.choice([8, 16, 32]),
            linear_value_head_dim=rng.choice([8, 16, 32]),
            linear_conv_kernel_dim=rng.choice([2, 3, 4]),
            attention_bias=coin(),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000.0,
                "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
            },
            tie_word_embeddings=coin(),
        )
        if family == "qwen3_5":
            return t.Qwen3_5TextConfig(**c, **extra)
        experts = rng.choice([2, 4, 6])
        c.pop("intermediate_size")
        return t.Qwen3_5MoeTextConfig(
            **c, **extra, num_experts=experts, num_experts_per_tok=rng.randint(1, experts),
            moe_intermediate_size=rng.choice([16, 24]),
            shared_expert_intermediate_size=rng.choice([16, 40]),
        )  # fmt: skip
    if family == "granite4_h":  # Mamba-2 and attention layers (granite-4.0-h-*)
        kinds = [rng.choice(["mamba", "attention"]) for _ in range(layers)]
        kinds[attention] = "attention"
        inner = c["hidden_size"] * rng.choice([1, 2])
        heads = rng.choice([h for h in (1, 2, 3, 4, 6, 8, 12, 16) if inner % h == 0])
        experts = rng.choice([0, 0, 2, 4, 6])
        mult = dict(embedding_multiplier=rng.uniform(1, 12), logits_scaling=rng.uniform(1, 8))
        mult.update(
            attention_multiplier=rng.uniform(0.01, 0.2), residual_multiplier=rng.uniform(0.1, 1)
        )
        return t.GraniteMoeHybridConfig(
            **c, **mult, layer_types=kinds, shared_intermediate_size=rng.choice([32, 48, 96]),
            num_local_experts=experts, num_experts_per_tok=rng.randint(1, max(experts, 1)),
            position_embedding_type=rng.choice(["rope", None]), attention_bias=coin(),
            mamba_n_heads=heads, mamba_n_groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0]),
            mamba_d_state=rng.choice([4, 8, 16, 32, 64]), mamba_d_conv=rng.choice([2, 3, 4]),
            mamba_expand=inner // c["hidden_size"], mamba_conv_bias=coin(), mamba_proj_bias=coin(),
            mamba_chunk_size=rng.choice([4, 16, 64]), pad_token_id=0, tie_word_embeddings=coin(),
            rope_parameters=_granite_rope(rng),
        )  # fmt: skip
    c.pop("head_dim")
    kinds = [rng.choice(["conv", "full_attention"]) for _ in range(layers)]
    kinds[attention] = "full_attention"
    extra = dict(
        layer_types=kinds,
        conv_L_cache=rng.choice([2, 3, 4]),
        conv_bias=coin(),
        tie_word_embeddings=coin(),
    )
    if family == "lfm2":
        return t.Lfm2Config(
            **c, **extra, block_auto_adjust_ff_dim=coin(), block_multiple_of=32,
            block_ffn_dim_multiplier=rng.choice([1.0, 1.5]),
        )  # fmt: skip
    experts = rng.choice([2, 4, 8])
    return t.Lfm2MoeConfig(
        **c, **extra, moe_intermediate_size=rng.choice([16, 24]),
        num_dense_layers=rng.choice([0, 1]), num_experts=experts,
        num_experts_per_tok=rng.randint(1, experts), use_expert_bias=coin(),
        norm_topk_prob=coin(), routed_scaling_factor=rng.choice([1.0, 1.7]),
    )  # fmt: skip


DENSE = [
    "llama", "qwen3", "mistral", "granite", "granite4", "phi3", "olmo2", "smollm3", "gemma2",
    "gemma3",
]  # fmt: skip
MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss"]
HYBRID = ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "granite4_h"]


def draw_config(family: str, rng: random.Random) -> Any:
    """A transformers config of ``family`` at shapes and options drawn by ``rng``."""
    maker = _dense if family in DENSE else _moe if family in MOE else _hybrid
    return maker(family, rng, _dims(rng))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", DENSE + MOE + HYBRID)
def test_drawn_shapes_generate_as_transformers(tmp_path, family: str, seed: int) -> None:
    rng = random.Random(f"{family}-{seed}")
    config = draw_config(family, rng)
    model = _build(family, str(tmp_path), seed=seed, config=config)
    # greedy to 8 tokens whatever they are: no end-of-sequence token on either side
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    check_greedy_generation(str(tmp_path), model, f"{family} {config.to_dict()}")


@pytest.mark.parametrize("family", HYBRID)
def test_recurrent_layers_only(tmp_path, family: str) -> None:
    """A hybrid with no attention layer at all: its KV blocks hold nothing
    (the cache plan divided by their size of 0 bytes), and greedy generation
    gives the tokens of transformers' forward pass over each whole sequence
    (its ``generate`` needs an attention layer, so the reference runs without
    a cache)."""
    from fastllm import LLM, SamplingParams

    rng = random.Random(f"{family}-recurrent")
    config = _hybrid(family, rng, _dims(rng))
    recurrent = {"qwen3_5": "linear_attention", "lfm2": "conv", "granite4_h": "linear_attention"}
    config.layer_types = [recurrent[family.removesuffix("_moe")]] * config.num_hidden_layers
    model = _build(family, str(tmp_path), seed=3, config=config)
    prompts = _sequences(5, [6, 11, 3])
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                logits = model(torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt) :], family


def test_granite4_runs_fused_where_the_stack_implements_it(tmp_path) -> None:
    """Granite 4.0's models, attention-only, hybrid, and hybrid with experts
    (the dense MLP as their ungated shared expert), run on the fused CPU
    stack; a model without attention layers runs layer by layer, the reason
    named."""
    from fastllm import LLM
    from fastllm.models import llama_stack

    for family, kinds, experts, reason in (
        ("granite4", ["full_attention"] * 2, 0, None),
        ("granite4_h", ["linear_attention", "full_attention"], 0, None),
        ("granite4_h", ["full_attention", "linear_attention"], 4, None),
        ("granite4_h", ["linear_attention"] * 2, 0, "the model has no attention layer"),
    ):
        rng = random.Random(f"{family}-fused")
        config = draw_config(family, rng)
        config.num_hidden_layers, config.layer_types = 2, kinds
        config.num_local_experts, config.num_experts_per_tok = experts, 2
        folder = tmp_path / f"{family}-{experts}"
        _build(family, str(folder), seed=0, config=config)
        llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
        model = llm.llm_engine.runner.model
        assert (model.decoder_stack is not None) == (reason is None), family
        if reason is not None:
            assert llama_stack.why_not(model).startswith(reason)
