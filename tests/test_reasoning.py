"""Reasoning models: the thinking split from the answer (whole and streamed,
with the tags cut across deltas in every way), chat template kwargs that
render the prompt transformers renders, a thinking budget the engine
enforces, structured outputs that apply to the answer after the thinking,
and request fields the server does not know answered with a 400."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm.reasoning import REASONING_PARSERS, reasoning_parser
from tiny_models import tiny_qwen3_config

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen3's template in little: thinking on unless enable_thinking is false,
# which writes an empty block into the prompt.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# A thinking-only template (as Qwen3's 2507 thinking models): the prompt opens the block.
OPEN_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}",
    "<think>\n",
)
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


# ---- the parser alone ------------------------------------------------------------

_piece = st.text(alphabet="ab <>/\nthink", max_size=12).filter(
    lambda s: "<think>" not in s and "</think>" not in s
)


def _streamed(parser, text: str, prompt: str | None, cuts: list[int]):
    s = parser.stream(prompt)
    r = c = ""
    prev = 0
    for k in sorted({min(x, len(text)) for x in cuts}) + [len(text)]:
        a, b = s.add(text[prev:k])
        r, c, prev = r + a, c + b, k
    a, b = s.finish()
    return (r + a) or None, (c + b) or None


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(n for n, p in REASONING_PARSERS.items() if p.start == "<think>")),
    lead=st.sampled_from(["", "\n", "  "]),
    opened=st.booleans(),
    closed=st.booleans(),
    reasoning=_piece,
    answer=_piece,
    prompt_open=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_split_and_stream(name, lead, opened, closed, reasoning, answer, prompt_open, cuts):
    parser = reasoning_parser(name)
    prompt = "<|im_start|>assistant\n" + ("<think>\n" if prompt_open else "")
    text = lead + ("<think>" if opened else "") + reasoning
    if closed:
        text += "</think>" + answer
    whole = parser.split(text, prompt)
    assert _streamed(parser, text, prompt, cuts) == whole
    thinks = opened or prompt_open or parser.implicit_start
    if thinks:
        assert whole == (reasoning.strip() or None, (answer.lstrip() or None) if closed else None)
    else:
        assert whole == (None, text.lstrip() or None)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        reasoning_parser("nope")
    from fastllm.config import EngineConfig

    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'nope'"):
        EngineConfig(model="x", reasoning_parser="nope").validate()


# ---- gpt-oss's harmony messages ---------------------------------------------------

HARMONY_END = ["<|end|>", "<|return|>", "<|call|>", ""]
_body = st.text(alphabet="ab <>|/\nmesagchnl", max_size=14).filter(
    lambda s: (
        not any(m in s for m in ("<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|message|>"))
    )
)


def _harmony(messages: list[tuple[str, str, str]]) -> str:
    """Messages (channel, body, end marker) as a reply in harmony's format;
    the channel ``call`` is a commentary message to a function (its recipient
    before the channel, or after it with a ``<|constrain|>``)."""
    out = []
    for i, (channel, body, end) in enumerate(messages):
        head = "" if i == 0 else "<|start|>assistant"
        if channel == "call" and i % 2:
            head, channel = f"{head} to=functions.f_{i}", "commentary json"
        elif channel == "call":
            channel = f"commentary to=functions.f_{i} <|constrain|>json"
        out.append(f"{head}<|channel|>{channel}<|message|>{body}{end}")
    return "".join(out)


def _answer_part(i: int, channel: str, body: str) -> str:
    """What message ``i`` adds to the answer: its body, a function call's as
    the Hermes call the tool parser reads."""
    if channel != "call":
        return body
    return f'<tool_call>\n{{"name": "f_{i}", "arguments": {body}}}\n</tool_call>'


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(
        st.tuples(
            st.sampled_from(["analysis", "final", "commentary", "call"]),
            _body,
            st.sampled_from(HARMONY_END),
        ),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 120), max_size=12),
)
def test_harmony_split_and_stream(messages, cuts):
    """The analysis channel is the reasoning, the other channels the answer,
    the markup removed, a function call as a Hermes call; streamed deltas
    (cut anywhere) join to the whole."""
    for i, (channel, body, end) in enumerate(messages[:-1]):
        messages[i] = (channel, body, end or "<|end|>")  # only the last may be cut off
    parser = reasoning_parser("openai_gptoss")
    text = _harmony(messages)
    whole = parser.split(text)
    assert _streamed(parser, text, None, cuts) == whole
    reasoning = "".join(b for c, b, _ in messages if c == "analysis")
    answer = "".join(
        _answer_part(i, c, b) for i, (c, b, _) in enumerate(messages) if c != "analysis"
    )
    assert whole == (reasoning or None, answer or None)


def test_harmony_function_calls_become_tool_calls():
    """gpt-oss's calls (``to=functions.NAME``, JSON arguments, ``<|call|>``)
    reach the ``openai`` tool format as calls, streamed or whole: the
    reasoning first, then a preamble in the commentary channel as content,
    then each call with its name and arguments."""
    from fastllm.server.tools import Tool, ToolStream, parse_as, parse_reply

    parser = reasoning_parser("openai_gptoss")
    tools = [Tool("get_weather", {"type": "object"}), Tool("add", {"type": "object"})]
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "unit": "C"}<|call|>'
        '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    )
    reasoning, content = parser.split(reply)
    assert reasoning == "Need the weather."
    text, calls = parse_reply(content, parse_as("openai"), tools)
    assert text == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("add", {"a": 1}),
    ]
    for cut in (1, 3, 7):
        split, stream = parser.stream(), ToolStream(parse_as("openai"), tools, False)
        deltas = []
        for k in range(0, len(reply), cut):
            deltas += stream.add(split.add(reply[k : k + cut])[1])
        deltas += stream.add(split.finish()[1])
        last, called = stream.finish()
        deltas += last
        assert called
        names = [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d]
        assert [n for n in names if n] == ["get_weather", "add"]
    # arguments cut off by max_tokens stay text, never a call
    cut_off = parser.split('<|channel|>commentary to=functions.add<|message|>{"a": ')[1]
    assert parse_reply(cut_off, "hermes", tools)[1] == []


def test_harmony_edges():
    parser = reasoning_parser("openai_gptoss")
    assert parser.split("Hello <|end|> there") == (None, "Hello <|end|> there")  # no header
    assert parser.split("<|channel|>analysis<|mess") == (None, None)  # a header cut off
    assert parser.split("<|channel|>analysis<|message|>hmm") == ("hmm", None)
    reply = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
    assert parser.split(reply + "<|message|>Hi!<|return|>") == ("Think.", "Hi!")
    assert parser.keeps_special_tokens and not reasoning_parser("qwen3").keeps_special_tokens


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"]


def test_harmony_engine_keeps_the_markers_and_refuses_grammars(tmp_path, tokenizer_dir):
    """With ``openai_gptoss`` the engine decodes replies with the special
    tokens kept (the split reads and removes them), whatever the request
    asked; a grammar is refused by name."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    from fastllm import LLM, SamplingParams
    from fastllm.sampling_params import StructuredOutputsParams

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = open(os.path.join(tokenizer_dir, "tokenizer_config.json")).read()
    (tmp_path / "tokenizer_config.json").write_text(cfg)
    eos = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tiny_qwen3_config(tok.get_vocab_size(), eos))
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, reasoning_parser="openai_gptoss")
    ids = [tok.token_to_id(t) for t in HARMONY_TOKENS]
    params = SamplingParams(
        max_tokens=24, seed=1, ignore_eos=True, logit_bias={i: 6.0 for i in ids}
    )
    (out,) = llm.generate(["hello"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=False)
    assert any(t in c.text for t in HARMONY_TOKENS)  # the bias made the model write markers
    parser = reasoning_parser("openai_gptoss")
    assert (c.reasoning_content, c.content) == parser.split(c.text)
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(["hello"], grammar, use_tqdm=False)


# ---- a tiny Qwen3-style model ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Qwen3 model whose tokenizer has Qwen3's think and tool tags
    as added (non-special) tokens and the template above."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path_factory.mktemp("qwen3-think")
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads(open(os.path.join(tokenizer_dir, "tokenizer_config.json")).read())
    cfg["chat_template"] = QWEN3_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    eos = tok.token_to_id("<|endoftext|>")
    config = tiny_qwen3_config(tok.get_vocab_size(), eos)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    from fastllm import LLM

    return LLM(
        qwen3_dir, dtype="float32", device="cpu", max_model_len=256, reasoning_parser="qwen3"
    )


def _hf_ids(folder: str, messages, **kw) -> list[int]:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_kwargs_render_what_transformers_renders(llm, qwen3_dir, kwargs):
    from fastllm import SamplingParams

    (out,) = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template_kwargs=kwargs,
    )
    assert out.prompt_token_ids == _hf_ids(qwen3_dir, MESSAGES, **kwargs)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    (out,) = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False, tools=tools)
    assert out.prompt_token_ids == _hf_ids(qwen3_dir, MESSAGES, tools=tools)
    assert "get_weather" in out.prompt


