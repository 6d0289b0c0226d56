"""Tool calls of the chat API: the constraint a forced call is generated
under, and the parser that turns a reply into OpenAI's ``tool_calls`` (whole,
or as streamed deltas).

The call formats carry vLLM's ``--tool-call-parser`` names (``FORMATS``):

- ``hermes`` (Hermes, Qwen 2.5 / 3): ``<tool_call>`` + a JSON
  ``{"name": ..., "arguments": {...}}`` + ``</tool_call>``, one block a call;
- ``llama3_json`` (Llama 3.1 to 3.3): ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or
  ``[TOOL_CALLS]NAME[ARGS]{...}`` once a call (newer tokenizers);
- ``qwen3_coder``: ``<tool_call>`` + ``<function=NAME>`` + one
  ``<parameter=P>`` text block a parameter + ``</function>`` + ``</tool_call>``;
- ``granite`` (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``;
- ``phi4_mini_json`` (Phi-4-mini): ``functools[{"name": ..., "arguments": {...}}, ...]``;
- ``openai`` (gpt-oss): harmony messages addressed ``to=functions.NAME``,
  which the ``openai_gptoss`` reasoning parser turns into Hermes calls
  (``reasoning.HarmonyStream``), read as ``hermes`` from there (``parse_as``);
- ``json``: the call's JSON object alone, for templates that write none of these.

``call_format`` reads which one from the chat template (or takes the server's
``--tool-call-parser``). Text that is not a well-formed call to one of the
request's tools stays content, with a warning in the server's log.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastllm.sampling_params import StructuredOutputsParams
from fastllm.server.protocol import APIError
from fastllm.server.tool_formats import FORMATS, TOOL_CALL_PARSERS

logger = logging.getLogger("fastllm.server")


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
GRANITE_CALLS = "<|tool_call|>"
PHI4_CALLS = "functools["
QWEN_FUNCTION = "<function="
# Where a call may start in a reply of each format: at one of its markers...
_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN,),
    "llama3_json": (PYTHON_TAG,),
    "mistral": (MISTRAL_CALLS,),
    "qwen3_coder": (HERMES_OPEN, QWEN_FUNCTION),
    "granite": (GRANITE_CALLS,),
    "phi4_mini_json": (PHI4_CALLS,),
    "json": (),
}
# ...or, in these, at the reply's first character (the marker is a special token
# that detokenization may have skipped, or the model did not write it).
_BARE = {"json": "{", "llama3_json": "{", "granite": "["}
# Formats whose marker is a special token of their models' tokenizers.
_SPECIAL_MARKERS = frozenset({"llama3_json", "mistral", "granite"})
# What Llama 3.1 to 3.3 templates write: the tag of their calls, or their
# instructions for JSON calls (quotes escaped or not).
_LLAMA3_TEMPLATE = re.compile(
    r'<\|python_tag\|>|\\?"parameters\\?": dictionary of argument name'
    r"|Given the following functions, please respond with a JSON for a function call"
)
# Forced calls: one optional space where JSON allows whitespace, as models write it.
_CALL_WHITESPACE = r"[ ]?"
_ARGS_START = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class Tool:
    """One function a request offers the model."""

    name: str
    parameters: dict[str, Any]


def parse_tools(tools: list[dict[str, Any]]) -> list[Tool]:
    """The request's ``tools``; a 400 naming ``tools[i]`` for a malformed one."""
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not fn:
            raise APIError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                400,
                param=f"tools[{i}]",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(
                f"tools[{i}].function.name must be a non-empty string",
                400,
                param=f"tools[{i}].function.name",
            )
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise APIError(
                f"tools[{i}].function.parameters must be a JSON schema object",
                400,
                param=f"tools[{i}].function.parameters",
            )
        try:
            StructuredOutputsParams(json=params)
        except ValueError as e:
            msg = str(e).replace("StructuredOutputsParams.json", f"tools[{i}].function.parameters")
            raise APIError(msg, 400, param=f"tools[{i}].function.parameters") from None
        out.append(Tool(name, params))
    return out


