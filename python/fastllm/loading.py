"""One way in: a model from where it lives to what the engine runs.

``load(config, device)`` resolves the model (a Hugging Face folder, a hub id
found in the local cache, or a GGUF file), reads its configuration, builds
the tokenizer, loads the weights from their source, quantizes or packs them
for the CPU kernels, binds the op table (inside each source's loader) and
decides once whether the runner fuses the decoder layers. The engine, the
CLI, the benchmark, the server and Ray all come in through here; none of
them imports ``gguf/`` or another loader.

A source is a small class behind one interface (``WeightSource``): the
folder of safetensors (``FolderSource``) and the GGUF file
(``GGUFSource``). Adding a source (split GGUF files, AWQ safetensors) is one
more class and one more line in ``open_source``; adding an architecture
touches ``models/`` only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastllm.config import EngineConfig, ModelConfig, resolve_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fastllm.tokenizer import Tokenizer

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class LoadedModel:
    """What ``load`` hands the engine."""

    #: The folder or GGUF file the weights came from.
    path: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    model: Any  # torch.nn.Module
    device: str
    dtype: torch.dtype
    #: The kernel format of ``quantization=...`` (``"q8_0"``, ...), or None.
    quantization: str | None
    #: A GGUF file's tensor types and what ran them (None for a folder).
    gguf: dict[str, Any] | None
    #: Whether the runner runs the decoder layers as one fused call per step
    #: (a packed Llama-family model on the CPU; ``FASTLLM_CPU_FUSED``).
    fuse_decoder: bool


def is_gguf_file(model: str) -> bool:
    """Whether ``model`` names a GGUF file (a path ending in ``.gguf``)."""
    return isinstance(model, str) and model.lower().endswith(".gguf") and not os.path.isdir(model)


def with_overrides(mc: ModelConfig, overrides: dict[str, Any] | None, path: str) -> ModelConfig:
    """``mc`` with ``hf_overrides``' fields merged into its config.json (vLLM's:
    they replace the file's values), read again; ``path``: the model's, for
    errors. End-of-sequence ids from generation_config.json are kept."""
    if not overrides:
        return mc
    out = ModelConfig.from_dict(
        {**mc.hf, **overrides}, path=f"{path}: config.json with hf_overrides"
    )
    if "eos_token_id" not in overrides:
        out.eos_token_ids = list(mc.eos_token_ids)
    return out


def gguf_encoder_config(model: str) -> dict[str, Any] | None:
    """The config.json dict of the text encoder in GGUF file ``model`` (its
    header only is read; None when the file holds a decoder); a GGUFError
    naming the key for an encoder file fastllm cannot configure."""
    from fastllm.gguf.encoder import encoder_config, is_encoder_file
    from fastllm.gguf.reader import GGUFFile

    with GGUFFile(model, populate=False) as gguf:
        return encoder_config(gguf) if is_encoder_file(gguf) else None


def resolve_model_folder(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A local folder for ``model``: a path, or a hub id (``org/name`` or
    ``name``) found in the local Hugging Face cache (``download_dir`` when
    given). fastllm never downloads: a miss says how to."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is not a folder")
    if _HUB_ID.match(model) and ".." not in model:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:  # pragma: no cover - tokenizers depends on it
            snapshot_download = None
        if snapshot_download is not None:
            try:
                return snapshot_download(
                    model, revision=revision, cache_dir=download_dir, local_files_only=True
                )
            except Exception as e:  # not in the local cache
                where = download_dir or "the local Hugging Face cache"
                rev = f" at revision {revision!r}" if revision else ""
                hint = f" --revision {revision}" if revision else ""
                hint += f" --cache-dir {download_dir}" if download_dir else ""
                raise ValueError(
                    f"model {model!r}{rev} is not a local folder and is not in {where} "
                    f"({type(e).__name__}); fastllm never downloads: run "
                    f"`huggingface-cli download {model}{hint}` first, or pass the folder's path"
                ) from None
    raise ValueError(f"model folder not found: {model!r}")


def resolve_model_path(config: EngineConfig) -> str:
    """The GGUF file or the local folder of ``config.model``."""
    if is_gguf_file(config.model):
        return config.model
    return resolve_model_folder(config.model, config.revision, config.download_dir)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model folder or GGUF file (only its header is read)."""
    if is_gguf_file(model):
        from fastllm.gguf import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(model)
    from fastllm.tokenizer import Tokenizer

    return Tokenizer(model)


def weight_bytes_per_token(model: str) -> int | None:
    """Bytes of weights one decode step reads, as a GGUF file stores them
    (None for a folder: the engine's packed weights tell)."""
    if not is_gguf_file(model):
        return None
    from fastllm.gguf import weight_bytes_per_token as gguf_bytes

    return gguf_bytes(model)


