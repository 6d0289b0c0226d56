"""The CUDA path without a GPU: every kernel compiles to PTX through fastllm's
own NVRTC loader, and missing NVRTC, compile errors and module-load failures
give the documented errors. Needs the ``nvidia-cuda-nvrtc`` wheel."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastllm import _core

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIR = ROOT / "python"
FAKE_SRC = Path(__file__).with_name("fake_cuda.c")
ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """A private kernel cache for this module (FASTLLM_CACHE_DIR)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    old = os.environ.get("FASTLLM_CACHE_DIR")
    os.environ["FASTLLM_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("FASTLLM_CACHE_DIR", None)
    else:
        os.environ["FASTLLM_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def nvrtc_available() -> None:
    try:
        _core.nvrtc_version()
    except RuntimeError as exc:
        pytest.fail(f"the nvidia-cuda-nvrtc wheel is a test dependency: {exc}")


def expected_entries(source: str) -> list[str]:
    """Every kernel entry point a file should produce (macro bodies expanded per dtype)."""
    plain = re.findall(
        r'^extern "C" __global__ void (?:__launch_bounds__\(\w+\) )?(\w+)\(', source, flags=re.M
    )
    macro = re.findall(r"void (?:__launch_bounds__\(\w+\) )?(\w+)_##SUFFIX\(", source)
    suffixes = re.findall(r"^DEFINE_\w+\(\w+, (\w+)\)$", source, flags=re.M)
    return plain + [f"{m}_{s}" for m in macro for s in suffixes]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_to_ptx(arch, nvrtc_available, kernel_cache):
    sources = _core.kernel_sources()
    assert set(sources) == {p.name for p in (ROOT / "kernels").glob("*.cu")}
    for name, source in sources.items():
        assert source == (ROOT / "kernels" / name).read_text(), f"{name}: embedded copy is stale"
        ptx = _core.nvrtc_compile(source, name, arch).decode()
        assert f".target {arch}" in ptx, name
        entries = expected_entries(source)
        assert entries, name
        for entry in entries:
            assert f".entry {entry}(" in ptx, f"{name} lacks {entry} for {arch}"
    assert (ROOT / "kernels" / "common.cuh").is_file()


def test_disk_cache_is_keyed_and_reused(nvrtc_available, kernel_cache):
    source = _core.kernel_sources()["cache.cu"]
    first = _core.nvrtc_compile(source, "cache.cu", "sm_80")
    major, minor = _core.nvrtc_version()
    files = sorted(kernel_cache.glob(f"cache-sm80-nvrtc{major}.{minor}-*.ptx"))
    assert len(files) == 1
    assert files[0].read_bytes() == first
    # A hit returns the stored file: prove it by planting a marker in it.
    files[0].write_bytes(first + b"\n// from the cache\n")
    assert _core.nvrtc_compile(source, "cache.cu", "sm_80").endswith(b"// from the cache\n")
    # Another source, architecture or output kind is another entry.
    _core.nvrtc_compile(source + "\n", "cache.cu", "sm_80")
    _core.nvrtc_compile(source, "cache.cu", "sm_90")
    assert len(list(kernel_cache.glob("cache-sm80-*.ptx"))) == 2
    assert len(list(kernel_cache.glob("cache-sm90-*.ptx"))) == 1


def test_cubin_for_an_exact_architecture(nvrtc_available):
    image = _core.nvrtc_compile(_core.kernel_sources()["cache.cu"], "cache.cu", "sm_90", cubin=True)
    assert image[:4] == b"\x7fELF"


def test_compile_error_carries_the_log(nvrtc_available):
    bad = '#include "common.cuh"\nextern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n'
    with pytest.raises(RuntimeError) as info:
        _core.nvrtc_compile(bad, "broken.cu", "sm_80")
    msg = str(info.value)
    assert "NVRTC_ERROR_COMPILATION" in msg
    assert "broken.cu" in msg and "undefined_name" in msg and "sm_80" in msg


def test_bad_arch_is_a_value_error():
    with pytest.raises(ValueError, match="arch"):
        _core.nvrtc_compile("", "x.cu", "ampere")


def test_missing_nvrtc_names_the_package(tmp_path):
    with pytest.raises(RuntimeError) as info:
        _core.nvrtc_version(nvrtc_path=str(tmp_path / "libnvrtc.so.13"))
    assert "pip install nvidia-cuda-nvrtc" in str(info.value)
    assert "libnvrtc.so.13" in str(info.value)
    # An empty folder has no candidate at all.
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-nvrtc"):
        _core.nvrtc_compile("", "x.cu", "sm_80", nvrtc_path=str(tmp_path))


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full["PYTHONPATH"] = str(PYTHON_DIR)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )


def test_fastllm_nvrtc_env_is_used_and_reported(tmp_path):
    proc = run_python(
        "from fastllm import _core\n"
        "try:\n    _core.nvrtc_version()\nexcept RuntimeError as e:\n    print('ERR', e)\n",
        FASTLLM_NVRTC=str(tmp_path / "nope" / "libnvrtc.so"),
    )
    assert "ERR" in proc.stdout, proc.stderr
    assert "FASTLLM_NVRTC" in proc.stdout and "pip install nvidia-cuda-nvrtc" in proc.stdout


def test_nvrtc_missing_everywhere(tmp_path):
    """No toolkit, no wheel: the search fails with the install hint (skipped if a toolkit exists)."""
    if shutil.which("nvcc") or Path("/usr/local/cuda/lib64").exists():
        pytest.skip("a CUDA toolkit is installed here")
    proc = run_python(
        "import fastllm.nvrtc as n\n"
        "n.wheel_library_dirs = lambda: []\n"
        "from fastllm import _core\n"
        "try:\n    _core.nvrtc_version()\nexcept RuntimeError as e:\n    print('ERR', e)\n",
        CUDA_HOME=str(tmp_path),
        LD_LIBRARY_PATH="",
    )
    if "ERR" not in proc.stdout:
        pytest.skip(f"a system libnvrtc is on the loader path: {proc.stdout}{proc.stderr}")
    assert "pip install nvidia-cuda-nvrtc" in proc.stdout


def test_wheel_dirs_are_found():
    from fastllm.nvrtc import wheel_library_dirs

    dirs = wheel_library_dirs()
    assert dirs, "the nvidia-cuda-nvrtc wheel is a test dependency"
    assert any(n.startswith("libnvrtc.so") for n in os.listdir(dirs[0]))
    assert _core.nvrtc_library().startswith(dirs[0])


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler (cc) is needed to build the fake CUDA driver")
    out = tmp_path_factory.mktemp("fake-cuda") / "libcuda-fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE_SRC)], check=True)
    return out


def test_failing_module_load_names_the_cuda_error(fake_driver, nvrtc_available, kernel_cache):
    """Compilation succeeds (CUBIN for the fake device's sm_90), the driver rejects the image."""
    proc = run_python(
        "from fastllm import _core\n"
        "try:\n    _core.cuda_load_kernels(0)\nexcept RuntimeError as e:\n    print('ERR', e)\n"
        "else:\n    print('LOADED')\n",
        FASTLLM_LIBCUDA=str(fake_driver),
        FAKE_CUDA_MODE="ok",
        FASTLLM_CACHE_DIR=str(kernel_cache),
    )
    out = proc.stdout
    assert "ERR" in out, out + proc.stderr
    assert "cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (200)" in out
    assert "attention.cu" in out and "sm_90" in out and "device 0" in out
    # The CUBIN went through the cache on the way.
    assert list(kernel_cache.glob("attention-sm90-*.cubin"))


def test_launch_without_gpu_is_refused_before_the_driver(tmp_path):
    """A CUDA op on a machine whose probe fails says why, and never loads a driver."""
    proc = run_python(
        "from fastllm import _core\n"
        "try:\n    _core.cuda_load_kernels(0)\nexcept RuntimeError as e:\n    print('ERR', e)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('LIBCUDA' if 'libcuda' in maps else 'NO-LIBCUDA')\n",
        FASTLLM_DEVICE="cpu",
    )
    assert "ERR CUDA is not available: FASTLLM_DEVICE=cpu" in proc.stdout, proc.stderr
    assert "NO-LIBCUDA" in proc.stdout


def test_kernel_fallback_warns_once(caplog, monkeypatch):
    import torch  # noqa: F401  (cuda_ops needs torch)

    from fastllm.layers import cuda_ops

    monkeypatch.setattr(cuda_ops, "_disabled", None)
    monkeypatch.setattr(cuda_ops, "_warned", False)

    def boom():
        raise RuntimeError("cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (200)")

    with caplog.at_level("WARNING", logger="fastllm"):
        assert cuda_ops._run("paged_attention", boom) is None
        assert cuda_ops._run("paged_attention", lambda: 1) is None
    assert not cuda_ops.enabled()
    assert "CUDA_ERROR_INVALID_IMAGE" in (cuda_ops.disabled_reason() or "")
    warnings = [r for r in caplog.records if "CUDA kernels disabled" in r.getMessage()]
    assert len(warnings) == 1


def test_cpu_generate_resolves_no_cuda_library(make_model):
    """A CPU generate maps no CUDA driver and no CUDA library beyond what torch itself loads.

    (A CUDA build of torch maps libcudart and libnvrtc at import; fastllm's own
    loaders must add nothing, least of all libcuda.)
    """
    folder = make_model("llama")
    proc = run_python(
        "def cuda_libs():\n"
        "    return {l.split()[-1] for l in open('/proc/self/maps')\n"
        "            if 'libcuda' in l or 'nvrtc' in l or 'libcudart' in l}\n"
        "import torch\n"
        "before = cuda_libs()\n"
        "from fastllm import LLM, SamplingParams\n"
        f"llm = LLM({folder!r}, device='cpu', dtype='float32')\n"
        "out = llm.generate(['def f(x):'], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "after = cuda_libs()\n"
        "driver = [p for p in after if 'libcuda.so' in p]\n"
        "print('NEW', sorted(after - before), 'DRIVER', driver)\n",
    )
    assert "NEW [] DRIVER []" in proc.stdout, proc.stdout + proc.stderr
