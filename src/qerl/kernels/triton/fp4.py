"""Fused FP4 x bf16 products on the GPU (Hopper has no FP4 tensor cores: dequantize in registers).

The Triton backends of `nvfp4_matmul` / `mxfp4_matmul` (`route` picks one). Public functions take the
format's tensors exactly as stored (compressed-tensors layout, no re-packing):
  nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias)  x [..., K] -> [..., N]
  nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale)  [..., N] -> [..., K]
  nvfp4_linear_gemv(...)  same as nvfp4_linear_triton for 1..16 rows, on CUDA cores (`fp4_gemv`)
  nvfp4_dequantize_triton(...)  W [N, K] in one pass (the dequantize + cuBLAS backend)
  mxfp4_linear_triton / mxfp4_grad_input_triton / mxfp4_dequantize_triton: the same for MXFP4 (uint8 E8M0
  scales per 32, no global scale).
Inputs must be bf16 or fp16 with K % 16 == 0 (K % 32 for MXFP4). The tile shape is picked from (M, N, K)
by `pick_config`; see `fp4_mm` for the kernels. This module imports Triton: import it lazily.
"""

import torch

from ..operands import as_2d, global_scale_f32, scale_bytes, step_fits_bf16
from ..route import TRITON_DOT, sm_count, tile_config
from .fp4_gemv import GemvConfig, fp4_gemv
from .fp4_mm import TileConfig, fp4_dequantize, fp4_grad_input, fp4_linear

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _sm_count(device: torch.device) -> int:
    return sm_count(device, 4)


def _split_for(tiles: int, k_blocks: int, sms: int) -> int:
    """Split the reduction until about two programs per SM exist, keeping >= 2 K blocks per program."""
    want = -(-2 * sms // tiles)
    return max(1, min(want, k_blocks // 2))


def pick_config(m: int, n_out: int, k_red: int, sms: int) -> TileConfig:
    """Tile for an [m, k_red] x [k_red, n_out] product (forward: n_out=N, k_red=K; backward: K, N): the row of
    the `triton_dot` table (kernels/tuning/default.json, `route.tile_config`) that takes m rows.

    Small M is weight-bandwidth bound: the 16-row tensor-core tile, 64 output columns, 128-column K steps (128
    divides every Qwen2.5 K, so the K masks go: 16-byte loads) and split-K so that the whole chip streams
    weights; at M <= 16 Triton's own cp.async pipeline (prefetch off) measured 5-15% faster on H200. Large M is
    compute bound: 128 x 128 tiles, no split.
    """
    t = tile_config(TRITON_DOT, m, n_out, k_red)
    split = 1
    if t["split_k"]:
        tiles = -(-n_out // t["bn"]) * -(-m // t["bm"])
        split = _split_for(tiles, -(-k_red // t["bk"]), sms)
    return TileConfig(t["bm"], t["bn"], t["bk"], split, warps=t["warps"], stages=t["stages"], prefetch=t["prefetch"])


def _check(x: torch.Tensor, packed: torch.Tensor, k: int, fmt: str) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fmt} Triton kernels take bf16/fp16 inputs, got {x.dtype}")
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != k:
        raise ValueError(f"{fmt}: packed weight must be uint8 [N, {k // 2}], got {packed.dtype} {tuple(packed.shape)}")


def _run_linear(x, packed, scale, gs, bias, group, mx, fmt, config, fits=False):
    k = x.shape[-1]
    _check(x, packed, k, fmt)
    x2 = as_2d(x)
    n = packed.shape[0]
    cfg = config or pick_config(x2.shape[0], n, k, _sm_count(x.device))
    b = None if bias is None else bias.to(x.dtype).contiguous()
    y = fp4_linear(x2, packed.contiguous(), scale_bytes(scale), gs, b, group, mx, cfg, fits)
    return y.reshape(*x.shape[:-1], n)


def _run_grad_input(g, packed, scale, gs, group, mx, fmt, config, fits=False):
    k = packed.shape[1] * 2
    if g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fmt} Triton kernels take bf16/fp16 gradients, got {g.dtype}")
    g2 = as_2d(g)
    cfg = config or pick_config(g2.shape[0], k, packed.shape[0], _sm_count(g.device))
    y = fp4_grad_input(g2, packed.contiguous(), scale_bytes(scale), gs, group, mx, cfg, fits)
    return y.reshape(*g.shape[:-1], k)


def nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias=None, config=None):
    """x [..., K] bf16/fp16 -> x @ W^T + bias [..., N]; packed uint8 [N, K/2], scale e4m3 [N, K/16], gs fp32 [1]."""
    return _run_linear(x, weight_packed, weight_scale, global_scale_f32(weight_global_scale), bias, 16, False,
                       "nvfp4", config, x.is_cuda and step_fits_bf16(weight_global_scale))


def nvfp4_linear_gemv(x, weight_packed, weight_scale, weight_global_scale, bias=None, config=None):
    """Decode sizes (x viewed as [M, K] with M <= 16): the CUDA-core kernel of `fp4_gemv`.
    Same arguments and result as `nvfp4_linear_triton`."""
    k = x.shape[-1]
    _check(x, weight_packed, k, "nvfp4")
    x2 = as_2d(x)
    n = weight_packed.shape[0]
    b = None if bias is None else bias.to(x.dtype).contiguous()
    y = fp4_gemv(x2, weight_packed, scale_bytes(weight_scale), global_scale_f32(weight_global_scale), b,
                 config or GemvConfig(), _sm_count(x.device))
    return y.reshape(*x.shape[:-1], n)


def nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale, config=None):
    """grad_out [..., N] bf16/fp16 -> grad_out @ W [..., K]."""
    return _run_grad_input(grad_out, weight_packed, weight_scale, global_scale_f32(weight_global_scale), 16, False,
                           "nvfp4", config, grad_out.is_cuda and step_fits_bf16(weight_global_scale))


def mxfp4_linear_triton(x, weight_packed, weight_scale, bias=None, config=None):
    """x [..., K] -> x @ W^T + bias [..., N]; packed uint8 [N, K/2], scale uint8 E8M0 exponents [N, K/32]."""
    return _run_linear(x, weight_packed, weight_scale, None, bias, 32, True, "mxfp4", config)


def mxfp4_grad_input_triton(grad_out, weight_packed, weight_scale, config=None):
    """grad_out [..., N] -> grad_out @ W [..., K] for an MXFP4 weight."""
    return _run_grad_input(grad_out, weight_packed, weight_scale, None, 32, True, "mxfp4", config)


def nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale, dtype=torch.bfloat16):
    """W [N, K] in dtype, decoded on the device in one pass (for the dequantize + cuBLAS fallback)."""
    return fp4_dequantize(weight_packed.contiguous(), scale_bytes(weight_scale),
                          global_scale_f32(weight_global_scale), 16, False, dtype,
                          weight_packed.is_cuda and step_fits_bf16(weight_global_scale))


def mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=torch.bfloat16):
    """W [N, K] in dtype for an MXFP4 weight, decoded on the device in one pass."""
    return fp4_dequantize(weight_packed.contiguous(), scale_bytes(weight_scale), None, 32, True, dtype)
