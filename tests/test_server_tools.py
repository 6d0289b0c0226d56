"""The tool-call parser and its streaming form: for any split of a reply into
deltas, the streamed tool calls joined equal the whole reply's, and text that
is not a well-formed call to one of the tools stays content."""

from __future__ import annotations

import json
import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm.server.tools import (
    FORMATS,
    TOOL_CALL_PARSERS,
    Tool,
    ToolStream,
    call_format,
    forced_call_constraint,
    needs_special_tokens,
    parse_reply,
)

TOOLS = [Tool("get_weather", {"type": "object"}), Tool("add", {"type": "object"})]


def streamed(text: str, fmt: str, cuts: list[int], forced: bool = False, tools=TOOLS):
    ts = ToolStream(fmt, tools, forced)
    deltas = []
    prev = 0
    for c in sorted({min(c, len(text)) for c in cuts}) + [len(text)]:
        deltas += ts.add(text[prev:c])
        prev = c
    last, called = ts.finish()
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
            call["id"] = tc.get("id") or call["id"]
            call["name"] += tc["function"].get("name", "")
            call["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], called


def call_text(name: str, args: dict, fmt: str) -> str:
    body = json.dumps({"name": name, "arguments": args})
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


args_strategy = st.dictionaries(
    st.text("abcxyz", min_size=1, max_size=4),
    st.one_of(st.integers(-5, 5), st.text(' {}"\\:,ab', max_size=6), st.booleans()),
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "json"]),
    prefix=st.sampled_from(["", "Sure. ", "<tool", "{"]),
    name=st.sampled_from(["get_weather", "add", "unknown"]),
    args=args_strategy,
    suffix=st.sampled_from(["", " ok", "\n"]),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_streamed_calls_join_to_the_parsed_reply(fmt, prefix, name, args, suffix, cuts):
    if fmt == "json":
        prefix, suffix = "", ""  # the JSON format's reply is the call alone
    text = prefix + call_text(name, args, fmt) + suffix
    content, calls = parse_reply(text, fmt, TOOLS)
    s_content, s_calls, called = streamed(text, fmt, cuts)
    assert called == bool(calls)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in s_calls)
    if calls:
        assert calls[0].name == name and json.loads(calls[0].arguments) == args
        assert (content or "").split() == s_content.split()
    else:
        assert name == "unknown"
        assert s_content == text  # all of it, as written
        assert content in (text, text.strip())


def test_call_format_follows_the_template():
    assert call_format("... {{ '<tool_call>' }} ...") == "hermes"
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "json"
    assert call_format(None) == "json"


def test_two_hermes_calls_and_malformed_ones():
    text = (
        'a <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
        "<tool_call>\n{broken\n</tool_call>"
    )
    content, calls = parse_reply(text, "hermes", TOOLS)
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"a": 2}]
    assert content == "a <tool_call>\n{broken\n</tool_call>"


# ---- every format -------------------------------------------------------------
# Replies are written as each family's chat template writes an assistant's
# tool calls (the model learned them from it); "mistral_named", "llama3_bare"
# and "granite_bare" are other spellings those families' parsers read.

TYPED = [
    Tool(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hot": {"type": "boolean"},
                "tags": {"type": "array"},
            },
        },
    ),
    Tool(
        "add",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "note": {}},
        },
    ),
]
text_value = st.text(' {}"\\:,ab1', max_size=6)
TYPED_ARGS = {
    "get_weather": st.fixed_dictionaries(
        {},
        optional={
            "city": text_value,
            "days": st.integers(-5, 5),
            "hot": st.booleans(),
            "tags": st.lists(st.integers(0, 3), max_size=2),
        },
    ),
    "add": st.fixed_dictionaries(
        {},
        optional={
            "a": st.integers(-99, 99),
            "b": st.sampled_from([1.5, -2.25]),
            "note": text_value,
        },
    ),
    "unknown": st.fixed_dictionaries({}, optional={"x": st.integers(0, 9)}),
}
STYLES = {  # writer -> the format that parses it
    "hermes": "hermes",
    "json": "json",
    "llama3_json": "llama3_json",
    "llama3_bare": "llama3_json",
    "mistral": "mistral",
    "mistral_named": "mistral",
    "qwen3_coder": "qwen3_coder",
    "granite": "granite",
    "granite_bare": "granite",
    "phi4_mini_json": "phi4_mini_json",
}
# Each call stands alone: one to an unknown tool stays content, the others are calls.
PER_CALL = {"hermes", "mistral_named", "qwen3_coder"}
# The reply is the calls alone (no text around them).
CALLS_ALONE = {"json", "llama3_bare", "granite_bare"}


