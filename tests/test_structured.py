"""Structured outputs: every constrained generation of a tiny random model
(which never writes valid JSON by chance) validates with an independent
checker, the token mask equals what an independent build of the grammar
engine (the ``llguidance`` Python package) computes, and seeds, batch
invariance and preemption hold with constrained and unconstrained requests
mixed in one batch."""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema
import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastllm import LLM, SamplingParams, StructuredOutputsParams, _core

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -50, "maximum": 50},
            "kind": {"enum": ["cat", "dog", "fish"]},
            "owner": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["ok"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 3},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["id", "kind", "owner", "tags"],
        "additionalProperties": False,
    },
    "array_of_points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                "label": {"anyOf": [{"type": "null"}, {"const": "origin"}]},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "maxItems": 4,
    },
}

# [0-9], not \d: the grammar engine's \d is Unicode's (a newer Unicode than
# Python's re knows), so the two checkers would disagree on rare digits.
REGEXES = [r"[a-c]{2}-[0-9]{3}", r"(ab|cd)+x?", r"[0-9]{1,3}(\.[0-9]{1,2})?"]
CHOICES = ["red", "green", "blue", "dark red"]
# A small arithmetic grammar, the same text for fastllm and for the Lark parser.
# Finite (at most three terms, groups of at most three numbers), so that every
# generation ends within max_tokens.
GRAMMAR = r"""
start: expr
expr: term | term OP term | term OP term OP term
term: NUMBER | "(" group ")"
group: NUMBER | NUMBER OP NUMBER | NUMBER OP NUMBER OP NUMBER
OP: "+" | "*" | "-"
NUMBER: /[0-9]{1,3}/
"""
N = 200


@pytest.fixture(scope="module")
def llm(make_model):
    return LLM(make_model("llama"), dtype="float32", device="cpu")


def constrained(seed: int, max_tokens: int = 160, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def run(llm, params: list[SamplingParams], prompt: str = "The answer:") -> list:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


# ---- every generation validates ----------------------------------------


# Whitespace: none, a bounded pattern, or any (a random model at temperature 1
# writes long runs of it, so "any" is sampled on the smallest schema only).
WHITESPACE = {
    "compact": {"disable_any_whitespace": True},
    "pattern": {"whitespace_pattern": r"[ \n]{0,2}"},
    "any": {},
}
JSON_CASES = [(name, "compact") for name in sorted(SCHEMAS)] + [
    ("nested", "pattern"),
    ("array_of_points", "pattern"),
    ("person", "any"),
]


@pytest.mark.parametrize(("name", "whitespace"), JSON_CASES)
def test_json_schema_outputs_validate(llm, name, whitespace):
    schema = SCHEMAS[name]
    budget = 480 if whitespace == "any" else 160
    params = [constrained(s, budget, json=schema, **WHITESPACE[whitespace]) for s in range(N)]
    for out in run(llm, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', "S", out.text)
        if whitespace == "compact":
            assert not re.search(r"\s", outside_strings), out.text
        if whitespace == "pattern":
            assert not re.search(r"\s{3}|\t", outside_strings), out.text


def test_json_object_outputs_parse(llm):
    # Any object: keys and values are free, so a random model's objects only end
    # in time with bounded whitespace; the finished ones must all parse.
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(
                json_object=True, disable_any_whitespace=True
            ),
        )
        for s in range(N)
    ]
    outs = run(llm, params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) > N // 4
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text
    for out in outs:
        assert out.text.startswith("{")


@pytest.mark.parametrize("rx", REGEXES)
def test_regex_outputs_fullmatch(llm, rx):
    outs = run(llm, [constrained(s, regex=rx, max_tokens=40) for s in range(N)])
    for out in outs:
        assert out.finish_reason == "stop"
        assert re.fullmatch(rx, out.text), out.text


def test_choice_outputs_are_choices(llm):
    outs = run(llm, [constrained(s, choice=CHOICES) for s in range(N)])
    assert {o.text for o in outs} <= set(CHOICES)
    assert len({o.text for o in outs}) > 1  # seeds do change the draw


