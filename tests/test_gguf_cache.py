"""The packed-weight cache of GGUF files (``fastllm/gguf/cache.py``).

A load that maps its panels from the cache must give the same logits, bit
for bit, as a load that repacks the file (the reference: the same file
loaded with the cache off); a changed file, a damaged cache file or a
cache file of other shapes must never be used, and never fail a load.
"""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from conftest import fake_disk  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.gguf.cache import MAGIC, PanelCache, cache_dir, cache_file_exists  # noqa: E402
from fastllm.gguf.config import hf_config  # noqa: E402
from fastllm.gguf.loader import load_gguf_model  # noqa: E402
from fastllm.gguf.reader import GGUFFile  # noqa: E402
from fastllm.layers.linear import pack_linears  # noqa: E402
from gguf_models import write_gguf  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402
from test_models import _build, _one_thread, _sequences  # noqa: E402, F401


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("cache-qwen2"))
    _build("qwen2", out)
    return out


@pytest.fixture
def cache_root(tmp_path, monkeypatch, ample_disk) -> str:
    root = str(tmp_path / "cache")
    monkeypatch.setenv("FASTLLM_CACHE_DIR", root)
    monkeypatch.delenv("FASTLLM_GGUF_CACHE", raising=False)
    return os.path.join(root, "gguf")


def _wait_for_writers() -> None:
    for t in threading.enumerate():
        if t.name == "fastllm-gguf-cache":
            t.join()


def _load(path: str):
    with GGUFFile(path) as g:
        config = ModelConfig.from_dict(hf_config(g), path=path)
        model, report = load_gguf_model(config, g, torch.float32, "cpu")
    pack_linears(model)
    _wait_for_writers()
    return model, report


def _logits(model):
    seqs = _sequences(3, [9, 4])
    return PagedRunner(model, torch.float32).step(list(enumerate(seqs)))


