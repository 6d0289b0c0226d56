"""The CUDA probe against a fake driver built from tests/fake_cuda.c.

Every probe that touches a driver runs in a fresh ``python -c`` process,
because results are cached per process; the test then checks that this
process survived and that the report matches what the fake driver is written
to return (see the comment at the top of fake_cuda.c).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_SRC = Path(__file__).resolve().parent / "fake_cuda.c"
GiB = 1 << 30

# Variables the probe reads; cleared so the outer environment cannot leak in.
PROBE_VARS = (
    "FASTLLM_DEVICE",
    "CUDA_VISIBLE_DEVICES",
    "FASTLLM_LIBCUDA",
    "FASTLLM_PROBE_TIMEOUT",
    "FAKE_CUDA_MODE",
    "FAKE_CUDA_DEVICES",
    "FAKE_CUDA_MARKER",
)


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> dict[str, Path]:
    """Compiles the fake driver, and a variant without cuInit, with the system C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler (cc) is needed to build the fake CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    libs = {"fake": out / "libfakecuda.so", "no_cuinit": out / "libfakecuda_noinit.so"}
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", libs["fake"], FAKE_SRC], check=True)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-DFAKE_NO_CUINIT", "-o", libs["no_cuinit"], FAKE_SRC],
        check=True,
    )
    return libs


def child_env(**extra: str | os.PathLike) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROBE_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "python"), env.get("PYTHONPATH")) if p
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


REPORT_SCRIPT = """
import json, sys
import fastllm
from fastllm import _core
r = fastllm.probe()
lib = sys.argv[1]
maps = open("/proc/self/maps").read()
print(json.dumps({
    "available": r.available,
    "device_count": r.device_count,
    "devices": [[d.index, d.name, d.total_memory, list(d.compute_capability)] for d in r.devices],
    "driver_version": r.driver_version,
    "library": r.library,
    "reason": r.reason,
    "api_device_count": fastllm.device_count(),
    "api_cuda_available": fastllm.cuda_available(),
    "core_device_count": _core.get_device_count(),
    "lib_mapped_in_parent": lib in maps,
    "repr": repr(r),
}))
"""


