"""NVFP4 weights with compressed-tensors `nvfp4-pack-quantized` semantics (what vLLM loads).

W [N, K] is split into blocks of 16 consecutive inputs of one output row. Each block has an FP8 E4M3
scale; the tensor has one FP32 global scale, stored as a *divisor*:
    global_scale = 448 * 6 / amax(|W|)
    weight_scale = e4m3(clamp(global_scale * (block_amax / 6), +-448))   (0 -> 0.125, as compressed-tensors)
    W ~= e2m1(W / (weight_scale / global_scale)) * (weight_scale / global_scale)
Every operation is done in float32, in the same order as compressed-tensors, so results are bit-exact.
"""

import torch

from .errors import check_weight
from .fp4 import E2M1_MAX, decode_e2m1, pack_fp4, round_to_e2m1, unpack_fp4

BLOCK = 16
E4M3_MAX = 448.0
# compressed-tensors replaces a zero block scale by the smallest "safe" E4M3 value it uses, 0.125.
_ZERO_SCALE_REPLACEMENT = 0.125
TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_global_scale")


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """FP32 [1] divisor 448*6/amax(|w|); 1.0 for an all-zero tensor (nothing to scale)."""
    amax = w.detach().float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    scale = (E4M3_MAX * E2M1_MAX) / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's cast to float8_e4m3fn does not saturate: clamp first.
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize W [N, K] (any float dtype, K % 16 == 0) round-to-nearest-even.

    global_scale: optional FP32 [1] divisor shared with sibling layers (q/k/v, gate/up); it must be
    <= this tensor's own 448*6/amax or block scales would saturate.
    Returns {"weight_packed": uint8 [N, K/2], "weight_scale": float8_e4m3fn [N, K/16],
             "weight_global_scale": float32 [1]} on w's device.
    """
    check_weight(w, BLOCK, "nvfp4")
    w32 = w.detach().float()
    gs = nvfp4_global_scale(w32) if global_scale is None else global_scale.detach().float().reshape(1).to(w.device)
    if not (torch.isfinite(gs).all() and (gs > 0).all()):
        raise ValueError(f"nvfp4: global scale must be a positive finite number, got {gs.tolist()}")
    n, k = w32.shape
    blocks = w32.reshape(n, k // BLOCK, BLOCK)
    block_scale = _to_e4m3(gs * (blocks.abs().amax(dim=-1) / E2M1_MAX))
    zero = block_scale.float() == 0
    block_scale = torch.where(zero, torch.tensor(_ZERO_SCALE_REPLACEMENT, device=w.device), block_scale.float())
    block_scale = block_scale.to(torch.float8_e4m3fn)
    step = block_scale.float() / gs  # [N, K/16]: the value of one unit of an E2M1 code
    scaled = (blocks / step.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1(scaled).reshape(n, k)
    return {"weight_packed": pack_fp4(codes), "weight_scale": block_scale, "weight_global_scale": gs}


def dequantize_nvfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """packed uint8 [N, K/2], scale e4m3 [N, K/16], global fp32 [1] -> W [N, K] in dtype.

    Computed in float32 (one rounding: code value x block step), then cast.
    """
    codes = unpack_fp4(weight_packed)
    n, k = codes.shape
    step = weight_scale.float() / weight_global_scale.float().reshape(1)
    w = decode_e2m1(codes).reshape(n, k // BLOCK, BLOCK) * step.unsqueeze(-1)
    return w.reshape(n, k).to(dtype)
