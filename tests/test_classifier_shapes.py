"""Every decoder family that transformers builds as ``...ForSequenceClassification``,
at drawn shapes (``test_model_shapes``' generator), against transformers:
the score head's logits on the last token of each input, inputs of mixed
lengths in one call, float32."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_model_shapes import draw_config  # noqa: E402
from test_models import VOCAB, _one_thread, _randomize, _sequences  # noqa: E402, F401

transformers.logging.set_verbosity_error()

# the families transformers has a sequence-classification class for
FAMILIES = [
    "llama", "qwen3", "mistral", "phi3", "olmo2", "smollm3", "gemma2", "gemma3",
    "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "qwen3_5",
]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_classifiers_score_as_transformers(tmp_path, family: str, seed: int) -> None:
    from fastllm import LLM, PoolingParams

    rng = random.Random(f"{family}-classifier-{seed}")
    config = draw_config(family, rng)
    config.num_labels = rng.choice([1, 2, 5])
    config.pad_token_id = 0  # the inputs hold no 0: the head reads each one's last token
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager"
    )
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(str(tmp_path))
    prompts = [[1 + t % (VOCAB - 1) for t in p] for p in _sequences(4 + seed, [9, 2, 17, 5])]
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    outs = llm.classify(
        [{"prompt_token_ids": p} for p in prompts],
        pooling_params=PoolingParams(activation=False),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt])).logits[0]
        got = torch.tensor(out.outputs.probs)
        assert got.shape == want.shape, (family, config.to_dict())
        assert (got - want).abs().max() <= 1e-4, (family, got, want, config.to_dict())
    with pytest.raises(ValueError, match="has no tokenizer"):  # skip_tokenizer_init: ids only
        llm.classify(["a text"], use_tqdm=False)
