"""Grouped FP4 experts product at decode sizes (a few rows per expert) on CUDA cores, no tensor cores.

Same product and operands as `fp4_grouped.grouped_fp4_linear`: x [M, K] bf16/fp16, rows sorted by expert
(expert e owns rows offsets[e]..offsets[e+1], offsets int [E + 1] on the device), stacked weights packed uint8
[E, N, K/2], scales uint8 [E, N, K/group] (E4M3 bits, NVFP4, group 16; or E8M0 exponents, MXFP4, group 32),
NVFP4's per-expert global scale fp32 [E, 1]; out [M, N] in x.dtype, rows from offsets[-1] on are 0.

Why a second kernel: at decode each expert sees ~1-16 rows, and the tile kernel's 16-row `tl.dot` tile is bound
by instructions (decode + layout conversion into the MMA operand), not by bytes. This is the dense
`fp4_gemv` scheme per expert: packed codes read as int32 words [E, N, K/8] (a free view, 16-byte vector
loads, each thread holding whole weight rows of the tile), 8 codes decoded per word with the fp16 bit trick
(`fp4_gemv._pair`), one fp32 FMA per weight element per row of x, the block scale (and for NVFP4
2^22 / global_scale) applied once per block to the block's partial sum.

Grid (all sizes from host-known shapes only, so a call never waits for the host and can be captured in a CUDA
graph): (N / BN, E (+1), split-K). Program (n block, e, k split) reads expert e's row range from the offsets on the
device and exits at once when it is empty (most experts at decode); otherwise it loops over the expert's rows in
chunks of ROWS (a constexpr), and for each chunk streams its [BN, K range] weight block once, decoding it in
registers and accumulating fp32 sums for each of the chunk's rows (rows of the last chunk past the expert's end
are skipped by a uniform branch, not computed and masked). Without split-K an extra program column e = E writes
the zero rows past offsets[-1], so the output needs no memset launch.

Split-K (when too few programs would have work: ~E-hit x N / BN against a few waves of SMs) writes fp32 partials
[S, M, N] and a second small kernel sums them in a fixed order and rounds once to x's dtype (zero past
offsets[-1]): deterministic (no atomics, the result does not depend on scheduling) and graph-safe (no zeroed
buffer or arrival counter to reset between replays). This module imports Triton: import it lazily.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..operands import as_2d, scale_bytes
from ..route import sm_count
from ..workspace import alloc
from .fp4_codes import e4m3_to_f32, e8m0_times_2p14, round_to
from .fp4_gemv import _pair, _row_dot


@dataclass(frozen=True)
class GroupedGemvConfig:
    """bn: weight rows (outputs) per program (= 32 * warps * weight rows per thread); bkw: int32 words (8 codes)
    per weight row per step, a multiple of group / 8 (NVFP4 2, MXFP4 4); warps; rows: rows of x per chunk (0:
    `chunk_rows`); split: K splits (0: `pick_split`, about `waves` x SMs programs with work); stages: Triton's
    num_stages (None: its default, as the dense gemv); skip: see the field."""
    bn: int = 256  # two weight rows per thread: each converted x element serves both (1.37x vs 1.13x of bf16
    # grouped_mm for a Qwen3-30B-A3B layer at 8 tokens with 128, H200 2026-11-26, benchmarks/moe_layer.py --gemv)
    bkw: int = 4
    warps: int = 4
    rows: int = 0
    split: int = 0
    waves: int = 4
    stages: int | None = None
    skip: bool = True  # rows of a chunk past the expert's end: a uniform branch skips them (False: computed as 0)


CONFIG = GroupedGemvConfig()  # read at each call (benchmarks vary it)


@triton.jit
def _grouped_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, off_ptr, out_ptr,
                         M, N, K8, E, stride_xm, stride_we, stride_w, stride_se, stride_s, stride_om, stride_os,
                         kw_per_split,
                         HAS_GS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
                         BKW: tl.constexpr, SKIP: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr,
                         INTERP: tl.constexpr):
    """out[r, n] = x[r, :] @ W_e[n, :] for the rows r of expert e = program_id(1), n in block program_id(0), K
    words in split program_id(2); or fp32 partials out[split, r, n] when PARTIAL.

    w_ptr: int32 words [E, N, K8] (K8 = K / 8); s_ptr: uint8 scales [E, N, K8 / (GROUP / 8)]; gs_ptr: fp32 [E]
    (HAS_GS, NVFP4); off_ptr: int [E + 1]. EVEN: every step's BKW words are in range (no K masks: 16-byte loads).
    SKIP: rows of a chunk past the expert's end are skipped by a branch (else computed on zeros, no branch).
    Program column e = E (launched only without PARTIAL) writes zeros to rows offsets[E]..M-1."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = pid_n * BN + tl.arange(0, BN)  # output columns = weight rows of this program
    cmask = cols < N
    mcols = tl.arange(0, ROWS)
    if e < E:
        start = tl.load(off_ptr + e).to(tl.int32)
        end = tl.load(off_ptr + e + 1).to(tl.int32)
        e64 = e.to(tl.int64)  # E * N * K/2 bytes may pass 2^31
        WPG: tl.constexpr = GROUP // 8  # words per scale block
        HB: tl.constexpr = BKW // WPG  # scale blocks per step
        if HAS_GS:
            step_mul = 4194304.0 / tl.load(gs_ptr + e64)  # 2^22 / global scale: undoes the fp16 tricks' 2^-22
        else:
            step_mul = 1.0
        w_rows = w_ptr + e64 * stride_we + cols[:, None] * stride_w
        s_rows = s_ptr + e64 * stride_se + cols[:, None] * stride_s
        kw_lo = pid_k * kw_per_split
        kw_hi = tl.minimum(K8, kw_lo + kw_per_split)
        for r0 in range(start, end, ROWS):  # no iteration for an expert without rows
            acc = tl.zeros((BN, ROWS), dtype=tl.float32)
            for kw0 in range(kw_lo, kw_hi, BKW):
                cw = kw0 + tl.arange(0, BKW)
                # HB adjacent bytes per weight row at a multiple of HB: said so, Triton gives each thread its rows'
                # whole scale vector (else it splits a row's bytes over 2 threads and converts every row's block
                # sums between the two layouts through shared memory, with barriers)
                cg = tl.max_contiguous(tl.multiple_of(kw0 // WPG, HB) + tl.arange(0, HB), HB)
                if EVEN:
                    w = tl.load(w_rows + cw[None, :], mask=tl.broadcast_to(cmask[:, None], (BN, BKW)), other=0)
                    s = tl.load(s_rows + cg[None, :], mask=tl.broadcast_to(cmask[:, None], (BN, HB)), other=0)
                else:
                    w = tl.load(w_rows + cw[None, :], mask=cmask[:, None] & (cw < kw_hi)[None, :], other=0)
                    s = tl.load(s_rows + cg[None, :], mask=cmask[:, None] & (cg * WPG < kw_hi)[None, :], other=0)
                w = w.to(tl.uint32, bitcast=True)
                if GROUP == 32:
                    sc = e8m0_times_2p14(s)  # 2^(e - 127) * 2^14: undoes the codes' 2^-14
                else:
                    sc = e4m3_to_f32(s) * step_mul  # [BN, HB]
                # decoded once per chunk step, reused by every row of the chunk
                c0, c4 = _pair(w, 0, INTERP)
                c1, c5 = _pair(w, 1, INTERP)
                c2, c6 = _pair(w, 2, INTERP)
                c3, c7 = _pair(w, 3, INTERP)
                xk = kw0 * 8 + tl.arange(0, BKW * 8)
                xmask = xk < kw_hi * 8
                for m in tl.static_range(ROWS):
                    r = r0 + m
                    x_row = x_ptr + r.to(tl.int64) * stride_xm + xk
                    if SKIP:
                        if r < end:  # uniform over the program: a short last chunk costs no FMAs
                            if EVEN:
                                xv = tl.load(x_row)
                            else:
                                xv = tl.load(x_row, mask=xmask, other=0.0)
                            contrib = _row_dot(xv, c0, c1, c2, c3, c4, c5, c6, c7, sc, BN, BKW, HB, WPG)
                            acc += tl.where(mcols[None, :] == m, contrib[:, None], 0.0)
                    else:  # every row of the chunk computed, rows past the end read as 0 (no branches)
                        # the row test as a splat, uniform along the row (keeps 16-byte loads; the interpreter
                        # rejects a broadcast 0-d mask)
                        live = tl.full((BKW * 8,), 1, tl.int1) & (r < end)
                        if EVEN:
                            xv = tl.load(x_row, mask=live, other=0.0)
                        else:
                            xv = tl.load(x_row, mask=xmask & live, other=0.0)
                        contrib = _row_dot(xv, c0, c1, c2, c3, c4, c5, c6, c7, sc, BN, BKW, HB, WPG)
                        acc += tl.where(mcols[None, :] == m, contrib[:, None], 0.0)
            rows = r0 + mcols
            omask = cmask[:, None] & (rows < end)[None, :]
            if PARTIAL:
                tl.store(out_ptr + pid_k * stride_os + rows[None, :].to(tl.int64) * stride_om + cols[:, None], acc,
                         mask=omask)
            else:
                tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_om + cols[:, None],
                         round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=omask)
    else:
        if not PARTIAL:  # rows no expert owns (routing sentinels, sorted last) must read 0
            tail = tl.load(off_ptr + E).to(tl.int32)
            zero = tl.zeros((BN, ROWS), dtype=out_ptr.dtype.element_ty)
            for r0 in range(tail, M, ROWS):
                rows = r0 + mcols
                tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_om + cols[:, None], zero,
                         mask=cmask[:, None] & (rows < M)[None, :])


