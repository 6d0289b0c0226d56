"""Builds a model and fills it from a Hugging Face safetensors checkpoint.

The model is built on the meta device (no memory, no initialisation), every
checkpoint tensor is checked (present, right shape) before any is read, then all
parameters are read, converted to the target dtype and device once, and only
when every one of them is ready are they assigned to the model. A failure at any
point leaves no half-loaded model behind.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from fastllm.config import ModelConfig
from fastllm.engine.model_runner import torch_threads
from fastllm.layers import load_dtype
from fastllm.layers.norm import LayerNorm, RMSNorm
from fastllm.layers.ops import bind_ops, select_ops
from fastllm.models import get_model_class
from fastllm.models.weights import PackedBlocks, WeightSpec, mxfp4_blocks

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
DUMMY_SEED = 0
DUMMY_STD = 0.02


def load_model(
    config: ModelConfig,
    folder: str,
    dtype: torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    quantization: str | None = None,
) -> nn.Module:
    """The model for ``config`` with its weights from ``folder`` (or random
    ones: "dummy"); with ``quantization`` (a kernel format, CPU only), its
    linear layers quantized as they are read (``StreamingQuantizer``: the
    float model is never whole in memory), the head and embeddings left to
    ``quantize_model``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(repr(f) for f in LOAD_FORMATS)}; got {load_format!r}"
        )
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    device = torch.device(device)
    streaming = None
    stored = getattr(model, "stored_quantization", None)
    if quantization is not None or stored is not None:
        from fastllm.layers.quantization import StreamingQuantizer

        if device.type != "cpu":
            what = f"quantization={quantization!r}" if quantization else None
            what = what or f"the checkpoint's {stored} weights (quantization_config)"
            raise ValueError(
                f"{what}: quantized weights run on the CPU's integer kernels, not on "
                f"device {str(device)!r}: pass device='cpu'"
            )
        streaming = StreamingQuantizer(model, quantization)
    # Streaming, torch's copies alternate with the quantizer's Rust team:
    # torch's OpenMP workers spin after each copy on the cores the team
    # needs (each quantization took twice as long), so torch runs on one thread.
    with torch_threads(1 if streaming is not None else None):
        if load_format == "dummy":
            state = _dummy_state(model, dtype, device, streaming)
        else:
            with Checkpoint(folder) as ckpt:
                state = _checkpoint_state(model, ckpt, dtype, device, streaming)
    consumed = streaming.consumed() if streaming is not None else set()
    missing, unexpected = model.load_state_dict(state, strict=not consumed, assign=True)
    if set(missing) != consumed or unexpected:  # a bug, never a checkpoint's fault
        raise RuntimeError(f"load: parameters missing {missing}, unexpected {unexpected}")
    if streaming is not None:
        streaming.adopt(model)
    bind_ops(model, select_ops(device, dtype))
    return model.eval()


