"""The ``fastllm`` command.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and one ``cmd_<name>`` function that runs it; ``main`` wires them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform as _os_platform
import sys
from typing import Any

# The instruction sets the CPU kernels use: (label, the cpu_features keys it needs).
_CPU_FEATURE_LABELS = (
    ("AVX2", ("avx2",)),
    ("FMA", ("fma",)),
    ("F16C", ("f16c",)),
    ("AVX-512 (F, BW, VL)", ("avx512f", "avx512bw", "avx512vl")),
    ("AVX-VNNI", ("avxvnni",)),
    ("AVX512-VNNI", ("avx512vnni",)),
    ("AVX512-BF16", ("avx512bf16",)),
    ("AMX-BF16", ("amx_tile", "amx_bf16")),
)
# How each integer kernel path computes its int8 dot products.
_INT_PATH_INSTRUCTIONS = {
    "scalar": "portable Rust",
    "avx2": "vpmaddubsw + vpmaddwd, 256-bit",
    "avxvnni": "vpdpbusd, 256-bit",
    "avx512": "vpmaddubsw + vpmaddwd, 512-bit",
    "avx512vnni": "vpdpbusd, 512-bit",
}


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

        info["cpu"] = _cpu_model_name()
        info["cpu_features"] = dict(_core.cpu_features())
        info["num_threads"] = int(_core.num_threads())
        info["gemm_path"] = _core.gemm_default_path()
        info["quant_path"] = _core.quant_default_path()
        info["quant_formats"] = list(_core.quant_formats())
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
    lines += _format_cpu(info)
    lines.append(f"Threads for CPU kernels: {info['num_threads']} (FASTLLM_NUM_THREADS to change)")
    set_vars = {k: v for k, v in info["env"].items() if v is not None}
    if set_vars:
        lines.append("Environment: " + ", ".join(f"{k}={v!r}" for k, v in set_vars.items()))
    return "\n".join(lines)


def _format_cpu(info: dict[str, Any]) -> list[str]:
    """The CPU part of the report: what the CPU has, what the OS lets a
    process use, and which kernel path each family of CPU kernels runs."""
    features = info["cpu_features"]
    if not features:
        return [f"CPU: unknown ({info.get('core_error')})"]
    lines = [f"CPU: {info.get('cpu') or 'unknown model'}"]
    has = [label for label, keys in _CPU_FEATURE_LABELS if all(features.get(k) for k in keys)]
    lacks = [label for label, keys in _CPU_FEATURE_LABELS if label not in has]
    lines.append(
        f"  has: {', '.join(has) or 'none of the SIMD instruction sets fastllm uses'}"
        " (AVX and AVX-512 counted only where the OS saves their registers)"
    )
    if lacks:
        lines.append(f"  does not have: {', '.join(lacks)}")
    if features.get("amx_tile"):
        lines.append(
            "  AMX: the OS granted this process the tile state"
            if features.get("amx_permitted")
            else "  AMX: the OS did not grant the tile state (Linux >= 5.16 does), so it is not used"
        )
    if info.get("quant_path"):
        gemm = info["gemm_path"]
        quant = info["quant_path"]
        lines.append("CPU kernel paths (chosen at run time from the above):")
        lines.append(f"  float matrix products (f32/bf16 linear layers): {gemm}")
        lines.append(
            f"  integer matrix products ({', '.join(info['quant_formats'])}; quantization="
            f"'int8'/'int4', GGUF files): {quant} ({_INT_PATH_INSTRUCTIONS.get(quant, quant)})"
        )
        lines.append(f"  paged attention, sampling, norms and activations: {gemm}")
    return lines


def _cpu_model_name() -> str | None:
    """The CPU's model name as the OS reports it (None where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _os_platform.processor() or None


def _cuda_version(version: int | None) -> str:
    if version is None:
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"


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
        from fastllm.engine.llm_engine import is_gguf_file

        if is_gguf_file(model):
            from fastllm.gguf import describe_file

            info["model"] = describe_file(model)
        else:
            info["model"] = f"Model: {model} (a Hugging Face folder)"
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
        help="measure throughput or batch-1 latency (optionally against transformers)",
        description="Offline throughput (random prompts, ignore_eos, one warm-up) or batch-1 "
        "latency (time to first token, prefill and decode tokens/s); --compare transformers "
        "runs transformers.generate on the same folder and workload in the same invocation.",
        formatter_class=_HelpFormatter,
    )
    benchmark.add_arguments(p)
    add_engine_settings(p.add_argument_group("engine"))
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
    _add_engine_args(p, model_optional=True)
    _add_chat_template_arg(
        p, "default template of /v1/chat/completions (a request's own chat_template still wins)"
    )
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
        type=_size,
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
        description="Interactive chat using the model's chat template (or --chat-template); "
        "replies stream as they are generated. Ctrl-C stops a reply and returns to the prompt; "
        "at the prompt, Ctrl-C, Ctrl-D or /exit leaves. When the conversation outgrows the "
        "context, its oldest turns are dropped.",
        formatter_class=fmt,
    )
    _add_engine_args(p, seed_help="sampling seed (also the engine seed)", model_optional=True)
    _add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past EOS and the end of turn (until --max-tokens or the context)",
    )
    _add_chat_template_arg(p, "chat template to use instead of the model's")
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
    g.add_argument("--seed", type=int, default=None, help=seed_help)
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="how to read the weights",
    )
    add_engine_settings(g)


