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

Thinking that never closes (``max_tokens`` ran out) is all reasoning. The
reasoning is the text between the tags without the whitespace that borders
it, the answer is the text after the closing tag without its leading
whitespace; an empty part is None. The whole-text split is the stream run over
the whole text, so streamed deltas always join to the whole reply's fields.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """How one family marks its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    #: Whether a reply that does not open a block still starts inside one.
    implicit_start: bool = False

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


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
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


class ReasoningStream:
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

    def add(self, delta: str) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for new text."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The last deltas, once the reply has ended."""
        return self._advance(final=True)

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
