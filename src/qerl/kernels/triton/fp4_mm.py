"""Triton kernels: x @ W^T and dY @ W for an FP4 weight (NVFP4 or MXFP4), dequantized in registers.

One tiled kernel per product; the shape picks the tile (see `fp4.pick_config`):
  - small M (decode): BM = 16 (the smallest tensor-core tile), narrow N tiles, long K tiles and split-K so
    that every SM streams packed weights; partial sums go to a float32 buffer [S, M, N] reduced after;
  - large M (prefill, loss pass): 128 x 128 tiles, the dequantized W tile fed to bf16 tensor cores.
W is never written to memory in 16 bits: each program decodes the [BN, BK] tile it multiplies.
Accumulation is float32; the output is rounded once to x's dtype.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..workspace import alloc
from .fp4_codes import fp4_decode, fp4_decode_bf16_asm, fp4_load, round_to


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes (elements), split of the reduction over `split` programs, launch options."""
    bm: int
    bn: int
    bk: int
    split: int = 1
    warps: int = 4
    stages: int = 3
    prefetch: bool = True
    asm: bool = True  # use the inline-PTX decode where `asm_ok` allows it


@triton.jit
def _STEP_NUM(ASM: tl.constexpr):
    """Numerator of the per-tensor step factor: 2^71 for the inline-PTX bf16 decode, else 2^22."""
    if ASM:
        return 2.3611832414348226e21
    return 4194304.0


@triton.jit
def _decode(p, s, step_mul, BR: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr,
            OUT_DTYPE: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr):
    if ASM:
        return fp4_decode_bf16_asm(p, s, step_mul, BR, BC, GROUP)
    return fp4_decode(p, s, step_mul, BR, BC, GROUP, MX, OUT_DTYPE, INTERP)


@triton.jit
def _load_rows(ptrs, c0, offs_m, M, offs_c, c_hi, EVEN: tl.constexpr):
    """Activation tile [BM, BC] at column offset c0: rows offs_m < M, columns >= c_hi read as 0.
    EVEN: the tile is all in range or all out (c0 >= c_hi: a prefetch past the end), so the column test is
    folded into a scalar row bound; a mask that varies along columns would stop 16-byte vector loads."""
    if EVEN:
        in_range = offs_m < tl.where(c0 < c_hi, M, 0)
        return tl.load(ptrs + c0, mask=tl.broadcast_to(in_range[:, None], ptrs.shape), other=0.0)
    return tl.load(ptrs + c0, mask=(offs_m < M)[:, None] & (c0 + offs_c[None, :] < c_hi), other=0.0)


