"""The 8-bit KV cache (``kv_cache_dtype="int8"``) against independent references.

* The cache write: the Rust kernel stores exactly the bytes of the torch
  reference quantizer (``attention_torch.quantize_rows``: int8 values, then
  the row's float32 scale ``max|x| / 127``).
* The attention read: the Rust kernel on an int8 cache against float32 SDPA
  over the dequantized rows and the query rows quantized the same way
  (``test_attention.reference_attention``, ``attention_torch.quantized_queries``),
  so the only difference is summation order (float32 tolerance).
* The torch backend and the Rust backend of ``PagedAttention`` write the
  same cache bytes and agree on the output.
* The engine: int8 caches take 0.5x (+ the scales) the bytes of bf16 ones,
  the fused decoder stack and the per-layer ops agree, and the trained demo
  model's perplexity on text it never saw stays within 0.5% of the float
  cache's.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm import LLM, SamplingParams, _core
from fastllm.demo import demo_model_path
from fastllm.engine.model_runner import ModelRunner
from fastllm.layers.attention_torch import (
    INT8_SCALE_BYTES,
    dequantize_rows,
    quantize_rows,
    quantized_queries,
)
from fastllm.layers.ops import RUST_OPS, TORCH_OPS
from test_attention import (
    TOL,
    TORCH_TOL,
    attention_cases,
    make_batch,
    reference_attention,
    run_layer,
    sinks_layer,
)
from test_quantization import prompt_logprobs


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 24),
    kv_heads=st.integers(1, 3),
    head_size=st.sampled_from([8, 64, 80, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cache_write_stores_the_reference_bytes(
    tokens, kv_heads, head_size, dtype, magnitude, seed
):
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 16
    k = (torch.randn(tokens, kv_heads, head_size, generator=gen) * magnitude).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_size, generator=gen) * magnitude).to(dtype)
    k[0, 0] = 0  # a row of zeros: scale 0
    shape = (num_blocks, kv_heads, block_size, head_size + INT8_SCALE_BYTES)
    kc = torch.full(shape, 7, dtype=torch.int8)
    vc = torch.full(shape, 7, dtype=torch.int8)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[-1] = -1 if tokens > 1 else slots[-1]  # a skipped token
    _core.reshape_and_cache(k, v, kc, vc, slots.to(torch.int64))
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        assert torch.equal(kc[b, :, o], quantize_rows(k[t])), (t, slot)
        assert torch.equal(vc[b, :, o], quantize_rows(v[t])), (t, slot)
    assert torch.equal(dequantize_rows(quantize_rows(k[0, :1]))[0], torch.zeros(head_size))
    # Values within half a step of the input (the scale's rounding aside).
    back = dequantize_rows(quantize_rows(k.float()))
    step = k.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - k.float()).abs() <= step * 0.5001 + 1e-37).all()


@settings(max_examples=40, deadline=None)
@given(attention_cases())
def test_attention_over_int8_cache_matches_sdpa_of_dequantized_rows(case):
    gen = torch.Generator().manual_seed(case.pop("seed"))
    window, softcap = case.pop("window"), case.pop("softcap")
    query, key_cache, value_cache, block_tables, seq_lens, qsl = make_batch(gen, **case)
    kc, vc = quantize_rows(key_cache), quantize_rows(value_cache)
    scale = 1.0 / math.sqrt(case["head_size"])
    got = torch.full_like(query, float("nan"))
    _core.paged_attention(got, query, kc, vc, block_tables, seq_lens, qsl, scale, window, softcap)
    # Against an 8-bit cache the query rows are quantized as its rows are.
    want = reference_attention(
        quantized_queries(query.float()),
        dequantize_rows(kc),
        dequantize_rows(vc),
        block_tables,
        seq_lens,
        qsl,
        scale,
        window,
        softcap,
    )
    assert got.dtype == case["dtype"]
    torch.testing.assert_close(got.float(), want, **TOL[case["dtype"]])


@settings(max_examples=25, deadline=None)
@given(attention_cases())
def test_rust_and_torch_backends_agree_on_int8_caches(case):
    """Each backend writes the step's K/V into its own int8 cache through
    ``PagedAttention.forward``: same bytes, outputs within the torch
    backend's tolerance."""
    gen = torch.Generator().manual_seed(case.pop("seed"))
    window, softcap = case.pop("window"), case.pop("softcap")
    query, key_cache, value_cache, block_tables, seq_lens, qsl = make_batch(gen, **case)
    block_tables = block_tables.clamp(min=0)  # the engine pads tables with block 0
    outs, caches = [], []
    for ops in (RUST_OPS, TORCH_OPS):
        kc, vc = quantize_rows(key_cache), quantize_rows(value_cache)
        layer = sinks_layer(case, window, softcap, None, kc, vc)
        outs.append(
            run_layer(layer, ops, query, block_tables, seq_lens, qsl, (key_cache, value_cache))
        )
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outs[1].double(), outs[0].double(), **TORCH_TOL[case["dtype"]])


