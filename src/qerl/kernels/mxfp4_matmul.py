"""y = x @ W^T and its input gradient for an MXFP4 weight (E8M0 scale per 32 inputs, no global scale).

Same routing as `nvfp4_matmul`: CUDA bf16/fp16 inputs use the fused Triton kernels (manual dequant in
registers, as for NVFP4, so one kernel family serves both formats), everything else the plain-torch
reference (dequantize into a temporary for this call only).
"""

import torch
import torch.nn.functional as F

from ..formats.mxfp4 import dequantize_mxfp4
from . import triton_gate


def mxfp4_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype; weight_packed uint8 [N, K/2], weight_scale uint8 exponents [N, K/32]."""
    if triton_gate.use_triton(x):
        from . import triton_nvfp4 as tk

        if triton_gate.fused_wins(triton_gate.rows(x), weight_packed.shape[0], weight_packed.shape[1] * 2):
            return tk.mxfp4_linear_triton(x, weight_packed, weight_scale, bias)
        w = tk.mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    w = dequantize_mxfp4(weight_packed, weight_scale, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def mxfp4_linear_grad_input(grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    if triton_gate.use_triton(grad_out):
        from . import triton_nvfp4 as tk

        if triton_gate.fused_wins(triton_gate.rows(grad_out), weight_packed.shape[0], weight_packed.shape[1] * 2):
            return tk.mxfp4_grad_input_triton(grad_out, weight_packed, weight_scale)
        return grad_out @ tk.mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=grad_out.dtype)
    return grad_out @ dequantize_mxfp4(weight_packed, weight_scale, dtype=grad_out.dtype)
