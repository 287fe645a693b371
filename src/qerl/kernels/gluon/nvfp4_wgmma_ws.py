"""Gluon kernel: NVFP4 x bf16 on Hopper, warp-specialized, with the decoded weights kept in registers.

Routed (`route.GLUON_WGMMA_WS`) for large weights at a few hundred rows, where it beats the single-warpgroup
wgmma form (`route.ws_rows`). Same product and epilogue as `nvfp4_swap_wgmma_kernel` with XP=True
(out^T[N, M] = W @ xp^T, the weight tile as wgmma's register A operand, x as the shared-memory B operand), but
the work of a program is split between warps that never meet at a CTA barrier:

    producer (1 warp):   per K step, TMA of the x_lo / x_hi tiles [BM, BKH] and the weight bytes of two 64-row
                         blocks [64, BKH] into ring slot s, all completing on ready[s]; waits on empty[s] first
    consumer c (c = 0, 1; one warpgroup each, 64 weight rows each, the same x tile):
                         wait ready[s] -> read its bytes from shared memory into the A layout, decode -> two
                         asynchronous wgmmas, wait for them -> arrive on empty[s]; scale bytes come from global
                         memory into registers one step ahead (8 per row per step: below TMA's 16-byte box)

The profile of the single-warpgroup form (docs/benchmarks.md, Known limits) shows CTA barriers as the largest
stall and three 4-warp programs per SM that each re-read their x tile. Here the only waits are on mbarriers and
the two consumers share one 256-row x tile (a quarter of the x traffic per multiply of the 64 x 128 tile). What
still costs (H100; docs/benchmarks.md, Known limits, the power-cap table, measured with
`ws_clocks.py` in docs/benchmarks.md's script list): at 1024-4096 rows every variant runs at the 700 W power cap, and
the kernel does 0.84-0.94x the work per clock cycle of cuBLAS, with or without the decode (within 1%, 7% on one
shape; a zero-weight variant of this kernel without the decode, measured once and not kept, ran faster because it
drew less power: a higher clock).
Ping-pong turns between the consumers and decoding one step ahead were measured and were not faster (commits
a6cd4a0 and cd8ac76; with the loads issued by a consumer, so that no warpgroup's setmaxnreg is below the wgmma
pipeline's registers, ptxas no longer serializes the decode-ahead schedule; at the same tile it is 0-12% faster
than this one, and slower than this kernel's 256-row tile).

Grid (cdiv(N, 128), cdiv(M, BM), splits); splits > 1 use the split-K store of `_store_out`, each consumer acting
as one 64-row program (arrival counters for cdiv(N, 64) x cdiv(M, BM) tiles). x must be `permute_x_kernel`'s
output for BN = 64. GPU-only: Gluon does not run under the Triton interpreter.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..route import GLUON_WGMMA_WS, tile_config
from ..workspace import alloc, counters
from .common import (DECODE_PTX, STEP_BF16, _decode_asm, _lora_tile, _split_group_layout, _step_bf16, _store_out,
                     lora_operands)
from .nvfp4 import call_on_stored_weight, split_for
from .nvfp4_wgmma import _phys_layout, _pi_bits, _to_logical, permute_x_kernel

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
RB = gl.constexpr(64)  # weight rows per consumer warpgroup (one wgmma M)


def default_config() -> tuple[int, int, int, int]:
    """(BM x rows per tile, BKH, pipeline stages, registers per consumer): the `gluon_wgmma_ws` table
    (kernels/tuning/sm90.json, `route.tile_config`; H100, docs/benchmarks.md "Warp-specialized NVFP4 kernel",
    measured with `wgmma_ws_ab.py` in docs/benchmarks.md's script list)."""
    t = tile_config(GLUON_WGMMA_WS, 0)
    return t["BM"], t["BKH"], t["NS"], t["CREGS"]


@gluon.jit
def _scales(s_ptr, N, stride_s, rb, k0, valid, S: gl.constexpr, BKH: gl.constexpr):
    """Scale bytes [64, BKH / 8] of weight rows [64 rb, 64 rb + 64), columns [k0, k0 + 2 BKH), in layout S
    (rows >= N clamped; valid False: zeros, no access)."""
    G: gl.constexpr = BKH // 8
    rows = gl.minimum(rb * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, S)), N - 1)
    gg = gl.arange(0, G, layout=gl.SliceLayout(0, S))
    ptr = s_ptr + gl.expand_dims(rows * stride_s, 1) + gl.expand_dims(k0 // 16 + gg, 0)
    m = gl.full([RB, G], 1, gl.int1, S) & valid
    return gl.load(ptr, mask=m, other=0)


@gluon.jit
def _decode(wq_s, sb, c, A: gl.constexpr, P: gl.constexpr, L3: gl.constexpr, p: gl.constexpr, BKH: gl.constexpr):
    """Weight bytes [64, BKH] of one slot (shared) + their scale bytes sb (registers, SliceLayout(2, L3)) ->
    (lo, hi) bf16 [64, BKH] in the wgmma A-operand layout A (logical k)."""
    G: gl.constexpr = BKH // 8
    q = wq_s.load(P)
    st = _step_bf16(sb, c)
    stb = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([RB, G, 8], 0, gl.bfloat16, L3))[0], [RB, BKH])
    lo, hi = _decode_asm(q, gl.convert_layout(stb, P, assert_trivial=True), DECODE_PTX, STEP_BF16)
    return gl.convert_layout(_to_logical(lo, p, RB, BKH), A), gl.convert_layout(_to_logical(hi, p, RB, BKH), A)


