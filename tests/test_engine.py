"""End-to-end engine tests against transformers on the same weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastllm import LLM, SamplingParams, _core  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import os\nimport sys\n",
    "Return the number of",
    "class Foo:\n    def __init__(self):",
    "x",
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def hf_greedy(folder: str, prompt_ids: list[int], n: int):
    """transformers' greedy tokens and raw-logit logprobs of each chosen token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    toks = out.sequences[0, len(prompt_ids) :].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


@pytest.fixture(scope="module")
def llama(make_model):
    folder = make_model("llama")
    return folder, LLM(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_matches_transformers(make_model, arch):
    folder = make_model(arch)
    llm = LLM(folder, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        ref, ref_lps = hf_greedy(folder, ids, 12)
        (out,) = llm.generate([prompt], greedy(12, logprobs=0), use_tqdm=False)
        c = out.outputs[0]
        assert c.token_ids == ref, (arch, prompt)
        # float32 on both sides: per-token logprobs agree to 1e-4 (absolute)
        got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert got == pytest.approx(ref_lps, abs=1e-4)


def test_bfloat16_close_to_transformers(make_model):
    folder = make_model("llama")
    llm = LLM(folder, dtype="bfloat16", device="cpu")
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    ref, _ = hf_greedy(folder, ids, 8)
    (out,) = llm.generate([{"prompt_token_ids": ids}], greedy(8), use_tqdm=False)
    # bfloat16 rounding can flip near-ties: the first tokens must agree, and
    # at least 6 of 8 overall.
    got = out.outputs[0].token_ids
    assert got[:2] == ref[:2]
    assert sum(a == b for a, b in zip(got, ref)) >= 6


def test_batch_invariance(llama):
    folder, llm = llama
    tok = llm.get_tokenizer()
    prompts = [(PROMPTS[i % len(PROMPTS)] + " word" * (i % 7)) for i in range(32)]
    alone = llm.generate([prompts[5]], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone
    assert [o.prompt for o in batch] == prompts
    assert batch[0].prompt_token_ids == tok.encode(prompts[0])


def test_preemption_gives_same_outputs(make_model):
    folder = make_model("llama")
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(8)]
    ref = LLM(folder, dtype="float32", device="cpu").generate(prompts, greedy(40), use_tqdm=False)
    small = LLM(
        folder,
        dtype="float32",
        device="cpu",
        block_size=8,
        max_model_len=128,
        # 24 blocks of 2 layers x (K, V) x 2 heads x 16 dims x 8 tokens x 4 bytes
        kv_cache_memory_bytes=24 * 4096,
    )
    got = small.generate(prompts, greedy(40), use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_prefix_caching(make_model):
    folder = make_model("llama")
    prefix = "def function(a, b):\n    return a + b\n" * 4
    prompts = [prefix + s for s in ["x = 1", "y = 2", "print(z)"]]
    on = LLM(folder, dtype="float32", device="cpu", enable_prefix_caching=True)
    off = LLM(folder, dtype="float32", device="cpu", enable_prefix_caching=False)
    first = on.generate(prompts[:1], greedy(8), use_tqdm=False)
    second = on.generate(prompts, greedy(8), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens > 0 for o in second)
    ref = off.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in ref]
    assert all(o.num_cached_tokens == 0 for o in ref)


def test_seeded_sampling_is_batch_independent(llama):
    _, llm = llama
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(
        PROMPTS, [SamplingParams(temperature=1.0, max_tokens=5)] * 3 + [sp] * 3, use_tqdm=False
    )
    others = [PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    in_batch = llm.generate([*others, PROMPTS[0]], [sp] * 4, use_tqdm=False)[3].outputs[0]
    assert in_batch.token_ids == alone.token_ids and in_batch.text == alone.text
    assert mixed[3].outputs[0].token_ids != [] and len(mixed) == len(PROMPTS)


def test_n_children_use_consecutive_seeds(llama):
    _, llm = llama
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(n=3, seed=77, **base), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        (single,) = llm.generate([PROMPTS[1]], SamplingParams(seed=77 + i, **base), use_tqdm=False)
        assert c.token_ids == single.outputs[0].token_ids


def test_stop_strings_and_token_ids(llama):
    _, llm = llama
    (ref,) = llm.generate([PROMPTS[0]], greedy(30), use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[10:13]
    assert len(stop) == 3
    (cut,) = llm.generate([PROMPTS[0]], greedy(30, stop=[stop]), use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    (kept,) = llm.generate(
        [PROMPTS[0]], greedy(30, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    tok_stop = ref.outputs[0].token_ids[5]
    first = ref.outputs[0].token_ids.index(tok_stop)
    (t,) = llm.generate([PROMPTS[0]], greedy(30, stop_token_ids=[tok_stop]), use_tqdm=False)
    assert t.outputs[0].token_ids == ref.outputs[0].token_ids[: first + 1]
    assert t.outputs[0].stop_reason == tok_stop
    (m,) = llm.generate(
        [PROMPTS[0]], greedy(30, stop_token_ids=[tok_stop], min_tokens=first + 2), use_tqdm=False
    )
    assert len(m.outputs[0].token_ids) >= first + 2
    assert tok_stop not in m.outputs[0].token_ids[: first + 2]


def test_eos_and_ignore_eos(llama):
    _, llm = llama
    eos = next(iter(llm.llm_engine.eos_token_ids))
    sp = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[])
    # Force EOS by making it a stop criterion through logits: a prompt ending in
    # EOS is not needed; instead check that ignore_eos keeps going to max_tokens.
    (o,) = llm.generate([PROMPTS[2]], greedy(20), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 20 and o.outputs[0].finish_reason == "length"
    (d,) = llm.generate([PROMPTS[2]], sp, use_tqdm=False)
    toks = d.outputs[0].token_ids
    if eos in o.outputs[0].token_ids:
        assert toks[-1] == eos and d.outputs[0].finish_reason == "stop"
    else:
        assert toks == o.outputs[0].token_ids


def test_logprobs_and_prompt_logprobs(make_model, llama):
    folder, llm = llama
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[4])
    (o,) = llm.generate([PROMPTS[4]], greedy(4, logprobs=3, prompt_logprobs=2), use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    pl = o.prompt_logprobs
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        entry = pl[i][ids[i]]
        assert entry.logprob == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        assert entry.rank == int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1
        assert len(pl[i]) in (2, 3)
        top_v, top_i = lp[i - 1].topk(2)
        for k in range(2):
            got = pl[i][int(top_i[k])]
            assert got.logprob == pytest.approx(top_v[k].item(), abs=1e-4)
            assert got.rank == k + 1 or int(top_i[k]) == ids[i]
    for step in o.outputs[0].logprobs:
        assert len(step) in (3, 4)
        chosen = [lp_.rank for lp_ in step.values()]
        assert 1 in chosen


def test_chat_template(llama):
    _, llm = llama
    msgs = [{"role": "user", "content": "Hello there"}]
    (o,) = llm.chat(msgs, greedy(5), use_tqdm=False)
    expected = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert o.prompt == expected
    assert o.prompt_token_ids == llm.get_tokenizer().encode(expected, add_special_tokens=False)
    (g,) = llm.generate([{"prompt_token_ids": o.prompt_token_ids}], greedy(5), use_tqdm=False)
    assert g.outputs[0].token_ids == o.outputs[0].token_ids


def test_stream_equals_generate(llama):
    _, llm = llama
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=15, ignore_eos=True)
    (g,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    chunks = list(llm.stream(PROMPTS[0], sp))
    assert chunks[-1].finished
    text = "".join(c.outputs[0].text for c in chunks if c.outputs)
    toks = [t for c in chunks if c.outputs for t in c.outputs[0].token_ids]
    assert toks == g.outputs[0].token_ids and text == g.outputs[0].text
    assert len(chunks) > 1


def test_prompt_too_long_names_request(make_model):
    folder = make_model("llama")
    llm = LLM(folder, dtype="float32", device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match=r"prompt 1: .*40 tokens.*max_model_len=32"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3] * 40}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_finish_reason_length_at_max_model_len(make_model):
    folder = make_model("llama")
    llm = LLM(folder, dtype="float32", device="cpu", max_model_len=20)
    prompt = {"prompt_token_ids": list(range(3, 18))}
    unlimited = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (o,) = llm.generate([prompt], unlimited, use_tqdm=False)
    assert o.outputs[0].finish_reason == "length"
    assert len(o.outputs[0].token_ids) == 5
    # The rotary table covers the positions a sequence can reach, no more
    # (the last token above ran at position 19).
    assert llm.llm_engine.runner.model.rotary.table_positions == 20
    # Asking for more than the context holds is an error naming max_tokens, as
    # the server's 400 (one rule in both places).
    with pytest.raises(ValueError, match=r"prompt 0: .*max_tokens=50 asks for 65 in all"):
        llm.generate([prompt], greedy(50), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_device_errors_come_before_weights(make_model, monkeypatch, tmp_path):
    folder = make_model("llama")
    monkeypatch.setenv("FASTLLM_DEVICE", "cpu")
    with pytest.raises(ValueError, match="CUDA device requested but no GPU available: "):
        LLM(folder, device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 when device is 'cpu'"):
        LLM(folder, device="cpu", tensor_parallel_size=2)
    # an unreadable weights file proves no weights were read before the device error
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((__import__("pathlib").Path(folder) / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="CUDA device requested"):
        LLM(str(broken), device="cuda")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(broken), device="cpu")


def test_bad_model_folders(tmp_path):
    with pytest.raises(ValueError, match="model folder not found"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    with pytest.raises((ValueError, FileNotFoundError)):
        LLM(str(tmp_path), device="cpu")


def test_request_output_repr_and_html(llama):
    _, llm = llama
    (o,) = llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert repr(o).startswith("RequestOutput(request_id=") and "CompletionOutput(" in repr(o)
    assert "<table>" in o._repr_html_()


@pytest.mark.parametrize("mode", ["rust", "torch"])
def test_cpu_gemm_modes_match_transformers(make_model, monkeypatch, mode):
    """Packed Rust linears (the CPU default) and torch's give transformers'
    greedy tokens and logprobs; the packed model really runs packed."""
    monkeypatch.setenv("FASTLLM_CPU_GEMM", mode)
    folder = make_model("qwen2")
    llm = LLM(folder, dtype="float32", device="cpu")
    model = llm.llm_engine.runner.model
    layers = [m for m in model.modules() if m.__class__.__name__ == "Linear"]
    packed = [m.packed is not None for m in layers]
    assert all(packed) if mode == "rust" else not any(packed)
    assert (getattr(model, "packed_head", None) is not None) == (mode == "rust")
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    ref, ref_lps = hf_greedy(folder, ids, 10)
    (out,) = llm.generate([{"prompt_token_ids": ids}], greedy(10, logprobs=0), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ref
    got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
    assert got == pytest.approx(ref_lps, abs=1e-4)


def test_cpu_gemm_mode_is_validated(monkeypatch):
    from fastllm.layers.linear import should_pack

    monkeypatch.setenv("FASTLLM_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="FASTLLM_CPU_GEMM='fast'"):
        should_pack("cpu", torch.float32)


@pytest.mark.parametrize("path", _core.gemm_paths())
def test_cpu_gemm_path_switch_packs_every_linear_on_that_path(make_model, monkeypatch, path):
    """``FASTLLM_CPU_GEMM_PATH`` names the float GEMM's path for every packed
    linear and the head (MoE routers pack through the same helper); unset,
    the CPU's default."""
    monkeypatch.setenv("FASTLLM_CPU_GEMM_PATH", path)
    llm = LLM(make_model("qwen2"), dtype="bfloat16", device="cpu")
    model = llm.llm_engine.runner.model
    packed = [m.packed for m in model.modules() if m.__class__.__name__ == "Linear"]
    assert packed and {p.path for p in [*packed, model.packed_head]} == {path}
    (out,) = llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    from fastllm.env_report import collect_env, format_env

    # `fastllm env` names the path the switch chose, as the layers run it.
    assert f"(f32/bf16 linear layers): {path}\n" in format_env(collect_env())
    monkeypatch.delenv("FASTLLM_CPU_GEMM_PATH")
    from fastllm.layers.linear import packed_linear

    assert packed_linear(torch.ones(3, 4), None).path == _core.gemm_default_path()


def test_cpu_gemm_path_switch_is_validated(monkeypatch):
    from fastllm.layers.linear import packed_linear

    monkeypatch.setenv("FASTLLM_CPU_GEMM_PATH", "avx1024")
    with pytest.raises(ValueError, match="FASTLLM_CPU_GEMM_PATH='avx1024'.*unknown"):
        packed_linear(torch.ones(3, 4), None)
    from fastllm.env_report import collect_env, format_env

    assert "FASTLLM_CPU_GEMM_PATH='avx1024' names no path" in format_env(collect_env())


def _greedy_in_fresh_process(switch, path, path_of, folder, ids, quantizations):
    """Greedy tokens and their logprobs (10 of them, float32 activations) for
    each of ``quantizations`` (None: float weights), in a fresh process with
    the switch ``switch`` (read once per process) set to ``path``; with the
    path ``_core.<path_of>()`` reports there and ``fastllm env``'s text."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from fastllm import LLM, SamplingParams, _core\n"
        "from fastllm.env_report import collect_env, format_env\n"
        "p = SamplingParams(temperature=0, max_tokens=10, logprobs=0)\n"
        "seen = {}\n"
        "for q in json.loads(sys.argv[3]):\n"
        "    llm = LLM(sys.argv[1], dtype='float32', device='cpu', quantization=q)\n"
        "    (o,) = llm.generate([{'prompt_token_ids': json.loads(sys.argv[2])}], p,"
        " use_tqdm=False)\n"
        "    c = o.outputs[0]\n"
        "    seen[str(q)] = [c.token_ids, [c.logprobs[i][t].logprob for i, t in"
        " enumerate(c.token_ids)]]\n"
        f"print(json.dumps([_core.{path_of}(), seen, format_env(collect_env())]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, folder, json.dumps(ids), json.dumps(quantizations)],
        env={**os.environ, switch: path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "path", [p for p in _core.gemm_paths() if p in ("scalar", "avx2", "avx512")]
)
def test_cpu_simd_path_switch_runs_the_model_on_that_path(make_model, path):
    """``FASTLLM_CPU_SIMD_PATH`` (read once per process, so in a fresh one)
    puts attention, sampling, norms and activations on the named path: the
    process reports it, and greedy tokens and logprobs equal transformers'."""
    folder = make_model("qwen2")
    ids = LLM(folder, device="cpu").get_tokenizer().encode(PROMPTS[1])
    got_path, seen, report = _greedy_in_fresh_process(
        "FASTLLM_CPU_SIMD_PATH", path, "simd_path", folder, ids, [None]
    )
    tokens, lps = seen["None"]
    assert got_path == path
    assert f"norms and activations: {path}" in report
    ref, ref_lps = hf_greedy(folder, ids, 10)
    assert tokens == ref
    assert lps == pytest.approx(ref_lps, abs=1e-4)


def test_cpu_simd_path_switch_is_validated(make_model, monkeypatch):
    folder = make_model("qwen2")
    monkeypatch.setenv("FASTLLM_CPU_SIMD_PATH", "avx1024")
    with pytest.raises(ValueError, match='FASTLLM_CPU_SIMD_PATH="avx1024": unknown path'):
        _core.simd_path()
    with pytest.raises(ValueError, match="FASTLLM_CPU_SIMD_PATH"):
        LLM(folder, device="cpu")
    # avx512bf16 names a GEMM path, not one of these kernels' paths.
    monkeypatch.setenv("FASTLLM_CPU_SIMD_PATH", "avx512bf16")
    with pytest.raises(ValueError, match="unknown path"):
        _core.simd_path()


@pytest.mark.parametrize("path", _core.quant_paths())
def test_cpu_int_path_switch_runs_quantized_models_on_that_path(make_model, path):
    """``FASTLLM_CPU_INT_PATH`` (read once per process, so in a fresh one)
    puts every quantized layer on the named integer path: the process
    reports it, and its int8 and int4 greedy tokens and logprobs are those
    of this process's default path (the integer sums are exact on every
    path, the float steps after them the same)."""
    folder = make_model("qwen2")
    ids = LLM(folder, device="cpu").get_tokenizer().encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    got_path, seen, report = _greedy_in_fresh_process(
        "FASTLLM_CPU_INT_PATH", path, "quant_default_path", folder, ids, ["int8", "int4"]
    )
    assert got_path == path
    assert f"GGUF files): {path} (" in report
    for q in ("int8", "int4"):
        llm = LLM(folder, dtype="float32", device="cpu", quantization=q)
        (o,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        c = o.outputs[0]
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert seen[q][0] == c.token_ids, (path, q)
        assert seen[q][1] == pytest.approx(lps, abs=1e-4), (path, q)


def test_cpu_int_path_switch_is_validated(make_model, monkeypatch):
    folder = make_model("qwen2")
    monkeypatch.setenv("FASTLLM_CPU_INT_PATH", "avx1024")
    with pytest.raises(ValueError, match='FASTLLM_CPU_INT_PATH="avx1024": unknown quantized'):
        _core.quant_default_path()
    with pytest.raises(ValueError, match="FASTLLM_CPU_INT_PATH"):
        LLM(folder, device="cpu")


def test_interrupted_generation_returns_blocks_cut_off_from_their_sequence(llama, monkeypatch):
    """A Ctrl-C between a block's allocation and its sequence's block table
    (simulated: the allocation raises KeyboardInterrupt after taking blocks)
    leaves no block held once generate has raised."""
    _, llama = llama
    engine = llama.llm_engine
    total = engine.kv.num_free_blocks
    pool = engine.kv.pool
    real = pool.allocate_many
    calls = {"n": 0}

    class Pool:
        """The engine's pool, whose third allocation is interrupted after it took its blocks."""

        def __getattr__(self, name):
            return getattr(pool, name)

        def allocate_many(self, n):
            calls["n"] += 1
            got = real(n)
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return got

    monkeypatch.setattr(engine.kv, "pool", Pool())
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llama.generate(["def f(x):", "import os", "class A:"], params, use_tqdm=False)
    assert calls["n"] >= 3
    assert engine.kv.num_free_blocks == total
    assert not engine.has_unfinished_requests()
    assert llama.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs


def test_prompt_longer_than_a_step_alone(make_model):
    """A prompt longer than max_num_batched_tokens, alone: its first steps
    prefill chunks and sample nothing; the tokens equal one-step prefill."""
    folder = make_model("llama")
    ids = list(range(5, 300))
    whole = LLM(folder, dtype="float32", device="cpu")
    chunked = LLM(folder, dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    want = whole.generate([{"prompt_token_ids": ids}], greedy(6), use_tqdm=False)
    got = chunked.generate([{"prompt_token_ids": ids}], greedy(6), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
