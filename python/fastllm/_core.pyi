"""Type stubs for the compiled Rust core, ``fastllm._core``."""

from collections.abc import Sequence

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

# ---- kv: block pool ----

class BlockPool:
    """Paged KV-cache block pool with reference counts and a prefix cache.

    Full blocks registered with ``register_full_block`` are keyed by a hash
    chaining their parent's hash and their token ids; lookups verify the stored
    tokens. Unreferenced cached blocks stay reusable until an allocation needs
    them, evicted least recently used first. Misuse raises ``ValueError``;
    running out of blocks raises ``MemoryError``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        """A pool of ``num_blocks`` free blocks of ``block_size`` tokens."""
    @property
    def num_blocks(self) -> int:
        """Number of blocks in the pool."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones plus evictable cached ones."""
    def allocate(self) -> int:
        """A block with reference count 1 and no cached content; evicts the LRU cached block if needed."""
    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks at once, all or nothing (``MemoryError`` leaves the pool unchanged)."""
    def incref(self, block_id: int) -> None:
        """Adds a reference (sharing, or a prefix-cache hit on an evictable block)."""
    def free(self, block_id: int) -> None:
        """Drops one reference; at zero a cached block becomes evictable, any other free."""
    def ref_count(self, block_id: int) -> int:
        """The block's reference count."""
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Ids of the longest run of cached full blocks matching the start of ``token_ids``."""
    def register_full_block(
        self, block_id: int, parent_block_id: int | None, token_ids: Sequence[int]
    ) -> None:
        """Registers a referenced full block holding ``token_ids`` after ``parent_block_id``."""
    def copy_on_write(self, block_id: int) -> int:
        """A private copy target for a shared block (new id, old one decref'd), else the block itself."""
    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache currently points at this block."""
    def stats(self) -> dict[str, int]:
        """free_blocks, cached_blocks, hits, queries, evictions."""
    def reset_prefix_cache(self) -> bool:
        """Drops every cache entry unless a cached block is referenced; returns whether it did."""
