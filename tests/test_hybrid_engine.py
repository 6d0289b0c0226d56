"""The engine with a hybrid model's recurrent state (``engine/state_cache.py``):
state slots through preemption, forks and chunked prefill, and the prefix
cache resuming from state snapshots, each against the plain run it must equal."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from fastllm import LLM, SamplingParams  # noqa: E402
from test_hybrid_models import CONFIGS  # noqa: E402
from test_models import _build, _one_thread, _sequences  # noqa: E402, F401

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2", "qwen3_5_moe", "lfm2_moe"])
def folder(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    _build("", path, 0, CONFIGS[request.param])
    return path


def _llm(folder: str, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(model=folder, dtype="float32", skip_tokenizer_init=True, **kw)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outs: list) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_prefix_cache_resumes_from_a_snapshot(folder: str) -> None:
    """A request sharing a long prefix with an earlier one resumes from the
    last snapshot inside the shared part (its cached-token count says so,
    as does the counter), and gives exactly the tokens it gives without the
    prefix cache."""
    shared = _sequences(5, [70])[0]
    prompts = [shared + t for t in _sequences(6, [5, 9])]
    plain = _tokens(_run(_llm(folder, enable_prefix_caching=False), prompts))
    llm = _llm(folder, state_snapshot_interval=16)
    first = _run(llm, prompts[:1])
    second = _run(llm, prompts[1:])
    assert _tokens(first + second) == plain
    assert first[0].num_cached_tokens == 0
    # The snapshot at 64 tokens (the last multiple of 16 inside the 70 shared).
    assert second[0].num_cached_tokens == 64
    stats = llm.llm_engine.states.stats
    assert stats["hits"] == 1 and stats["hit_tokens"] == 64


@pytest.mark.parametrize("interval", [8, 64])
def test_multi_turn_chat_recomputes_only_the_new_turn(folder: str, interval: int) -> None:
    """Each turn's prompt is the conversation so far plus a new message. With
    snapshots every block (interval 8), it resumes within a block of the
    conversation's end (snapshots taken while decoding); with sparse ones
    (64), within a block of the previous prompt's end (the prompt's own
    snapshot point). Either way it replies as without the cache."""
    llm = _llm(folder, state_snapshot_interval=interval, block_size=8)
    plain = _llm(folder, enable_prefix_caching=False)
    conversation: list[int] = []
    previous_prompt = 0
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for turn, message in enumerate(_sequences(7, [20, 7, 13, 9])):
        prompt = conversation + message
        (out,) = _run(llm, [prompt], params)
        (ref,) = _run(plain, [prompt], params)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, turn
        if turn:
            resumed_by = len(conversation) if interval == 8 else previous_prompt
            assert out.num_cached_tokens > resumed_by - 8, turn
        previous_prompt = len(prompt)
        conversation = prompt + list(out.outputs[0].token_ids)


def test_preemption_gives_the_same_tokens(folder: str) -> None:
    """A KV cache too small for the batch preempts sequences (their state
    slots are freed and recomputed); the tokens do not change."""
    prompts = _sequences(8, [30, 25, 28, 33])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    roomy = _tokens(_run(_llm(folder, enable_prefix_caching=False), prompts, params))
    budget = _bytes_for(folder, 100)
    tight = _llm(
        folder, enable_prefix_caching=False, kv_cache_memory_bytes=budget, max_model_len=64
    )
    assert _tokens(_run(tight, prompts, params)) == roomy
    assert tight.llm_engine.scheduler.num_preemptions > 0


def _bytes_for(folder: str, tokens: int) -> int:
    """A cache budget of the recurrent states plus about ``tokens`` tokens of KV."""
    llm = _llm(folder, enable_prefix_caching=False)
    plan = llm.llm_engine.cache
    per_token = plan.block_bytes / plan.block_size
    return plan.state_bytes + int(per_token * tokens)


def test_chunked_prefill_and_batching_give_the_same_tokens(folder: str) -> None:
    """Prompts prefilled in chunks of 7 tokens, mixed in one batch, give the
    tokens each gives alone in one pass."""
    prompts = _sequences(9, [40, 3, 17])
    alone = [_tokens(_run(_llm(folder), [p]))[0] for p in prompts]
    chunked = _llm(folder, max_num_batched_tokens=7, max_num_seqs=3)
    assert _tokens(_run(chunked, prompts)) == alone


def test_forks_copy_the_state(folder: str) -> None:
    """``n = 3`` seeded completions share the prompt's state (copied into
    each fork's slot) and equal three requests with seeds s, s+1, s+2."""
    (prompt,) = _sequences(10, [19])
    llm = _llm(folder)
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = _run(llm, [prompt], params)
    forked = sorted(c.token_ids for c in out.outputs)
    single = []
    for j in range(3):
        p = SamplingParams(max_tokens=10, temperature=1.0, seed=5 + j, ignore_eos=True)
        single.append(_run(_llm(folder), [prompt], p)[0].outputs[0].token_ids)
    assert forked == sorted(single)


def test_state_memory_is_planned_and_n_is_checked(folder: str) -> None:
    llm = _llm(folder, max_num_seqs=4, max_state_snapshots=3)
    plan = llm.llm_engine.cache
    assert plan.state_slots == 7 and plan.state_bytes > 0
    assert "recurrent states: 7 slots" in plan.describe()
    with pytest.raises(ValueError, match="n=5"):
        _run(llm, [[1, 2, 3]], SamplingParams(n=5, max_tokens=2))
    with pytest.raises(ValueError, match="state_snapshot_interval"):
        _llm(folder, state_snapshot_interval=20)


def test_metrics_count_snapshot_resumes(folder: str, tokenizer_dir: str, tmp_path) -> None:
    """Over HTTP: a second completion sharing the first's prompt resumes from
    a snapshot, and ``/metrics`` counts it."""
    import json
    import shutil

    from server_process import app_server
    from test_server import _metrics, _post

    shutil.copytree(folder, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", tmp_path / "model" / name)
    shared = _sequences(12, [40])[0]
    with app_server(str(tmp_path / "model"), 128, state_snapshot_interval=16) as (_, server):
        for tail in ([1, 2], [3]):
            body = {"prompt": shared + tail, "max_tokens": 3, "temperature": 0}
            status, _ = _post(*server, "/v1/completions", json.dumps(body))
            assert status == 200
        metrics = _metrics(server)
    assert metrics["fastllm_state_snapshot_hits_total"] == 1
    assert metrics["fastllm_state_snapshot_hit_tokens_total"] == 32
    assert metrics["fastllm_state_snapshots_saved_total"] >= 1
