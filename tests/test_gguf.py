"""GGUF files as models: fastllm's reader, config, loader and kernels against
independent references.

Each tiny random model (test_models' configs) is written as a GGUF file by
``gguf_models.write_gguf`` (llama.cpp's ``gguf`` package: its tensor-name map,
writer and quantizers; q/k rows permuted as llama.cpp's converter does), then

* F32 files: fastllm's logits from the file equal transformers' on the
  original folder within the float32 bound of test_models (1e-4 of max|ref|);
  BF16 files: the same logits, bit for bit, as the folder loaded in bf16;
* quantized files (Q8_0, Q4_0 kept as they are; Q5_1 and the K-quants
  converted to q8_0): fastllm's logits are within ``QUANT_BOUND`` of max|ref|
  of transformers' ``from_pretrained(folder, gguf_file=...)``, which
  dequantizes every tensor with the ``gguf`` package (for the configurations
  its GGUF reader cannot read, see ``TRANSFORMERS_READS``, the reference is
  the original transformers model holding the file's weights dequantized by
  the ``gguf`` package). The bound holds the int8 quantization of
  the activations (the weights themselves are the file's, bit for bit);
* Q8_0 / Q4_0 files equal, bit for bit, the same folder quantized at load by
  fastllm (both quantizers write the same blocks), which checks the exact
  repack and the q/k row permutation of quantized tensors;
* a battery of broken files: each a clear error naming the file and the key
  or tensor, raised before any weight is assigned.
"""

from __future__ import annotations

import copy
import os
import shutil
import struct

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from fastllm import _core  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.gguf.config import hf_config  # noqa: E402
from fastllm.gguf.loader import EXACT_TYPES, load_gguf_model  # noqa: E402
from fastllm.gguf.reader import GGUFError, GGUFFile  # noqa: E402
from fastllm.layers.linear import pack_linears  # noqa: E402
from fastllm.layers.quantization import quantize_model  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from gguf_models import dequantized_state, write_gguf  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402
from test_models import (  # noqa: E402
    CONFIGS,
    _assert_close_f32,
    _build,
    _one_thread,  # noqa: F401 - the autouse fixture: one torch thread for tiny models
    _reference,
    _sequences,
)

transformers.logging.set_verbosity_error()

NAMES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi",
    "gpt2",
    "gemma2",
    "gemma3",
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
]


def _gguf_configs() -> dict[str, object]:
    """The families' test configs, where llama.cpp's converter cannot write
    an option of ``test_models.CONFIGS``, changed to what a GGUF file can
    hold: Gemma's query scale is the head size (llama.cpp infers it; only
    the 27B models differ), Granite's head size is hidden / heads (the
    converter drops ``head_dim``), SmolLM3 drops every 4th layer's rotary
    embedding (llama.cpp's fixed rule) and has no window, Gemma 3 has six
    layers, the last one global (the converter writes no layer pattern and
    llama.cpp assumes that one)."""
    c = {n: copy.deepcopy(CONFIGS[n]) for n in NAMES}
    for name in ("gemma2", "gemma3"):
        c[name].query_pre_attn_scalar = c[name].head_dim
    g3 = c["gemma3"]
    g3.num_hidden_layers = 6
    g3.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    c["granite"].head_dim = c["granite"].hidden_size // c["granite"].num_attention_heads
    c["olmo2"].bos_token_id, c["olmo2"].eos_token_id = 1, 2  # ids inside the tiny vocabulary
    smol = c["smollm3"]
    smol.num_hidden_layers = 4
    smol.no_rope_layers = [1, 1, 1, 0]
    smol.use_sliding_window = False
    smol.sliding_window = None
    smol.layer_types = ["full_attention"] * 4
    return c


GGUF_CONFIGS = _gguf_configs()
# Read with transformers' own GGUF loader; the others are compared with the file's
# dequantized weights in the original transformers model, because transformers'
# GGUF reader does not read phi2, drops mistral's sliding window and the explicit
# head_dim of these qwen2/qwen3 configs, and mis-sizes this gpt2.
TRANSFORMERS_READS = {"llama"}
# max |fastllm - dequantized reference| / max|reference| (observed: 0.01 to
# 0.033; files converted at load, Q5_1: up to 0.047 on the 4-layer configs)
QUANT_BOUND = 0.04
QUANT_BOUND_CONVERTED = 0.06
LENGTHS = [7, 13, 1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, transformers model) for the GGUF tests' configs."""
    out = {}
    for name in NAMES:
        folder = str(tmp_path_factory.mktemp(f"gguf-{name}"))
        out[name] = (folder, _build(name, folder, config=GGUF_CONFIGS[name]))
    return out