def qwen3_coder_call(name: str, args: dict) -> str:
    """As Qwen3-Coder's template writes a call: objects and lists as JSON, other
    values through Jinja's ``string`` filter (Python's ``str``)."""
    params = "".join(
        f"<parameter={k}>\n{json.dumps(v) if isinstance(v, (dict, list)) else v}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def write_calls(style: str, calls: list[tuple[str, dict]]) -> str:
    objects = [json.dumps({"name": n, "arguments": a}) for n, a in calls]
    llama = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if style == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if style == "json":
        return objects[0]
    if style in ("llama3_json", "llama3_bare"):
        return ("<|python_tag|>" if style == "llama3_json" else "") + llama
    if style == "mistral":
        return "[TOOL_CALLS][" + ", ".join(objects) + "]"
    if style == "mistral_named":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if style == "qwen3_coder":
        return "\n".join(qwen3_coder_call(n, a) for n, a in calls)
    if style in ("granite", "granite_bare"):
        return ("<|tool_call|>" if style == "granite" else "") + "[" + ", ".join(objects) + "]"
    assert style == "phi4_mini_json"
    return "functools[" + ", ".join(objects) + "]"


@settings(max_examples=400, deadline=None)
@given(
    style=st.sampled_from(sorted(STYLES)),
    prefix=st.sampled_from(["", "Sure. ", "<tool", "[TOOL", "functools", "<|python", "<function"]),
    names=st.lists(st.sampled_from(["get_weather", "add", "unknown"]), min_size=1, max_size=3),
    suffix=st.sampled_from(["", " ok", "\n"]),
    cuts=st.lists(st.integers(0, 400), max_size=14),
    data=st.data(),
)
def test_every_format_streams_what_it_parses(style, prefix, names, suffix, cuts, data):
    fmt = STYLES[style]
    if style in CALLS_ALONE:
        prefix, suffix = "", ""
    if style == "json":
        names = names[:1]
    calls = [(n, data.draw(TYPED_ARGS[n])) for n in names]
    text = prefix + write_calls(style, calls) + suffix
    content, parsed = parse_reply(text, fmt, TYPED)
    s_content, s_calls, called = streamed(text, fmt, cuts, tools=TYPED)
    # Streamed, the reply is what the whole reply parses to.
    assert called == bool(parsed)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in parsed]
    assert all(c["id"].startswith("call_") for c in s_calls)
    assert (content or "").split() == s_content.split()
    if not parsed:
        assert s_content == text  # all of it, as written
    # And the parse is the calls as written.
    known = [c for c in calls if c[0] != "unknown"]
    expected = known if style in PER_CALL or len(known) == len(calls) else []
    if fmt == "llama3_json" and suffix.strip():
        expected = []  # Llama 3's calls are the whole rest of the reply
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == expected
    if expected and len(known) == len(calls):
        assert (content or "").split() == (prefix + suffix).split()