@triton.jit
def _fp4_linear_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr,
                       M, N, K, stride_xm, stride_w, stride_s, stride_om, stride_os, k_per_split,
                       HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                       MX: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                       INTERP: tl.constexpr):
    """out[M, N] = x[M, K] @ W[N, K]^T (+ bias), or float32 partials out[split, M, N] when PARTIAL.

    PREFETCH: issue the loads of step i+1 before decoding and multiplying step i (software pipelining
    in registers: the dequantize feeds the MMA from registers, which Triton's own pipeliner skips).
    EVEN_K: every split's K range is a whole number of BK tiles, so no K masks (16-byte vector loads).
    INTERP (CPU interpreter only): multiply the 16-bit tiles as float32, because the Triton interpreter's
    bf16 tl.dot is wrong (3.9); the values are the same bf16 numbers, so the result is unchanged.
    Its bf16 casts truncate, so they go through `round_to`.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    step_mul = 1.0
    if HAS_GS:
        step_mul = _STEP_NUM(ASM) / tl.load(gs_ptr)  # 2^22 (or 2^71) / global_scale: see fp4_codes
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    # columns >= k_hi read as 0 (x masked), so a split never touches its neighbour's range
    x = _load_rows(x_ptrs, k_lo, offs_m, M, offs_k, k_hi, EVEN_K)
    p, s = fp4_load(w_ptr, s_ptr, pid_n * BN, k_lo, N, k_hi, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
    for k0 in range(k_lo, k_hi, BK):
        if PREFETCH:
            kn = k0 + BK
            x_next = _load_rows(x_ptrs, kn, offs_m, M, offs_k, k_hi, EVEN_K)
            # past the last tile every row reads as absent (a scalar row bound keeps the loads vectorized)
            n_rows = tl.where(kn < k_hi, N, 0)
            p_next, s_next = fp4_load(w_ptr, s_ptr, pid_n * BN, kn, n_rows, k_hi, stride_w, stride_s, BN, BK,
                                      GROUP, not EVEN_K)
        else:
            x = _load_rows(x_ptrs, k0, offs_m, M, offs_k, k_hi, EVEN_K)
            p, s = fp4_load(w_ptr, s_ptr, pid_n * BN, k0, N, k_hi, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
        w = _decode(p, s, step_mul, BN, BK, GROUP, MX, x_ptr.dtype.element_ty, ASM, INTERP)
        if INTERP:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if PREFETCH:
            x, p, s = x_next, p_next, s_next
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = m_mask[:, None] & (offs_n[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _fp4_grad_input_kernel(g_ptr, w_ptr, s_ptr, gs_ptr, out_ptr,
                           M, N, K, stride_gm, stride_w, stride_s, stride_om, stride_os, n_per_split,
                           HAS_GS: tl.constexpr, PARTIAL: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                           MX: tl.constexpr, PREFETCH: tl.constexpr, EVEN_N: tl.constexpr,
                           EVEN_K: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr):
    """out[M, K] = g[M, N] @ W[N, K], or float32 partials out[split, M, K] when PARTIAL.

    The reduction runs over W's rows (N): each step decodes a [BN, BK] tile of W, no transpose needed.
    PREFETCH and INTERP as in `_fp4_linear_kernel`; EVEN_N: each split's N range is whole BN tiles;
    EVEN_K: K % BK == 0 (no column masks on W).
    """
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    step_mul = 1.0
    if HAS_GS:
        step_mul = _STEP_NUM(ASM) / tl.load(gs_ptr)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    m_mask = offs_m < M
    g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :]
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    n_lo = pid_s * n_per_split
    n_hi = tl.minimum(N, n_lo + n_per_split)
    col0 = pid_k * BK
    g = _load_rows(g_ptrs, n_lo, offs_m, M, offs_n, n_hi, EVEN_N)
    p, s = fp4_load(w_ptr, s_ptr, n_lo, col0, n_hi, K, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
    for n0 in range(n_lo, n_hi, BN):
        if PREFETCH:
            nn = n0 + BN  # past the end: rows >= n_hi read as absent
            g_next = _load_rows(g_ptrs, nn, offs_m, M, offs_n, n_hi, EVEN_N)
            p_next, s_next = fp4_load(w_ptr, s_ptr, nn, col0, n_hi, K, stride_w, stride_s, BN, BK, GROUP,
                                      not EVEN_K)
        else:
            g = _load_rows(g_ptrs, n0, offs_m, M, offs_n, n_hi, EVEN_N)
            p, s = fp4_load(w_ptr, s_ptr, n0, col0, n_hi, K, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
        w = _decode(p, s, step_mul, BN, BK, GROUP, MX, g_ptr.dtype.element_ty, ASM, INTERP)
        if INTERP:
            acc = tl.dot(g.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(g, w, acc)
        if PREFETCH:
            g, p, s = g_next, p_next, s_next
    offs_k = col0 + tl.arange(0, BK)
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_k[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_k[None, :],
                 round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, S, MN, N, stride_s,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """out[i] = sum_s part[s, i] (+ bias[i % N]), rounded once to out's dtype; out is [M, N] contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)


