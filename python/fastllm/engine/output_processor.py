"""Output processor: sampled tokens in, text and ``RequestOutput`` out.

The one place that detokenizes (incrementally), finds stop strings, records
logprobs and builds ``RequestOutput``s, cumulative, as deltas or only the
final one (``SamplingParams.output_kind``). ``LLM.generate``, ``LLM.stream``
and the HTTP server all read what it builds, so a streamed text joined is the
text of the same request run without streaming.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fastllm.engine.request import Request
from fastllm.engine.scheduler import SampledToken, StepUpdate
from fastllm.engine.sequence import Sequence
from fastllm.outputs import CompletionOutput, Logprob, RequestOutput
from fastllm.sampling_params import RequestOutputKind
from fastllm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Text:
    """The text side of one sequence, and how much of it a delta output has sent."""

    detokenizer: IncrementalDetokenizer | None  # None: no text (detokenize=False, no tokenizer)
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


class OutputProcessor:
    """Holds the engine's requests and the text state of their sequences."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._texts: dict[int, _Text] = {}

    # ---- requests -------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Starts tracking a request."""
        self.requests[req.request_id] = req

    def release_all(self) -> None:
        """Forgets every request (an engine reset after an interrupt)."""
        self.requests.clear()
        self._texts.clear()

    def release(self, req: Request) -> None:
        """Forgets a finished or aborted request."""
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._texts.pop(seq.seq_id, None)

    def _text(self, seq: Sequence) -> _Text:
        state = self._texts.get(seq.seq_id)
        if state is None:
            detok = None
            if self.tokenizer is not None and seq.params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
                )
            state = self._texts[seq.seq_id] = _Text(detok)
        return state

    # ---- after a step ---------------------------------------------------

    def process(self, update: StepUpdate, now: float) -> list[tuple[Sequence, str]]:
        """Records the step's new tokens (text, logprobs, timings); returns the
        sequences that a stop string ends, with that string. Their text is
        already cut; the caller finishes them (``Scheduler.stop``)."""
        for child in update.forked:
            self.requests[child.request_id].seqs.append(child)
        hits: list[tuple[Sequence, str]] = []
        for seq, sample in update.new_tokens:
            req = self.requests[seq.request_id]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            hit = self._add_token(seq, sample)
            if hit is not None:
                hits.append((seq, hit))
        return hits

    def _add_token(self, seq: Sequence, sample: SampledToken) -> str | None:
        p = seq.params
        state = self._text(seq)
        if p.logprobs is not None:
            state.cumulative_logprob += sample.logprob
            entry = {sample.token: Logprob(sample.logprob, sample.rank)}
            for i, (t, v) in enumerate(sample.top):
                if t not in entry:
                    entry[t] = Logprob(v, i + 1)
            if state.detokenizer is not None:
                self._decode_logprob_tokens([entry])
            state.logprobs.append(entry)
        # The scheduler has applied the token rules: "stop" here means EOS or a
        # stop token, whose text is shown only with include_stop_str_in_output
        # (a token that completed the grammar is text like any other).
        stopped_by_token = seq.finish_reason == "stop" and not seq.grammar_complete
        if state.detokenizer is None or (stopped_by_token and not p.include_stop_str_in_output):
            return None
        delta = state.detokenizer.add(sample.token)
        state.text += delta
        if stopped_by_token or not p._stop_list or not delta:
            return None
        if seq.num_output_tokens < p.min_tokens:
            return None
        hit = _find_stop(state.text, len(delta), p._stop_list)
        if hit is None:
            return None
        pos, stop = hit
        state.text = (
            state.text[: pos + len(stop)] if p.include_stop_str_in_output else state.text[:pos]
        )
        return stop

    def add_prompt_logprobs(self, seq: Sequence, entries: list[dict[int, Logprob]]) -> None:
        """Appends the logprobs of a chunk's next prompt tokens to the request's."""
        req = self.requests[seq.request_id]
        self._decode_logprob_tokens(entries)
        if req.prompt_logprobs is not None:
            req.prompt_logprobs.extend(entries)

    def _decode_logprob_tokens(self, entries: list[dict[int, Logprob]]) -> None:
        if self.tokenizer is None:
            return
        for d in entries:
            for t, lp in d.items():
                lp.decoded_token = self.tokenizer.decode([t], skip_special_tokens=False)

    # ---- outputs --------------------------------------------------------

    def outputs(self, request_ids: Iterable[str], now: float) -> list[RequestOutput]:
        """The outputs due for these requests after a step, in their output
        kind; finished requests are released."""
        outs = []
        for rid in dict.fromkeys(request_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            finished = req.finished
            if finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now
            out = self.output(req, finished)
            if out is not None:
                outs.append(out)
            if finished:
                self.release(req)
        return outs

    def output(self, req: Request, finished: bool) -> RequestOutput | None:
        """The request's output now (None when its output kind has nothing to say)."""
        kind = req.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        comps = []
        for seq in req.seqs:
            c = self._completion(seq, delta)
            if c is not None:
                comps.append(c)
        if delta and not comps and not finished:
            return None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=comps,
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
        )

    def _completion(self, seq: Sequence, delta: bool) -> CompletionOutput | None:
        state = self._text(seq)
        want_lp = seq.params.logprobs is not None
        tokens = seq.output_token_ids
        text, logprobs = state.text, state.logprobs
        finish = seq.finish_reason
        if delta:
            if state.sent_finish:
                return None
            hold = 0 if finish else seq.params.stop_holdback
            end = max(state.sent_text, len(text) - hold)
            first = state.sent_tokens
            text, tokens, logprobs = text[state.sent_text : end], tokens[first:], logprobs[first:]
            state.sent_text = end
            state.sent_tokens += len(tokens)
            state.sent_finish = finish is not None
            if not text and not tokens and finish is None:
                return None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=state.cumulative_logprob if want_lp else None,
            logprobs=list(logprobs) if want_lp else None,
            finish_reason=finish,
            stop_reason=seq.stop_reason,
        )


def _find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last new_len characters."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