def resolve_tool_choice(choice: Any, tools: list[Tool]) -> str | Tool:
    """``"none"``, ``"auto"``, ``"required"`` or the named Tool; a 400 otherwise."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise APIError(f"tool_choice={choice!r} needs tools", 400, param="tool_choice")
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise APIError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            400,
            param="tool_choice",
        )
    for t in tools:
        if t.name == name:
            return t
    raise APIError(f"tool_choice names {name!r}, which is not in tools", 400, param="tool_choice")


# Formats read with another's parser: gpt-oss's harmony calls reach the
# tool parser as Hermes calls (the reasoning parser rewrites them).
_PARSE_AS = {"openai": "hermes"}
# What a gpt-oss (harmony) chat template writes for a function call.
_HARMONY_TEMPLATE = re.compile(r"<\|channel\|>.*to=functions\.", re.DOTALL)


def parse_as(fmt: str) -> str:
    """The format whose parser reads replies of ``fmt`` (itself but for ``openai``)."""
    return _PARSE_AS.get(fmt, fmt)


def check_tool_call_parser(name: str | None) -> str:
    """``name`` (``--tool-call-parser``; None: ``auto``) if it is one of
    TOOL_CALL_PARSERS, else a ValueError naming the flag and the choices."""
    if name is None:
        return "auto"
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser (tool_call_parser) must be one of "
            f"{', '.join(TOOL_CALL_PARSERS)}; got {name!r}"
        )
    return name


def call_format(chat_template: str | None, parser: str | None = None) -> str:
    """The format of tool calls in replies: ``parser`` (``--tool-call-parser``)
    unless it is None or ``auto``, else the one the chat template writes, else
    ``json``. Markers are checked from the most specific: Qwen3-Coder's
    ``<function=`` wins over the ``<tool_call>`` it shares with Hermes."""
    chosen = check_tool_call_parser(parser)
    if chosen != "auto":
        return chosen
    t = chat_template or ""
    if _HARMONY_TEMPLATE.search(t):
        return "openai"
    if MISTRAL_CALLS in t:
        return "mistral"
    if PHI4_CALLS in t or "functools marker" in t:
        return "phi4_mini_json"
    if GRANITE_CALLS in t:
        return "granite"
    if HERMES_OPEN in t:
        return "qwen3_coder" if QWEN_FUNCTION in t else "hermes"
    if _LLAMA3_TEMPLATE.search(t):
        return "llama3_json"
    return "json"


def needs_special_tokens(fmt: str) -> bool:
    """Whether replies in ``fmt`` must be detokenized with special tokens kept
    (``skip_special_tokens=False``) for its call marker to reach the parser: Llama
    3's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]`` and Granite's
    ``<|tool_call|>`` are special tokens of those models' tokenizers."""
    return fmt in _SPECIAL_MARKERS


def _call_schema(tools: list[Tool], arguments: str = "arguments") -> dict[str, Any]:
    def one(t: Tool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments: t.parameters},
            "required": ["name", arguments],
            "additionalProperties": False,
        }

    return one(tools[0]) if len(tools) == 1 else {"anyOf": [one(t) for t in tools]}


def _with_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the forced calls' whitespace rule, for ``%json`` in a grammar."""
    return {**schema, "x-guidance": {"whitespace_pattern": _CALL_WHITESPACE}}


def forced_call_constraint(tools: list[Tool], fmt: str) -> StructuredOutputsParams:
    """The constraint of a forced call (``required``: any tool; named: that one):
    exactly one call in the model family's format, arguments per the schema.

    Markers are written as text: where the tokenizer has them as special
    tokens, the grammar spells them with ordinary tokens (the parser reads the
    same text). A forced ``llama3_json`` call has no ``<|python_tag|>`` (the
    Llama 3 templates ask for the JSON alone); a forced ``mistral`` call may
    take either form, so each model version writes its own."""
    fmt = parse_as(fmt)
    if fmt in ("json", "llama3_json"):
        schema = _call_schema(tools, "parameters" if fmt == "llama3_json" else "arguments")
        return StructuredOutputsParams(json=schema, whitespace_pattern=_CALL_WHITESPACE)
    if fmt == "qwen3_coder":
        return StructuredOutputsParams(grammar=_xml_call_grammar(tools))
    q = json.dumps
    starts = {
        "hermes": f"{q(HERMES_OPEN + chr(10))} call {q(chr(10) + HERMES_CLOSE)}",
        "granite": f'{q(GRANITE_CALLS)} "[" call "]"',
        "phi4_mini_json": f'{q(PHI4_CALLS)} call "]"',
        "mistral": f'{q(MISTRAL_CALLS)} (" "? "[" call "]" | named)',
    }
    if fmt not in starts:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    grammar = f"start: {starts[fmt]}\ncall: %json {q(_with_whitespace(_call_schema(tools)))}\n"
    if fmt == "mistral":
        # The newer form, NAME[ARGS]{...}: one alternative per tool.
        grammar += "named: " + " | ".join(f"named_{k}" for k in range(len(tools))) + "\n"
        for k, t in enumerate(tools):
            grammar += f"named_{k}: {q(t.name + '[ARGS]')} args_{k}\n"
            grammar += f"args_{k}: %json {q(_with_whitespace(t.parameters))}\n"
    return StructuredOutputsParams(grammar=grammar)


