"""The ``fastllm`` command.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and one ``cmd_<name>`` function that runs it; ``main`` wires them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from fastllm import envs
from fastllm.chat_repl import chat_turn
from fastllm.engine_args import (
    HelpFormatter,
    add_chat_template_arg,
    add_engine_args,
    add_engine_settings,
    add_sampling_args,
    engine_config,
    parse_size,
    read_chat_template,
    sampling_params,
)
from fastllm.env_report import collect_env, format_env
from fastllm.inputs import check_chat_template
from fastllm.loading import describe_model, load_tokenizer, resolve_model_folder, resolve_model_path
from fastllm.server.tool_formats import TOOL_CALL_PARSERS


def add_env_parser(sub: Any) -> None:
    """Registers ``fastllm env``."""
    p = sub.add_parser("env", help="show what fastllm sees on this machine and why")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--model",
        default=None,
        help="also describe this model: a GGUF file's architecture and tensor types "
        "(only its header is read)",
    )
    p.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    """Runs ``fastllm env``."""
    info = collect_env()
    model = getattr(args, "model", None)
    if model:
        info["model"] = describe_model(model) or f"Model: {model} (a Hugging Face folder)"
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_env(info))
        if model:
            print()
            print(info["model"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm command line")
    sub = parser.add_subparsers(dest="command", required=True)
    add_env_parser(sub)
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastllm`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


# ---- bench ---------------------------------------------------------------------


def add_bench_parser(sub: Any) -> None:
    """Registers ``fastllm bench`` (throughput / latency, optionally against transformers)."""
    from fastllm import benchmark

    p = sub.add_parser(
        "bench",
        help="measure throughput, batch-1 latency or embedding speed",
        description="Offline throughput (random prompts, ignore_eos, one warm-up) or batch-1 "
        "latency (time to first token, prefill and decode tokens/s); --compare transformers "
        "runs transformers.generate on the same folder and workload in the same invocation. "
        "embed: a pooling model's documents per second for each of --lengths and --batch-size.",
        formatter_class=HelpFormatter,
    )
    benchmark.add_arguments(p)
    add_engine_settings(p.add_argument_group("engine"))
    p.set_defaults(func=benchmark.run)


# ---- serve, generate, chat -------------------------------------------------------


def add_serve_parser(sub: Any) -> None:
    """Registers ``fastllm serve``."""
    fmt = HelpFormatter
    p = sub.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics); with "
        "--runner pooling, an embedding, reranker or classifier model (/v1/embeddings, "
        "/v1/rerank, /score, /classify).",
        formatter_class=fmt,
    )
    add_engine_args(p, model_optional=True)
    add_chat_template_arg(
        p, "default template of /v1/chat/completions (a request's own chat_template still wins)"
    )
    add_tool_call_parser_arg(p)
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
        help="model name(s) clients use (default: the model folder's name, for a hub "
        "cache snapshot the repo's name; MODEL as given is accepted too)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of the server and the engine",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=4 << 20,
        help="largest request body accepted (larger ones get 413)",
    )
    r = p.add_argument_group(
        'replicas on Ray Serve (needs the ray extra: pip install "fastllm[ray]")'
    )
    r.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve with N engine replicas on Ray Serve (default: one engine, no Ray)",
    )
    r.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto': the one this machine belongs to; "
        "default: start a local one)",
    )
    r.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=1,
        help="CPUs each replica asks Ray for (its kernel threads)",
    )
    r.add_argument(
        "--num-gpus-per-replica",
        type=float,
        default=0,
        help="GPUs each replica asks Ray for (1 for a GPU replica)",
    )
    r.add_argument(
        "--prefix-routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send requests that share a prompt prefix to the replica whose prefix cache "
        "holds it, through a router deployment (--no-prefix-routing: Serve's own routing)",
    )
    p.set_defaults(func=cmd_serve)


def add_tool_call_parser_arg(p: Any) -> None:
    """Adds ``--tool-call-parser`` (vLLM's flag and names)."""
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="format of the model's tool calls in chat replies (auto: the one the chat "
        "template writes)",
    )


