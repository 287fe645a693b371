"""Gluon kernel: the input gradient dX = dY @ W of an NVFP4 weight on Hopper, without a dequantized copy of W.

The training pass's backward through a frozen NVFP4 layer (`nvfp4_matmul.nvfp4_linear_grad_input`). The forward
kernel (`nvfp4_wgmma_ws`) reads each packed byte as two consecutive k of one weight row, which is what
wgmma's register A operand wants there: consecutive pairs along the reduction. Here the reduction runs over the
weight's rows n, so a byte holds two *output* columns k, 2j and 2j + 1. The product is computed transposed,

    dX^T[K, M] = W^T[K, N] @ dY^T[N, M]:  A = the decoded W^T tile [64 k, BNR n] in registers,
                                          B = the dY tile [BM, BNR] from shared memory (TMA, as stored),

and the A operand's rows are relabelled so that no data moves: the fragment row r of the m64 tile stands for
the weight column

    k(r) = 2 (r & 7) + ((r >> 3) & 1) + (r & 48)      (rows r and r + 8 of a thread are the two nibbles of a byte)

and the epilogue writes accumulator row r to dX column k(r). A thread's bf16x2 register pairs rows n, n + 1 of
one byte column: the decode takes four bytes (rows n, n + 8, n + 1, n + 9) per 32-bit word and multiplies each
bf16x2 by its own pair of row scales (`_decode_asm` with DECODE_PTX_PAIRS). Neither dY nor the output is
permuted in memory.

Warp-specialized as the forward kernel: one producer warp issues, per step of BNR weight rows, the TMA copies of
the dY tile [BM, BNR] and of the weight bytes [BNR, 32] of each consumer into ring slot s (ready[s]); NC
consumer warpgroups (2, or 4 at <= 64 rows; 64 output columns each, the same dY tile) decode and run wgmma, then
release the slot (empty[s]). The scale bytes of a step (one byte per weight row and 16 columns) are loaded
BNR / 32 per thread, one step ahead, and spread across the warp by a layout conversion.

Grid (cdiv(K, 64 NC), cdiv(M, BM), splits): splits > 1 split the reduction over N and use `_store_out`'s split-K
store (arrival counters for cdiv(K, 64) x cdiv(M, BM) tiles). Needs bf16 dY with N % 8 == 0 (TMA row
alignment), K % 32 == 0 and a global scale > 128 (the bf16 decode step). GPU-only: Gluon does not run under the
Triton interpreter.
"""

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..operands import as_2d, global_scale_f32, scale_bytes, step_fits_bf16
from ..route import GLUON_GRAD_INPUT, sm_count, tile_config
from ..workspace import alloc, counters
from .common import DECODE_PTX_PAIRS, STEP_BF16, _decode_asm, _split_group_layout, _step_bf16, _store_out

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
RB = gl.constexpr(64)  # output columns k per consumer warpgroup (one wgmma M)
JB_BYTES = 32  # their bytes per weight row
JB = gl.constexpr(JB_BYTES)