def test_continue_final_message(llm):
    from fastllm import SamplingParams

    conv = MESSAGES + [{"role": "assistant", "content": "It returns"}]
    (out,) = llm.chat(
        conv,
        SamplingParams(max_tokens=2, temperature=0),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert out.prompt.endswith("<|im_start|>assistant\nIt returns")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(conv, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'messages'"):
        llm.chat(conv, chat_template_kwargs={"messages": []}, use_tqdm=False)


# ---- the engine: thinking budget and constraints after the thinking ----------------


def _ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _check_split(llm, c) -> None:
    """The output's reasoning_content / content are its tokens before and after
    the closing tag (decoded apart: an independent reading of the split)."""
    (end,) = _ids(llm, "</think>")
    tok = llm.get_tokenizer()
    ids = list(c.token_ids)
    if isinstance(c.stop_reason, int):
        ids = ids[:-1]  # the stop token is not text
    if end in ids:
        k = ids.index(end)
        before = tok.decode(ids[:k], skip_special_tokens=True)
        after = tok.decode(ids[k + 1 :], skip_special_tokens=True).rstrip("\ufffd")
        if before.lstrip().startswith("<think>"):
            before = before.lstrip().removeprefix("<think>")
        assert c.reasoning_content == (before.strip() or None)
        assert (c.content or "").rstrip("\ufffd") == after.lstrip()


def test_thinking_budget_closes_the_block_and_keeps_its_tokens(llm):
    from fastllm import SamplingParams

    (end,) = _ids(llm, "</think>")
    kw = dict(use_tqdm=False, chat_template=OPEN_TEMPLATE)
    (free,) = llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0), **kw)
    for budget in (0, 1, 4):
        params = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=budget)
        (out,) = llm.chat(MESSAGES, params, **kw)
        c = out.outputs[0]
        ids = list(c.token_ids)
        k = ids.index(end)
        assert k <= budget
        # the thinking is what the model writes unbudgeted, up to the budget
        assert ids[:k] == list(free.outputs[0].token_ids[:k])
        if end not in free.outputs[0].token_ids[:budget]:
            assert k == budget
        _check_split(llm, c)
        if k > 0:
            assert (
                c.reasoning_content is not None or not llm.get_tokenizer().decode(ids[:k]).strip()
            )


