"""Triton kernels for `model.compute: fp8` on FP8 tensor cores (`qerl.kernels.fp8_matmul.w4a8_linear`):

  quantize_rows_e4m3(x)   x [M, K] bf16/fp16/fp32 -> (e4m3 [M, K], fp32 scale [M, 1]), bit-identical to
                          `qerl.formats.fp8.quantize_rows_fp8` (one read of x for the row maximum, one for the codes)
  fp4_to_e4m3(...)        an NVFP4 / MXFP4 weight -> the e4m3 codes of `qerl.formats.fp8.nvfp4_as_fp8` /
                          `mxfp4_as_fp8` (code x block scale / row shift, rounded to nearest even), [N, K], one pass;
                          `torch._scaled_mm` multiplies them

A product that decodes in registers instead (each program turning its [BN, BK] tile into e4m3 before an FP8 tl.dot)
measured 0.38-0.67x cuBLAS bf16 at 128-8192 rows on an H200 against 1.2-1.4x for decode + `_scaled_mm` from 2048
rows (docs/benchmarks.md "W4A8" names the commit): the per-element decode on the
CUDA cores, repeated for every row tile, costs more than the FP8 math saves.

Exactness: code x block scale has at most 6 significant bits and the shift is a power of two, so the fp32
value before rounding is exact; the GPU's fp32 -> e4m3 conversion rounds to nearest even (cvt.rn.satfinite).
The CPU interpreter's conversion does not (Triton 3.9: ties away from zero, subnormals off, NaN lost), so under
the interpreter the rounding is done in fp32 first (`_round_e4m3`) and the cast is then exact.
This module imports Triton: import it lazily.
"""

import torch
import triton
import triton.language as tl

from ..workspace import alloc
from .fp4_codes import e2m1_pair_to_f32, e4m3_to_f32, e8m0_times_2p14, fp4_load

E4M3_MAX = tl.constexpr(448.0)
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)  # fp32(1/448) once cast: `qerl.formats.fp8.e4m3_scale`
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
# 1.5 * 2^14: its fp32 ulp is 2^-9, e4m3's subnormal step, so (v + c) - c rounds there
SUBNORMAL_ROUNDER = tl.constexpr(24576.0)


@triton.jit
def _round_e4m3(v, INTERP: tl.constexpr):
    """fp32 (|v| <= 448) -> e4m3, round to nearest even."""
    if INTERP:
        b = v.to(tl.int32, bitcast=True)
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
        mag = (tl.abs(v) + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER
        sub = (mag.to(tl.int32, bitcast=True) | (b & -2147483648)).to(tl.float32, bitcast=True)  # keeps -0
        v = tl.where(tl.abs(v) < E4M3_MIN_NORMAL, sub, normal)
        nan8 = tl.full(v.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)  # its cast loses NaN too
        return tl.where(v != v, nan8, v.to(tl.float8e4nv))
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BK: tl.constexpr, INTERP: tl.constexpr):
    """One program per row: scale = amax x fp32(1/448) (1 for an all-zero row), q = e4m3(x / scale)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)  # NaN in, NaN row out
    m = tl.max(amax, axis=0)
    m = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), m)  # tl.max drops NaN
    scale = tl.where(m > 0, m * INV_E4M3_MAX, 1.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), E4M3_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + row * stride_q + k0 + offs, _round_e4m3(v, INTERP), mask=k0 + offs < K)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float (unit column stride) -> (float8_e4m3fn [M, K], fp32 scale [M, 1])."""
    m, k = x.shape
    q = alloc((m, k), x.device, torch.float8_e4m3fn)
    s = alloc((m, 1), x.device, torch.float32)
    if m:
        bk = min(4096, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BK=bk, INTERP=x.device.type != "cuda",
                                    num_warps=4 if bk <= 1024 else 8)
    return q, s


@triton.jit
def _decode_e4m3(p, s, rowmul, BR: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr,
                 INTERP: tl.constexpr):
    """(packed [BR, BC/2], scales [BR, BC/GROUP]) uint8 and rowmul fp32 [BR] = 2^22 / shift (NVFP4) or
    1 / shift (MXFP4) -> e4m3 [BR, BC] = code x block scale / shift, rounded to nearest even."""
    NG: tl.constexpr = BC // GROUP
    if MX:
        step = e8m0_times_2p14(s) * rowmul[:, None]
    else:
        step = e4m3_to_f32(s) * rowmul[:, None]  # scale x 2^-8 x 2^22 / shift: with the code's 2^-14, exact
    lo, hi = e2m1_pair_to_f32(p)
    w = tl.reshape(tl.join(lo, hi), (BR, NG, GROUP)) * step[:, :, None]
    return _round_e4m3(tl.reshape(w, (BR, BC)), INTERP)


@triton.jit
def _to_e4m3_kernel(w_ptr, s_ptr, rm_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_k * BK + tl.arange(0, BK)
    rowmul = tl.load(rm_ptr + rows, mask=rows < N, other=1.0)
    p, s = fp4_load(w_ptr, s_ptr, pid_n * BN, pid_k * BK, N, K, stride_w, stride_s, BN, BK, GROUP, True)
    w = _decode_e4m3(p, s, rowmul, BN, BK, GROUP, MX, INTERP)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], w,
             mask=(rows[:, None] < N) & (cols[None, :] < K))


def _row_multipliers(shift: torch.Tensor, mx: bool) -> torch.Tensor:
    """fp32 [N]: what `_decode_e4m3` multiplies a row's decoded step by (powers of two, exact)."""
    return ((1.0 if mx else 4194304.0) / shift.float()).reshape(-1).contiguous()


def fp4_to_e4m3(packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, mx: bool) -> torch.Tensor:
    """packed uint8 [N, K/2], scale uint8 [N, K/group], shift fp32 [N, 1] -> e4m3 [N, K]: the codes of
    `nvfp4_as_fp8` / `mxfp4_as_fp8`, decoded in one pass."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = alloc((n, k), packed.device, torch.float8_e4m3fn)
    bn, bk = 32, 256
    _to_e4m3_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scale, _row_multipliers(shift, mx), out, n, k, packed.stride(0), scale.stride(0), out.stride(0),
        BN=bn, BK=bk, GROUP=32 if mx else 16, MX=mx, INTERP=packed.device.type != "cuda", num_warps=4)
    return out
