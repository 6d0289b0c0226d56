"""Tokenizers and chat templates of the 2025-26 families, against transformers.

Gemma's tokenizer is SentencePiece-style (``▁`` for spaces, byte fallback, no
prefix space, ``<bos>`` added by the post-processor) with
``<start_of_turn>``/``<end_of_turn>`` turn tokens and a template that folds a
system message into the first user turn; Phi-3/Phi-4-mini's is Llama-2-style
with ``<|user|>``/``<|assistant|>``/``<|end|>``. Each is built here from a
tokenizer trained on local text (``test_gguf_tokenizer._spm_folder``) with the
family's special tokens and template, then:

* encoding and decoding varied text agree with transformers' tokenizer;
* a conversation renders to the token ids transformers' ``apply_chat_template`` gives;
* the end-of-turn token a chat reply stops at is the family's;
* ``LLM.chat`` on a tiny model of the family runs the same prompt ids.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastllm.tokenizer import Tokenizer  # noqa: E402
from test_gguf_tokenizer import MULTILINGUAL, _spm_folder, _text_sample  # noqa: E402

transformers.logging.set_verbosity_error()

# The shape of Gemma 3's published template: a system message becomes the
# first user turn's prefix, "assistant" is called "model", contents are trimmed.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Phi-3 / Phi-4-mini's template shape.
PHI_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

FAMILIES = {
    "gemma": dict(
        specials=["<start_of_turn>", "<end_of_turn>"],
        template=GEMMA_TEMPLATE,
        end_of_turn="<end_of_turn>",
        prefix_space=False,
    ),
    "phi": dict(
        specials=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        template=PHI_TEMPLATE,
        end_of_turn="<|end|>",
        prefix_space=True,
    ),
}

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "  Wie spät ist es? 日本語 🦙\n"},
    {"role": "assistant", "content": "Es ist    halb drei."},
    {"role": "user", "content": "def f(x):\n\treturn x ** 2  # and <end> tags"},
]


def _family_folder(out, family: str) -> str:
    """The SentencePiece-style test tokenizer with the family's turn tokens and template."""
    spec = FAMILIES[family]
    folder = _spm_folder(out)
    path = os.path.join(folder, "tokenizer.json")
    doc = json.load(open(path, encoding="utf-8"))
    if not spec["prefix_space"]:  # Gemma: spaces become ▁, no space is prepended
        doc["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        doc["decoder"]["decoders"] = doc["decoder"]["decoders"][:-1]  # no leading-space strip
    next_id = len(doc["model"]["vocab"])
    for token in spec["specials"]:
        doc["added_tokens"].append(
            {
                "id": next_id,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        next_id += 1
    json.dump(doc, open(path, "w", encoding="utf-8"), ensure_ascii=False)
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = spec["template"]
    json.dump(cfg, open(cfg_path, "w"))
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = _family_folder(tmp_path_factory.mktemp(name), name)
    return name, folder


def test_encode_decode_match_transformers(family) -> None:
    name, folder = family
    ours = Tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    texts = [
        _text_sample(),
        MULTILINGUAL,
        " leading space",
        "trailing space ",
        "",
        "x" * 50,
        "a<end_of_turn>b<|end|>c",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), (name, text[:40])
        for skip in (True, False):
            got = ours.decode(ids, skip_special_tokens=skip)
            assert got == ref.decode(ids, skip_special_tokens=skip), (name, text[:40])
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == ref.encode(text, add_special_tokens=False)
        assert ours.decode(plain, skip_special_tokens=True) == ref.decode(
            plain, skip_special_tokens=True
        )


def test_chat_template_ids_and_end_of_turn_match_transformers(family) -> None:
    from fastllm.inputs import chat_prompt

    name, folder = family
    ours = Tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        text, ids = chat_prompt(ours, messages)
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == want, name
        want_ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
            want_ids = want_ids["input_ids"]
        assert ids == list(want_ids), name
    end = ref.convert_tokens_to_ids(FAMILIES[name]["end_of_turn"])
    assert ours.end_of_turn_token_ids()[0] == end


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_llm_chat_runs_the_family_template(tmp_path, arch: str) -> None:
    """``LLM.chat`` on a tiny model of the family: the prompt ids are the
    template's, and the reply stops at the family's end-of-turn token."""
    import shutil

    from fastllm import LLM, SamplingParams

    name = "gemma" if arch == "gemma3" else "phi"
    tok_folder = _family_folder(tmp_path / "tok", name)
    ref_tok = transformers.AutoTokenizer.from_pretrained(tok_folder)
    vocab = len(ref_tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=8, tie_word_embeddings=False
        )
    else:
        config = transformers.Phi3Config(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    end = ref_tok.convert_tokens_to_ids(FAMILIES[name]["end_of_turn"])
    want = ref_tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    if isinstance(want, dict) or hasattr(want, "input_ids"):
        want = want["input_ids"]
    with torch.no_grad():  # the head's end-of-turn row along the prompt's last hidden state
        h = model.model(torch.tensor([list(want)])).last_hidden_state[0, -1]
        model.lm_head.weight[end] = 50 * h / h.norm()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_folder, f), folder / f)
    llm = LLM(str(folder), dtype="float32")
    out = llm.chat(CONVERSATION, SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt_token_ids == list(want)
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
    assert first == end  # the reference would close the turn at once
    assert out.outputs[0].token_ids == [end] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == ""