def test_grammar_outputs_parse(llm):
    parser = lark.Lark(GRAMMAR, start="start")
    outs = run(llm, [constrained(s, grammar=GRAMMAR, max_tokens=80) for s in range(N)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        parser.parse(out.text)  # raises on a text outside the grammar
    assert len({o.text for o in outs}) > N // 2


# ---- the mask is exact -----------------------------------------------------


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer.json of 8,192 tokens (multi-token keys and
    numbers, so forced text has several tokenizations to choose from)."""
    from conftest import train_byte_level_bpe

    path = tmp_path_factory.mktemp("big-tokenizer") / "tokenizer.json"
    train_byte_level_bpe(8192).save(str(path))
    return str(path)


@pytest.fixture(scope="module", params=["model", "big"])
def reference(request, llm, big_tokenizer):
    """Ours and llguidance's own Python build over the same tokenizer (the
    test model's, and a larger one with padding logits past its tokens):
    (our GrammarVocabulary, llguidance module, its tokenizer, EOS ids)."""
    import llguidance
    import llguidance.hf
    import transformers

    eng = llm.llm_engine
    if request.param == "model":
        path = os.path.join(eng.folder, "tokenizer.json")
        ours, n_vocab = eng.structured.vocabulary, eng.model_config.vocab_size
    else:
        path, n_vocab = big_tokenizer, 8192 + 64
        with open(path, "rb") as f:
            ours = _core.GrammarVocabulary(f.read(), [0], n_vocab)
    eos = [0] if request.param == "big" else sorted(eng.eos_token_ids)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
    return ours, llguidance, tok, set(eos)


def reference_grammar(llguidance, kind: str, value, flexible: bool) -> str:
    M = llguidance.LLMatcher
    if kind == "json":
        return M.grammar_from_json_schema(value, defaults={"whitespace_flexible": flexible})
    if kind == "json_object":
        return M.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": flexible}
        )
    if kind == "regex":
        return M.grammar_from_regex(value)
    if kind == "choice":
        return M.grammar_from_regex("(?:" + "|".join(re.escape(c) for c in value) + ")")
    return M.grammar_from_lark(value)


def reference_allowed(matcher, vocab: int) -> list[int]:
    bits = int.from_bytes(matcher.compute_bitmask(), "little")
    return [t for t in range(vocab) if bits >> t & 1]


CONSTRAINTS = [
    *(("json", json.dumps(s)) for s in SCHEMAS.values()),
    *(("regex", r) for r in REGEXES),
    ("choice", CHOICES),
    ("grammar", GRAMMAR),
    ("json_object", None),
]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.integers(0, len(CONSTRAINTS) - 1),
    flexible=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 40),
)
def test_mask_equals_llguidance_python(reference, which, flexible, seed, steps):
    vocab, llguidance, tok, eos = reference
    kind, value = CONSTRAINTS[which]
    ours = vocab.start(kind, value, flexible)
    ref_value = json.loads(value) if kind == "json" else value
    theirs = llguidance.LLMatcher(tok, reference_grammar(llguidance, kind, ref_value, flexible))
    assert not theirs.is_error(), theirs.get_error()
    rng = random.Random(seed)
    for _ in range(steps):
        allowed = ours.allowed_tokens()
        assert allowed == reference_allowed(theirs, vocab.vocab_size)
        assert ours.is_accepting() == theirs.is_accepting()
        assert bool(eos & set(allowed)) == theirs.is_accepting()  # EOS exactly when accepting
        choices = [t for t in allowed if t not in eos]
        if not choices:
            break
        t = rng.choice(choices)
        ours.consume(t)
        assert theirs.consume_token(t)


# ---- parameters --------------------------------------------------------------


def test_bad_schema_names_field_and_path():
    schema = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ValueError, match=r"structured_outputs|StructuredOutputsParams\.json") as e:
        StructuredOutputsParams(json=schema)
    assert "#/properties/a/uniqueItems" in str(e.value)
    with pytest.raises(ValueError, match="StructuredOutputsParams.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="StructuredOutputsParams.regex"):
        StructuredOutputsParams(regex="(")
    with pytest.raises(ValueError, match="StructuredOutputsParams.grammar"):
        StructuredOutputsParams(grammar="start: missing_rule")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="StructuredOutputsParams.choice"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs="json")
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs.constraint == ("regex", "a+")
    assert p.clone().structured_outputs == p.structured_outputs


def test_compiled_grammars_are_cached(llm):
    vocab = llm.llm_engine.structured.vocabulary
    before = vocab.cached_grammars
    schema = {
        "type": "object",
        "properties": {"q": {"const": 7}},
        "required": ["q"],
        "additionalProperties": False,
    }
    outs = run(llm, [constrained(s, json=schema, disable_any_whitespace=True) for s in range(3)])
    assert vocab.cached_grammars == before + 1
    assert [o.text for o in outs] == ['{"q":7}'] * 3


# ---- seeds, batches, forks and preemption ----------------------------------


def mixed_params(count: int) -> list[SamplingParams]:
    out = []
    for i in range(count):
        if i % 3 == 0:
            out.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24))
        elif i % 3 == 1:
            out.append(constrained(100 + i, json=SCHEMAS["person"]))
        else:
            out.append(constrained(100 + i, regex=REGEXES[i % len(REGEXES)], max_tokens=40))
    return out


def test_mixed_batch_is_batch_invariant(llm):
    params = mixed_params(12)
    prompts = [f"Item {i}:" for i in range(12)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 1, 2, 7):
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids


def test_forks_follow_their_own_grammar_state(llm):
    p = constrained(3, choice=CHOICES)
    p = p.clone(n=6)
    outs = llm.generate(["Pick:"], p, use_tqdm=False)[0].outputs
    assert len(outs) == 6 and all(o.text in CHOICES for o in outs)
    for j, o in enumerate(outs):  # completion j samples with seed + j, as alone
        alone = llm.generate(["Pick:"], constrained(3 + j, choice=CHOICES), use_tqdm=False)
        assert alone[0].outputs[0].text == o.text


def test_preemption_with_constrained_requests(make_model, llm):
    folder = make_model("llama")
    prompts = [f"Item {i}: " + "word " * 12 for i in range(8)]
    params = mixed_params(8)
    ref = llm.generate(prompts, params, use_tqdm=False)
    small = LLM(
        folder,
        dtype="float32",
        device="cpu",
        block_size=8,
        max_model_len=256,
        kv_cache_memory_bytes=40 * 4096,
    )
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_bad_tokenizers_are_errors(big_tokenizer):
    with open(big_tokenizer, "rb") as f:
        data = f.read()
    with pytest.raises(ValueError, match="EOS token id 9000 is outside"):
        _core.GrammarVocabulary(data, [9000], 9100)
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        _core.GrammarVocabulary(data, [0], 100)
    with pytest.raises(ValueError, match="tokenizer.json: not valid JSON"):
        _core.GrammarVocabulary(b"{not json", [0], 100)
    with pytest.raises(ValueError, match="at least one EOS"):
        _core.GrammarVocabulary(data, [], 9000)


def test_no_tokenizer_is_a_request_error(make_model, tmp_path):
    import shutil

    folder = tmp_path / "noTok"
    shutil.copytree(make_model("llama"), folder)
    llm = LLM(str(folder), dtype="float32", device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, constrained(0, regex="a"), use_tqdm=False)


def test_bitmask_layout_matches_allowed_tokens(llm):
    import torch

    from fastllm.engine.structured import unpack_bitmask

    vocab = llm.llm_engine.structured.vocabulary
    m = vocab.start("regex", REGEXES[0])
    m.consume(m.allowed_tokens()[0])
    words = (vocab.vocab_size + 31) // 32
    raw = _core.grammar_bitmask([m], vocab.vocab_size)
    bits = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(1, words)
    allowed = unpack_bitmask(bits, vocab.vocab_size)[0].nonzero().flatten().tolist()
    assert allowed == m.allowed_tokens()


def test_chat_end_of_turn_ends_an_accepting_grammar(llm):
    # (ab|cd)+ may go on after any complete match: the template's end of turn
    # (a stop token, not the model's EOS) is allowed exactly there.
    tok = llm.get_tokenizer()
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    rx = r"(ab|cd)+"
    convs = [[{"role": "user", "content": f"Say {i}"}] for i in range(N)]
    params = [constrained(s, regex=rx, max_tokens=60) for s in range(N)]
    outs = llm.chat(convs, params, use_tqdm=False)
    ended_by_turn = 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert re.fullmatch(rx, c.text), c.text
            ended_by_turn += c.stop_reason == end_of_turn
        else:  # out of tokens mid-way: still a prefix of a match
            assert c.finish_reason == "length" and re.fullmatch(r"((ab|cd)*)(a|c)?", c.text)
    assert ended_by_turn > N // 4


def test_bitmask_path_equals_the_sampler_pass(llm):
    # The CUDA sampler's masks go through the bitmask; here on CPU logits, the
    # same code must give exactly what the Rust pass writes.
    import torch

    from fastllm.engine.sequence import Sequence
    from fastllm.engine.structured import GrammarMasks

    vocab = llm.llm_engine.structured.vocabulary
    rng = random.Random(7)
    seqs = []
    for i, (kind, value) in enumerate(CONSTRAINTS * 2):
        seq = Sequence(str(i), [1, 2, 3], SamplingParams(stop_token_ids=[2]), seed=i)
        if i % 3:  # some rows unconstrained
            seq.grammar = vocab.start(kind, value)
            for _ in range(rng.randrange(6)):
                allowed = [t for t in seq.grammar.allowed_tokens() if t not in (0, 2)]
                if not allowed:
                    break
                seq.grammar.consume(rng.choice(allowed))
        seqs.append(seq)
    seqs.append(seqs[1])  # one sequence on two rows (n > 1 first tokens)
    logits = torch.randn(len(seqs), vocab.vocab_size, generator=torch.Generator().manual_seed(0))
    a, b = logits.clone(), logits.clone()
    GrammarMasks(seqs).apply(a)
    GrammarMasks(seqs).apply(b, bitmask=True)
    assert torch.equal(a, b)
    assert torch.equal(a[-1], a[1])
    for i, seq in enumerate(seqs):
        finite = a[i].isfinite().nonzero().flatten().tolist()
        if seq.grammar is None:
            assert len(finite) == vocab.vocab_size
        else:
            expect = set(seq.grammar.allowed_tokens())
            if seq.grammar.is_accepting():
                expect.add(2)  # the stop token counts as EOS
            assert finite == sorted(expect)


def test_masks_computed_during_the_forward_pass_give_the_same_tokens(llm):
    runner = llm.llm_engine.runner
    params = mixed_params(9)
    prompts = [f"Item {i}:" for i in range(9)]
    ref = llm.generate(prompts, params, use_tqdm=False)
    runner.overlap_masks = True  # as on a GPU: masks on a worker thread during the forward
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.overlap_masks = False
    assert runner._mask_worker is not None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_structured_bench_script_runs(make_model, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "so.json"
    cmd = [
        sys.executable,
        os.path.join(root, "benches", "structured_outputs.py"),
        make_model("llama"),
        "--batch", "4", "--steps", "2", "--rounds", "1", "--dtype", "float32",
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["sequences_alive_at_last_step"]["json"] == [4]
    assert report["json_over_free"] > 0 and report["ttft_new_schema_over_free"] > 0


def test_stream_joins_to_generate(llm):
    for s in range(5):
        p = constrained(s, json=SCHEMAS["person"], disable_any_whitespace=True)
        whole = llm.generate(["Person:"], p, use_tqdm=False)[0].outputs[0]
        parts = [c.outputs[0].text for c in llm.stream("Person:", p)]
        assert "".join(parts) == whole.text
        jsonschema.validate(json.loads(whole.text), SCHEMAS["person"])


def test_a_gguf_file_with_its_own_tokenizer(make_model, tmp_path):
    # A GGUF file's tokenizer is built in memory (no tokenizer.json on disk):
    # its grammar vocabulary comes from the same tokenizer, and masks hold.
    from gguf_models import write_gguf

    path = write_gguf(
        make_model("llama"), str(tmp_path / "m.gguf"), "llama", "Q8_0", tokenizer=True
    )
    llm = LLM(path, dtype="float32", device="cpu")
    params = [
        constrained(s, json=SCHEMAS["person"], disable_any_whitespace=True) for s in range(20)
    ]
    for out in run(llm, params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS["person"])
