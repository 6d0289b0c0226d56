"""`fastllm bench` runs both workloads, side by side with transformers, and writes its figures."""

import json

import pytest

pytest.importorskip("transformers")

from fastllm.cli import main


def test_bench_throughput_and_latency_json(make_model, tmp_path):
    folder = make_model("llama")
    out = tmp_path / "tp.json"
    args = ["--input-len", "8", "--output-len", "4", "--dtype", "float32", "--device", "cpu"]
    assert (
        main(
            [
                "bench",
                "throughput",
                folder,
                "--num-prompts",
                "4",
                "--batch",
                "2",
                *args,
                "--compare",
                "transformers",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    engines = [r["engine"] for r in report["results"]]
    assert engines == ["fastllm", "transformers"]
    for r in report["results"]:
        assert r["output_tokens_per_s"] > 0 and r["num_prompts"] == 4
    assert report["ratio"] == pytest.approx(
        report["results"][0]["output_tokens_per_s"] / report["results"][1]["output_tokens_per_s"]
    )
    lat = tmp_path / "lat.json"
    assert main(["bench", "latency", folder, "--num-iters", "1", *args, "--json", str(lat)]) == 0
    (r,) = json.loads(lat.read_text())["results"]
    assert r["decode_tokens_per_s"] > 0 and r["time_to_first_token_s"] > 0
    assert len(r["decode_token_times_s"]) == 3


@pytest.mark.parametrize(
    ("checkpoint", "dtype", "elem"),
    [
        ("bfloat16", "float32", 2),  # packed as bf16 (the values are bf16)
        ("bfloat16", "bfloat16", 2),
        ("float32", "float32", 4),
        ("float16", "float32", 4),
        ("float32", "bfloat16", 2),
    ],
)
def test_decode_bound_counts_the_bytes_the_engine_packs(tmp_path, checkpoint, dtype, elem):
    """The bound reads each float matrix at the bytes the engine keeps it in:
    a bf16 checkpoint run in float32 keeps bf16 weights."""
    import argparse
    import json

    from fastllm.benchmark import weight_bytes_per_token

    h, inter, layers, vocab = 64, 96, 2, 100
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "torch_dtype": checkpoint,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = argparse.Namespace(dtype=dtype, quantization=None)
    weights = layers * (h * (64 + 2 * 32) + 64 * h + 3 * h * inter) + vocab * h
    assert weight_bytes_per_token(str(tmp_path), args) == elem * weights


def test_decode_bound_counts_mxfp4_experts_as_stored(tmp_path):
    """The bandwidth bound of a gpt-oss folder whose experts are MXFP4 reads
    them at 18/32 bytes a weight (as the kernel holds them), the other
    matrices at the float dtype or ``quantization``'s format."""
    import argparse
    import json

    from fastllm.benchmark import weight_bytes_per_token

    h, inter, layers, experts, top, vocab = 64, 32, 2, 8, 2, 100
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": experts,
        "num_experts_per_tok": top,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = argparse.Namespace(dtype="bfloat16", quantization=None)
    attention = layers * (h * (64 + 2 * 32) + 64 * h)
    mlp = layers * (top * 3 * h * inter + h * experts)
    assert weight_bytes_per_token(str(tmp_path), args) == 2 * (attention + vocab * h + mlp)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = 2 * (attention + vocab * h) + mlp * 18 / 32
    assert weight_bytes_per_token(str(tmp_path), args) == int(want)
    args.quantization = "int8"
    want = 34 / 32 * (attention + vocab * h) + mlp * 18 / 32
    assert weight_bytes_per_token(str(tmp_path), args) == int(want)
