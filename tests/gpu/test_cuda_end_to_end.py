"""End to end on a tiny float32 model: the CUDA path gives the CPU path's tokens.

Skipped without a GPU. Greedy decoding must agree token for token; a seeded
sampled request must draw the same tokens on both devices (same counter-based
randomness; float32 logits from the two devices agree to ~1e-6, far below
the gaps a draw could be sensitive to on this small vocabulary).
"""

from __future__ import annotations

import pytest

import fastllm

pytestmark = pytest.mark.skipif(
    not fastllm.cuda_available(), reason="no usable CUDA GPU (fastllm.cuda_available() is false)"
)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def", "x = 1"]


@pytest.fixture(scope="module")
def llms(make_model):
    from fastllm import LLM

    folder = make_model("llama")
    cpu = LLM(folder, device="cpu", dtype="float32")
    cuda = LLM(folder, device="cuda", dtype="float32")
    return cpu, cuda


def tokens_of(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_cuda_kernels_are_used(llms):
    from fastllm.layers import cuda_ops

    _, cuda = llms
    cuda.generate(["hello"], fastllm.SamplingParams(max_tokens=2), use_tqdm=False)
    assert cuda_ops.enabled(), cuda_ops.disabled_reason()


def test_greedy_tokens_equal(llms):
    from fastllm import SamplingParams

    cpu, cuda = llms
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert tokens_of(cuda.generate(PROMPTS, params, use_tqdm=False)) == tokens_of(
        cpu.generate(PROMPTS, params, use_tqdm=False)
    )


def test_seeded_sampling_tokens_equal(llms):
    from fastllm import SamplingParams

    cpu, cuda = llms
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.7, repetition_penalty=1.2, seed=3, max_tokens=20, ignore_eos=True
        ),
    ]
    prompts = PROMPTS[:3]
    assert tokens_of(cuda.generate(prompts, params, use_tqdm=False)) == tokens_of(
        cpu.generate(prompts, params, use_tqdm=False)
    )


def test_constrained_tokens_equal_and_validate(llms):
    # The CUDA path gets its grammar masks as a bitmask computed during the
    # forward pass; the tokens must be the CPU path's, and the outputs valid.
    import json
    import re

    from fastllm import SamplingParams, StructuredOutputsParams

    cpu, cuda = llms
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    params = (
        [
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=60,
                structured_outputs=StructuredOutputsParams(
                    json=schema, disable_any_whitespace=True
                ),
            )
            for s in range(8)
        ]
        + [
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=20,
                structured_outputs=StructuredOutputsParams(regex="[a-c]{2}-[0-9]{3}"),
            )
            for s in range(4)
        ]
        + [SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)]
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    got = cuda.generate(prompts, params, use_tqdm=False)
    assert tokens_of(got) == tokens_of(cpu.generate(prompts, params, use_tqdm=False))
    for o in got[:8]:
        assert set(json.loads(o.outputs[0].text)) == {"n", "ok"}
    for o in got[8:12]:
        assert re.fullmatch("[a-c]{2}-[0-9]{3}", o.outputs[0].text)
