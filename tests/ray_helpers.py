"""Test helper: what the Ray tests share: a small local Ray cluster and the
engine settings of its replicas."""

from __future__ import annotations

import os

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
# Small KV caches: several engines share this machine's memory.
ENGINE = {"kv_cache_memory_bytes": 16 << 20, "max_model_len": 256}


def start_local_cluster() -> None:
    """ray.init of a 2-CPU local cluster whose workers import this fastllm
    and run its kernels on one thread (two replicas share the two cores)."""
    import ray

    os.environ["FASTLLM_NUM_THREADS"] = "1"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": PYTHON_DIR, "FASTLLM_NUM_THREADS": "1"}},
    )
