"""Decoder models as embedders (Qwen3-Embedding's shape: a Qwen3 base model,
last-token pooling, normalised) against transformers with the pooling done by
hand, through chunked prefill and the prefix cache; the pooling API's rules
(dimensions, normalisation, truncation, scores, clear errors)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastllm import LLM, PoolingParams  # noqa: E402
from tiny_models import tiny_qwen3_config, write_sentence_transformers  # noqa: E402

TEXTS = [
    "x",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "  leading and trailing whitespace  ",
    "Unicode: naïve café, 日本語, emoji 🙂",
    "import os\nimport sys\n" * 6,
]


@pytest.fixture(scope="module", params=["last", "mean"])
def embed_dir(request, tmp_path_factory, tokenizer_dir):
    """A tiny random Qwen3 base model saved without its head (as Qwen3-Embedding
    is), its config naming Qwen3ForCausalLM or Qwen3Model, with
    sentence-transformers files."""
    out = tmp_path_factory.mktemp(f"qwen3-embed-{request.param}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    config = tiny_qwen3_config(tok.get_vocab_size(), eos)
    torch.manual_seed(1)
    transformers.Qwen3Model(config).to(torch.float32).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3Model"]  # runs as Qwen3ForCausalLM
    if request.param == "last":  # as Qwen3-Embedding's config names it
        cfg["architectures"] = ["Qwen3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), out / name)
    prompts = {"query": "Instruct: find code\nQuery: "}
    write_sentence_transformers(out, request.param, 64, [16, 32], prompts)
    return str(out), request.param


def _reference(folder: str, pooling: str, texts: list[str]) -> list[torch.Tensor]:
    """transformers' Qwen3Model, one text at a time, pooled and normalised by hand."""
    from fastllm.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    model = transformers.AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok.encode(t)])
            h = model(input_ids=ids).last_hidden_state[0]
            v = h[-1] if pooling == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0))
    return out


def test_decoder_embeddings_equal_transformers(embed_dir):
    folder, pooling = embed_dir
    # Small steps: long inputs are prefilled in several chunks.
    llm = LLM(folder, runner="pooling", dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    ref = _reference(folder, pooling, TEXTS)
    for round_ in range(2):  # the second round meets the prefix cache
        outs = llm.embed(TEXTS, use_tqdm=False)
        for o, r, text in zip(outs, ref, TEXTS):
            v = torch.tensor(o.outputs.embedding)
            assert v.shape == (64,)
            cos = torch.nn.functional.cosine_similarity(v, r, dim=0).item()
            assert cos >= 0.9999, (round_, text, cos)
            assert abs(v.norm().item() - 1) < 1e-5
    # Matryoshka: the first 16 dimensions, normalised again; raw when asked.
    (short,) = llm.embed([TEXTS[1]], PoolingParams(dimensions=16), use_tqdm=False)
    expect = torch.nn.functional.normalize(ref[1][:16], dim=0)
    assert torch.allclose(torch.tensor(short.outputs.embedding), expect, atol=1e-4)
    (raw,) = llm.embed([TEXTS[1]], PoolingParams(normalize=False), use_tqdm=False)
    assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1) > 1e-3
    # Scores of an embedding model: cosine similarity, one query against many.
    scores = llm.score(TEXTS[1], TEXTS[2:], use_tqdm=False)
    for s, r in zip(scores, ref[2:]):
        assert abs(s.outputs.score - float(ref[1] @ r)) < 1e-4


def test_pooling_rules_and_errors(embed_dir):
    folder, _ = embed_dir
    llm = LLM(folder, runner="pooling", dtype="float32", max_model_len=32)
    long_text = TEXTS[4] * 3
    with pytest.raises(ValueError, match=r"input\[1\] has \d+ tokens, more than max_model_len=32"):
        llm.embed(["x", long_text], use_tqdm=False)
    # truncate_prompt_tokens keeps the last tokens (vLLM's rule)
    (cut,) = llm.embed([long_text], use_tqdm=False, truncate_prompt_tokens=8)
    assert len(cut.prompt_token_ids) == 8
    for d in (100, 20):
        with pytest.raises(
            ValueError, match=rf"dimensions={d} is not one of the model's Matryoshka"
        ):
            llm.embed(["x"], PoolingParams(dimensions=d), use_tqdm=False)
    (full,) = llm.embed(["x"], PoolingParams(dimensions=64), use_tqdm=False)
    assert len(full.outputs.embedding) == 64
    with pytest.raises(ValueError, match=r"input\[0\] is an empty string"):
        llm.embed([""], use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate text"):
        llm.generate(["x"], use_tqdm=False)
    assert "runner='pooling', tasks=['embed', 'score']" in repr(llm)
    with pytest.raises(ValueError, match="classify: this model is an embedding model"):
        llm.classify(["x"], use_tqdm=False)
    with pytest.raises(ValueError, match="PoolingParams.dimensions must be"):
        PoolingParams(dimensions=0)


def test_generation_model_refuses_pooling_calls(make_model):
    llm = LLM(make_model("llama"), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model"):
        llm.embed(["x"], use_tqdm=False)


def test_docs_example_runs(embed_dir, capsys):
    """docs/embeddings.md's Python example, run as written on the tiny model."""
    import re

    folder, _ = embed_dir
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "embeddings.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    # the API's example (the GGUF one runs in tests/test_gguf_encoders.py)
    (code,) = [b for b in blocks if "MODEL" in b]
    exec(compile(code, "docs/embeddings.md", "exec"), {"MODEL": folder})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "64" and lines[3] == "[16, 16]"