def _xml_call_grammar(tools: list[Tool]) -> str:
    """The Lark grammar of one Qwen3-Coder call: each parameter of the schema
    in its order (the required ones always), as its template writes them."""
    q, nl = json.dumps, "\n"
    lines = [
        f"start: {q(HERMES_OPEN + nl)} function {q(nl + HERMES_CLOSE)}",
        "function: " + " | ".join(f"function_{k}" for k in range(len(tools))),
    ]
    for k, t in enumerate(tools):
        props = t.parameters.get("properties")
        props = props if isinstance(props, dict) else {}
        required = t.parameters.get("required") or []
        parts = []
        for j, (name, schema) in enumerate(props.items()):
            rule = f"param_{k}_{j}"
            parts.append(rule if name in required else f"{rule}?")
            value = _xml_value_grammar(schema, f"{k}_{j}", lines)
            lines.append(
                f"{rule}: {q(f'<parameter={name}>' + nl)} {value} {q(nl + '</parameter>' + nl)}"
            )
        body = " ".join([q(f"<function={t.name}>" + nl), *parts, q("</function>")])
        lines.append(f"function_{k}: {body}")
    return "\n".join(lines) + "\n"


def _xml_value_grammar(schema: Any, suffix: str, lines: list[str]) -> str:
    """The grammar of one Qwen3-Coder parameter's value (appending the rules it
    needs to ``lines``): a text parameter is one line of text (its length per
    ``minLength`` / ``maxLength``) or one of its ``enum`` strings; any other is
    JSON per its schema, which the parser reads back as JSON."""
    schema = schema if isinstance(schema, dict) else {}
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices and all(isinstance(c, str) and "<" not in c and "\n" not in c for c in choices):
        return "(" + " | ".join(json.dumps(c) for c in choices) + ")"
    if _is_text(schema):
        low = max(1, int(schema.get("minLength", 1)))
        high = schema.get("maxLength")
        count = f"{{{low},{int(high)}}}" if isinstance(high, int) and high >= low else f"{{{low},}}"
        lines.append(f"TEXT_{suffix}: /[^<\\n]{count}/")
        return f"TEXT_{suffix}"
    lines.append(f"json_{suffix}: %json {json.dumps(_with_whitespace(schema))}")
    return f"json_{suffix}"


def unfinished_forced_call(max_tokens: int | None, index: int) -> APIError:
    """The error for a forced call that ended before it was complete: only
    ``max_tokens`` can cut a constrained call short, so that is the field named."""
    return APIError(
        f"choice {index}: the forced tool call was not complete when max_tokens={max_tokens} "
        "tokens were generated; raise max_tokens so the call's arguments can be closed",
        400,
        param="max_tokens",
    )


@dataclass
class ParsedCall:
    name: str
    # the arguments' JSON text as the model wrote it (qwen3_coder: built from
    # its parameters, as json.dumps writes it)
    arguments: str


def _decode_call(text: str, start: int) -> tuple[ParsedCall | None, int, int | None]:
    """Reads a call object at ``start``: (call or None, end, start of its arguments)."""
    m = _ARGS_START.match(text, start)
    if not m:
        return None, start, None
    dec = json.JSONDecoder()
    try:
        obj, end = dec.raw_decode(text, start)
        _, args_end = dec.raw_decode(text, m.end())
    except ValueError:
        return None, start, m.end()
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, start, m.end()
    if not isinstance(obj.get("arguments"), dict):
        return None, start, m.end()
    return ParsedCall(obj["name"], text[m.end() : args_end]), end, m.end()


