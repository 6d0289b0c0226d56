"""Text encoders from GGUF files: the embedding models llama.cpp's converter
writes (``bert``: BERT, DistilBERT and their sentence-transformers
fine-tunes such as all-MiniLM, bge, e5, mxbai-embed, snowflake-arctic-embed,
and XLM-RoBERTa ones with a SentencePiece vocabulary: bge-m3,
multilingual-e5; ``nomic-bert``: nomic-embed-text v1 / v1.5).

``encoder_config`` turns the file's metadata into the ``config.json`` dict of
the matching Hugging Face encoder (``BertModel`` / ``NomicBertModel``), so the
encoder is built as it is from a folder (``fastllm.pooling.encoder``).
``GGUFEncoderCheckpoint`` presents the file's tensors under that folder's
tensor names (float, dequantized where stored quantized), which
``load_encoder_weights`` reads like safetensors; ``pack_quantized_linears``
then hands every quantized linear layer to the integer kernels as stored
(``loader._quantized``: Q8_0, Q4_0, Q4_1, IQ4_NL bit for bit; the other
types converted to q8_0 as for decoders). Embedding tables are read as
float. ``encoder_pooling`` is the file's ``{arch}.pooling_type``.

What a GGUF file does not say, and what fastllm takes instead:
- whether embeddings are normalised: they are (llama.cpp's default too;
  ``PoolingParams(normalize=False)`` gives the raw vectors);
- the activation: GELU (BERT's ``hidden_act`` in every such checkpoint),
  SwiGLU for Nomic BERT;
- whether the WordPiece vocabulary lowercases: ``gguf/tokenizer.py`` decides
  from the vocabulary (no token with an upper-case letter: lowercased).

An XLM-RoBERTa file (a ``bert`` file with a ``t5`` vocabulary) loads as
``XLMRobertaModel``, its position table's first pad + 1 rows (which the
converter cut) put back as zeros, so that positions count as RoBERTa's do;
with ``pooling_type`` rank it is a reranker, ``XLMRobertaForSequenceClassification``
(``cls`` / ``cls.output``: its head's dense and output layers). A BERT
reranker file is an error (the converter drops BERT's pooler layer, which
its head needs), as are Nomic's mixture-of-experts encoder
(``nomic-bert-moe``) and the other encoder architectures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fastllm.gguf.config import ENCODER_ARCHITECTURES, _float, _int
from fastllm.gguf.loader import (
    FLOAT_TYPES,
    LoadReport,
    _float_tensor,
    _Param,
    _quantized,
    _source,
)
from fastllm.gguf.reader import GGUFError, GGUFFile

#: llama.cpp's ``pooling_type`` values -> fastllm's pooling
_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}
_POOLING_RANK = 4
#: the vocabularies each architecture loads with: BERT's WordPiece (``bert``),
#: and XLM-RoBERTa's SentencePiece Unigram (``t5``: bge-m3, multilingual-e5;
#: its position table cut to start at the first token, as the converter writes it)
_VOCABULARIES = {"bert": ("bert", "t5"), "nomic-bert": ("bert",)}
#: Nomic BERT's rotary base when the file has none (its release's default)
_NOMIC_ROPE_BASE = 1000.0


def is_encoder_file(gguf: GGUFFile) -> bool:
    """Whether the file holds a text encoder: its architecture is one of
    ``ENCODER_ARCHITECTURES`` or another encoder family llama.cpp writes
    (named by ``encoder_config``'s error)."""
    arch = gguf.get("general.architecture")
    return arch in ENCODER_ARCHITECTURES or arch in _OTHER_ENCODERS


#: encoder families llama.cpp's converter writes that fastllm does not load from GGUF
_OTHER_ENCODERS = ("nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert")


def encoder_config(gguf: GGUFFile) -> dict[str, Any]:
    """The ``config.json`` dict of the file's encoder (``architectures``,
    sizes, positions, token types, norm epsilon, rotary base)."""
    arch = gguf.get("general.architecture")
    if arch not in ENCODER_ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: general.architecture {arch!r} is not an encoder fastllm loads "
            f"from GGUF; supported: {', '.join(ENCODER_ARCHITECTURES)} (load the model's "
            "Hugging Face folder instead)"
        )
    p = f"{arch}."
    vocab = gguf.get("tokenizer.ggml.model")
    if vocab not in _VOCABULARIES[arch]:
        raise GGUFError(
            f"{gguf.path}: a {arch} encoder with tokenizer.ggml.model {vocab!r} is not supported "
            f"(supported: {', '.join(_VOCABULARIES[arch])}; a RoBERTa-style BPE vocabulary "
            "is not); load the model's Hugging Face folder"
        )
    if gguf.get(p + "attention.causal") is True:
        raise GGUFError(f"{gguf.path}: {p}attention.causal is true; an encoder attends both ways")
    tensors = gguf.tensors
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    hidden = _int(gguf, p + "embedding_length")
    heads = _int(gguf, p + "attention.head_count")
    hf: dict[str, Any] = {
        "architectures": [ENCODER_ARCHITECTURES[arch]],
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "hidden_size": hidden,
        "num_hidden_layers": _int(gguf, p + "block_count"),
        "num_attention_heads": heads,
        "intermediate_size": _int(gguf, p + "feed_forward_length"),
        "max_position_embeddings": _int(gguf, p + "context_length"),
        "layer_norm_eps": _float(gguf, p + "attention.layer_norm_epsilon", 1e-12),
        "type_vocab_size": (
            int(tensors["token_types.weight"].shape[0]) if "token_types.weight" in tensors else 0
        ),
    }
    rank = _pooling_value(gguf) == _POOLING_RANK
    if rank and not (arch == "bert" and vocab == "t5"):
        raise GGUFError(
            f"{gguf.path}: {p}pooling_type is rank (a reranker's head), which fastllm reads "
            "for XLM-RoBERTa rerankers only (llama.cpp's converter drops BERT's pooler "
            "layer, so a BERT cross-encoder's scores cannot be computed from the file); "
            "load the model's Hugging Face folder"
        )
    if arch == "bert":
        hf.update(hidden_act="gelu", position_embedding_type="absolute")
        rows = hf["max_position_embeddings"]
        if "position_embd.weight" in tensors:  # the table's rows are the positions
            rows = int(tensors["position_embd.weight"].shape[0])
        if vocab == "t5":
            # XLM-RoBERTa: the converter cut the table's first pad + 1 rows;
            # they are put back (unused) so positions count as RoBERTa's do
            pad = _int(gguf, "tokenizer.ggml.padding_token_id", 1)
            hf.update(
                architectures=[
                    "XLMRobertaForSequenceClassification" if rank else "XLMRobertaModel"
                ],
                model_type="xlm-roberta",
                pad_token_id=pad,
                max_position_embeddings=rows + pad + 1,
            )
            if rank:
                hf["num_labels"] = _classifier_labels(gguf)
                labels = gguf.get(p + "classifier.output_labels")
                if labels is not None and len(labels) == hf["num_labels"]:
                    hf["id2label"] = {str(i): str(v) for i, v in enumerate(labels)}
        else:
            hf.update(model_type="bert", max_position_embeddings=rows)
    else:
        hf.update(
            model_type="nomic_bert",
            hidden_act="silu",
            head_dim=hidden // heads,
            rope_theta=_float(gguf, p + "rope.freq_base", _NOMIC_ROPE_BASE),
        )
        scaling = gguf.get(p + "rope.scaling.type")
        if scaling not in (None, "none"):
            raise GGUFError(f"{gguf.path}: {p}rope.scaling.type {scaling!r} is not supported")
    return hf