class Checkpoint:
    """The safetensors file(s) of a folder, opened memory-mapped; a context manager."""

    def __init__(self, folder: str) -> None:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"model folder not found: {folder}")
        self.folder = folder
        self.files = self._find_files(folder)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self.location: dict[str, str] = {}  # tensor name -> file path

    @staticmethod
    def _find_files(folder: str) -> list[str]:
        index = os.path.join(folder, _INDEX)
        single = os.path.join(folder, _SINGLE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (
                json.JSONDecodeError,
                KeyError,
                TypeError,
                AttributeError,
                UnicodeDecodeError,
            ) as e:
                raise ValueError(f"malformed safetensors index {index}: {e!r}") from None
            files = [os.path.join(folder, n) for n in names]
            for path in files:
                if not os.path.isfile(path):
                    raise FileNotFoundError(
                        f"safetensors shard {path} listed in {index} is missing"
                    )
            return files
        if os.path.isfile(single):
            return [single]
        shards = sorted(
            os.path.join(folder, n)
            for n in os.listdir(folder)
            if n.endswith(".safetensors") and not n.startswith(".")
        )
        if shards:
            return shards
        others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = (
            f" (found {', '.join(sorted(others))}; only safetensors is supported)" if others else ""
        )
        raise FileNotFoundError(f"no safetensors weights found in {folder}{hint}")

    def __enter__(self) -> Checkpoint:
        try:
            for path in self.files:
                try:
                    handle = self._stack.enter_context(
                        safe_open(path, framework="pt", device="cpu")
                    )
                    names = list(handle.keys())
                except Exception as e:  # safetensors raises its own error type
                    raise ValueError(f"corrupt or truncated safetensors file {path}: {e}") from None
                self._handles[path] = handle
                for name in names:
                    self.location.setdefault(name, path)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        # Drop the handles too: each maps its whole file, and the mapping
        # (counted in the process RSS) lives as long as the handle object.
        self._handles.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (no data read)."""
        path = self.location[name]
        try:
            return tuple(self._handles[path].get_slice(name).get_shape())
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} in {path}: {e}") from None

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """Row ``row`` (along dim 0) of tensor ``name``, reading only that row."""
        path = self.location[name]
        try:
            return self._handles[path].get_slice(name)[row]
        except Exception as e:
            raise ValueError(
                f"corrupt or truncated safetensors file {path}: cannot read tensor {name!r}: {e}"
            ) from None

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a CPU tensor; errors name the tensor and the file."""
        path = self.location[name]
        try:
            return self._handles[path].get_tensor(name)
        except Exception as e:
            raise ValueError(
                f"corrupt or truncated safetensors file {path}: cannot read tensor {name!r}: {e}"
            ) from None


def _resolve(model: nn.Module, ckpt: Checkpoint, name: str) -> str | None:
    """The checkpoint's name for ``name``, trying the model's prefix aliases."""
    if name in ckpt.location:
        return name
    for prefix, alias in getattr(model, "checkpoint_prefix_aliases", ()):
        if name.startswith(prefix):
            other = alias + name[len(prefix) :]
            if other in ckpt.location:
                return other
    return None


def _match(
    model: nn.Module, ckpt: Checkpoint, spec: WeightSpec, shape: tuple[int, ...]
) -> tuple[list[str] | None, str | None]:
    """The checkpoint names of ``spec``'s sources, all checked: (names, None),
    or (None, the first problem) where a source is missing or misshapen."""
    names = []
    for source, expected in zip(spec.sources, spec.source_shapes(shape), strict=True):
        resolved = _resolve(model, ckpt, source)
        if resolved is None:
            return None, f"missing tensor {source!r}"
        actual = ckpt.shape(resolved)
        if spec.select is not None:  # one expert's row of a stacked tensor
            ok = len(actual) == len(expected) + 1 and actual[1:] == expected
            ok = ok and actual[0] > spec.select
            expected = (f">{spec.select}", *expected)
        else:
            ok = actual == expected
        if not ok:
            return None, (
                f"tensor {resolved!r} in {ckpt.location[resolved]} has shape {list(actual)}, "
                f"expected {list(expected)}"
            )
        names.append(resolved)
    return names, None


def _plan(
    model: nn.Module, ckpt: Checkpoint
) -> list[tuple[str, torch.Size, WeightSpec, list[str]]]:
    """(param, shape, spec, resolved source names) for every parameter, all checked first."""
    specs: dict[str, WeightSpec] = model.weight_specs()
    where = (
        ", ".join(ckpt.files)
        if len(ckpt.files) <= 3
        else f"{len(ckpt.files)} shards in {ckpt.folder}"
    )
    plan = []
    for pname, param in model.named_parameters():
        spec = specs.get(pname, WeightSpec((pname,)))
        first_problem = None
        for candidate in (spec, *spec.alternatives):
            names, problem = _match(model, ckpt, candidate, tuple(param.shape))
            if names is not None:
                plan.append((pname, param.shape, candidate, names))
                break
            first_problem = first_problem or problem
        else:
            if first_problem and first_problem.startswith("missing"):
                first_problem += f" in {where}"
            raise ValueError(first_problem)
    return plan


def _source_tensor(ckpt: Checkpoint, name: str, spec: WeightSpec) -> torch.Tensor:
    """Source ``name`` as ``spec`` reads it: its expert row, transposed,
    de-interleaved, offset."""
    t = ckpt.read(name) if spec.select is None else ckpt.read_row(name, spec.select)
    if spec.transpose:
        t = t.t()
    if spec.deinterleave:
        t = torch.cat([t[0::2], t[1::2]])
    if spec.offset:
        t = t.float() + spec.offset
    return t


def _checkpoint_state(
    model: nn.Module,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    streaming: Any = None,
) -> dict[str, torch.Tensor]:
    """Every parameter read, fused and converted (each offered to
    ``streaming``, which may quantize it, when given); nothing is assigned here."""
    state: dict[str, torch.Tensor] = {}
    for pname, shape, spec, names in _plan(model, ckpt):
        pdtype = load_dtype(model, pname, dtype)
        if spec.mxfp4:
            blocks, scales = (
                ckpt.read(n) if spec.select is None else ckpt.read_row(n, spec.select)
                for n in names
            )
            if spec.deinterleave:
                blocks = torch.cat([blocks[0::2], blocks[1::2]])
                scales = torch.cat([scales[0::2], scales[1::2]])
            packed = PackedBlocks("mxfp4", mxfp4_blocks(blocks, scales), *shape)
            streaming.offer(pname, packed, state)
            continue
        if len(names) == 1:
            t = _source_tensor(ckpt, names[0], spec)
            moved = t.to(device=device, dtype=pdtype).contiguous()
            # A tensor read from a safetensors file views the file's memory
            # map, and any one such tensor kept keeps the whole file mapped
            # (and counted in the process RSS): own a copy instead.
            out = moved.clone() if moved.data_ptr() == t.data_ptr() else moved
        else:
            out = torch.empty(shape, dtype=pdtype, device=device)
            offset = 0
            for name in names:
                t = _source_tensor(ckpt, name, spec)
                out[offset : offset + t.shape[0]].copy_(t)
                offset += t.shape[0]
        if streaming is None:
            state[pname] = out
        else:
            streaming.offer(pname, out, state)
    return state


def _dummy_state(
    model: nn.Module, dtype: torch.dtype, device: torch.device, streaming: Any = None
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: normal(0, 0.02), norms at 1, biases at 0."""
    norm_params = set()
    for mname, module in model.named_modules():
        if isinstance(module, (RMSNorm, LayerNorm)):
            norm_params.add(f"{mname}.weight" if mname else "weight")
    gen = torch.Generator(device="cpu").manual_seed(DUMMY_SEED)
    state: dict[str, torch.Tensor] = {}
    for pname, param in model.named_parameters():
        pdtype = load_dtype(model, pname, dtype)
        if pname in norm_params:
            t = torch.ones(param.shape, dtype=pdtype, device=device)
        elif pname.endswith("bias"):
            t = torch.zeros(param.shape, dtype=pdtype, device=device)
        else:
            t = torch.empty(param.shape, dtype=torch.float32, device="cpu")
            t.normal_(0.0, DUMMY_STD, generator=gen)
            t = t.to(device=device, dtype=pdtype)
        if streaming is None:
            state[pname] = t
        else:
            streaming.offer(pname, t, state)
    return state
