"""y = x @ W^T and its input gradient for an MXFP4 weight (E8M0 scale per 32 inputs, no global scale).

The public entry for MXFP4 products, routed like `nvfp4_matmul` (`route.route`): on CUDA bf16/fp16 the Triton
kernels of `triton.fp4` (tl.dot with W decoded in registers, or one-pass dequantize + cuBLAS; one kernel
family serves both formats), everything else the plain-torch reference (dequantize into a temporary for this
call only).
"""

import torch
import torch.nn.functional as F

from ..formats.mxfp4 import dequantize_mxfp4
from . import route as rt


def _backend(op: str, t: torch.Tensor, weight_packed: torch.Tensor) -> str:
    return rt.route("mxfp4", rt.rows(t), weight_packed.shape[0], weight_packed.shape[1] * 2, rt.kernel_capability(t),
                    op=op, dtype=t.dtype, unavailable=rt.unavailable())


def mxfp4_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype; weight_packed uint8 [N, K/2], weight_scale uint8 exponents [N, K/32]."""
    backend = _backend("forward", x, weight_packed)
    if backend == rt.TORCH_DEQUANTIZE:
        w = dequantize_mxfp4(weight_packed, weight_scale, dtype=x.dtype)
    else:
        from .triton import fp4 as tk

        if backend == rt.TRITON_DOT:
            return tk.mxfp4_linear_triton(x, weight_packed, weight_scale, bias)
        w = tk.mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def mxfp4_linear_grad_input(grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor
                            ) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    backend = _backend("grad_input", grad_out, weight_packed)
    if backend == rt.TORCH_DEQUANTIZE:
        return grad_out @ dequantize_mxfp4(weight_packed, weight_scale, dtype=grad_out.dtype)
    from .triton import fp4 as tk

    if backend == rt.TRITON_DOT:
        return tk.mxfp4_grad_input_triton(grad_out, weight_packed, weight_scale)
    return grad_out @ tk.mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=grad_out.dtype)
