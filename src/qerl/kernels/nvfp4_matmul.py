"""y = x @ W^T and its input gradient for an NVFP4 weight, without keeping W in 16 bits.

Plain-torch path (CPU, and GPUs without the Triton kernels): dequantize into a temporary that lives for
this call only. On the CPU that is the intended trade: speed matters less than staying small.
"""

import torch
import torch.nn.functional as F

from ..formats.nvfp4 import dequantize_nvfp4


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> [..., N] in x.dtype.

    weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale fp32 [1].
    """
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def nvfp4_linear_grad_input(
    grad_out: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=grad_out.dtype)
    return grad_out @ w
