"""``fastllm chat``'s conversation at the terminal: each turn streamed as it
is written, Ctrl-C to stop a reply, the oldest exchanges dropped when the
conversation outgrows the context."""

from __future__ import annotations

import sys
from typing import Any

from fastllm.inputs import chat_prompt


class _StopReply:
    """While active, Ctrl-C asks the streaming reply to stop after the engine
    step in progress (a step is never cut halfway, so the engine stays
    consistent for the next message); a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopReply:
        import signal

        try:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
            self._previous = None
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def chat_turn(llm: Any, messages: list[dict], line: str, params: Any, template: str | None) -> None:
    """One exchange: the user's line, then the reply streamed to the terminal.
    Ctrl-C stops the reply (its request is aborted) and the conversation keeps
    what was shown."""
    messages.append({"role": "user", "content": line})
    reply: list[str] = []
    started = False
    with _StopReply() as stop:
        try:
            fitted = fit_conversation(llm, messages, params, template)
            if fitted is None:
                messages.pop()
                return
            prompt, turn_params = fitted
            if stop.requested:
                raise KeyboardInterrupt
            print("assistant> ", end="", flush=True)
            started = True
            stream = llm.stream(prompt, turn_params)
            try:
                for out in stream:
                    for c in out.outputs:
                        reply.append(c.text)
                        sys.stdout.write(c.text)
                        sys.stdout.flush()
                    if stop.requested:
                        break
            finally:
                stream.close()  # aborts the request if it is still running
        except KeyboardInterrupt:
            stop.requested = True
        if started:
            print(flush=True)
        if stop.requested:
            print("[interrupted]", file=sys.stderr, flush=True)
    text = "".join(reply)
    if text:
        messages.append({"role": "assistant", "content": text})
    else:  # nothing was said: the conversation goes on as if the line was not sent
        messages.pop()


def fit_conversation(
    llm: Any, messages: list[dict], params: Any, template: str | None
) -> tuple[dict, Any] | None:
    """The prompt of the conversation and the reply's parameters. The oldest
    exchanges (never the system message or the new line) are dropped while the
    prompt leaves less than min(max_tokens, half the context) for the reply;
    max_tokens is capped to the context left. None (after printing why) when
    even the new line alone does not fit."""
    engine = llm.llm_engine
    tok = engine.tokenizer
    limit = engine.max_model_len
    want = params.max_tokens or limit
    room = min(want, limit // 2)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while True:
        text, ids = chat_prompt(tok, messages, template)
        if len(ids) + room <= limit or len(messages) - first <= 1:
            break
        del messages[first : first + 2]  # the oldest user message and its reply
        dropped += 2
    if dropped:
        print(
            f"(dropped the {dropped} oldest messages to fit the {limit}-token context)",
            file=sys.stderr,
            flush=True,
        )
    turn_params = params.clone(max_tokens=max(1, min(want, limit - len(ids))))
    try:
        engine.validate_request(ids, turn_params, "conversation")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return None
    return {"prompt": text, "prompt_token_ids": ids}, turn_params