def _warn_kept(fmt: str, reason: str, text: str) -> None:
    """Logs a call the parser left as content (the reply's text from where it starts)."""
    logger.warning("%s tool call kept as content: %s: %.200r", fmt, reason, text)


def _unknown_or_malformed(call: ParsedCall | None, names: set[str]) -> str:
    """Why a call was not taken: its tool is unknown, or it is malformed."""
    if call is not None and call.name not in names:
        return f"a call to {call.name!r}, which is not one of the request's tools"
    return "malformed call"


def parse_reply(text: str, fmt: str, tools: list[Tool]) -> tuple[str | None, list[ParsedCall]]:
    """A finished reply as (content or None, tool calls); a malformed call or
    one to an unknown tool stays content, with a warning in the log."""
    fmt = parse_as(fmt)
    names = {t.name for t in tools}
    if fmt in _REGIONS:
        pieces, found = _parse_regions(text, fmt, tools, final=True)
        body = "".join(pieces).strip()
        return (body or None), found
    if fmt == "json":
        s = text.strip()
        call, end, _ = _decode_call(s, 0)
        if call is not None and call.name in names and not s[end:].strip():
            return None, [call]
        if _ARGS_START.match(s):
            _warn_kept(fmt, _unknown_or_malformed(call, names), s)
        return text, []
    if fmt != "hermes":
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    calls: list[ParsedCall] = []
    content: list[str] = []
    pos = 0
    while True:
        i = text.find(HERMES_OPEN, pos)
        if i < 0:
            content.append(text[pos:])
            break
        j = i + len(HERMES_OPEN)
        while j < len(text) and text[j].isspace():
            j += 1
        call, end, _ = _decode_call(text, j)
        close = text.find(HERMES_CLOSE, end) if call is not None else -1
        if call is None or call.name not in names or text[end:close].strip() or close < 0:
            _warn_kept(fmt, _unknown_or_malformed(call, names), text[i:])
            content.append(text[pos:j])
            pos = j
            continue
        content.append(text[pos:i])
        calls.append(call)
        pos = close + len(HERMES_CLOSE)
    body = "".join(content).strip()
    return (body or None), calls


class _NotACall(ValueError):
    """Text at a call's start that is not (or not yet) a whole, well-formed call
    to one of the request's tools; the message says why."""


_WHITESPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()
_MISTRAL_NAMED = re.compile(r'([^\s\[\]{}"]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*)?\[ARGS\]\s*')
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_PYTHON_SCALARS: dict[str, Any] = {"True": True, "False": False, "None": None}


def _skip_ws(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]