def _kind(name: str) -> str:
    return "llama" if name == "mistral" else name


def _load_gguf(path: str, dtype=torch.float32):
    with GGUFFile(path) as g:
        config = ModelConfig.from_dict(hf_config(g), path=path)
        model, report = load_gguf_model(config, g, dtype, "cpu")
    pack_linears(model)
    return model, report


def _logits(model, seqs):
    return PagedRunner(model, torch.float32).step(list(enumerate(seqs)))


def _max_rel(ours, refs) -> float:
    return max(
        ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, refs, strict=True)
    )


@pytest.mark.parametrize("name", NAMES)
def test_f32_file_matches_transformers(name, saved, tmp_path):
    folder, ref_model = saved[name]
    path = write_gguf(folder, str(tmp_path / "m.gguf"), _kind(name), "F32")
    model, report = _load_gguf(path)
    assert report.tensor_types == {"F32": len(GGUFFile(path).tensors)}
    seqs = _sequences(3, LENGTHS)
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"{name} sequence {i}")


@pytest.mark.parametrize("name", NAMES)
def test_bf16_file_equals_the_folder_in_bf16(name, saved, tmp_path):
    """BF16 matrices (rounded to nearest even, as torch rounds): the same
    logits, bit for bit, as the folder loaded by fastllm in bfloat16."""
    folder, _ = saved[name]
    path = write_gguf(folder, str(tmp_path / "m.gguf"), _kind(name), "BF16")
    with GGUFFile(path) as g:
        assert hf_config(g)["torch_dtype"] == "bfloat16"
    from_file, _ = _load_gguf(path, torch.bfloat16)
    folder_model = load_model(ModelConfig.from_pretrained(folder), folder, torch.bfloat16, "cpu")
    pack_linears(folder_model)
    seqs = _sequences(9, LENGTHS)
    a = PagedRunner(from_file, torch.bfloat16).step(list(enumerate(seqs)))
    b = PagedRunner(folder_model, torch.bfloat16).step(list(enumerate(seqs)))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["llama3-rope", "llama-linear-rope", "qwen3-yarn"])
def test_rope_scaling_from_the_file(name, tmp_path_factory):
    """Llama 3's scaling (a rope_freqs.weight tensor), linear scaling and
    YaRN (metadata, as the converter writes Qwen3's long-context configs)."""
    folder = str(tmp_path_factory.mktemp(name))
    ref_model = _build(name, folder)
    kind = "qwen3" if name == "qwen3-yarn" else "llama"
    path = write_gguf(folder, os.path.join(folder, "m.gguf"), kind, "F32")
    with GGUFFile(path) as g:
        assert ("rope_freqs.weight" in g.tensors) == (name == "llama3-rope")
        read = ModelConfig.from_dict(hf_config(g), path=path).rope_scaling
    want = {"llama3-rope": "freq_factors", "llama-linear-rope": "linear", "qwen3-yarn": "yarn"}
    assert read["rope_type"] == want[name]
    model, _ = _load_gguf(path)
    seqs = _sequences(7, [40, 9])  # long enough for the scaled frequencies to matter
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"{name} sequence {i}")


def test_phi2_file_with_fused_qkv(saved, tmp_path):
    folder, ref_model = saved["phi"]
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "phi", "F32", fuse_qkv=True)
    with GGUFFile(path) as g:
        assert "blk.0.attn_qkv.weight" in g.tensors and "blk.0.attn_q.weight" not in g.tensors
    model, _ = _load_gguf(path)
    seqs = _sequences(8, LENGTHS)
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"phi fused sequence {i}")