def test_structured_output_applies_after_the_thinking(llm):
    from fastllm import SamplingParams
    from fastllm.sampling_params import StructuredOutputsParams

    (start,) = _ids(llm, "<think>")
    (end,) = _ids(llm, "</think>")
    kw = dict(use_tqdm=False, chat_template=OPEN_TEMPLATE)
    (free,) = llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0), **kw)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(
        max_tokens=30, temperature=0, thinking_token_budget=5, structured_outputs=choice
    )
    (out,) = llm.chat(MESSAGES, params, **kw)
    c = out.outputs[0]
    k = list(c.token_ids).index(end)
    # the grammar did not touch the thinking: it is the unconstrained reply's start
    assert list(c.token_ids[:k]) == list(free.outputs[0].token_ids[:k])
    assert c.content in ("yes", "no") and c.finish_reason == "stop"
    _check_split(llm, c)
    # A reply that may open a block (the template leaves it closed): the opening
    # tag stays allowed beside the grammar's tokens.
    bias = SamplingParams(
        max_tokens=30,
        temperature=0,
        thinking_token_budget=3,
        structured_outputs=choice,
        logit_bias={start: 100.0},
    )
    (out,) = llm.chat(MESSAGES, bias, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids[0] == start and end in c.token_ids
    assert c.content in ("yes", "no")
    assert c.reasoning_content == "<think>" * 3  # the budget: 3 tokens after the opening tag
    # No thinking: the grammar applies from the first token.
    (out,) = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=30, temperature=0, structured_outputs=choice),
        use_tqdm=False,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].reasoning_content is None