def _json_value(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at ``pos`` and its end."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        raise _NotACall("malformed or unfinished JSON") from None


def _json_object(text: str, pos: int) -> tuple[dict[str, tuple[Any, int, int]], int]:
    """The JSON object at ``pos`` as {key: (value, start, end)}, where each
    value's text is, and its end."""
    if not text.startswith("{", pos):
        raise _NotACall("expected a JSON object")
    fields: dict[str, tuple[Any, int, int]] = {}
    pos = _skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        return fields, pos + 1
    while True:
        key, pos = _json_value(text, pos)
        pos = _skip_ws(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            raise _NotACall("malformed JSON object")
        start = _skip_ws(text, pos + 1)
        value, end = _json_value(text, start)
        fields[key] = (value, start, end)
        pos = _skip_ws(text, end)
        if text.startswith("}", pos):
            return fields, pos + 1
        if not text.startswith(",", pos):
            raise _NotACall("malformed JSON object")
        pos = _skip_ws(text, pos + 1)


def _known_tool(name: str, tools: list[Tool]) -> Tool:
    for t in tools:
        if t.name == name:
            return t
    raise _NotACall(f"a call to {name!r}, which is not one of the request's tools")


def _object_call(text: str, pos: int, tools: list[Tool]) -> tuple[ParsedCall, int]:
    """The call object at ``pos`` (``{"name": ..., "arguments": {...}}``, or
    Llama's ``"parameters"``; other keys, such as Mistral's ``id``, ignored)
    and its end."""
    fields, end = _json_object(text, pos)
    name = fields.get("name", (None, 0, 0))[0]
    args = fields.get("arguments") or fields.get("parameters")
    if not isinstance(name, str) or args is None or not isinstance(args[0], dict):
        raise _NotACall('expected {"name": ..., "arguments": {...}}')
    _known_tool(name, tools)
    return ParsedCall(name, text[args[1] : args[2]]), end


def _object_list(text: str, pos: int, tools: list[Tool]) -> tuple[list[ParsedCall], int]:
    """The JSON list of call objects at ``pos`` and its end."""
    if not text.startswith("[", pos):
        raise _NotACall("expected a JSON list of calls")
    calls: list[ParsedCall] = []
    pos = _skip_ws(text, pos + 1)
    while True:
        call, pos = _object_call(text, pos, tools)
        calls.append(call)
        pos = _skip_ws(text, pos)
        if text.startswith("]", pos):
            return calls, pos + 1
        if not text.startswith(",", pos):
            raise _NotACall("malformed list of calls")
        pos = _skip_ws(text, pos + 1)


# Each reads the calls of one region, at a marker or the reply's start:
# (calls, end); _NotACall if it is not (yet) whole calls. ``final``: the reply
# is complete (else a region that only the reply's end settles is not read).
_Region = Callable[[str, int, list[Tool], bool], tuple[list[ParsedCall], int]]


def _llama3_region(
    text: str, i: int, tools: list[Tool], final: bool
) -> tuple[list[ParsedCall], int]:
    """Llama 3: ``[<|python_tag|>]{call}; {call}...``, nothing after the calls."""
    pos = i + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, i) else i
    calls: list[ParsedCall] = []
    while True:
        call, pos = _object_call(text, _skip_ws(text, pos), tools)
        calls.append(call)
        pos = _skip_ws(text, pos)
        if not text.startswith(";", pos) or not text[pos + 1 :].strip():
            break
        pos += 1
    if not final:
        raise _NotACall("another call or text may follow")
    if text[pos:].strip() not in ("", ";"):
        raise _NotACall("text after the calls")
    return calls, len(text)


def _mistral_region(
    text: str, i: int, tools: list[Tool], final: bool
) -> tuple[list[ParsedCall], int]:
    """Mistral: ``[TOOL_CALLS][{call}, ...]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``."""
    pos = _skip_ws(text, i + len(MISTRAL_CALLS))
    if text.startswith("[", pos):
        return _object_list(text, pos, tools)
    m = _MISTRAL_NAMED.match(text, pos)
    if not m:
        raise _NotACall("expected [{...}] or NAME[ARGS]{...} after [TOOL_CALLS]")
    tool = _known_tool(m.group(1), tools)
    args, end = _json_value(text, m.end())
    if not isinstance(args, dict):
        raise _NotACall("the arguments are not a JSON object")
    return [ParsedCall(tool.name, text[m.end() : end])], end


def _granite_region(
    text: str, i: int, tools: list[Tool], final: bool
) -> tuple[list[ParsedCall], int]:
    """Granite: ``<|tool_call|>[{call}, ...]`` (or the list alone, first in the reply)."""
    pos = i + len(GRANITE_CALLS) if text.startswith(GRANITE_CALLS, i) else i
    return _object_list(text, _skip_ws(text, pos), tools)


def _phi4_region(text: str, i: int, tools: list[Tool], final: bool) -> tuple[list[ParsedCall], int]:
    """Phi-4-mini: ``functools[{call}, ...]``."""
    return _object_list(text, i + len(PHI4_CALLS) - 1, tools)


def _qwen3_coder_region(
    text: str, i: int, tools: list[Tool], final: bool
) -> tuple[list[ParsedCall], int]:
    """Qwen3-Coder: ``<tool_call>`` + functions + ``</tool_call>`` (which a
    finished reply may leave out), or a ``<function=...>`` block alone."""
    if text.startswith(QWEN_FUNCTION, i):
        call, end = _xml_function(text, i, tools)
        return [call], end
    pos = i + len(HERMES_OPEN)
    calls: list[ParsedCall] = []
    while not calls or text.startswith(QWEN_FUNCTION, pos):
        call, pos = _xml_function(text, _skip_ws(text, pos), tools)
        calls.append(call)
        pos = _skip_ws(text, pos)
    if text.startswith(HERMES_CLOSE, pos):
        return calls, pos + len(HERMES_CLOSE)
    if final and pos == len(text):
        return calls, pos
    raise _NotACall(f"expected {HERMES_CLOSE} after </function>")


def _xml_function(text: str, pos: int, tools: list[Tool]) -> tuple[ParsedCall, int]:
    """One ``<function=NAME>`` block, its parameters converted to JSON
    arguments by the tool's schema, and its end."""
    m = _FUNCTION.match(text, pos)
    if not m:
        raise _NotACall("expected <function=NAME>")
    tool = _known_tool(m.group(1).strip(), tools)
    props = tool.parameters.get("properties")
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {}
    pos = m.end()
    while True:
        pos = _skip_ws(text, pos)
        if text.startswith("</function>", pos):
            arguments = json.dumps(args, ensure_ascii=False)
            return ParsedCall(tool.name, arguments), pos + len("</function>")
        p = _PARAMETER.match(text, pos)
        close = text.find("</parameter>", p.end()) if p else -1
        if p is None or close < 0:
            raise _NotACall("expected <parameter=NAME>VALUE</parameter> or </function>")
        name = p.group(1).strip()
        # The template writes the value between newlines: they are not part of it.
        value = text[p.end() : close].removeprefix("\n").removesuffix("\n")
        args[name] = _xml_value(props.get(name), value)
        pos = close + len("</parameter>")


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a schema names (from ``type``, ``enum``, ``const`` and
    ``anyOf`` / ``oneOf`` branches); empty when it names none."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = (
        {t}
        if isinstance(t, str)
        else {x for x in t if isinstance(x, str)}
        if isinstance(t, list)
        else set()
    )
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    for v in values if isinstance(values, list) else []:
        types.add("string" if isinstance(v, str) else "value")
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            types |= _schema_types(branch)
    return types