def _reference(path: str, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("FASTLLM_GGUF_CACHE", "0")
        model, report = _load(path)
    assert report.cache is None
    return _logits(model)


def _assert_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _mix(tensor: str, shape) -> str:
    """Q4_K where the rows allow it, Q5_1 (converted to q8_0 at load) for the
    MLP, Q8_0 elsewhere: every way a quantized matrix is built."""
    if shape[-1] % 256 == 0:
        return "Q4_K"
    return "Q5_1" if "ffn" in tensor else "Q8_0"


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", _mix])
def test_second_load_maps_the_cache_and_gives_the_same_logits(
    fmt, folder, cache_root, tmp_path, monkeypatch
):
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", fmt)
    ref = _reference(path, monkeypatch)
    assert not os.path.exists(cache_root)
    first, r1 = _load(path)
    assert not r1.from_cache and os.path.isfile(r1.cache)
    assert os.path.dirname(r1.cache) == cache_root
    second, r2 = _load(path)
    assert r2.from_cache and r2.cache == r1.cache
    assert r2.summary(path)["from_cache"] is True
    assert r2.quantized_bytes == r1.quantized_bytes
    assert (r2.rewritten, r2.converted) == (r1.rewritten, r1.converted)
    if fmt is _mix:
        assert r1.converted
    _assert_equal(_logits(first), ref)
    _assert_equal(_logits(second), ref)
    assert [f for f in os.listdir(cache_root) if f.endswith(".tmp")] == []


def test_no_cache_is_written_on_a_nearly_full_disk(
    folder, cache_root, tmp_path, monkeypatch, caplog
):
    """Below 10% of the disk free (after the file) the packed weights are not
    cached: the load works as without a cache, and says why in the log."""
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q8_0")
    ref = _reference(path, monkeypatch)
    fake_disk(monkeypatch, free=(1 << 40) // 10, total=1 << 40)
    with caplog.at_level("INFO", logger="fastllm"):
        model, report = _load(path)
    assert not report.from_cache and not os.path.exists(report.cache)
    assert "too little free disk space" in caplog.text
    _assert_equal(_logits(model), ref)


def test_a_changed_file_never_meets_the_old_cache(folder, cache_root, tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    write_gguf(folder, path, "qwen2", "Q8_0")
    _, r1 = _load(path)
    # The same path and size, other weights (Q8_0 and Q4_0 differ in size:
    # rewrite as Q8_0 with one byte of tensor data changed).
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0x5A
    stat = os.stat(path)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the same mtime
    ref = _reference(path, monkeypatch)
    model, r2 = _load(path)
    assert not r2.from_cache and r2.cache != r1.cache
    _assert_equal(_logits(model), ref)


@pytest.mark.parametrize("damage", ["truncated", "magic", "header", "shapes", "fields"])
def test_a_damaged_cache_file_is_ignored_and_written_again(
    damage, folder, cache_root, tmp_path, monkeypatch
):
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q8_0")
    ref = _reference(path, monkeypatch)
    _, r1 = _load(path)
    raw = bytearray(open(r1.cache, "rb").read())
    (n,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + n])
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "magic":
        raw[:8] = b"NOTPANEL"
    elif damage == "header":
        raw[16:24] = b"{garbage"
    else:  # an entry of another shape, or one without its fields
        name = next(iter(header["tensors"]))
        if damage == "shapes":
            header["tensors"][name]["n"] += 1
        else:
            del header["tensors"][name]["format"]
            header["tensors"][name]["offset"] = -4096
        # Compact, padded with spaces to the header's length: the data stays put.
        text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
        assert len(text) == n
        raw[16 : 16 + n] = text
    with open(r1.cache, "wb") as f:
        f.write(raw)
    model, r2 = _load(path)
    assert not r2.from_cache
    _assert_equal(_logits(model), ref)
    # Written again, whole: the next load maps it.
    again, r3 = _load(path)
    assert r3.from_cache
    _assert_equal(_logits(again), ref)


def test_switch_and_directory(folder, cache_root, tmp_path, monkeypatch):
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q8_0")
    monkeypatch.setenv("FASTLLM_GGUF_CACHE", "0")
    assert cache_dir() is None
    _, report = _load(path)
    assert report.cache is None and not os.path.exists(cache_root)
    monkeypatch.setenv("FASTLLM_GGUF_CACHE", "maybe")
    with pytest.raises(ValueError, match="FASTLLM_GGUF_CACHE must be 0 or 1"):
        cache_dir()
    monkeypatch.setenv("FASTLLM_GGUF_CACHE", "1")
    monkeypatch.delenv("FASTLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "fastllm" / "gguf")
    # A cache file is looked up by the GGUF file's identity, not only its name.
    cache = PanelCache(path, cache_root)
    assert not cache.found and os.path.basename(cache.path).startswith("m-")
    assert MAGIC.startswith(b"FLLM")


def test_llm_loads_from_the_cache_with_the_same_tokens(folder, cache_root, tmp_path, monkeypatch):
    from fastllm import LLM, SamplingParams

    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q4_0")
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]
    kw = dict(skip_tokenizer_init=True, max_model_len=64, dtype="float32")
    assert not cache_file_exists(path)
    a = LLM(path, **kw)
    assert a.llm_engine.loaded.gguf["from_cache"] is False
    first = a.generate(prompts, sp, use_tqdm=False)
    _wait_for_writers()
    assert cache_file_exists(path)
    # With a cache file, the engine maps the GGUF file without reading it all
    # (its header is read twice: once to tell an encoder from a decoder).
    opened = []
    real_init = GGUFFile.__init__

    def spy(self, p, populate=True):
        opened.append(populate)
        real_init(self, p, populate)

    monkeypatch.setattr(GGUFFile, "__init__", spy)
    b = LLM(path, **kw)
    assert opened and not any(opened)
    assert b.llm_engine.loaded.gguf["from_cache"] is True
    second = b.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(first, second, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert {k: v.logprob for k, v in p.items()} == {k: v.logprob for k, v in q.items()}


def test_no_room_or_no_directory_skips_the_cache_not_the_load(
    folder, cache_root, tmp_path, monkeypatch
):
    import shutil
    from collections import namedtuple

    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen2", "Q8_0")
    ref = _reference(path, monkeypatch)
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(shutil, "disk_usage", lambda _: usage(100 << 30, 99 << 30, 1 << 30))
        model, report = _load(path)
    assert not report.from_cache and not os.listdir(cache_root)
    _assert_equal(_logits(model), ref)
    # A cache folder that cannot be made (a file in its way).
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("FASTLLM_CACHE_DIR", str(blocker))
    model, report = _load(path)
    assert not report.from_cache
    _assert_equal(_logits(model), ref)


def test_panel_file_writer_places_every_part_and_rejects_overlaps(tmp_path):
    from fastllm import _core

    torch.manual_seed(0)
    a = _core.QuantizedLinear(torch.randn(64, 96), None, "q4_0")
    b = _core.QuantizedLinear(torch.randn(40, 64), None, "q8_0")
    head = b"head bytes"
    path = tmp_path / "p.panels"
    at_b = (2 << 20) - 4096  # b crosses the first 2 MiB chunk's end
    with open(path, "wb") as f:
        _core.write_panel_file(f.fileno(), head, [(a, 4096), (b, at_b)])
    data = path.read_bytes()
    assert len(data) == at_b + b.nbytes
    assert data[: len(head)] == head and not any(data[len(head) : 4096])
    assert not any(data[4096 + a.nbytes : at_b])
    # The same bytes as each layer's own panels (written alone, one call each).
    for t, at in ((a, 4096), (b, at_b)):
        alone = tmp_path / "alone.panels"
        with open(alone, "wb") as f:
            _core.write_panel_file(f.fileno(), b"", [(t, 0)])
        assert data[at : at + t.nbytes] == alone.read_bytes()
    with open(path, "wb") as f, pytest.raises(ValueError, match="overlaps"):
        _core.write_panel_file(f.fileno(), head, [(a, 4096), (b, 4096 + a.nbytes - 1)])
