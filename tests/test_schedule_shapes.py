"""Every decoder family at drawn shapes (``test_model_shapes``' generator)
under the engine's hard schedules, against transformers: prefill cut into
chunks of a few tokens at odd positions, blocks of 4 tokens, prompts that
share a prefix (served again from the prefix cache, and for the hybrids
resumed from a recurrent-state snapshot), and a KV budget too small for
every sequence at once (preemption and recompute). Greedy tokens must equal
transformers' ``generate`` for each prompt alone (float32)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_model_shapes import DENSE, HYBRID, MOE, draw_config  # noqa: E402
from test_models import _build, _one_thread, _sequences  # noqa: E402, F401

transformers.logging.set_verbosity_error()

STEPS = 6


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", DENSE + MOE + HYBRID)
def test_drawn_shapes_under_chunks_prefix_cache_and_preemption(tmp_path, family, seed):
    from fastllm import LLM, SamplingParams

    rng = random.Random(f"{family}-schedule-{seed}")
    config = draw_config(family, rng)
    model = _build(family, str(tmp_path), seed=seed, config=config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    shared = _sequences(100 + seed, [rng.choice([9, 13, 18])])[0]
    tails = _sequences(200 + seed, [1, 5, 11, 3])
    prompts = [shared + t for t in tails] + [shared[:7]]
    longest = max(len(p) for p in prompts) + STEPS
    settings = dict(
        model=str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=-(-longest // 4) * 4,
        block_size=4,
        max_num_seqs=rng.choice([2, 3, 5]),
        max_num_batched_tokens=rng.choice([5, 7, 11]),
        state_snapshot_interval=4,
        max_state_snapshots=8,
    )
    # The engine's own sizes (block bytes, recurrent states) from an engine
    # with room, then a budget with room for one sequence at its longest and
    # two blocks more, so that the others wait or are preempted.
    plan = LLM(**settings).llm_engine.cache
    blocks = (-(-longest // 4) + 2) * plan.groups
    llm = LLM(**settings, kv_cache_memory_bytes=plan.state_bytes + plan.block_bytes * blocks)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    want = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # a token 0 is not padding
                max_new_tokens=STEPS,
                do_sample=False,
                min_new_tokens=STEPS,
            )
        want.append(out[0, len(p) :].tolist())
    # the last prompt asks for two completions: forks share its blocks and
    # copy its recurrent state; greedy, both are the reference's
    plist = [params] * (len(prompts) - 1) + [SamplingParams(
        n=2, max_tokens=STEPS, temperature=0, ignore_eos=True
    )]  # fmt: skip
    for run in range(2):  # the second run meets the first's cached prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], plist, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == want, (family, run, config.to_dict())
        assert [c.token_ids for c in outs[-1].outputs] == [want[-1]] * 2, (family, run)
    # the second run reused blocks (and snapshots) the small cache still held
    assert any(o.num_cached_tokens > 0 for o in outs), [o.num_cached_tokens for o in outs]
