"""``fastllm bench``: offline throughput and batch-1 latency, optionally side by
side with ``transformers.generate`` on the same folder and workload."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fastllm import envs


@dataclass
class ThroughputResult:
    """Figures of one engine's throughput run."""

    engine: str
    num_prompts: int
    input_len: int
    output_len: int
    batch: int
    elapsed_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    peak_memory_mib: float


@dataclass
class LatencyResult:
    """Figures of one engine's batch-1 latency run (medians over the runs)."""

    engine: str
    input_len: int
    output_len: int
    time_to_first_token_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_token_times_s: list[float] = field(default_factory=list)


@dataclass
class EmbedResult:
    """Figures of one ``bench embed`` row: documents of one length in batches of one size."""

    length: int
    batch_size: int
    num_docs: int
    elapsed_s: float
    docs_per_s: float
    tokens_per_s: float


def _peak_rss_mib() -> float:
    import resource  # Unix only; imported here so the CLI loads everywhere

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / (1024 * 1024)


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompt token ids from a fixed seed (special tokens at the top of the vocabulary avoided)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hi = max(2, vocab - 512) if vocab > 1024 else vocab
    return rng.integers(0, hi, size=(num, length)).tolist()


def _llm(args: Any):
    from fastllm import LLM
    from fastllm.engine_args import engine_settings

    settings = engine_settings(args) if hasattr(args, "gpu_memory_utilization") else {}
    return LLM(
        args.model,
        **settings,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.batch,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_batched_tokens=max(args.batch, args.max_num_batched_tokens or 2048),
        load_format=args.load_format,
        enable_prefix_caching=False,
    )


def fastllm_throughput(args: Any) -> ThroughputResult:
    """Runs the throughput workload through fastllm."""
    from fastllm import SamplingParams

    llm = _llm(args)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, vocab)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[: min(len(prompts), args.batch)], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return ThroughputResult(
        "fastllm",
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.batch,
        elapsed,
        n_out / elapsed,
        (n_in + n_out) / elapsed,
        len(outs) / elapsed,
        _peak_rss_mib(),
    )


def _hf_model(args: Any):
    import torch
    import transformers

    from fastllm.config import resolve_dtype
    from fastllm.platform import resolve_device

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, None)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(device).eval(), torch.device(device)


def transformers_throughput(args: Any) -> ThroughputResult:
    """Runs the same workload through ``transformers.generate`` in batches of the same size."""
    import torch

    model, dev = _hf_model(args)
    vocab = model.config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    pad = model.config.pad_token_id
    pad = pad if pad is not None else 0

    def run(batch: list[list[int]], new: int) -> int:
        ids = torch.tensor(batch, device=dev)  # equal lengths: left padding is a no-op
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    run(prompts[: min(len(prompts), args.batch)], 4)
    start = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), args.batch):
        n_out += run(prompts[i : i + args.batch], args.output_len)
    elapsed = time.perf_counter() - start
    n_in = args.num_prompts * args.input_len
    return ThroughputResult(
        "transformers",
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.batch,
        elapsed,
        n_out / elapsed,
        (n_in + n_out) / elapsed,
        args.num_prompts / elapsed,
        _peak_rss_mib(),
    )


