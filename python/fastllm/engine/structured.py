"""Structured outputs on the engine side: one grammar vocabulary per engine
(built from the tokenizer on first use, shared per process by the Rust core),
one grammar matcher per constrained sequence, and the step's token masks."""

from __future__ import annotations

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

    @property
    def vocabulary(self) -> _core.GrammarVocabulary:
        """The token trie and grammar compiler (built on first use)."""
        if self._vocab is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine has none")
            if not self.eos_token_ids:
                raise ValueError("structured_outputs needs the model's EOS token id; it has none")
            self._vocab = _core.GrammarVocabulary(
                self.tokenizer.to_json().encode(), self.eos_token_ids, self.vocab_size
            )
        return self._vocab

    def start(self, params: StructuredOutputsParams) -> _core.GrammarMatcher:
        """A fresh matcher for ``params`` (its grammar compiled once, then cached)."""
        kind, value = params.constraint
        try:
            return self.vocabulary.start(kind, value, not params.disable_any_whitespace)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{e}") from None


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Sets to -inf, in place, every logit of row i that ``seqs[i]``'s grammar
    does not allow next; rows without a grammar are left as they are. A
    request's stop tokens (a chat template's end of turn) count as EOS: they
    stay allowed exactly when the grammar accepts.

    A sequence listed on several rows (the first tokens of an ``n > 1``
    request come from one row) has its mask computed once and copied.
    """
    first: dict[int, int] = {}
    rows: list[int] = []
    matchers: list[_core.GrammarMatcher] = []
    repeats: list[tuple[int, int]] = []
    for i, seq in enumerate(seqs):
        if seq.grammar is None:
            continue
        j = first.setdefault(seq.seq_id, i)
        if j != i:
            repeats.append((i, j))
            continue
        rows.append(i)
        matchers.append(seq.grammar)
    if not matchers:
        return
    # Stop tokens of rows whose grammar accepts keep their logits.
    keep = []
    for i, m in zip(rows, matchers):
        stops = seqs[i].params.stop_token_ids
        if stops and m.is_accepting():
            ids = torch.tensor(stops, device=logits.device)
            keep.append((i, ids, logits[i, ids].clone()))
    if logits.is_cuda:
        vocab = logits.shape[1]
        words = (vocab + 31) // 32
        raw = _core.grammar_bitmask(matchers, vocab)
        bits = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(len(matchers), words)
        allowed = unpack_bitmask(bits.to(logits.device), vocab)
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    else:
        _core.apply_grammar_masks(logits, rows, matchers)
    for i, ids, values in keep:
        logits[i, ids] = values
    for i, j in repeats:
        logits[i] = logits[j]


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bool ``[rows, vocab]`` tensor from int32 bitmask words (token t at
    bit t % 32 of word t // 32), on the bitmask's device."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    unpacked = (bits.unsqueeze(-1) >> shifts).bitwise_and(1).bool()
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab]