def run_probe(lib: Path | str, **env: str) -> dict:
    """Probes in a fresh interpreter with FASTLLM_LIBCUDA=lib; asserts it survived."""
    proc = subprocess.run(
        [sys.executable, "-c", REPORT_SCRIPT, str(lib)],
        env=child_env(FASTLLM_LIBCUDA=lib, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"the probing process died: {proc.returncode}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # The parent never maps the driver during a probe: the child does.
    assert not out["lib_mapped_in_parent"]
    assert out["api_device_count"] == out["device_count"] == out["core_device_count"]
    assert out["api_cuda_available"] == out["available"]
    return out


def expected_device(i: int) -> list:
    return [i, f"Fake GPU {i}", (i + 1) * 16 * GiB, [9, 0] if i % 2 == 0 else [8, 6]]


def test_devices_ok(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="ok", FAKE_CUDA_DEVICES="3")
    assert r["available"] is True
    assert r["device_count"] == 3
    assert r["devices"] == [expected_device(i) for i in range(3)]
    assert r["driver_version"] == 12040
    assert Path(r["library"]).resolve() == fake_libs["fake"].resolve()
    assert r["reason"] is None
    assert "Fake GPU 2" in r["repr"] and "driver=12.4" in r["repr"]


def test_zero_devices(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="zero")
    assert (r["available"], r["device_count"], r["devices"]) == (False, 0, [])
    assert "cuDeviceGetCount returned 0" in r["reason"]
    assert r["driver_version"] == 12040


def test_cuinit_no_device(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="no_device")
    assert (r["available"], r["device_count"]) == (False, 0)
    assert r["reason"].startswith("cuInit failed: CUDA_ERROR_NO_DEVICE (100)")
    assert Path(r["library"]).resolve() == fake_libs["fake"].resolve()


def test_cuinit_segfault(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="segv")
    assert (r["available"], r["device_count"]) == (False, 0)
    assert r["reason"] == "driver crashed with SIGSEGV during cuInit"


def test_cuinit_hang_times_out(fake_libs):
    start = time.monotonic()
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="hang", FASTLLM_PROBE_TIMEOUT="1")
    assert time.monotonic() - start < 20
    assert (r["available"], r["device_count"]) == (False, 0)
    assert r["reason"].startswith("driver did not answer within 1.0 s during cuInit")
    assert "FASTLLM_PROBE_TIMEOUT" in r["reason"]


def test_cuinit_exits(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="exit3")
    assert not r["available"]
    assert "exited with status 3 during cuInit" in r["reason"]


def test_missing_cuinit_symbol(fake_libs):
    r = run_probe(fake_libs["no_cuinit"])
    assert (r["available"], r["device_count"]) == (False, 0)
    assert "has no symbol cuInit" in r["reason"]


def test_library_that_does_not_exist(tmp_path):
    missing = tmp_path / "libcuda-missing.so"
    r = run_probe(missing)
    assert (r["available"], r["device_count"]) == (False, 0)
    assert str(missing) in r["reason"] and "does not exist" in r["reason"]


def test_library_not_found_by_name():
    r = run_probe("libfastllm-no-such-driver.so.1")
    assert not r["available"]
    assert "could not be loaded" in r["reason"]
    assert "libfastllm-no-such-driver.so.1" in r["reason"]


def test_library_crashing_while_loaded(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="ctor_segv")
    assert (r["available"], r["device_count"]) == (False, 0)
    assert r["reason"] == f"driver crashed with SIGSEGV while loading {fake_libs['fake']}"


def test_device_name_without_nul_is_bounded(fake_libs):
    r = run_probe(fake_libs["fake"], FAKE_CUDA_MODE="long_name", FAKE_CUDA_DEVICES="1")
    assert r["available"]
    # The fake fills the whole 256-byte buffer and writes no terminator.
    assert r["devices"][0][1] == "X" * 256


def run_code(code: str, **env: str | os.PathLike) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def loads(marker: Path) -> int:
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def test_import_touches_neither_driver_nor_torch(fake_libs, tmp_path):
    marker = tmp_path / "loads"
    out = run_code(
        """
        import sys, fastllm, fastllm._core, fastllm.platform, fastllm.cli
        maps = open("/proc/self/maps").read()
        print("libcuda" in maps, "fakecuda" in maps, "torch" in sys.modules)
        """,
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_MARKER=marker,
    )
    assert out.split() == ["False", "False", "False"]
    assert loads(marker) == 0


@pytest.mark.parametrize(
    "env",
    [{"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}, {"FASTLLM_DEVICE": "cpu"}],
)
def test_opt_outs_never_load_the_library(fake_libs, tmp_path, env):
    marker = tmp_path / "loads"
    out = run_code(
        """
        import json, fastllm
        r = fastllm.probe()
        maps = open("/proc/self/maps").read()
        print(json.dumps([r.available, r.device_count, r.reason, "fakecuda" in maps]))
        """,
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_MARKER=marker,
        **env,
    )
    available, count, reason, mapped = json.loads(out)
    assert (available, count, mapped) == (False, 0, False)
    assert next(iter(env)) in reason
    assert loads(marker) == 0  # not even the probe child loaded it


def test_cache_per_visible_devices_and_threads(fake_libs, tmp_path):
    marker = tmp_path / "loads"
    out = run_code(
        """
        import os, sys, threading
        import fastllm
        loads = lambda: len(open(sys.argv[1]).read().splitlines()) if os.path.exists(sys.argv[1]) else 0
        # Busy threads run while several threads probe at once: one child only.
        stop = False
        def spin():
            while not stop:
                sum(range(1000))
        spinners = [threading.Thread(target=spin) for _ in range(2)]
        for t in spinners: t.start()
        results = []
        probers = [threading.Thread(target=lambda: results.append(fastllm.probe())) for _ in range(4)]
        for t in probers: t.start()
        for t in probers: t.join()
        stop = True
        for t in spinners: t.join()
        print(len(results), all(r.available for r in results), loads())
        fastllm.probe()
        print(loads())
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        print(fastllm.device_count(), loads())
        del os.environ["CUDA_VISIBLE_DEVICES"]
        print(fastllm.device_count(), loads())
        """.replace("sys.argv[1]", repr(str(marker))),
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_MARKER=marker,
        FAKE_CUDA_DEVICES="2",
    )
    lines = [line.split() for line in out.strip().splitlines()]
    assert lines[0] == ["4", "True", "1"]
    assert lines[1] == ["1"]  # cached
    assert lines[2] == ["2", "2"]  # a new CUDA_VISIBLE_DEVICES value probes again
    assert lines[3] == ["2", "2"]  # and the first value is still cached


def test_parent_initialises_only_after_child_success(fake_libs, tmp_path):
    marker = tmp_path / "loads"
    code = """
        import fastllm._core as c
        try:
            print("count", c._init_driver())
        except RuntimeError as e:
            print("error", e)
        print("mapped", "fakecuda" in open("/proc/self/maps").read())
        """
    out = run_code(code, FASTLLM_LIBCUDA=fake_libs["fake"], FAKE_CUDA_MODE="segv")
    assert "error CUDA is not available: driver crashed with SIGSEGV during cuInit" in out
    assert "mapped False" in out
    out = run_code(
        code, FASTLLM_LIBCUDA=fake_libs["fake"], FAKE_CUDA_MARKER=marker, FAKE_CUDA_DEVICES="3"
    )
    assert "count 3" in out and "mapped True" in out
    assert loads(marker) == 2  # the probe child, then this process


def test_core_device_count_without_gpu_is_zero():
    # CI has no GPU: no /proc/driver/nvidia, so the probe stops before any child.
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has an NVIDIA driver")
    out = run_code(
        "import fastllm._core as c, fastllm; print(c.get_device_count(), fastllm.probe().reason)"
    )
    count, reason = out.split(" ", 1)
    assert count == "0"
    assert "/proc/driver/nvidia" in reason


# ---- resolve_device ----


@pytest.fixture
def no_gpu(monkeypatch):
    """A probe that finds no GPU on any machine: CUDA_VISIBLE_DEVICES hides them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    from fastllm import platform

    return platform


def test_resolve_cpu_never_probes(monkeypatch):
    from fastllm import platform

    def boom():
        raise AssertionError("resolve_device('cpu') probed")

    monkeypatch.setattr(platform, "probe", boom)
    assert platform.resolve_device("cpu") == "cpu"
    assert platform.resolve_device(" CPU ") == "cpu"
    with pytest.raises(ValueError) as e:
        platform.resolve_device("cpu", tensor_parallel_size=2)
    assert str(e.value) == "tensor_parallel_size must be 1 when device is 'cpu'"


def test_resolve_cpu_never_loads_driver(fake_libs, tmp_path):
    marker = tmp_path / "loads"
    out = run_code(
        "from fastllm.platform import resolve_device; print(resolve_device('cpu'))",
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_MARKER=marker,
    )
    assert out.strip() == "cpu" and loads(marker) == 0


def test_resolve_without_gpu(no_gpu, caplog):
    reason = no_gpu.probe().reason
    assert reason and "CUDA_VISIBLE_DEVICES" in reason
    with pytest.raises(ValueError) as e:
        no_gpu.resolve_device("cuda")
    assert str(e.value) == f"CUDA device requested but no GPU available: {reason}"
    with pytest.raises(ValueError) as e:
        no_gpu.resolve_device("cuda:0")
    assert str(e.value) == f"CUDA device requested but no GPU available: {reason}"
    no_gpu._logged_reasons.clear()
    with caplog.at_level("INFO", logger="fastllm"):
        assert no_gpu.resolve_device() == "cpu"
        assert no_gpu.resolve_device("auto") == "cpu"
    records = [r for r in caplog.records if r.name == "fastllm"]
    assert len(records) == 1 and reason in records[0].getMessage()
    with pytest.raises(ValueError, match="^tensor_parallel_size must be 1 when device is 'cpu'"):
        no_gpu.resolve_device("auto", tensor_parallel_size=2)


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:", "cuda:x", "", "mps"])
def test_resolve_unknown_device(bad):
    from fastllm.platform import resolve_device

    with pytest.raises(ValueError) as e:
        resolve_device(bad)
    for valid in ("auto", "cpu", "cuda"):
        assert valid in str(e.value)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("tp", [0, -1, 1.5, True, "2"])
def test_resolve_bad_tensor_parallel_size(tp):
    from fastllm.platform import resolve_device

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_device("cpu", tensor_parallel_size=tp)


def test_resolve_with_fake_gpus(fake_libs):
    out = run_code(
        """
        from fastllm.platform import resolve_device
        print(resolve_device(), resolve_device("cuda"), resolve_device("cuda:1"),
              resolve_device("auto", tensor_parallel_size=2))
        for args in [("cuda:2",), ("cuda", 3)]:
            try:
                resolve_device(*args)
                print("no error")
            except ValueError as e:
                print("ValueError:", e)
        """,
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_DEVICES="2",
    )
    lines = out.strip().splitlines()
    assert lines[0].split() == ["cuda", "cuda", "cuda:1", "cuda"]
    assert lines[1].startswith("ValueError: device 'cuda:2' does not exist")
    assert lines[2].startswith("ValueError: tensor_parallel_size=3")


def test_probe_never_raises(monkeypatch):
    from fastllm import _core, platform

    def broken():
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(_core, "_probe", broken)
    r = platform.probe()
    assert not r.available and "simulated failure" in r.reason
    assert platform.device_count() == 0 and platform.cuda_available() is False


def test_report_reprs():
    from fastllm.platform import DeviceInfo, ProbeReport

    d = DeviceInfo(0, "NVIDIA H200", 141 * GiB, (9, 0))
    r = ProbeReport(True, 1, (d,), 12080, "/usr/lib/libcuda.so.1", None)
    assert "NVIDIA H200" in repr(r) and "141.0 GiB" in repr(r) and "sm_90" in repr(r)
    assert "driver=12.8" in repr(r)
    assert "<td>NVIDIA H200</td>" in r._repr_html_()
    bad = ProbeReport(False, reason="driver crashed with SIGSEGV <during> cuInit")
    assert "SIGSEGV" in repr(bad) and "&lt;during&gt;" in bad._repr_html_()


# ---- CPU features and the CLI ----


def test_cpu_features_match_proc_cpuinfo():
    from fastllm import _core

    f = _core.cpu_features()
    assert set(f) == {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512vnni",
        "avxvnni",
        "avx512bf16",
        "amx_tile",
        "amx_bf16",
        "amx_permitted",
        "amx",
    }
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or os.uname().machine != "x86_64":
        pytest.skip("needs Linux on x86_64 for /proc/cpuinfo flags")
    flags = next(
        line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
    ).split()
    for key, flag in [
        ("avx2", "avx2"),
        ("fma", "fma"),
        ("f16c", "f16c"),
        ("avx512f", "avx512f"),
        ("avx512bw", "avx512bw"),
        ("avx512vl", "avx512vl"),
        ("avx512vnni", "avx512_vnni"),
        ("avxvnni", "avx_vnni"),
        ("avx512bf16", "avx512_bf16"),
        ("amx_tile", "amx_tile"),
        ("amx_bf16", "amx_bf16"),
    ]:
        assert f[key] == (flag in flags), key
    assert f["amx"] == (f["amx_tile"] and f["amx_bf16"] and f["amx_permitted"])


def test_env_command(fake_libs):
    out = run_code(
        "from fastllm.cli import main; main(['env', '--json'])",
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_DEVICES="2",
    )
    info = json.loads(out)
    assert info["cuda"]["available"] is True and info["device"] == "cuda"
    assert [d["name"] for d in info["cuda"]["devices"]] == ["Fake GPU 0", "Fake GPU 1"]
    assert info["num_threads"] >= 1 and "avx2" in info["cpu_features"]
    assert info["python_version"] == sys.version.split()[0]

    out = run_code(
        "from fastllm.cli import main; main(['env'])",
        FASTLLM_LIBCUDA=fake_libs["fake"],
        FAKE_CUDA_MODE="segv",
    )
    assert "CUDA: not used" in out
    assert "driver crashed with SIGSEGV during cuInit" in out
    assert "what to do:" in out and "Threads for CPU kernels" in out
    assert "Device for device='auto': cpu" in out


def test_env_console_script_help():
    proc = subprocess.run(
        [sys.executable, "-m", "fastllm.cli", "env", "--help"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--json" in proc.stdout


def test_stream_triad_reports_bandwidth():
    from fastllm import _core

    assert _core.stream_triad_gbs(4_000_000, 1) > 0.0
    with pytest.raises(ValueError, match="bytes"):
        _core.stream_triad_gbs(0, 1)


def _env_info(features: dict, gemm: str, quant: str, cpu: str) -> dict:
    keys = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni"]
    keys += ["avx512bf16", "amx_tile", "amx_bf16", "amx_permitted", "amx"]
    return {
        "fastllm_version": "0",
        "python_version": "3",
        "platform": "Linux x86_64",
        "cuda": {"available": False, "reason": "no driver", "library": None},
        "advice": "Running on the CPU.",
        "device": "cpu",
        "cpu": cpu,
        "cpu_features": {k: bool(features.get(k)) for k in keys},
        "num_threads": 2,
        "gemm_path": gemm,
        "quant_path": quant,
        "quant_formats": ["q8_0", "q4_0"],
        "env": {},
    }


def test_env_report_on_an_avx2_only_cpu_says_plainly_what_it_has():
    """A Zen 3: AVX2, FMA and F16C, no AVX-512 and no AMX; every kernel family
    on its AVX2 path. Nothing in what it lacks reads as usable."""
    from fastllm.env_report import format_env

    zen3 = dict(avx2=1, fma=1, f16c=1)
    text = format_env(_env_info(zen3, "avx2", "avx2", "AMD EPYC 7B13 64-Core Processor"))
    lines = text.splitlines()
    assert "CPU: AMD EPYC 7B13 64-Core Processor" in lines
    (has,) = [ln for ln in lines if ln.startswith("  has: ")]
    assert has.startswith("  has: AVX2, FMA, F16C (")
    (lacks,) = [ln for ln in lines if ln.startswith("  does not have: ")]
    assert lacks == (
        "  does not have: AVX-512 (F, BW, VL), AVX-VNNI, AVX512-VNNI, AVX512-BF16, AMX-BF16"
    )
    assert "usable" not in text and "AMX:" not in text
    assert "  float matrix products (f32/bf16 linear layers): avx2" in lines
    assert any(
        ln.startswith("  integer matrix products")
        and ln.endswith(": avx2 (vpmaddubsw + vpmaddwd, 256-bit)")
        for ln in lines
    )
    assert "  paged attention, sampling, norms and activations: avx2" in lines


def test_env_report_says_when_the_os_refuses_amx():
    from fastllm.env_report import format_env

    sapphire = dict(
        avx2=1,
        fma=1,
        f16c=1,
        avx512f=1,
        avx512bw=1,
        avx512vl=1,
        avx512vnni=1,
        avx512bf16=1,
        amx_tile=1,
        amx_bf16=1,
    )
    text = format_env(_env_info(sapphire, "avx512", "avx512vnni", "Intel Xeon"))
    assert "AMX: the OS did not grant the tile state" in text and "not used" in text
    sapphire["amx_permitted"] = 1
    text = format_env(_env_info(sapphire, "avx512", "avx512vnni", "Intel Xeon"))
    assert "AMX: the OS granted this process the tile state" in text
    assert "does not have: AVX-VNNI" in text
