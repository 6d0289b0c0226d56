"""fastllm: LLM inference for Python with a Rust core.

Importing this package is cheap and safe everywhere: it imports neither torch
nor any GPU driver. Every public name is resolved lazily on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastllm.lazy import lazy_attribute

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "LLM": "fastllm.llm",
    "TextPrompt": "fastllm.inputs",
    "TokensPrompt": "fastllm.inputs",
    "SamplingParams": "fastllm.sampling_params",
    "RequestOutputKind": "fastllm.sampling_params",
    "StructuredOutputsParams": "fastllm.sampling_params",
    "RequestOutput": "fastllm.outputs",
    "CompletionOutput": "fastllm.outputs",
    "PoolingParams": "fastllm.pooling.params",
    "EmbeddingRequestOutput": "fastllm.outputs",
    "ScoringRequestOutput": "fastllm.outputs",
    "ClassificationRequestOutput": "fastllm.outputs",
    "probe": "fastllm.platform",
    "ProbeReport": "fastllm.platform",
    "DeviceInfo": "fastllm.platform",
    "device_count": "fastllm.platform",
    "cuda_available": "fastllm.platform",
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.inputs import TextPrompt, TokensPrompt
    from fastllm.llm import LLM
    from fastllm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from fastllm.platform import DeviceInfo, ProbeReport, cuda_available, device_count, probe
    from fastllm.pooling.params import PoolingParams
    from fastllm.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    return lazy_attribute("fastllm", _LAZY, globals(), name)


def __dir__() -> list[str]:
    return __all__
