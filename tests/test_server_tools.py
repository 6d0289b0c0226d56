"""The tool-call parser and its streaming form: for any split of a reply into
deltas, the streamed tool calls joined equal the whole reply's, and text that
is not a well-formed call to one of the tools stays content."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm.server.tools import Tool, ToolStream, call_format, parse_reply

TOOLS = [Tool("get_weather", {"type": "object"}), Tool("add", {"type": "object"})]


def streamed(text: str, fmt: str, cuts: list[int], forced: bool = False):
    ts = ToolStream(fmt, TOOLS, forced)
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
    st.one_of(st.integers(-5, 5), st.text(" {}\"\\:,ab", max_size=6), st.booleans()),
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
    assert [(c["name"], c["arguments"]) for c in s_calls] == [
        (c.name, c.arguments) for c in calls
    ]
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