@gluon.jit
def _producer(x_desc, w_desc, xls, xhs, wqs, ready, empty, pid_n, pid_m, k_lo, n, BM: gl.constexpr,
              BKH: gl.constexpr, NS: gl.constexpr):
    """One warp: fills ring slot i % NS with step i's x_lo, x_hi and the two weight-byte blocks once both
    consumers have released it (a fresh barrier passes the parity-1 wait at once)."""
    BK: gl.constexpr = 2 * BKH
    STAGE_BYTES: gl.constexpr = 2 * x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    for i in range(n):
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(s), STAGE_BYTES)
        k0 = k_lo + i * BK
        _tma_load(w_desc, [2 * pid_n * RB, k0 // 2], ready.index(s), wqs.index(2 * s))
        _tma_load(w_desc, [(2 * pid_n + 1) * RB, k0 // 2], ready.index(s), wqs.index(2 * s + 1))
        _tma_load(x_desc, [pid_m * BM, k0], ready.index(s), xls.index(s))
        _tma_load(x_desc, [pid_m * BM, k0 + BKH], ready.index(s), xhs.index(s))


@gluon.jit
def _consumer(xls, xhs, wqs, ready, empty, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_s, stride_om, ws_ptr, cnt_ptr,
              h_ptr, lb_ptr, stride_hm, R, pid_n, pid_m, pid_k, k_lo, n, CID: gl.constexpr, BM: gl.constexpr,
              BKH: gl.constexpr, NS: gl.constexpr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr, RP: gl.constexpr):
    """One warpgroup: weight rows [64 rb, 64 rb + 64) (rb = 2 pid_n + CID) x the shared x tile; its own
    epilogue (LoRA, bias, split-K) as a 64-row program."""
    NW: gl.constexpr = 4
    BK: gl.constexpr = 2 * BKH
    rb = 2 * pid_n + CID
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    al: gl.constexpr = gl.to_linear_layout(A, [RB, BKH])
    p: gl.constexpr = _pi_bits(al, BKH)
    P: gl.constexpr = _phys_layout(al, p, RB, BKH)
    L3: gl.constexpr = _split_group_layout(P, RB, BKH)
    S: gl.constexpr = gl.SliceLayout(2, L3)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale
    acc = gl.zeros([RB, BM], gl.float32, layout=mma)
    sb = _scales(s_ptr, N, stride_s, rb, k_lo, n > 0, S, BKH)
    for i in range(n):
        sb_next = _scales(s_ptr, N, stride_s, rb, k_lo + (i + 1) * BK, i + 1 < n, S, BKH)
        s = i % NS
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        lo, hi = _decode(wqs.index(2 * s + CID), sb, c, A, P, L3, p, BKH)
        tok = warpgroup_mma(lo, xls.index(s).permute((1, 0)), acc, is_async=True)
        tok = warpgroup_mma(hi, xhs.index(s).permute((1, 0)), tok, is_async=True)
        acc, lo, hi = warpgroup_mma_wait(0, deps=(tok, lo, hi))
        mbarrier.arrive(empty.index(s), count=1)  # this warpgroup's reads of slot s (bytes; x by wgmma) are done
        sb = sb_next
    if RP > 0:
        mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        acc2 = _lora_tile(gl.convert_layout(acc, mma2), h_ptr, lb_ptr, stride_hm, R, M, N, rb, pid_m, pid_k == 0, RB,
                          BM, RP, NW)
        _store_out(acc2, mma2, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, rb, pid_m, pid_k, RB, BM, PARTIAL,
                   HAS_BIAS, NW)
    else:
        _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, rb, pid_m, pid_k, RB, BM, PARTIAL,
                   HAS_BIAS, NW)


@gluon.jit
def nvfp4_wgmma_ws_kernel(x_desc, w_desc, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                          cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R, BM: gl.constexpr, BKH: gl.constexpr,
                          NS: gl.constexpr, CREGS: gl.constexpr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                          RP: gl.constexpr):
    """x_desc: TMA descriptor of xp [M, K] bf16 (`permute_x_kernel`, BN = 64), block [BM, BKH]; w_desc: of
    weight_packed [N, K/2] uint8, block [64, BKH]; launched with num_warps=4 (consumer 0; the other consumer
    and the producer are added by warp_specialize)."""
    BK: gl.constexpr = 2 * BKH
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    xls = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], x_desc.layout)
    xhs = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], x_desc.layout)
    wqs = gl.allocate_shared_memory(gl.uint8, [2 * NS, RB, BKH], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)  # the producer's expect (+ the TMA bytes)
        mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)  # >= 1 for every program of the launcher's grid
    k_lo = t_lo * BK
    gl.warp_specialize([
        (_consumer, (xls, xhs, wqs, ready, empty, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_s, stride_om, ws_ptr,
                     cnt_ptr, h_ptr, lb_ptr, stride_hm, R, pid_n, pid_m, pid_k, k_lo, n, 0, BM, BKH, NS, PARTIAL,
                     HAS_BIAS, RP)),
        (_consumer, (xls, xhs, wqs, ready, empty, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_s, stride_om, ws_ptr,
                     cnt_ptr, h_ptr, lb_ptr, stride_hm, R, pid_n, pid_m, pid_k, k_lo, n, 1, BM, BKH, NS, PARTIAL,
                     HAS_BIAS, RP)),
        (_producer, (x_desc, w_desc, xls, xhs, wqs, ready, empty, pid_n, pid_m, k_lo, n, BM, BKH, NS)),
    ], [4, 1], [CREGS, 40])
    for s in gl.static_range(NS):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def nvfp4_linear_ws(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None, sms: int, config: tuple[int, int, int, int] | None = None,
                    split: int | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                    waves: float = 1.0) -> torch.Tensor:
    """x [M, K] bf16 -> x @ W^T (+ bias) (+ h @ lb^T), [M, N] bf16; operands as `nvfp4.nvfp4_linear_swap`.
    config (BM, BKH, NS, CREGS), None: `default_config()`; split: number of K splits (None: `split_for` at `waves`
    programs per SM)."""
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    bm, bkh, ns, cregs = config or default_config()
    if k % (2 * bkh) or (k // 2) % 16 or packed.data_ptr() % 16:
        raise ValueError(f"K={k}: needs K % {2 * bkh} == 0 and 16-byte aligned weight rows for TMA")
    tiles = k // (2 * bkh)
    if split is None:
        s, per = split_for(m, n, k, (2 * 64, bm, bkh), sms, waves)
    else:
        per = triton.cdiv(tiles, max(1, min(split, tiles)))
        s = triton.cdiv(tiles, per)
    grid = (triton.cdiv(n, 2 * 64), triton.cdiv(m, bm), s)
    out = alloc((m, n), x.device, torch.bfloat16)
    if s > 1:
        if s * m * n >= 2**31:
            raise ValueError(f"split-K workspace of {s} x {m} x {n} elements exceeds int32 indexing")
        ws, cnt = alloc((s, m, n), x.device, torch.float32), counters("gluon_ws", x.device, 2 * grid[0] * grid[1])
    else:
        ws, cnt = out, out
    b = bias if bias is not None else out
    h, lb, stride_hm, r, rp = lora_operands(lora, m, n, out)
    xp = alloc((m, k), x.device, torch.bfloat16)
    permute_x_kernel[(triton.cdiv(m, bm), tiles)](x, xp, m, k, x.stride(0), BN=64, BM=bm, BKH=bkh, NW=4, num_warps=4)
    x_desc = TensorDescriptor.from_tensor(xp, [bm, bkh], gl.NVMMASharedLayout.get_default_for([bm, bkh], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(packed, [64, bkh], gl.NVMMASharedLayout.get_default_for([64, bkh], gl.uint8))
    nvfp4_wgmma_ws_kernel[grid](
        x_desc, w_desc, scale_u8, global_scale, b, out, m, n, k, scale_u8.stride(0), out.stride(0), ws, cnt, per, h, lb,
        stride_hm, r, BM=bm, BKH=bkh, NS=ns, CREGS=cregs, PARTIAL=s > 1, HAS_BIAS=bias is not None, RP=rp, num_warps=4)
    return out


def nvfp4_linear_ws_gluon(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                          weight_global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                          lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> x @ W^T + bias (+ h @ lb^T for lora = (h [..., R], lb = scaling * B [N, R])), [..., N]
    bf16, with the warp-specialized kernel; `nvfp4.nvfp4_linear_gluon`'s contract (`call_on_stored_weight`)."""
    def launch(x2, packed, scale_u8, gs, b, sms, lo):
        return nvfp4_linear_ws(x2, packed, scale_u8, gs, b, sms, lora=lo)

    return call_on_stored_weight(x, weight_packed, weight_scale, weight_global_scale, bias, lora, launch)
