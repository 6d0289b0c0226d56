"""A cache of a GGUF file's quantized weights in the kernels' panel layout.

Loading a quantized GGUF file repacks every matrix into the integer kernels'
panels (``_core.QuantizedLinear.from_blocks``). Most of that time is the
first touch of fresh memory for the panels, which on some machines (virtual
machines above all) costs far more than the repack itself. So after a load
the panels are written, on a background thread (which a short-lived
process waits for at exit), to one file in the cache directory; the next load of the same GGUF file maps that file and reads the
panels where they lie (``from_panels``: no copy, no fresh memory), as a GGUF
file's own weights would be mapped.

- Directory: ``$FASTLLM_CACHE_DIR/gguf`` (default ``$XDG_CACHE_HOME/fastllm``
  or ``~/.cache/fastllm``). ``FASTLLM_GGUF_CACHE=0`` turns the cache off.
- A cache file is named after the GGUF file and a hash of its identity (real
  path, size, inode, modification and change times, a sample of its bytes)
  and of the layout version: a changed or replaced GGUF file never meets an
  old cache file.
- It is written to a temporary name, flushed to disk, then renamed: a reader
  sees a whole file or none. It is not written when the disk would be left
  with less than 10% (and 1 GiB) free.
- A cache file that does not match (another version, a tensor of another
  format or shape, a short file) is ignored and written again; it never
  fails a load.

File layout: ``MAGIC``, the JSON header's length (8 bytes, little-endian), the
header, then the data from the next multiple of 4096 bytes: each tensor's
panels at its offset into the data (a multiple of 4096).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import threading
from typing import Any

import numpy as np

from fastllm import _core, envs
from fastllm.gguf.reader import map_file, readonly_tensor

logger = logging.getLogger("fastllm")

MAGIC = b"FLLMPNL\x01"
# Bump when the panel layout of any format changes (``rust/quant/pack.rs``).
LAYOUT_VERSION = 1
_ALIGN = 4096


def cache_dir() -> str | None:
    """Where cache files live, or None when ``FASTLLM_GGUF_CACHE`` turns the cache off."""
    if not envs.flag("FASTLLM_GGUF_CACHE"):
        return None
    return os.path.join(envs.cache_root(), "gguf")


def _identity(path: str) -> dict[str, Any]:
    """What a cache file must match: the GGUF file's path, size, inode, and
    modification and change times (any write moves the change time, which no
    tool sets back), a hash of 32 slices of its bytes spread over the file,
    and the panel layout's version."""
    real = os.path.realpath(path)
    with open(real, "rb") as f:
        st = os.fstat(f.fileno())
        sample = hashlib.sha256()
        step = max(1, st.st_size // 32)
        for at in range(0, st.st_size, step):
            sample.update(os.pread(f.fileno(), 4096, at))
    return {
        "path": real,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "sample": sample.hexdigest(),
        "layout": LAYOUT_VERSION,
    }


def _cache_path(gguf_path: str, directory: str, identity: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(directory, f"{stem}-{digest[:16]}.panels")


def cache_file_exists(gguf_path: str) -> bool:
    """Whether ``gguf_path`` has a cache file (not yet checked against its header)."""
    directory = cache_dir()
    try:
        return directory is not None and os.path.isfile(
            _cache_path(gguf_path, directory, _identity(gguf_path))
        )
    except OSError:
        return False


class PanelCache:
    """The cache file of one GGUF file: its panels to adopt, or to write."""

    def __init__(self, gguf_path: str, directory: str) -> None:
        self.identity = _identity(gguf_path)
        self.directory = directory
        self.path = _cache_path(gguf_path, directory, self.identity)
        self._entries: dict[str, dict[str, Any]] = {}
        self._map: mmap.mmap | None = None
        self._data = 0  # where the data starts
        #: Tables adopted from the cache file, and tables that had to be built.
        self.hits = 0
        self.misses = 0
        self._open()

    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(16)
                if len(head) < 16 or head[:8] != MAGIC:
                    return
                (n,) = struct.unpack("<Q", head[8:])
                data = _aligned(16 + n)
                header = json.loads(f.read(n)) if data <= size else None
                if not isinstance(header, dict) or header.get("source") != self.identity:
                    return
                entries = header.get("tensors")
                if not isinstance(entries, dict):
                    return
                if not all(_entry_ok(e, size - data) for e in entries.values()):
                    return
                self._map = map_file(f.fileno())
                self._entries, self._data = entries, data
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the packed-weight cache %s: %s", self.path, e)

    @property
    def found(self) -> bool:
        """Whether a matching cache file was mapped."""
        return self._map is not None

    def table(
        self, name: str, fmt: str, out_features: int, in_features: int, bias: Any
    ) -> Any | None:
        """Parameter ``name``'s ``QuantizedLinear`` adopted from the cache file, or
        None when the file has no such panels (the caller builds them)."""
        e = self._entries.get(name)
        want = (fmt, out_features, in_features)
        if self._map is None or e is None or (e["format"], e["n"], e["k"]) != want:
            self.misses += 1
            return None

        at = self._data + e["offset"]
        view = np.frombuffer(self._map, dtype=np.uint8, count=e["nbytes"], offset=at)
        data = readonly_tensor(view)
        try:
            table = _core.QuantizedLinear.from_panels(data, out_features, in_features, fmt, bias)
        except ValueError as err:
            logger.warning("packed-weight cache %s: %s: %s", self.path, name, err)
            self.misses += 1
            return None
        self.hits += 1
        return table

    def write_in_background(self, tables: dict[str, Any]) -> threading.Thread | None:
        """Writes ``tables`` (parameter name -> QuantizedLinear) as this file's
        cache on a thread of its own, which the interpreter waits for at exit;
        None when nothing is written."""
        layout: dict[str, dict[str, Any]] = {}
        offset = 0
        for name, t in tables.items():
            layout[name] = {
                "format": t.format,
                "n": t.out_features,
                "k": t.in_features,
                "offset": offset,
                "nbytes": t.nbytes,
            }
            offset += _aligned(t.nbytes)
        text = json.dumps({"source": self.identity, "tensors": layout}).encode()
        head = MAGIC + struct.pack("<Q", len(text)) + text
        total = _aligned(len(head)) + offset
        try:
            os.makedirs(self.directory, exist_ok=True)
            usage = shutil.disk_usage(self.directory)
        except OSError as e:
            logger.info("not caching packed weights in %s: %s", self.directory, e)
            return None
        if usage.free - total < max(1 << 30, usage.total // 10):
            logger.info(
                "not caching packed weights (%.0f MB) in %s: too little free disk space",
                total / 1e6,
                self.directory,
            )
            return None
        self._remove_stale_temporaries()
        thread = threading.Thread(
            target=self._write,
            args=(head, layout, tables, total),
            name="fastllm-gguf-cache",
            # Not a daemon: a short-lived process finishes the file on exit.
            daemon=False,
        )
        thread.start()
        logger.info(
            "caching the packed weights (%.0f MB) in %s for the next load "
            "(FASTLLM_GGUF_CACHE=0 turns this off)",
            total / 1e6,
            self.path,
        )
        return thread

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of this cache file left by processes that are gone."""
        prefix = os.path.basename(self.path) + "."
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                    continue
                pid = entry.name[len(prefix) :].split(".")[0]
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _write(
        self, head: bytes, layout: dict[str, dict[str, Any]], tables: dict[str, Any], total: int
    ) -> None:
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        # The lowest priority for this thread alone (Linux): the model's first
        # steps, which run meanwhile, keep the cores.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, total)
                data = _aligned(len(head))
                # In whole 2 MiB chunks: the page cache keeps the file in huge
                # folios, which the next load maps as huge pages.
                places = [(t, data + layout[name]["offset"]) for name, t in tables.items()]
                _core.write_panel_file(fd, head, places)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except Exception as e:  # a cache never fails the load or the process
            logger.info("could not write the packed-weight cache %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _entry_ok(e: Any, size: int) -> bool:
    """A header entry with its fields, whose bytes lie inside the file."""
    if not isinstance(e, dict) or not isinstance(e.get("format"), str):
        return False
    fields = [e.get(k) for k in ("n", "k", "offset", "nbytes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields):
        return False
    return e["offset"] % _ALIGN == 0 and e["offset"] + e["nbytes"] <= size


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 4096."""
    return -(-n // _ALIGN) * _ALIGN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
