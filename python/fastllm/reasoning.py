"""Reasoning parsers: a reasoning model's reply split into its thinking
(``reasoning_content``) and its answer (``content``), whole or as streamed
deltas, with vLLM's parser names (``--reasoning-parser``).

Both parsers read ``<think>…</think>`` blocks:

- ``qwen3``: the reply thinks when the prompt leaves a block open (the chat
  template wrote ``<think>``) or the reply opens one; otherwise all of it is
  the answer (``enable_thinking=False`` templates close the block in the
  prompt).
- ``deepseek_r1``: the reply is thinking until ``</think>`` even when the
  opening tag is nowhere (DeepSeek-R1's template opens it in the prompt).

``openai_gptoss`` reads gpt-oss's harmony format instead: a reply is a run
of messages ``<|channel|>NAME<|message|>BODY<|end|>`` (each after the
first opened by ``<|start|>assistant``); the ``analysis`` channel is the
reasoning and the ``final`` and ``commentary`` channels the answer, with the
markup removed. A message addressed to a function (``to=functions.NAME`` in
its header, the body the call's JSON arguments, ended by ``<|call|>``) is a
tool call: it goes into the answer as a Hermes-style call,
``<tool_call>{"name": "NAME", "arguments": BODY}</tool_call>``, which the
server's ``openai`` tool-call format reads (``server/tools.py``). Its
markers are special tokens, so an engine with this parser decodes replies
with ``skip_special_tokens=False`` (``keeps_special_tokens``).

Thinking that never closes (``max_tokens`` ran out) is all reasoning. The
reasoning is the text between the tags without the whitespace that borders
it, the answer is the text after the closing tag without its leading
whitespace; an empty part is None. The whole-text split is the stream run over
the whole text, so streamed deltas always join to the whole reply's fields.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """How one family marks its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    #: Whether a reply that does not open a block still starts inside one.
    implicit_start: bool = False
    #: Whether the markers are special tokens the reply's text must keep.
    keeps_special_tokens: bool = False

    def prompt_opens(self, prompt: str | None) -> bool:
        """Whether ``prompt`` ends inside a thinking block (the template opened it)."""
        if not prompt:
            return False
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A splitter for one reply to ``prompt`` (its rendered text)."""
        return ReasoningStream(self, self.prompt_opens(prompt) or self.implicit_start)

    def split(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole reply; an empty part is None."""
        s = self.stream(prompt)
        r1, c1 = s.add(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, (c1 + c2) or None


@dataclass(frozen=True)
class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: the ``analysis`` channel is the reasoning.
    ``start`` / ``end`` delimit the analysis message (the thinking budget
    closes it with ``end``)."""

    start: str = "<|channel|>analysis<|message|>"
    end: str = "<|end|>"
    keeps_special_tokens: bool = True

    def stream(self, prompt: str | None = None) -> HarmonyStream:  # type: ignore[override]
        """A splitter for one reply (the prompt ends before the reply's header)."""
        return HarmonyStream()


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
    "openai_gptoss": HarmonyParser("openai_gptoss"),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called ``name`` (None: none); a ValueError listing the names."""
    if name is None:
        return None
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        names = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; fastllm has {names}")
    return parser


class _Splitter:
    """Text deltas in, ``(reasoning delta, content delta)`` out; the held-back
    text is ``_buf`` and ``_advance`` moves it on."""

    _buf: str

    def add(self, delta: str) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for new text."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The last deltas, once the reply has ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningStream(_Splitter):
    """Splits a reply's text deltas into reasoning and content deltas.

    Phases: ``open`` (the reply may still open a block: leading whitespace and
    a prefix of the opening tag are held back), ``think`` (inside the block: a
    tail that may begin the closing tag, and trailing whitespace, are held
    back) and ``answer`` (after the block, or a reply that never thinks).
    """

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser = parser
        self.phase = "open"
        # the phase a reply that does not open a block is in
        self._unopened = "think" if thinking else "answer"
        self._buf = ""  # held-back text of the current phase
        self._started = False  # the current part has sent something
        self._answer_started = False

    @property
    def thinking_done(self) -> bool:
        """Whether the answer has begun (the block closed, or there was none)."""
        return self.phase == "answer"

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.phase == "open":
            start = self.parser.start
            head = self._buf.lstrip()
            if head.startswith(start):
                self.phase = "think"
                self._buf = head[len(start) :]
            elif not final and start.startswith(head):
                return "", ""  # maybe the opening tag, not yet whole
            else:
                self.phase = self._unopened
        if self.phase == "think":
            end = self.parser.end
            i = self._buf.find(end)
            if i >= 0:
                reasoning = self._take_reasoning(i, closed=True)
                self._buf = self._buf[len(end) :]
                self.phase = "answer"
            else:
                hold = 0 if final else _partial_suffix(self._buf, end)
                return self._take_reasoning(len(self._buf) - hold, closed=final), ""
        if self.phase == "answer":
            text = self._buf
            self._buf = ""
            if not self._answer_started:
                text = text.lstrip()
                self._answer_started = bool(text)
            content = text
        return reasoning, content

    def _take_reasoning(self, upto: int, closed: bool) -> str:
        """Sends the block's text up to ``upto`` of the held text: the block's
        leading whitespace is dropped, and whitespace at the end is held back
        (it may border the closing tag) unless ``closed``, when it is dropped."""
        body = self._buf[:upto]
        if not self._started:
            stripped = body.lstrip()
            upto -= len(body) - len(stripped)
            self._buf = self._buf[len(body) - len(stripped) :]
            body = stripped
        out = body.rstrip()
        self._buf = self._buf[upto:] if closed else self._buf[len(out) :]
        self._started = self._started or bool(out)
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


# Harmony's markers (special tokens of gpt-oss's tokenizer).
_MESSAGE, _CHANNEL, _START = "<|message|>", "<|channel|>", "<|start|>"
# What ends a message's body: the message's end, the reply's end, a tool
# call's end, or the next message's header.
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", _START)
# A header's recipient when the message calls a function (``to=functions.NAME``,
# before or after the channel).
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
# A function call as the answer carries it (the Hermes markup of ``server/tools.py``).
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "}\n</tool_call>"


class HarmonyStream(_Splitter):
    """Splits a harmony reply's text deltas into reasoning and content deltas.

    Phases: ``header`` (up to ``<|message|>``: held back, never sent; its
    channel decides where the body goes), ``body`` (sent as it comes, but a
    tail that may begin a marker that ends it) and ``plain`` (a reply that
    does not start with a header: all of it is the answer).
    """

    def __init__(self) -> None:
        self.phase = "header"
        self._buf = ""
        self._channel: str | None = None
        self._seen_message = False
        self._call = False  # the current body is a function call's arguments

    @property
    def thinking_done(self) -> bool:
        """Whether the reply has moved past its analysis."""
        return self.phase == "plain" or self._channel not in (None, "analysis")

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.phase == "plain":
                content.append(self._buf)
                self._buf = ""
                break
            if self.phase == "header":
                if not self._seen_message and not self._may_be_header(final):
                    self.phase = "plain"
                    continue
                i = self._buf.find(_MESSAGE)
                if i < 0:
                    if final:
                        self._buf = ""  # a header cut off: nothing to show
                    break
                header = self._buf[:i]
                self._channel = _channel_of(header)
                self._buf = self._buf[i + len(_MESSAGE) :]
                self._seen_message = True
                self.phase = "body"
                recipient = _RECIPIENT.search(header)
                self._call = recipient is not None
                if recipient is not None:
                    name = json.dumps(recipient.group(1))
                    content.append(f'{CALL_OPEN}{{"name": {name}, "arguments": ')
            ends = [(j, m) for m in _BODY_ENDS if (j := self._buf.find(m)) >= 0]
            out = content if self._call or self._channel != "analysis" else reasoning
            if ends:
                j, marker = min(ends)
                out.append(self._buf[:j])
                self._buf = self._buf[j + (0 if marker == _START else len(marker)) :]
                self._close_call(content)
                self.phase = "header"
                continue
            hold = 0 if final else max(_partial_suffix(self._buf, m) for m in _BODY_ENDS)
            out.append(self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold :]
            if final:
                self._close_call(content)  # arguments cut off: the parser keeps them as text
            break
        return "".join(reasoning), "".join(content)

    def _close_call(self, content: list[str]) -> None:
        """Ends the function call the body was, if it was one."""
        if self._call:
            content.append(CALL_CLOSE)
            self._call = False

    def _may_be_header(self, final: bool) -> bool:
        """Whether the reply (nothing sent yet) starts, or may start, with a header."""
        head = self._buf.lstrip()
        if not head:
            return not final
        for marker in (_CHANNEL, _START):
            if head.startswith(marker) or (not final and marker.startswith(head)):
                return True
        return False


def _channel_of(header: str) -> str | None:
    """The channel a message header names (``<|channel|>final``, possibly
    with `` to=functions.f <|constrain|>json``), or None."""
    i = header.rfind(_CHANNEL)
    if i < 0:
        return None
    name = header[i + len(_CHANNEL) :].split("<|", 1)[0].split()
    return name[0] if name else None
