"""fastllm against llama.cpp on the same weights, on the CPU: prefill and batch-1 decode.

For each weight format (bf16, q8_0, q4_0, iq4_nl) this runs llama.cpp's ``llama-bench``
on the GGUF file of that format and ``fastllm bench latency`` on the Hugging Face folder
with the matching ``--quantization`` (bf16: none, the folder's bf16 weights), with the
same prompt length, generation length and threads, and prints

    format  llama.cpp pp t/s  fastllm pp t/s  ratio  llama.cpp tg t/s  fastllm tg t/s  ratio

where ratio = fastllm / llama.cpp (above 1: fastllm is faster). With several prompt
lengths (--prompt-lens) or decode depths (--depths) the table has a row per format and
measurement, with two more columns: the prompt length of a prefill row and the depth of
a decode-at-depth row. Each repeat runs both sides once per measurement, alternating
which goes first, so a drift of the machine (other load, clocks) hits both; the table
shows the median over repeats. Each side runs as a subprocess, so neither sees the
other's memory. STREAM-triad bandwidth (fastllm's ``_core.stream_triad_gbs``, same
threads) is measured before and after.

What is measured (P: a prompt length, the smallest of --prompt-lens, else --input-len;
N: --output-len; D: a depth of --depths)
  llama.cpp  ``llama-bench -m FILE -t T -p P -n N -r INNER -o json``: pp = P prompt
             tokens in one batch, tg = N tokens generated one at a time from an empty
             context (llama-bench's definitions; its own warm-up run is included).
             Each further prompt length: ``-p P -n 0`` (prefill alone). Each depth:
             ``-p 0 -n N -d D``, tg = N tokens generated after D tokens already in the
             context (filled before the timed part).
  fastllm    ``fastllm bench latency MODEL --input-len P --output-len N --threads T
             --num-iters INNER [--quantization NAME]``: prefill = P / time to first token
             (which also holds the first token's sampling), decode = batch-1 tokens/s
             after the prompt. Each further prompt length: ``--input-len P --output-len
             1``. Each depth: ``--input-len D --output-len N``, its decode figure. The
             bench sizes the context to input + output + 8 tokens itself
             (max_model_len), so no length needs a --max-model-len.
  So the prefill figure is slightly unfavourable to fastllm, and the decode figure of a
  prompt row runs at context P..P+N for fastllm but 0..N for llama.cpp (decode is
  measured there once, at the smallest prompt); a depth row is like for like.
  --fastllm-arg passes an engine setting to every fastllm run (repeatable, with ``=``
  since the value starts with a dash; for example an 8-bit KV cache with
  ``--fastllm-arg=--kv-cache-dtype --fastllm-arg=int8``, or whole-prompt steps with
  ``--fastllm-arg=--max-num-batched-tokens --fastllm-arg=8192``; the bench steps 2048
  tokens at a time otherwise, llama-bench 2048 (-b) in micro-batches of 512 (-ub)), and
  --llama-arg an option to every llama-bench run (llama.cpp's 8-bit KV cache:
  ``--llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0
  --llama-arg=-fa --llama-arg=1``: a quantized V cache needs its flash attention, which
  llama-bench leaves off by default).

Which code each side runs is printed once known and again above the table, and kept in
--json: for fastllm, ``fastllm env --json``'s kernel paths (float GEMM, integer GEMM,
attention) and CPU features (``fastllm_env``); for llama.cpp, llama-bench's build,
``cpu_info``, ``backends``, KV-cache types and flash attention, any instruction-set
field its JSON has (older builds) and any stderr line naming the CPU backend variant or
its features, and the ISA switches of its CMake cache (``llama_isa``).

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

Prefill at several lengths and decode at depth, on the Llama 3.2 1B shape
(``MODEL=/work/benchmodels/llama3.2-1b-random benches/build_llama_cpp.sh convert quantize``
builds its folder and GGUF files), then the same with 8-bit KV caches on both sides
(llama.cpp's flash attention on, as its q8_0 V cache needs; add the two ``-fa`` args to
the first run too to compare with it on and the KV cache in 16 bits):

    flock /tmp/bench.lock python benches/vs_llama_cpp.py \\
        --llama-bench /work/llamacpp/build/bin/llama-bench \\
        --gguf-dir /work/benchmodels/gguf/pure --model /work/benchmodels/llama3.2-1b-random \\
        --formats q8_0 q4_0 --threads 2 --prompt-lens 512 2048 8192 --depths 8192 \\
        --output-len 32 --repeats 3 --json vs_llama_lengths.json
    flock /tmp/bench.lock python benches/vs_llama_cpp.py \\
        --llama-bench /work/llamacpp/build/bin/llama-bench \\
        --gguf-dir /work/benchmodels/gguf/pure --model /work/benchmodels/llama3.2-1b-random \\
        --formats q8_0 q4_0 --threads 2 --prompt-lens 512 2048 8192 --depths 8192 \\
        --output-len 32 --repeats 3 --json vs_llama_lengths_kv8.json \\
        --fastllm-arg=--kv-cache-dtype --fastllm-arg=int8 \\
        --llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0 \\
        --llama-arg=-fa --llama-arg=1

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
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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
# llama-bench's JSON fields kept as the run's description
LLAMA_INFO_KEYS = (
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_type",
    "model_size",
    "model_n_params",
    "n_threads",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "flash_attn",
)
# parts of a llama-bench JSON field name (older builds) or stderr line that tell the CPU
# instruction sets it was built for or runs
ISA_HINTS = ("avx", "sse", "fma", "f16c", "vnni", "amx", "neon", "sve", "simd", "flags", "blas")


def _positive_ints(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a positive number of tokens, got {text!r}")
    return value


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
    p.add_argument(
        "--input-len", type=_positive_ints, default=128, help="prompt tokens (llama-bench -p)"
    )
    p.add_argument(
        "--prompt-lens",
        nargs="+",
        type=_positive_ints,
        default=None,
        metavar="P",
        help="prefill at each of these prompt lengths (default: --input-len); decode is "
        "measured once, after the smallest",
    )
    p.add_argument(
        "--depths",
        nargs="+",
        type=_positive_ints,
        default=[],
        metavar="D",
        help="also decode --output-len tokens after D tokens of context (llama-bench -d D)",
    )
    p.add_argument("--output-len", type=_positive_ints, default=128, help="generated tokens (-n)")
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
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-bench arg, passed to every llama-bench run (repeatable)",
    )
    p.add_argument(
        "--fastllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `fastllm bench` arg (an engine setting), passed to every fastllm run "
        "(repeatable)",
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


@dataclass(frozen=True)
class Test:
    """One measurement both sides make: ``prompt`` tokens of prefill and ``gen``
    tokens generated one at a time (0: not measured), the generation after
    ``depth`` tokens already in the context (llama-bench's -p, -n and -d)."""

    prompt: int
    gen: int
    depth: int = 0

    @property
    def name(self) -> str:
        """llama-bench's name for it: pp512, tg128, tg128@d8192, pp128+tg128."""
        parts = [f"pp{self.prompt}"] if self.prompt else []
        if self.gen:
            parts.append(f"tg{self.gen}" + (f"@d{self.depth}" if self.depth else ""))
        return "+".join(parts)


def plan_tests(args: argparse.Namespace) -> list[Test]:
    """The measurements of one format: prefill and decode at the smallest prompt length
    (the single test of a run without --prompt-lens and --depths), prefill alone at the
    other lengths, and decode alone after each depth."""
    lens = sorted(set(args.prompt_lens or [args.input_len]))
    tests = [Test(lens[0], args.output_len)]
    tests += [Test(p, 0) for p in lens[1:]]
    tests += [Test(0, args.output_len, d) for d in sorted(set(args.depths))]
    return tests


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


def llama_command(args: argparse.Namespace, gguf: str, test: Test) -> list[str]:
    """The llama-bench command line of one test."""
    return [
        args.llama_bench,
        "-m",
        gguf,
        "-t",
        str(args.threads),
        "-p",
        str(test.prompt),
        "-n",
        str(test.gen),
        *(["-d", str(test.depth)] if test.depth else []),
        "-r",
        str(args.inner_reps),
        "-o",
        "json",
        *args.llama_arg,
    ]


def llama_info(row: dict[str, Any], stderr: str = "") -> dict[str, Any]:
    """What llama-bench says about its build and the CPU path: the fixed fields, any
    instruction-set field an older build reports, and stderr lines naming them (a
    build that loads its CPU backend as a library names the variant it chose)."""
    info = {k: row.get(k) for k in LLAMA_INFO_KEYS}
    info["isa_fields"] = {
        k: v
        for k, v in row.items()
        if k not in LLAMA_INFO_KEYS and any(h in k.lower() for h in ISA_HINTS)
    }
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if re.search(r"system_info|cpu backend|ggml-cpu", line, re.I)
        or re.search(r"\b(AVX\w*|SSE\w*|NEON|SVE\w*) = 1", line)
    ]
    info["stderr_isa"] = lines[:4]
    return info


