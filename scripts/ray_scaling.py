"""Replica scaling of fastllm.ray.generate: N prompts of IN random token ids, OUT
tokens each, on 1 then 2 replicas of 1 thread, then a warm in-process
LLM.generate of the same rows; prints the seconds of each as JSON.

Usage: PYTHONPATH=python .venv/bin/python scripts/ray_scaling.py MODEL N IN OUT
"""

from __future__ import annotations

import json
import os
import random
import sys
import time


def main() -> None:
    model = sys.argv[1]
    n, n_in, n_out = (int(a) for a in sys.argv[2:5])
    os.environ["FASTLLM_NUM_THREADS"] = "1"
    rng = random.Random(0)
    rows = [
        {
            "id": i,
            "prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(n_in)],
            "seed": i,
            "max_tokens": n_out,
            "ignore_eos": True,
        }
        for i in range(n)
    ]
    eng = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 512}
    t = time.time()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    res = {"ray_init_s": time.time() - t}
    import fastllm.ray

    for reps in (1, 2):
        ds = ray.data.from_items(rows, override_num_blocks=8)
        t = time.time()
        out = fastllm.ray.generate(
            ds,
            model=model,
            num_replicas=reps,
            num_cpus_per_replica=1,
            batch_size=max(1, n // (2 * reps)),
            **eng,
        ).take_all()
        assert sorted(r["id"] for r in out) == list(range(n))
        res[f"replicas_{reps}_s"] = time.time() - t
    ray.shutdown()
    import torch

    from fastllm import LLM, SamplingParams

    torch.set_num_threads(1)
    t = time.time()
    llm = LLM(model, **eng)
    res["load_s"] = time.time() - t
    t = time.time()
    llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
        [SamplingParams(seed=r["seed"], max_tokens=n_out, ignore_eos=True) for r in rows],
        use_tqdm=False,
    )
    res["in_process_generate_s"] = time.time() - t
    print(json.dumps(res))


if __name__ == "__main__":
    main()
