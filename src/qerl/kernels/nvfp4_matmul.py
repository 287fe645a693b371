"""y = x @ W^T and its input gradient for an NVFP4 weight, without keeping W in 16 bits.

CUDA bf16/fp16 inputs go to the Triton kernels: at decode sizes (forward, M <= triton_gate.SWAP_MAX_M, and
on sm_90 up to 128-256 rows, `triton_gate.wide_wgmma_wins`) the Gluon swap-AB kernel (`gluon_nvfp4`) where it
applies, else (M <= triton_gate.GEMV_ROUTE_MAX_M)
the CUDA-core kernel `triton_fp4_gemv`, otherwise the fused tensor-core kernels (`triton_nvfp4`, imported lazily), which decode W
tile by tile in registers. Everything else takes the plain-torch path, which is also the reference the
kernels are tested against: dequantize into a temporary that lives for this call only. On the CPU that is
the intended trade: speed matters less than staying small.
"""

import torch
import torch.nn.functional as F

from ..formats.nvfp4 import dequantize_nvfp4
from . import triton_gate


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> [..., N] in x.dtype.

    weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale fp32 [1].
    lora: optional (h [..., R], b [N, R]) in x.dtype: adds h @ b^T (a LoRA delta with h = x @ A^T and
    b = scaling * B), inside the decode kernel's launch where it can, else as one addmm.
    """
    if triton_gate.use_triton(x):
        from . import triton_nvfp4 as tk

        m, n, k = triton_gate.rows(x), weight_packed.shape[0], weight_packed.shape[1] * 2
        if triton_gate.swap_wins(m, n, k):
            y = tk.nvfp4_linear_swap(x, weight_packed, weight_scale, weight_global_scale, bias, lora=lora)
            if y is not None:
                return y
    return add_lora(_nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias), lora)


def add_lora(y: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """y [..., N] + h @ b^T for lora = (h [..., R], b [N, R]) as one addmm (y unchanged when lora is None).

    y must be a fresh result the caller owns (every caller passes its matmul's output): the sum is written
    into it. In place because an out-of-place addmm first copies y into a new tensor (one extra device copy
    per call: 112 per 7B decode step of the bf16 engine); same cuBLAS product, same bits."""
    if lora is None:
        return y
    h, b = lora
    y2 = y.reshape(-1, y.shape[-1])
    return y2.addmm_(h.reshape(-1, h.shape[-1]), b.t()).view(y.shape)


def _nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias):
    if triton_gate.use_triton(x):
        from . import triton_nvfp4 as tk

        m, n, k = triton_gate.rows(x), weight_packed.shape[0], weight_packed.shape[1] * 2
        if triton_gate.gemv_wins(m, n, k):
            return tk.nvfp4_linear_gemv(x, weight_packed, weight_scale, weight_global_scale, bias)
        if triton_gate.fused_wins(m, n, k):
            return tk.nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias)
        w = tk.nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def nvfp4_linear_grad_input(
    grad_out: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    if triton_gate.use_triton(grad_out):
        from . import triton_nvfp4 as tk

        if triton_gate.fused_wins(triton_gate.rows(grad_out), weight_packed.shape[0], weight_packed.shape[1] * 2):
            return tk.nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale)
        w = tk.nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale, dtype=grad_out.dtype)
        return grad_out @ w
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=grad_out.dtype)
    return grad_out @ w
