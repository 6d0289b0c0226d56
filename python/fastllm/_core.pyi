"""Type stubs for the compiled Rust core, ``fastllm._core``."""

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""
