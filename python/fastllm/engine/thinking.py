"""The engine's view of a reply's thinking block, token by token: where it
is (before, inside or after the block), the request's thinking budget, and
the grammar of its structured output, which applies to the answer only.

Set on a sequence by the engine when it has a reasoning parser and the
request has a budget or an output constraint. Its state is a function of the
output tokens, like a grammar matcher's, so preemption by recompute keeps it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

OPEN, THINK, ANSWER = "open", "think", "answer"


def rfind_sublist(ids: list[int], sub: list[int]) -> int:
    """The start of the last occurrence of ``sub`` in ``ids`` (-1: none)."""
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if ids[i : i + n] == sub:
            return i
    return -1


@dataclass
class ThinkingTags:
    """A reasoning parser's tags as token ids (the engine encodes them once)."""

    start_ids: list[int]
    end_ids: list[int]

    def prompt_opens(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside a thinking block (the template opened it)."""
        return rfind_sublist(prompt_ids, self.start_ids) > rfind_sublist(prompt_ids, self.end_ids)


@dataclass
class ThinkingState:
    """One sequence's place relative to its thinking block.

    ``open``: nothing generated yet; a reply may open a block with the
    (single-token) opening tag, which stays allowed beside the grammar's
    tokens. ``think``: inside the block; the grammar waits, the budget
    counts, and once it is spent the closing tag is forced token by token.
    ``answer``: the grammar (if any) applies from here on.
    """

    tags: ThinkingTags
    budget: int | None
    phase: str
    count: int = 0
    forced: list[int] = field(default_factory=list)
    #: the output constraint, held here while the reply thinks
    grammar: Any = None

    @classmethod
    def start(
        cls, tags: ThinkingTags, prompt_ids: list[int], budget: int | None, implicit: bool
    ) -> ThinkingState:
        """The state of a new reply; ``implicit``: a reply that does not open a
        block still starts inside one (the deepseek_r1 parser)."""
        thinking = implicit or tags.prompt_opens(prompt_ids)
        state = cls(tags, budget, THINK if thinking else OPEN)
        state._check_budget()
        return state

    @property
    def opening_token(self) -> int | None:
        """The token that opens a block, while the reply may still open one."""
        ids = self.tags.start_ids
        return ids[0] if self.phase == OPEN and len(ids) == 1 else None

    def on_token(self, token: int, output_ids: list[int]) -> bool:
        """Advances past ``token`` (already appended to ``output_ids``);
        whether it belongs to the thinking (the grammar does not see it)."""
        if self.forced and token == self.forced[0]:
            self.forced.pop(0)
        if self.phase == OPEN:
            if token == self.opening_token:
                self.phase = THINK
                self._check_budget()
                return True
            self.phase = ANSWER
            return False
        if self.phase == THINK:
            end = self.tags.end_ids
            if output_ids[-len(end) :] == end:
                self.phase = ANSWER
                self.forced.clear()
            else:
                self.count += 1
                self._check_budget()
            return True
        return False

    def _check_budget(self) -> None:
        if (
            self.phase == THINK
            and self.budget is not None
            and self.count >= self.budget
            and not self.forced
        ):
            self.forced = list(self.tags.end_ids)

    def fork(self) -> ThinkingState:
        """A copy for a sibling completion (its own grammar matcher)."""
        child = copy.copy(self)
        child.forced = list(self.forced)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child