def _pooling_value(gguf: GGUFFile) -> Any:
    """``{arch}.pooling_type``; rank for a file with a classification head
    that names none (llama.cpp's converter writes none for a reranker
    folder without sentence-transformers files)."""
    value = gguf.get(f"{gguf.get('general.architecture')}.pooling_type")
    if value is None and "cls.output.weight" in gguf.tensors:
        return _POOLING_RANK
    return value


def _classifier_labels(gguf: GGUFFile) -> int:
    """A reranker's labels: the rows of its output layer (``cls.output``)."""
    info = gguf.tensors.get("cls.output.weight")
    if info is None or "cls.weight" not in gguf.tensors:
        raise GGUFError(
            f"{gguf.path}: a rank pooling file needs its classification head, tensors "
            "'cls.weight' and 'cls.output.weight'"
        )
    return int(info.shape[0])


def encoder_pooling(gguf: GGUFFile) -> str:
    """The file's pooling (``MEAN`` when it names none, as sentence-transformers
    pools a bare encoder; ``CLS`` for a reranker, whose head reads that row)."""
    arch = gguf.get("general.architecture")
    value = _pooling_value(gguf)
    if value is None or value == 0:
        return "MEAN"
    if value == _POOLING_RANK:
        return "CLS"
    if value not in _POOLING:
        raise GGUFError(f"{gguf.path}: {arch}.pooling_type {value!r} is not a known pooling")
    return _POOLING[value]


