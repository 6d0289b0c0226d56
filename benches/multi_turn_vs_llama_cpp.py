"""A multi-turn chat on a hybrid recurrent model, fastllm against llama-server, on the CPU.

One conversation of token ids: a ``--start``-token opening (4096), then
``--turns`` turns (8). Turn t sends the whole conversation so far plus
``--turn-tokens`` new "user" tokens (256) and generates a ``--reply-tokens``
reply (32; greedy, EOS ignored); the next turn appends that turn's reply and
its own user tokens. Every token is drawn at random from the vocabulary with
``--seed``, so turn t's prompt is ``start + u1 + r1 + u2 + ... + r(t-1) + ut``:
4352 tokens at turn 1, 6368 at turn 8 with the defaults. Per turn each column
times the wall clock from sending the prompt to holding the whole reply:

  fastllm              ``LLM(MODEL, enable_prefix_caching=True,
                       state_snapshot_interval=--interval, max_state_snapshots=
                       --snapshots)``, one ``generate`` per turn; its
                       ``num_cached_tokens`` (the prefix it resumed from a
                       state snapshot and cached KV blocks) is shown.
  fastllm no cache     the same with ``enable_prefix_caching=False``: the whole
                       conversation recomputed every turn (what an engine
                       without a reusable recurrent state pays).
  llama.cpp            ``llama-server`` on the GGUF file, its native
                       ``/completion`` endpoint with the prompt as token ids,
                       ``cache_prompt: true``, ``n_predict``, ``temperature: 0``,
                       ``ignore_eos: true``; its own ``timings`` are kept too:
                       ``prompt_n`` (tokens it re-processed), ``cache_n``,
                       ``prompt_ms``, ``predicted_ms``.

and ratio = llama.cpp / fastllm (above 1: fastllm is faster). Both sides run
``--threads`` threads (fastllm: FASTLLM_NUM_THREADS, set before it is imported;
llama.cpp: ``-t`` and ``-tb``), each fastllm column in a subprocess of its own
(``max_num_seqs=1``, one conversation as llama-server's one slot; token ids in
and out, no tokenizer). Each side first answers one short unrelated prompt
(warm-up: first-touch page faults, thread start), untimed.

The replies. Both sides must send the very same prompts, so the conversation
is fixed before anything runs: with ``--replies random`` (the default) each
turn's reply in the conversation is ``--reply-tokens`` random tokens, not what
either engine generated (each still generates and is timed for that many
tokens). Neither side has the state at the end of the tokens it is sent back,
so each resumes from what it saved: fastllm from its last snapshot at a
multiple of ``--interval`` at or before the previous prompt's end, llama.cpp
from the context checkpoint it made 4 tokens before the previous prompt's end.
With ``--replies fastllm`` the conversation takes the replies the first fastllm
column generated (the client sends back what it got, as a chat does); the other
columns replay those prompts, so llama.cpp resumes from its checkpoint whenever
its own greedy reply differs.

llama-server's flags, chosen from this llama.cpp's ``tools/server`` and
``common/arg.cpp`` for a model whose memory is partly recurrent:

  -np 1                one slot: the conversation always lands on the slot that
                       holds it (no slot picked by similarity or LRU, and no
                       unified KV cache whose idle slots are cleared).
  -c CTX               the whole conversation plus a margin (the same as
                       fastllm's max_model_len).
  --ctx-checkpoints 32 (the default, given explicitly) context checkpoints per
                       slot: copies of the recurrent state. The server makes
                       them near the end of each prompt (4 + n_ubatch and 4
                       tokens before it) and restores the newest usable one
                       when a new prompt diverges from the slot's tokens; with
                       none usable a hybrid model re-processes the whole prompt.
  --cache-ram 0        no prompt cache in RAM: with one slot and one conversation
                       it is never read back, but the server would copy the
                       warm-up's state into it when turn 1 replaces it (inside
                       turn 1's time).
  -t T -tb T           the same threads for generation and prompt processing.
  --no-ui              nothing but the API.

Left at their defaults, on purpose: ``--cache-prompt`` (on); ``--cache-reuse``
(0): it shifts chunks of KV cache found after the first difference, which a
recurrent state cannot follow, and in an append-only chat nothing after the
divergence point matches anyway; ``--swa-full``: these models have no sliding
window, so the server drops it; ``--checkpoint-min-step`` (8192): it only
thins mid-prompt checkpoints, and the near-end ones are made regardless;
``-b 2048 -ub 512``.

With the defaults fastllm resumes turn 2 at 4352 (turn 1's prompt ends on a
multiple of 256) and each later turn at the last multiple of 256 inside the
previous prompt, so it recomputes 288 to 512 tokens a turn; llama.cpp
re-processes 4 + 32 + 256 = 292 (``prompt_n``).

The columns run once each, in the order of the table; STREAM-triad bandwidth
(fastllm's ``_core.stream_triad_gbs``, same threads) is measured before and
after, and the CPU and fastllm's kernel paths printed. The table also counts
the turns whose greedy reply equals fastllm's (random weights leave near ties,
so llama.cpp may differ). Run it on an otherwise idle machine (llama.cpp's
threads spin-wait, so another process on a core costs it most). llama-server is
``--llama-server PATH``, else ``$LLAMA_BUILD/bin/llama-server``, else the first
of ``build-noamx/bin`` and ``build/bin`` under ``--llama-dir`` that has one.
The models and files:

    python benches/make_bench_model.py /work/benchmodels --models=qwen3.5-2b,lfm2-1.2b
    LLAMA_BUILD=/work/llamacpp/build-noamx benches/build_llama_cpp.sh build
    MODEL=/work/benchmodels/qwen3.5-2b-random benches/build_llama_cpp.sh convert
    MODEL=/work/benchmodels/lfm2-1.2b-random benches/build_llama_cpp.sh convert

    flock /tmp/bench.lock python benches/multi_turn_vs_llama_cpp.py \\
        --model /work/benchmodels/gguf/qwen3.5-2b-random-bf16.gguf --threads 2 \\
        --json multi_turn_qwen35.json

(``--model`` a folder runs fastllm on it, with ``--gguf FILE`` for llama.cpp.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_llama_cpp import _tail, stream_triad  # noqa: E402

WORKER_FLAG = "--fastllm-worker"
SERVER_NAMES = ("build-noamx", "build")  # build folders searched under --llama-dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="multi-turn chat: fastllm vs llama-server, per-turn latency",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="fastllm's model: a folder or a .gguf file")
    p.add_argument("--gguf", default=None, help="llama.cpp's GGUF file (default: --model's)")
    p.add_argument("--start", type=int, default=4096, help="tokens before the first turn")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=256, help="new user tokens per turn")
    p.add_argument("--reply-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--interval", type=int, default=256, help="fastllm state_snapshot_interval")
    p.add_argument("--snapshots", type=int, default=32, help="fastllm max_state_snapshots")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replies", choices=("random", "fastllm"), default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="fastllm's device")
    p.add_argument("--llama-dir", default="/work/llamacpp", help="where llama-server is built")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--python", default=sys.executable, help="interpreter that imports fastllm")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run or request")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-fastllm", action="store_true")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the STREAM-triad runs")
    p.add_argument("--json", default=None, metavar="FILE", help="write all figures as JSON")
    args = p.parse_args(argv)
    if args.gguf is None and args.model and args.model.endswith(".gguf"):
        args.gguf = args.model
    if not args.skip_fastllm and not args.model:
        p.error("--model is needed unless --skip-fastllm")
    if not args.skip_llama and not args.gguf:
        p.error("llama.cpp needs a GGUF file: --gguf FILE (or --skip-llama)")
    if args.skip_fastllm and args.replies == "fastllm":
        p.error("--replies fastllm needs the fastllm run")
    return args


# ---- the conversation --------------------------------------------------------


def vocab_size(path: str) -> int:
    """The vocabulary of a model folder (config.json) or a GGUF file (its tokens)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    from fastllm.gguf.reader import GGUFFile

    with GGUFFile(path, populate=False) as g:
        tokens = g.get("tokenizer.ggml.tokens")
        if tokens is not None:
            return len(tokens)
        return int(g.get(f"{g.get('general.architecture')}.vocab_size"))


