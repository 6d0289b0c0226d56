"""The engine's and the sampler's command-line arguments, shared by every
command that loads a model (``fastllm serve``, ``generate``, ``chat``,
``bench``) and by the Ray entry points: one table of options, and the
``EngineConfig`` and ``SamplingParams`` they describe."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fastllm.config import POOLING_TASKS
from fastllm.reasoning import REASONING_PARSERS


class HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default unless its help already says it or it is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, True, False, argparse.SUPPRESS)
        if action.option_strings and not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parse_size(text: str) -> int:
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


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_engine_args(
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
        "--state-snapshot-interval",
        type=int,
        default=256,
        help="hybrid models: tokens between recurrent-state snapshots of the prefix cache",
    )
    g.add_argument(
        "--max-state-snapshots",
        type=int,
        default=32,
        help="hybrid models: recurrent-state snapshots kept for the prefix cache",
    )
    g.add_argument("--seed", type=int, default=None, help=seed_help)
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="how to read the weights",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts are token ids and outputs token ids (their text "
        "is empty); the server's text routes answer 400",
    )
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="generate: text generation; pooling: an embedding, reranker or classifier model "
        "(the server's /v1/embeddings, /v1/rerank, /score, /classify); auto: generate unless "
        "--task names a pooling task",
    )
    g.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        help="JSON object of config.json fields merged over the model's (vLLM's), e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' for Qwen3-Reranker',
    )
    g.add_argument(
        "--task",
        default="generate",
        choices=["auto", "generate", *POOLING_TASKS],
        help="vLLM's older spelling of --runner: a pooling task (embed, score, classify, "
        "reward) means --runner pooling",
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
        type=parse_size,
        default=None,
        help="KV-cache size, e.g. 2GiB (default: planned from --gpu-memory-utilization, "
        "never more than max-num-seqs sequences of max-model-len tokens need)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV-cache element type: auto (the model's dtype) or int8 (8-bit rows with a "
        "scale each: about half the memory, and half the bytes decode reads at depth)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="quantize the weights at load for the CPU's integer kernels: int8 (q8_0), "
        "int4 (q4_0), q8_0, q4_0, iq4_nl, q4_1 or mxfp4 (default: none, float weights)",
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
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="how the model marks its thinking: replies carry it apart as "
        "reasoning_content, and thinking_token_budget and structured outputs apply",
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
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_logprobs": args.max_logprobs,
        "quantization": args.quantization,
        "revision": args.revision,
        "tokenizer_revision": args.tokenizer_revision,
        "download_dir": args.download_dir,
        "tokenizer_mode": args.tokenizer_mode,
        "trust_remote_code": args.trust_remote_code,
        "enforce_eager": args.enforce_eager,
        "reasoning_parser": args.reasoning_parser,
    }


def add_chat_template_arg(p: argparse.ArgumentParser, what: str) -> None:
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


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")


def engine_config(args: argparse.Namespace):
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
        state_snapshot_interval=args.state_snapshot_interval,
        max_state_snapshots=args.max_state_snapshots,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format,
        skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
        runner=getattr(args, "runner", "auto"),
        task=getattr(args, "task", "generate"),
        hf_overrides=getattr(args, "hf_overrides", None),
        **engine_settings(args),
    )


def sampling_params(args: argparse.Namespace, **extra: Any):
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
