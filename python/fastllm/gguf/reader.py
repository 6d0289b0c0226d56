"""Reads a GGUF file: header, metadata and tensor directory, validated whole.

The file is memory-mapped once; tensor data is never copied here, only viewed.
Every check runs when the file is opened, before a single weight is used: the
magic and version, every metadata key and value (types, lengths, UTF-8), every
tensor's name, shape, type, offset and size against the end of the file, and
overlaps between tensors. Anything wrong is a ``GGUFError`` (a ``ValueError``)
naming the file and the key or tensor.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastllm import _core

# madvise(MADV_POPULATE_READ) (Linux 5.14): every page mapped at once.
_MADV_POPULATE_READ = 22


def map_file(fileno: int, populate: bool = True) -> mmap.mmap:
    """The whole open file ``fileno`` mapped read-only (shared).

    Huge pages are asked for before any page is touched: pages read into the
    page cache through this mapping then come in 2 MiB folios (where the file
    system keeps them), and the kernels streaming weights through it take a
    TLB miss per 2 MiB instead of per 4 KiB (batch-1 decode of a Gemma-3-1B
    Q4_0 file, two engines alternating in one process: 1.02-1.08x). With
    ``populate`` every page is mapped at once, far cheaper than a fault per
    page when the tensors are read right after.
    """
    m = mmap.mmap(fileno, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    if populate and len(m):
        try:
            m.madvise(_MADV_POPULATE_READ)
        except (OSError, AttributeError):  # an older kernel: touch each page
            np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE].max()
    return m


MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
_SCALARS: dict[int, str] = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY: dict[int, str] = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorType:
    """A ggml tensor type: its name, and the bytes of one block of ``block`` values."""

    id: int
    name: str
    block: int
    block_bytes: int


# Every ggml type a GGUF file may hold (id, name, values per block, bytes per block).
_TYPES = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
]
TENSOR_TYPES: dict[int, TensorType] = {t[0]: TensorType(*t) for t in _TYPES}


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. ``shape`` is in row-major order ([rows, row length]),
    the reverse of the ggml dimension order the file stores."""

    name: str
    shape: tuple[int, ...]
    type: TensorType
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of the tensor as a matrix: all dims but the last multiplied."""
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> TensorInfo).

    Arrays of numbers in the metadata are 1-D numpy arrays, arrays of strings
    are lists of ``str``. ``populate=False`` maps the file's pages only as they
    are read (for a load that reads few of its tensors). Use as a context manager, or call ``close()``; the
    views ``data()`` returns are valid while the file is open.
    """

    def __init__(self, path: str, populate: bool = True) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
            self._map = map_file(self._file.fileno(), populate)
            self.size = size
            self.metadata: dict[str, Any] = {}
            self.tensors: dict[str, TensorInfo] = {}
            self._parse()
        except BaseException:
            self.close()
            raise

    # ---- lifetime -------------------------------------------------------

    def close(self) -> None:
        """Releases the mapping and the file (views from ``data()`` must be gone)."""
        m = getattr(self, "_map", None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # a numpy view still exists; the mapping ends with it
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- parsing --------------------------------------------------------

    def _fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def _parse(self) -> None:
        buf = memoryview(self._map)
        try:
            self._parse_buffer(buf)
        finally:
            buf.release()

    def _parse_buffer(self, buf: memoryview) -> None:
        if bytes(buf[:4]) != MAGIC:
            raise self._fail(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in VERSIONS:
            raise self._fail(
                f"GGUF version {version} is not supported (supported: "
                f"{', '.join(map(str, VERSIONS))})"
            )
        self.version = version
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        if n_tensors > len(buf) or n_kv > len(buf):
            raise self._fail(f"header counts ({n_tensors} tensors, {n_kv} keys) exceed the file")
        cur = _Cursor(self, buf, 24)
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            (vtype,) = cur.unpack("<I", f"metadata key {key!r}")
            v = cur.value(vtype, key)
            if key in self.metadata:
                raise self._fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = v
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise self._fail(
                f"metadata key 'general.alignment' must be a power of two, got {alignment!r}"
            )
        infos = [cur.tensor_info(i) for i in range(n_tensors)]
        self._place_tensors(infos, -(-cur.pos // alignment) * alignment, alignment, len(buf))

    def _place_tensors(
        self,
        infos: list[tuple[str, tuple[int, ...], int, int]],
        data_start: int,
        alignment: int,
        end: int,
    ) -> None:
        """Checks every tensor's type, shape, alignment and extent (inside the
        file, no two overlapping) and records it."""
        spans = []
        for name, dims, ttype, offset in infos:
            if name in self.tensors:
                raise self._fail(f"tensor {name!r} appears twice")
            t = TENSOR_TYPES.get(ttype)
            if t is None:
                raise self._fail(f"tensor {name!r} has unknown ggml type {ttype}")
            if any(d <= 0 for d in dims):
                raise self._fail(f"tensor {name!r} has an empty dimension: {list(dims)}")
            if dims[0] % t.block:
                raise self._fail(
                    f"tensor {name!r} of type {t.name} has rows of {dims[0]} values, "
                    f"not a multiple of its block of {t.block}"
                )
            count = 1
            for d in dims[1:]:
                count *= d
            nbytes = dims[0] // t.block * t.block_bytes * count
            if offset % alignment:
                raise self._fail(f"tensor {name!r}: offset {offset} is not aligned to {alignment}")
            start = data_start + offset
            if start + nbytes > end:
                raise self._fail(
                    f"tensor {name!r} ({t.name}, shape {list(reversed(dims))}) ends at byte "
                    f"{start + nbytes}, past the end of the file ({end} bytes): truncated file?"
                )
            spans.append((start, start + nbytes, name))
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), t, start, nbytes)
        spans.sort()
        for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:], strict=False):
            if b_start < a_end:
                raise self._fail(f"tensors {a!r} and {b!r} overlap in the file")

    # ---- access ---------------------------------------------------------

    def data(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name`` (a read-only uint8 view of the mapping)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _bytes(self) -> Any:
        """The whole file as a uint8 CPU tensor viewing the mapping (for the core)."""
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read
            return torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default``."""
        return self.metadata.get(key, default)


class _Cursor:
    """Reads the header of a GGUF file front to back, every read checked
    against the end of the file."""

    def __init__(self, file: GGUFFile, buf: memoryview, pos: int) -> None:
        self.file = file
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.end:
            raise self.file._fail(
                f"truncated while reading {what} (needs {self.pos + n} bytes, file has {self.end})"
            )

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        width = struct.calcsize(fmt)
        self.need(width, what)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += width
        return values

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Token strings of some vocabularies are not valid UTF-8 on their own.
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        what = f"metadata key {key!r}"
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype, count = self.unpack("<IQ", what)
            return self.array(itype, count, key)
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise self.file._fail(f"{what}: unknown value type {vtype}")
        return self.unpack(fmt, what)[0]

    def array(self, itype: int, count: int, key: str) -> Any:
        what = f"metadata key {key!r}"
        if itype in _NUMPY:
            width = struct.calcsize(_SCALARS[itype])
            self.need(count * width, what)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[itype], count=count, offset=self.pos)
            self.pos += count * width
            return arr.copy()
        if itype == _BOOL:
            self.need(count, what)
            arr = np.frombuffer(self.buf, dtype=np.uint8, count=count, offset=self.pos) != 0
            self.pos += count
            return arr
        if itype == _STRING:
            if count > self.end:
                raise self.file._fail(f"{what}: array of {count} strings exceeds the file")
            try:
                strings, self.pos = _core.gguf_strings(self.file._bytes(), self.pos, count)
            except ValueError as e:
                raise self.file._fail(f"truncated while reading {what}: {e}") from None
            return strings
        raise self.file._fail(f"{what}: unsupported array element type {itype}")

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        """(name, dims, ggml type, offset) of the next tensor entry."""
        name = self.string(f"tensor #{i}'s name")
        (n_dims,) = self.unpack("<I", f"tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise self.file._fail(f"tensor {name!r} has {n_dims} dimensions (1 to 4 are valid)")
        self.need(8 * n_dims + 12, f"tensor {name!r}")
        dims = self.unpack(f"<{n_dims}Q", f"tensor {name!r}")
        ttype, offset = self.unpack("<IQ", f"tensor {name!r}")
        return name, dims, ttype, offset


def readonly_tensor(arr: np.ndarray) -> Any:
    """A CPU tensor viewing ``arr`` (read-only memory: only the kernels read it)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only arrays
        return torch.from_numpy(arr)
