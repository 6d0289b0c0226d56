"""``LLM.stream`` joined equals ``LLM.generate``: text, tokens, logprobs and finish,
with stop strings that span several tokens, ``include_stop_str_in_output`` both
ways and ``n = 2`` (the demo model, which writes real words)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fastllm import LLM, SamplingParams  # noqa: E402

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def _joined(llm: LLM, prompt: str, params: SamplingParams) -> dict[int, dict]:
    """The stream of one request, joined per completion index."""
    joined: dict[int, dict] = {}
    finished = 0
    for out in llm.stream(prompt, params):
        finished += out.finished
        for c in out.outputs:
            j = joined.setdefault(c.index, {"text": "", "tokens": [], "logprobs": [], "ends": 0})
            assert j["ends"] == 0, "a completion goes on after its finish"
            j["text"] += c.text
            j["tokens"] += c.token_ids
            j["logprobs"] += c.logprobs or []
            if c.finish_reason is not None:
                j["ends"] += 1
                j["finish"] = (c.finish_reason, c.stop_reason)
    assert finished == 1, "exactly the last output is marked finished"
    return joined


def _assert_stream_matches(llm: LLM, prompt: str, params: SamplingParams) -> list:
    (whole,) = llm.generate([prompt], params, use_tqdm=False)
    joined = _joined(llm, prompt, params)
    assert sorted(joined) == [c.index for c in whole.outputs]
    for c in whole.outputs:
        j = joined[c.index]
        assert j["text"] == c.text
        assert j["tokens"] == c.token_ids
        assert j["finish"] == (c.finish_reason, c.stop_reason)
        if params.logprobs is not None:
            assert [{t: v.logprob for t, v in d.items()} for d in j["logprobs"]] == [
                {t: v.logprob for t, v in d.items()} for d in c.logprobs
            ]
    return whole.outputs


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["line.", "self.lin", "list of the"])
def test_stream_with_stop_strings_of_the_demo_model(llm, stop, include):
    """Greedy text of the demo model meets these stop strings a few tokens in."""
    params = SamplingParams(
        temperature=0.0, max_tokens=96, stop=[stop], include_stop_str_in_output=include
    )
    (c,) = _assert_stream_matches(llm, PROMPT, params)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text.endswith(stop) == include


def _multi_token_stop(llm: LLM, token_ids: list[int], text: str) -> str:
    """A piece of ``text`` that is several tokens long (a stop string the stream
    can only see complete after more than one step)."""
    tok = llm.get_tokenizer()
    for k in range(2, len(token_ids) - 3):
        piece = tok.decode(token_ids[k : k + 3])
        first = tok.decode(token_ids[k : k + 1])
        if len(piece.strip()) >= 4 and len(first) < len(piece) and piece in text:
            return piece
    pytest.skip("no multi-token piece in the sampled text")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", [1, 7])
def test_seeded_n2_stream_with_a_stop_string_from_the_text(llm, seed, include):
    free = SamplingParams(n=2, temperature=0.8, seed=seed, max_tokens=48)
    (ref,) = llm.generate([PROMPT], free, use_tqdm=False)
    c0 = ref.outputs[0]
    stop = _multi_token_stop(llm, c0.token_ids, c0.text)
    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=seed,
        max_tokens=48,
        stop=[stop],
        include_stop_str_in_output=include,
        logprobs=2,
    )
    outs = _assert_stream_matches(llm, PROMPT, params)
    assert outs[0].stop_reason == stop  # completion 0 meets it: it was taken from its text
    assert outs[0].text.endswith(stop) == include


def test_stream_without_stop_strings_and_at_max_tokens(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    outs = _assert_stream_matches(llm, PROMPT, params)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in outs)
