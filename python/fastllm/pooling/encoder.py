"""Encoder models as pooling runners: embeddings and cross-encoder scores.

``load_encoder(config)`` builds a BERT, RoBERTa / XLM-RoBERTa, DistilBERT,
MPNet, ModernBERT, Nomic BERT, GTE or EmbeddingGemma encoder (``bert.py``,
``modernbert.py``, ``rotary_bert.py``, ``gemma_encoder.py``) from a folder's safetensors, reads how it pools
(``st_config.py``), and packs or quantizes its linear layers for the CPU
kernels as ``loading.prepare_for_kernels`` does for decoders.
``EncoderRunner`` runs batches packed into one row per token, with no
padding and no KV cache (``encoder_layers.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from fastllm.config import EngineConfig, ModelConfig, resolve_dtype
from fastllm.engine.model_runner import torch_threads
from fastllm.layers import Module
from fastllm.layers.linear import Linear
from fastllm.models.loader import Checkpoint
from fastllm.pooling.bert import BERT_ARCHITECTURES, BertEncoder
from fastllm.pooling.encoder_layers import PackedInputs
from fastllm.pooling.gemma_encoder import GemmaEncoder, is_gemma_encoder
from fastllm.pooling.modernbert import MODERNBERT_ARCHITECTURES, ModernBertEncoder
from fastllm.pooling.rotary_bert import ROTARY_BERT_ARCHITECTURES, RotaryBertEncoder
from fastllm.pooling.runner import PoolerConfig
from fastllm.pooling.st_config import DenseLayer, read_json, read_st_pooling
from fastllm.tokenizer import Tokenizer

logger = logging.getLogger("fastllm")

#: every architecture ``load_encoder`` runs
ENCODER_ARCHITECTURES: tuple[str, ...] = (
    *BERT_ARCHITECTURES,
    *MODERNBERT_ARCHITECTURES,
    *ROTARY_BERT_ARCHITECTURES,
)
#: checkpoint prefixes of the encoder part (``BertFor*``: ``bert.``, ...)
_PREFIXES = (
    "",
    "bert.",
    "roberta.",
    "distilbert.",
    "mpnet.",
    "model.",
    "nomic_bert.",
    "gte.",
    "new.",
)
#: an encoder module of any family
Encoder = BertEncoder | ModernBertEncoder | RotaryBertEncoder | GemmaEncoder
#: rows per forward pass at most (whole inputs; a longer input runs alone)
MAX_BATCH_TOKENS = 8192
#: Forwards of at most this many tokens run with one torch thread
#: (``EncoderRunner._torch_threads``).
SMALL_FORWARD_TOKENS = 2048


def is_encoder_architecture(architectures: list[str], hf: dict[str, Any] | None = None) -> bool:
    """Whether a config.json (its ``architectures``, and the whole ``hf`` where
    the architecture alone does not tell: EmbeddingGemma's bidirectional Gemma
    3) names an encoder ``load_encoder`` runs."""
    if hf is not None and is_gemma_encoder(architectures, hf):
        return True
    return bool(architectures) and architectures[0] in ENCODER_ARCHITECTURES


class EncoderModel(Module):
    """The encoder and the Dense layers after its pooling: one module, so one
    ``prepare_for_kernels`` call packs or quantizes all their linear layers."""

    def __init__(self, encoder: Encoder, dense: list[DenseLayer]) -> None:
        super().__init__()
        self.encoder = encoder
        self.dense = torch.nn.ModuleList(dense)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the model's last linear layer. An encoder has no
        language-model head; the kernels' preparation packs this one as its
        head, and the layer then shares that packed copy."""
        last = [m for m in self.modules() if isinstance(m, Linear)][-1]
        return last.weight, last.bias


