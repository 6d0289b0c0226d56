"""OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API
(``/v1/messages``), driven by the official ``openai`` and ``anthropic``
clients against the app serving a tiny random model: replies equal the
offline engine's on the same conversation (the translation renders the same
prompt), streamed events join to the whole reply, forced tool calls come back
as ``function_call`` items / ``tool_use`` blocks whose arguments validate,
a tool's result is accepted in the next turn, and what fastllm does not do is
a 400 naming the field."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest

from server_process import app_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastllm import LLM, SamplingParams  # noqa: E402
from fastllm.inputs import chat_prompt, chat_stop  # noqa: E402

NAME = "tiny-apis"
KEY = "sk-apis"
MAX_LEN = 512
# A Hermes / Qwen style template (tests/test_server_structured.py's) that also
# writes the assistant's tool calls, so a conversation's earlier calls show in
# the prompt the offline reference renders.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    'Answer with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same with Qwen3's thinking switch: the reply starts inside <think> unless
# enable_thinking is false.
THINK_TEMPLATE = TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% endif %}{% endif %}",
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# anthropic's client has no temperature argument any more; the API still takes it
GREEDY = {"temperature": 0}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "def fibonacci(n):"},
]


@contextlib.contextmanager
def _served(model: str, template: str, **engine):
    """create_app(...) with an API key, served on a thread of this process
    (server_process.app_server): the base URL."""
    with app_server(model, MAX_LEN, template, served_model_name=NAME, api_key=KEY, **engine) as (
        _,
        (host, port),
    ):
        yield f"http://{host}:{port}"


@pytest.fixture(scope="module")
def model_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture(scope="module")
def base(model_dir):
    with _served(model_dir, TEMPLATE) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(base) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """The offline reference: the same model in this process."""
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=MAX_LEN)


def _offline(llm: LLM, messages: list[dict], max_tokens: int, tools: list | None = None):
    """The offline engine's greedy reply to ``messages`` rendered with
    ``TEMPLATE``: (prompt token ids, completion)."""
    tok = llm.llm_engine.tokenizer
    _, ids = chat_prompt(tok, messages, TEMPLATE, True, tools)
    params = chat_stop(SamplingParams(temperature=0, max_tokens=max_tokens), tok, TEMPLATE)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return ids, out.outputs[0]


def _chat_tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


# ---- /v1/responses -----------------------------------------------------------------


def test_response_matches_offline(oai, llm):
    ids, ref = _offline(llm, CONVERSATION, 24)
    resp = oai.responses.create(
        model=NAME,
        instructions="Be brief.",
        input="def fibonacci(n):",
        max_output_tokens=24,
        temperature=0,
        metadata={"run": "1"},
        store=False,
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == NAME and resp.metadata == {"run": "1"}
    assert resp.output_text == ref.text
    assert resp.usage.input_tokens == len(ids)
    assert resp.usage.output_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == len(ids) + len(ref.token_ids)
    if ref.finish_reason == "length":
        assert resp.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"


def test_response_stream_joins_to_the_whole_response(oai):
    kw = dict(model=NAME, input="The quick brown fox", max_output_tokens=30, temperature=0)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == (
        "response.completed" if whole.status == "completed" else "response.incomplete"
    )
    assert types[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done.text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.status == whole.status and final.id == events[0].response.id


def test_response_input_items_render_as_chat(oai, llm):
    """Messages with text parts, a function call and its output become the
    chat messages the template renders: the prompt and reply are the offline
    engine's on those messages."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo", "unit": "C"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
    ]
    resp = oai.responses.create(
        model=NAME, input=items, tools=tools, max_output_tokens=16, temperature=0
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
    }
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees", "name": "get_weather"},
    ]
    ids, ref = _offline(llm, messages, 16, [_chat_tool("get_weather", WEATHER)])
    assert resp.usage.input_tokens == len(ids)
    text = "".join(p.text for i in resp.output if i.type == "message" for p in i.content)
    calls = [i for i in resp.output if i.type == "function_call"]
    # the reply is free text, unless the random model happened to write a call
    assert calls or text == ref.text.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_response_forced_function_call(oai, stream):
    tools = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER},
        {"type": "function", "name": "noop", "parameters": {"type": "object"}},
    ]
    kw = dict(
        model=NAME,
        input="Weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        temperature=1.0,
    )
    if not stream:
        resp = oai.responses.create(**kw)
    else:
        events = list(oai.responses.create(stream=True, **kw))
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == done.arguments
        assert events[-1].type == "response.completed"
        resp = events[-1].response
    calls = [i for i in resp.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert resp.status == "completed"


def test_response_json_schema_format(oai):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    resp = oai.responses.create(
        model=NAME,
        input="A digit, as JSON",
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema}},
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(resp.output_text), schema)


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown field"),
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "no built-in tools"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "keeps no items"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": "nope"}]},
            "tools[0].parameters",
            "JSON schema",
        ),
    ],
)
def test_response_refusals_name_the_field(oai, kwargs, field, words):
    kwargs = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model=NAME, max_output_tokens=kwargs.pop("max_output_tokens", 4), **kwargs
        )
    assert e.value.body["param"] == field, e.value.body
    assert words in e.value.body["message"]