def _names(arch: str, layers: int) -> Iterator[tuple[str, str]]:
    """(checkpoint tensor name, GGUF tensor name) pairs of the family's folder
    layout (BERT's; Nomic BERT's original release)."""
    emb = "embeddings."
    yield f"{emb}word_embeddings.weight", "token_embd.weight"
    yield f"{emb}token_type_embeddings.weight", "token_types.weight"
    yield f"{emb}position_embeddings.weight", "position_embd.weight"
    norm = f"{emb}LayerNorm" if arch == "bert" else "emb_ln"
    for kind in ("weight", "bias"):
        yield f"{norm}.{kind}", f"token_embd_norm.{kind}"
    if arch == "bert":
        parts = {
            "attention.self.query": "attn_q",
            "attention.self.key": "attn_k",
            "attention.self.value": "attn_v",
            "attention.output.dense": "attn_output",
            "attention.output.LayerNorm": "attn_output_norm",
            "intermediate.dense": "ffn_up",
            "output.dense": "ffn_down",
            "output.LayerNorm": "layer_output_norm",
        }
        layer = "encoder.layer"
    else:
        parts = {
            "attn.Wqkv": "attn_qkv",
            "attn.out_proj": "attn_output",
            "norm1": "attn_output_norm",
            "mlp.fc11": "ffn_up",
            "mlp.fc12": "ffn_gate",
            "mlp.fc2": "ffn_down",
            "norm2": "layer_output_norm",
        }
        layer = "encoder.layers"
    for i in range(layers):
        for theirs, ours in parts.items():
            for kind in ("weight", "bias"):
                yield f"{layer}.{i}.{theirs}.{kind}", f"blk.{i}.{ours}.{kind}"
    for kind in ("weight", "bias"):  # a reranker's RoBERTa-style head
        yield f"classifier.dense.{kind}", f"cls.{kind}"
        yield f"classifier.out_proj.{kind}", f"cls.output.{kind}"


class GGUFEncoderCheckpoint:
    """The encoder tensors of a GGUF file under a folder checkpoint's names:
    what ``load_encoder_weights`` reads (``location``, ``shape``, ``read``,
    ``files``), every tensor as float."""

    def __init__(self, gguf: GGUFFile, hf: dict[str, Any]) -> None:
        """``hf``: the file's ``encoder_config``."""
        self.gguf = gguf
        self.files = [gguf.path]
        arch = gguf.get("general.architecture")
        layers = _int(gguf, f"{arch}.block_count")
        #: checkpoint name -> GGUF tensor name, for the tensors the file has
        self.location = {n: g for n, g in _names(arch, layers) if g in gguf.tensors}
        #: rows the converter cut from the front of the position table (XLM-RoBERTa's)
        self.cut_positions = hf["pad_token_id"] + 1 if hf.get("model_type") == "xlm-roberta" else 0

    def __enter__(self) -> GGUFEncoderCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.gguf.tensors[self.location[name]].shape)
        if name.endswith("position_embeddings.weight"):
            shape = (shape[0] + self.cut_positions, *shape[1:])
        return shape

    def read(self, name: str) -> torch.Tensor:
        info = self.gguf.tensors[self.location[name]]
        t = _float_tensor(self.gguf, _source(self.gguf, info.name, tuple(info.shape)))
        if name.endswith("position_embeddings.weight") and self.cut_positions:
            t = torch.cat([t.new_zeros(self.cut_positions, t.shape[1]), t])
        return t


def pack_quantized_linears(
    encoder: torch.nn.Module, checkpoint: GGUFEncoderCheckpoint, report: LoadReport
) -> None:
    """Hands every linear layer whose GGUF tensors are quantized to the integer
    kernels as the file stores them (their float copies, read for the shape
    checks, are freed); float layers are left for ``prepare_for_kernels``."""
    from fastllm.layers.linear import Linear

    gguf = checkpoint.gguf
    sources = encoder.checkpoint_sources("", set(checkpoint.location))
    for name, module in encoder.named_modules():
        if not isinstance(module, Linear) or module.weight is None:
            continue
        pname = f"{name}.weight"
        infos = [gguf.tensors[checkpoint.location[s]] for s in sources[pname]]
        if all(info.type.name in FLOAT_TYPES for info in infos):
            continue
        param = _Param(
            pname,
            tuple(module.weight.shape),
            [_source(gguf, info.name, tuple(info.shape)) for info in infos],
        )
        bias = None if module.bias is None else module.bias.detach().float()
        module.pack(_quantized(gguf, param, bias, report))
