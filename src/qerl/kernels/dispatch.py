"""Route a quantized matmul to the entry point of its weight format."""

import torch
import torch.nn.functional as F

from ..formats import get_format
from ..formats.fp8 import as_fp8
from .dequant_cache import cached_dense_weight
from .fp8_matmul import (W4A8_EMULATED, W4A8_TENSOR_CORES, emulated_w8a8, fp8_linear, w4a8_linear, w4a8_path,
                         w4a8_weight)
from .route import current_policy, reads_dense_copy, rows, use_triton
from .bf16_matmul import bf16_linear
from .mxfp4_matmul import mxfp4_linear, mxfp4_linear_grad_input
from .nvfp4_matmul import nvfp4_linear, nvfp4_linear_grad_input
from .operands import add_lora


def _dequantize_linear(fmt: str, x: torch.Tensor, tensors: dict, bias: torch.Tensor | None) -> torch.Tensor:
    w = get_format(fmt).dequantize(**tensors, dtype=x.dtype)  # temporary, freed on return
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def _dequantize_grad_input(fmt: str, grad_out: torch.Tensor, tensors: dict) -> torch.Tensor:
    return grad_out @ get_format(fmt).dequantize(**tensors, dtype=grad_out.dtype)


def quantized_linear(
    fmt: str, x: torch.Tensor, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., K] -> x @ W^T + bias (+ h @ b^T for lora = (h [..., R], b [N, R])), [..., N] in x.dtype;
    W given as the format's tensors. The LoRA term rides in the NVFP4 / bf16 decode kernels where they apply."""
    path = None
    if fmt in ("nvfp4", "mxfp4") and current_policy().compute == "fp8":
        path = w4a8_path(fmt, x, tensors["weight_packed"].shape[0])
    if path == W4A8_TENSOR_CORES:
        return add_lora(w4a8_linear(fmt, x, tensors, bias), lora)
    if path == W4A8_EMULATED:
        # a dequantization scope (the CPU's passes) decodes each weight once, not per call (per decoded token)
        dense = cached_dense_weight(fmt, tensors, torch.float32, decode=w4a8_weight)
        if dense is not None:
            return add_lora(emulated_w8a8(x, dense, bias), lora)
        return add_lora(fp8_linear(x, **as_fp8(fmt, tensors), bias=bias, emulate=True), lora)
    # W4A8_BF16_KERNELS (a GPU's few rows) and compute bf16: the 16-bit products below; a kept dense copy where
    # it beats the 4-bit kernels (`route.reads_dense_copy`)
    dense = cached_dense_weight(fmt, tensors, x.dtype) if reads_dense_copy(fmt, rows(x), use_triton(x)) else None
    if dense is not None:
        return add_lora(F.linear(x, dense, None if bias is None else bias.to(x.dtype)), lora)
    if fmt == "nvfp4":
        return nvfp4_linear(x, **tensors, bias=bias, lora=lora)
    if fmt == "bf16":
        return bf16_linear(x, tensors["weight"], bias, lora)
    if fmt == "mxfp4":
        return add_lora(mxfp4_linear(x, **tensors, bias=bias), lora)
    if fmt == "fp8":
        return add_lora(fp8_linear(x, **tensors, bias=bias), lora)
    return add_lora(_dequantize_linear(fmt, x, tensors, bias), lora)


def quantized_linear_grad_input(fmt: str, grad_out: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    dense = cached_dense_weight(fmt, tensors, grad_out.dtype)
    if dense is not None:
        return grad_out @ dense
    if fmt == "nvfp4":
        return nvfp4_linear_grad_input(grad_out, **tensors)
    if fmt == "mxfp4":
        return mxfp4_linear_grad_input(grad_out, **tensors)
    return _dequantize_grad_input(fmt, grad_out, tensors)