@pytest.mark.parametrize("types", ["Q8_0", "Q4_0", "Q5_1", "mixed", "exact-mix"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_file_close_to_dequantized_reference(name, types, saved, tmp_path):
    folder, ref_model = saved[name]
    cycle = ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "F16"]
    if types == "exact-mix":
        cycle = ["Q8_0", "Q4_0", "Q5_0"]  # to q8_0 exactly, fused with each other or not

    def mixed(tensor: str, shape) -> str:  # a different type per matrix, fused ones included
        return cycle[sum(map(ord, tensor)) % len(cycle)]

    path = write_gguf(
        folder, str(tmp_path / "m.gguf"), _kind(name), mixed if "mix" in types else types
    )
    model, report = _load_gguf(path)
    if types == "Q5_1":
        assert report.converted.get("Q5_1", 0) > 0
    if types == "exact-mix":
        assert report.converted == {} and report.fused_with == {} and report.exact
    seqs = _sequences(4, LENGTHS)
    ours = _logits(model, seqs)
    if name in TRANSFORMERS_READS:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=path, dtype=torch.float32
        ).eval()
    else:
        ref = _with_dequantized_weights(ref_model, path, name)
    err = _max_rel(ours, _reference(ref, seqs))
    # Q5_1 is requantized to q8_0 at load: a second rounding on top of the file's.
    bound = QUANT_BOUND_CONVERTED if types == "Q5_1" else QUANT_BOUND
    assert err <= bound, f"{name} {types}: max error {err:.4f} of max|ref|"


