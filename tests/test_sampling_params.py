import pytest

from fastllm import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -3),
        ("seed", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("temperature", float("nan")),
        ("n", 1.5),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_defaults_and_greedy():
    sp = SamplingParams()
    assert sp.max_tokens == 16 and sp.n == 1 and sp.temperature == 1.0 and not sp.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x")._stop_list == ["x"]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
