"""The Rust linear kernels (``_core.linear``) against ``torch.nn.functional.linear``.

The reference is computed in float32 on the very same (bf16-rounded) inputs.
Tolerance: a bf16 result is rounded once at the end, so it may differ by
2^-8 of its magnitude; on top of that, every path sums in f32 in its own order
(and AVX512-BF16 keeps ~16 bits of an f32 ``x`` as two bf16 terms), which is
bounded by ``3e-5 * (|x| @ |w|^T)``, the magnitude of the summed terms.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import _core  # noqa: E402

PATHS = _core.linear_paths()
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def reference(x, w, b):
    """float32 torch result and the magnitude of the summed terms."""
    xf, wf = x.float(), w.float()
    bf = None if b is None else b.float()
    ref = torch.nn.functional.linear(xf, wf, bf)
    mag = torch.nn.functional.linear(xf.abs(), wf.abs(), None if bf is None else bf.abs())
    return ref, mag


def assert_close(out, x, w, b):
    ref, mag = reference(x, w, b)
    rtol = 2.0**-8 if out.dtype == torch.bfloat16 else 0.0
    tol = rtol * ref.abs() + 3e-5 * mag + 1e-30
    err = (out.float() - ref).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {out.numel()} wrong; worst err {err.max().item()} "
        f"at {divmod(int(err.argmax()), out.shape[1])}"
    )


def make(m, n, k, x_dtype, w_dtype, b_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DTYPES[x_dtype])
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPES[w_dtype])
    b = None if b_dtype is None else torch.randn(n, generator=g).to(DTYPES[b_dtype])
    return x, w, b


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 70),
    k=st.integers(1, 300),
    x_dtype=st.sampled_from(["bf16", "f32"]),
    w_dtype=st.sampled_from(["bf16", "bf16", "f32"]),
    b_dtype=st.sampled_from([None, "bf16", "f32"]),
    path=st.sampled_from([None, *PATHS]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_torch_on_random_shapes(m, n, k, x_dtype, w_dtype, b_dtype, path, seed):
    x, w, b = make(m, n, k, x_dtype, w_dtype, b_dtype, seed)
    out = torch.full((m, n), float("nan"), dtype=x.dtype)
    _core.linear(out, x, w, b, path=path)
    assert_close(out, x, w, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("x_dtype", ["bf16", "f32"])
def test_every_path_decode_shapes(path, x_dtype):
    """M = 1 with bias, and a multi-tile M, on a model-like shape with a K tail."""
    for m in (1, 13):
        x, w, b = make(m, 389, 901, x_dtype, "bf16", "bf16", m)
        out = torch.empty(m, 389, dtype=x.dtype)
        _core.linear(out, x, w, b, path=path)
        assert_close(out, x, w, b)


def test_default_path_and_many_rows():
    """Enough output rows to spread over every thread of the pool."""
    x, w, b = make(3, 4099, 96, "bf16", "bf16", "f32", 7)
    out = torch.empty(3, 4099, dtype=torch.bfloat16)
    _core.linear(out, x, w, b)
    assert_close(out, x, w, b)


def test_paths_listed():
    assert PATHS[0] == "scalar"
    assert set(PATHS) <= {"scalar", "avx2", "avx512", "avx512bf16"}
    for m in (1, 4, 5, 64):
        for x_bf16 in (True, False):
            assert _core.linear_default_path(m, x_bf16) in PATHS
    if {"avx512", "avx512bf16"} <= set(PATHS):
        assert _core.linear_default_path(1) == "avx512bf16"
        assert _core.linear_default_path(5) == "avx512"
        assert _core.linear_default_path(1, x_bf16=False) == "avx512"


def test_errors_name_the_argument():
    x, w, b = make(2, 5, 8, "bf16", "bf16", "bf16", 0)
    out = torch.empty(2, 5, dtype=torch.bfloat16)
    cases = [
        ((out, x, w.t()), "weight: must be contiguous"),
        ((out, x[:, :7].contiguous(), w), "x: dimension 1 must be 8"),
        ((out, x[:, :7], w), "x: must be contiguous"),
        ((out, x.int(), w), "x: expected dtype"),
        ((out, x.bool(), w), "x: unsupported dtype"),
        ((out, x.half(), w), "x: expected dtype"),
        ((out.float(), x, w), "out: expected dtype"),
        ((out[:1], x, w), "out: dimension 0 must be 2"),
        ((torch.empty(2, 4, dtype=torch.bfloat16), x, w), "out: dimension 1 must be 5"),
        ((out, x, w, b[:4]), "bias: dimension 0 must be 5"),
        ((out, x, w, b.view(1, 5)), "bias: expected 1 dimensions"),
        ((out, x, w[None]), "weight: expected 2 dimensions"),
        ((out, x, "w"), "weight: expected a torch.Tensor"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _core.linear(*args)
    with pytest.raises(ValueError, match="unknown linear kernel path 'sse9'"):
        _core.linear(out, x, w, path="sse9")
    shared = torch.empty(2 * 5 + 2 * 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out: must not share memory with x"):
        _core.linear(shared[:10].view(2, 5), shared[4:20].view(2, 8), w)


def test_env_var_forces_a_path_and_rejects_unknown_names():
    code = (
        "import torch; from fastllm import _core\n"
        "x = torch.ones(1, 4, dtype=torch.bfloat16); w = torch.ones(3, 4, dtype=torch.bfloat16)\n"
        "out = torch.empty(1, 3, dtype=torch.bfloat16); _core.linear(out, x, w)\n"
        "print(out.float().tolist())\n"
    )
    code_path = code + "print(_core.linear_default_path())\n"
    env = dict(os.environ, FASTLLM_LINEAR_PATH="scalar")
    run = subprocess.run([sys.executable, "-c", code_path], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[[4.0,", "4.0,", "4.0]]", "scalar"]
    env["FASTLLM_LINEAR_PATH"] = "sse9"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "unknown linear kernel path 'sse9'" in run.stderr


def test_stream_triad_reports_bandwidth():
    assert _core.stream_triad_gbs(4_000_000, 1) > 0.0
    with pytest.raises(ValueError, match="bytes"):
        _core.stream_triad_gbs(0, 1)