def test_n2_and_streaming_split(llm):
    from fastllm import SamplingParams

    (end,) = _ids(llm, "</think>")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=2, thinking_token_budget=3)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=OPEN_TEMPLATE)
    for c in out.outputs:
        assert end in c.token_ids[:4]
        _check_split(llm, c)
    one = SamplingParams(max_tokens=10, temperature=0, thinking_token_budget=3)
    (whole,) = llm.chat(MESSAGES, one, use_tqdm=False, chat_template=OPEN_TEMPLATE)
    r = c = ""
    for delta in llm.stream(whole.prompt, one):
        (d,) = delta.outputs
        r, c = r + d.reasoning_content, c + d.content
    assert ((r or None), (c or None)) == (
        whole.outputs[0].reasoning_content,
        whole.outputs[0].content,
    )


def test_budget_needs_a_parser(qwen3_dir):
    from fastllm import LLM, SamplingParams

    plain = LLM(qwen3_dir, dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        plain.generate(["x"], SamplingParams(thinking_token_budget=2), use_tqdm=False)
    (out,) = plain.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.outputs[0].reasoning_content is None and out.outputs[0].content is None


# ---- over HTTP ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(qwen3_dir):
    """The model served in this process with --reasoning-parser qwen3: (app, (host, port))."""
    from server_process import app_server

    with app_server(qwen3_dir, 256, reasoning_parser="qwen3", served_model_name="x") as running:
        yield running


def _post(addr, path: str, body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _client(addr):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{addr[0]}:{addr[1]}/v1", api_key="x", max_retries=0)


def _streamed_chat(client, **kw) -> tuple[str | None, str | None, list, str]:
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = ch.finish_reason or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish


def test_template_kwargs_over_http_match_transformers(served, qwen3_dir):
    app, addr = served
    for kwargs in ({"enable_thinking": False}, {}):
        status, body = _post(
            addr, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs}
        )
        assert status == 200, body
        assert body["tokens"] == _hf_ids(qwen3_dir, MESSAGES, **kwargs)
        status, reply = _post(
            addr,
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs},
        )
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == len(body["tokens"])


