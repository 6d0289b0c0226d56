"""Offline generation on Ray Data: one ``LLM`` per actor, rows in, rows out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fastllm import envs
from fastllm.ray import require_ray

ray = require_ray()

# Columns every output row gets, besides the input columns it keeps.
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "error",
)


def sampling_fields() -> tuple[str, ...]:
    """The SamplingParams fields a dataset column may set per row."""
    from fastllm.sampling_params import SamplingParams

    return tuple(
        f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"
    )


def _params_dict(sampling_params: Any) -> dict[str, Any]:
    """``sampling_params`` (None, a SamplingParams or a dict) as keyword arguments."""
    if sampling_params is None:
        return {}
    if isinstance(sampling_params, dict):
        return dict(sampling_params)
    fields = sampling_fields()
    return {k: getattr(sampling_params, k) for k in fields}


def _is_missing(value: Any) -> bool:
    """A null cell (None, or NaN in a float column): the row keeps the default."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A cell as plain Python (numpy scalars and arrays become ints, floats, lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class LLMPredictor:
    """The callable class for ``ray.data.Dataset.map_batches``: each Ray actor
    holds one ``LLM`` and turns a batch of rows into generated rows.

    A row gives its prompt in a ``prompt`` column (text), a
    ``prompt_token_ids`` column (token ids) or a ``messages`` column (a chat
    conversation, rendered with the model's chat template or
    ``chat_template``); any column named as a ``SamplingParams`` field
    (``max_tokens``, ``temperature``, ``seed``, ...) sets that field for its
    row, over ``sampling_params``; a null cell keeps the default. The output
    keeps every input column and adds ``generated_text``,
    ``generated_token_ids``, ``finish_reason``, ``num_prompt_tokens``,
    ``num_generated_tokens`` and ``error`` (None, or why that row could not
    run: its ``finish_reason`` is then ``"error"`` and the other rows of the
    batch still run).

    ``num_threads`` sets ``FASTLLM_NUM_THREADS`` and torch's threads of the
    actor (default: leave them). Every other keyword goes to ``LLM`` as is
    (``dtype``, ``device``, ``quantization``, ``max_model_len``, ...).

    Example::

        ds = ds.map_batches(
            LLMPredictor,
            fn_constructor_kwargs={"model": "path/to/model", "num_threads": 1},
            concurrency=2, num_cpus=1, batch_size=16, batch_format="pyarrow",
        )
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        sampling_params: Any = None,
        chat_template: str | None = None,
        num_threads: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be at least 1, got {num_threads}")
            envs.set_num_threads(num_threads)
            import torch

            torch.set_num_threads(num_threads)
        from fastllm.llm import LLM
        from fastllm.sampling_params import SamplingParams

        self.defaults = _params_dict(sampling_params)
        SamplingParams(**self.defaults)  # a bad default fails here, not per row
        self.chat_template = chat_template
        self.fields = set(sampling_fields())
        self.llm = LLM(model, **llm_kwargs)

    def __repr__(self) -> str:
        return f"LLMPredictor({self.llm!r})"

    def __call__(self, batch: Any) -> Any:
        columns, rebuild = _columns(batch)
        n = len(next(iter(columns.values()))) if columns else 0
        result = self.generate_rows(columns, n)
        return rebuild(batch, result)

    def generate_rows(self, columns: dict[str, list[Any]], n: int) -> dict[str, list[Any]]:
        """The output columns for ``n`` rows given as plain-Python columns."""
        from fastllm.inputs import chat_stop, truncate
        from fastllm.sampling_params import SamplingParams

        llm = self.llm
        engine = llm.llm_engine
        out: dict[str, list[Any]] = {name: [None] * n for name in OUTPUT_COLUMNS}
        runnable: list[int] = []
        prompts: list[dict[str, Any]] = []
        params: list[SamplingParams] = []
        for i in range(n):
            try:
                kwargs = dict(self.defaults)
                for name in self.fields & columns.keys():
                    value = columns[name][i]
                    if not _is_missing(value):
                        kwargs[name] = _plain(value)
                p = SamplingParams(**kwargs)
                if p.n != 1:
                    raise ValueError(
                        f"n={p.n}: each row gives one completion; "
                        "repeat the row with other seeds for more"
                    )
                text, ids, is_chat = self._prompt(columns, i)
                if is_chat:
                    p = chat_stop(p, engine.require_tokenizer(), self.chat_template)
                ids = truncate(ids, p)
                engine.validate_request(ids, p, f"row {i}")
            except ValueError as e:
                out["generated_text"][i] = ""
                out["generated_token_ids"][i] = []
                out["finish_reason"][i] = "error"
                out["num_prompt_tokens"][i] = 0
                out["num_generated_tokens"][i] = 0
                out["error"][i] = str(e)
                continue
            runnable.append(i)
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if text is not None:
                prompt["prompt"] = text
            prompts.append(prompt)
            params.append(p)
        results = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for i, res in zip(runnable, results):
            c = res.outputs[0]
            out["generated_text"][i] = c.text
            out["generated_token_ids"][i] = list(c.token_ids)
            out["finish_reason"][i] = c.finish_reason
            out["num_prompt_tokens"][i] = len(res.prompt_token_ids)
            out["num_generated_tokens"][i] = len(c.token_ids)
        return out

    def _prompt(self, columns: dict[str, list[Any]], i: int) -> tuple[str | None, list[int], bool]:
        """Row ``i``'s prompt: (text or None, token ids, whether it is a chat)."""
        from fastllm.inputs import chat_prompt, is_token_ids

        tokenizer = self.llm.llm_engine.require_tokenizer
        for name in ("messages", "prompt_token_ids", "prompt"):
            value = columns[name][i] if name in columns else None
            if value is None:
                continue
            if name == "messages":
                conv = _plain(value)
                if not isinstance(conv, list) or not all(isinstance(m, dict) for m in conv):
                    raise ValueError(f"row {i}: messages must be a list of message dicts")
                return (*chat_prompt(tokenizer(), conv, self.chat_template), True)
            if name == "prompt_token_ids":
                ids = _plain(value)
                if not isinstance(ids, list) or not is_token_ids(ids):
                    raise ValueError(f"row {i}: prompt_token_ids must be a list of ints")
                text = columns["prompt"][i] if "prompt" in columns else None
                return (text if isinstance(text, str) else None), ids, False
            if not isinstance(value, str):
                raise ValueError(f"row {i}: prompt must be a string, got {type(value).__name__}")
            return value, tokenizer().encode(value), False
        raise ValueError(
            f"row {i} has no prompt: give a 'prompt', 'prompt_token_ids' or 'messages'"
        )


