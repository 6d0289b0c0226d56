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
