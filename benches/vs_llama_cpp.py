"""fastllm against llama.cpp on the same weights, on the CPU: prefill and batch-1 decode.

For each weight format (bf16, q8_0, q4_0, iq4_nl) this runs llama.cpp's ``llama-bench``
on the GGUF file of that format and ``fastllm bench latency`` on the Hugging Face folder
with the matching ``--quantization`` (bf16: none, the folder's bf16 weights), with the
same prompt length, generation length and threads, and prints

    format  llama.cpp pp t/s  fastllm pp t/s  ratio  llama.cpp tg t/s  fastllm tg t/s  ratio

where ratio = fastllm / llama.cpp (above 1: fastllm is faster). Each repeat runs both
sides once, alternating which goes first, so a drift of the machine (other load, clocks)
hits both; the table shows the median over repeats. Each side runs as a subprocess, so
neither sees the other's memory. STREAM-triad bandwidth (fastllm's
``_core.stream_triad_gbs``, same threads) is measured before and after.

What is measured
  llama.cpp  ``llama-bench -m FILE -t T -p P -n N -r INNER -o json``: pp = P prompt
             tokens in one batch, tg = N tokens generated one at a time from an empty
             context (llama-bench's definitions; its own warm-up run is included).
  fastllm    ``fastllm bench latency MODEL --input-len P --output-len N --threads T
             --num-iters INNER [--quantization NAME]``: prefill = P / time to first token
             (which also holds the first token's sampling), decode = batch-1 tokens/s
             after the prompt.
  So the prefill figure is slightly unfavourable to fastllm and the decode figure runs
  at context P..P+N for fastllm but 0..N for llama.cpp; extra llama-bench options (for
  example ``--llama-arg=-d --llama-arg=128`` for a decode depth) go through --llama-arg.

Building the reference (CPU only, Release, GGML_NATIVE=ON, static; from the PyPI sdist
of llama-cpp-python, which vendors llama.cpp), and the GGUF files of the benchmark model
(converted to BF16 by llama.cpp's convert_hf_to_gguf.py, then llama-quantize to Q8_0,
Q4_0 and IQ4_NL):

    benches/build_llama_cpp.sh                   # fetch, build, convert, quantize
    # -> /work/llamacpp/build/bin/llama-bench, llama-quantize
    # -> /work/benchmodels/gguf/{,pure/}qwen2-0.5b-random-{bf16,q8_0,q4_0,iq4_nl}.gguf

(see the script's header for its settings: LLAMA_DIR, MODEL, GGUF_DIR, JOBS, TORCH_PY).

Run it on an otherwise idle machine: with -t equal to the free cores, anything else
running (a compile, a test) takes cores from both sides and the figures swing by several
times (llama.cpp's threads spin-wait, so it suffers most); each sample records the 1-minute
load average before it, and --repeats 5 with the median helps. Usage (with a shared
machine, hold a lock around it):

    flock /tmp/bench.lock python benches/vs_llama_cpp.py \\
        --llama-bench /work/llamacpp/build/bin/llama-bench \\
        --gguf-dir /work/benchmodels/gguf/pure --model /work/benchmodels/qwen2-0.5b-random \\
        --formats bf16 q8_0 q4_0 iq4_nl --threads 2 --json vs_llama.json

fastllm quantizes every matrix, the token embedding and the tied head included, so the
like-for-like files are the ``--pure`` ones (``--gguf-dir /work/benchmodels/gguf/pure``);
llama-quantize's default mix keeps token_embd (here also the head, 136M of the 494M
weights) at q8_0 and, for IQ4_NL, some attn_v/ffn_down in q5_1/q5_K.

GGUF files are found in --gguf-dir by their format in the name (``*-q8_0.gguf``, case
insensitive), or given one by one with ``--gguf q8_0=PATH``. fastllm runs from
``--python`` (default: this interpreter), which must import fastllm. ``--quant
FORMAT=NAME`` changes the name passed to fastllm (for example ``q8_0=int8``). A format
that fastllm rejects is reported as such, its llama.cpp figures are still shown, and the
script exits with status 1.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

FORMATS = ("bf16", "q8_0", "q4_0", "iq4_nl")
# fastllm's --quantization per format (None: the folder's own float weights)
DEFAULT_QUANT: dict[str, str | None] = {
    "bf16": None,
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "iq4_nl": "iq4_nl",
}
FASTLLM_MAIN = "import sys; from fastllm.cli import main; sys.exit(main())"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="fastllm vs llama.cpp: prefill and decode tokens/s per weight format",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--llama-bench", required=True, metavar="PATH", help="llama-bench binary")
    p.add_argument("--gguf-dir", default=None, metavar="DIR", help="folder of the GGUF files")
    p.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="FORMAT=PATH",
        help="GGUF file of one format (repeatable; overrides --gguf-dir)",
    )
    p.add_argument("--model", required=True, help="Hugging Face folder fastllm loads")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (llama-bench -p)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (-n)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds (median shown)")
    p.add_argument(
        "--inner-reps", type=int, default=1, help="runs per side per round (-r / --num-iters)"
    )
    p.add_argument("--python", default=sys.executable, help="interpreter that imports fastllm")
    p.add_argument("--dtype", default="auto", help="fastllm --dtype (activations)")
    p.add_argument(
        "--quant",
        action="append",
        default=[],
        metavar="FORMAT=NAME",
        help="fastllm --quantization name for a format (repeatable)",
    )
    p.add_argument(
        "--llama-arg", action="append", default=[], metavar="ARG", help="extra llama-bench arg"
    )
    p.add_argument(
        "--fastllm-arg", action="append", default=[], metavar="ARG", help="extra fastllm arg"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the STREAM-triad runs")
    p.add_argument(
        "--same-file",
        action="store_true",
        help="fastllm loads each format's GGUF file too (instead of the folder quantized at load)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write all figures as JSON")
    return p.parse_args(argv)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or key not in FORMATS:
            raise SystemExit(f"{what} wants FORMAT=VALUE with FORMAT in {FORMATS}, got {item!r}")
        out[key] = val
    return out


def find_gguf(fmt: str, gguf_dir: str | None, explicit: dict[str, str], model: str) -> str:
    """The GGUF file of one format: given explicitly, or the one in gguf_dir named after it."""
    if fmt in explicit:
        path = explicit[fmt]
    else:
        if gguf_dir is None:
            raise SystemExit(f"no GGUF file for {fmt}: pass --gguf-dir DIR or --gguf {fmt}=PATH")
        names = [
            f
            for f in glob.glob(os.path.join(gguf_dir, "*.gguf"))
            if os.path.basename(f).lower().removesuffix(".gguf").endswith(fmt)
        ]
        if len(names) > 1:  # several models in the folder: prefer the one named like --model
            stem = os.path.basename(os.path.normpath(model)).lower()
            names = [f for f in names if os.path.basename(f).lower().startswith(stem)] or names
        if len(names) != 1:
            found = ", ".join(sorted(names)) or "none"
            raise SystemExit(
                f"need one *{fmt}.gguf in {gguf_dir} (found: {found}); pass --gguf {fmt}=PATH"
            )
        path = names[0]
    if not os.path.isfile(path):
        raise SystemExit(f"GGUF file for {fmt} not found: {path}")
    return path


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_llama(args: argparse.Namespace, gguf: str) -> dict[str, Any]:
    """One llama-bench run: pp and tg tokens/s (llama-bench's mean over its -r runs)."""
    cmd = [
        args.llama_bench,
        "-m",
        gguf,
        "-t",
        str(args.threads),
        "-p",
        str(args.input_len),
        "-n",
        str(args.output_len),
        "-r",
        str(args.inner_reps),
        "-o",
        "json",
        *args.llama_arg,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (rc {proc.returncode}):\n{_tail(proc.stderr)}")
    rows = json.loads(proc.stdout)
    out: dict[str, Any] = {"cmd": cmd}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            out["prefill_tokens_per_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            out["decode_tokens_per_s"] = float(row["avg_ts"])
        out["info"] = {
            k: row.get(k)
            for k in (
                "build_commit",
                "build_number",
                "cpu_info",
                "backends",
                "model_type",
                "model_size",
                "model_n_params",
                "n_threads",
                "n_batch",
                "type_k",
                "type_v",
            )
        }
    if "prefill_tokens_per_s" not in out or "decode_tokens_per_s" not in out:
        raise RuntimeError(f"llama-bench output has no pp/tg rows: {proc.stdout[:500]}")
    return out


class FastllmRejected(RuntimeError):
    """fastllm refused the quantization option (not implemented, or not this format)."""


def run_fastllm(args: argparse.Namespace, quant: str | None, model: str) -> dict[str, Any]:
    """One ``fastllm bench latency`` run in a subprocess: prefill and decode tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "latency.json")
        cmd = [
            args.python,
            "-c",
            FASTLLM_MAIN,
            "bench",
            "latency",
            model,
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--num-iters",
            str(args.inner_reps),
            "--threads",
            str(args.threads),
            "--dtype",
            args.dtype,
            "--json",
            out_json,
            *(["--quantization", quant] if quant else []),
            *args.fastllm_arg,
        ]
        env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        if proc.returncode != 0:
            err = _tail(proc.stderr)
            last = _tail(proc.stderr, 3).lower()  # the argparse error or the exception
            if quant and ("--quantization" in last or "quantization" in last and "support" in last):
                raise FastllmRejected(
                    f"fastllm rejected --quantization {quant} (rc {proc.returncode}); "
                    f"this fastllm does not run that format yet:\n{err}"
                )
            raise RuntimeError(f"fastllm bench failed (rc {proc.returncode}):\n{err}")
        with open(out_json) as f:
            report = json.load(f)
    res = report["results"][0]
    return {
        "cmd": cmd,
        "prefill_tokens_per_s": float(res["prefill_tokens_per_s"]),
        "decode_tokens_per_s": float(res["decode_tokens_per_s"]),
        "time_to_first_token_s": float(res["time_to_first_token_s"]),
        "bandwidth_gbs": report.get("bandwidth_gbs"),
    }


def stream_triad(args: argparse.Namespace) -> float | None:
    """STREAM-triad GB/s with fastllm's kernel threads (None if it cannot be measured)."""
    code = "from fastllm import _core; print(_core.stream_triad_gbs())"
    env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads))
    try:
        proc = subprocess.run(
            [args.python, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        return float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def _sample(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "loadavg_1m_before")
    return {k: r[k] for k in keys}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = [
        "format",
        "llama.cpp pp t/s",
        "fastllm pp t/s",
        "ratio",
        "llama.cpp tg t/s",
        "fastllm tg t/s",
        "ratio",
    ]
    keys = ["format", "llama_pp", "fastllm_pp", "pp_ratio", "llama_tg", "fastllm_tg", "tg_ratio"]
    cells = [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(args.llama_bench, os.X_OK):
        raise SystemExit(f"llama-bench not found or not executable: {args.llama_bench}")
    if not os.path.isdir(args.model):
        raise SystemExit(f"model folder not found: {args.model}")
    explicit = _pairs(args.gguf, "--gguf")
    quants = {**DEFAULT_QUANT, **{k: (v or None) for k, v in _pairs(args.quant, "--quant").items()}}
    files = {fmt: find_gguf(fmt, args.gguf_dir, explicit, args.model) for fmt in args.formats}

    report: dict[str, Any] = {
        "model": args.model,
        "threads": args.threads,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "inner_reps": args.inner_reps,
        "dtype": args.dtype,
    }
    if not args.no_bandwidth:
        report["bandwidth_gbs_before"] = stream_triad(args)
        print(f"STREAM triad before: {_cell(report['bandwidth_gbs_before'])} GB/s", flush=True)

    samples: dict[str, dict[str, list[Any]]] = {
        fmt: {"llama": [], "fastllm": [], "errors": []} for fmt in args.formats
    }
    rejected: dict[str, str] = {}
    failed = False
    for rep in range(args.repeats):
        for fmt in args.formats:
            sides = ["llama", "fastllm"] if rep % 2 == 0 else ["fastllm", "llama"]
            for side in sides:
                if side == "fastllm" and fmt in rejected:
                    continue
                label = f"[{rep + 1}/{args.repeats}] {fmt:6s} {side:8s}"
                load = os.getloadavg()[0]  # other work on the cores skews both sides
                try:
                    if side == "llama":
                        r = run_llama(args, files[fmt])
                    else:
                        if args.same_file:  # fastllm runs the very file llama.cpp runs
                            r = run_fastllm(args, None, files[fmt])
                        else:
                            r = run_fastllm(args, quants[fmt], args.model)
                except FastllmRejected as e:
                    rejected[fmt] = str(e)
                    samples[fmt]["errors"].append(f"fastllm: {e}")
                    print(f"{label} REJECTED\n{e}", file=sys.stderr, flush=True)
                    failed = True
                    continue
                except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                    samples[fmt]["errors"].append(f"{side}: {e}")
                    print(f"{label} FAILED\n{e}", file=sys.stderr, flush=True)
                    failed = True
                    continue
                r["loadavg_1m_before"] = load
                samples[fmt][side].append(r)
                print(
                    f"{label} pp {r['prefill_tokens_per_s']:8.2f} t/s"
                    f"  tg {r['decode_tokens_per_s']:7.2f} t/s  (load {load:.1f})",
                    flush=True,
                )

    if not args.no_bandwidth:
        report["bandwidth_gbs_after"] = stream_triad(args)
        print(f"STREAM triad after: {_cell(report['bandwidth_gbs_after'])} GB/s", flush=True)

    rows = []
    for fmt in args.formats:
        s = samples[fmt]
        lp = _median([r["prefill_tokens_per_s"] for r in s["llama"]])
        lt = _median([r["decode_tokens_per_s"] for r in s["llama"]])
        fp = _median([r["prefill_tokens_per_s"] for r in s["fastllm"]])
        ft = _median([r["decode_tokens_per_s"] for r in s["fastllm"]])
        rows.append(
            {
                "format": fmt,
                "gguf": files[fmt],
                "fastllm_quantization": "gguf" if args.same_file else quants[fmt],
                "llama_pp": lp,
                "fastllm_pp": fp,
                "pp_ratio": _ratio(fp, lp),
                "llama_tg": lt,
                "fastllm_tg": ft,
                "tg_ratio": _ratio(ft, lt),
                "llama_info": s["llama"][0]["info"] if s["llama"] else None,
                "llama_samples": [_sample(r) for r in s["llama"]],
                "fastllm_samples": [_sample(r) for r in s["fastllm"]],
                "errors": s["errors"],
            }
        )
    report["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print()
    print(
        f"threads {args.threads}, prompt {args.input_len}, generate {args.output_len}, "
        f"median of {args.repeats} alternating rounds; ratio = fastllm / llama.cpp"
    )
    print_table(rows)
    for fmt, msg in rejected.items():
        first, *rest = msg.splitlines()
        print(f"{fmt}: {first.split(';')[0]}: {rest[-1].strip() if rest else ''}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
