"""Grouped FP4 products for mixture-of-experts layers: every expert's x_e @ W_e^T in one launch.

Rows of x are sorted by expert (expert e owns rows offsets[e]..offsets[e+1]); the weights are the stacked
per-expert tensors of `qerl.nn.QuantExperts` (packed uint8 [E, N, K/2], scales [E, N, K/group], NVFP4's
global scale fp32 [E, 1]). A tile table maps each program to (expert, first row); the program decodes its
expert's [BN, BK] weight tiles in registers, as the dense kernel of `fp4_mm` does, so no expert is ever
written out in 16 bits. The table is built on the device from the offsets with a size fixed by the shapes
(E + rows / BM slots, the unused ones empty and returning at once), so a call never waits for the host and can
be captured in a CUDA graph. At decode (a few rows per expert, `use_gemv`) the forward goes to the CUDA-core
kernel of `fp4_grouped_gemv` instead. This module imports Triton: import it lazily.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..operands import ASM_MIN_GLOBAL_SCALE, as_2d, scale_bytes
from .fp4_codes import fp4_load, round_to
from .fp4_mm import _STEP_NUM, _decode, _load_rows, asm_ok


@triton.jit
def _expert_tile(tile_expert_ptr, tile_row_ptr, row_end_ptr, w_ptr, s_ptr, gs_ptr, stride_we, stride_se,
                 HAS_GS: tl.constexpr, ASM: tl.constexpr):
    """Program_id(1)'s tile: (first row, end of its expert's rows, the decode's step factor, the expert's packed
    weight and scale pointers)."""
    pid_t = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)  # int64: E * N * K/2 bytes may pass 2^31
    step_mul = 1.0
    if HAS_GS:
        step_mul = _STEP_NUM(ASM) / tl.load(gs_ptr + e)
    first, end = tl.load(tile_row_ptr + pid_t), tl.load(row_end_ptr + pid_t)
    return first, end, step_mul, w_ptr + e * stride_we, s_ptr + e * stride_se


@triton.jit
def _grouped_fp4_linear_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr,
                               N, K, stride_xm, stride_we, stride_w, stride_se, stride_s, stride_om,
                               HAS_GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               GROUP: tl.constexpr, MX: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                               INTERP: tl.constexpr):
    """out[r, N] = x[r, K] @ W_e[N, K]^T for the rows r of tile program_id(1), all of expert e."""
    pid_n = tl.program_id(0)
    r0, r_end, step_mul, w_e, s_e = _expert_tile(tile_expert_ptr, tile_row_ptr, row_end_ptr, w_ptr, s_ptr, gs_ptr,
                                                 stride_we, stride_se, HAS_GS, ASM)
    if r0 >= r_end:  # a table slot past the tiles this routing needs
        return
    offs_m = r0 + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = _load_rows(x_ptrs, k0, offs_m, r_end, offs_k, K, EVEN_K)
        p, s = fp4_load(w_e, s_e, pid_n * BN, k0, N, K, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
        w = _decode(p, s, step_mul, BN, BK, GROUP, MX, x_ptr.dtype.element_ty, ASM, INTERP)
        if INTERP:  # the interpreter's bf16 dot is wrong: multiply the same bf16 values as float32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m < r_end)[:, None] & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)


_FITS_ATTR = "_qerl_grouped_steps_fit"  # cached on the global-scale tensor with its version, as operands does


def _steps_fit_bf16(global_scale: torch.Tensor) -> bool:
    """Every expert's global scale allows the inline-PTX bf16 decode (`operands.step_fits_bf16` over all E):
    read from the device once per tensor version; False while a graph is captured and nothing is cached."""
    hit = getattr(global_scale, _FITS_ATTR, None)
    if hit is not None and hit[0] == global_scale._version:
        return hit[1]
    if global_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    g = global_scale.detach().float()
    fits = bool(((g > ASM_MIN_GLOBAL_SCALE) & torch.isfinite(g)).all())
    setattr(global_scale, _FITS_ATTR, (global_scale._version, fits))
    return fits


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile for `rows` sorted rows over `experts`: by the mean per expert (decode: a few rows each)."""
    mean = rows / max(experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 32 else 64)