def _is_text(schema: Any) -> bool:
    """Whether a Qwen3-Coder parameter's value is its text as written: its
    schema allows a string, or names no type at all."""
    types = _schema_types(schema)
    return not types or "string" in types


def _xml_value(schema: Any, text: str) -> Any:
    """A Qwen3-Coder parameter's text as its JSON value: parsed as JSON when its
    schema wants a number, boolean, null, object or array and it parses; else the text."""
    if _is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        # The template writes a scalar with Jinja's ``string`` filter: Python's spelling.
        return _PYTHON_SCALARS.get(text.strip(), text)


_REGIONS: dict[str, _Region] = {
    "llama3_json": _llama3_region,
    "mistral": _mistral_region,
    "qwen3_coder": _qwen3_coder_region,
    "granite": _granite_region,
    "phi4_mini_json": _phi4_region,
}


def _next_region(text: str, fmt: str, pos: int) -> tuple[int, int]:
    """Where the next call may start at or after ``pos`` and how much of it is
    content if it is not a call (its marker); (-1, 0) when none may."""
    bare = _BARE.get(fmt)
    if pos == 0 and bare:
        s = text.lstrip()
        if s.startswith(bare):
            return len(text) - len(s), 1
    best = (-1, 0)
    for marker in _MARKERS[fmt]:
        i = text.find(marker, pos)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, len(marker))
    return best


