"""vLLM scripts that run unchanged: LLM's settings, typed prompts, SamplingParams'
extra fields, a Hugging Face-like tokenizer, and the one request rule. Every
check has an independent reference: transformers' tokenizer, brute-force
properties of the tokens drawn, or the same request written another way."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 12, **kw})


# ---- LLM(...) settings -----------------------------------------------------------


def test_vllm_engine_arguments_are_accepted(make_model):
    folder = make_model("llama")
    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        gpu_memory_utilization=0.5,
        trust_remote_code=True,
        enforce_eager=True,
        task="generate",
        tokenizer_mode="auto",
        max_logprobs=5,
        download_dir=None,
        revision=None,
    )
    (out,) = llm.generate(["x = "], _greedy(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    text = repr(llm)
    for part in (f"model={folder!r}", "device='cpu'", "dtype=float32", "quantization=None"):
        assert part in text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"task": "transcription"}, "task"),
        ({"runner": "draft"}, "runner"),
        ({"quantization": "awq"}, "quantization"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_logprobs": -3}, "max_logprobs"),
    ],
)
def test_unsupported_engine_arguments_name_the_field(make_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(make_model("llama"), device="cpu", **kwargs)


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="swap_space_gb"):
        LLM(device="cpu", swap_space_gb=4)


def test_remote_code_architecture_is_refused_clearly(make_model, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(make_model("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MyCustomForCausalLM"]
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.MyCustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    for trust in (False, True):
        with pytest.raises(ValueError, match="remote code"):
            LLM(str(folder), device="cpu", trust_remote_code=trust)


# ---- model ids --------------------------------------------------------------------


def test_hub_ids_with_and_without_org_come_from_the_local_cache(make_model, tmp_path, monkeypatch):
    """A hand-made Hugging Face cache (refs/main -> snapshots/<commit>/)."""
    cache = tmp_path / "hub"
    for repo, dirname in (("tiny", "models--tiny"), ("someorg/tiny", "models--someorg--tiny")):
        snap = cache / dirname / "snapshots" / "0123abcd"
        shutil.copytree(make_model("llama"), snap)
        (cache / dirname / "refs").mkdir()
        (cache / dirname / "refs" / "main").write_text("0123abcd")
        llm = LLM(repo, device="cpu", dtype="float32", download_dir=str(cache))
        assert os.path.samefile(llm.llm_engine.folder, snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(ValueError, match=r"huggingface-cli download gpt2` first"):
        LLM("gpt2", device="cpu")


# ---- prompts ---------------------------------------------------------------------


def test_typed_prompts_equal_plain_ones(llm):
    tok = llm.get_tokenizer()
    params = _greedy()
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    typed = llm.generate(
        [
            TextPrompt(prompt=PROMPTS[0]),
            TokensPrompt(prompt_token_ids=tok.encode(PROMPTS[1])),
            PROMPTS[2],
        ],
        params,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]
    assert typed[0].prompt == PROMPTS[0] and typed[1].prompt is None


def test_multimodal_prompt_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: multi-modal"):
        llm.generate([{"prompt": "x", "multi_modal_data": {"image": object()}}], use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0] + " " + PROMPTS[1])
    (cut,) = llm.generate([ids], _greedy(truncate_prompt_tokens=4), use_tqdm=False)
    (ref,) = llm.generate([ids[-4:]], _greedy(), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids


# ---- SamplingParams' extra fields ----------------------------------------------


def test_logit_bias_forces_a_token(llm):
    (out,) = llm.generate([PROMPTS[0]], _greedy(logit_bias={7: 100.0}), use_tqdm=False)
    assert out.outputs[0].token_ids == [7] * 12


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    allowed=st.lists(st.integers(1, 1500), min_size=1, max_size=6, unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_allowed_token_ids_bound_every_token(llm, allowed, seed):
    params = SamplingParams(max_tokens=6, seed=seed, allowed_token_ids=allowed, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_never_appear(llm):
    (free,) = llm.generate([PROMPTS[0]], _greedy(max_tokens=40), use_tqdm=False)
    words = [w for w in free.outputs[0].text.split() if len(w) >= 3]
    assert words, free.outputs[0].text
    banned = words[:2]
    (out,) = llm.generate([PROMPTS[0]], _greedy(max_tokens=40, bad_words=banned), use_tqdm=False)
    tok = llm.get_tokenizer()
    for w in banned:
        for form in (w, " " + w):
            ids = tok.encode(form, add_special_tokens=False)
            got = out.outputs[0].token_ids
            assert not any(got[i : i + len(ids)] == ids for i in range(len(got))), (w, got)


def test_detokenize_false_gives_tokens_without_text(llm):
    (ref,) = llm.generate([PROMPTS[2]], _greedy(), use_tqdm=False)
    (out,) = llm.generate([PROMPTS[2]], _greedy(detokenize=False, logprobs=1), use_tqdm=False)
    assert out.outputs[0].text == ""
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert all(lp.decoded_token is None for d in out.outputs[0].logprobs for lp in d.values())
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(detokenize=False, stop=["x"])


def test_from_optional_and_unknown_fields():
    p = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, seed=None)
    assert p.temperature == 1.0 and p.top_p == 0.5 and p.max_tokens is None and p.seed is None
    with pytest.raises(TypeError, match="best_of_n"):
        SamplingParams.from_optional(best_of_n=2)
    with pytest.raises(TypeError, match="best_of_n"):
        SamplingParams(best_of_n=2)
    with pytest.raises(ValueError, match="SamplingParams.output_kind"):
        SamplingParams(output_kind="delta")


def test_output_kinds_through_the_engine(llm):
    engine = llm.llm_engine
    got = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind)
        engine.add_request(PROMPTS[0], llm.get_tokenizer().encode(PROMPTS[0]), params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        got[kind] = outs
    final = got[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    cumulative = got[RequestOutputKind.CUMULATIVE]
    assert cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 7))
    delta = got[RequestOutputKind.DELTA]
    assert [t for o in delta for t in o.outputs[0].token_ids] == final[0].outputs[0].token_ids


# ---- limits: one rule ------------------------------------------------------------


def test_max_logprobs_bounds_logprobs(make_model):
    llm = LLM(make_model("llama"), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"prompt 0: logprobs=100000 is more than max_logprobs=20"):
        llm.generate(["x"], _greedy(logprobs=100000), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate(["x"], _greedy(prompt_logprobs=21), use_tqdm=False)
    wide = LLM(make_model("llama"), device="cpu", dtype="float32", max_logprobs=30)
    (out,) = wide.generate(["x"], _greedy(logprobs=30, max_tokens=2), use_tqdm=False)
    assert all(len(d) >= 30 for d in out.outputs[0].logprobs)


# ---- the tokenizer, against transformers' on the same files -----------------------


def test_get_tokenizer_behaves_like_transformers(llm):
    transformers = pytest.importorskip("transformers")
    from fastllm.demo import demo_model_path

    ref = transformers.AutoTokenizer.from_pretrained(demo_model_path())
    tok = llm.get_tokenizer()
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok(text).input_ids == tok.encode(text) == ref.encode(text)
    assert tok([text, "x"])["input_ids"] == ref([text, "x"])["input_ids"]
    ids = ref.encode(text) + [ref.eos_token_id]
    assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.batch_decode([ids, ids[:3]]) == ref.batch_decode([ids, ids[:3]])
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[0]) == ref.convert_ids_to_tokens(ids[0])
    toks = ref.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(toks) == ref.convert_tokens_to_ids(toks)
    assert tok.tokenize(text) == ref.tokenize(text)
    assert tok.eos_token_id == ref.eos_token_id and tok.eos_token == ref.eos_token
    assert tok.pad_token_id == ref.pad_token_id
    assert len(tok) == len(ref) and tok.vocab_size == ref.vocab_size
    assert tok.get_vocab() == ref.get_vocab()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for gen in (False, True):
        assert tok.apply_chat_template(
            conv, add_generation_prompt=gen, return_dict=False
        ) == ref.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False)
        assert tok.apply_chat_template(conv, add_generation_prompt=gen) == ref.apply_chat_template(
            conv, add_generation_prompt=gen
        )
        assert tok.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=gen
        ) == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


# ---- chat turns end ---------------------------------------------------------------


def test_chat_reply_stops_at_the_end_of_turn_token(llm):
    tok = llm.get_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.end_of_turn_token_ids()
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={im_end: 100.0})
    (reply,) = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    c = reply.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("stop", im_end, [im_end], "")
    # generate() knows nothing of turns: the same bias runs to max_tokens
    (plain,) = llm.generate(["hi"], params, use_tqdm=False)
    assert plain.outputs[0].finish_reason == "length"


# ---- no tokenizer ----------------------------------------------------------------


def test_dummy_weights_from_config_json_alone(make_model, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(os.path.join(make_model("llama"), "config.json"), folder / "config.json")
    llm = LLM(str(folder), device="cpu", load_format="dummy")
    (out,) = llm.generate([{"prompt_token_ids": [3, 4, 5]}], _greedy(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