def _with_dequantized_weights(ref_model, path: str, name: str):
    """A copy of the transformers model holding the GGUF file's weights, dequantized
    by the ``gguf`` package (q/k rows of Llama-family files permuted back)."""
    import copy

    from gguf_models import ARCH, GEMMA, PERMUTED, unpermute

    model = copy.deepcopy(ref_model)
    cfg = model.config
    names = gguf.TensorNameMap(ARCH[name], cfg.num_hidden_layers)
    deq = dequantized_state(path)
    with torch.no_grad():
        for hf_name, p in model.named_parameters():
            t = deq[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
            if name == "gpt2" and p.ndim == 2 and "wte" not in hf_name and "wpe" not in hf_name:
                t = t.reshape(p.shape[::-1]).T  # Conv1D: [in, out] in the checkpoint
            t = t.reshape(p.shape)
            if _kind(name) in PERMUTED and ".q_proj." in hf_name:
                t = unpermute(t.numpy(), cfg.num_attention_heads)
            elif _kind(name) in PERMUTED and ".k_proj." in hf_name:
                t = unpermute(t.numpy(), cfg.num_key_value_heads)
            elif name in GEMMA and hf_name.endswith("norm.weight"):
                t = t - 1  # stored as 1 + w
            p.copy_(torch.as_tensor(t))
    return model


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_kernel_types_run_bit_for_bit_as_quantized_at_load(name, fmt, saved, tmp_path):
    folder, _ = saved[name]

    def types(tensor: str, shape) -> str:  # fastllm keeps GPT-2's position table in float
        return "F32" if tensor.startswith("position_embd") else fmt

    path = write_gguf(folder, str(tmp_path / "m.gguf"), _kind(name), types)
    from_file, report = _load_gguf(path)
    assert report.converted == {}
    config = ModelConfig.from_pretrained(folder)
    at_load = load_model(config, folder, torch.float32, "cpu")
    quantize_model(at_load, fmt.lower(), config.vocab_size)
    seqs = _sequences(5, LENGTHS)
    for a, b in zip(_logits(from_file, seqs), _logits(at_load, seqs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mix", ["Q4_K", "K-mix"])
def test_k_quants_close_to_dequantized_reference(tmp_path, mix):
    """Q4_K / Q5_K / Q6_K matrices (in_features a multiple of 256): Q4_K runs as
    q4_1, the others are converted to q8_0 (a matrix fusing Q4_K with another
    type too), each with a warning; close to transformers on the dequantized
    file."""
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    folder = str(tmp_path / "k")
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    kinds = ["Q4_K", "Q5_K", "Q6_K"] if mix == "K-mix" else ["Q4_K"]

    def types(tensor: str, shape) -> str:
        return kinds[sum(map(ord, tensor)) % len(kinds)]

    path = write_gguf(folder, os.path.join(folder, "m.gguf"), "llama", types)
    model, report = _load_gguf(path)
    if mix == "Q4_K":
        assert report.converted == {} and report.rewritten["Q4_K"] == 9  # 7 per layer + 2
    else:
        assert {"Q5_K", "Q6_K"} <= set(report.converted) and report.rewritten
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    seqs = _sequences(6, LENGTHS)
    err = _max_rel(_logits(model, seqs), _reference(ref, seqs))
    assert err <= QUANT_BOUND, f"K-quants: max error {err:.4f} of max|ref|"


# The loader's exact types (the gguf package cannot write IQ4_NL; the core's
# own test covers it).
@pytest.mark.parametrize("kind", [k for k in EXACT_TYPES if k != "IQ4_NL"])
def test_exact_conversion_to_q8_0_keeps_the_weights(kind):
    """Q4_0 / Q5_0 / Q8_0 blocks as q8_0 blocks: the kernel's weights are the
    file's weights as the gguf package dequantizes them, bit for bit."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    blocks = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
    q8 = torch.empty(40 * 3 * 34, dtype=torch.uint8)
    _core.gguf_to_q8_0(torch.from_numpy(blocks.reshape(-1).copy()), kind, q8)
    layer = _core.QuantizedLinear.from_blocks(q8, 40, 96, "q8_0")
    rows = torch.empty(40, 96)
    layer.embed(rows, torch.arange(40))
    np.testing.assert_array_equal(rows.numpy(), want)


def test_dequantize_matches_the_gguf_package():
    """Every block type fastllm reads, on random valid blocks, against gguf's numpy code."""
    rng = np.random.default_rng(0)
    for kind in _core.gguf_block_types():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(37, size), dtype=np.uint8)
        scales = rng.uniform(-0.05, 0.05, size=(37, 2)).astype(np.float16).view(np.uint8)
        if kind == "Q6_K":
            raw[:, 208:210] = scales[:, :2]
        elif kind == "MXFP4":  # E8M0 exponents 0 and 1 (subnormal scales) to 2^11
            raw[:, 0] = rng.integers(0, 140, size=37)
        else:
            raw[:, 0:2] = scales[:, :2]
            if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
                raw[:, 2:4] = scales[:, 2:4]
        ref = gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(-1)
        out = torch.empty(37 * block)
        _core.dequantize_gguf(torch.from_numpy(raw.reshape(-1).copy()), kind, out)
        np.testing.assert_array_equal(out.numpy(), ref.astype(np.float32), err_msg=kind)
    with pytest.raises(ValueError, match="unknown block type"):
        _core.dequantize_gguf(torch.zeros(84, dtype=torch.uint8), "Q2_K", torch.empty(256))
    with pytest.raises(ValueError, match="bytes of blocks"):
        _core.dequantize_gguf(torch.zeros(33, dtype=torch.uint8), "Q8_0", torch.empty(32))


# ---- the LLM API --------------------------------------------------------


def test_llm_runs_a_gguf_file_like_its_folder(saved, tmp_path):
    """LLM("model.gguf") greedy tokens and logprobs equal LLM(folder, quantization=...)."""
    from fastllm import LLM, SamplingParams

    folder, _ = saved["qwen2"]
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q8_0")
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]
    kw = dict(skip_tokenizer_init=True, max_model_len=64, dtype="float32")
    a = LLM(path, **kw)
    assert "gguf" in repr(a) and "Q8_0" in repr(a)
    ours = a.generate(prompts, sp, use_tqdm=False)
    b = LLM(folder, quantization="q8_0", **kw)
    ref = b.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(ours, ref, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert {k: v.logprob for k, v in p.items()} == {k: v.logprob for k, v in q.items()}
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        LLM(folder, quantization="gguf", **kw)


# ---- broken files ---------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(saved, tmp_path_factory) -> str:
    folder, _ = saved["llama"]
    return write_gguf(folder, str(tmp_path_factory.mktemp("good") / "m.gguf"), "llama", "Q8_0")


def _broken(good_file: str, tmp_path, edit) -> str:
    path = str(tmp_path / "broken.gguf")
    shutil.copy(good_file, path)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data = edit(data)
        f.seek(0)
        f.truncate()
        f.write(data)
    return path


def _tensor_info_offset(data: bytes, name: str) -> int:
    """The byte position of tensor ``name``'s directory entry (its name's length field)."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    pos = data.find(needle)
    assert pos > 0
    return pos


def _load_all(path: str):
    from fastllm import LLM

    return LLM(path, skip_tokenizer_init=True, max_model_len=64)


def test_truncated_file(good_file, tmp_path):
    path = _broken(good_file, tmp_path, lambda d: d[: len(d) - 1000])
    with pytest.raises(GGUFError, match=r"broken\.gguf: tensor '.*' .*past the end of the file"):
        GGUFFile(path)
    path = _broken(good_file, tmp_path, lambda d: d[:100])
    with pytest.raises(GGUFError, match=r"broken\.gguf: truncated while reading metadata key"):
        _load_all(path)


def test_wrong_magic_and_version(good_file, tmp_path):
    path = _broken(good_file, tmp_path, lambda d: b"GGML" + d[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)
    path = _broken(good_file, tmp_path, lambda d: d[:4] + struct.pack("<I", 9) + d[8:])
    with pytest.raises(GGUFError, match="GGUF version 9 is not supported"):
        GGUFFile(path)


def test_offset_past_the_end_and_unknown_type(good_file, tmp_path):
    name = "blk.1.ffn_down.weight"

    def field_at(d: bytearray) -> int:  # the entry's type field: after name, n_dims, dims
        pos = _tensor_info_offset(d, name) + 8 + len(name)
        (n_dims,) = struct.unpack_from("<I", d, pos)
        return pos + 4 + 8 * n_dims

    def offset_past(d: bytearray) -> bytearray:
        struct.pack_into("<Q", d, field_at(d) + 4, 1 << 40)
        return d

    def unknown_type(d: bytearray) -> bytearray:
        struct.pack_into("<I", d, field_at(d), 77)
        return d

    def unsupported_type(d: bytearray) -> bytearray:
        struct.pack_into("<I", d, field_at(d), 16)  # IQ2_XXS: a known type without a reader
        return d

    with pytest.raises(GGUFError, match=f"tensor '{name}'.*past the end of the file"):
        GGUFFile(_broken(good_file, tmp_path, offset_past))
    with pytest.raises(GGUFError, match=f"tensor '{name}' has unknown ggml type 77"):
        GGUFFile(_broken(good_file, tmp_path, unknown_type))
    with pytest.raises(
        GGUFError, match=f"tensor '{name}' has type IQ2_XXS, which fastllm does not read"
    ):
        _load_all(_broken(good_file, tmp_path, unsupported_type))


def _rewrite(
    good_file: str,
    path: str,
    drop_key: str | None = None,
    drop_tensor: str | None = None,
    set_key: tuple[str, object] | None = None,
) -> str:
    """A copy of the file through gguf's reader and writer, with one change."""
    reader = gguf.GGUFReader(good_file)
    arch = reader.fields["general.architecture"].contents()
    if set_key and set_key[0] == "general.architecture":
        arch = set_key[1]
    w = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = field.contents()
        vtype = field.types[0]
        if set_key and key == set_key[0]:
            value = set_key[1]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name == drop_tensor:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_key_missing_tensor_and_bad_values(good_file, tmp_path):
    path = _rewrite(good_file, str(tmp_path / "a.gguf"), drop_key="llama.block_count")
    with pytest.raises(GGUFError, match=r"a\.gguf: metadata key 'llama.block_count' is missing"):
        _load_all(path)
    path = _rewrite(good_file, str(tmp_path / "b.gguf"), drop_tensor="blk.0.attn_k.weight")
    with pytest.raises(GGUFError, match=r"b\.gguf: tensor 'blk.0.attn_k.weight' is missing"):
        _load_all(path)
    path = _rewrite(good_file, str(tmp_path / "c.gguf"), set_key=("llama.embedding_length", 96))
    with pytest.raises(GGUFError, match=r"c\.gguf: tensor '.*' has shape \[.*\], expected"):
        _load_all(path)
    path = _rewrite(good_file, str(tmp_path / "d.gguf"), set_key=("general.architecture", "rwkv7"))
    with pytest.raises(GGUFError, match="general.architecture 'rwkv7' is not supported"):
        _load_all(path)
    # A text encoder's architecture goes to the encoder loader, which names
    # what its file lacks (this one has no vocabulary).
    path = _rewrite(good_file, str(tmp_path / "e.gguf"), set_key=("general.architecture", "bert"))
    with pytest.raises(GGUFError, match=r"e\.gguf: a bert encoder with tokenizer.ggml.model None"):
        _load_all(path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        _load_all(str(tmp_path / "nothing.gguf"))


# ---- the server -------------------------------------------------------------


def test_server_serves_a_gguf_file_with_its_tokenizer_and_template(make_model, tmp_path):
    """``serve model.gguf``: /v1/models names the file's tensor types, and a chat
    completion (the file's chat template and tokenizer) answers what the folder
    quantized at load answers."""
    import json

    from fastllm import LLM, SamplingParams
    from test_server import _app_server, _get, _post

    folder = make_model("llama")
    path = write_gguf(folder, str(tmp_path / "chat.gguf"), "llama", "Q8_0", tokenizer=True)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ref = LLM(folder, quantization="q8_0", dtype="float32", max_model_len=256)
    want = ref.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    with _app_server(path) as (app, addr):
        status, body = _get(*addr, "/v1/models")
        assert status == 200
        (model,) = json.loads(body)["data"]
        assert model["quantization"] == "gguf"
        assert model["gguf"]["tensor_types"]["Q8_0"] > 0 and model["gguf"]["file"] == path
        req = {"messages": messages, "max_tokens": 8, "temperature": 0}
        status, answer = _post(*addr, "/v1/chat/completions", json.dumps(req))
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == want[0].outputs[0].text
        assert answer["usage"]["prompt_tokens"] == len(want[0].prompt_token_ids)


def test_phi3_longrope_file(tmp_path):
    """LongRoPE from a GGUF file: the factor tensors, the original context and
    the attention factor the converter writes; the long factors serve the
    default context (longer than the original), equal to the reference on
    sequences past the original context."""
    from test_models import _phi3_longrope

    folder = str(tmp_path / "phi3")
    ref_model = _phi3_longrope(folder, 6)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "phi3", "F32")
    with GGUFFile(path) as g:
        rope = ModelConfig.from_dict(hf_config(g), path=path).rope_scaling
        assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(g.tensors)
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 16
    model, _ = _load_gguf(path)
    seqs = _sequences(16, [33, 20])
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"phi3 longrope file sequence {i}")


@pytest.mark.parametrize("period", [3, None])
def test_gemma3_file_without_layer_flags(tmp_path, period):
    """A Gemma 3 file that gives the layer pattern as a period, or not at all
    (llama.cpp's default: 6), and no local rotary base (10000), configures
    like the reference config with those values."""
    import json

    every = period or 6
    config = copy.deepcopy(GGUF_CONFIGS["gemma3"])
    config.num_hidden_layers = 7
    config.layer_types = [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(7)
    ]
    config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    folder = str(tmp_path / "g3")
    ref_model = _build("gemma3", folder, config=config)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.pop("layer_types")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if period:
        cfg["sliding_window_pattern"] = period
    json.dump(cfg, open(cfg_path, "w"))
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "gemma3", "F32")
    with GGUFFile(path) as g:
        read = ModelConfig.from_dict(hf_config(g), path=path)
    assert read.layer_attention_types() == config.layer_types
    model, _ = _load_gguf(path)
    seqs = _sequences(17, [14, 6])
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"gemma3 period {period} sequence {i}")


