"""The ``fastllm`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastllm`` console script."""
    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="show what fastllm sees on this machine")
    add_model_commands(sub)
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is not None:
        return args.run(args)
    if args.command == "env":
        from fastllm import __version__

        print(f"fastllm {__version__}, Python {sys.version.split()[0]}")
    return 0


# ---- serve, generate, chat -------------------------------------------------------


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    """Adds the ``serve``, ``generate`` and ``chat`` subcommands."""
    fmt = _HelpFormatter
    p = sub.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
        formatter_class=fmt,
    )
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $FASTLLM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: MODEL as given)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn log level",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default=4 << 20,
        help="largest request body accepted (larger ones get 413)",
    )
    p.set_defaults(run=_run_serve)

    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate a completion of each --prompt and print it.",
        formatter_class=fmt,
    )
    _add_engine_args(p, seed_help="sampling seed (also the engine seed)")
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for several)"
    )
    _add_sampling_args(p, max_tokens=16)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    p.add_argument("--json", action="store_true", help="print each RequestOutput as one JSON line")
    p.set_defaults(run=_run_generate)

    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive chat using the model's chat template; replies stream as "
        "they are generated. Type /exit (or send EOF, Ctrl-D) to leave.",
        formatter_class=fmt,
    )
    _add_engine_args(p, seed_help="sampling seed (also the engine seed)")
    _add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.set_defaults(run=_run_chat)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default unless its help already says it or it is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, True, False, argparse.SUPPRESS)
        if action.option_strings and not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _size(text: str) -> int:
    """An integer byte count, with an optional K/M/G/KiB/MiB/GiB suffix."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in units:
        mult, t = units[t[-1]], t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 512MiB, 4G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _add_engine_args(p: argparse.ArgumentParser, seed_help: str = "engine seed") -> None:
    p.add_argument("model", help="model folder (or a Hugging Face id in the local cache)")
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs to shard over")
    g.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per engine step"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn the prefix cache off",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=_size,
        default=None,
        help="KV-cache size, e.g. 2GiB (default: enough for max-num-seqs, at most 4 GiB)",
    )
    g.add_argument("--seed", type=int, default=None, help=seed_help)
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="how to read the weights",
    )


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")


def _engine_config(args: argparse.Namespace):
    """The EngineConfig that the engine options describe."""
    from fastllm.config import EngineConfig

    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        seed=args.seed if args.seed is not None else 0,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        load_format=args.load_format,
    )


def _sampling_params(args: argparse.Namespace, **extra):
    """The SamplingParams that the sampling options describe."""
    from fastllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        **extra,
    )


def _fail(message: str) -> int:
    print(f"fastllm: error: {message}", file=sys.stderr)
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from fastllm.server.app import serve

    api_key = args.api_key if args.api_key is not None else os.environ.get("FASTLLM_API_KEY")
    try:
        config = _engine_config(args)
        serve(
            config,
            host=args.host,
            port=args.port,
            api_key=api_key or None,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            max_body_bytes=args.max_body_bytes,
        )
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    import json

    try:
        params = _sampling_params(
            args, n=args.n, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs
        )
        from fastllm.llm import LLM

        llm = LLM(**_llm_kwargs(args))
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    for out in outputs:
        if args.json:
            print(json.dumps(request_output_to_dict(out), ensure_ascii=False))
        else:
            for c in out.outputs:
                print(c.text)
    return 0


def _llm_kwargs(args: argparse.Namespace) -> dict:
    from dataclasses import asdict

    return asdict(_engine_config(args))


def request_output_to_dict(out) -> dict:
    """A RequestOutput as plain JSON-ready data (logprob dicts keyed by token id)."""
    from dataclasses import asdict

    return asdict(out)


def _run_chat(args: argparse.Namespace) -> int:
    try:
        params = _sampling_params(args)
        from fastllm.llm import LLM

        llm = LLM(**_llm_kwargs(args))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    tok = llm.get_tokenizer()
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("fastllm chat: type /exit or press Ctrl-D to leave.", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("user> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            llm.llm_engine.validate_prompt(ids, "conversation")
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        reply = []
        print("assistant> ", end="", flush=True)
        try:
            for out in llm.stream({"prompt": text, "prompt_token_ids": ids}, params):
                for c in out.outputs:
                    reply.append(c.text)
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            pass  # stop this reply; the stream aborts its request
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main())