A1 = {"a": 1, "b": 2}
W = {"city": "Oslo"}
KEPT, PLAIN = "<kept as content, with a warning>", "<plain text>"
EXAMPLES = [
    # (format, reply, content, calls); content None: no text outside the calls
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", A1)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}',
        None,
        [("add", A1)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("add", A1), ("get_weather", W)],
    ),
    (
        "llama3_json",
        'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "Let me look.",
        [("get_weather", W)],
    ),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}', KEPT, []),
    ("llama3_json", '{"name": "search", "parameters": {"q": "x"}}', KEPT, []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', KEPT, []),
    ("llama3_json", 'The JSON is {"a": 1}.', PLAIN, []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        None,
        [("add", A1)],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abcdefghi"}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "bcdefghij"}]',
        "Sure.",
        [("add", A1), ("get_weather", W)],
    ),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None, [("add", A1)]),
    (
        "mistral",
        'On it.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}',
        "On it.",
        [("add", A1), ("get_weather", W)],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1,}}]', KEPT, []),
    ("mistral", '[TOOL_CALLS]search[ARGS]{"q": "x"}', KEPT, []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "search", "arguments": {}}]',
        KEPT,
        [],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n"
        "<parameter=tags>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Oslo", "days": 3, "hot": True, "tags": [1, 2]})],
    ),
    (
        "qwen3_coder",
        "I will add them.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
        "<parameter=b>\n2\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\n12\n</parameter>\n</function>\n</tool_call>",
        "I will add them.",
        [("add", {**A1, "note": "line one\nline two"}), ("get_weather", {"city": "12"})],
    ),
    (  # a value that is not what its schema wants stays text; no </tool_call> at the end
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\nten\n</parameter>\n</function>",
        None,
        [("add", {"a": "ten"})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
        KEPT,
        [],
    ),
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>\n</tool_call>", KEPT, []),
    (
        "granite",
        '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        None,
        [("add", A1), ("get_weather", W)],
    ),
    (
        "granite",
        'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Checking.",
        [("get_weather", W)],
    ),
    ("granite", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [("add", A1)]),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": "a=1"}]', KEPT, []),
    ("granite", '<|tool_call|>[{"name": "search", "arguments": {}}]', KEPT, []),
    ("granite", "[1, 2] are the numbers.", KEPT, []),
    (
        "phi4_mini_json",
        'functools[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        None,
        [("add", A1), ("get_weather", W)],
    ),
    (
        "phi4_mini_json",
        'Use functools.partial here. functools[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "Use functools.partial here.",
        [("add", A1)],
    ),
    ("phi4_mini_json", 'functools[{"name": "add", "arguments": {"a": 1, "b": 2}]', KEPT, []),
    ("phi4_mini_json", 'functools[{"name": "search", "arguments": {}}]', KEPT, []),
]


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), EXAMPLES)
def test_each_format_parses_its_replies(fmt, reply, content, calls, caplog):
    with caplog.at_level(logging.WARNING, logger="fastllm.server"):
        got_content, got = parse_reply(reply, fmt, TYPED)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # KEPT: not a call (malformed, or to an unknown tool): the reply as written,
    # and a warning; PLAIN: text where no call starts
    assert got_content == (reply if content in (KEPT, PLAIN) else content)
    assert bool(caplog.records) == (content == KEPT)
    if content == KEPT:
        assert f"{fmt} tool call kept as content" in caplog.text


