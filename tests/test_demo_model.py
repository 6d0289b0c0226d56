"""The embedded demo model: small, loads with LLM(), and writes Python-like text."""

import json
import os

import pytest

from fastllm.demo import demo_model_path


def test_demo_model_is_small_llama():
    folder = demo_model_path()
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    assert size < 30 * 1024 * 1024


def test_llm_without_model_generates_python():
    pytest.importorskip("torch")
    from fastllm import LLM, SamplingParams

    llm = LLM(device="cpu")
    (out,) = llm.generate(
        ["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
    )
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) > 0
    # Trained on the standard library's source: indentation and Python keywords.
    assert "\n    " in text
    assert any(k in text for k in ("return", "self", "if ", "def ", '"""', "import"))
    assert text.isascii()
