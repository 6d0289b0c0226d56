"""Structured outputs on the engine side: one grammar vocabulary per engine
(built from the tokenizer on first use, shared per process by the Rust core),
one grammar matcher per constrained sequence, and the step's token masks."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import torch

from fastllm import _core

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.engine.sequence import Sequence
    from fastllm.sampling_params import StructuredOutputsParams
    from fastllm.tokenizer import Tokenizer


class StructuredOutputs:
    """Starts grammar matchers for an engine's tokenizer and model vocabulary."""

    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: set[int], vocab_size: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._vocab: _core.GrammarVocabulary | None = None

    def check(self) -> None:
        """A ValueError if this engine cannot run constrained requests (cheap:
        the vocabulary itself is built by the first request that needs it)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        if not self.eos_token_ids:
            raise ValueError("structured_outputs needs the model's EOS token id; it has none")

    @property
    def vocabulary(self) -> _core.GrammarVocabulary:
        """The token trie and grammar compiler (built on first use, by the
        thread that runs the engine)."""
        if self._vocab is None:
            self.check()
            assert self.tokenizer is not None
            self._vocab = _core.GrammarVocabulary(
                self.tokenizer.to_json().encode(), self.eos_token_ids, self.vocab_size
            )
        return self._vocab

    def start(self, params: StructuredOutputsParams) -> _core.GrammarMatcher:
        """A fresh matcher for ``params`` (its grammar compiled once, then cached)."""
        kind, value = params.constraint
        try:
            return self.vocabulary.start(kind, value, params.any_whitespace)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{e}") from None


class GrammarMasks:
    """The token masks of one step's constrained rows.

    ``start`` may run before the forward pass: on a worker thread it computes
    the bitmask of every constrained row (the Rust core releases the GIL), so
    the masks overlap the model's work; ``apply`` then waits for them and sets
    the disallowed logits to -inf. Without a worker, ``apply`` computes them
    itself (on CPU logits, in the Rust pass that also writes the -inf).
    """

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        first: dict[int, int] = {}
        self.rows: list[int] = []
        self.matchers: list[_core.GrammarMatcher] = []
        # A sequence listed on several rows (the first tokens of an n > 1 request
        # come from one row) has its mask computed once and copied.
        self.repeats: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            if seq.grammar is None:
                continue
            j = first.setdefault(seq.seq_id, i)
            if j != i:
                self.repeats.append((i, j))
                continue
            self.rows.append(i)
            self.matchers.append(seq.grammar)
        self._future: Future[bytes] | None = None
        self._vocab = 0

    def start(self, executor: Executor, vocab: int) -> GrammarMasks:
        """Begins computing the bitmasks on ``executor`` (vocabulary width ``vocab``)."""
        if self.matchers:
            self._vocab = vocab
            self._future = executor.submit(_core.grammar_bitmask, self.matchers, vocab)
        return self

    def apply(self, logits: torch.Tensor, bitmask: bool | None = None) -> None:
        """Sets to -inf, in place, every logit of row i that ``seqs[i]``'s grammar
        does not allow next; rows without a grammar are left as they are. A
        request's stop tokens (a chat template's end of turn) count as EOS: they
        stay allowed exactly when the grammar accepts. ``bitmask``: go through
        the bitmask (as for CUDA logits) even on the CPU."""
        if not self.matchers:
            return
        raw = self._future.result() if self._future is not None else None
        # Stop tokens of rows whose grammar accepts keep their logits.
        # So does the token that opens a thinking block, while a reply may open one.
        keep = []
        for i, m in zip(self.rows, self.matchers):
            seq = self.seqs[i]
            ids_kept = list(seq.params.stop_token_ids) if m.is_accepting() else []
            opening = seq.thinking.opening_token if seq.thinking is not None else None
            if opening is not None:
                ids_kept.append(opening)
            if ids_kept:
                ids = torch.tensor(ids_kept, device=logits.device)
                keep.append((i, ids, logits[i, ids].clone()))
        vocab = logits.shape[1]
        if raw is not None or logits.is_cuda or bitmask:
            if raw is None or self._vocab != vocab:
                raw = _core.grammar_bitmask(self.matchers, vocab)
            words = (vocab + 31) // 32
            bits = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(len(self.rows), words)
            allowed = unpack_bitmask(bits.to(logits.device), vocab)
            idx = torch.tensor(self.rows, device=logits.device)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        else:
            _core.apply_grammar_masks(logits, self.rows, self.matchers)
        for i, ids, values in keep:
            logits[i, ids] = values
        for i, j in self.repeats:
            logits[i] = logits[j]


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bool ``[rows, vocab]`` tensor from int32 bitmask words (token t at
    bit t % 32 of word t // 32), on the bitmask's device."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    unpacked = (bits.unsqueeze(-1) >> shifts).bitwise_and(1).bool()
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab]