def _columns(batch: Any) -> tuple[dict[str, list[Any]], Any]:
    """A batch of any of Ray Data's formats as plain-Python columns, and the
    function that adds the output columns to it in the same format."""
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return {name: batch.column(name).to_pylist() for name in batch.column_names}, _to_arrow
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas comes with ray[data]
        pd = None
    if pd is not None and isinstance(batch, pd.DataFrame):
        cols = {name: [_plain(v) for v in batch[name].tolist()] for name in batch.columns}
        return cols, _to_pandas
    if isinstance(batch, dict):
        return {name: [_plain(v) for v in col] for name, col in batch.items()}, _to_numpy
    raise TypeError(f"LLMPredictor: unsupported batch type {type(batch).__name__}")


def _to_arrow(batch: Any, out: dict[str, list[Any]]) -> Any:
    import pyarrow as pa

    types = {
        "generated_text": pa.string(),
        "generated_token_ids": pa.list_(pa.int64()),
        "finish_reason": pa.string(),
        "num_prompt_tokens": pa.int64(),
        "num_generated_tokens": pa.int64(),
        "error": pa.string(),
    }
    table = batch.drop_columns([c for c in OUTPUT_COLUMNS if c in batch.column_names])
    for name in OUTPUT_COLUMNS:
        table = table.append_column(name, pa.array(out[name], type=types[name]))
    return table


def _to_pandas(batch: Any, out: dict[str, list[Any]]) -> Any:
    frame = batch.copy()
    for name in OUTPUT_COLUMNS:
        frame[name] = out[name]
    return frame


def _to_numpy(batch: Any, out: dict[str, list[Any]]) -> Any:
    import numpy as np

    result = dict(batch)
    for name in OUTPUT_COLUMNS:
        if name == "generated_token_ids":
            col = np.empty(len(out[name]), dtype=object)
            for i, ids in enumerate(out[name]):
                col[i] = np.asarray(ids, dtype=np.int64)
            result[name] = col
        elif name in ("num_prompt_tokens", "num_generated_tokens"):
            result[name] = np.asarray(out[name], dtype=np.int64)
        else:
            result[name] = np.asarray(out[name], dtype=object)
    return result


def generate(
    dataset: Any,
    model: str | None = None,
    *,
    sampling_params: Any = None,
    num_replicas: int = 1,
    num_cpus_per_replica: float = 1,
    num_gpus_per_replica: float = 0,
    num_threads: int | None = None,
    batch_size: int = 16,
    chat_template: str | None = None,
    max_restarts: int | None = None,
    max_task_retries: int | None = None,
    runtime_env: dict[str, Any] | None = None,
    **llm_kwargs: Any,
) -> Any:
    """``dataset`` with generated columns (see ``LLMPredictor``), computed by
    ``num_replicas`` Ray actors, each holding one fastllm engine.

    Each replica asks Ray for ``num_cpus_per_replica`` CPUs and
    ``num_gpus_per_replica`` GPUs (1 for a GPU replica: Ray then gives it
    its own device, which it probes as usual) and runs its CPU kernels on
    ``num_threads`` threads (default: the CPUs it asked for, at least 1). A
    replica that dies is restarted and its batch retried, so every input row
    comes out exactly once: Ray Data's own actor-pool rules, which restart
    and retry without limit unless ``max_restarts`` / ``max_task_retries``
    say otherwise (0 turns them off). The result is lazy, as every Ray Dataset: iterate it, call
    ``take_all()``, or write it with ``write_parquet`` / ``write_json``.
    Rows come out in no fixed order; keep an id column to join them back.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if num_cpus_per_replica < 0 or num_gpus_per_replica < 0:
        raise ValueError("num_cpus_per_replica and num_gpus_per_replica must not be negative")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if num_threads is None:
        num_threads = max(1, int(num_cpus_per_replica))
    env = dict(runtime_env or {})
    env_vars = {
        "FASTLLM_NUM_THREADS": str(num_threads),
        "OMP_NUM_THREADS": str(num_threads),
        **env.get("env_vars", {}),
    }
    env["env_vars"] = env_vars
    retries = {
        k: v
        for k, v in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries))
        if v is not None
    }
    return dataset.map_batches(
        LLMPredictor,
        fn_constructor_kwargs={
            "model": model,
            "sampling_params": _params_dict(sampling_params),
            "chat_template": chat_template,
            "num_threads": num_threads,
            **llm_kwargs,
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        # one batch in flight per replica: a batch is one long generate call,
        # and a second block queued behind it on a busy replica can leave
        # another replica idle (seen with few blocks: all on one replica)
        compute=ray.data.ActorPoolStrategy(size=num_replicas, max_tasks_in_flight_per_actor=1),
        num_cpus=num_cpus_per_replica,
        num_gpus=num_gpus_per_replica,
        runtime_env=env,
        **retries,
    )