TEMPLATES = [
    # (expected format, what that family's template contains)
    (
        "hermes",
        '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function '
        "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
        '<|im_end|>\\n" }}',
    ),
    (
        "qwen3_coder",
        "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
        "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
        "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
        "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",
    ),
    (  # Llama 3.1 / 3.3
        "llama3_json",
        '{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}'
        "{%- endif %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}",
    ),
    (  # Llama 3.2 (no <|python_tag|>)
        "llama3_json",
        '{{- "Given the following functions, please respond with a JSON for a function call '
        'with its proper arguments that best answers the given prompt.\\n\\n" }}'
        '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
        "argument name and its value}.' }}<|start_header_id|>",
    ),
    (  # Mistral 7B v0.3, Nemo
        "mistral",
        '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
        '{{- tool_call.function|tojson }}{%- endfor %}{{- "]" + eos_token }}',
    ),
    (  # Mistral Small 3.2, Magistral, Devstral
        "mistral",
        "{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[CALL_ID]' + tool_call.id }}"
        "{{- '[ARGS]' + arguments }}",
    ),
    (
        "granite",
        "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message.tool_calls"
        "|tojson + '<|end_of_text|>\\n' }}",
    ),
    (
        "phi4_mini_json",
        "  * prefix function calls with functools marker (no closing marker required)\n"
        "  * all function calls should be generated in a single JSON list formatted as "
        'functools[{"name": [function name], "arguments": [function arguments as JSON]}, ...]',
    ),
    ("json", "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"),
    (  # Llama 3 without tools
        "json",
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' %}",
    ),
    ("json", "{{ tools | tojson }} Call a tool with its name and parameters as JSON."),
    (  # gpt-oss (harmony): a call is a commentary message to the function
        "openai",
        "{%- for m in messages %}<|start|>{{ m.role }}<|channel|>commentary"
        "{% if m.tool_calls %} to=functions.{{ m.tool_calls[0].function.name }}{% endif %}"
        "<|message|>{{ m.content }}<|end|>{% endfor %}",
    ),
]


@pytest.mark.parametrize(("fmt", "template"), TEMPLATES)
def test_call_format_reads_each_familys_template(fmt, template):
    assert call_format(template) == fmt
    assert call_format(template, "auto") == fmt
    assert call_format(template, "granite") == "granite"  # --tool-call-parser wins


def test_tool_call_parser_names():
    from fastllm.cli import TOOL_CALL_PARSERS as CLI_NAMES

    assert TOOL_CALL_PARSERS == ("auto", *FORMATS) == CLI_NAMES
    # the formats whose markers are special tokens, which skip_special_tokens would drop
    assert {f for f in FORMATS if needs_special_tokens(f)} == {"llama3_json", "mistral", "granite"}
    with pytest.raises(ValueError, match="--tool-call-parser"):
        call_format("<tool_call>", "hermes2")


def test_openai_parser_needs_the_harmony_reasoning_parser():
    """``--tool-call-parser openai`` without ``--reasoning-parser openai_gptoss``
    (which turns harmony calls into what the parser reads) is refused."""
    from fastllm.config import EngineConfig
    from fastllm.server.app import create_app

    with pytest.raises(ValueError, match="needs --reasoning-parser openai_gptoss"):
        create_app(EngineConfig(model="unused"), tool_call_parser="openai")


def test_serve_takes_tool_call_parser(monkeypatch, capsys):
    import fastllm.server.app as app
    from fastllm.cli import main

    seen: dict = {}
    monkeypatch.setattr(app, "serve", lambda config, **kw: seen.update(kw))
    assert main(["serve", "--tool-call-parser", "qwen3_coder"]) == 0
    assert seen["tool_call_parser"] == "qwen3_coder"
    assert main(["serve"]) == 0
    assert seen["tool_call_parser"] == "auto"
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "nope"])
    assert "--tool-call-parser" in capsys.readouterr().err


def test_create_app_and_route_context_use_the_parser():
    from types import SimpleNamespace

    from fastllm.config import EngineConfig
    from fastllm.server.app import create_app
    from fastllm.server.context import RouteContext

    with pytest.raises(ValueError, match="--tool-call-parser"):  # before any model is read
        create_app(EngineConfig(model="/no/such/model"), tool_call_parser="nope")
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=None))
    for parser, expected in (("auto", "hermes"), ("mistral", "mistral")):
        ctx = RouteContext(SimpleNamespace(engine=engine, tool_call_parser=parser))
        assert ctx.tool_format("... <tool_call> ...") == expected


# ---- forced calls ---------------------------------------------------------------