def _parse_regions(
    text: str, fmt: str, tools: list[Tool], final: bool
) -> tuple[list[str], list[ParsedCall]]:
    """A reply in one of the ``_REGIONS`` formats as (content pieces, calls).
    With ``final`` False (a reply still being written) it stops at the first
    region it cannot read as whole calls yet: the calls it returns are
    settled, the same the whole reply will have first."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        i, skip = _next_region(text, fmt, pos)
        if i < 0:
            content.append(text[pos:])
            return content, calls
        try:
            found, end = _REGIONS[fmt](text, i, tools, final)
        except _NotACall as e:
            if not final:
                return content, calls
            _warn_kept(fmt, str(e), text[i:])
            content.append(text[pos : i + skip])
            pos = i + skip
            continue
        content.append(text[pos:i])
        calls.extend(found)
        pos = end


def new_call_id() -> str:
    """An id for one tool call, OpenAI-style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_json(calls: list[ParsedCall], ids: list[str] | None = None) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` for parsed calls."""
    ids = ids or [new_call_id() for _ in calls]
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in zip(ids, calls)
    ]


@dataclass
class ToolStream:
    """Turns a reply's text deltas into content and ``tool_calls`` deltas.

    Content is streamed until a call may start (the format's marker, or, in
    the JSON formats, a reply starting with ``{`` or ``[``), holding back a
    tail that could be the start of a marker. In the Hermes and JSON formats
    a call's name comes in one delta once it is complete, then its arguments
    as they are written, holding back what could still be the call's closing
    text; in the others each call comes whole once it is settled (Llama 3's
    when the reply ends: another call or text could still follow). ``finish``
    sends what is left, so the deltas joined equal the non-streamed reply's
    calls.
    """

    fmt: str
    tools: list[Tool]
    forced: bool
    text: str = ""
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fmt = parse_as(self.fmt)

    def _call_region(self) -> int | None:
        """Where the first call starts in the text (None: no call has begun)."""
        if self.fmt == "json" and self.forced:
            return len(self.text) - len(self.text.lstrip())
        i, _ = _next_region(self.text, self.fmt, 0)
        return None if i < 0 else i

    def _content_limit(self) -> int:
        """How much of the text is surely content (before any possible call start)."""
        start = self._call_region()
        if start is not None:
            return start
        if self.fmt in _BARE and not self.text.strip():
            return 0  # the reply may still start with a call
        # Hold back a tail that could be the beginning of a marker.
        markers = _MARKERS[self.fmt]
        for k in range(min(max(map(len, markers), default=1) - 1, len(self.text)), 0, -1):
            if any(m.startswith(self.text[-k:]) for m in markers):
                return len(self.text) - k
        return len(self.text)

    def add(self, delta: str) -> list[dict[str, Any]]:
        """The chat ``delta`` objects for new text."""
        self.text += delta
        return self._deltas(final=False)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the reply made tool calls."""
        deltas = self._deltas(final=True)
        return deltas, bool(self.ids)

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        parsed = None
        if final:
            parsed = content, calls = parse_reply(self.text, self.fmt, self.tools)
            if not calls:
                rest = self.text[self.sent_content :]
                if rest:
                    out.append({"content": rest})
                    self.sent_content = len(self.text)
                return out
            # Text between or after the calls: what the whole reply's content has
            # beyond what was streamed before the first call.
            sent = self.text[: self.sent_content].strip()
            if content and content.startswith(sent) and len(content) > len(sent):
                out.append({"content": content[len(sent) :]})
        limit = self._content_limit()
        if limit > self.sent_content and not self.ids:
            out.append({"content": self.text[self.sent_content : limit]})
            self.sent_content = limit
        start = self._call_region()
        if start is None:
            return out
        calls_seen = self._partial_calls(start, parsed)
        for k, (name, args, complete) in enumerate(calls_seen):
            if k >= len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": k,
                                "id": self.ids[k],
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            # Hold back what could be the end of the call object and its closing marker.
            hold = 0 if complete else len(" }\n" + HERMES_CLOSE)
            upto = max(self.sent_args[k], len(args) - hold)
            if upto > self.sent_args[k]:
                piece = args[self.sent_args[k] : upto]
                self.sent_args[k] = upto
                out.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        return out

    def _partial_calls(
        self, start: int, parsed: tuple[str | None, list[ParsedCall]] | None
    ) -> list[tuple[str, str, bool]]:
        """(name, arguments text so far, complete) of each call begun after
        ``start``; ``parsed``: the whole reply's parse, once it is finished."""
        found: list[tuple[str, str, bool]] = []
        if parsed is not None:
            return [(c.name, c.arguments, True) for c in parsed[1]]
        if self.fmt in _REGIONS:
            _, settled = _parse_regions(self.text, self.fmt, self.tools, final=False)
            return [(c.name, c.arguments, True) for c in settled]
        pos = start
        while pos < len(self.text):
            j = pos
            if self.fmt == "hermes":
                i = self.text.find(HERMES_OPEN, pos)
                if i < 0:
                    break
                j = i + len(HERMES_OPEN)
            while j < len(self.text) and self.text[j].isspace():
                j += 1
            m = _ARGS_START.match(self.text, j)
            if not m:
                break
            call, end, _ = _decode_call(self.text, j)
            if call is not None and call.name in {t.name for t in self.tools}:
                found.append((call.name, call.arguments, True))
                pos = end
                continue
            if call is not None:
                break
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                break
            if name not in {t.name for t in self.tools}:
                break  # not a call to one of the tools: left for the final parse
            found.append((name, self.text[m.end() :], False))
            break
        return found