def add_engine_settings(g: Any) -> None:
    """The engine settings every model-loading command shares (EngineConfig's
    memory, logprob and hub fields), added to the parser or group ``g``."""
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on a GPU, the fraction of its memory the engine may hold; on the CPU, the "
        "fraction of the available memory the KV cache may take",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=_size,
        default=None,
        help="KV-cache size, e.g. 2GiB (default: planned from --gpu-memory-utilization, "
        "never more than max-num-seqs sequences of max-model-len tokens need)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="quantize the weights at load for the CPU's integer kernels: int8 (q8_0), "
        "int4 (iq4_nl), q8_0, q4_0 or iq4_nl (default: none, float weights)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs a request may ask per token (-1: no limit)",
    )
    g.add_argument("--revision", default=None, help="revision of a hub id in the local cache")
    g.add_argument("--tokenizer-revision", default=None, help="revision of the tokenizer's hub id")
    g.add_argument(
        "--download-dir",
        default=None,
        help="Hugging Face cache folder to look hub ids up in (default: the usual cache)",
    )
    g.add_argument(
        "--tokenizer-mode",
        default="auto",
        choices=["auto", "hf", "slow"],
        help="accepted for vLLM command lines: every mode reads tokenizer.json",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM command lines: fastllm runs only its own model code",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="accepted for vLLM command lines; no effect (fastllm captures no graphs)",
    )


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``add_engine_settings``' options, as EngineConfig / LLM keywords."""
    return {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_logprobs": args.max_logprobs,
        "quantization": args.quantization,
        "revision": args.revision,
        "tokenizer_revision": args.tokenizer_revision,
        "download_dir": args.download_dir,
        "tokenizer_mode": args.tokenizer_mode,
        "trust_remote_code": args.trust_remote_code,
        "enforce_eager": args.enforce_eager,
    }


def _add_chat_template_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|STRING",
        help=f"{what}: a file holding the Jinja template, or the template itself",
    )


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the contents of the file ``value`` names,
    else ``value`` itself when it looks like a template (it has ``{``)."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
        if not text.strip():
            raise ValueError(f"--chat-template: {value} is empty")
        return text
    if "{" not in value:
        raise ValueError(
            f"--chat-template: no such file: {value} (give a file holding the Jinja template, "
            "or the template itself)"
        )
    return value


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
        load_format=args.load_format,
        **engine_settings(args),
    )


def _sampling_params(args: argparse.Namespace, **extra: Any):
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
    if args.replicas is not None or args.address is not None:
        return _serve_on_ray(args, api_key or None)
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
            chat_template=read_chat_template(args.chat_template),
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
        config = _engine_config(args)
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
            prefix_routing=args.prefix_routing,
        )
        fastllm.ray.run(app, host=args.host, port=args.port, address=args.address)
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


def check_chat_template(tokenizer: Any, template: str | None, folder: str) -> None:
    """A ValueError at startup, not at the first message, when there is no chat
    template (``template`` from ``--chat-template``, else the model's) or it
    cannot render a conversation."""
    from jinja2.exceptions import TemplateError

    if template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"{folder} has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja); pass --chat-template FILE|STRING"
        )
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=template, add_generation_prompt=True
        )
    except (ValueError, TemplateError) as e:
        whose = "--chat-template" if template is not None else f"the chat template of {folder}"
        raise ValueError(f"{whose} cannot render a conversation: {e}") from None


def _check_chat_template_early(config: Any, template: str | None) -> None:
    """``check_chat_template`` on the tokenizer alone, before any weights are read."""
    from fastllm.engine.llm_engine import is_gguf_file, resolve_model_folder
    from fastllm.tokenizer import Tokenizer

    if config.tokenizer:
        folder = resolve_model_folder(
            config.tokenizer, config.tokenizer_revision, config.download_dir
        )
    elif is_gguf_file(config.model):
        from fastllm.gguf import load_tokenizer

        check_chat_template(load_tokenizer(config.model), template, config.model)
        return
    else:
        folder = resolve_model_folder(config.model, config.revision, config.download_dir)
    check_chat_template(Tokenizer(folder), template, folder)


def cmd_chat(args: argparse.Namespace) -> int:
    """Runs ``fastllm chat``."""
    from dataclasses import asdict

    try:
        template = read_chat_template(args.chat_template)
        params = _sampling_params(args, ignore_eos=args.ignore_eos)
        config = _engine_config(args)
        _check_chat_template_early(config, template)
        from fastllm.llm import LLM, chat_stop

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
                _chat_turn(llm, messages, line, params, template)
    except KeyboardInterrupt:  # pressed between a reply and the prompt: as at the prompt
        print(flush=True)
        return 0


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


def _chat_turn(
    llm: Any, messages: list[dict], line: str, params: Any, template: str | None
) -> None:
    """One exchange: the user's line, then the reply streamed to the terminal.
    Ctrl-C stops the reply (its request is aborted) and the conversation keeps
    what was shown."""
    messages.append({"role": "user", "content": line})
    reply: list[str] = []
    started = False
    with _StopReply() as stop:
        try:
            fitted = _fit_conversation(llm, messages, params, template)
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


def _fit_conversation(
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
        text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
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


if __name__ == "__main__":
    sys.exit(main())
