"""benches/vs_llama_cpp.py without llama.cpp or a model: the measurements it plans,
the command lines of both sides, how it reads llama-bench's JSON and fastllm's
report, and a whole run against stand-ins for llama-bench and fastllm's CLI that
log what they were asked and answer with canned figures."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vs_llama_cpp", ROOT / "benches" / "vs_llama_cpp.py")
vs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("vs_llama_cpp", vs)  # dataclasses look their module up there
_spec.loader.exec_module(vs)

BASE = ["--llama-bench", "/bin/true", "--model", "/m"]


def _row(n_prompt: int, n_gen: int, ts: float, **extra) -> dict:
    row = {
        "build_commit": "abc1234",
        "build_number": 7000,
        "cpu_info": "Test CPU",
        "gpu_info": "",
        "backends": "CPU",
        "type_k": "f16",
        "type_v": "f16",
        "flash_attn": False,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": 0,
        "avg_ts": ts,
    }
    row.update(extra)
    return row


def test_default_run_plans_the_single_test_of_before():
    args = vs.parse_args(BASE)
    assert vs.plan_tests(args) == [vs.Test(128, 128)]
    assert args.fastllm_arg == [] and args.llama_arg == [] and args.depths == []


def test_prompt_lens_and_depths_plan_prefill_rows_and_decode_at_depth():
    args = vs.parse_args(
        [*BASE, "--prompt-lens", "2048", "512", "8192", "--depths", "8192", "--output-len", "32"]
    )
    tests = vs.plan_tests(args)
    # decode once, with the smallest prompt; prefill alone at the others; decode at depth
    assert tests == [vs.Test(512, 32), vs.Test(2048, 0), vs.Test(8192, 0), vs.Test(0, 32, 8192)]
    assert [t.name for t in tests] == ["pp512+tg32", "pp2048", "pp8192", "tg32@d8192"]


def test_lengths_must_be_positive():
    with pytest.raises(SystemExit):
        vs.parse_args([*BASE, "--prompt-lens", "0"])
    with pytest.raises(SystemExit):
        vs.parse_args([*BASE, "--depths", "-1"])


def test_command_lines_of_both_sides():
    args = vs.parse_args(
        [
            *BASE,
            "--threads",
            "4",
            "--fastllm-arg=--kv-cache-dtype",
            "--fastllm-arg=int8",
            "--llama-arg=-ctk",
            "--llama-arg=q8_0",
        ]
    )
    first = vs.llama_command(args, "m.gguf", vs.Test(128, 128))
    assert first == [
        "/bin/true", "-m", "m.gguf", "-t", "4", "-p", "128", "-n", "128",
        "-r", "1", "-o", "json", "-ctk", "q8_0",
    ]  # fmt: skip
    pp = vs.llama_command(args, "m.gguf", vs.Test(2048, 0))
    assert pp[pp.index("-p") + 1] == "2048" and pp[pp.index("-n") + 1] == "0"
    assert "-d" not in pp
    tg = vs.llama_command(args, "m.gguf", vs.Test(0, 32, 8192))
    assert tg[tg.index("-p") + 1 :][:5] == ["0", "-n", "32", "-d", "8192"]

    def opts(cmd):
        i = cmd.index("latency")
        return cmd[i + 1], dict(zip(cmd[i + 2 :: 2], cmd[i + 3 :: 2]))

    model, o = opts(vs.fastllm_command(args, "q8_0", "/m", vs.Test(8192, 0), "r.json"))
    assert model == "/m"
    assert o["--input-len"] == "8192" and o["--output-len"] == "1"
    assert o["--quantization"] == "q8_0" and o["--kv-cache-dtype"] == "int8"
    _, o = opts(vs.fastllm_command(args, None, "/m", vs.Test(0, 32, 8192), "r.json"))
    assert o["--input-len"] == "8192" and o["--output-len"] == "32"
    assert "--quantization" not in o


def test_llama_bench_json_rows_per_test():
    combined = json.dumps([_row(128, 0, 700.0), _row(0, 128, 50.0)])
    got = vs.parse_llama(combined, vs.Test(128, 128))
    assert got["prefill_tokens_per_s"] == 700.0 and got["decode_tokens_per_s"] == 50.0
    assert got["info"]["cpu_info"] == "Test CPU" and got["info"]["backends"] == "CPU"

    depth = json.dumps([_row(0, 32, 20.0, n_depth=8192, type_k="q8_0", flash_attn=True)])
    got = vs.parse_llama(depth, vs.Test(0, 32, 8192))
    assert got == {"decode_tokens_per_s": 20.0, "info": got["info"]}
    assert got["info"]["type_k"] == "q8_0" and got["info"]["flash_attn"] is True

    with pytest.raises(RuntimeError, match="no pp row"):
        vs.parse_llama(depth, vs.Test(512, 0))
    with pytest.raises(RuntimeError, match="no pp and tg row"):
        vs.parse_llama("[]", vs.Test(512, 32))


def test_llama_isa_fields_and_stderr_lines_are_kept():
    row = _row(64, 0, 1.0, avx512="1", avx512_vnni="1", fma="1")
    stderr = "load_backend: loaded CPU backend from libggml-cpu-icelake.so\nother line\n"
    info = vs.llama_info(row, stderr)
    assert info["isa_fields"] == {"avx512": "1", "avx512_vnni": "1", "fma": "1"}
    assert info["stderr_isa"] == ["load_backend: loaded CPU backend from libggml-cpu-icelake.so"]
    text = vs.describe_llama(info)
    assert "cpu_info 'Test CPU'" in text and "avx512_vnni=1" in text and "icelake" in text


def test_llama_build_flags_come_from_its_cmake_cache(tmp_path):
    """An AVX2-only build (benches/build_llama_cpp.sh with LLAMA_ISA=avx2) is named
    as such: the ISA switches of the CMake cache beside the binary's bin folder."""
    (tmp_path / "bin").mkdir()
    bench = tmp_path / "bin" / "llama-bench"
    assert vs.llama_build_flags(str(bench)) == {}
    (tmp_path / "CMakeCache.txt").write_text(
        "GGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\n"
        "GGML_CUDA:BOOL=OFF\nCMAKE_BUILD_TYPE:STRING=Release\n"
    )
    flags = vs.llama_build_flags(str(bench))
    assert flags == {"GGML_NATIVE": "OFF", "GGML_AVX2": "ON", "GGML_AVX512": "OFF"}
    info = vs.llama_info(_row(64, 0, 1.0))
    info["build_flags"] = flags
    assert "llama.cpp built with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF" in (
        vs.describe_llama(info)
    )
    # a native build ignores the per-ISA switches
    (tmp_path / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\nGGML_AVX512:BOOL=OFF\n")
    assert vs.llama_build_flags(str(bench)) == {"GGML_NATIVE": "ON"}


def test_fastllm_report_and_env():
    report = {
        "results": [
            {
                "prefill_tokens_per_s": 300.0,
                "decode_tokens_per_s": 0.0,
                "time_to_first_token_s": 6.8,
            }
        ],
        "bandwidth_gbs": 40.0,
    }
    got = vs.parse_fastllm(report, vs.Test(2048, 0))
    assert got["prefill_tokens_per_s"] == 300.0 and "decode_tokens_per_s" not in got
    got = vs.parse_fastllm(report, vs.Test(0, 32, 8192))
    assert got["decode_tokens_per_s"] == 0.0 and "prefill_tokens_per_s" not in got

    env = vs.summarize_fastllm_env(
        {
            "fastllm_version": "0.1.0",
            "cpu": "Test CPU",
            "cpu_features": {"avx2": True, "avx512f": True, "amx_tile": False},
            "num_threads": 2,
            "gemm_path": "avx512",
            "quant_path": "avx512vnni",
            "quant_formats": ["q8_0"],
        }
    )
    assert env["float_gemm_path"] == "avx512" and env["int_gemm_path"] == "avx512vnni"
    assert env["attention_path"] == "avx512" and env["cpu_features"] == ["avx2", "avx512f"]
    line = vs.describe_fastllm(env)
    assert "float GEMM avx512, integer GEMM avx512vnni, attention avx512" in line
    # Attention's own path where the report has it (``FASTLLM_CPU_SIMD_PATH``).
    env = vs.summarize_fastllm_env({"gemm_path": "avx512bf16", "simd_path": "avx2"})
    assert env["float_gemm_path"] == "avx512bf16" and env["attention_path"] == "avx2"


def test_table_keeps_its_columns_for_one_length(capsys):
    row = {"format": "q8_0", "llama_pp": 1.0, "fastllm_pp": 2.0, "pp_ratio": 2.0}
    vs.print_table([row])
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[:2] == ["format", "llama.cpp"] and "prompt" not in head
    vs.print_table([{**row, "prompt_len": 512, "depth": None}], extended=True)
    head, line = capsys.readouterr().out.splitlines()
    assert head.split()[:3] == ["format", "prompt", "depth"]
    assert line.split()[:4] == ["q8_0", "512", "-", "1.00"]


# Stand-ins: llama-bench answers pp = 1000 / P * 100 and tg = 50 - D / 1000 tokens/s;
# fastllm's CLI (run as `PYTHON -c CODE ...`) answers `env --json` and `bench latency`.
FAKE_LLAMA = """\
    import json, os, sys
    a = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(["llama", *a]) + "\\n")
    opt = lambda k, d=0: int(a[a.index(k) + 1]) if k in a else d
    p, n, d = opt("-p"), opt("-n"), opt("-d")
    rows = []
    base = dict(build_commit="abc", build_number=1, cpu_info="Fake CPU", backends="CPU",
                type_k="f16", type_v="f16", flash_attn=False, n_depth=d)
    if p:
        rows.append(dict(base, n_prompt=p, n_gen=0, avg_ts=1000 / p * 100))
    if n:
        rows.append(dict(base, n_prompt=0, n_gen=n, avg_ts=50 - d / 1000))
    print(json.dumps(rows))
"""
FAKE_PYTHON = """\
    import json, os, sys
    a = sys.argv[3:]  # after -c CODE
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(["fastllm", *a]) + "\\n")
    if a[0] == "env":
        print(json.dumps({"fastllm_version": "0", "cpu": "Fake CPU", "num_threads": 2,
                          "cpu_features": {"avx2": True}, "gemm_path": "avx2",
                          "quant_path": "avx2", "quant_formats": ["q8_0"]}))
        sys.exit(0)
    opt = lambda k: int(a[a.index(k) + 1])
    p, n = opt("--input-len"), opt("--output-len")
    res = {"prefill_tokens_per_s": 2000 / p * 100, "decode_tokens_per_s": 60 - p / 1000,
           "time_to_first_token_s": p / 2000}
    with open(a[a.index("--json") + 1], "w") as f:
        json.dump({"results": [res]}, f)
"""


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_whole_run_against_stand_ins(tmp_path, monkeypatch, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    (tmp_path / "model").mkdir()
    (tmp_path / "m-q8_0.gguf").write_bytes(b"")
    args = [
        "--llama-bench",
        _script(tmp_path / "llama-bench", FAKE_LLAMA),
        "--python",
        _script(tmp_path / "python", FAKE_PYTHON),
        "--model",
        str(tmp_path / "model"),
        "--gguf-dir",
        str(tmp_path),
        "--formats",
        "q8_0",
        "--repeats",
        "1",
        "--no-bandwidth",
        "--prompt-lens",
        "512",
        "2048",
        "--depths",
        "8192",
        "--output-len",
        "16",
        "--fastllm-arg=--kv-cache-dtype",
        "--fastllm-arg=int8",
        "--json",
        str(tmp_path / "out.json"),
    ]
    assert vs.main(args) == 0
    out = capsys.readouterr().out
    assert "fastllm 0 paths: float GEMM avx2, integer GEMM avx2, attention avx2" in out
    assert "cpu_info 'Fake CPU'" in out
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    fastllm_runs = [c for c in calls if c[0] == "fastllm" and c[1] == "bench"]
    assert len(fastllm_runs) == 3 and all("--kv-cache-dtype" in c for c in fastllm_runs)
    assert sum(c[0] == "llama" for c in calls) == 3

    report = json.loads((tmp_path / "out.json").read_text())
    assert report["prompt_lens"] == [512, 2048] and report["depths"] == [8192]
    assert report["fastllm_env"]["int_gemm_path"] == "avx2"
    assert report["llama_isa"]["cpu_info"] == "Fake CPU"
    rows = {r["test"]: r for r in report["rows"]}
    assert list(rows) == ["pp512+tg16", "pp2048", "tg16@d8192"]
    assert rows["pp512+tg16"]["llama_pp"] == pytest.approx(1000 / 512 * 100)
    assert rows["pp512+tg16"]["pp_ratio"] == pytest.approx(2.0)
    assert rows["pp512+tg16"]["llama_tg"] == 50.0
    assert rows["pp2048"]["fastllm_pp"] == pytest.approx(2000 / 2048 * 100)
    assert rows["pp2048"]["llama_tg"] is None and rows["pp2048"]["fastllm_tg"] is None
    depth = rows["tg16@d8192"]
    assert depth["llama_pp"] is None and depth["depth"] == 8192
    assert depth["llama_tg"] == pytest.approx(50 - 8.192)
    assert depth["fastllm_tg"] == pytest.approx(60 - 8.192)
    assert os.path.basename(depth["gguf"]) == "m-q8_0.gguf"
