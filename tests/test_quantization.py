"""Quantized weights: the blocks against the ``gguf`` package (the GGUF
format's own Python implementation), the integer kernels on every path
against a numpy reference over those blocks, and whole models against their
float selves (perplexity on real text with the trained demo model).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import LLM, SamplingParams, _core  # noqa: E402
from fastllm.demo import demo_model_path  # noqa: E402
from fastllm.layers.quantization import QUANTIZATION_FORMATS, resolve_quantization  # noqa: E402

PATHS = _core.quant_paths()
GGUF_TYPES = {
    "q8_0": GT.Q8_0,
    "q4_0": GT.Q4_0,
    "iq4_nl": GT.IQ4_NL,
    "q4_1": GT.Q4_1,
    "mxfp4": GT.MXFP4,
}


def blocks_of(q) -> np.ndarray:
    """A QuantizedLinear's weights as GGUF rows of blocks (uint8 [n, bytes])."""
    raw = np.frombuffer(q.to_blocks(), dtype=np.uint8)
    return raw.reshape(q.out_features, -1)


def dequantized(q) -> np.ndarray:
    """The weights of ``q`` as the gguf package dequantizes its blocks."""
    return quants.dequantize(blocks_of(q), GGUF_TYPES[q.format]).astype(np.float64)


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: int8 per group of 32, scale max|x| / 127."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xp = np.zeros((m, kp), dtype=np.float32)
    xp[:, :k] = x
    g = xp.reshape(m, kp // 32, 32)
    d = np.abs(g).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(g * inv)
    return (q * d).reshape(m, kp)[:, :k].astype(np.float64)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_blocks_equal_the_gguf_packages_quantization(fmt):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((70, 96)) * 0.05).astype(np.float32)
    q = _core.QuantizedLinear(torch.from_numpy(w), format=fmt)
    want = quants.quantize(w, GGUF_TYPES[fmt])
    got = blocks_of(q)
    assert got.shape == want.shape
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_blocks_round_trip_and_dequantize_like_gguf(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((45, 64)).astype(np.float32)
    q = _core.QuantizedLinear(torch.from_numpy(w), format=fmt)
    # Adopting the blocks again gives the same weights, bit for bit.
    blocks = torch.from_numpy(blocks_of(q).copy())
    again = _core.QuantizedLinear.from_blocks(blocks, 45, 64, fmt)
    assert again.to_blocks() == q.to_blocks()
    # The embedding lookup dequantizes rows exactly as the gguf package does.
    ids = torch.tensor([0, 44, 7, 7], dtype=torch.int64)
    out = torch.empty(4, 64, dtype=torch.float32)
    q.embed(out, ids)
    np.testing.assert_array_equal(out.numpy(), dequantized(q)[ids.numpy()].astype(np.float32))
    # And the weights are close to the floats they came from.
    err = np.abs(dequantized(q) - w).max()
    # mxfp4: levels 8 and 12 of a scale up to max|w| / 8 are 4 steps apart.
    assert err < {"q8_0": 0.02, "mxfp4": 0.8}.get(fmt, 0.6), err


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 90),
    k=st.integers(1, 200),
    fmt=st.sampled_from(list(GGUF_TYPES)),
    x_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    path=st.sampled_from(PATHS),
    seed=st.integers(0, 2**31),
)
def test_kernel_matches_reference_on_every_path(m, n, k, fmt, x_dtype, out_dtype, bias, path, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g).to(x_dtype)
    q = _core.QuantizedLinear(w, b, format=fmt, path=path)
    assert q.path == path and q.format == fmt
    out = torch.empty(m, n, dtype=out_dtype)
    q.forward(out, x)
    wd = dequantized(q)[:, :k]
    xq = quantized_activations(x.float().numpy())
    ref = xq @ wd.T + (0 if b is None else b.double().numpy())
    mag = np.abs(xq) @ np.abs(wd).T + (0 if b is None else np.abs(b.double().numpy()))
    tol = (2**-8 if out_dtype == torch.bfloat16 else 1e-5) * mag + 1e-5
    np.testing.assert_array_less(np.abs(out.double().numpy() - ref), tol)


