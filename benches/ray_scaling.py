"""Replica scaling of fastllm on Ray, with the models loaded before timing.

N prompts of IN random token ids, OUT generated tokens each (ignore_eos, seeded),
in batches of BATCH rows, measured in one run on one local Ray cluster:

- ``local_s``: ``LLMPredictor`` (one ``LLM``) in this process, no Ray, the
  batches one after another: the reference generation time;
- ``actors_1_s`` / ``actors_2_s``: the same batches on 1 / 2 Ray actors each
  holding an ``LLMPredictor`` (1 thread, 1 CPU), loaded and warmed up before
  the clock starts; the batches go to whichever actor is free
  (``ray.util.ActorPool``);
- ``data_2_s``: the ``map_batches`` job ``fastllm.ray.generate`` runs, on Ray
  Data with 2 replicas (and ``data_2_inflight1_s``: with at most one block in
  flight per replica), from the
  first batch a replica starts to the last it ends (each replica stamps its
  batches), so Ray Data's actor start and model loads are left out;
  ``data_2_total_s`` is the whole job, start-up included.

Each phase also reports ``*_foreign_cpu``: the share of the machine's CPU
time that processes other than this one and its descendants took meanwhile
(other users of a shared machine); a scaling figure is only meaningful when
that is near 0.

Printed as JSON with ``scaling`` (actors_1_s / actors_2_s), ``ray_overhead``
((actors_1_s - local_s) / local_s: what the Ray path adds per request, relative
to its generation time) and the start-up times.

Usage (on a shared machine, under the bench lock):
  flock /work/bench.lock env PYTHONPATH=python .venv/bin/python benches/ray_scaling.py \
      /work/benchmodels/qwen2-0.5b-random [N IN OUT BATCH]
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 512}


def _rows(n: int, n_in: int, n_out: int, vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "id": i,
            "prompt_token_ids": [rng.randrange(vocab // 20, vocab // 2) for _ in range(n_in)],
            "seed": i,
            "max_tokens": n_out,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


def _batches(rows: list[dict], size: int) -> list[dict]:
    """Column batches (the layout Ray Data hands a predictor)."""
    out = []
    for i in range(0, len(rows), size):
        part = rows[i : i + size]
        out.append({k: [r[k] for r in part] for k in part[0]})
    return out


def _cpu() -> tuple[int, int, int]:
    """CPU jiffies so far: (busy, total) of the whole machine (/proc/stat), and
    the busy jiffies of this process and its descendants (Ray's processes)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    busy, total = sum(vals) - vals[3] - vals[4], sum(vals)
    procs: dict[int, tuple[int, int]] = {}  # pid -> (parent, jiffies)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            procs[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    me, ours = os.getpid(), 0
    for pid, (_, jiffies) in procs.items():
        p = pid
        while p > 1 and p != me:
            p = procs.get(p, (0, 0))[0]
        if p == me:
            ours += jiffies
    return busy, total, ours


def _foreign(before: tuple[int, int, int]) -> float:
    """The share of the machine's CPU time since ``before`` that processes
    other than this one and its descendants (other users of a shared
    machine) took."""
    now = _cpu()
    total = now[1] - before[1]
    return max(0.0, (now[0] - before[0]) - (now[2] - before[2])) / total if total else 0.0


def _check(outs: list[dict], n: int, n_out: int) -> None:
    ids = sorted(i for o in outs for i in o["id"])
    assert ids == list(range(n)), "rows lost or repeated"
    errors = [e for o in outs for e in o["error"] if e]
    assert not errors, errors[:3]
    assert all(int(k) == n_out for o in outs for k in o["num_generated_tokens"])


def main() -> None:
    model = sys.argv[1]
    given = [int(a) for a in sys.argv[2:6]]
    n, n_in, n_out, batch = given + [64, 128, 64, 32][len(given) :]
    os.environ["FASTLLM_NUM_THREADS"] = "1"
    python_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = _rows(n, n_in, n_out, vocab)
    batches = _batches(rows, batch)
    warm = _batches(_rows(2, 16, 2, vocab), 2)[0]
    res: dict[str, float | int | str] = {"n": n, "in": n_in, "out": n_out, "batch": batch}

    import torch

    from fastllm.ray.data import LLMPredictor

    torch.set_num_threads(1)
    t = time.time()
    local = LLMPredictor(model, num_threads=1, **ENGINE)
    res["local_load_s"] = time.time() - t
    local(warm)
    c, t = _cpu(), time.time()
    _check([local(b) for b in batches], n, n_out)
    res["local_s"] = time.time() - t
    res["local_foreign_cpu"] = _foreign(c)
    del local

    import ray
    from ray.util import ActorPool

    t = time.time()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_dir, "FASTLLM_NUM_THREADS": "1"}},
    )
    res["ray_init_s"] = time.time() - t

    class Replica:
        """A Ray actor holding one LLMPredictor (what a Ray Data replica holds)."""

        def __init__(self) -> None:
            self.predictor = LLMPredictor(model, num_threads=1, **ENGINE)

        def run(self, b: dict) -> dict:
            return self.predictor(b)

    actor_class = ray.remote(num_cpus=1)(Replica)
    for reps in (1, 2):
        t = time.time()
        actors = [actor_class.remote() for _ in range(reps)]
        ray.get([a.run.remote(warm) for a in actors])  # loaded and warm
        res[f"actors_{reps}_start_s"] = time.time() - t
        c, t = _cpu(), time.time()
        outs = list(ActorPool(actors).map(lambda a, b: a.run.remote(b), batches))
        res[f"actors_{reps}_s"] = time.time() - t
        res[f"actors_{reps}_foreign_cpu"] = _foreign(c)
        _check(outs, n, n_out)
        for a in actors:
            ray.kill(a)
        del actors

    import fastllm.ray

    class StampedPredictor(LLMPredictor):
        """Stamps each batch with when this replica started and ended it."""

        def __call__(self, b):
            t0 = time.time()
            out = super().__call__(b)
            out["batch_start"] = [t0] * len(out["id"])
            out["batch_end"] = [time.time()] * len(out["id"])
            out["replica_pid"] = [os.getpid()] * len(out["id"])
            return out

    ray.data.DataContext.get_current().enable_progress_bars = False
    # Ray Data's default lets an actor queue several blocks; with one
    # long-running batch per block that can leave a replica idle, so both
    # settings are measured (1: one block in flight per actor)
    for in_flight in (None, 1):
        tag = "data_2" if in_flight is None else f"data_2_inflight{in_flight}"
        ds = ray.data.from_items(rows, override_num_blocks=max(1, n // batch))
        c, t = _cpu(), time.time()
        out = ds.map_batches(
            StampedPredictor,
            fn_constructor_kwargs={"model": model, "num_threads": 1, **ENGINE},
            compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=in_flight),
            num_cpus=1,
            batch_size=batch,
            batch_format="numpy",
        ).take_all()
        res[f"{tag}_total_s"] = time.time() - t
        res[f"{tag}_foreign_cpu"] = _foreign(c)  # an overestimate: its actors have exited
        assert sorted(r["id"] for r in out) == list(range(n))
        res[f"{tag}_s"] = max(r["batch_end"] for r in out) - min(r["batch_start"] for r in out)
        pids = [r["replica_pid"] for r in out]
        res[f"{tag}_rows_per_replica"] = str(sorted(pids.count(p) for p in set(pids)))
    assert fastllm.ray.generate  # the one-call path wraps this same map_batches
    ray.shutdown()

    res["scaling"] = res["actors_1_s"] / res["actors_2_s"]
    res["data_scaling_vs_actors_1"] = res["actors_1_s"] / res["data_2_s"]
    res["data_inflight1_scaling_vs_actors_1"] = res["actors_1_s"] / res["data_2_inflight1_s"]
    res["ray_overhead"] = (res["actors_1_s"] - res["local_s"]) / res["local_s"]
    res["ray_overhead_per_request_ms"] = 1000 * (res["actors_1_s"] - res["local_s"]) / n
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
