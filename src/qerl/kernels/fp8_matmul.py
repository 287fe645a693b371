"""FP8 weights (`qerl.formats.fp8`, or 4-bit weights decoded to them: `model.compute: fp8`) times 16-bit
activations.

On FP8 tensor cores (CUDA compute capability 8.9 and newer, bf16 activations, K and N multiples of 16) the
activations are quantized per token to e4m3 with an fp32 scale each (`quantize_rows_fp8`; on the GPU the Triton
kernel that gives the same bits) and the product runs in torch's `_scaled_mm` with row-wise scales and fp32
accumulation (W8A8, as the FP8 RL peers' forward). Elsewhere (the CPU, older GPUs, other dtypes or shapes) the
weight is dequantized and multiplied in x's dtype (W8A16): the reference path.

4-bit weights under `model.compute: fp8` (`w4a8_linear`): the same e4m3 activations times the weight's e4m3 codes
(`qerl.formats.fp8.nvfp4_as_fp8`), decoded into a temporary by one Triton pass (`qerl.kernels.triton.w4a8`) and
multiplied by `_scaled_mm`; below `w4a8_min_m` rows the bf16 kernels keep the product (there the decode costs more
than FP8 math saves). The CPU emulates the same numerics in fp32. The input gradient is always the dequantized
weight's, in 16 bits (`qerl.kernels.dispatch`).
"""

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats.fp8 import as_fp8, dequantize_fp8, fp4_row_shift, quantize_rows_fp8
from .operands import as_2d, scale_bytes
from .route import current_policy, use_triton


def fp8_tensor_cores(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fp8_linear(x, weight, ...)` runs as W8A8 on FP8 tensor cores."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and hasattr(torch, "_scaled_mm"))


def _quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, 1]): the Triton kernel on CUDA (one launch, same bits), else torch."""
    if x2.is_cuda and use_triton(x2):
        from .triton.w4a8 import quantize_rows_e4m3

        return quantize_rows_e4m3(x2)
    return quantize_rows_fp8(x2)


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
    q, s = _quantize_rows(as_2d(x))
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


@dataclass
class _Shift:
    """One weight's W4A8 row shifts, in tensors whose addresses never change (CUDA graphs bake them in)."""
    shift: torch.Tensor  # fp32 [N, 1]
    ws: torch.Tensor  # fp32 [N, 1]: shift / global scale (NVFP4) or shift (MXFP4)
    source: "weakref.ref[torch.Tensor]"  # the scale tensor object they were computed from
    versions: tuple[int, int]  # its version counter and the global scale's, at that time


# keyed by where the scales live (address, shape, strides), not by tensor object: the engine's fused sibling
# groups are fresh views of the same memory on every refresh, and a captured graph keeps reading the tensors it
# saw at capture, so an entry is refilled in place, never replaced or freed
_SHIFTS: dict[tuple, _Shift] = {}


def w4a8_shift(fmt: str, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows' power-of-two shifts, the fp8 weight scale = shift / global scale), fp32 [N, 1] each.

    Computed once per weight and kept at a fixed address: recomputed in place when the scale tensor object or
    the version counter of the scales or of the global scale differs from last time (a new view of the same
    memory, an in-place load), so a CUDA graph that captured a product reads current shifts on every replay."""
    scale = tensors["weight_scale"]
    gs = tensors.get("weight_global_scale") if fmt == "nvfp4" else None
    key = (fmt, scale.device, scale.data_ptr(), tuple(scale.shape), scale.stride(),
           None if gs is None else gs.data_ptr())
    versions = (scale._version, -1 if gs is None else gs._version)
    entry = _SHIFTS.get(key)
    if entry is not None and entry.source() is scale and entry.versions == versions:
        return entry.shift, entry.ws
    shift = fp4_row_shift(fmt, scale)
    ws = shift / gs.float().reshape(1, 1) if gs is not None else shift
    if entry is None:
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            return shift, ws  # recomputed by the graph on every replay; cached by the next eager call
        entry = _SHIFTS[key] = _Shift(shift, ws.clone() if ws is shift else ws, weakref.ref(scale), versions)
    else:  # same place, same shape: refill, keeping the addresses a captured graph may read
        entry.shift.copy_(shift)
        entry.ws.copy_(ws)
        entry.source, entry.versions = weakref.ref(scale), versions
    return entry.shift, entry.ws


W4A8_TENSOR_CORES, W4A8_BF16_KERNELS, W4A8_EMULATED = "tensor_cores", "bf16_kernels", "emulated"


def w4a8_path(fmt: str, x: torch.Tensor, n: int) -> str:
    """How a 4-bit product under model.compute fp8 runs x [..., K] against an [n, K] weight: on FP8 tensor cores
    (`w4a8_linear`: CUDA sm_89+, bf16 / fp16 x, Triton on, n a multiple of 16 as `_scaled_mm` needs, at least
    `w4a8_min_m` rows); with the 16-bit kernels on such a GPU below that row count
    (there decoding the weight costs more than FP8 math saves); emulated in fp32 elsewhere
    (the CPU: the reference numerics)."""
    if not (x.is_cuda and use_triton(x) and torch.cuda.get_device_capability(x.device) >= (8, 9)):
        return W4A8_EMULATED
    if x.numel() // max(1, x.shape[-1]) < current_policy().w4a8_min_m:
        return W4A8_BF16_KERNELS
    shapes_fit = x.shape[-1] % (32 if fmt == "mxfp4" else 16) == 0 and n % 16 == 0
    return W4A8_TENSOR_CORES if shapes_fit else W4A8_EMULATED


def w4a8_linear(fmt: str, x: torch.Tensor, tensors: dict[str, torch.Tensor],
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x.dtype on FP8 tensor cores (where `w4a8_path` says so):
    x rounded per token to e4m3 times the 4-bit weight's e4m3 codes (NVFP4: packed uint8 [N, K/2], e4m3 scales
    [N, K/16], fp32 global scale; MXFP4: packed, E8M0 scales [N, K/32]), fp32 accumulation."""
    from .triton import w4a8 as tk

    shift, ws = w4a8_shift(fmt, tensors)
    q, s = tk.quantize_rows_e4m3(as_2d(x))
    w = tk.fp4_to_e4m3(tensors["weight_packed"].contiguous(), scale_bytes(tensors["weight_scale"]), shift,
                       fmt == "mxfp4")  # temporary, freed on return
    y = torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws.reshape(1, -1), out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias.to(x.dtype)