def test_errors_name_the_argument():
    kc = torch.zeros(4, 1, 4, 8 + INT8_SCALE_BYTES, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="value"):
        _core.reshape_and_cache(
            k, torch.zeros(1, 1, 8, dtype=torch.bfloat16), kc, vc, torch.zeros(1, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match=r"head_size \+ 4"):
        tiny = torch.zeros(4, 1, 4, 4, dtype=torch.int8)
        _core.reshape_and_cache(k, k, tiny, tiny.clone(), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(demo_model_path(), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        LLM(demo_model_path(), kv_cache_dtype="int4")


def test_int8_cache_takes_about_half_the_bytes():
    for head_size in (64, 128):
        bf16 = ModelRunner.block_bytes(4, 8, head_size, 16, torch.bfloat16)
        int8 = ModelRunner.block_bytes(4, 8, head_size, 16, torch.bfloat16, "int8")
        assert int8 / bf16 == (head_size + 4) / (2 * head_size)
        assert abs(int8 / bf16 - 0.5) <= 0.05


def _held_out_ids(llm: LLM) -> list[int]:
    """Python source the demo model never trained on (its corpus excluded
    the standard library's tests), else a library module."""
    import textwrap

    lib = os.path.dirname(textwrap.__file__)
    for path in (os.path.join(lib, "test", "test_textwrap.py"), os.path.join(lib, "textwrap.py")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return llm.get_tokenizer().encode(f.read())[:1000]
    raise AssertionError("no standard-library source to score")


def test_engine_int8_cache_keeps_perplexity_and_fused_matches_layers():
    # Chunks of 128 tokens: later chunks read earlier ones from the cache.
    kw = dict(max_num_batched_tokens=128, max_num_seqs=4)
    base = LLM(demo_model_path(), **kw)
    ids = _held_out_ids(base)
    ppl_float = float(np.exp(-np.mean(prompt_logprobs(base, ids))))
    q8 = LLM(demo_model_path(), kv_cache_dtype="int8", **kw)
    runner = q8.llm_engine.runner
    assert runner.k_caches[0].dtype == torch.int8 and runner.fused_layers
    lp_fused = prompt_logprobs(q8, ids)
    ppl_int8 = float(np.exp(-np.mean(lp_fused)))
    assert ppl_int8 / ppl_float < 1.005, (ppl_float, ppl_int8)
    # The same steps through the per-layer Rust ops (no fused stack).
    runner.fused_layers = False
    lp_layers = prompt_logprobs(q8, ids)
    np.testing.assert_allclose(lp_layers, lp_fused, atol=2e-3)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["def parse(self, text):", "import os\nclass Cache:"]
    got = [o.outputs[0].token_ids for o in q8.generate(prompts, greedy, use_tqdm=False)]
    runner.fused_layers = True
    want = [o.outputs[0].token_ids for o in q8.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