def splitk_reduce(part: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 split-K partials [S, M, N] -> sum over S (+ bias [N]) as [M, N] in dtype, in one launch
    (instead of sum, add and cast: at decode sizes each launch costs about as much as the work)."""
    s, m, n = part.shape
    out = alloc((m, n), part.device, dtype)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else out, out, s, m * n, n, part.stride(0), HAS_BIAS=bias is not None,
        BLOCK=block, INTERP=part.device.type != "cuda", num_warps=4)
    return out


def _split_extent(total: int, block: int, split: int) -> tuple[int, int]:
    """(extent per split, a multiple of block; number of non-empty splits)."""
    per = triton.cdiv(triton.cdiv(total, split), block) * block
    return per, triton.cdiv(total, per)


def asm_ok(device: torch.device, dtype: torch.dtype, mx: bool, step_fits_bf16: bool) -> bool:
    """The inline-PTX bf16 decode: CUDA, bf16, NVFP4, and a global scale known to keep step * 2^126 finite."""
    return device.type == "cuda" and dtype == torch.bfloat16 and not mx and step_fits_bf16


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
               bias: torch.Tensor | None, group: int, mx: bool, cfg: TileConfig, fits: bool = False) -> torch.Tensor:
    """x [M, K] bf16/fp16 (row stride any, unit column stride) -> x @ W^T + bias, [M, N] in x.dtype.

    packed uint8 [N, K/2]; scale uint8 [N, K/group] (E4M3 bits, or E8M0 exponents when mx);
    global_scale fp32 [1] (NVFP4's divisor) or None.
    """
    m, k = x.shape
    n = packed.shape[0]
    per, split = _split_extent(k, cfg.bk, cfg.split)
    partial = split > 1
    if partial:
        out = alloc((split, m, n), x.device, torch.float32)
    else:
        out = alloc((m, n), x.device, x.dtype)
    gs = global_scale if global_scale is not None else scale  # unused pointer when HAS_GS is False
    b = bias if (bias is not None and not partial) else out
    grid = (triton.cdiv(n, cfg.bn), triton.cdiv(m, cfg.bm), split)
    _fp4_linear_kernel[grid](
        x, packed, scale, gs, b, out, m, n, k, x.stride(0), packed.stride(0), scale.stride(0),
        out.stride(-2), out.stride(0) if partial else 0, per,
        HAS_GS=global_scale is not None, HAS_BIAS=bias is not None and not partial, PARTIAL=partial,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=group, MX=mx, PREFETCH=cfg.prefetch, EVEN_K=k % cfg.bk == 0,
        ASM=cfg.asm and asm_ok(x.device, x.dtype, mx, fits), INTERP=x.device.type != "cuda", num_warps=cfg.warps,
        num_stages=cfg.stages)
    return splitk_reduce(out, bias, x.dtype) if partial else out


def fp4_grad_input(g: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                   group: int, mx: bool, cfg: TileConfig, fits: bool = False) -> torch.Tensor:
    """g [M, N] bf16/fp16 -> g @ W, [M, K] in g.dtype. Weight tensors as in `fp4_linear`."""
    m, n = g.shape
    k = packed.shape[1] * 2
    per, split = _split_extent(n, cfg.bn, cfg.split)
    partial = split > 1
    if partial:
        out = alloc((split, m, k), g.device, torch.float32)
    else:
        out = alloc((m, k), g.device, g.dtype)
    gs = global_scale if global_scale is not None else scale
    grid = (triton.cdiv(k, cfg.bk), triton.cdiv(m, cfg.bm), split)
    _fp4_grad_input_kernel[grid](
        g, packed, scale, gs, out, m, n, k, g.stride(0), packed.stride(0), scale.stride(0),
        out.stride(-2), out.stride(0) if partial else 0, per,
        HAS_GS=global_scale is not None, PARTIAL=partial,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=group, MX=mx, PREFETCH=cfg.prefetch, EVEN_N=n % cfg.bn == 0,
        EVEN_K=k % cfg.bk == 0, ASM=cfg.asm and asm_ok(g.device, g.dtype, mx, fits), INTERP=g.device.type != "cuda",
        num_warps=cfg.warps, num_stages=cfg.stages)
    return splitk_reduce(out, None, g.dtype) if partial else out


@triton.jit
def _fp4_dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
                        HAS_GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                        MX: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr):
    """out[N, K] (16-bit) = W: one pass, packed bytes in, 16-bit weight out (the cuBLAS fallback's input)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    step_mul = 1.0
    if HAS_GS:
        step_mul = _STEP_NUM(ASM) / tl.load(gs_ptr)
    p, s = fp4_load(w_ptr, s_ptr, pid_n * BN, pid_k * BK, N, K, stride_w, stride_s, BN, BK, GROUP, True)
    w = _decode(p, s, step_mul, BN, BK, GROUP, MX, out_ptr.dtype.element_ty, ASM, INTERP)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], w, mask=(rows[:, None] < N) & (cols[None, :] < K))


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                   group: int, mx: bool, dtype: torch.dtype, fits: bool = False) -> torch.Tensor:
    """packed uint8 [N, K/2], scales uint8 [N, K/group] -> W [N, K] in dtype (a new tensor)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = alloc((n, k), packed.device, dtype)
    gs = global_scale if global_scale is not None else scale
    bn, bk = 32, 256
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _fp4_dequant_kernel[grid](packed, scale, gs, out, n, k, packed.stride(0), scale.stride(0), out.stride(0),
                              HAS_GS=global_scale is not None, BN=bn, BK=bk, GROUP=group, MX=mx,
                              ASM=asm_ok(packed.device, dtype, mx, fits), INTERP=packed.device.type != "cuda",
                              num_warps=4)
    return out