# ---- /v1/messages ------------------------------------------------------------------


def test_message_matches_offline(claude, llm):
    ids, ref = _offline(llm, CONVERSATION, 24)
    msg = claude.messages.create(
        model=NAME,
        max_tokens=24,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "def fibonacci(n):"}]}],
        extra_body=GREEDY,
        metadata={"user_id": "u1"},
    )
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == NAME
    assert "".join(b.text for b in msg.content if b.type == "text") == ref.text
    assert msg.usage.input_tokens == len(ids)
    assert msg.usage.output_tokens == len(ref.token_ids)
    assert msg.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert msg.stop_sequence is None


def test_message_stream_joins_to_the_whole_message(claude):
    kw = dict(
        model=NAME,
        max_tokens=30,
        messages=[{"role": "user", "content": "The quick brown fox"}],
        extra_body=GREEDY,
    )
    whole = claude.messages.create(**kw)
    events = list(claude.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    # the client's own accumulator reads the stream into the same message
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason


def test_message_stop_sequence(claude, llm):
    _, ref = _offline(llm, [{"role": "user", "content": "for i in range("}], 30)
    stop = ref.text[5:8]
    if len(ref.text) < 8 or not stop.strip():
        pytest.skip("the random model's reply is too short to cut")
    msg = claude.messages.create(
        model=NAME,
        max_tokens=30,
        messages=[{"role": "user", "content": "for i in range("}],
        extra_body=GREEDY,
        stop_sequences=[stop],
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == ref.text[: ref.text.index(stop)]


def test_message_tool_round_trip(claude, llm):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    first = [{"role": "user", "content": "Weather in Oslo?"}]
    msg = claude.messages.create(
        model=NAME,
        max_tokens=120,
        messages=first,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    # the client's accumulator builds the same tool call from the stream
    with claude.messages.stream(
        model=NAME,
        max_tokens=120,
        messages=first,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as s:
        streamed = s.get_final_message()
    (suse,) = [b for b in streamed.content if b.type == "tool_use"]
    jsonschema.validate(suse.input, WEATHER)
    assert streamed.stop_reason == "tool_use"
    # the next turn sends the call and its result back
    second = [
        *first,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "12 degrees"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    answer = claude.messages.create(
        model=NAME, max_tokens=16, messages=second, tools=tools, extra_body=GREEDY
    )
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
    }
    text = "".join(b.text for b in msg.content if b.type == "text")
    messages = [
        first[0],
        {"role": "assistant", "content": text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "12 degrees", "name": "get_weather"},
        {"role": "user", "content": "Thanks."},
    ]
    ids, ref = _offline(llm, messages, 16, [_chat_tool("get_weather", WEATHER)])
    assert answer.usage.input_tokens == len(ids)
    if answer.stop_reason != "tool_use":
        assert "".join(b.text for b in answer.content if b.type == "text") == ref.text.strip()


def test_message_output_config_format(claude):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    msg = claude.messages.create(
        model=NAME,
        max_tokens=60,
        messages=[{"role": "user", "content": "A digit, as JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_message_auth_and_errors(base, claude):
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    # the key as a bearer token is accepted too
    bearer = anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0)
    ok = bearer.messages.create(
        model=NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    assert ok.usage.output_tokens <= 2
    # x-api-key opens the OpenAI routes as well; the OpenAI routes answer
    # OpenAI's error body
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    headers = {"x-api-key": KEY, "Content-Type": "application/json"}
    request = urllib.request.Request(f"{base}/v1/chat/completions", body.encode(), headers)
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.responses.create(model=NAME, input="x", max_output_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    for kwargs, words in (
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [{"name": "", "input_schema": WEATHER}]}, "tools[0].name"),
        ({"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "needs a reasoning parser"),
        ({"output_config": {"verbosity": "low"}}, "output_config.verbosity"),
        ({"max_tokens": 0}, "max_tokens"),
    ):
        kwargs = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **kwargs}
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=NAME, **kwargs)
        assert e.value.body["type"] == "error", e.value.body
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert words in e.value.body["error"]["message"], e.value.body


# ---- thinking: a reasoning parser and a template that opens <think> ----------------


@pytest.fixture(scope="module")
def thinking_base(model_dir):
    with _served(model_dir, THINK_TEMPLATE, reasoning_parser="qwen3") as url:
        yield url


def test_reasoning_item_and_thinking_block(thinking_base):
    """A reply inside the template's open <think> block is all reasoning: a
    ``reasoning`` item (streamed as reasoning_text events) and a ``thinking``
    block (thinking deltas); with thinking disabled it is all answer, and a
    budget ends the thinking as the chat route's does."""
    oai = openai.OpenAI(base_url=f"{thinking_base}/v1", api_key=KEY, max_retries=0)
    claude = anthropic.Anthropic(base_url=thinking_base, api_key=KEY, max_retries=0)
    kw = dict(model=NAME, input="Think first.", max_output_tokens=20, temperature=0)
    resp = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    chat = oai.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Think first."}],
        max_tokens=20,
        temperature=0,
    )
    reasoning = chat.choices[0].message.reasoning_content
    assert reasoning and resp.output[0].type == "reasoning"
    assert resp.output[0].content[0].text == reasoning
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    joined = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert joined == reasoning
    assert events[-1].response.output[0].content[0].text == reasoning

    user = [{"role": "user", "content": "Think first."}]
    msg = claude.messages.create(model=NAME, max_tokens=20, messages=user, extra_body=GREEDY)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == reasoning
    with claude.messages.stream(model=NAME, max_tokens=20, messages=user, extra_body=GREEDY) as s:
        assert s.get_final_message().content[0].thinking == reasoning

    off = claude.messages.create(
        model=NAME, max_tokens=20, messages=user, extra_body=GREEDY, thinking={"type": "disabled"}
    )
    chat_off = oai.chat.completions.create(
        model=NAME,
        messages=user,
        max_tokens=20,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert all(b.type == "text" for b in off.content)
    assert "".join(b.text for b in off.content) == (chat_off.choices[0].message.content or "")

    budget = claude.messages.create(
        model=NAME,
        max_tokens=30,
        messages=user,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    chat_budget = (
        oai.chat.completions.create(
            model=NAME,
            messages=user,
            max_tokens=30,
            temperature=0,
            extra_body={
                "thinking_token_budget": 4,
                "chat_template_kwargs": {"enable_thinking": True},
            },
        )
        .choices[0]
        .message
    )
    thinking = [b.thinking for b in budget.content if b.type == "thinking"]
    text = [b.text for b in budget.content if b.type == "text"]
    assert thinking == [chat_budget.reasoning_content]
    assert "".join(text) == (chat_budget.content or "")


# ---- a server without a tokenizer, and vLLM's return_token_ids ----------------------


@pytest.fixture(scope="module")
def bare(model_dir):
    """The same model served with ``skip_tokenizer_init``: token ids in and out."""
    with app_server(model_dir, MAX_LEN, None, api_key=KEY, skip_tokenizer_init=True) as (
        _,
        (host, port),
    ):
        yield openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)


def _post_json(client: openai.OpenAI, path: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the client's server (``path`` from the root)."""
    url = str(client.base_url).removesuffix("/v1/") + path
    req = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_without_tokenizer_answers_token_ids(bare, model_dir):
    """``--skip-tokenizer-init``: token-id prompts give the offline engine's
    greedy tokens as ``token_ids`` (whole, and streamed chunk by chunk), with
    ``prompt_token_ids``; what needs text is a 400 naming the field."""
    ref = LLM(
        model_dir, dtype="float32", device="cpu", max_model_len=MAX_LEN, skip_tokenizer_init=True
    )
    prompts = [[5, 9, 13, 200], [7, 8]]
    outs = ref.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    want = [list(o.outputs[0].token_ids) for o in outs]
    kw = dict(model="x", prompt=prompts, max_tokens=6, temperature=0)
    kw = {**kw, "model": bare.models.list().data[0].id, "extra_body": {"ignore_eos": True}}
    whole = bare.completions.create(**kw)
    assert [c.token_ids for c in whole.choices] == want
    assert [c.prompt_token_ids for c in whole.choices] == prompts
    assert all(c.text == "" for c in whole.choices)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list[int]] = {}
    for chunk in bare.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.token_ids
            if getattr(c, "prompt_token_ids", None) is not None:
                firsts.setdefault(c.index, c.prompt_token_ids)
    assert [streamed[0], streamed[1]] == want and [firsts[0], firsts[1]] == prompts
    for path, body, param in (
        ("/v1/completions", {"prompt": "some text", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 2}, "messages"),
        ("/tokenize", {"prompt": "text"}, "prompt"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ):
        status, reply = _post_json(bare, path, body)
        assert status == 400 and reply["error"]["param"] == param, (path, reply)
        assert "needs a tokenizer" in reply["error"]["message"]


def test_return_token_ids(oai, llm):
    """vLLM's ``return_token_ids`` on a server with a tokenizer: the prompt's
    ids as the tokenizer encodes it, and the completion's ids, equal to the
    offline engine's."""
    prompt = "def fibonacci(n):"
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    reply = oai.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (c,) = reply.choices
    assert c.prompt_token_ids == list(out.prompt_token_ids)
    assert c.token_ids == list(out.outputs[0].token_ids) and c.text == out.outputs[0].text
    plain = oai.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_chat_return_token_ids(oai, llm):
    """``return_token_ids`` on chat: the rendered prompt's ids and the reply's,
    equal to the offline engine's; streamed, the chunks' ``token_ids`` join
    to the whole reply's and the first chunk carries the prompt's."""
    ids, want = _offline(llm, CONVERSATION, 6)
    kw = dict(model=NAME, messages=CONVERSATION, max_tokens=6, temperature=0)
    kw["extra_body"] = {"return_token_ids": True}
    whole = oai.chat.completions.create(**kw)
    assert whole.prompt_token_ids == ids
    assert whole.choices[0].token_ids == list(want.token_ids)
    assert whole.choices[0].message.content == want.text
    joined: list[int] = []
    prompts = []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        if getattr(chunk, "prompt_token_ids", None) is not None:
            prompts.append(chunk.prompt_token_ids)
        for c in chunk.choices:
            joined += getattr(c, "token_ids", None) or []
    assert prompts == [ids] and joined == list(want.token_ids)
