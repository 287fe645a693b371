"""FP8 weights (`qerl.formats.fp8`, or 4-bit weights decoded to them: `model.compute: fp8`) times 16-bit
activations.

On FP8 tensor cores (CUDA compute capability 8.9 and newer, bf16 activations, K and N multiples of 16) the
activations are quantized per token to e4m3 with an fp32 scale each (`quantize_rows_fp8`) and the product runs in
torch's `_scaled_mm` with row-wise scales and fp32 accumulation (W8A8, as the FP8 RL peers' forward). Elsewhere
(the CPU, older GPUs, other dtypes or shapes) the weight is dequantized and multiplied in x's dtype (W8A16): the
reference path. The input gradient is always the dequantized weight's (`qerl.kernels.dispatch`).
"""

import torch
import torch.nn.functional as F

from ..formats.fp8 import as_fp8, dequantize_fp8, quantize_rows_fp8


def fp8_tensor_cores(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fp8_linear(x, weight, ...)` runs as W8A8 on FP8 tensor cores."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and hasattr(torch, "_scaled_mm"))


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The W8A8 product in float64 from the same quantized operands: x [..., K] -> [..., N] float64."""
    q, s = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    y = (q.double() * s.double()) @ (weight.double() * weight_scale.double()).t()
    return y.reshape(*x.shape[:-1], weight.shape[0])


def emulated_w8a8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 numerics in fp32: x [..., K] rounded per token to e4m3, times the (already e4m3-valued) weight
    [N, K] fp32, plus bias; [..., N] in x.dtype."""
    q, s = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    y = F.linear((q.float() * s).reshape(x.shape), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


def w4a8_weight(fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit weight as W4A8 multiplies it (`as_fp8`), dense [N, K] in dtype: what the emulation caches."""
    return dequantize_fp8(**as_fp8(fmt, tensors), dtype=dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, emulate: bool = False) -> torch.Tensor:
    """x [..., K] -> x @ W^T (+ bias), [..., N] in x.dtype; weight float8_e4m3fn [N, K], weight_scale fp32 [N, 1].
    Where FP8 tensor cores cannot run it: the dequantized weight times x (W8A16), or with `emulate` the W8A8
    numerics in fp32 (x rounded per token as on the tensor cores, fp32 products: model.compute fp8's reference)."""
    if not fp8_tensor_cores(x, weight):
        if emulate:
            return emulated_w8a8(x, dequantize_fp8(weight, weight_scale), bias)
        return F.linear(x, dequantize_fp8(weight, weight_scale, x.dtype), None if bias is None else bias.to(x.dtype))
    bias = None if bias is None else bias.to(x.dtype)
    q, s = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.float().reshape(1, -1),
                         out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def check_compute(compute: str, device: torch.device) -> None:
    """ValueError for model.compute fp8 on a GPU without FP8 tensor cores (compute capability below 8.9); the CPU
    runs the same numerics emulated (the reference path)."""
    if compute == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"model.compute fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use model.compute bf16")
