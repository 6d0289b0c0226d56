"""Structured outputs and tool calls over HTTP, with the official ``openai``
client against a ``fastllm serve`` process running a tiny random model:
every constrained reply validates with ``jsonschema`` (or ``re.fullmatch``),
streamed replies join to valid ones, forced tool calls carry arguments that
parse against their function's schema, and bad schemas get a 400 naming
the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_process import free_port, package_env, running_server, serve_command

NAME = "tiny-structured"
KEY = "sk-structured"
MAX_LEN = 512

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "notes": {"type": "string", "maxLength": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A Hermes / Qwen style template: tools in the system turn, calls in <tool_call> tags.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    'Answer with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(make_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = serve_command(make_model("llama"), port, MAX_LEN, NAME, KEY)
    env = package_env()
    with running_server(cmd, port, log, env):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def chat(client, **kw):
    kw.setdefault("model", NAME)
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 300)
    return client.chat.completions.create(**kw)


def joined_stream(stream) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish_reason) of a streamed chat reply, deltas joined."""
    content, calls, finish = "", {}, None
    for ch in stream:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- response_format -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_reply_validates(client, seed):
    r = chat(client, response_format=json_schema_format(SCHEMA), seed=seed)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_streamed_reply_validates(client, seed):
    stream = chat(client, response_format=json_schema_format(SCHEMA), seed=seed, stream=True)
    content, calls, finish = joined_stream(stream)
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), SCHEMA)
    whole = chat(client, response_format=json_schema_format(SCHEMA), seed=seed)
    assert whole.choices[0].message.content == content


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_reply_is_an_object(client, stream):
    # Any object: a random model does not always close one in time; the ones it
    # finishes must parse, and everything it writes starts an object.
    finished = 0
    for seed in range(8):
        kw = dict(
            response_format={"type": "json_object"},
            seed=seed,
            max_tokens=120,
            extra_body={"guided_whitespace_pattern": ""},
        )
        if stream:
            text, _, finish = joined_stream(chat(client, stream=True, **kw))
        else:
            c = chat(client, **kw).choices[0]
            text, finish = c.message.content, c.finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished > 0


def test_completions_take_response_format_and_guided_fields(client):
    kw = dict(model=NAME, prompt="Answer:", temperature=1.0, max_tokens=300)
    # the openai client has no response_format for completions: sent as an extra field
    r = client.completions.create(
        extra_body={"response_format": json_schema_format(SCHEMA)}, seed=1, n=3, **kw
    )
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    r = client.completions.create(extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"}, **kw)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text)
    r = client.completions.create(extra_body={"guided_choice": ["yes", "no"]}, n=4, seed=2, **kw)
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = client.completions.create(
        extra_body={"structured_outputs": {"choice": ["up", "down"]}}, **kw
    )
    assert r.choices[0].text in ("up", "down")


def test_bad_schema_is_a_400_naming_the_problem(client):
    bad = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format=json_schema_format(bad))
    body = e.value.body
    assert body["param"] == "response_format"
    assert "#/properties/xs/uniqueItems" in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", extra_body={"guided_regex": "("})
    assert e.value.body["param"] == "guided_regex" and "guided_regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(
            client,
            response_format={"type": "json_object"},
            extra_body={"guided_choice": ["a"]},
        )
    assert "only one output constraint" in e.value.body["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tools[0].function.parameters"
    assert "#/properties/xs/uniqueItems" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.body["param"] == "tool_choice"


# ---- tool calls ------------------------------------------------------------------


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


TEMPLATES = {"json": None, "hermes": HERMES_TEMPLATE}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
@pytest.mark.parametrize("seed", range(3))
def test_named_tool_call(client, fmt, seed):
    extra = {"chat_template": TEMPLATES[fmt]} if TEMPLATES[fmt] else {}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=TOOLS, tool_choice=choice, seed=seed, extra_body=extra)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    calls = c.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    check_calls([(t.function.name, t.function.arguments) for t in calls], {"get_weather"})
    assert c.message.content is None  # a forced call is the whole reply


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
@pytest.mark.parametrize("seed", range(3))
def test_required_tool_call_streamed_equals_whole(client, fmt, seed):
    extra = {"chat_template": TEMPLATES[fmt]} if TEMPLATES[fmt] else {}
    kw = dict(tools=TOOLS, tool_choice="required", seed=seed, extra_body=extra)
    whole = chat(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    check_calls(
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls],
        {"get_weather", "add"},
    )
    content, calls, finish = joined_stream(chat(client, stream=True, **kw))
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_and_none_tool_choice(client):
    # With "auto" the model decides; a random model writes text, which comes back
    # as content, and any well-formed call it did write would be parsed.
    for seed in range(3):
        r = chat(client, tools=TOOLS, seed=seed, max_tokens=24)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls(
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls],
                {"get_weather", "add"},
            )
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content is not None
    r = chat(client, tools=TOOLS, tool_choice="none", seed=0, max_tokens=8)
    assert not r.choices[0].message.tool_calls


def test_tool_call_then_tool_result_round_trip(client):
    first = (
        chat(
            client,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
            seed=5,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    r = chat(client, messages=messages, tools=TOOLS, max_tokens=8, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---- bounded schemas always close ---------------------------------------------

BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
ROUNDS = 100  # x2 (plain and streamed; or the two call formats): 200 replies per test


def test_bounded_json_schema_always_closes_plain_and_streamed(client):
    """At temperature 1 with max_tokens=200, every reply of a random model under
    a bounded schema finishes and validates, whole and streamed (free
    whitespace let such replies run to max_tokens inside the JSON)."""
    bad = []
    for seed in range(ROUNDS):
        schema = (BOUNDED, SCHEMA)[seed % 2]
        kw = dict(response_format=json_schema_format(schema), seed=seed, max_tokens=200)
        c = chat(client, **kw).choices[0]
        content, _, finish = joined_stream(chat(client, stream=True, **kw))
        for text, reason in ((c.message.content, c.finish_reason), (content, finish)):
            try:
                assert reason == "stop", reason
                jsonschema.validate(json.loads(text), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                bad.append((seed, text[:60], str(e)[:60]))
    assert not bad, f"{len(bad)} of {2 * ROUNDS} replies did not close: {bad[:4]}"


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_forced_tool_call_always_returns_valid_calls(client, fmt):
    extra = {"chat_template": TEMPLATES[fmt]} if TEMPLATES[fmt] else {}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(ROUNDS):
        r = chat(
            client, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=120, extra_body=extra
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, (seed, c)
        check_calls(
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls], {"get_weather"}
        )


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_forced_tool_call_cut_by_max_tokens_is_a_clear_error(client, fmt):
    """Never a silent ``tool_calls=None``: a 400 naming max_tokens, and in a
    stream an error event before [DONE]."""
    extra = {"chat_template": TEMPLATES[fmt]} if TEMPLATES[fmt] else {}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(tools=TOOLS, tool_choice=choice, seed=0, max_tokens=3, extra_body=extra)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert e.value.body["param"] == "max_tokens" and "forced tool call" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="forced tool call"):
        joined_stream(chat(client, stream=True, **kw))