def build_conversation(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The seeded token ids: the opening, each turn's user tokens and reply
    tokens (used with --replies random), and a warm-up prompt that shares no
    prefix with the conversation."""
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    start = draw(args.start)
    users = [draw(args.turn_tokens) for _ in range(args.turns)]
    replies = [draw(args.reply_tokens) for _ in range(args.turns)]
    warmup = [(start[0] + 1) % vocab, *draw(31)]
    return {"vocab": vocab, "start": start, "users": users, "replies": replies, "warmup": warmup}


def turn_prompt(conv: dict[str, Any], replies: list[list[int]], turn: int) -> list[int]:
    """Turn ``turn``'s prompt (0-based): the opening, then user and reply tokens."""
    ids = list(conv["start"])
    for i in range(turn):
        ids += conv["users"][i] + replies[i]
    return ids + conv["users"][turn]


def context_len(args: argparse.Namespace) -> int:
    """Positions the whole conversation needs, rounded up to 256 (as fastllm's
    max_model_len and llama-server's -c)."""
    need = args.start + args.turns * (args.turn_tokens + args.reply_tokens) + 16
    return -(-need // 256) * 256


# ---- fastllm (in a subprocess) -----------------------------------------------


def fastllm_worker(spec_path: str, out_path: str) -> None:
    """Runs one fastllm column: the conversation turn by turn in one LLM. With
    ``replies`` None, each turn's reply is what this run generated."""
    with open(spec_path) as f:
        spec = json.load(f)
    from fastllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        device=spec["device"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=1,
        enable_prefix_caching=spec["prefix_caching"],
        state_snapshot_interval=spec["interval"],
        max_state_snapshots=spec["snapshots"],
        skip_tokenizer_init=True,
    )
    load_s = time.perf_counter() - t0
    n = spec["reply_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["conv"]["warmup"]}], warm, use_tqdm=False)
    replies = spec["replies"]
    own: list[list[int]] = []
    turns = []
    for t in range(len(spec["conv"]["users"])):
        prompt = turn_prompt(spec["conv"], replies if replies is not None else own, t)
        t1 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        reply = list(out.outputs[0].token_ids)
        if len(reply) != n:
            raise RuntimeError(f"turn {t + 1}: {len(reply)} tokens generated, not {n}")
        own.append(reply)
        turns.append(
            {
                "prompt_tokens": len(prompt),
                "seconds": seconds,
                "cached_tokens": int(out.num_cached_tokens),
                "reply": reply,
            }
        )
    states = llm.llm_engine.states
    result = {"load_seconds": load_s, "turns": turns, "state_stats": states and states.stats}
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_fastllm(
    args: argparse.Namespace, conv: dict[str, Any], replies: list[list[int]] | None, cache: bool
) -> dict[str, Any]:
    """One fastllm column in a subprocess of this script (threads set before import)."""
    spec = {
        "model": args.model,
        "device": args.device,
        "max_model_len": context_len(args),
        "prefix_caching": cache,
        "interval": args.interval,
        "snapshots": args.snapshots,
        "reply_tokens": args.reply_tokens,
        "conv": conv,
        "replies": replies,
    }
    env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [args.python, os.path.abspath(__file__), WORKER_FLAG, spec_path, out_path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(
                f"fastllm run failed (rc {proc.returncode}):\n{_tail(proc.stderr, 12)}"
            )
        with open(out_path) as f:
            return json.load(f)


# ---- llama-server --------------------------------------------------------------


def find_server(args: argparse.Namespace) -> str:
    if args.llama_server:
        candidates = [args.llama_server]
    else:
        builds = [os.environ["LLAMA_BUILD"]] if os.environ.get("LLAMA_BUILD") else []
        builds += [os.path.join(args.llama_dir, name) for name in SERVER_NAMES]
        candidates = [os.path.join(b, "bin", "llama-server") for b in builds]
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    raise SystemExit(
        f"llama-server not found (tried {', '.join(candidates)}); build it with "
        "benches/build_llama_cpp.sh build, or pass --llama-server PATH"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class LlamaServer:
    """llama-server on one GGUF file, started on a free port, stopped on exit."""

    def __init__(self, args: argparse.Namespace, log_path: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        t = str(args.threads)
        self.cmd = [
            find_server(args),
            "-m", args.gguf,
            "-t", t, "-tb", t,
            "-c", str(context_len(args)),
            "-np", "1",
            "--ctx-checkpoints", "32",
            "--cache-ram", "0",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--no-ui",
            *args.llama_arg,
        ]  # fmt: skip
        self.log_path = log_path
        self.timeout = args.timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            return self._wait_ready()
        except BaseException:
            self.__exit__()
            raise

    def _wait_ready(self) -> LlamaServer:
        assert self.proc is not None
        deadline = time.monotonic() + min(self.timeout, 600.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited (rc {self.proc.returncode}):\n{self.tail()}"
                )
            try:
                if _http(self.url + "/health", None, 5.0).get("status") == "ok":
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server not ready after {min(self.timeout, 600.0):.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self, lines: int = 12) -> str:
        with open(self.log_path, errors="replace") as f:
            return _tail(f.read(), lines)

    def complete(self, prompt: list[int], n: int) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": n,
            "cache_prompt": True,
            "temperature": 0,
            "ignore_eos": True,
            "return_tokens": True,
            "stream": False,
        }
        return _http(self.url + "/completion", body, self.timeout)


def run_llama(args: argparse.Namespace, conv: dict[str, Any], replies: list[list[int]]) -> dict:
    """The conversation through llama-server's /completion, turn by turn."""
    with tempfile.TemporaryDirectory() as tmp, LlamaServer(args, os.path.join(tmp, "log")) as srv:
        srv.complete(conv["warmup"], 2)
        turns = []
        for t in range(args.turns):
            prompt = turn_prompt(conv, replies, t)
            t1 = time.perf_counter()
            res = srv.complete(prompt, args.reply_tokens)
            seconds = time.perf_counter() - t1
            timings = res.get("timings") or {}
            if len(res.get("tokens") or []) != args.reply_tokens:
                raise RuntimeError(f"turn {t + 1}: llama-server returned {res.get('tokens')!r}")
            turns.append(
                {
                    "prompt_tokens": len(prompt),
                    "seconds": seconds,
                    "prompt_n": timings.get("prompt_n"),
                    "cache_n": timings.get("cache_n"),
                    "prompt_ms": timings.get("prompt_ms"),
                    "predicted_ms": timings.get("predicted_ms"),
                    "reply": res["tokens"],
                }
            )
        return {"cmd": srv.cmd, "turns": turns, "log_tail": srv.tail(40)}


# ---- report --------------------------------------------------------------------


def cpu_report(args: argparse.Namespace) -> str:
    """The CPU part of ``fastllm env`` (model, instruction sets, kernel paths, threads)."""
    code = (
        "from fastllm.env_report import collect_env, format_env\n"
        "text = format_env(collect_env())\n"
        "print(text[text.index('CPU:'):])"
    )
    env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads))
    try:
        proc = subprocess.run(
            [args.python, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
    except subprocess.TimeoutExpired:
        return "CPU: unknown (fastllm env timed out)"
    return proc.stdout.strip() if proc.returncode == 0 else f"CPU: unknown\n{_tail(proc.stderr)}"


def _get(run: dict[str, Any] | None, t: int, key: str) -> Any:
    return run["turns"][t][key] if run else None


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(args: argparse.Namespace, runs: dict[str, Any], prompts: list[int]) -> None:
    fast, nocache, llama = runs.get("fastllm"), runs.get("fastllm_no_cache"), runs.get("llama")
    head = ["turn", "prompt", "fastllm s", "cached", "no-cache s", "llama.cpp s", "prompt_n"]
    head += ["pp ms", "tg ms", "llama/fastllm"]
    rows = []
    for t in range(args.turns):
        fs, ls = _get(fast, t, "seconds"), _get(llama, t, "seconds")
        rows.append(
            [
                str(t + 1),
                str(prompts[t]),
                _fmt(fs),
                _fmt(_get(fast, t, "cached_tokens"), "d"),
                _fmt(_get(nocache, t, "seconds")),
                _fmt(ls),
                _fmt(_get(llama, t, "prompt_n"), "d"),
                _fmt(_get(llama, t, "prompt_ms"), ".0f"),
                _fmt(_get(llama, t, "predicted_ms"), ".0f"),
                _fmt(ls / fs if fs and ls else None),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    last = args.turns - 1
    fs, ns, ls = (_get(x, last, "seconds") for x in (fast, nocache, llama))
    if fs and ls:
        print(f"turn {args.turns}: llama.cpp / fastllm = {ls / fs:.2f}")
    if fs and ns:
        print(f"turn {args.turns}: fastllm no prefix cache / fastllm = {ns / fs:.2f}")
    for name, other in (("fastllm no prefix cache", nocache), ("llama.cpp", llama)):
        if fast and other:  # greedy replies to the same prompts (random weights: near ties)
            same = sum(a["reply"] == b["reply"] for a, b in zip(fast["turns"], other["turns"]))
            print(f"replies equal to fastllm's: {name} {same}/{args.turns} turns")


FAILURES = (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError)


def run_all(
    args: argparse.Namespace, conv: dict[str, Any]
) -> tuple[dict[str, Any], list[list[int]], dict[str, str]]:
    """Every column in turn: the runs, the replies the conversation used, and
    the error of each column that failed (the others still run)."""
    runs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    replies = conv["replies"]
    columns = [] if args.skip_fastllm else ["fastllm", "fastllm_no_cache"]
    columns += [] if args.skip_llama else ["llama"]
    for name in columns:
        if args.replies == "fastllm" and "fastllm" not in runs and name != "fastllm":
            errors[name] = "not run: the conversation's replies come from the failed fastllm run"
            continue
        try:
            if name == "llama":
                runs[name] = run_llama(args, conv, replies)
            else:
                own = None if name == "fastllm" and args.replies == "fastllm" else replies
                runs[name] = run_fastllm(args, conv, own, cache=name == "fastllm")
                if own is None:
                    replies = [t["reply"] for t in runs[name]["turns"]]
        except FAILURES as e:
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name} FAILED\n{e}", file=sys.stderr, flush=True)
            continue
        print(f"{name} done", flush=True)
    return runs, replies, errors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["FASTLLM_NUM_THREADS"] = str(args.threads)  # before fastllm is imported
    paths = [p for p in (None if args.skip_fastllm else args.model, args.gguf) if p]
    for path in paths:
        if not os.path.exists(path):
            raise SystemExit(f"not found: {path}")
    if not args.skip_llama:
        args.llama_server = find_server(args)  # before the long fastllm runs
    conv = build_conversation(args, min(vocab_size(p) for p in paths))
    report: dict[str, Any] = {"args": vars(args), "context": context_len(args)}
    print(cpu_report(args))
    print(f"threads {args.threads}; fastllm {args.model}; llama.cpp {args.gguf}", flush=True)
    if not args.no_bandwidth:
        report["bandwidth_gbs_before"] = stream_triad(args)
        print(f"STREAM triad before: {_fmt(report['bandwidth_gbs_before'])} GB/s", flush=True)
    runs, replies, errors = run_all(args, conv)
    if not args.no_bandwidth:
        report["bandwidth_gbs_after"] = stream_triad(args)
        print(f"STREAM triad after: {_fmt(report['bandwidth_gbs_after'])} GB/s", flush=True)
    prompts = [len(turn_prompt(conv, replies, t)) for t in range(args.turns)]
    report.update(runs=runs, errors=errors, prompt_tokens=prompts, replies=args.replies)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print()
    print(
        f"{args.start}-token start, {args.turns} turns of {args.turn_tokens} user tokens and "
        f"{args.reply_tokens} generated; replies in the conversation: {args.replies}; "
        f"fastllm snapshot interval {args.interval}; seconds are wall time per turn"
    )
    print_table(args, runs, prompts)
    for name, err in errors.items():
        print(f"{name}: {err.splitlines()[0]}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == WORKER_FLAG:
        fastllm_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
