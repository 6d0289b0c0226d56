"""fastllm.layers."""

import torch
from torch import nn

# Element types of the Rust CPU kernels (packed GEMM, attention, RMSNorm,
# SiLU-and-mul, rotary); other dtypes run torch.
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# Marks a parameter the loaders keep in float32 whatever the model's dtype.
_FLOAT32 = "_fastllm_float32"


def float32_parameter(t: torch.Tensor) -> nn.Parameter:
    """A frozen parameter that the loaders (folder, GGUF, dummy) keep in
    float32 in a model of any dtype, as the model's reference implementation
    keeps it (LFM2-MoE's ``expert_bias`` buffer)."""
    p = nn.Parameter(t.float(), requires_grad=False)
    setattr(p, _FLOAT32, True)
    return p


def load_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a loader gives parameter ``name`` of ``model`` (built, not
    yet loaded) in a model of ``dtype``."""
    return torch.float32 if getattr(model.get_parameter(name), _FLOAT32, False) else dtype


class Module(nn.Module):
    """An ``nn.Module`` whose call is its ``forward``.

    ``nn.Module.__call__`` runs the hook machinery (forward hooks,
    pre-hooks, tracing state) on every call: a few microseconds each, and a
    decode step makes about 270 module calls, so on a 0.5B model that is
    several percent of a step. fastllm's layers and models use no hooks, so
    every subclass that defines ``forward`` is called straight through it.
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward
