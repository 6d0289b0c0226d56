"""fastllm.layers."""

import torch

# Element types of the Rust CPU kernels (packed GEMM, attention, RMSNorm,
# SiLU-and-mul, rotary); other dtypes run torch.
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