def test_vocabulary_is_the_embedding_rows(saved, tmp_path):
    """llama.cpp's Gemma 3 converter cuts the embedding to the tokenizer's
    tokens but may keep the config's larger vocab_size in the metadata: the
    embedding's rows are the model's vocabulary."""
    import json

    folder, ref_model = saved["gemma3"]
    copy_dir = tmp_path / "g3"
    shutil.copytree(folder, copy_dir)
    cfg = json.load(open(copy_dir / "config.json"))
    cfg["vocab_size"] = 262144  # the metadata's, not the rows'
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    path = write_gguf(str(copy_dir), str(tmp_path / "m.gguf"), "gemma3", "F32")
    with GGUFFile(path) as g:
        assert g.get("gemma3.vocab_size") == 262144
        assert hf_config(g)["vocab_size"] == 512
    model, _ = _load_gguf(path)
    seqs = _sequences(18, [11])
    for ours, ref in zip(_logits(model, seqs), _reference(ref_model, seqs), strict=True):
        _assert_close_f32(ours, ref, "gemma3 with a larger vocab_size key")


def test_gemma2_27b_query_scale_from_the_layer_count(tmp_path):
    """A GGUF file has no query_pre_attn_scalar: llama.cpp scales Gemma 2's
    queries by hidden / heads for its 46-layer (27B) model and by the head
    size otherwise, and fastllm reads the file the same way: a 46-layer model
    whose scalar is hidden / heads (not the head size) equals transformers."""
    config = copy.deepcopy(GGUF_CONFIGS["gemma2"])
    config.num_hidden_layers = 46
    config.layer_types = ["sliding_attention", "full_attention"] * 23
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    assert config.query_pre_attn_scalar != config.head_dim
    folder = str(tmp_path / "g2-27b")
    ref_model = _build("gemma2", folder, config=config)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "gemma2", "F32")
    with GGUFFile(path) as g:
        assert hf_config(g)["query_pre_attn_scalar"] == config.query_pre_attn_scalar
    model, _ = _load_gguf(path)
    seqs = _sequences(19, [13, 5])
    for i, (ours, ref) in enumerate(zip(_logits(model, seqs), _reference(ref_model, seqs))):
        _assert_close_f32(ours, ref, f"gemma2 46 layers sequence {i}")