class EncoderRunner:
    """A loaded encoder: the ``PoolingRunner`` protocol (``runner.py``)."""

    def __init__(
        self,
        model: EncoderModel,
        tokenizer: Tokenizer,
        max_model_len: int,
        pooler: PoolerConfig,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.encoder = model.encoder
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.pooler = pooler
        self.num_labels = model.encoder.num_labels
        self.device = device
        #: whether the linear layers run the Rust GEMM (packed by
        #: ``prepare_for_kernels`` before the runner is made; ``_torch_threads``)
        self._packed = any(m.packed is not None for m in model.modules() if isinstance(m, Linear))
        self.type_vocab_size = (
            model.encoder.token_type_embeddings.num_embeddings if model.encoder.uses_type_ids else 1
        )

    def tokenize(self, text: str, pair: str | None = None) -> tuple[list[int], list[int] | None]:
        """Token ids with the special tokens, and token types where the model
        reads them (BERT: 0 for ``text``, 1 for ``pair``; RoBERTa and
        ModernBERT: None)."""
        ids, types = self.tokenizer.encode_with_types(text, pair)
        return ids, (types if self.encoder.uses_type_ids else None)

    def pool(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's pooled vector (float32, CPU, not normalised), after the Dense layers."""
        out: list[torch.Tensor] = []
        for inputs, hidden in self._forward(batch):
            if self.pooler.pooling_type == "CLS":
                pooled = inputs.first_rows(hidden).float()
            elif self.pooler.pooling_type == "LAST":
                pooled = inputs.last_rows(hidden).float()
            else:
                pooled = inputs.mean_rows(hidden)
            for dense in self.model.dense:
                pooled = dense(pooled)
            out.extend(pooled.float().cpu().unbind(0))
        return out

    def classify(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's classifier logits (float32, CPU, no activation)."""
        if self.num_labels is None:
            raise ValueError(
                "this model has no classification head (a *ForSequenceClassification "
                "architecture scores and classifies)"
            )
        out: list[torch.Tensor] = []
        for inputs, hidden in self._forward(batch):
            out.extend(self.encoder.classify(hidden, inputs).float().cpu().unbind(0))
        return out

    def _forward(
        self, batch: list[tuple[list[int], list[int] | None]]
    ) -> Iterator[tuple[PackedInputs, torch.Tensor]]:
        """(packed inputs, last hidden states) of each chunk of ``batch``, in order."""
        self._check(batch)
        chunk: list[tuple[list[int], list[int] | None]] = []
        rows = 0
        for item in [*batch, None]:
            if chunk and (item is None or rows + len(item[0]) > MAX_BATCH_TOKENS):
                inputs = PackedInputs.from_batch(chunk, self.device)
                with torch.inference_mode(), torch_threads(self._torch_threads(rows)):
                    hidden = self.encoder(inputs)
                yield inputs, hidden
                chunk, rows = [], 0
            if item is not None:
                chunk.append(item)
                rows += len(item[0])

    def _torch_threads(self, tokens: int) -> int | None:
        """torch's intra-op threads for a forward of ``tokens`` rows: one for a
        small forward while the Rust GEMM runs the linear layers, else
        torch's own count. Between its elementwise ops torch's OpenMP workers
        spin on the cores the GEMM's threads need; the decoder's step sets one
        thread for the same reason (``model_runner.torch_threads``). Measured
        on 2 cores, BERT-base in bf16: one 128-token input took 80 ms instead
        of 146; batches of 48 inputs (13k tokens) ran 0.94-0.97x as fast with
        one thread, so large forwards keep torch's count."""
        if tokens > SMALL_FORWARD_TOKENS:
            return None
        return 1 if self._packed else None

    def _check(self, batch: list[tuple[list[int], list[int] | None]]) -> None:
        """A ValueError naming the first input that cannot run, before any work."""
        vocab = self.encoder.vocab_size
        for i, (ids, types) in enumerate(batch):
            if not ids:
                raise ValueError(f"input {i} has no tokens")
            if len(ids) > self.max_model_len:
                raise ValueError(
                    f"input {i} has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {i} has a token id outside the vocabulary [0, {vocab})")
            if types is not None and (
                len(types) != len(ids) or min(types) < 0 or max(types) >= self.type_vocab_size
            ):
                raise ValueError(
                    f"input {i}: token type ids must be one per token, each in "
                    f"[0, {self.type_vocab_size})"
                )


def load_encoder(config: EngineConfig) -> EncoderRunner:
    """The encoder of ``config.model`` (a folder, a cached hub id, or a GGUF
    file: ``_load_gguf_encoder``), ready to run.

    dtype: float32 on the CPU unless bfloat16 is asked for; ``quantization``
    ("int8", "int4", ...) quantizes every linear layer and the word
    embeddings for the CPU's integer kernels; ``max_model_len``: at most the
    position table's length (default: that, or sentence-transformers'
    ``max_seq_length`` when smaller)."""
    from fastllm.layers.quantization import resolve_quantization
    from fastllm.loading import (
        is_gguf_file,
        prepare_for_kernels,
        resolve_model_folder,
        with_overrides,
    )
    from fastllm.platform import resolve_device

    quantization = resolve_quantization(config.quantization)
    device = resolve_device(config.device)
    if quantization is not None and device != "cpu":
        raise ValueError(
            f"quantization={config.quantization!r} runs on the CPU's integer kernels, "
            f"not on device {device!r}: pass device='cpu', or quantization=None"
        )
    if is_gguf_file(config.model):
        return _load_gguf_encoder(config, quantization, device)
    folder = resolve_model_folder(config.model, config.revision, config.download_dir)
    mc = with_overrides(ModelConfig.from_pretrained(folder), config.hf_overrides, folder)
    if not is_encoder_architecture([mc.architecture], mc.hf):
        raise ValueError(
            f"{os.path.join(folder, 'config.json')}: architecture {mc.architecture!r} is not "
            f"an encoder fastllm runs; supported: {', '.join(ENCODER_ARCHITECTURES)}"
        )
    dtype = encoder_dtype(config.dtype, device, mc.torch_dtype)
    encoder = build_encoder(mc.hf, mc.architecture)
    load_encoder_weights(encoder, folder, dtype, device)
    pooler, dense = read_st_pooling(folder, mc.hidden_size, "MEAN", mc.hf)
    model = EncoderModel(encoder, dense).to(device).eval()
    prepare_for_kernels(model, quantization, device, dtype, mc.vocab_size)
    tokenizer_folder = folder
    if config.tokenizer:
        tokenizer_folder = resolve_model_folder(
            config.tokenizer, config.tokenizer_revision, config.download_dir
        )
    max_len = encoder_max_len(folder, encoder.max_positions, config.max_model_len)
    return EncoderRunner(model, Tokenizer(tokenizer_folder), max_len, pooler, device)


def _load_gguf_encoder(
    config: EngineConfig, quantization: str | None, device: str
) -> EncoderRunner:
    """The encoder of a GGUF file (``fastllm.gguf.encoder``): configured from
    its metadata, its tokenizer from its vocabulary, pooled as its
    ``pooling_type`` says and normalised; quantized linear layers run as
    stored, float ones as ``dtype`` / ``quantization`` say."""
    from fastllm.gguf import open_file
    from fastllm.gguf.encoder import (
        GGUFEncoderCheckpoint,
        encoder_config,
        encoder_pooling,
        pack_quantized_linears,
    )
    from fastllm.gguf.loader import LoadReport
    from fastllm.gguf.tokenizer import tokenizer_from_metadata
    from fastllm.loading import prepare_for_kernels

    if config.load_format not in ("auto", "gguf"):
        raise ValueError(
            f"load_format={config.load_format!r} does not apply to a GGUF file; use 'auto' or 'gguf'"
        )
    with open_file(config.model) as gguf:
        hf = encoder_config(gguf)
        pooling = encoder_pooling(gguf)
        architecture = hf["architectures"][0]
        tokenizer = None
        if config.tokenizer:
            from fastllm.loading import resolve_model_folder

            tokenizer = Tokenizer(
                resolve_model_folder(
                    config.tokenizer, config.tokenizer_revision, config.download_dir
                )
            )
        else:
            tokenizer = tokenizer_from_metadata(gguf.metadata, gguf.path)
        mc = ModelConfig.from_dict(hf, path=config.model)
        dtype = encoder_dtype(config.dtype, device, None)
        encoder = build_encoder(hf, architecture)
        checkpoint = GGUFEncoderCheckpoint(gguf, hf)
        load_encoder_weights(encoder, checkpoint, dtype, device)
        report = LoadReport(tensor_types={})
        if device != "cpu" and any(
            t.type.name not in ("F32", "F16", "BF16") for t in gguf.tensors.values()
        ):
            raise ValueError(
                f"{gguf.path}: quantized GGUF tensors run on the CPU's integer kernels, "
                f"not on device {device!r}: pass device='cpu'"
            )
        pack_quantized_linears(encoder, checkpoint, report)
    pooler = PoolerConfig(pooling_type=pooling, normalize=True, dimensions=mc.hidden_size)
    model = EncoderModel(encoder, []).to(device).eval()
    last = [m for m in model.modules() if isinstance(m, Linear)][-1]
    if last.packed is not None:  # quantized in the file: the kernels' head is ready
        model.packed_head = last.packed
    prepare_for_kernels(model, quantization, device, dtype, mc.vocab_size)
    max_len = encoder.max_positions
    if config.max_model_len is not None:
        max_len = encoder_max_len(config.model, max_len, config.max_model_len)
    return EncoderRunner(model, tokenizer, max_len, pooler, device)


def encoder_dtype(dtype: Any, device: str, config_dtype: str | None) -> torch.dtype:
    """float32 on the CPU for ``"auto"`` (encoders are small and bfloat16 costs
    accuracy); otherwise ``resolve_dtype``'s rules."""
    if device == "cpu" and dtype == "auto":
        return torch.float32
    return resolve_dtype(dtype, device, config_dtype)


def build_encoder(hf: dict[str, Any], architecture: str) -> Encoder:
    """The encoder module of ``architecture``, its parameters on the meta device."""
    with torch.device("meta"):
        if is_gemma_encoder([architecture], hf):
            return GemmaEncoder(hf, architecture)
        if architecture in BERT_ARCHITECTURES:
            return BertEncoder(hf, architecture)
        if architecture in ROTARY_BERT_ARCHITECTURES:
            return RotaryBertEncoder(hf, architecture)
        return ModernBertEncoder(hf, architecture)


def encoder_max_len(folder: str, positions: int, requested: int | None) -> int:
    """``max_model_len``: ``requested`` (at most ``positions``), else the
    positions or sentence-transformers' ``max_seq_length`` when smaller."""
    if requested is not None:
        if requested > positions:
            raise ValueError(
                f"max_model_len={requested} is more than this encoder's {positions} positions"
            )
        return requested
    st_path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(st_path):
        limit = read_json(st_path).get("max_seq_length")
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < positions:
            return limit
    return positions


def load_encoder_weights(
    encoder: Encoder, source: str | Any, dtype: torch.dtype, device: str
) -> None:
    """Reads every parameter of ``encoder`` from a folder's safetensors, or from
    a checkpoint object of the same reading interface (a GGUF file's,
    ``gguf.encoder.GGUFEncoderCheckpoint``): the encoder's tensors under
    whichever prefix the checkpoint uses, fused parameters concatenated;
    checks every shape first, and assigns them all."""
    folder = source if isinstance(source, str) else source.files[0]
    with Checkpoint(source) if isinstance(source, str) else source as tensors:
        probe = encoder.checkpoint_probe()
        prefix = next((p for p in _PREFIXES if p + probe in tensors.location), None)
        if prefix is None:
            raise ValueError(f"{folder}: no tensor {probe!r} (under any of {_PREFIXES})")
        sources = encoder.checkpoint_sources(prefix, set(tensors.location))
        plan = []
        for pname, param in encoder.named_parameters():
            names = [_stored_name(tensors, n) for n in sources[pname]]
            shapes = [tensors.shape(n) for n in names]
            rows = sum(s[0] for s in shapes)
            if any(s[1:] != tuple(param.shape[1:]) for s in shapes) or rows != param.shape[0]:
                raise ValueError(
                    f"{folder}: tensors {names} have shapes {[list(s) for s in shapes]}, "
                    f"expected {list(param.shape)} for {pname}"
                )
            plan.append((pname, names))
        state = {}
        for pname, names in plan:
            parts = [tensors.read(n) for n in names]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
            if hasattr(encoder, "loaded"):  # a layout the module reorders
                t = encoder.loaded(pname, t)
            moved = t.to(device=device, dtype=dtype).contiguous()
            # a tensor read from the file views its memory map: own a copy
            state[pname] = moved.clone() if moved.data_ptr() == t.data_ptr() else moved
    encoder.load_state_dict(state, strict=True, assign=True)


def _stored_name(ckpt: Checkpoint, name: str) -> str:
    """``name`` as the checkpoint stores it: as it is, or in the older spelling
    of LayerNorm parameters (``gamma`` / ``beta``)."""
    if name in ckpt.location:
        return name
    old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
        "LayerNorm.bias", "LayerNorm.beta"
    )
    if old in ckpt.location:
        return old
    raise ValueError(f"missing tensor {name!r} in {', '.join(ckpt.files)}")
