"""Shared fixtures: a tokenizer trained on local text and tiny random models
built with transformers (a test-only reference)."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import pytest

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session", autouse=True)
def _gguf_cache_dir(tmp_path_factory):
    """GGUF loads cache their packed weights in the session's temporary
    directory, not the user's cache (``fastllm/gguf/cache.py``)."""
    if "FASTLLM_CACHE_DIR" not in os.environ:
        os.environ["FASTLLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("fastllm-cache"))
    yield


def fake_disk(monkeypatch, free: int, total: int = 1 << 40) -> None:
    """Makes the GGUF cache writer see a disk of ``total`` bytes with ``free``
    free (``fastllm/gguf/cache.py`` skips writing below 10% free), so its
    tests do not depend on the host's disk."""
    import shutil
    from types import SimpleNamespace

    usage = SimpleNamespace(total=total, used=total - free, free=free)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)


@pytest.fixture
def ample_disk(monkeypatch) -> None:
    """A disk with room for any cache file (``fake_disk``)."""
    fake_disk(monkeypatch, free=1 << 40)


def _corpus():
    libdir = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(libdir, "*.py")))[:60]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            yield f.read()


def train_byte_level_bpe(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (the
    specials included), trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A folder with tokenizer.json (byte-level BPE, 512 tokens) and tokenizer_config.json."""
    out = tmp_path_factory.mktemp("tokenizer")
    train_byte_level_bpe(512).save(str(out / "tokenizer.json"))
    cfg = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def _hf_config(arch: str, vocab: int, eos: int):
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if arch == "llama":
        return tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            initializer_range=0.1,
            **common,
        )
    if arch == "qwen2":
        return tf.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            initializer_range=0.1,
            **common,
        )
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.1, **common
        )
    raise ValueError(arch)


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_dir):
    """Builds (once per arch) a tiny random float32 transformers model with the test tokenizer."""
    import shutil

    cache: dict[str, str] = {}

    def build(arch: str = "llama") -> str:
        if arch in cache:
            return cache[arch]
        import torch
        import transformers as tf
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        eos = tok.token_to_id("<|endoftext|>")
        cfg = _hf_config(arch, tok.get_vocab_size(), eos)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
        out = tmp_path_factory.mktemp(f"model-{arch}")
        model.save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), out / name)
        cache[arch] = str(out)
        return cache[arch]

    return build


@pytest.fixture(scope="module")
def untemplated_model_dir(model_dir, tmp_path_factory) -> str:
    """The module's test model (its ``model_dir``) without a chat template."""
    import shutil

    out = tmp_path_factory.mktemp("untemplated") / "tiny-untemplated"
    shutil.copytree(model_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(cfg))
    return str(out)
