"""Type stubs for the compiled Rust core, ``fastllm._core``."""

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""

# ---- probe and platform ----

def get_device_count() -> int:
    """Number of usable CUDA devices, 0 without a GPU; runs the isolated, cached probe."""

def cpu_features() -> dict[str, bool]:
    """CPU features detected at run time: avx2, fma, avx512f, avx512bf16, amx_tile, amx_bf16, amx_permitted, amx."""

def _probe() -> dict[str, object]:
    """The probe report as a dict (available, device_count, devices, driver_version, library, reason)."""

def _probe_child() -> None:
    """Entry point of the probe child process: probes, prints the protocol on stdout, exits the process."""

def _init_driver() -> int:
    """Initialises the driver in this process once the isolated probe succeeded; returns its device count."""