def test_bad_arguments_name_the_problem():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="unknown quantized format 'q3'"):
        _core.QuantizedLinear(w, format="q3")
    with pytest.raises(ValueError, match="unknown quantized kernel path"):
        _core.QuantizedLinear(w, path="neon")
    q = _core.QuantizedLinear(w)
    with pytest.raises(ValueError, match="in_features"):
        q.forward(torch.empty(2, 8), torch.randn(2, 16))
    with pytest.raises(ValueError, match="expected 272 bytes"):
        _core.QuantizedLinear.from_blocks(torch.zeros(10, dtype=torch.uint8), 8, 32, "q8_0")
    with pytest.raises(ValueError, match="out of range"):
        q.embed(torch.empty(1, 32), torch.tensor([8]))
    with pytest.raises(ValueError, match=r"quantization='int3' is not supported; expected None"):
        resolve_quantization("int3")
    with pytest.raises(ValueError, match="'int8', 'int4'"):
        LLM(demo_model_path(), quantization="fp8")


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The log-probability of each prompt token after the first."""
    (o,) = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
        use_tqdm=False,
    )
    return [entry[tok].logprob for tok, entry in zip(ids[1:], o.prompt_logprobs[1:])]


def _perplexity(llm: LLM, ids: list[int]) -> float:
    return float(np.exp(-np.mean(prompt_logprobs(llm, ids))))


@pytest.fixture(scope="module")
def stdlib_text_ids():
    # Real text the demo model has learned from: Python's standard library.
    import textwrap

    path = os.path.join(os.path.dirname(textwrap.__file__), "textwrap.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    llm = LLM(demo_model_path())
    return llm.get_tokenizer().encode(text)[:1000]


def test_quantized_models_keep_the_float_models_perplexity(stdlib_text_ids):
    ppl = {}
    for q in (None, "int8", "q4_0", "iq4_nl", "mxfp4"):
        ppl[q] = _perplexity(LLM(demo_model_path(), quantization=q), stdlib_text_ids)
    base = ppl[None]
    assert ppl["int8"] / base < 1.02, ppl
    for fmt in ("q4_0", "iq4_nl", "mxfp4"):
        assert ppl[fmt] / base < 1.25, ppl
    # "int4" names the 4-bit format of the smaller loss.
    int4 = QUANTIZATION_FORMATS["int4"]
    assert ppl[int4] == min(ppl["q4_0"], ppl["iq4_nl"]), ppl


@pytest.mark.parametrize("quantization, bound", [("int8", 0.55), ("int4", 0.32)])
def test_weights_shrink_and_the_float_copies_are_freed(quantization, bound):
    llm = LLM(demo_model_path(), quantization=quantization)
    model = llm.llm_engine.runner.model
    fmt = QUANTIZATION_FORMATS[quantization]
    assert repr(llm).count(f"quantization='{fmt}'") == 1
    from safetensors import safe_open

    with safe_open(os.path.join(demo_model_path(), "model.safetensors"), "pt") as f:
        # bf16 bytes of the matrices (what is quantized; norms stay float)
        float_bytes = sum(
            f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] * 2
            for n in f.keys()
            if len(f.get_slice(n).get_shape()) == 2
        )
    seen, total = set(), 0
    for module in model.modules():
        for table in (getattr(module, "packed", None), getattr(module, "quantized", None)):
            if table is not None and id(table) not in seen:
                seen.add(id(table))
                assert table.format == fmt
                total += table.nbytes
        weight = getattr(module, "weight", "none")
        if module.__class__.__name__ in ("Linear", "Embedding"):
            assert weight is None, module  # the float copy is gone
    assert total <= bound * float_bytes, (total, float_bytes)
    # The tied embedding reads its rows from the quantized head.
    assert model.model.embed_tokens.quantized is model.packed_head


def test_bench_latency_runs_quantized(make_model, tmp_path):
    import json

    from fastllm.cli import main

    out = tmp_path / "lat.json"
    args = ["--input-len", "8", "--output-len", "4", "--num-iters", "1", "--device", "cpu"]
    folder = make_model("llama")
    assert main(["bench", "latency", folder, *args, "-q", "int4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["results"][0]["decode_tokens_per_s"] > 0


def _tables(model) -> dict[str, tuple]:
    """Every linear layer's quantized rows (dequantized by the kernel's own
    lookup) and bias, by module name."""
    import torch

    out = {}
    for name, m in model.named_modules():
        packed = getattr(m, "packed", None)
        if type(m).__name__ == "Linear" and isinstance(packed, _core.QuantizedLinear):
            rows = torch.empty(packed.out_features, packed.in_features)
            packed.embed(rows, torch.arange(packed.out_features))
            out[name] = (packed.format, rows, None if m.bias is None else m.bias.detach().clone())
    return out


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen2", "gpt2", "phi", "gemma3", "phi3", "olmo2", "qwen2_moe", "lfm2_moe"],
)
def test_folders_quantize_layer_by_layer_as_they_load(family, make_model, tmp_path, monkeypatch):
    """``LLM(folder, quantization=...)`` quantizes each linear layer as the
    loader reads it (``StreamingQuantizer``): the loader's state never holds
    a float weight of a quantized layer (only the head's, left to
    ``quantize_model``), and the model is the one quantized after a whole
    float load: the same blocks, biases and logits."""
    import torch

    import test_hybrid_models
    import test_moe_models
    from fastllm.config import EngineConfig, ModelConfig
    from fastllm.layers.linear import Linear
    from fastllm.layers.quantization import quantize_model
    from fastllm.loading import load
    from fastllm.models import loader
    from paged_helpers import PagedRunner

    if family == "qwen2_moe":
        folder = str(tmp_path / family)
        test_moe_models.build(test_moe_models.CONFIGS[family], folder)
    elif family == "lfm2_moe":
        from test_models import _build

        folder = str(tmp_path / family)
        _build("", folder, 0, test_hybrid_models.CONFIGS[family])
    elif family in ("phi", "gemma3", "phi3", "olmo2"):  # heads with a bias, tied, fused
        from test_models import _build

        folder = str(tmp_path / family)
        _build(family, folder, 0)
    else:
        folder = make_model(family)
    held: list[int] = []  # float linear weights in the loader's state, at each read
    from fastllm.layers import quantization as q

    real_offer = q.StreamingQuantizer.offer

    def offer(self, pname, tensor, state):
        real_offer(self, pname, tensor, state)
        weights = [
            k for k in state if k.rpartition(".")[0] in self.linears and k.endswith("weight")
        ]
        held.append(len(weights) + len(self.pending))

    monkeypatch.setattr(q.StreamingQuantizer, "offer", offer)
    fmt = "q8_0"
    engine = EngineConfig(
        model=folder, dtype="float32", quantization="int8", skip_tokenizer_init=True
    )
    streamed = load(engine, "cpu").model
    assert held and max(held) <= 1  # at most one weight waits for its bias
    config = ModelConfig.from_pretrained(folder)
    whole = loader.load_model(config, folder, torch.float32, "cpu")
    quantize_model(whole, fmt, config.vocab_size)
    got, want = _tables(streamed), _tables(whole)
    assert got.keys() == want.keys() and len(got) > 2
    for name, (f, rows, bias) in want.items():
        assert got[name][0] == f
        assert torch.equal(got[name][1], rows), name
        assert (bias is None and got[name][2] is None) or torch.equal(got[name][2], bias), name
    assert all(m.weight is None for m in streamed.modules() if isinstance(m, Linear))
    seqs = [[3, 17, 40, 5, 9], [8, 2]]
    for a, b in zip(
        PagedRunner(streamed, torch.float32).step(list(enumerate(seqs))),
        PagedRunner(whole, torch.float32).step(list(enumerate(seqs))),
        strict=True,
    ):
        assert torch.equal(a, b)