def describe_model(model: str) -> str | None:
    """A paragraph about a GGUF file's tensor types and how each runs (None for a folder)."""
    if not is_gguf_file(model):
        return None
    from fastllm.gguf import describe_file

    return describe_file(model)


def stored_quantization(loaded: LoadedModel) -> str | None:
    """The format a folder's checkpoint stores some weights in, which run as
    stored (``"mxfp4"``: gpt-oss's released experts), or None."""
    return getattr(loaded.model, "stored_quantization", None)


def describe_weights(loaded: LoadedModel) -> str:
    """``quantization=...`` as ``LLM``'s repr shows it."""
    quant = f"quantization={loaded.quantization!r}"
    stored = stored_quantization(loaded)
    if stored is not None:
        quant = f"quantization={stored!r} (the checkpoint's experts, as stored)"
        if loaded.quantization is not None:
            quant += f", other layers quantized to {loaded.quantization!r}"
    if loaded.gguf is not None:
        from fastllm.gguf import describe_tensor_types

        quant = f"quantization='gguf' ({describe_tensor_types(loaded.gguf)})"
        if loaded.quantization is not None:
            quant += f", float tensors quantized to {loaded.quantization!r}"
    return quant


def quantization_name(loaded: LoadedModel) -> str | None:
    """The server's ``quantization`` field: ``"gguf"`` for a GGUF file, else the
    format the checkpoint stores (``"mxfp4"``) and the kernel format quantized
    at load, joined by ``+`` when both (None: float weights)."""
    if loaded.gguf:
        return "gguf"
    names = [n for n in (stored_quantization(loaded), loaded.quantization) if n is not None]
    return "+".join(names) or None


def describe_quantization(loaded: LoadedModel, requested: str | None) -> str:
    """The server's startup line: ``"int8 (q8_0)"``, ``"none"``, or a GGUF
    file's tensor types."""
    if loaded.gguf:
        from fastllm.gguf import describe_tensor_types

        return f"gguf ({describe_tensor_types(loaded.gguf)})"
    from fastllm.layers.quantization import describe

    stored = stored_quantization(loaded)
    if stored is not None:
        rest = "" if requested is None else f", the other layers {describe(requested)}"
        return f"{stored} (the checkpoint's experts, as stored){rest}"
    return describe(requested)


def check_architecture(mc: ModelConfig, path: str) -> None:
    """A clear error, before any weight is read, for an architecture fastllm cannot run."""
    from fastllm.models import ARCHITECTURES, get_model_class

    if mc.architecture not in ARCHITECTURES and "auto_map" in mc.hf:
        raise ValueError(
            f"{os.path.join(path, 'config.json')}: architecture {mc.architecture!r} comes "
            f"with its own remote code (auto_map), and fastllm runs no remote code, "
            f"trust_remote_code or not; supported architectures: {', '.join(ARCHITECTURES)}"
        )
    get_model_class(mc.architecture)  # the usual error for any other unknown architecture


# ---- sources ------------------------------------------------------------------------


