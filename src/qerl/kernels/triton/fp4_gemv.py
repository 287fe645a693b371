"""NVFP4 decode-size product (M = 1..16) on CUDA cores: y[M, N] = x[M, K] @ W[N, K]^T, no tensor cores.

Why not `tl.dot`: at M <= 16 the fused tensor-core kernel (`fp4_mm`) is bound by instructions
(decode + layout conversion into the MMA operand + scale multiply: ~7.5-12 per weight element), not by
bytes. Here each weight element costs ~2 integer/convert instructions to decode plus one fp32 FMA per
row of x, and nothing is converted between layouts.

Layout: the compressed-tensors tensors as stored, no re-pack. `weight_packed` uint8 [N, K/2] is read as
int32 words [N, K/8] (a free view): word w of a row holds elements 8w..8w+7, element 8w+j in nibble j
(bits 4j..4j+3). A program owns BN output rows and a K range (split-K); each thread holds whole rows of
the tile, BKW words (16 bytes when BKW = 4) per row per step, so its loads are 16-byte vectors and the
K reduction inside a step needs no shuffles. x (bf16/fp16) is read once per step per row of x and shared by
all the thread's weight rows.

Decode of a word, 8 codes, to fp32 (the fp16 bit trick of `fp4_codes`: fp16 bits
sign<<15 | mag3<<9 are the E2M1 value * 2^-14, exact for all 16 codes, subnormal 0.5 included):
nibbles j and j+4 (j = 0..3) form one fp16x2 register, low half = element j, high half = element j+4.
Rotating the word right by 4j - 9 (mod 32) puts both magnitudes at bits 9..11 and 25..27 at once; rotating
by 4j - 12 puts both signs at bits 15 and 31. So 4 fp16x2 registers take 2 rotates + 2 logic ops each
(~1.9 instructions per element with the rotate by 0 free), then one f16 -> f32 convert per element.
The block scale (E4M3, one per 16 elements = two words) and 2^22 / global_scale multiply the fp32
partial sum of each 16-element block once per block, not each element.

Accumulation is fp32; split-K partials go to an fp32 buffer [S, M, N] that one small reduce kernel sums
(+ bias) and rounds once to x's dtype. This module imports Triton: import it lazily.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..workspace import alloc
from . import fp4_mm
from .fp4_codes import e4m3_to_f32, round_to

GEMV_MAX_M = 16


@dataclass(frozen=True)
class GemvConfig:
    """BN output rows per program (= 32 * warps * rows per thread), BKW int32 words (8 codes each) per row per
    step, split-K count (0: pick so that about `waves` * SMs programs exist)."""
    bn: int = 128
    bkw: int = 4
    warps: int = 4
    split: int = 0
    waves: int = 4


@triton.jit
def _rotr(w, D: tl.constexpr):
    """Rotate uint32 right by D (0 <= D < 32); ptxas makes this one funnel shift. The left shift is taken
    mod 32 so that D = 0 never shifts by the full width (w | w = w; Triton warns of the undefined shift even
    inside a constexpr branch)."""
    return (w >> D) | (w << ((32 - D) % 32))


@triton.jit
def _f16x2_to_f32(h):
    """GPU: both fp16 halves of uint32 h -> float32 with two converts that read the halves in place
    (plain Triton extracts the high half with an extra PRMT)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        constraints="=r,=r,r", args=[h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _pair(w, J: tl.constexpr, INTERP: tl.constexpr):
    """uint32 words -> (element J, element J + 4) as float32 = E2M1 value * 2^-14."""
    h = (_rotr(w, (4 * J + 23) % 32) & 0x0E000E00) | (_rotr(w, (4 * J + 20) % 32) & 0x80008000)
    if INTERP:
        lo = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi
    return _f16x2_to_f32(h)


@triton.jit
def _row_dot(xv, c0, c1, c2, c3, c4, c5, c6, c7, sc, BN: tl.constexpr, BKW: tl.constexpr, HB: tl.constexpr,
             WPG: tl.constexpr):
    """One row of x's step, xv [BKW * 8] (16-bit), against the decoded words' codes c_j [BN, BKW] (element 8t + j
    of word t, times 2^-14) and block scales sc [BN, HB] -> fp32 [BN], the step's share of x @ W^T."""
    # x[8t + j] -> eight [BKW] columns, j = 4h + 2a + b (in-thread splits of a 16-byte vector)
    xa, xb = tl.split(tl.reshape(xv.to(tl.float32), (BKW, 2, 2, 2)))
    x00, x01 = tl.split(xa)
    x10, x11 = tl.split(xb)
    x0, x4 = tl.split(x00)
    x2, x6 = tl.split(x01)
    x1, x5 = tl.split(x10)
    x3, x7 = tl.split(x11)
    p = c0 * x0[None, :]  # sequential: one FMA per element
    p += c1 * x1[None, :]
    p += c2 * x2[None, :]
    p += c3 * x3[None, :]
    p += c4 * x4[None, :]
    p += c5 * x5[None, :]
    p += c6 * x6[None, :]
    p += c7 * x7[None, :]
    blk = tl.sum(tl.reshape(p, (BN, HB, WPG)), axis=2)  # the words of each scale block
    return tl.sum(blk * sc, axis=1)


@triton.jit
def _fp4_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr,
                     N, K8, stride_xm, stride_w, stride_s, stride_om, stride_os, kw_per_split,
                     M: tl.constexpr, BMP: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr):
    """out[M, N] = x[M, K] @ W^T (+ bias), or fp32 partials out[split, M, N] when PARTIAL.

    w_ptr: int32 words [N, K8] (K8 = K / 8); s_ptr: uint8 E4M3 bytes [N, K8 / 2]. M is a compile-time
    constant (<= 16, BMP its next power of two). EVEN: every step's BKW words are in range (no K masks).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    step_mul = 4194304.0 / tl.load(gs_ptr)  # 2^22 / global_scale: undoes the two fp16 tricks' 2^-14 * 2^-8
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    mcols = tl.arange(0, BMP)
    acc = tl.zeros((BN, BMP), dtype=tl.float32)
    kw_lo = pid_k * kw_per_split
    kw_hi = tl.minimum(K8, kw_lo + kw_per_split)
    HB: tl.constexpr = BKW // 2
    w_rows = w_ptr + rows[:, None] * stride_w
    s_rows = s_ptr + rows[:, None] * stride_s
    for kw0 in range(kw_lo, kw_hi, BKW):
        cw = kw0 + tl.arange(0, BKW)
        cg = kw0 // 2 + tl.arange(0, HB)
        cmask = cw < kw_hi
        if EVEN:
            w = tl.load(w_rows + cw[None, :], mask=tl.broadcast_to(rmask[:, None], (BN, BKW)), other=0)
            s = tl.load(s_rows + cg[None, :], mask=tl.broadcast_to(rmask[:, None], (BN, HB)), other=0)
        else:
            w = tl.load(w_rows + cw[None, :], mask=rmask[:, None] & cmask[None, :], other=0)
            s = tl.load(s_rows + cg[None, :], mask=rmask[:, None] & (cg * 2 < kw_hi)[None, :], other=0)
        w = w.to(tl.uint32, bitcast=True)
        sc = e4m3_to_f32(s) * step_mul  # [BN, HB]
        c0, c4 = _pair(w, 0, INTERP)
        c1, c5 = _pair(w, 1, INTERP)
        c2, c6 = _pair(w, 2, INTERP)
        c3, c7 = _pair(w, 3, INTERP)
        for m in tl.static_range(M):
            xk = kw0 * 8 + tl.arange(0, BKW * 8)
            if EVEN:
                xv = tl.load(x_ptr + m * stride_xm + xk)
            else:
                xv = tl.load(x_ptr + m * stride_xm + xk, mask=xk < kw_hi * 8, other=0.0)
            contrib = _row_dot(xv, c0, c1, c2, c3, c4, c5, c6, c7, sc, BN, BKW, HB, 2)  # 2 words per 16-element block
            acc += tl.where(mcols[None, :] == m, contrib[:, None], 0.0)
    omask = rmask[:, None] & (mcols[None, :] < M)
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + mcols[None, :] * stride_om + rows[:, None], acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + mcols[None, :] * stride_om + rows[:, None],
                 round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=omask)


def as_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K/8], the same bytes (a view when contiguous and 4-byte aligned)."""
    p = packed if packed.is_contiguous() and packed.data_ptr() % 16 == 0 else packed.contiguous()
    if p.data_ptr() % 16:
        p = p.clone()
    return p.view(torch.int32)