def add_generate_parser(sub: Any) -> None:
    """Registers ``fastllm generate``."""
    fmt = HelpFormatter
    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate a completion of each --prompt and print it.",
        formatter_class=fmt,
    )
    add_engine_args(p, seed_help="sampling seed (also the engine seed)", model_optional=True)
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for several)"
    )
    add_sampling_args(p, max_tokens=16)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    p.add_argument("--json", action="store_true", help="print each RequestOutput as one JSON line")
    p.set_defaults(func=cmd_generate)


def add_chat_parser(sub: Any) -> None:
    """Registers ``fastllm chat``."""
    fmt = HelpFormatter
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive chat using the model's chat template (or --chat-template); "
        "replies stream as they are generated. Ctrl-C stops a reply and returns to the prompt; "
        "at the prompt, Ctrl-C, Ctrl-D or /exit leaves. When the conversation outgrows the "
        "context, its oldest turns are dropped.",
        formatter_class=fmt,
    )
    add_engine_args(p, seed_help="sampling seed (also the engine seed)", model_optional=True)
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past EOS and the end of turn (until --max-tokens or the context)",
    )
    add_chat_template_arg(p, "chat template to use instead of the model's")
    p.set_defaults(func=cmd_chat)


def _fail(message: str) -> int:
    print(f"fastllm: error: {message}", file=sys.stderr)
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs ``fastllm serve``."""

    from fastllm.server.app import serve

    api_key = args.api_key if args.api_key is not None else envs.get("FASTLLM_API_KEY")
    if args.replicas is not None or args.address is not None:
        return _serve_on_ray(args, api_key or None)
    try:
        config = engine_config(args)
        serve(
            config,
            host=args.host,
            port=args.port,
            api_key=api_key or None,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            max_body_bytes=args.max_body_bytes,
            chat_template=read_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
        )
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def _serve_on_ray(args: argparse.Namespace, api_key: str | None) -> int:
    """``fastllm serve --replicas N [--address ADDR]``: the same app on Ray Serve."""
    from fastllm.logs import configure_logging

    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        return _fail(f"--replicas must be at least 1, got {replicas}")
    try:
        import fastllm.ray
    except ImportError as e:
        return _fail(str(e))
    configure_logging(args.log_level)
    try:
        config = engine_config(args)
        if not os.path.isabs(config.model) and os.path.exists(config.model):
            # replicas may run in other folders (or on other nodes with the same path)
            config = dataclasses.replace(config, model=os.path.abspath(config.model))
        app = fastllm.ray.build_app(
            config,
            num_replicas=replicas,
            num_cpus_per_replica=args.num_cpus_per_replica,
            num_gpus_per_replica=args.num_gpus_per_replica,
            served_model_name=args.served_model_name,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            chat_template=read_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
            prefix_routing=args.prefix_routing,
        )
        fastllm.ray.run(app, host=args.host, port=args.port, address=args.address)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Runs ``fastllm generate``."""

    try:
        params = sampling_params(
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

    return asdict(engine_config(args))


def request_output_to_dict(out) -> dict:
    """A RequestOutput as plain JSON-ready data (logprob dicts keyed by token id)."""
    from dataclasses import asdict

    return asdict(out)


def _check_chat_template_early(config: Any, template: str | None) -> None:
    """``check_chat_template`` on the tokenizer alone, before any weights are read."""
    if config.tokenizer:
        path = resolve_model_folder(
            config.tokenizer, config.tokenizer_revision, config.download_dir
        )
    else:
        path = resolve_model_path(config)
    check_chat_template(load_tokenizer(path), template, path)


def cmd_chat(args: argparse.Namespace) -> int:
    """Runs ``fastllm chat``."""
    from dataclasses import asdict

    try:
        template = read_chat_template(args.chat_template)
        params = sampling_params(args, ignore_eos=args.ignore_eos)
        config = engine_config(args)
        _check_chat_template_early(config, template)
        from fastllm.inputs import chat_stop
        from fastllm.llm import LLM

        llm = LLM(**asdict(config))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    # the same stop rule as LLM.chat: the reply ends at the template's end of turn
    params = chat_stop(params, llm.llm_engine.tokenizer, template)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "fastllm chat: Ctrl-C stops a reply; /exit, Ctrl-D or Ctrl-C at the prompt leaves.",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            try:
                line = input("user> ")
            except (EOFError, KeyboardInterrupt):
                print(flush=True)
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip():
                chat_turn(llm, messages, line, params, template)
    except KeyboardInterrupt:  # pressed between a reply and the prompt: as at the prompt
        print(flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