class WeightSource(Protocol):
    """Where a model's configuration, tokenizer and weights come from."""

    path: str
    #: What the weights were, for the engine's report (None: nothing to say).
    summary: dict[str, Any] | None

    def model_config(self) -> ModelConfig:
        """The model's configuration."""

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the source carries (None: the folder's ``tokenizer.json``)."""

    def load_weights(
        self, mc: ModelConfig, dtype: torch.dtype, device: str, quantization: str | None = None
    ) -> Any:
        """The model with its weights, its op table bound; ``quantization``:
        the source may quantize linear layers as it reads them (a folder
        does), ``prepare_for_kernels`` finishes the rest."""

    def close(self) -> None:
        """Releases the source's files."""


class FolderSource:
    """A Hugging Face folder: ``config.json``, safetensors, ``tokenizer.json``."""

    def __init__(self, config: EngineConfig) -> None:
        self.path = resolve_model_folder(config.model, config.revision, config.download_dir)
        self.load_format = config.load_format
        self.summary = None

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained(self.path)

    def tokenizer(self) -> Tokenizer | None:
        return None

    def load_weights(
        self, mc: ModelConfig, dtype: torch.dtype, device: str, quantization: str | None = None
    ) -> Any:
        from fastllm.models.loader import load_model

        return load_model(mc, self.path, dtype, device, self.load_format, quantization)

    def close(self) -> None:
        pass


class GGUFSource:
    """A GGUF file: configuration, tokenizer, chat template and tensors in one."""

    def __init__(self, config: EngineConfig) -> None:
        from fastllm.gguf import open_file

        if config.load_format not in ("auto", "gguf"):
            raise ValueError(
                f"load_format={config.load_format!r} does not apply to a GGUF file; "
                "use 'auto' or 'gguf'"
            )
        self.path = config.model
        self.summary = None
        # Every header, key and tensor is checked here. With the packed-weight
        # cache the quantized tensors are not read: their pages are mapped as
        # the header and the float tensors need them.
        self.file = open_file(config.model)

    def model_config(self) -> ModelConfig:
        from fastllm.gguf import hf_config

        return ModelConfig.from_dict(hf_config(self.file), path=self.path)

    def tokenizer(self) -> Tokenizer | None:
        from fastllm.gguf import tokenizer_from_metadata

        return tokenizer_from_metadata(self.file.metadata, self.path)

    def load_weights(
        self, mc: ModelConfig, dtype: torch.dtype, device: str, quantization: str | None = None
    ) -> Any:
        from fastllm.gguf import load_gguf_model

        model, report = load_gguf_model(mc, self.file, dtype, device)
        self.summary = report.summary(self.path)
        return model

    def close(self) -> None:
        self.file.close()  # every tensor was copied or repacked out of the file


def open_source(config: EngineConfig) -> WeightSource:
    """The source of ``config.model``: a GGUF file, or a (cached) folder."""
    if is_gguf_file(config.model):
        return GGUFSource(config)
    q = config.quantization
    if isinstance(q, str) and q.strip().lower() == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf model file; got {config.model!r}")
    return FolderSource(config)


# ---- the load ------------------------------------------------------------------------


def load(config: EngineConfig, device: str) -> LoadedModel:
    """Everything the engine needs of ``config.model``, on ``device``; nothing is
    left half-loaded when it raises."""
    from fastllm.layers.quantization import resolve_quantization

    quantization = resolve_quantization(config.quantization)
    if quantization is not None and device != "cpu":
        raise ValueError(
            f"quantization={config.quantization!r} runs on the CPU's integer kernels, "
            f"not on device {device!r}: pass device='cpu', or quantization=None"
        )
    with _gc_paused():
        source = open_source(config)
        try:
            mc = with_overrides(source.model_config(), config.hf_overrides, source.path)
            check_architecture(mc, source.path)
            tokenizer = _tokenizer(config, source)
            dtype = resolve_dtype(config.dtype, device, mc.torch_dtype)
            model = source.load_weights(mc, dtype, device, quantization)
            packed = prepare_for_kernels(model, quantization, device, dtype, mc.vocab_size)
        finally:
            source.close()
    return LoadedModel(
        path=source.path,
        model_config=mc,
        tokenizer=tokenizer,
        model=model,
        device=device,
        dtype=dtype,
        quantization=quantization,
        gguf=source.summary,
        fuse_decoder=packed and _fuses_decoder(model),
    )


def prepare_for_kernels(
    model: Any, quantization: str | None, device: str, dtype: torch.dtype, vocab_size: int
) -> bool:
    """Quantizes (``quantization``) or packs the model's matrices into the CPU
    kernels' layout where that is the faster path; returns whether they are."""
    from fastllm.layers.linear import pack_linears, should_pack

    if device == "cpu":
        from fastllm import _core

        _core.simd_path()  # a bad FASTLLM_CPU_SIMD_PATH: a ValueError naming it
        _core.quant_default_path()  # the same for FASTLLM_CPU_INT_PATH
    if quantization is not None:
        from fastllm.layers.quantization import quantize_model

        quantize_model(model, quantization, vocab_size)
    elif should_pack(device, dtype):
        pack_linears(model)
    return device == "cpu" and getattr(model, "packed_head", None) is not None


def _fuses_decoder(model: Any) -> bool:
    """Whether the runner fuses this packed CPU model's decoder layers."""
    from fastllm.envs import cpu_fused

    return cpu_fused() and callable(getattr(model, "fuse_decoder_layers", None))


def _tokenizer(config: EngineConfig, source: WeightSource) -> Tokenizer | None:
    """The tokenizer: ``tokenizer=...``, else the source's own (a GGUF file's),
    else the folder's ``tokenizer.json``; None without one (vLLM's
    ``skip_tokenizer_init``, or random weights from a folder holding only
    ``config.json``: prompts are token ids and outputs carry no text)."""
    from fastllm.tokenizer import Tokenizer

    if config.skip_tokenizer_init:
        return None
    folder = source.path
    if config.tokenizer:
        folder = resolve_model_folder(
            config.tokenizer, config.tokenizer_revision, config.download_dir
        )
    if config.load_format == "dummy" and not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    if not config.tokenizer:
        own = source.tokenizer()
        if own is not None:
            return own
    return Tokenizer(folder)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while a model loads. A load makes
    hundreds of thousands of objects that form no cycles (a GGUF vocabulary's
    strings and merges), and every collection they set off walks all of
    torch's objects too (a 152k-token GGUF header and tokenizer: 104 -> 99 ms)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
