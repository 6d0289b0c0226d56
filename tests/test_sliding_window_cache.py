"""Sliding-window layers that free their KV blocks (``KVLayout``, ``KVCacheManager``).

A model mixing windowed and full-attention layers keeps one block table per
layer group; a windowed group frees the blocks its window no longer sees.
Checked here: the layouts chosen; greedy tokens equal to transformers with
blocks freed (prefix caching on and off, chunked prefill, preemption,
``n > 1`` forks); the prefix cache rule (a hit only where every group still
holds the prefix); and the memory a Gemma-3-shaped model holds at 8k tokens
against (global layers x length + local layers x window).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from fastllm import LLM, SamplingParams  # noqa: E402
from fastllm.engine.kv_cache_manager import KVLayout  # noqa: E402

transformers.logging.set_verbosity_error()

WINDOW = 8
FULL_LAYERS = (3, 7)  # of 8: two full-attention layers, six windowed ones


def _gemma3_types(n: int, full: tuple[int, ...]) -> list[str]:
    return ["full_attention" if i in full else "sliding_attention" for i in range(n)]


def test_layouts() -> None:
    gemma3 = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = KVLayout.of(gemma3)
    assert layout.layers_per_block == 4 and layout.num_groups == 7
    assert layout.groups[0] == (5, 11, 17, 23) and layout.windows[0] is None
    assert all(w == 512 for w in layout.windows[1:])
    assert sorted(i for g in layout.groups for i in g) == list(range(26))
    assert layout.groups[-1] == (24, 25)  # the last group's other slots are unused
    # 8k tokens, 2048-token steps: the global group's blocks for every token,
    # each local group's for a window plus a step.
    assert layout.blocks_per_seq(8192, 16, 2048) == 512 + 6 * (160 + 1)
    gemma2 = KVLayout.of([4096 if i % 2 == 0 else None for i in range(26)])
    assert gemma2.layers_per_block == 13 and gemma2.num_groups == 2
    assert KVLayout.of([None] * 4) == KVLayout(((0, 1, 2, 3),), (None,), 4)
    assert KVLayout.of([16] * 3) == KVLayout(((0, 1, 2),), (16,), 3)
    mixed = KVLayout.of([None, 8, 32, None, 16, 8])
    assert mixed.groups == ((0, 3), (1, 2), (4, 5)) and mixed.windows == (None, 32, 16)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """A tiny Gemma 3 whose local layers see 8 tokens (random weights, float32)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=_gemma3_types(8, FULL_LAYERS),
        query_pre_attn_scalar=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.15
            p.copy_(scale * torch.randn(p.shape, generator=g))
    model = model.float().eval()
    folder = str(tmp_path_factory.mktemp("gemma3-window"))
    model.save_pretrained(folder)
    return folder, model


def _prompts(n: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lengths]


def _reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each the argmax of a full forward pass."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _llm(folder: str, **kw) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", block_size=4, skip_tokenizer_init=True, **kw)


def _in_use(llm: LLM) -> int:
    pool = llm.llm_engine.kv.pool
    return pool.num_blocks - pool.num_free_blocks()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers_while_blocks_are_freed(gemma3, prefix_caching) -> None:
    folder, ref_model = gemma3
    llm = _llm(
        folder, enable_prefix_caching=prefix_caching, max_num_batched_tokens=24, max_num_seqs=4
    )
    assert llm.llm_engine.runner.layout.num_groups == 4  # 1 full + 3 windowed groups of 2
    assert llm.llm_engine.runner.fused_layers  # the fused stack reads each group's tables
    prompts = _prompts(1, [37, 9, 61])  # 61 tokens take three 24-token chunks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == _reference(ref_model, p, 20)
    assert _in_use(llm) == 0


def test_mistral_frees_its_window_on_the_fused_stack(tmp_path) -> None:
    """Every layer windowed (Mistral): one block table whose early blocks are
    freed, read by the fused CPU decoder stack; greedy tokens equal transformers'."""
    config = transformers.MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        pad_token_id=0,
    )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    llm = _llm(str(tmp_path))
    assert llm.llm_engine.runner.layout.windows == (WINDOW,)
    assert llm.llm_engine.runner.fused_layers
    prompts = _prompts(6, [45, 12])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == _reference(model, p, 16)
    engine = llm.llm_engine
    engine.add_request(None, _prompts(7, [100])[0], _greedy(3), "long")
    engine.step()
    (seq,) = engine.scheduler.running
    assert len(seq.block_table) - seq.num_freed[0] <= WINDOW // 4 + 1


