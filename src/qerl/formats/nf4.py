"""NF4 weights (the QLoRA baseline) in bitsandbytes' layout and arithmetic.

The weight is flattened row-major and split into blocks of 64 consecutive elements (a block may
span rows); each block has an fp32 absmax. Elements are scaled to [-1, 1] by multiplying with the
reciprocal of the absmax (as bitsandbytes does, not by dividing), then mapped to the nearest of the 16
NF4 values: the thresholds are the fp32 midpoints of consecutive table values, and a value exactly on
a midpoint goes to the LOWER code (bitsandbytes' `torch.bucketize(right=False)`; its CUDA kernel's
`x > threshold` tree does the same). Two codes per byte, the FIRST element in the HIGH nibble.
    W ~= NF4_CODE[code] * absmax
The bytes of `weight_packed` [N, K/2] are bnb's packed [N*K/2, 1]; `weight_absmax` [N*K/64] is bnb's
`quant_state.absmax` (no double quantization).
"""

import functools

import torch

from .errors import check_weight

BLOCK = 64
TENSOR_NAMES = ("weight_packed", "weight_absmax")

# bitsandbytes' `get_4bit_type("nf4")`: quantiles of N(0, 1) normalised to [-1, 1], index = code.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# bitsandbytes clamps the absmax to this before taking its reciprocal (an all-zero block stays 0).
_ABSMAX_FLOOR = 1e-38


def nf4_values(device=None) -> torch.Tensor:
    """The 16 NF4 values, float32 [16]; index = code. Cached per device (CUDA-graph safe); read-only."""
    return _nf4_table(str(torch.device(device if device is not None else "cpu")))


@functools.lru_cache(maxsize=None)
def _nf4_table(device: str) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _midpoints(device) -> torch.Tensor:
    code = nf4_values(device)
    return (code[:-1] + code[1:]) / 2  # fp32 sums, as bitsandbytes computes them


def quantize_nf4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize W [N, K] (any float dtype; K even, N*K % 64 == 0).

    Returns {"weight_packed": uint8 [N, K/2], "weight_absmax": float32 [N*K/64]}.
    global_scale must be None: NF4 has none (the argument exists for the common quantize signature).
    """
    if global_scale is not None:
        raise ValueError("nf4: the format has no global scale; pass global_scale=None")
    check_weight(w, 1, "nf4")
    n, k = w.shape
    if k % 2:
        raise ValueError(f"nf4: weight has {k} input features; two codes share a byte, so it must be even")
    if (n * k) % BLOCK:
        raise ValueError(
            f"nf4: weight has {n}x{k} = {n * k} elements, not a multiple of the block size {BLOCK} "
            "(blocks run over the flattened tensor)"
        )
    blocks = w.detach().float().reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=-1)  # [N*K/64]
    scaled = (blocks * (1.0 / absmax.clamp(min=_ABSMAX_FLOOR)).unsqueeze(-1)).clamp(-1, 1)
    codes = torch.bucketize(scaled.reshape(-1), _midpoints(w.device)).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return {"weight_packed": packed.reshape(n, k // 2), "weight_absmax": absmax}


def dequantize_nf4(
    weight_packed: torch.Tensor, weight_absmax: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [N, K/2], absmax fp32 [N*K/64] -> W [N, K] in dtype (fp32 product, then one cast)."""
    n, half_k = weight_packed.shape
    codes = torch.stack([weight_packed >> 4, weight_packed & 0x0F], dim=-1).reshape(-1, BLOCK)
    w = nf4_values(weight_packed.device)[codes.long()] * weight_absmax.float().unsqueeze(-1)
    return w.reshape(n, 2 * half_k).to(dtype)
