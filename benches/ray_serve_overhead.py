"""What the prefix-routing router deployment adds to a Serve request: the same
requests, one at a time, against ``build_app`` with ``prefix_routing`` off
(the engine replica is Serve's ingress) and on (router deployment, then the
replica), on one local Ray cluster with 1 replica of 1 thread.

Each request is a completion of IN random prompt tokens and OUT generated
tokens (ignore_eos, seeded), sent R times plain and R times streamed (a
distinct prompt each, so the prefix cache does not help); prints the median
seconds of each as JSON, and the router's extra milliseconds per request.

Usage (on a shared machine, under the bench lock):
  flock /work/bench.lock env PYTHONPATH=python .venv/bin/python benches/ray_serve_overhead.py \\
      MODEL [R IN OUT]
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ray_scaling import _cpu, _foreign  # noqa: E402


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()


def main() -> None:
    model = sys.argv[1]
    given = [int(a) for a in sys.argv[2:5]]
    reps, n_in, n_out = given + [10, 128, 16][len(given) :]
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    python_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    os.environ["FASTLLM_NUM_THREADS"] = "1"
    import ray
    from ray import serve

    import fastllm.ray
    from fastllm.config import EngineConfig

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_dir, "FASTLLM_NUM_THREADS": "1"}},
    )
    rng = random.Random(0)
    res: dict[str, float] = {"reps": reps, "in": n_in, "out": n_out}
    with socket.socket() as s:  # one port: Serve's proxy keeps its first one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for routed in (False, True):
        app = fastllm.ray.build_app(
            EngineConfig(model=model, kv_cache_memory_bytes=256 << 20, max_model_len=512),
            num_replicas=1,
            num_cpus_per_replica=1,
            served_model_name="m",
            prefix_routing=routed,
        )
        fastllm.ray.run(app, port=port, blocking=False)
        url = f"http://127.0.0.1:{port}/v1/completions"
        c = _cpu()
        tag = "routed" if routed else "direct"
        for stream in (False, True):
            times = []
            for i in range(reps + 1):
                ids = [rng.randrange(vocab // 20, vocab // 2) for _ in range(n_in)]
                body = {"model": "m", "prompt": ids, "max_tokens": n_out, "seed": i}
                body.update(ignore_eos=True, stream=stream)
                t = time.perf_counter()
                out = _post(url, body)
                if i:  # the first request warms the path up
                    times.append(time.perf_counter() - t)
                assert (b"[DONE]" in out) if stream else (b'"length"' in out), out[:200]
            res[f"{tag}_{'stream' if stream else 'plain'}_s"] = statistics.median(times)
        res[f"{tag}_foreign_cpu"] = _foreign(c)
        serve.delete("fastllm")
    for kind in ("plain", "stream"):
        d, r = res[f"direct_{kind}_s"], res[f"routed_{kind}_s"]
        res[f"router_extra_{kind}_ms"] = 1000 * (r - d)
        res[f"router_extra_{kind}_frac"] = (r - d) / d
    serve.shutdown()
    ray.shutdown()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
