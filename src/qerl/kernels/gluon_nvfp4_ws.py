"""Gluon kernel: NVFP4 weight x bf16 activations on Hopper for many rows, warp-specialized (sm_90).

y[M, N] = x[M, K] @ W[N, K]^T (+ bias), one program per [BM, BN] output tile, three partitions that share a ring
of NS shared-memory stages and hand them over by mbarriers, so the FP4 decode and the tensor-core work overlap
instead of alternating:
  producer (one warpgroup): per k step, once the stage is free, a TMA of the x tile [BM, BK]; cp.async of the
    raw weight bytes [BN, BK/2] and scale bytes [BN, BK/16] (its own NSD-stage pipeline); the decode in
    registers (`gluon_common._decode_stage`: inline-PTX nibble decode, per-group scale step), the nibble
    pairing undone by a register relabelling (no data movement); a store of the bf16 tile [BN, BK] into the
    NVMMA-swizzled ring;
  MMA (the default partition, MMA_WARPS / 4 warpgroups, BM / that rows each): waits for both tiles of a stage,
    wgmma x_tile @ w_tile^T with one group in flight, releases a stage once its wgmma has retired; then the
    epilogue (+ bias, bf16 store).
Barriers per stage: x_ready (TMA bytes), w_ready (the producer's arrive), empty (the MMA partition's release).
The x TMA is not a partition of its own: a one-warp loader pads to a warpgroup, and 16 warps leave ptxas 128
registers per thread, too few for two warpgroups of wgmma accumulators (12 warps give 168).

Requirements (`route` sends only such calls here): sm_90, bf16 x with 16-byte aligned rows, K % BK == 0, scale
rows 4-byte aligned, global_scale > 128 (`operands.step_fits_bf16`). GPU-tested only: Gluon does not run under
the Triton interpreter.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_common import _barrier, _commit, _decode_stage, _issue_w, _wait
from .workspace import alloc

# API names that differ between Triton 3.6 and 3.9
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _natural_order(lo, hi, BN: gl.constexpr, BKH: gl.constexpr):
    """(lo, hi) [BN, BKH] of `_decode_stage` (element j' = 4 g + 2 b0 + b1 holds byte j = 4 g + 2 b1 + b0;
    lo its low nibble, k = 2 j, hi its high one) -> the tile [BN, 2 BKH] in k order, by relabelling registers."""
    w = gl.join(lo, hi)  # [n, j', h]
    w = gl.reshape(w, [BN, BKH // 4, 2, 2, 2])  # [n, g, b0, b1, h]
    w = gl.permute(w, [0, 1, 3, 2, 4])  # [n, g, b1, b0, h]: k = 8 g + 4 b1 + 2 b0 + h
    return gl.reshape(w, [BN, 2 * BKH])


@gluon.jit
def _producer(x_desc, x_ring, x_ready, w_ptr, s_ptr, gs_ptr, N, stride_w, stride_s, wqs, wss, w_ring, w_ready, empty,
              pid_m, pid_n, n_k, BM: gl.constexpr, BN: gl.constexpr, BKH: gl.constexpr, NS: gl.constexpr,
              NSD: gl.constexpr, SALIGN: gl.constexpr, SKIP_DECODE: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    TC: gl.constexpr = BKH // 16
    # 16 consecutive bytes (two scale groups) per thread: the decode's 4-byte packs and its scale run
    L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TC, TC], [NW, 1], [1, 0])
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale (2^134 would overflow fp32)
    for p in gl.static_range(NSD - 1):
        _issue_w(wqs.index(p), wss.index(p), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, p * 2 * BKH, p < n_k,
                 BN, BKH, NW, SALIGN)
        _commit()
    for i in range(n_k):
        st = i % NS
        mbarrier.wait(empty.index(st), ((i // NS) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(x_ready.index(st), x_desc.block_type.nbytes)
        _tma_load(x_desc, [pid_m * BM, i * 2 * BKH], x_ready.index(st), x_ring.index(st))
        _wait(NSD - 2)
        _barrier()  # raw stage i visible to every decoder thread; raw stage (i - 1) % NSD free
        j = i + NSD - 1
        _issue_w(wqs.index(j % NSD), wss.index(j % NSD), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, j * 2 * BKH,
                 j < n_k, BN, BKH, NW, SALIGN)
        _commit()
        if SKIP_DECODE:
            w_ring.index(st).store(gl.zeros([BN, 2 * BKH], gl.bfloat16, L))
        else:
            lo, hi = _decode_stage(wqs.index(i % NSD), wss.index(i % NSD), c, L, gl.to_linear_layout(L, [BN, BKH]),
                                   BN, BKH)
            w_ring.index(st).store(_natural_order(lo, hi, BN, BKH))
        fence_async_shared()  # generic-proxy stores -> the wgmma's async-proxy reads
        mbarrier.arrive(w_ready.index(st))
    _wait(0)


@gluon.jit
def _mma(x_ring, w_ring, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, stride_om, pid_m, pid_n, n_k,
         BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, HAS_BIAS: gl.constexpr, SKIP_MMA: gl.constexpr,
         num_warps: gl.constexpr):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
    for i in range(n_k):
        s = i % NS
        ph = (i // NS) & 1
        mbarrier.wait(x_ready.index(s), ph)
        mbarrier.wait(w_ready.index(s), ph)
        if not SKIP_MMA:
            acc = warpgroup_mma(x_ring.index(s), w_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, x_ring.index(s), w_ring.index(s)))
        mbarrier.arrive(empty.index((i + NS - 1) % NS), pred=i > 0)  # the wgmma of step i - 1 has retired
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
    rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 0)
    mask = gl.expand_dims(rm < M, 1) & gl.expand_dims(rn < N, 0)
    gl.store(out_ptr + gl.expand_dims(rm * stride_om, 1) + gl.expand_dims(rn, 0), acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def nvfp4_ws_kernel(x_desc, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_w, stride_s, stride_om,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, NSD: gl.constexpr,
                    GROUP_M: gl.constexpr, SALIGN: gl.constexpr, HAS_BIAS: gl.constexpr, DEC_WARPS: gl.constexpr,
                    DEC_REGS: gl.constexpr, SKIP: gl.constexpr, num_warps: gl.constexpr):
    # grouped tile order: GROUP_M row tiles share each weight tile while it is in L2
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    n_k = K // BK
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BK], x_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, BK], w_layout)
    # the decoder's raw stages (cp.async targets, read back in its own register layout)
    RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    wqs = gl.allocate_shared_memory(gl.uint8, [NSD, BN, BK // 2], RAW)
    wss = gl.allocate_shared_memory(gl.uint8, [NSD, BN, BK // 16], RAW)
    x_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma, (x_ring, w_ring, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, stride_om, pid_m, pid_n, n_k,
                BM, BN, NS, HAS_BIAS, SKIP == 2, num_warps)),
        (_producer, (x_desc, x_ring, x_ready, w_ptr, s_ptr, gs_ptr, N, stride_w, stride_s, wqs, wss, w_ring, w_ready,
                     empty, pid_m, pid_n, n_k, BM, BN, BK // 2, NS, NSD, SALIGN, SKIP == 1)),
    ], [DEC_WARPS], [DEC_REGS])
    for i in gl.static_range(NS):
        mbarrier.invalidate(x_ready.index(i))
        mbarrier.invalidate(w_ready.index(i))
        mbarrier.invalidate(empty.index(i))


# (BM, BN, BK, NS, NSD, GROUP_M, DEC_WARPS, DEC_REGS, MMA_WARPS): tile rows of x, weight rows, columns per step,
# ring stages, decoder raw stages, row tiles sharing a weight tile, decoder warps and registers, warps of the
# MMA partition (4 per warpgroup; each warpgroup takes BM / (MMA_WARPS / 4) rows)
WsConfig = tuple[int, int, int, int, int, int, int, int, int]
DEFAULT_CONFIG: WsConfig = (256, 128, 64, 3, 4, 8, 4, 128, 8)


def nvfp4_linear_ws(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None, config: WsConfig | None = None, skip: str | None = None) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) -> x @ W^T + bias, [M, N] bf16. packed uint8 [N, K/2] contiguous,
    scale_u8 uint8 [N, K/16] (E4M3 bits) contiguous, global_scale fp32 [1] (> 128), bias bf16 [N] or None.
    config: `WsConfig` (None: DEFAULT_CONFIG). skip: a counterfactual for `qerl bench kernels --ws` only, with
    a wrong result: "decode" stores zero tiles instead of decoding, "mma" waits for the tiles but multiplies
    nothing (the time of the other partitions alone)."""
    bm, bn, bk, ns, nsd, group_m, dec_warps, dec_regs, mma_warps = config or DEFAULT_CONFIG
    m, k = x.shape
    n = packed.shape[0]
    if k % bk:
        raise ValueError(f"K={k} is not a multiple of the tile's {bk} columns")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    salign = 16
    while scale_u8.stride(0) % salign:
        salign //= 2
    if salign < 4:
        raise ValueError(f"scale rows must be 4-byte aligned (K % 64 == 0), got row stride {scale_u8.stride(0)}")
    out = alloc((m, n), x.device, torch.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    nvfp4_ws_kernel[grid](x_desc, packed, scale_u8, global_scale, bias if bias is not None else out, out, m, n, k,
                          packed.stride(0), scale_u8.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, NS=ns, NSD=nsd,
                          GROUP_M=group_m, SALIGN=salign, HAS_BIAS=bias is not None, DEC_WARPS=dec_warps,
                          DEC_REGS=dec_regs, SKIP={None: 0, "decode": 1, "mma": 2}[skip], num_warps=mma_warps)
    return out
