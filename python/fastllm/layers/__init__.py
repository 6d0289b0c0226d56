"""fastllm.layers."""

import torch
from torch import nn

# Element types of the Rust CPU kernels (packed GEMM, attention, RMSNorm,
# SiLU-and-mul, rotary); other dtypes run torch.
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


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