def pick_config(m: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM dY rows per tile, BNR weight rows per step, stages, consumer warpgroups, registers per consumer) by the
    H100 sweep (docs/benchmarks.md, "NVFP4 input gradient"; `grad_input_ab.py` in docs/benchmarks.md's script list): at
    <= 64 rows four consumers of a 64-row tile (more warps decoding: the decode, not the MMA, is the limit there),
    at <= 128 a 128-row tile, above it 256 rows with 128 weight rows per step for outputs wider than 8192, else 64
    (the `gluon_grad_input` table, kernels/tuning/sm90.json, `route.tile_config`)."""
    t = tile_config(GLUON_GRAD_INPUT, m, k=k)
    return t["BM"], t["BNR"], t["NS"], t["NC"], t["CREGS"]


@gluon.constexpr_function
def _byte_layout(al, BNR):
    """Layout P of a consumer's byte tile [BNR n, 32 j] such that decoding it (`_decode_asm` with
    DECODE_PTX_PAIRS), relabelling (`_unswap`, `_to_operand`) gives the wgmma A operand al [64 r, BNR n] with no
    data movement.
    A basis (r, n) of al becomes (n, j(r)), j(r) = (r & 7) + (r >> 4) * 8; the basis r = 8 (the nibble) is
    dropped; and the register bases n + 1 and n + 8 trade places so that the four bytes of one decode word are
    rows n, n + 8, n + 1, n + 9 (the decode pairs bytes 0 and 2, 1 and 3)."""
    al = gl._unwrap_if_constexpr(al) if hasattr(gl, "_unwrap_if_constexpr") else al

    def tr(b):
        r, n = b
        return [n, (r & 7) + (r >> 4) * 8]

    regs = [tr(b) for b in al.reg_bases if b != [8, 0]]
    assert regs[:2] == [[1, 0], [8, 0]], al.reg_bases  # the A operand's first registers: n + 1, then n + 8
    regs[0], regs[1] = regs[1], regs[0]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[tr(b) for b in al.lane_bases],
                                      warp_bases=[tr(b) for b in al.warp_bases], block_bases=[], shape=[BNR, 32])


@gluon.constexpr_function
def _scale_src_layout(BNR):
    """Layout of the scale bytes [BNR n, 4 g] a consumer loads per step: BNR / 32 rows n per thread, the lanes
    along n, one warp per 16-column group g (as in `_byte_layout`, where warp w holds j in [8 w, 8 w + 8))."""
    per_thread = BNR // 32
    regs = [[1 << i, 0] for i in range(per_thread.bit_length() - 1)]
    lanes = [[per_thread << i, 0] for i in range(5)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[0, 1], [0, 2]],
                                      block_bases=[], shape=[BNR, 4])


@gluon.jit
def _unswap(t, BNR: gl.constexpr, C: gl.constexpr):
    """[BNR, C] -> the same data with row bits 0 and 3 exchanged (a relabelling: row n <-> row n ^ 9 when bits
    0 and 3 differ)."""
    t = gl.reshape(t, [BNR // 16, 2, 4, 2, C])
    t = gl.permute(t, (0, 3, 2, 1, 4))
    return gl.reshape(t, [BNR, C])


@gluon.jit
def _to_operand(lo, hi, BNR: gl.constexpr):
    """lo, hi [BNR n, 32 j] (W[n, 2j], W[n, 2j + 1]) -> [64 r, BNR n] with row r holding column k(r) (module
    docstring): r = 16 (j >> 3) + 8 h + (j & 7) for k = 2 j + h."""
    t = gl.join(lo, hi)  # [BNR, 32, 2]
    t = gl.reshape(t, [BNR, 4, 8, 2])
    t = gl.permute(t, (1, 3, 2, 0))  # [j >> 3, h, j & 7, n]
    return gl.reshape(t, [64, BNR])


@gluon.jit
def _to_columns(acc, BM: gl.constexpr):
    """acc [64 r, BM] -> the same data indexed by output column k(r) - 64 rb (a relabelling)."""
    t = gl.reshape(acc, [4, 2, 8, BM])  # [r >> 4, (r >> 3) & 1, r & 7, m]
    t = gl.permute(t, (0, 2, 1, 3))
    return gl.reshape(t, [64, BM])


@gluon.jit
def _producer(g_desc, w_desc, gys, wqs, ready, empty, pid_k, pid_m, n_lo, n, BM: gl.constexpr,
              BNR: gl.constexpr, NS: gl.constexpr, NC: gl.constexpr):
    """One warp: fills ring slot i % NS with step i's dY tile and the NC consumers' weight bytes once all
    consumers have released it (a fresh barrier passes the parity-1 wait at once)."""
    STAGE_BYTES: gl.constexpr = g_desc.block_type.nbytes + NC * w_desc.block_type.nbytes
    for i in range(n):
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(s), STAGE_BYTES)
        n0 = n_lo + i * BNR
        for c in gl.static_range(NC):
            _tma_load(w_desc, [n0, (NC * pid_k + c) * JB], ready.index(s), wqs.index(NC * s + c))
        _tma_load(g_desc, [pid_m * BM, n0], ready.index(s), gys.index(s))


@gluon.jit
def _scales(s_ptr, N, K, stride_s, rb, n0, valid, SRC: gl.constexpr, BNR: gl.constexpr):
    """Scale bytes [BNR, 4] of weight rows n0 + swap(n) (row bits 0 and 3 exchanged: the order DECODE_PTX_PAIRS
    wants its scale pairs in) and the 4 groups of columns [64 rb, 64 rb + 64), in layout SRC; zeros past N,
    past K or when valid is False."""
    n = gl.arange(0, BNR, layout=gl.SliceLayout(1, SRC))
    n = n ^ (((n ^ (n >> 3)) & 1) * 9)
    rows = n0 + n
    g = rb * 4 + gl.arange(0, 4, layout=gl.SliceLayout(0, SRC))
    m = gl.expand_dims((rows < N) & valid, 1) & gl.expand_dims(g * 16 < K, 0)
    return gl.load(s_ptr + gl.expand_dims(rows * stride_s, 1) + gl.expand_dims(g, 0), mask=m, other=0)


@gluon.jit
def _consumer(gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr, cnt_ptr,
              pid_k, pid_m, pid_s, n_lo, n, CID: gl.constexpr, BM: gl.constexpr, BNR: gl.constexpr,
              NS: gl.constexpr, NC: gl.constexpr, PARTIAL: gl.constexpr):
    """One warpgroup: output columns [64 rb, 64 rb + 64) (rb = NC pid_k + CID) x the shared dY tile, then its
    own store (split-K: as one 64-column program)."""
    NW: gl.constexpr = 4
    rb = NC * pid_k + CID
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    P: gl.constexpr = _byte_layout(gl.to_linear_layout(A, [RB, BNR]), BNR)
    L3: gl.constexpr = _split_group_layout(P, BNR, JB)
    S: gl.constexpr = gl.SliceLayout(2, L3)
    SRC: gl.constexpr = _scale_src_layout(BNR)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale
    acc = gl.zeros([RB, BM], gl.float32, layout=mma)
    sb = _scales(s_ptr, N, K, stride_s, rb, n_lo, n > 0, SRC, BNR)
    for i in range(n):
        sb_next = _scales(s_ptr, N, K, stride_s, rb, n_lo + (i + 1) * BNR, i + 1 < n, SRC, BNR)
        s = i % NS
        st = gl.convert_layout(_step_bf16(sb, c), S)
        stb = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([BNR, 4, 8], 0, gl.bfloat16, L3))[0],
                         [BNR, JB])
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        q = wqs.index(NC * s + CID).load(P)
        # each 32-bit word of q holds rows (n, n + 8, n + 1, n + 9) of one byte column and stb their scales in the
        # order (n, n + 1, n + 8, n + 9): lo = (W[n, 2j], W[n + 1, 2j], W[n + 8, 2j], W[n + 9, 2j]) per word (the
        # element order SIGMA), hi the same at column 2j + 1
        lo, hi = _decode_asm(q, gl.convert_layout(stb, P, assert_trivial=True), DECODE_PTX_PAIRS, STEP_BF16)
        a = gl.convert_layout(_to_operand(_unswap(lo, BNR, JB), _unswap(hi, BNR, JB), BNR), A)
        tok = warpgroup_mma(a, gys.index(s).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(0, deps=(tok, a))
        mbarrier.arrive(empty.index(s), count=1)  # this warpgroup's reads of slot s are done
        sb = sb_next
    out = _to_columns(acc, BM)
    OL: gl.constexpr = out.type.layout
    _store_out(out, OL, out_ptr, out_ptr, ws_ptr, cnt_ptr, M, K, stride_om, rb, pid_m, pid_s, RB, BM,
               PARTIAL, False, NW)


@gluon.jit
def nvfp4_grad_input_kernel(g_desc, w_desc, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr, cnt_ptr,
                            tiles_per_split, BM: gl.constexpr, BNR: gl.constexpr, NS: gl.constexpr,
                            NC: gl.constexpr, CREGS: gl.constexpr, PARTIAL: gl.constexpr):
    """g_desc: TMA descriptor of dY [M, N] bf16, block [BM, BNR]; w_desc: of weight_packed [N, K/2] uint8, block
    [BNR, 32]; out: dX [M, K] bf16. NC (2 or 4) consumer warpgroups of 64 output columns each. Launched with
    num_warps=4 (consumer 0; the other consumers and the producer are added by warp_specialize)."""
    pid_k = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    gys = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BNR], g_desc.layout)
    wqs = gl.allocate_shared_memory(gl.uint8, [NC * NS, BNR, JB], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)  # the producer's expect (+ the TMA bytes)
        mbarrier.init(empty.index(s), count=NC)  # one arrive per consumer warpgroup
    t_lo = pid_s * tiles_per_split
    n = gl.minimum((N + BNR - 1) // BNR - t_lo, tiles_per_split)  # >= 1 for every program of the launcher's grid
    n_lo = t_lo * BNR
    # the partitions are spelled out: warp_specialize takes a literal list of (function, arguments)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 0, BM, BNR, NS, NC, PARTIAL)),
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 1, BM, BNR, NS, NC, PARTIAL)),
            (_producer, (g_desc, w_desc, gys, wqs, ready, empty, pid_k, pid_m, n_lo, n, BM, BNR, NS, NC)),
        ], [4, 1], [CREGS, 40])
    else:
        gl.static_assert(NC == 4, "NC must be 2 or 4")
        gl.warp_specialize([
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 0, BM, BNR, NS, NC, PARTIAL)),
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 1, BM, BNR, NS, NC, PARTIAL)),
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 2, BM, BNR, NS, NC, PARTIAL)),
            (_consumer, (gys, wqs, ready, empty, s_ptr, gs_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                         cnt_ptr, pid_k, pid_m, pid_s, n_lo, n, 3, BM, BNR, NS, NC, PARTIAL)),
            (_producer, (g_desc, w_desc, gys, wqs, ready, empty, pid_k, pid_m, n_lo, n, BM, BNR, NS, NC)),
        ], [4, 4, 4, 1], [CREGS, CREGS, CREGS, 40])
    for s in gl.static_range(NS):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def nvfp4_grad_input_ws(g: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                        sms: int, config: tuple[int, int, int, int, int] | None = None, split: int | None = None,
                        waves: float = 1.0) -> torch.Tensor:
    """g [M, N] bf16 (unit column stride) -> g @ W, [M, K] bf16. packed uint8 [N, K/2] contiguous, scale_u8 uint8
    [N, K/16] (E4M3 bits), global_scale fp32 [1]. config (BM, BNR, NS, NC, CREGS); split: number of splits of the
    reduction over N (None: about `waves` programs per SM). config None: `pick_config`'s."""
    m, n = g.shape
    k = packed.shape[1] * 2
    bm, bnr, ns, nc, cregs = config or pick_config(m, k)
    if g.stride(1) != 1 or g.stride(0) % 8 or g.data_ptr() % 16:
        g = g.contiguous()
    if n % 8 or k % 32 or packed.data_ptr() % 16 or packed.stride(0) != k // 2:
        raise ValueError(f"N={n}, K={k}: needs N % 8 == 0, K % 32 == 0 and contiguous 16-byte aligned weight "
                         f"bytes (TMA)")
    tiles = triton.cdiv(n, bnr)
    grid_k, grid_m = triton.cdiv(k, nc * 64), triton.cdiv(m, bm)
    if split is None:
        split = math.ceil(waves * sms / (grid_k * grid_m))
    per = triton.cdiv(tiles, max(1, min(split, tiles)))
    s = triton.cdiv(tiles, per)
    out = alloc((m, k), g.device, torch.bfloat16)
    if s > 1:
        if s * m * k >= 2**31:
            raise ValueError(f"split-K workspace of {s} x {m} x {k} elements exceeds int32 indexing")
        ws = alloc((s, m, k), g.device, torch.float32)
        cnt = counters("gluon_grad_input", g.device, nc * grid_k * grid_m)
    else:
        ws, cnt = out, out
    g_layout = gl.NVMMASharedLayout.get_default_for([bm, bnr], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([bnr, JB_BYTES], gl.uint8)
    g_desc = TensorDescriptor.from_tensor(g, [bm, bnr], g_layout)
    w_desc = TensorDescriptor.from_tensor(packed, [bnr, JB_BYTES], w_layout)
    nvfp4_grad_input_kernel[(grid_k, grid_m, s)](
        g_desc, w_desc, scale_u8, global_scale, out, m, n, k, scale_u8.stride(0), out.stride(0), ws, cnt, per,
        BM=bm, BNR=bnr, NS=ns, NC=nc, CREGS=cregs, PARTIAL=s > 1, num_warps=4)
    return out


def nvfp4_grad_input_gluon(grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                           weight_global_scale: torch.Tensor) -> torch.Tensor:
    """grad_out [..., N] bf16 -> grad_out @ W, [..., K] bf16, for the NVFP4 weight as stored (weight_packed uint8
    [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale fp32 [1]). The caller chose this backend
    (`route`); a requirement it breaks (module docstring) raises ValueError."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if grad_out.dtype != torch.bfloat16 or grad_out.shape[-1] != n or n % 8 or k % 32:
        raise ValueError(f"Gluon NVFP4 input gradient: bf16 grad_out [..., N] with N % 8 == 0 and K % 32 == 0, got "
                         f"{grad_out.dtype} {tuple(grad_out.shape)} for packed {tuple(weight_packed.shape)}")
    if not step_fits_bf16(weight_global_scale):
        raise ValueError("Gluon NVFP4 input gradient: the global scale must be > 128 (bf16 decode step)")
    y = nvfp4_grad_input_ws(as_2d(grad_out), weight_packed.contiguous(), scale_bytes(weight_scale),
                            global_scale_f32(weight_global_scale), sm_count(grad_out.device, 4))
    return y.reshape(*grad_out.shape[:-1], k)
