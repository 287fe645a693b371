"""Triton kernels for the small per-layer ops of a decode step: residual add + RMSNorm, and RoPE on q and k.

At decode sizes a step is mostly launches: HF's RMSNorm is ~7 kernels (cast, square, mean, add, rsqrt,
multiply, weight multiply), the residual add one more, rotate-half RoPE ~5 per tensor. These kernels do
each group in one launch with the SAME roundings as the eager torch code they replace (every bf16/fp16
intermediate that torch materialises is rounded here too), so results differ only by the order of the
fp32 sum inside the norm's mean. This module imports Triton: import it lazily (see `fused_ops`).
"""

import torch
import triton
import triton.language as tl

from .triton_fp4_decode import round_to


@triton.jit
def _rounded(v, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """float32 v rounded (nearest even) to DTYPE, returned as float32. On the GPU through inline PTX: the
    compiler folds a plain `v.to(bf16).to(fp32)` away (measured: it then fuses multiply and add into one
    FMA), which would skip the rounding torch does between the two."""
    if INTERP or DTYPE == tl.float32:
        return round_to(v, DTYPE, INTERP).to(tl.float32)
    if DTYPE == tl.bfloat16:
        asm: tl.constexpr = "{ .reg .b16 t, z; mov.b16 z, 0; cvt.rn.bf16.f32 t, $1; mov.b32 $0, {z, t}; }"
    else:
        asm: tl.constexpr = "{ .reg .b16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }"
    return tl.inline_asm_elementwise(asm, "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, res_ptr, out_ptr, D, stride_h, stride_d, stride_r, stride_o, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """One row: s = h + d (rounded, stored to res) and out = w * round(s * rsqrt(mean(s^2) + eps))."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x, dtype, INTERP)
        tl.store(res_ptr + row * stride_r + offs, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / D
    y = _rounded(x * tl.math.rsqrt(var + eps), dtype, INTERP)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, round_to(w * y, dtype, INTERP), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """h, delta [..., D] (same dtype), weight [D] -> (h + delta, rms_norm(h + delta) * weight), both [..., D].

    delta None: (h, rms_norm(h) * weight). Rows are normalised independently; the output dtype is h's.
    """
    D = h.shape[-1]
    h2 = h.reshape(-1, D)
    rows = h2.shape[0]
    out = torch.empty_like(h2)
    res = torch.empty_like(h2) if delta is not None else h2
    d2 = delta.reshape(-1, D) if delta is not None else h2
    if h2.stride(-1) != 1 or d2.stride(-1) != 1:
        raise ValueError("add_rms_norm needs a unit stride along the normalised dimension")
    _add_rms_norm_kernel[(rows,)](
        h2, d2, weight, res, out, D, h2.stride(0), d2.stride(0), res.stride(0), out.stride(0), float(eps),
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(D), INTERP=h.device.type != "cuda",
        num_warps=4 if D <= 4096 else 8)
    return res.view(h.shape), out.view(h.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, L, H, stride_xb, stride_xl, stride_xh, stride_cb, stride_cl,
                 HALF: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """In place, one (batch, position) per program, all heads: x = round(x*cos) + round(rot(x)*sin), rounded."""
    pid = tl.program_id(0)
    b = pid // L
    pos = pid % L
    dtype = x_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    jmask = j < HALF
    hmask = (heads < H) & jmask
    base = x_ptr + b * stride_xb + pos * stride_xl + heads * stride_xh
    x1 = tl.load(base + j, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=hmask, other=0.0).to(tl.float32)
    cbase = b * stride_cb + pos * stride_cl
    c1 = tl.load(cos_ptr + cbase + j, mask=jmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cbase + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cbase + j, mask=jmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cbase + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1); torch rounds x*cos, rot*sin and their sum, each to x's dtype
    lo = round_to(_rounded(x1 * c1, dtype, INTERP) + _rounded(-x2 * s1, dtype, INTERP), dtype, INTERP)
    hi = round_to(_rounded(x2 * c2, dtype, INTERP) + _rounded(x1 * s2, dtype, INTERP), dtype, INTERP)
    tl.store(base + j, lo, mask=hmask)
    tl.store(base + HALF + j, hi, mask=hmask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [B, L, heads, hd] (unit stride on hd); cos, sin [B, L, hd] in x's dtype. Returns x."""
    B, L, H, hd = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride() or hd % 2:
        raise ValueError("rope_ needs unit-stride head dims, an even head dim and cos/sin of one layout")
    _rope_kernel[(B * L,)](x, cos, sin, L, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
                           HALF=hd // 2, BLOCK_J=triton.next_power_of_2(hd // 2), BLOCK_H=triton.next_power_of_2(H), INTERP=x.device.type != "cuda",
                           num_warps=4)
    return x
