"""Where the ``nvidia-cuda-nvrtc`` wheel keeps libnvrtc (found with importlib, no torch)."""

from __future__ import annotations

import glob
import importlib.util
import os


def wheel_library_dirs() -> list[str]:
    """Folders of installed NVIDIA wheels that hold a libnvrtc, newest layout first.

    CUDA 13 wheels put it in ``nvidia/cu13/lib``, CUDA 12 wheels in
    ``nvidia/cuda_nvrtc/lib``; the Rust loader tries these after the CUDA
    toolkit's places and ``FASTLLM_NVRTC``.
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for root in spec.submodule_search_locations:
        for pattern in ("cu*/lib", "cuda_nvrtc/lib", "cu*/bin", "cuda_nvrtc/bin"):
            for lib_dir in sorted(glob.glob(os.path.join(root, pattern)), reverse=True):
                names = os.listdir(lib_dir) if os.path.isdir(lib_dir) else []
                if any(n.startswith(("libnvrtc.so", "nvrtc64_")) for n in names):
                    if lib_dir not in found:
                        found.append(lib_dir)
    return found