def pick_split(n: int, k8: int, cfg: GemvConfig, sms: int) -> int:
    if cfg.split:
        return cfg.split
    tiles = -(-n // cfg.bn)
    steps = -(-k8 // cfg.bkw)
    want = -(-cfg.waves * sms // tiles)
    return max(1, min(want, steps // 2 if steps >= 4 else 1))


def fp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
             bias: torch.Tensor | None, cfg: GemvConfig, sms: int) -> torch.Tensor:
    """x [M, K] bf16/fp16 (unit column stride), M <= 16 -> x @ W^T + bias, [M, N] in x.dtype.

    packed uint8 [N, K/2]; scale_u8 uint8 [N, K/16] (E4M3 bits, contiguous); global_scale fp32 [1]."""
    m, k = x.shape
    if m < 1 or m > GEMV_MAX_M:
        raise ValueError(f"fp4_gemv takes 1..{GEMV_MAX_M} rows, got {m}")
    n = packed.shape[0]
    words = as_words(packed)
    k8 = k // 8
    split = pick_split(n, k8, cfg, sms)
    per = triton.cdiv(triton.cdiv(k8, split), cfg.bkw) * cfg.bkw  # words per split, a multiple of BKW
    split = triton.cdiv(k8, per)
    even = k8 % cfg.bkw == 0
    partial = split > 1
    part = alloc((split, m, n), x.device, torch.float32) if partial else alloc((m, n), x.device, x.dtype)
    b = bias if bias is not None else part
    grid = (triton.cdiv(n, cfg.bn), split)
    _fp4_gemv_kernel[grid](
        x, words, scale_u8, global_scale, b, part, n, k8, x.stride(0), words.stride(0), scale_u8.stride(0),
        part.stride(-2), part.stride(0) if partial else 0, per,
        M=m, BMP=triton.next_power_of_2(m), BN=cfg.bn, BKW=cfg.bkw, HAS_BIAS=bias is not None and not partial,
        PARTIAL=partial, EVEN=even, INTERP=x.device.type != "cuda", num_warps=cfg.warps)
    return fp4_mm.splitk_reduce(part, bias, x.dtype) if partial else part