def test_windowed_groups_hold_about_a_window(gemma3) -> None:
    """While a long sequence runs, the full group holds a block for every
    4 tokens and each windowed group about a window's worth."""
    folder, _ = gemma3
    llm = _llm(folder, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = _prompts(2, [200])[0]
    engine.add_request(None, prompt, _greedy(5), "r")
    engine.step()  # the whole prompt in one step, then the blocks out of the window go
    (seq,) = engine.scheduler.running
    windowed = [len(t) - f for t, f in zip(seq.block_tables[1:], seq.num_freed[1:], strict=True)]
    assert len(seq.block_tables[0]) == 50 and seq.num_freed[0] == 0  # 200 tokens
    assert all(n <= WINDOW // 4 + 1 for n in windowed), windowed
    assert _in_use(llm) == 50 + sum(windowed)
    while engine.has_unfinished_requests():
        engine.step()
    assert _in_use(llm) == 0


def test_prefix_cache_with_windowed_groups(gemma3) -> None:
    """A prompt extending an earlier one resumes from the cached prefix (every
    group still holds it: the freed windowed blocks stay cached until
    evicted) and gives the tokens it gives with the prefix cache off."""
    folder, ref_model = gemma3
    on = _llm(folder, enable_prefix_caching=True)
    base = _prompts(3, [50])[0]
    longer = base + _prompts(4, [13])[0]
    (first,) = on.generate([{"prompt_token_ids": base}], _greedy(4), use_tqdm=False)
    (second,) = on.generate([{"prompt_token_ids": longer}], _greedy(12), use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    assert second.outputs[0].token_ids == _reference(ref_model, longer, 12)
    # After the pool has evicted the early windowed blocks, no group-0-only hit:
    on.llm_engine.kv.pool.reset_prefix_cache()
    (third,) = on.generate([{"prompt_token_ids": longer}], _greedy(12), use_tqdm=False)
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == second.outputs[0].token_ids


def test_preemption_and_forks_with_windowed_groups(gemma3) -> None:
    folder, ref_model = gemma3
    prompts = _prompts(5, [40, 33, 47, 29])
    ample = _llm(folder)
    want = ample.generate([{"prompt_token_ids": p} for p in prompts], _greedy(30), use_tqdm=False)
    # 70 blocks of 2 layers x (K, V) x 2 heads x 16 dims x 4 tokens x 4 bytes; 16-token
    # steps, so one sequence of 128 tokens needs 32 + 3 x 7 blocks at most.
    small = _llm(
        folder,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=70 * 2 * 2 * 2 * 16 * 4 * 4,
    )
    got = small.generate([{"prompt_token_ids": p} for p in prompts], _greedy(30), use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # n = 3 forks share the prompt's blocks (freed ones included) and match single runs.
    sp = dict(temperature=0.9, max_tokens=25, ignore_eos=True)
    (forked,) = ample.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(n=3, seed=11, **sp), use_tqdm=False
    )
    for i, completion in enumerate(forked.outputs):
        (single,) = ample.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(seed=11 + i, **sp), use_tqdm=False
        )
        assert completion.token_ids == single.outputs[0].token_ids
    assert _in_use(ample) == 0


def test_gemma3_shaped_kv_memory_at_8k_tokens(tmp_path) -> None:
    """A Gemma-3-1B-shaped layer pattern (26 layers, every 6th global, window
    512) at 8k tokens holds within 1.2x of global layers x 8k tokens + local
    layers x the window, where keeping every block would take 26 x 8k."""
    import json

    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 26,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 8448,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=64 << 20,
    )
    engine = llm.llm_engine
    engine.add_request(None, [5] * 8192, _greedy(2), "r")
    while engine.scheduler.running == [] or not engine.scheduler.running[0].prefill_done:
        engine.step()
    layout = engine.runner.layout
    held = _in_use(llm) * 16 * layout.layers_per_block  # token-layers held
    bound = 4 * 8193 + 22 * 512
    assert held <= 1.2 * bound, (held, bound)
    assert held < 0.3 * 26 * 8193  # what keeping every block would hold


def _check_invariants(kv, seqs) -> None:
    """Every block a live table lists past its freed entries is referenced
    once per listing; nothing else is; freed entries are 0 and sit below the
    window of the next query (and below the last registered block)."""
    from collections import Counter

    held: Counter[int] = Counter()
    for seq in seqs:
        if not seq.block_tables:
            continue
        lengths = {len(t) for t in seq.block_tables}
        assert len(lengths) == 1
        for g, table in enumerate(seq.block_tables):
            freed = seq.num_freed[g]
            assert all(b == 0 for b in table[:freed])
            held.update(table[freed:])
            if kv.windows[g] is None:
                assert freed == 0
            else:
                assert freed <= kv._first_visible(g, seq.num_computed_tokens)
                if kv.enable_prefix_caching and freed:
                    assert freed <= seq.num_registered[g] - 1
    for block in range(kv.pool.num_blocks):
        assert kv.pool.ref_count(block) == held[block], block


@settings(max_examples=60, deadline=None)
@given(
    windows=st.sampled_from([(None,), (5,), (None, 5, 3), (None, None, 9)]),
    prefix=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "step", "fork", "free"]), st.integers(0, 2**16)),
        max_size=40,
    ),
)
def test_kv_manager_keeps_its_invariants(windows, prefix, ops) -> None:
    """Random new sequences (sharing prefixes), steps of random sizes, forks
    and frees over 1-3 layer groups, with and without prefix caching."""
    import random

    from fastllm.engine.kv_cache_manager import KVCacheManager
    from fastllm.engine.sequence import Sequence

    kv = KVCacheManager(64, 4, prefix, windows)
    live: list[Sequence] = []
    base = list(range(100, 160))
    for op, seed in ops:
        rng = random.Random(seed)
        if op == "new" or not live:
            tokens = base[: rng.randint(1, 40)] + [
                rng.randint(0, 99) for _ in range(rng.randint(0, 9))
            ]
            seq = Sequence("r", tokens, SamplingParams(), 0)
            kv.acquire_prefix(seq)
            if kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                kv.register_computed_blocks(seq)
                live.append(seq)
            else:
                kv.free(seq)
        elif op == "step":
            seq = rng.choice(live)
            seq.token_ids.extend(rng.randint(0, 99) for _ in range(rng.randint(1, 6)))
            if kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                kv.register_computed_blocks(seq)
        elif op == "fork":
            parent = rng.choice(live)
            child = parent.fork(1, 0)
            child.token_ids = list(parent.token_ids)
            kv.fork(parent, child)
            live.append(child)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        _check_invariants(kv, live)
    for seq in live:
        kv.free(seq)
    assert kv.pool.num_free_blocks() == kv.pool.num_blocks