def fastllm_latency(args: Any) -> LatencyResult:
    """Batch-1 time to first token, prefill and decode speed through ``LLM.stream``."""
    from fastllm import SamplingParams

    args.batch = 1
    llm = _llm(args)
    vocab = llm.llm_engine.model_config.vocab_size
    (prompt,) = random_prompts(1, args.input_len, vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    list(llm.stream({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, ignore_eos=True)))
    ttfts, decodes, per_token = [], [], []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        stamps = []
        for out in llm.stream({"prompt_token_ids": prompt}, sp):
            if out.outputs and out.outputs[0].token_ids:
                stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
        ttfts.append(stamps[0] - start)
        decodes.append((len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9))
        per_token = [b - a for a, b in zip(stamps, stamps[1:])]
    ttft = statistics.median(ttfts)
    return LatencyResult(
        "fastllm",
        args.input_len,
        args.output_len,
        ttft,
        args.input_len / ttft,
        statistics.median(decodes),
        per_token,
    )


def transformers_latency(args: Any) -> LatencyResult:
    """Batch-1 latency of ``transformers.generate``: prefill from a 1-token run, decode from the rest."""
    import torch

    model, dev = _hf_model(args)
    (prompt,) = random_prompts(1, args.input_len, model.config.vocab_size)
    ids = torch.tensor([prompt], device=dev)
    pad = model.config.pad_token_id or 0

    def timed(new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
            )
        return time.perf_counter() - start

    timed(2)
    ttfts, decodes = [], []
    for _ in range(args.num_iters):
        t1 = timed(1)
        tn = timed(args.output_len)
        ttfts.append(t1)
        decodes.append((args.output_len - 1) / max(tn - t1, 1e-9))
    ttft = statistics.median(ttfts)
    return LatencyResult(
        "transformers",
        args.input_len,
        args.output_len,
        ttft,
        args.input_len / ttft,
        statistics.median(decodes),
    )


def _int_list(text: str, option: str) -> list[int]:
    """A comma-separated list of positive integers (``--lengths 32,128``)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{option}: not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{option}: give positive integers, got {text!r}")
    return values


def _pooling_engine(args: Any, max_len: int):
    from fastllm.config import EngineConfig
    from fastllm.engine_args import engine_settings
    from fastllm.pooling.engine import PoolingEngine

    settings = engine_settings(args) if hasattr(args, "gpu_memory_utilization") else {}
    return PoolingEngine(
        EngineConfig(
            model=args.model,
            runner="pooling",
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            max_model_len=max_len,
            **settings,
        )
    )


def embed_documents(args: Any, engine: Any, length: int) -> list[list[int]] | list[str]:
    """``--num-docs`` documents of ``length`` tokens: random token ids, or
    (``--docs text``) the text those ids decode to, cut back to ``length``
    tokens by the engine."""
    vocab = engine.tokenizer.vocab_size
    ids = random_prompts(args.num_docs, length, vocab, seed=length)
    if args.docs == "ids":
        return ids
    return [engine.tokenizer.decode(doc) or "empty" for doc in ids]


def fastllm_embed(args: Any, engine: Any, length: int, batch_size: int) -> EmbedResult:
    """Embeds the documents in batches of ``batch_size`` (after one warm-up batch)."""
    from fastllm.pooling.params import PoolingParams

    docs = embed_documents(args, engine, length)
    params = PoolingParams(truncate_prompt_tokens=length)
    engine.embed(docs[:batch_size], params)
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(docs), batch_size):
        outs = engine.embed(docs[i : i + batch_size], params)
        tokens += sum(len(o.prompt_token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return EmbedResult(
        length, batch_size, len(docs), elapsed, len(docs) / elapsed, tokens / elapsed
    )


def run_embed(args: Any) -> int:
    """``fastllm bench embed``: documents per second for each length and batch size."""
    lengths = _int_list(args.lengths, "--lengths")
    sizes = _int_list(args.batch_size, "--batch-size")
    engine = _pooling_engine(args, max(lengths))
    if "embed" not in engine.tasks:
        raise SystemExit(f"{args.model} does not embed (it supports: {sorted(engine.tasks)})")
    rows = [asdict(fastllm_embed(args, engine, n, b)) for n in lengths for b in sizes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "embed", "model": args.model, "results": rows}, f, indent=2)
    _print_table(rows, ["length", "batch_size", "docs_per_s", "tokens_per_s", "elapsed_s"])
    return 0


def weight_bytes_per_token(folder: str, args: Any) -> int | None:
    """Bytes of weights one decode step reads (every matrix once; embeddings only if tied)."""
    from fastllm.loading import is_gguf_file
    from fastllm.loading import weight_bytes_per_token as file_bytes

    if is_gguf_file(folder):
        try:
            return file_bytes(folder)
        except (OSError, ValueError):
            return None
    try:
        from fastllm.config import ModelConfig

        mc = ModelConfig.from_pretrained(folder)
    except Exception:
        return None
    h, i, L = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    from fastllm.models.moe import mlp_weights_per_token

    mlp = mlp_weights_per_token(mc)  # a mixture of experts: the experts a token uses
    attention = L * (h * (q + 2 * kv) + q * h)
    mlps = L * 3 * h * i if mlp is None else mlp
    # The engine's dtype on the CPU; its float matrices are 2 bytes a weight
    # unless it runs float32 on a checkpoint that is not bf16 (a bf16
    # checkpoint's float32 weights are packed as bf16: _core.PackedLinear).
    from fastllm.config import resolve_dtype

    try:
        run = str(resolve_dtype(args.dtype, "cpu", mc.torch_dtype)).removeprefix("torch.")
    except ValueError:
        return None
    elem = 4 if run == "float32" and mc.torch_dtype != "bfloat16" else 2
    from fastllm.layers.quantization import BYTES_PER_WEIGHT, resolve_quantization

    fmt = resolve_quantization(getattr(args, "quantization", None))
    if fmt is not None:
        elem = BYTES_PER_WEIGHT[fmt]
    # Experts stored in MXFP4 (gpt-oss's checkpoints; their routers, a few
    # thousand weights, counted with them) run as stored, whatever
    # quantization= does to the other layers.
    stored = mc.hf.get("quantization_config")
    mlp_elem = elem
    if mlp is not None and isinstance(stored, dict) and stored.get("quant_method") == "mxfp4":
        mlp_elem = BYTES_PER_WEIGHT["mxfp4"]
    return int((attention + mc.vocab_size * h) * elem + mlps * mlp_elem)


def memory_bandwidth_gbs() -> float | None:
    """STREAM-triad bandwidth with the kernels' threads, when the core provides it."""
    from fastllm import _core

    fn = getattr(_core, "stream_triad_gbs", None)
    return float(fn(256 << 20)) if fn is not None else None


def _print_table(rows: list[dict[str, Any]], keys: list[str]) -> None:
    widths = [max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).ljust(w) for k, w in zip(keys, widths)))


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def run(args: Any) -> int:
    """Entry point of ``fastllm bench``."""
    if args.threads:
        envs.set_num_threads(args.threads)
        import torch

        torch.set_num_threads(args.threads)
    if args.mode == "embed":
        return run_embed(args)
    results: list[Any] = []
    report: dict[str, Any] = {"mode": args.mode, "model": args.model}
    if args.mode == "throughput":
        results.append(fastllm_throughput(args))
        if args.compare == "transformers":
            results.append(transformers_throughput(args))
        keys = [
            "engine",
            "output_tokens_per_s",
            "total_tokens_per_s",
            "requests_per_s",
            "elapsed_s",
            "peak_memory_mib",
        ]
        metric = "output_tokens_per_s"
    else:
        results.append(fastllm_latency(args))
        if args.compare == "transformers":
            results.append(transformers_latency(args))
        keys = ["engine", "time_to_first_token_s", "prefill_tokens_per_s", "decode_tokens_per_s"]
        metric = "decode_tokens_per_s"
        bw = memory_bandwidth_gbs()
        wb = weight_bytes_per_token(args.model, args)
        if bw and wb:
            bound = bw * 1e9 / wb
            report["bandwidth_gbs"] = bw
            report["weight_bytes_per_token"] = wb
            report["decode_bound_tokens_per_s"] = bound
            report["fraction_of_bound"] = results[0].decode_tokens_per_s / bound
    rows = [asdict(r) for r in results]
    report["results"] = rows
    if len(results) == 2:
        report["ratio"] = getattr(results[0], metric) / getattr(results[1], metric)
        if args.mode == "latency":
            report["prefill_ratio"] = (
                results[0].prefill_tokens_per_s / results[1].prefill_tokens_per_s
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    _print_table(rows, keys)
    for k in (
        "bandwidth_gbs",
        "decode_bound_tokens_per_s",
        "fraction_of_bound",
        "ratio",
        "prefill_ratio",
    ):
        if k in report:
            print(f"{k}: {report[k]:.3f}")
    if args.plot:
        plot(report, args.plot)
    return 0


def plot(report: dict[str, Any], path: str) -> None:
    """Draws tokens/s per engine (and, for latency, per-token decode times) to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    rows = report["results"]
    metric = "output_tokens_per_s" if report["mode"] == "throughput" else "decode_tokens_per_s"
    ncols = 2 if report["mode"] == "latency" else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4), squeeze=False)
    ax = axes[0][0]
    ax.bar([r["engine"] for r in rows], [r[metric] for r in rows], color=["C0", "C1"][: len(rows)])
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(f"{report['mode']}: {os.path.basename(os.path.normpath(report['model']))}")
    if ncols == 2:
        times = rows[0].get("decode_token_times_s") or []
        axes[0][1].plot([t * 1000 for t in times])
        axes[0][1].set_xlabel("token")
        axes[0][1].set_ylabel("decode time (ms)")
        axes[0][1].set_title("fastllm per-token decode time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(parser: Any) -> None:
    """Adds ``fastllm bench``'s options to an argparse parser."""
    parser.add_argument("mode", choices=["throughput", "latency", "embed"])
    parser.add_argument("model", help="model folder (Hugging Face layout)")
    parser.add_argument("--num-prompts", type=int, default=64)
    e = parser.add_argument_group("embed (a pooling model's documents per second)")
    e.add_argument("--num-docs", type=int, default=256, help="documents per row")
    e.add_argument("--lengths", default="32,128,512", help="document lengths in tokens")
    e.add_argument("--batch-size", default="32", help="documents per embed call (a list: 1,32)")
    e.add_argument(
        "--docs",
        choices=["ids", "text"],
        default="ids",
        help="random token ids, or the text they decode to (tokenized by the engine)",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", "--max-num-seqs", dest="batch", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-iters", type=int, default=3, help="latency runs (median)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="threads for torch and Rust")
    parser.add_argument("--compare", choices=["transformers"], default=None)
    parser.add_argument("--json", default=None, metavar="FILE", help="write all figures as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png")