def test_reasoning_content_whole_streamed_and_offline(served, llm):
    from fastllm import SamplingParams

    _, addr = served
    client = _client(addr)
    extra = {"chat_template": OPEN_TEMPLATE, "thinking_token_budget": 4}
    kw = dict(model="x", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=extra)
    whole = client.chat.completions.create(**kw).choices[0].message.model_dump()
    params = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=4)
    (offline,) = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=OPEN_TEMPLATE)
    o = offline.outputs[0]
    assert (whole["reasoning_content"], whole["content"]) == (o.reasoning_content, o.content)
    assert o.reasoning_content is not None
    reasoning, content, calls, _ = _streamed_chat(client, **kw)
    assert (reasoning, content, calls) == (whole["reasoning_content"], whole["content"], [])


def test_tool_calls_are_parsed_from_the_answer_only(served, llm):
    """Thinking full of tool-call tags stays reasoning; the forced call after it is the call."""
    _, addr = served
    client = _client(addr)
    (tag,) = _ids(llm, "<tool_call>")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    template = OPEN_TEMPLATE.replace("{{ t.function.name }}", "{{ t.function.name }} <tool_call>")
    extra = {"chat_template": template, "thinking_token_budget": 3}
    kw = dict(
        model="x",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        tools=tools,
        tool_choice="required",
        logit_bias={str(tag): 100},
        extra_body=extra,
    )
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content == "<tool_call>" * 3
    assert msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    reasoning, content, calls, finish = _streamed_chat(client, **kw)
    assert (reasoning, content, finish) == ("<tool_call>" * 3, None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_unknown_fields_are_named(served):
    _, addr = served
    chat = {"messages": MESSAGES, "max_tokens": 2}
    for path, body, field in (
        ("/v1/chat/completions", {**chat, "made_up_field": 1}, "made_up_field"),
        (
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"nope": 1}},
            "stream_options.nope",
        ),
        ("/v1/completions", {"prompt": "x", "made_up_field": True}, "made_up_field"),
        ("/tokenize", {"prompt": "x", "made_up_field": 0}, "made_up_field"),
    ):
        status, answer = _post(addr, path, body)
        assert status == 400, answer
        assert answer["error"]["param"] == field
        assert f"unknown field '{field}'" in answer["error"]["message"]
    status, answer = _post(
        addr, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}}
    )
    assert status == 400 and answer["error"]["param"] == "chat_template_kwargs", answer


def test_docs_example_runs(qwen3_dir, capsys):
    """docs/reasoning.md's Python example, run as written on the tiny model."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "reasoning.md"), encoding="utf-8") as f:
        (code,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    exec(compile(code, "docs/reasoning.md", "exec"), {"MODEL": qwen3_dir})
    printed = capsys.readouterr().out
    assert "thought:" in printed
    assert printed.rstrip().splitlines()[-1] in ("answer: yes", "answer: no")


def test_non_special_added_tokens_are_text_to_grammars(qwen3_dir):
    """Qwen's <think> and <tool_call> are added tokens the tokenizer declares
    non-special: a grammar sees their text (a forced `<tool_call>` may use
    them), while special tokens stay special."""
    from fastllm import _core

    with open(os.path.join(qwen3_dir, "tokenizer.json"), "rb") as f:
        raw = f.read()
    added = {t["content"]: t["id"] for t in json.loads(raw)["added_tokens"]}
    vocab = _core.GrammarVocabulary(raw, [added["<|endoftext|>"]], max(added.values()) + 8)
    for name in THINK_TOKENS:
        assert vocab.token_bytes(added[name]) == name.encode()
    assert vocab.token_bytes(added["<|im_end|>"]) == b"\xff<|im_end|>"


def test_stateless_openai_fields_are_accepted_and_store_true_refused(served):
    _, addr = served
    chat = {"messages": MESSAGES, "max_tokens": 2}
    harmless = {
        "store": False,
        "metadata": {"run": "a"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
    }
    status, answer = _post(addr, "/v1/chat/completions", {**chat, **harmless})
    assert status == 200, answer
    status, answer = _post(addr, "/v1/chat/completions", {**chat, "store": True})
    assert status == 400 and answer["error"]["param"] == "store", answer