def llama_build_flags(llama_bench: str) -> dict[str, str]:
    """The instruction-set switches llama-bench's CPU backend was configured with
    (``GGML_NATIVE``, ``GGML_AVX2``, ``GGML_AVX512``, ...), read from the CMake cache of
    its build folder (the binary's ``bin/..``); empty where there is none. llama-bench
    itself does not say which ISA it was compiled for."""
    cache = os.path.join(os.path.dirname(os.path.abspath(llama_bench)), "..", "CMakeCache.txt")
    flags: dict[str, str] = {}
    try:
        with open(cache, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"(GGML_(?:NATIVE|AVX\w*|FMA|F16C|AMX\w*)):BOOL=(\w+)", line)
                if m:
                    flags[m.group(1)] = m.group(2)
    except OSError:
        pass
    if flags.get("GGML_NATIVE") == "ON":
        # -march=native: the per-ISA switches are not used (this CPU's ISA is)
        return {"GGML_NATIVE": "ON"}
    return flags


def parse_llama(stdout: str, test: Test, stderr: str = "") -> dict[str, Any]:
    """pp and tg tokens/s (llama-bench's mean over its -r runs) from its JSON output;
    raises RuntimeError when a row the test asked for is missing."""
    rows = json.loads(stdout)
    out: dict[str, Any] = {}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            out["prefill_tokens_per_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            out["decode_tokens_per_s"] = float(row["avg_ts"])
        out["info"] = llama_info(row, stderr)
    want = {"prefill_tokens_per_s": test.prompt, "decode_tokens_per_s": test.gen}
    missing = [k for k, n in want.items() if n and k not in out]
    if missing:
        names = " and ".join("pp" if k.startswith("prefill") else "tg" for k in missing)
        raise RuntimeError(f"llama-bench output has no {names} row: {stdout[:500]}")
    return out


def run_llama(args: argparse.Namespace, gguf: str, test: Test) -> dict[str, Any]:
    """One llama-bench run of one test."""
    cmd = llama_command(args, gguf, test)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (rc {proc.returncode}):\n{_tail(proc.stderr)}")
    return {"cmd": cmd, **parse_llama(proc.stdout, test, proc.stderr)}


class FastllmRejected(RuntimeError):
    """fastllm refused the quantization option (not implemented, or not this format)."""


def fastllm_command(
    args: argparse.Namespace, quant: str | None, model: str, test: Test, out_json: str
) -> list[str]:
    """The ``fastllm bench latency`` command line of one test. A decode at depth D is the
    decode after a D-token prompt; a prefill alone generates the first token only. The
    bench sizes the context itself (max_model_len = input + output + 8)."""
    return [
        args.python,
        "-c",
        FASTLLM_MAIN,
        "bench",
        "latency",
        model,
        "--input-len",
        str(test.prompt or test.depth),
        "--output-len",
        str(test.gen or 1),
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


def parse_fastllm(report: dict[str, Any], test: Test) -> dict[str, Any]:
    """The figures of one test from ``fastllm bench latency --json``'s report."""
    res = report["results"][0]
    out: dict[str, Any] = {
        "time_to_first_token_s": float(res["time_to_first_token_s"]),
        "bandwidth_gbs": report.get("bandwidth_gbs"),
    }
    if test.prompt:
        out["prefill_tokens_per_s"] = float(res["prefill_tokens_per_s"])
    if test.gen:
        out["decode_tokens_per_s"] = float(res["decode_tokens_per_s"])
    return out


def run_fastllm(
    args: argparse.Namespace, quant: str | None, model: str, test: Test
) -> dict[str, Any]:
    """One ``fastllm bench latency`` run of one test, in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "latency.json")
        cmd = fastllm_command(args, quant, model, test, out_json)
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
    return {"cmd": cmd, **parse_fastllm(report, test)}


def fastllm_env(args: argparse.Namespace) -> dict[str, Any] | None:
    """The kernel paths fastllm picks on this machine (``fastllm env --json``, with the
    benchmark's threads), None when that cannot run."""
    env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads))
    try:
        proc = subprocess.run(
            [args.python, "-c", FASTLLM_MAIN, "env", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        info = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        return None
    if not isinstance(info, dict):
        return None
    return summarize_fastllm_env(info)


def summarize_fastllm_env(info: dict[str, Any]) -> dict[str, Any]:
    """The parts of ``fastllm env --json`` that say which CPU code runs."""
    return {
        "fastllm_version": info.get("fastllm_version"),
        "cpu": info.get("cpu"),
        "cpu_features": sorted(k for k, v in (info.get("cpu_features") or {}).items() if v),
        "num_threads": info.get("num_threads"),
        "float_gemm_path": info.get("gemm_path"),
        "int_gemm_path": info.get("quant_path"),
        # paged attention's SIMD path (``FASTLLM_CPU_SIMD_PATH``); older
        # reports had none and ran the float kernels' instruction set
        "attention_path": info.get("simd_path", info.get("gemm_path")),
        "quant_formats": info.get("quant_formats"),
        "core_error": info.get("core_error"),
    }


def describe_fastllm(env: dict[str, Any] | None) -> str:
    if env is None:
        return "fastllm paths: unknown (`fastllm env --json` failed)"
    if env.get("core_error"):
        return f"fastllm paths: unknown ({env['core_error']})"
    return (
        f"fastllm {env['fastllm_version']} paths: float GEMM {env['float_gemm_path']}, "
        f"integer GEMM {env['int_gemm_path']}, attention {env['attention_path']}; "
        f"CPU {env['cpu']} ({', '.join(env['cpu_features'])}); "
        f"{env['num_threads']} threads"
    )


def describe_llama(info: dict[str, Any] | None) -> str:
    if info is None:
        return "llama.cpp paths: unknown (no llama-bench run succeeded)"
    text = (
        f"llama.cpp build {info.get('build_number')} ({info.get('build_commit')}), "
        f"backends {info.get('backends')}, cpu_info {info.get('cpu_info')!r}, "
        f"KV cache {info.get('type_k')}/{info.get('type_v')}, "
        f"flash_attn {info.get('flash_attn')}"
    )
    if info.get("isa_fields"):
        text += ", " + ", ".join(f"{k}={v}" for k, v in info["isa_fields"].items())
    for line in info.get("stderr_isa") or []:
        text += f"\n  llama.cpp stderr: {line}"
    if info.get("build_flags"):
        flags = " ".join(f"{k}={v}" for k, v in info["build_flags"].items())
        text += f"\n  llama.cpp built with {flags}"
    return text


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
    return {k: r[k] for k in keys if k in r}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict[str, Any]], extended: bool = False) -> None:
    """The table: one row per format, or (``extended``) per format and test, with the
    prompt length of a prefill and the depth of a decode at depth."""
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
    if extended:
        head[1:1] = ["prompt", "depth"]
        keys[1:1] = ["prompt_len", "depth"]
    cells = [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def _run_side(
    args: argparse.Namespace,
    side: str,
    fmt: str,
    test: Test,
    files: dict[str, str],
    quants: dict[str, str | None],
) -> dict[str, Any]:
    if side == "llama":
        return run_llama(args, files[fmt], test)
    if args.same_file:  # fastllm runs the very file llama.cpp runs
        return run_fastllm(args, None, files[fmt], test)
    return run_fastllm(args, quants[fmt], args.model, test)


def _progress(label: str, r: dict[str, Any], load: float) -> str:
    figures = [
        f"{name} {r[k]:8.2f} t/s"
        for name, k in (("pp", "prefill_tokens_per_s"), ("tg", "decode_tokens_per_s"))
        if k in r
    ]
    return f"{label} {'  '.join(figures)}  (load {load:.1f})"


Samples = dict[tuple[str, Test], dict[str, list[Any]]]


def measure(
    args: argparse.Namespace,
    tests: list[Test],
    files: dict[str, str],
    quants: dict[str, str | None],
) -> tuple[Samples, dict[str, str], bool]:
    """Every round: each format's tests on both sides, alternating which goes first.
    Returns the samples per (format, test), the formats fastllm rejected, and whether
    anything failed."""
    samples: Samples = {
        (fmt, t): {"llama": [], "fastllm": [], "errors": []} for fmt in args.formats for t in tests
    }
    rejected: dict[str, str] = {}
    failed = shown_llama = False
    for rep in range(args.repeats):
        for fmt in args.formats:
            for test in tests:
                s = samples[(fmt, test)]
                sides = ["llama", "fastllm"] if rep % 2 == 0 else ["fastllm", "llama"]
                for side in sides:
                    if side == "fastllm" and fmt in rejected:
                        continue
                    label = f"[{rep + 1}/{args.repeats}] {fmt:6s} {test.name:12s} {side:8s}"
                    load = os.getloadavg()[0]  # other work on the cores skews both sides
                    try:
                        r = _run_side(args, side, fmt, test, files, quants)
                    except FastllmRejected as e:
                        rejected[fmt] = str(e)
                        s["errors"].append(f"fastllm: {e}")
                        print(f"{label} REJECTED\n{e}", file=sys.stderr, flush=True)
                        failed = True
                        continue
                    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                        s["errors"].append(f"{side}: {e}")
                        print(f"{label} FAILED\n{e}", file=sys.stderr, flush=True)
                        failed = True
                        continue
                    r["loadavg_1m_before"] = load
                    s[side].append(r)
                    print(_progress(label, r, load), flush=True)
                    if side == "llama" and not shown_llama:  # its build and CPU, once
                        print(describe_llama(r["info"]), flush=True)
                        shown_llama = True
    return samples, rejected, failed


def build_rows(
    args: argparse.Namespace,
    tests: list[Test],
    files: dict[str, str],
    quants: dict[str, str | None],
    samples: Samples,
) -> list[dict[str, Any]]:
    """One row per format and test: the medians of both sides and their ratios."""
    rows = []
    for fmt in args.formats:
        for test in tests:
            s = samples[(fmt, test)]

            def med(side: str, key: str, s=s) -> float | None:
                return _median([r[key] for r in s[side] if key in r])

            lp, lt = med("llama", "prefill_tokens_per_s"), med("llama", "decode_tokens_per_s")
            fp, ft = med("fastllm", "prefill_tokens_per_s"), med("fastllm", "decode_tokens_per_s")
            rows.append(
                {
                    "format": fmt,
                    "test": test.name,
                    "prompt_len": test.prompt or None,
                    "depth": test.depth or None,
                    "output_len": test.gen,
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
    return rows


def print_summary(
    args: argparse.Namespace,
    tests: list[Test],
    rows: list[dict[str, Any]],
    report: dict[str, Any],
) -> None:
    """Both sides' code paths, what was run, and the table."""
    print()
    print(describe_fastllm(report.get("fastllm_env")))
    print(describe_llama(report.get("llama_isa")))
    rounds = f"median of {args.repeats} alternating rounds; ratio = fastllm / llama.cpp"
    extended = len(tests) > 1
    if extended:
        lens = ", ".join(str(t.prompt) for t in tests if t.prompt)
        depths = ", ".join(str(t.depth) for t in tests if t.depth)
        print(
            f"threads {args.threads}, prefill at prompt {lens}, generate {args.output_len} "
            f"after prompt {tests[0].prompt}" + (f" and at depth {depths}" if depths else "")
        )
        print(
            "tg on a prompt row: llama.cpp from an empty context, fastllm after the prompt; "
            f"on a depth row: both after that many tokens; {rounds}"
        )
    else:
        print(
            f"threads {args.threads}, prompt {tests[0].prompt}, generate {args.output_len}, "
            + rounds
        )
    if args.fastllm_arg or args.llama_arg:
        print(f"fastllm args: {args.fastllm_arg}  llama-bench args: {args.llama_arg}")
    print_table(rows, extended)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(args.llama_bench, os.X_OK):
        raise SystemExit(f"llama-bench not found or not executable: {args.llama_bench}")
    if not os.path.isdir(args.model):
        raise SystemExit(f"model folder not found: {args.model}")
    explicit = _pairs(args.gguf, "--gguf")
    quants = {**DEFAULT_QUANT, **{k: (v or None) for k, v in _pairs(args.quant, "--quant").items()}}
    files = {fmt: find_gguf(fmt, args.gguf_dir, explicit, args.model) for fmt in args.formats}
    tests = plan_tests(args)

    report: dict[str, Any] = {
        "model": args.model,
        "threads": args.threads,
        "input_len": tests[0].prompt,
        "output_len": args.output_len,
        "prompt_lens": [t.prompt for t in tests if t.prompt],
        "depths": [t.depth for t in tests if t.depth],
        "repeats": args.repeats,
        "inner_reps": args.inner_reps,
        "dtype": args.dtype,
        "fastllm_args": args.fastllm_arg,
        "llama_args": args.llama_arg,
    }
    report["fastllm_env"] = fastllm_env(args)
    print(describe_fastllm(report["fastllm_env"]), flush=True)
    if not args.no_bandwidth:
        report["bandwidth_gbs_before"] = stream_triad(args)
        print(f"STREAM triad before: {_cell(report['bandwidth_gbs_before'])} GB/s", flush=True)

    samples, rejected, failed = measure(args, tests, files, quants)

    if not args.no_bandwidth:
        report["bandwidth_gbs_after"] = stream_triad(args)
        print(f"STREAM triad after: {_cell(report['bandwidth_gbs_after'])} GB/s", flush=True)

    rows = build_rows(args, tests, files, quants, samples)
    report["llama_isa"] = next((r["llama_info"] for r in rows if r["llama_info"]), None)
    if report["llama_isa"] is not None:
        report["llama_isa"]["build_flags"] = llama_build_flags(args.llama_bench)
    report["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print_summary(args, tests, rows, report)
    for fmt, msg in rejected.items():
        first, *rest = msg.splitlines()
        print(f"{fmt}: {first.split(';')[0]}: {rest[-1].strip() if rest else ''}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
