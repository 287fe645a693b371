"""Gluon kernel: the sm_90 wgmma NVFP4 kernel (`gluon_nvfp4_wgmma`, x pre-permuted) with its pipeline fed by TMA.

EXPERIMENTAL (A/B candidate, not routed). Same product, grid and epilogue as `nvfp4_swap_wgmma_kernel` with
XP=True; what differs is how a stage reaches shared memory. There every thread issues cp.async for its share of
the x tiles (2 x BM x BKH bf16), the weight bytes (BN x BKH) and the scale bytes, then waits for its own copies
and a CTA barrier makes them visible (Nsight Compute, H100, 7B gate_up at 256 rows: the barrier is the largest
stall, 1.78 cycles per issued instruction, then dispatch 1.18). Here one thread issues three TMA copies per stage
(x_lo, x_hi, the weight bytes) that complete on the stage's mbarrier, which every warp waits on; the scale bytes
(8 per row per step, below TMA's 16-byte minimum box) are loaded into registers one step ahead.
The barrier at the top of each step stays: it certifies that every warp finished step i-1 (decode and
synchronous wgmma), so its slot can be refilled.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import pdl
from .gluon_common import (_barrier, _decode_asm, _lora_tile, _split_group_layout, _step_bf16, _store_out,
                           launch_buffers, lora_operands)
from .gluon_nvfp4 import split_for
from .gluon_nvfp4_wgmma import _phys_layout, _pi_bits, _to_logical, permute_x_kernel
from .workspace import alloc

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
DEFAULT_CONFIG = (64, 128, 64, 16, 3)
LAST_COMPILED: dict = {}


@gluon.jit
def _scales(s_ptr, N, stride_s, pid_n, k0, valid, S: gl.constexpr, BN: gl.constexpr, BKH: gl.constexpr):
    """Scale bytes [BN, BKH / 8] of columns [k0, k0 + 2 BKH) in layout S (rows >= N clamped; valid False:
    zeros, no access)."""
    G: gl.constexpr = BKH // 8
    rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, S)), N - 1)
    gg = gl.arange(0, G, layout=gl.SliceLayout(0, S))
    ptr = s_ptr + gl.expand_dims(rows * stride_s, 1) + gl.expand_dims(k0 // 16 + gg, 0)
    m = gl.full([BN, G], 1, gl.int1, S) & valid
    return gl.load(ptr, mask=m, other=0)


@gluon.jit
def _decode(wq_s, sb, c, A: gl.constexpr, P: gl.constexpr, L3: gl.constexpr, p: gl.constexpr, BN: gl.constexpr,
            BKH: gl.constexpr):
    """Weight bytes of one stage (shared) + its scale bytes sb (registers, layout SliceLayout(2, L3)) -> (lo, hi)
    bf16 [BN, BKH] in the wgmma A-operand layout A (logical k)."""
    G: gl.constexpr = BKH // 8
    q = wq_s.load(P)
    st = _step_bf16(sb, c)
    stb = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([BN, G, 8], 0, gl.bfloat16, L3))[0], [BN, BKH])
    lo, hi = _decode_asm(q, gl.convert_layout(stb, P, assert_trivial=True))
    lo = gl.convert_layout(_to_logical(lo, p, BN, BKH), A)
    hi = gl.convert_layout(_to_logical(hi, p, BN, BKH), A)
    return lo, hi


@gluon.jit
def nvfp4_swap_wgmma_tma_kernel(x_desc, w_desc, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_s, stride_om, ws_ptr,
                                cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R, BN: gl.constexpr,
                                BM: gl.constexpr, BKH: gl.constexpr, NS: gl.constexpr, PARTIAL: gl.constexpr,
                                HAS_BIAS: gl.constexpr, RP: gl.constexpr, PDL: gl.constexpr = False):
    """out^T[N, M] = W @ xp^T as `nvfp4_swap_wgmma_kernel` (XP=True): x_desc: TMA descriptor of xp [M, K] bf16
    (`permute_x_kernel`'s output), block [BM, BKH]; w_desc: of weight_packed [N, K/2] uint8, block [BN, BKH]."""
    NW: gl.constexpr = 4
    BK: gl.constexpr = 2 * BKH
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    al: gl.constexpr = gl.to_linear_layout(A, [BN, BKH])
    p: gl.constexpr = _pi_bits(al, BKH)
    P: gl.constexpr = _phys_layout(al, p, BN, BKH)
    L3: gl.constexpr = _split_group_layout(P, BN, BKH)
    S: gl.constexpr = gl.SliceLayout(2, L3)
    xls = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], x_desc.layout)
    xhs = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], x_desc.layout)
    wqs = gl.allocate_shared_memory(gl.uint8, [NS, BN, BKH], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
    STAGE_BYTES: gl.constexpr = 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)  # >= 1 for every program of the launcher's grid
    k_lo = t_lo * BK
    _barrier()  # barrier inits visible to every thread before anyone waits
    for s in gl.static_range(NS - 1):
        if s < n:
            mbarrier.expect(ready.index(s), STAGE_BYTES)
            _tma_load(w_desc, [pid_n * BN, (k_lo + s * BK) // 2], ready.index(s), wqs.index(s))
    if PDL:  # only static weight bytes were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    for s in gl.static_range(NS - 1):
        if s < n:
            _tma_load(x_desc, [pid_m * BM, k_lo + s * BK], ready.index(s), xls.index(s))
            _tma_load(x_desc, [pid_m * BM, k_lo + s * BK + BKH], ready.index(s), xhs.index(s))
    sb = _scales(s_ptr, N, stride_s, pid_n, k_lo, n > 0, S, BN, BKH)
    for i in range(n):
        _barrier()  # every warp is past step i-1 (its decode and its synchronous wgmma): slot (i-1) % NS is free
        j = i + NS - 1
        if j < n:
            st = j % NS
            mbarrier.expect(ready.index(st), STAGE_BYTES)
            _tma_load(w_desc, [pid_n * BN, (k_lo + j * BK) // 2], ready.index(st), wqs.index(st))
            _tma_load(x_desc, [pid_m * BM, k_lo + j * BK], ready.index(st), xls.index(st))
            _tma_load(x_desc, [pid_m * BM, k_lo + j * BK + BKH], ready.index(st), xhs.index(st))
        sb_next = _scales(s_ptr, N, stride_s, pid_n, k_lo + (i + 1) * BK, i + 1 < n, S, BN, BKH)
        sl = i % NS
        mbarrier.wait(ready.index(sl), (i // NS) & 1)
        lo, hi = _decode(wqs.index(sl), sb, c, A, P, L3, p, BN, BKH)
        acc = warpgroup_mma(lo, xls.index(sl).permute((1, 0)), acc)
        acc = warpgroup_mma(hi, xhs.index(sl).permute((1, 0)), acc)
        sb = sb_next
    for s in gl.static_range(NS):
        mbarrier.invalidate(ready.index(s))
    if RP > 0:
        mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        acc2 = _lora_tile(gl.convert_layout(acc, mma2), h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m,
                          pid_k == 0, BN, BM, RP, NW)
        _store_out(acc2, mma2, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
                   HAS_BIAS, NW)
    else:
        _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
                   HAS_BIAS, NW)


def nvfp4_linear_swap_tma(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                          bias: torch.Tensor | None, sms: int, config: tuple[int, int, int, int, int] = DEFAULT_CONFIG,
                          split: int | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                          waves: float = 2.0) -> torch.Tensor:
    """`gluon_nvfp4.nvfp4_linear_swap(..., wgmma=True, x_permuted=True)` with the TMA-fed kernel: same operands
    and result. config (BN, BM, BKH, KW, NS) (KW ignored); split: number of K splits (None: `split_for` at
    `waves` programs per SM)."""
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    bn, bm, bkh, _, ns = config
    if k % (2 * bkh) or (k // 2) % 16 or packed.data_ptr() % 16:
        raise ValueError(f"K={k}: needs K % {2 * bkh} == 0 and 16-byte aligned weight rows for TMA")
    tiles = k // (2 * bkh)
    if split is None:
        s, per = split_for(m, n, k, config, sms, waves)
    else:
        per = triton.cdiv(tiles, max(1, min(split, tiles)))
        s = triton.cdiv(tiles, per)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), s)
    out, ws, cnt = launch_buffers(x.device, m, n, s, grid[0] * grid[1])
    b = bias if bias is not None else out
    h, lb, stride_hm, r, rp = lora_operands(lora, m, n, out)
    xp = alloc((m, k), x.device, torch.bfloat16)
    permute_x_kernel[(triton.cdiv(m, bm), k // (2 * bkh))](x, xp, m, k, x.stride(0), BN=bn, BM=bm, BKH=bkh, NW=4,
                                                            num_warps=4, **pdl.launch_options(x))
    x_desc = TensorDescriptor.from_tensor(xp, [bm, bkh], gl.NVMMASharedLayout.get_default_for([bm, bkh], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(packed, [bn, bkh], gl.NVMMASharedLayout.get_default_for([bn, bkh], gl.uint8))
    LAST_COMPILED["tma"] = nvfp4_swap_wgmma_tma_kernel[grid](
        x_desc, w_desc, scale_u8, global_scale, b, out, m, n, k, scale_u8.stride(0), out.stride(0), ws, cnt, per, h, lb,
        stride_hm, r, BN=bn, BM=bm, BKH=bkh, NS=ns, PARTIAL=s > 1, HAS_BIAS=bias is not None, RP=rp, num_warps=4,
        **pdl.launch_options(xp))
    return out
