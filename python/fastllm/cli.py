"""The ``fastllm`` command.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and one ``cmd_<name>`` function that runs it; ``main`` wires them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _os_platform
import sys
from typing import Any

_CPU_FEATURE_LABELS = (
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX-512F"),
    ("avx512bf16", "AVX512-BF16"),
    ("amx", "AMX-BF16 (usable)"),
)


def collect_env() -> dict[str, Any]:
    """Everything ``fastllm env`` reports, as plain JSON-ready values."""
    from fastllm import __version__
    from fastllm.platform import probe

    report = probe()
    info: dict[str, Any] = {
        "fastllm_version": __version__,
        "python_version": sys.version.split()[0],
        "platform": f"{_os_platform.system()} {_os_platform.machine()}",
        "cuda": {
            "available": report.available,
            "device_count": report.device_count,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "total_memory": d.total_memory,
                    "compute_capability": list(d.compute_capability),
                }
                for d in report.devices
            ],
            "driver_version": report.driver_version,
            "library": report.library,
            "reason": report.reason,
        },
        "device": "cuda" if report.available else "cpu",
        "advice": cuda_advice(report),
        "env": {
            k: os.environ.get(k)
            for k in (
                "FASTLLM_DEVICE",
                "CUDA_VISIBLE_DEVICES",
                "FASTLLM_LIBCUDA",
                "FASTLLM_PROBE_TIMEOUT",
                "FASTLLM_NUM_THREADS",
            )
        },
    }
    try:
        from fastllm import _core

        info["cpu_features"] = dict(_core.cpu_features())
        info["num_threads"] = int(_core.num_threads())
    except Exception as exc:
        info["cpu_features"] = {}
        info["num_threads"] = None
        info["core_error"] = repr(exc)
    return info


def cuda_advice(report: Any) -> str:
    """One sentence telling the user what to do about the probe's outcome."""
    if report.available:
        return "CUDA will be used by default (device='auto'); pass device='cpu' to force the CPU."
    reason = report.reason or ""
    if "FASTLLM_DEVICE=cpu" in reason:
        return "Unset FASTLLM_DEVICE to let fastllm look for a GPU."
    if "CUDA_VISIBLE_DEVICES" in reason and "hides" in reason:
        return (
            "Unset CUDA_VISIBLE_DEVICES or set it to the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0."
        )
    if "no NVIDIA kernel driver" in reason or "no CUDA driver on" in reason:
        return "Running on the CPU. To use a GPU, install the NVIDIA driver and check `nvidia-smi`."
    if "did not answer" in reason:
        return "The driver hung; check `nvidia-smi`, or raise FASTLLM_PROBE_TIMEOUT if it is only slow."
    if "crashed" in reason:
        return "The driver crashed in a child process (this one is fine); check `nvidia-smi` and the driver install."
    return "Running on the CPU. Fix the cause above (check `nvidia-smi`) to use a GPU."


def format_env(info: dict[str, Any]) -> str:
    """The human-readable text of ``fastllm env``."""
    cuda = info["cuda"]
    lines = [
        f"fastllm {info['fastllm_version']}, Python {info['python_version']}, {info['platform']}",
        "",
    ]
    if cuda["available"]:
        lines.append(
            f"CUDA: available, {cuda['device_count']} device(s), driver "
            f"{_cuda_version(cuda['driver_version'])}, library {cuda['library']}"
        )
        for d in cuda["devices"]:
            major, minor = d["compute_capability"]
            lines.append(
                f"  [{d['index']}] {d['name']}, {d['total_memory'] / 2**30:.1f} GiB, "
                f"compute capability {major}.{minor}"
            )
    else:
        lines.append("CUDA: not used")
        lines.append(f"  why: {cuda['reason']}")
        if cuda["library"]:
            lines.append(f"  library: {cuda['library']}")
    lines.append(f"  what to do: {info['advice']}")
    lines.append(f"Device for device='auto': {info['device']}")
    lines.append("")
    features = info["cpu_features"]
    if features:
        present = [label for key, label in _CPU_FEATURE_LABELS if features.get(key)]
        absent = [label for key, label in _CPU_FEATURE_LABELS if not features.get(key)]
        lines.append(f"CPU features: {', '.join(present) or 'none of the SIMD paths'}")
        if absent:
            lines.append(f"  not available: {', '.join(absent)}")
        if features.get("amx_tile") and not features.get("amx_permitted"):
            lines.append(
                "  the CPU has AMX but the OS did not grant the tile state (Linux >= 5.16)"
            )
    else:
        lines.append(f"CPU features: unknown ({info.get('core_error')})")
    lines.append(f"Threads for CPU kernels: {info['num_threads']} (FASTLLM_NUM_THREADS to change)")
    set_vars = {k: v for k, v in info["env"].items() if v is not None}
    if set_vars:
        lines.append("Environment: " + ", ".join(f"{k}={v!r}" for k, v in set_vars.items()))
    return "\n".join(lines)


def _cuda_version(version: int | None) -> str:
    if version is None:
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"


def add_env_parser(sub: Any) -> None:
    """Registers ``fastllm env``."""
    p = sub.add_parser("env", help="show what fastllm sees on this machine and why")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    """Runs ``fastllm env``."""
    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_env(info))
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
        help="measure throughput or batch-1 latency (optionally against transformers)",
        description="Offline throughput (random prompts, ignore_eos, one warm-up) or batch-1 "
        "latency (time to first token, prefill and decode tokens/s); --compare transformers "
        "runs transformers.generate on the same folder and workload in the same invocation.",
        formatter_class=_HelpFormatter,
    )
    benchmark.add_arguments(p)
    p.set_defaults(func=benchmark.run)


# ---- serve, generate, chat -------------------------------------------------------


def add_serve_parser(sub: Any) -> None:
    """Registers ``fastllm serve``."""
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
    p.set_defaults(func=cmd_serve)


def add_generate_parser(sub: Any) -> None:
    """Registers ``fastllm generate``."""
    fmt = _HelpFormatter
    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate a completion of each --prompt and print it.",
        formatter_class=fmt,
    )
    _add_engine_args(p, seed_help="sampling seed (also the engine seed)", model_optional=True)
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for several)"
    )
    _add_sampling_args(p, max_tokens=16)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    p.add_argument("--json", action="store_true", help="print each RequestOutput as one JSON line")
    p.set_defaults(func=cmd_generate)


def add_chat_parser(sub: Any) -> None:
    """Registers ``fastllm chat``."""
    fmt = _HelpFormatter
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive chat using the model's chat template; replies stream as "
        "they are generated. Type /exit (or send EOF, Ctrl-D) to leave.",
        formatter_class=fmt,
    )
    _add_engine_args(p, seed_help="sampling seed (also the engine seed)", model_optional=True)
    _add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.set_defaults(func=cmd_chat)


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


def _add_engine_args(
    p: argparse.ArgumentParser, seed_help: str = "engine seed", model_optional: bool = False
) -> None:
    if model_optional:
        p.add_argument(
            "model",
            nargs="?",
            default=None,
            help="model folder (or a Hugging Face id in the local cache); "
            "default: the embedded demo model",
        )
    else:
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

    model = args.model
    if model is None:
        from fastllm.demo import demo_model_path

        model = demo_model_path()
    return EngineConfig(
        model=model,
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


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs ``fastllm serve``."""

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


def cmd_generate(args: argparse.Namespace) -> int:
    """Runs ``fastllm generate``."""

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


def cmd_chat(args: argparse.Namespace) -> int:
    """Runs ``fastllm chat``."""
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