def tile_table(offsets: torch.Tensor, bm: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """offsets int [E + 1] (on the device) -> (expert, first row, end of the expert's rows), int32 [slots] each:
    one tile per bm rows of every expert, in expert order, then empty slots (first == end). Device ops only:
    slots = E + ceil(rows / bm) always suffices (each expert wastes at most one partial tile)."""
    offsets = offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    slot = torch.arange(slots, device=offsets.device)
    expert = torch.searchsorted(tile_end, slot, right=True)
    valid = expert < counts.numel()
    expert = expert.clamp(max=counts.numel() - 1)
    first = offsets[expert] + (slot - (tile_end - tiles)[expert]) * bm
    end = torch.where(valid, offsets[expert + 1], first)
    return expert.to(torch.int32), first.to(torch.int32), end.to(torch.int32)


_TILES_ATTR = "_qerl_grouped_tiles"  # the table built from an offsets tensor, cached on it with its version


def _cached_tile_table(offsets: torch.Tensor, bm: int, slots: int):
    """`tile_table`, built once per offsets tensor (version) and size: a MoE layer's gate_up and down products
    and both their input gradients share one routing, so they share one table."""
    key = (offsets._version, bm, slots)
    hit = getattr(offsets, _TILES_ATTR, None)
    if hit is None or hit[0] != key:
        hit = (key, tile_table(offsets, bm, slots))
        setattr(offsets, _TILES_ATTR, hit)
    return hit[1]


BN, BK = 128, 128  # weight tile (rows x columns): 128 divides every Qwen MoE hidden and expert width; BN 128
# was the fastest of BN 32-128 x BK 128-256 x 4-8 warps x 2-4 stages at 8-256 tokens (docs/formats.md,
# "Mixture-of-experts (first piece)"; `moe_grouped_sweep.py` in docs/benchmarks.md's script list)
NUM_WARPS, NUM_STAGES = 4, 3  # read at each launch (the sweep at 8441d0e varies all four)


@dataclass
class _Launch:
    """What both grouped kernels take besides the activation: the tile table and the weight operands."""

    bm: int
    experts: torch.Tensor
    firsts: torch.Tensor
    ends: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    asm: bool


def _launch(a: torch.Tensor, width: int, offsets: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
            global_scale: torch.Tensor | None, mx: bool, what: str) -> _Launch | None:
    """Check a [M, width] activation (what: its name) against the experts and the offsets' shape; None when M
    is 0. The offsets' values are not read on the host (no sync): they must rise from 0 to at most M."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"grouped FP4 kernels take bf16/fp16 {what}, got {a.dtype}")
    E, n, half = packed.shape
    if a.shape[1] != width or tuple(offsets.shape) != (E + 1,) or offsets.device != a.device:
        raise ValueError(f"{what} {tuple(a.shape)} on {a.device} and offsets {tuple(offsets.shape)} on "
                         f"{offsets.device} do not match {E} experts of [{n}, {2 * half}]")
    if a.shape[0] == 0:
        return None
    gs = None if global_scale is None else global_scale.reshape(E).float().contiguous()
    bm = tile_rows(a.shape[0], E)
    experts, firsts, ends = _cached_tile_table(offsets, bm, E + -(-a.shape[0] // bm))
    fits = global_scale is not None and a.is_cuda and _steps_fit_bf16(global_scale)
    return _Launch(bm, experts, firsts, ends, scale_bytes(scale), gs, asm_ok(a.device, a.dtype, mx, fits))


GEMV: bool | None = None  # None: `use_gemv` decides; True / False force the CUDA-core decode kernel or the tile
# kernel for every forward (tests and benchmarks)
GEMV_MAX_ROWS_PER_EXPERT = 0.5  # the decode kernel's FMAs grow with the rows of x per expert, the tile kernel's
# tensor-core work does not. Qwen3-30B-A3B layer, H200 (benchmarks/moe_layer.py --gemv): at 0.5 rows per expert
# (8 tokens) the decode kernel is 1.37x bf16 grouped_mm against the tile kernel's 1.14x; at 4 (64 tokens) 0.63x
# against 1.15x. Between them nothing was measured, so the rule stays at the measured win.


def use_gemv(rows: int, experts: int) -> bool:
    """Whether `grouped_fp4_linear` takes the CUDA-core decode kernel (`fp4_grouped_gemv`) for `rows` rows
    over `experts` experts: host-known numbers only (the routing stays on the device), so a CUDA graph captured
    at one batch size always replays the same kernel."""
    if GEMV is not None:
        return GEMV
    return 0 < rows <= GEMV_MAX_ROWS_PER_EXPERT * experts


def grouped_fp4_linear(x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       global_scale: torch.Tensor | None, group: int, mx: bool) -> torch.Tensor:
    """x [M, K] bf16/fp16, rows sorted by expert (expert e: rows offsets[e]..offsets[e+1]; offsets int [E + 1] on
    x's device, offsets[-1] <= M) -> [M, N] in x.dtype, row r = x[r] @ W_e^T; rows from offsets[-1] on are 0
    (rows no expert owns: the backward through them must see zeros, not leftover memory).

    packed uint8 [E, N, K/2]; scale [E, N, K/group] (E4M3 bits, or E8M0 exponents when mx); global_scale fp32
    [E, 1] (NVFP4's per-expert divisor) or None (MXFP4). Few rows per expert (decode, `use_gemv`): the CUDA-core
    kernel of `fp4_grouped_gemv`; else the tile kernel below."""
    if use_gemv(x.shape[0], packed.shape[0]):
        from .fp4_grouped_gemv import grouped_fp4_gemv

        return grouped_fp4_gemv(x, offsets, packed, scale, global_scale, group, mx)
    n, k = packed.shape[1], 2 * packed.shape[2]
    out = torch.zeros((x.shape[0], n), device=x.device, dtype=x.dtype)  # rows past offsets[-1] stay 0
    run = _launch(x, k, offsets, packed, scale, global_scale, mx, "inputs")
    if run is None:
        return out
    x2, s, gs = as_2d(x), run.scale, run.global_scale
    _grouped_fp4_linear_kernel[(triton.cdiv(n, BN), run.experts.numel())](
        x2, packed, s, gs if gs is not None else s, out, run.experts, run.firsts, run.ends, n, k, x2.stride(0),
        packed.stride(0), packed.stride(1), s.stride(0), s.stride(1), out.stride(0),
        HAS_GS=gs is not None, BM=run.bm, BN=BN, BK=BK, GROUP=group, MX=mx, EVEN_K=k % BK == 0, ASM=run.asm,
        INTERP=x.device.type != "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


@triton.jit
def _grouped_fp4_grad_input_kernel(g_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr,
                                   N, K, stride_gm, stride_we, stride_w, stride_se, stride_s, stride_om,
                                   HAS_GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                   GROUP: tl.constexpr, MX: tl.constexpr, EVEN_N: tl.constexpr,
                                   EVEN_K: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr):
    """out[r, K] = g[r, N] @ W_e[N, K] for the rows r of tile program_id(1): the reduction runs over W_e's rows,
    each step decoding a [BN, BK] tile (no transpose), as `fp4_mm._fp4_grad_input_kernel` does."""
    pid_k = tl.program_id(0)
    r0, r_end, step_mul, w_e, s_e = _expert_tile(tile_expert_ptr, tile_row_ptr, row_end_ptr, w_ptr, s_ptr, gs_ptr,
                                                 stride_we, stride_se, HAS_GS, ASM)
    if r0 >= r_end:  # a table slot past the tiles this routing needs
        return
    offs_m = r0 + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    g_ptrs = g_ptr + offs_m[:, None].to(tl.int64) * stride_gm + offs_n[None, :]
    col0 = pid_k * BK
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        g = _load_rows(g_ptrs, n0, offs_m, r_end, offs_n, N, EVEN_N)
        p, s = fp4_load(w_e, s_e, n0, col0, N, K, stride_w, stride_s, BN, BK, GROUP, not EVEN_K)
        w = _decode(p, s, step_mul, BN, BK, GROUP, MX, g_ptr.dtype.element_ty, ASM, INTERP)
        if INTERP:
            acc = tl.dot(g.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(g, w, acc)
    offs_k = col0 + tl.arange(0, BK)
    mask = (offs_m < r_end)[:, None] & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_k[None, :],
             round_to(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)


def grouped_fp4_grad_input(g: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           global_scale: torch.Tensor | None, group: int, mx: bool) -> torch.Tensor:
    """The input gradient of `grouped_fp4_linear`: g [M, N] (rows sorted by expert as x was) -> [M, K] in
    g.dtype, row r = g[r] @ W_e. Weight tensors as in `grouped_fp4_linear`."""
    n, k = packed.shape[1], 2 * packed.shape[2]
    out = torch.zeros((g.shape[0], k), device=g.device, dtype=g.dtype)  # rows past offsets[-1] stay 0
    run = _launch(g, n, offsets, packed, scale, global_scale, mx, "gradients")
    if run is None:
        return out
    g2, s, gs = as_2d(g), run.scale, run.global_scale
    _grouped_fp4_grad_input_kernel[(triton.cdiv(k, BK), run.experts.numel())](
        g2, packed, s, gs if gs is not None else s, out, run.experts, run.firsts, run.ends, n, k, g2.stride(0),
        packed.stride(0), packed.stride(1), s.stride(0), s.stride(1), out.stride(0),
        HAS_GS=gs is not None, BM=run.bm, BN=BN, BK=BK, GROUP=group, MX=mx, EVEN_N=n % BN == 0,
        EVEN_K=k % BK == 0, ASM=run.asm, INTERP=g.device.type != "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
