"""FP8 weights: e4m3 codes with one fp32 scale per output channel (compressed-tensors "float-quantized",
channel strategy, the layout vLLM serves).

    W[n, k] ~= weight[n, k] * weight_scale[n, 0]     weight float8_e4m3fn [N, K], weight_scale fp32 [N, 1]

The scale maps each row's absolute maximum onto e4m3's largest finite value (448); the codes are torch's cast to
float8_e4m3fn (round to nearest even) of the scaled row, so the row maximum is exact. An all-zero row gets scale 1
and zero codes. Activations are quantized per token when the matmul runs on FP8 tensor cores
(`qerl.kernels.fp8_matmul`); this module only stores weights.
"""

import torch

from .errors import check_weight
from .fp4 import decode_e2m1, unpack_fp4
from .nvfp4 import BLOCK as NVFP4_BLOCK

BLOCK = 1  # one scale per output channel: any K
TENSOR_NAMES = ("weight", "weight_scale")
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize_fp8(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """w [N, K] float -> {"weight": float8_e4m3fn [N, K], "weight_scale": fp32 [N, 1]}. global_scale: unused (the
    per-channel scale is fp32)."""
    check_weight(w, BLOCK, "fp8")
    w = w.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored tensors -> W [N, K] in dtype (the product formed in fp32, then rounded once)."""
    return (weight.float() * weight_scale.float()).to(dtype)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations per token: x [M, K] float -> (float8_e4m3fn [M, K], fp32 scale [M, 1]) as `quantize_fp8` does
    for weight rows (x ~= codes * scale)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def nvfp4_as_fp8(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 tensors -> the fp8 format's tensors a W4A8 product multiplies: each E2M1 code times its E4M3 block
    scale (exact in fp32, up to 5 significant bits) rounded to e4m3 after a per-row power-of-two shift that puts
    the row's largest value in (224, 448]; the shift over the global scale is the row's fp32 scale. {"weight": float8_e4m3fn [N, K],
    "weight_scale": fp32 [N, 1]}; benchmarks/w4a8_weights.py measures the rounding (about 4% of NVFP4's own error)."""
    codes = unpack_fp4(weight_packed)
    n, k = codes.shape
    v = (decode_e2m1(codes).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
         * weight_scale.float().unsqueeze(-1)).reshape(n, k)
    codes, shift = _rows_to_e4m3(v)
    return {"weight": codes, "weight_scale": shift / weight_global_scale.float().reshape(1, 1)}


def _rows_to_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [N, K] fp32 -> (e4m3 codes of v / shift, shift [N, 1]): a per-row power-of-two shift putting the row's
    largest value in (224, 448], so a value of at most 4 significant bits within e4m3's range converts exactly."""
    amax = v.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    shift = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    return (v / shift).to(torch.float8_e4m3fn), shift


def mxfp4_as_fp8(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 tensors -> fp8 tensors: an E2M1 code times a power-of-two (E8M0) scale converts to e4m3 exactly while
    the row's scales span e4m3's range (a block more than 2^17 below the row's largest falls into its
    subnormals). {"weight": float8_e4m3fn [N, K], "weight_scale": fp32 [N, 1]}."""
    from .mxfp4 import dequantize_mxfp4

    codes, shift = _rows_to_e4m3(dequantize_mxfp4(weight_packed, weight_scale))
    return {"weight": codes, "weight_scale": shift}


def as_fp8(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A 4-bit format's tensors as the fp8 tensors a W4A8 product multiplies (`nvfp4_as_fp8`, `mxfp4_as_fp8`)."""
    if fmt == "nvfp4":
        return nvfp4_as_fp8(**tensors)
    if fmt == "mxfp4":
        return mxfp4_as_fp8(**tensors)
    raise ValueError(f"FP8 compute takes nvfp4 or mxfp4 weights, not {fmt}")