FORCED_TOOLS = [
    Tool(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "add",
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    ),
]
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
QWEN_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=unit>\nC\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
FORCED = [
    # (format, one call the constraint accepts, replies it refuses)
    (
        "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        [WEATHER, f"<tool_call>\n{ADD[:-2]}}}\n</tool_call>"],
    ),
    ("json", ADD, [f"<tool_call>\n{ADD}\n</tool_call>", ADD.replace('"b": 2', '"b": 200')]),
    ("llama3_json", ADD.replace("arguments", "parameters"), [ADD]),
    ("mistral", f"[TOOL_CALLS][{ADD}]", [f"[TOOL_CALLS][{ADD}, {ADD}]", f"[{ADD}]"]),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}]", ['[TOOL_CALLS]add[ARGS]{"a": 1}']),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', ["[TOOL_CALLS]search[ARGS]{}"]),
    (
        "qwen3_coder",
        QWEN_WEATHER,
        [
            QWEN_WEATHER.replace("\nC\n", "\nK\n"),
            QWEN_WEATHER.replace("\n3\n", "\nthree\n"),
            QWEN_WEATHER.replace("<parameter=city>\nOslo\n</parameter>\n", ""),
        ],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\n-5\n</parameter>\n"
        "<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>",
        ["<tool_call>\n<function=add>\n</function>\n</tool_call>"],
    ),
    ("granite", f"<|tool_call|>[{WEATHER}]", [f"<|tool_call|>[{WEATHER}, {ADD}]", f"[{WEATHER}]"]),
    ("phi4_mini_json", f"functools[{ADD}]", [f"functools[{ADD}, {ADD}]", f"functools{ADD}"]),
]


@pytest.fixture(scope="module")
def grammar_vocabulary(tokenizer_dir):
    """The test tokenizer's grammar vocabulary, and the tokenizer."""
    from tokenizers import Tokenizer

    from fastllm import _core

    path = os.path.join(tokenizer_dir, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    with open(path, "rb") as f:
        eos = tok.token_to_id("<|endoftext|>")
        return _core.GrammarVocabulary(f.read(), [eos], tok.get_vocab_size()), tok


def accepts(grammar_vocabulary, constraint, text: str) -> bool:
    vocab, tok = grammar_vocabulary
    kind, value = constraint.constraint
    matcher = vocab.start(kind, value, constraint.any_whitespace)
    try:
        for t in tok.encode(text).ids:
            matcher.consume(t)
    except ValueError:
        return False
    return matcher.is_accepting()


@pytest.mark.parametrize(("fmt", "good", "bad"), FORCED)
def test_forced_call_grammar_of_each_format(grammar_vocabulary, fmt, good, bad):
    constraint = forced_call_constraint(FORCED_TOOLS, fmt)
    assert accepts(grammar_vocabulary, constraint, good)
    for reply in bad:
        assert not accepts(grammar_vocabulary, constraint, reply), reply
    # what the grammar lets through is one call to the parser
    content, calls = parse_reply(good, fmt, FORCED_TOOLS)
    assert content is None and len(calls) == 1
    # a named forced call: that function only
    name = calls[0].name
    other = next(t for t in FORCED_TOOLS if t.name != name)
    assert not accepts(grammar_vocabulary, forced_call_constraint([other], fmt), good)


def test_forced_calls_of_a_random_model_parse_back(make_model):
    """A tiny random model (which never writes a call by chance) under each
    format's forced-call constraint: every reply is one call whose arguments
    validate against its function's schema."""
    import jsonschema

    from fastllm import LLM, SamplingParams

    llm = LLM(make_model("llama"), dtype="float32", device="cpu")
    schemas = {t.name: t.parameters for t in FORCED_TOOLS}
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            structured_outputs=forced_call_constraint(FORCED_TOOLS, fmt),
        )
        for fmt in FORMATS
        for seed in (1, 2)
    ]
    outs = llm.generate(["Call a tool:"] * len(params), params, use_tqdm=False)
    fmts = [fmt for fmt in FORMATS for _ in (1, 2)]
    for fmt, out in zip(fmts, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (fmt, text)
        content, calls = parse_reply(text, fmt, FORCED_TOOLS)
        assert content is None and len(calls) == 1, (fmt, text)
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
