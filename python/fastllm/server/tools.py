"""Tool calls of the chat API: the constraint a forced call is generated
under, and the parser that turns a reply into OpenAI's ``tool_calls`` (whole,
or as streamed deltas).

Two call formats: the Hermes / Qwen one, used when the chat template defines
it (``<tool_call>`` + a JSON ``{"name": ..., "arguments": {...}}`` +
``</tool_call>``), and otherwise that JSON object alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastllm.sampling_params import StructuredOutputsParams
from fastllm.server.protocol import APIError

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
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


def call_format(chat_template: str | None) -> str:
    """``"hermes"`` when the chat template writes Hermes / Qwen tool calls, else ``"json"``."""
    return "hermes" if chat_template and HERMES_OPEN in chat_template else "json"


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    def one(t: Tool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    return one(tools[0]) if len(tools) == 1 else {"anyOf": [one(t) for t in tools]}


def forced_call_constraint(tools: list[Tool], fmt: str) -> StructuredOutputsParams:
    """The constraint of a forced call (``required``: any tool; named: that one):
    exactly one call in the model family's format, arguments per the schema."""
    schema = _call_schema(tools)
    if fmt == "json":
        return StructuredOutputsParams(json=schema, whitespace_pattern=_CALL_WHITESPACE)
    schema = {**schema, "x-guidance": {"whitespace_pattern": _CALL_WHITESPACE}}
    grammar = (
        f"start: {json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}\n"
        f"call: %json {json.dumps(schema)}\n"
    )
    return StructuredOutputsParams(grammar=grammar)


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
    arguments: str  # the arguments' JSON text as the model wrote it


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


def parse_reply(text: str, fmt: str, tools: list[Tool]) -> tuple[str | None, list[ParsedCall]]:
    """A finished reply as (content or None, tool calls), calls to unknown tools left as text."""
    names = {t.name for t in tools}
    if fmt == "json":
        s = text.strip()
        call, end, _ = _decode_call(s, 0)
        if call is not None and call.name in names and not s[end:].strip():
            return None, [call]
        return text, []
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
            content.append(text[pos:j])
            pos = j
            continue
        content.append(text[pos:i])
        calls.append(call)
        pos = close + len(HERMES_CLOSE)
    body = "".join(content).strip()
    return (body or None), calls


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

    Content is streamed until a call may start (the Hermes marker, or, in the
    JSON format, a reply starting with ``{``); a call's name comes in one
    delta once it is complete, then its arguments as they are written,
    holding back what could still be the call's closing text. ``finish``
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

    def _call_region(self) -> int | None:
        """Where the first call starts in the text (None: no call has begun)."""
        if self.fmt == "json":
            s = self.text.lstrip()
            if self.forced or s.startswith("{"):
                return len(self.text) - len(s)
            return None
        i = self.text.find(HERMES_OPEN)
        return None if i < 0 else i

    def _content_limit(self) -> int:
        """How much of the text is surely content (before any possible call start)."""
        start = self._call_region()
        if start is not None:
            return start
        if self.fmt == "json":
            return 0 if not self.text.strip() else len(self.text)
        # Hold back a tail that could be the beginning of the marker.
        for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
            if HERMES_OPEN.startswith(self.text[-k:]):
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
        if final:
            content, calls = parse_reply(self.text, self.fmt, self.tools)
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
        calls_seen = self._partial_calls(start, final)
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

    def _partial_calls(self, start: int, final: bool) -> list[tuple[str, str, bool]]:
        """(name, arguments text so far, complete) of each call begun after ``start``."""
        found: list[tuple[str, str, bool]] = []
        if final:
            _, calls = parse_reply(self.text, self.fmt, self.tools)
            return [(c.name, c.arguments, True) for c in calls]
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
