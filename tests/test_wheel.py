"""The wheel: one cp310-abi3 manylinux wheel, no CUDA library linked, installable.

Slow (a release build and a fresh virtual environment), marked ``slow``, and
still part of the default run: this is the promise the whole project makes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUDA_LIBS = ("libcuda", "libcudart", "libnvrtc", "libnvidia")


def find_maturin() -> str:
    local = Path(sys.executable).parent / "maturin"
    if local.exists():
        return str(local)
    found = shutil.which("maturin")
    if found is None:
        pytest.fail("maturin is needed to build the wheel (scripts/setup.sh installs it)")
    return found


def needed_libraries(so: Path) -> list[str]:
    """The NEEDED entries of a shared object's dynamic section, read by readelf."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("readelf (binutils) is needed to inspect the wheel's shared object")
    out = subprocess.run([readelf, "-d", so], capture_output=True, text=True, check=True).stdout
    return [
        line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line
    ]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks a manylinux wheel")
def test_wheel_is_abi3_links_no_cuda_and_installs(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [find_maturin(), "build", "--release", "--quiet", "--out", dist],
        cwd=ROOT,
        check=True,
        timeout=900,
    )
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    assert "-cp310-abi3-" in wheel.name, wheel.name
    assert "manylinux" in wheel.name, wheel.name

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        so_name = next(n for n in names if n.startswith("fastllm/_core") and n.endswith(".so"))
        assert "fastllm/py.typed" in names and "fastllm/_core.pyi" in names
        # the embedded demo model ships inside the wheel
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert f"fastllm/demo_model/{f}" in names, f
        so = Path(z.extract(so_name, tmp_path / "unpacked"))
    needed = needed_libraries(so)
    assert needed, "readelf found no NEEDED entries at all"
    assert not [lib for lib in needed if lib.startswith(CUDA_LIBS)], needed

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel],
        check=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    code = (
        "import sys, fastllm, fastllm._core as c\n"
        "assert fastllm.__file__.startswith(sys.prefix), fastllm.__file__\n"
        "assert 'torch' not in sys.modules\n"
        "print(c.__version__, type(c.get_device_count()).__name__)\n"
    )
    out = subprocess.run(
        [py, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.1.0", "int"]
