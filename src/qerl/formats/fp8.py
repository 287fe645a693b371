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