@triton.jit
def _rows_reduce_kernel(part_ptr, off_ptr, out_ptr, S, M, N, E, stride_s,
                        BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """out[M, N] (contiguous) = sum over s of part[s] in order s = 0..S-1, rounded once to out's dtype; rows from
    offsets[E] on (never written by the product kernel) are 0."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    owned = tl.load(off_ptr + E).to(tl.int32) * N
    live = offs < tl.minimum(M * N, owned)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=live, other=0.0)
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=offs < M * N)


def chunk_rows(rows: int, experts: int) -> int:
    """Rows of x per chunk for `rows` sorted rows over `experts` (host-known numbers only): enough that a typical
    expert takes one chunk (rows past an expert's end cost a skipped branch, not FMAs)."""
    mean = rows / max(experts, 1)
    return 4 if mean <= 1 else (8 if mean <= 3 else 16)


def pick_split(rows: int, experts: int, n: int, k8: int, cfg: GroupedGemvConfig, sms: int) -> int:
    """K splits so that about cfg.waves x SMs programs have work. At most min(E, rows) experts have rows (an upper
    bound: the real routing is not read on the host); each split keeps >= 2 steps of BKW words."""
    if cfg.split:
        return cfg.split
    busy = min(experts, rows) * -(-n // cfg.bn)
    want = -(-cfg.waves * sms // max(busy, 1))
    steps = -(-k8 // cfg.bkw)
    return max(1, min(want, steps // 2))


def _words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] -> int32 [E, N, K/8], the same bytes (a view when the layout allows, else a copy)."""
    p = packed if packed.stride(-1) == 1 and packed.data_ptr() % 16 == 0 else packed.contiguous()
    try:
        return p.view(torch.int32)
    except RuntimeError:  # a stride not a multiple of 4 bytes
        return p.contiguous().view(torch.int32)


def grouped_fp4_gemv(x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     global_scale: torch.Tensor | None, group: int, mx: bool,
                     config: GroupedGemvConfig | None = None) -> torch.Tensor:
    """`grouped_fp4_linear` on CUDA cores, for few rows per expert: x [M, K] bf16/fp16 sorted by expert, offsets
    int [E + 1] on x's device (rising from 0 to at most M; not read on the host) -> [M, N] in x.dtype, row r =
    x[r] @ W_e^T, rows from offsets[-1] on 0. packed uint8 [E, N, K/2]; scale [E, N, K/group] (E4M3, or E8M0 when
    mx); global_scale fp32 [E, 1] (NVFP4) or None (MXFP4); group 16 (NVFP4) or 32 (MXFP4)."""
    cfg = config or CONFIG
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"grouped FP4 kernels take bf16/fp16 inputs, got {x.dtype}")
    E, n, half = packed.shape
    k = 2 * half
    if x.shape[-1] != k or tuple(offsets.shape) != (E + 1,) or offsets.device != x.device:
        raise ValueError(f"inputs {tuple(x.shape)} on {x.device} and offsets {tuple(offsets.shape)} on "
                         f"{offsets.device} do not match {E} experts of [{n}, {k}]")
    if group != (32 if mx else 16) or k % group or cfg.bkw % (group // 8) or (global_scale is None) != mx:
        raise ValueError(f"grouped_fp4_gemv: group {group}, mx {mx}, K {k}, bkw {cfg.bkw}, global scale "
                         f"{'absent' if global_scale is None else 'present'} do not fit together")
    m = x.shape[0]
    if m == 0:
        return torch.zeros((0, n), device=x.device, dtype=x.dtype)
    x2 = as_2d(x)
    words = _words(packed)
    s = scale_bytes(scale)
    gs = None if global_scale is None else global_scale.reshape(E).float().contiguous()
    k8 = k // 8
    split = pick_split(m, E, n, k8, cfg, sm_count(x.device, 4))
    per = triton.cdiv(triton.cdiv(k8, split), cfg.bkw) * cfg.bkw  # words per split, a multiple of BKW
    split = triton.cdiv(k8, per)
    partial = split > 1
    rows = cfg.rows or chunk_rows(m, E)
    out = alloc((m, n), x.device, x.dtype)
    part = alloc((split, m, n), x.device, torch.float32) if partial else out
    interp = x.device.type != "cuda"
    grid = (triton.cdiv(n, cfg.bn), E if partial else E + 1, split)
    extra = {} if cfg.stages is None else {"num_stages": cfg.stages}
    _grouped_gemv_kernel[grid](
        x2, words, s, gs if gs is not None else s, offsets, part, m, n, k8, E, x2.stride(0), words.stride(0),
        words.stride(1), s.stride(0), s.stride(1), part.stride(-2), part.stride(0) if partial else 0, per,
        HAS_GS=gs is not None, GROUP=group, ROWS=rows, BN=cfg.bn, BKW=cfg.bkw, SKIP=bool(cfg.skip), PARTIAL=partial,
        EVEN=k8 % cfg.bkw == 0 and per % cfg.bkw == 0, INTERP=interp, num_warps=cfg.warps, **extra)
    if partial:
        block = 1024
        _rows_reduce_kernel[(triton.cdiv(m * n, block),)](part, offsets, out, split, m, n, E, part.stride(0),
                                                          BLOCK=block, INTERP=interp, num_warps=4)
    return out
