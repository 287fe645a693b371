"""Gluon kernel: the sm_90 wgmma NVFP4 kernel (`gluon_nvfp4_wgmma`) with decode software-pipelined against the MMA.

EXPERIMENTAL (A/B candidate, not routed): `nvfp4_swap_wgmma_async_kernel` has the same arguments, grid and
semantics as `gluon_nvfp4_wgmma.nvfp4_swap_wgmma_kernel`, restricted to XP=True (x pre-permuted by
`permute_x_kernel` and copied by cp.async with the weight bytes of each pipeline stage). The synchronous kernel
decodes tile i and then runs its two wgmmas and waits, so inside one warpgroup the decode (ALU) and the MMA
(tensor cores) take turns. Here the order is

    decode tile 0 (before the loop)
    iteration i:  warpgroup_mma_wait(0): wgmma i-1 retired (nothing in flight at i = 0)
                  issue wgmma(lo_i, x_lo[i]^T), wgmma(hi_i, x_hi[i]^T)   (is_async)
                  wait for the cp.async group of tile i+1, fence, CTA barrier
                  cp.async tile i+NS-1 into slot (i-1) % NS
                  decode tile i+1 into fresh registers (lo_{i+1}, hi_{i+1})      <- overlaps the wgmmas
    last tile:    wait, then its two wgmmas, synchronous (peeled: no tile past the end is decoded)

Where the wait sits matters (checked offline: Triton 3.6 PTX -> ptxas 12.8 SASS for sm_90a). With the wait at
the END of iteration i (after the decode, `nvfp4_swap_wgmma_async_naive_kernel`), ptxas treats the wgmma's A
registers as free after the HGMMA issue, gives them to the decode's temporaries and outputs (coalescing the
loop-carried copies) and places the WARPGROUP.DEPBAR right before the first such write: only the cp.async issue,
the LDS and ~1/4 of the decode's integer ops overlap the MMA; every HMUL2 of the decode comes after the wait.
With the wait at the TOP of the next iteration (after the back edge), ptxas keeps the decode in other registers
and the whole decode of tile i+1 (all LDS, LOP3, IMAD, HMUL2) sits between the last HGMMA of tile i and the
loop's single WARPGROUP.DEPBAR; the cost is 32 register moves into the A operand after the wait. No variant
draws a "wgmma serialized" warning from ptxas.

Shared-memory stages (NS >= 3). While wgmma i runs it reads x slot i % NS (async proxy); the decode reads the
weight bytes of slot (i+1) % NS; the copy issued in that iteration needs a third slot. The farthest tile that
can be issued is i+NS-1 into slot (i-1) % NS: its last reader, wgmma i-1, was retired at the top of iteration i
by every warp, which the barrier of iteration i (before the issue) certifies; its weight bytes were read by the
decode in iteration i-2. So the slots i, i+1, i-1 must differ: with NS = 2 tile i+1 could only be copied after
wgmma i-1 retired, into the slot being decoded, and waited for at once (no prefetch). NS = 3 is the minimum and
gives the copy lookahead of the synchronous kernel at NS = 2 (tile i+1 issued one iteration before it is
decoded: cp.async wait_group 0 in the loop); NS = 4 one iteration more (wait_group 1).
Shared memory per stage at (BN, BM, BKH) = (64, 128, 64): x_lo + x_hi 32 KiB, weight bytes 4 KiB, scales 0.5 KiB:
NS = 3 uses 112,128 B (2 programs per SM fit in 228 KiB), NS = 4 149,504 B (1 program per SM).
Registers (ptxas, no LoRA, one split): 185 at NS = 3 (the synchronous kernel: 157), 198 with split-K, 219 / 243
with a LoRA term (RP = 32) without / with split-K; no spills. Two A-operand tiles are live at once.

`nvfp4_linear_swap_async` is a launcher mirroring the XP path of `gluon_nvfp4.nvfp4_linear_swap` (same split,
buffers, LoRA operands, permute launch) with this kernel; benchmarks/wgmma_async_ab.py compares the two.
GPU-tested only: Gluon does not run under the Triton interpreter.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import pdl
from .gluon_common import _barrier, _commit, _issue_w, _lora_tile, _store_out, _wait, launch_buffers, lora_operands
from .gluon_nvfp4 import _scale_align, split_for
from .gluon_nvfp4_wgmma import _decode_tile, _issue_xp, _pi_bits, permute_x_kernel
from .workspace import alloc

# (BN, BM, BKH, KW, NS) for more than 64 rows: the synchronous kernel's tile with one more stage
DEFAULT_CONFIG = (64, 128, 64, 16, 3)
# kernel name -> the CompiledKernel of its last launch by `nvfp4_linear_swap_async` (n_regs, n_spills, shared)
LAST_COMPILED: dict = {}


@gluon.jit
def _async_body(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R, BN: gl.constexpr, BM: gl.constexpr,
                BKH: gl.constexpr, NS: gl.constexpr, PARTIAL: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr,
                HAS_BIAS: gl.constexpr, RP: gl.constexpr, XP: gl.constexpr, PDL: gl.constexpr,
                WAIT_AT_TOP: gl.constexpr):
    """The kernels below. WAIT_AT_TOP: the wgmma wait of tile i sits at the top of the next iteration (after the
    loop's back edge), else at the end of iteration i (module docstring: ptxas then hoists it into the decode)."""
    gl.static_assert(XP, "the async form needs x pre-permuted (XP=True)")
    gl.static_assert(NS >= 3, "NS >= 3: x slot of the running wgmma, weight slot being decoded, slot being loaded")
    BK: gl.constexpr = 2 * BKH
    G: gl.constexpr = BKH // 8
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    al: gl.constexpr = gl.to_linear_layout(A, [BN, BKH])
    p: gl.constexpr = _pi_bits(al, BKH)
    XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BKH], gl.bfloat16)
    WS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8 if BKH >= 128 else BKH // 16,
                                               order=[1, 0])
    SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    xls = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], XS)  # x_lo (logical k), one per stage
    xhs = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKH], XS)  # x_hi
    wqs = gl.allocate_shared_memory(gl.uint8, [NS, BN, BKH], WS)
    wss = gl.allocate_shared_memory(gl.uint8, [NS, BN, G], SS)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)  # >= 1 for every program of the launcher's grid
    k_lo = t_lo * BK
    for s in gl.static_range(NS - 1):
        _issue_w(wqs.index(s), wss.index(s), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + s * BK, s < n,
                 BN, BKH, NW, SALIGN)
    if PDL:  # only static weight bytes were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    for s in gl.static_range(NS - 1):  # commit group s = x tile s (+ every weight stage for s == 0)
        _issue_xp(xls.index(s), xhs.index(s), x_ptr, M, stride_xm, pid_m, k_lo + s * BK, s < n, BM, BKH, NW)
        _commit()
    _wait(NS - 2)  # group 0: tile 0
    fence_async_shared()  # this thread's cp.async writes (generic proxy) -> wgmma reads (async proxy)
    _barrier()
    lo, hi = _decode_tile(wqs.index(0), wss.index(0), c, A, al, p, BN, BKH)
    lo_p = lo  # the A registers of the wgmma in flight (a dependency of its wait)
    hi_p = hi
    tok = warpgroup_mma_init(acc)
    for i in range(n - 1):
        # committed groups: tiles 0 .. i+NS-2; tile i is resident and visible, lo/hi hold its decode
        if WAIT_AT_TOP:  # retire wgmma i-1 (nothing is in flight at i = 0)
            acc, lo_p, hi_p = warpgroup_mma_wait(0, deps=(tok, lo_p, hi_p))
        xb = i % NS
        tok = warpgroup_mma(lo, xls.index(xb).permute((1, 0)), acc, is_async=True)
        tok = warpgroup_mma(hi, xhs.index(xb).permute((1, 0)), tok, is_async=True)
        # -- while the two wgmmas of tile i run --
        _wait(NS - 3)  # tile i+1 complete (this thread's copies)
        fence_async_shared()
        _barrier()  # tile i+1 visible to all; every warp retired wgmma i-1, so slot (i-1) % NS is free
        j = i + NS - 1
        _issue_w(wqs.index(j % NS), wss.index(j % NS), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + j * BK,
                 j < n, BN, BKH, NW, SALIGN)
        _issue_xp(xls.index(j % NS), xhs.index(j % NS), x_ptr, M, stride_xm, pid_m, k_lo + j * BK, j < n, BM, BKH,
                  NW)
        _commit()
        lo_n, hi_n = _decode_tile(wqs.index((i + 1) % NS), wss.index((i + 1) % NS), c, A, al, p, BN, BKH)
        if WAIT_AT_TOP:
            lo_p = lo
            hi_p = hi
        else:  # wgmma i retired here: ptxas places this wait before the first write to a register it reuses
            acc, lo, hi = warpgroup_mma_wait(0, deps=(tok, lo, hi))
            tok = warpgroup_mma_init(acc)
        lo = lo_n
        hi = hi_n
    acc, lo_p, hi_p = warpgroup_mma_wait(0, deps=(tok, lo_p, hi_p))
    xb = (n - 1) % NS  # the last tile (already decoded): synchronous
    acc = warpgroup_mma(lo, xls.index(xb).permute((1, 0)), acc)
    acc = warpgroup_mma(hi, xhs.index(xb).permute((1, 0)), acc)
    _wait(0)
    if RP > 0:
        mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        acc2 = _lora_tile(gl.convert_layout(acc, mma2), h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m,
                          pid_k == 0, BN, BM, RP, NW)
        _store_out(acc2, mma2, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
                   HAS_BIAS, NW)
    else:
        _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
                   HAS_BIAS, NW)


@gluon.jit
def nvfp4_swap_wgmma_async_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s,
                                  stride_om, ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R,
                                  BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr,
                                  NS: gl.constexpr, PARTIAL: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr,
                                  HAS_BIAS: gl.constexpr, RP: gl.constexpr, XP: gl.constexpr,
                                  PDL: gl.constexpr = False):
    """`nvfp4_swap_wgmma_kernel` (same grid, arguments, semantics; KW ignored) with XP=True only and NS >= 3:
    the decode of tile i+1 overlaps the asynchronous wgmmas of tile i, whose wait is at the top of the next
    iteration (module docstring)."""
    _async_body(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R, BN, BM, BKH, NS, PARTIAL, NW, SALIGN,
                HAS_BIAS, RP, XP, PDL, True)


@gluon.jit
def nvfp4_swap_wgmma_async_naive_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w,
                                        stride_s, stride_om, ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr,
                                        stride_hm, R, BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr,
                                        KW: gl.constexpr, NS: gl.constexpr, PARTIAL: gl.constexpr, NW: gl.constexpr,
                                        SALIGN: gl.constexpr, HAS_BIAS: gl.constexpr, RP: gl.constexpr,
                                        XP: gl.constexpr, PDL: gl.constexpr = False):
    """The same with the wgmma wait at the end of the iteration that issued it (for A/B runs: ptxas hoists it
    above most of the decode, module docstring)."""
    _async_body(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R, BN, BM, BKH, NS, PARTIAL, NW, SALIGN,
                HAS_BIAS, RP, XP, PDL, False)


def nvfp4_linear_swap_async(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor,
                            global_scale: torch.Tensor, bias: torch.Tensor | None, sms: int,
                            config: tuple[int, int, int, int, int] = DEFAULT_CONFIG, split: int | None = None,
                            lora: tuple[torch.Tensor, torch.Tensor] | None = None, waves: float = 2.0,
                            kernel=None) -> torch.Tensor:
    """`gluon_nvfp4.nvfp4_linear_swap(..., wgmma=True, x_permuted=True)` with the async kernel: same operands
    and result. config (BN, BM, BKH, KW, NS), NS >= 3; split: number of K splits (None: `split_for` at
    `waves` programs per SM). kernel: the kernel to launch (default the async one; the synchronous
    `nvfp4_swap_wgmma_kernel` takes the same arguments, for A/B runs at equal grids)."""
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    bn, bm, bkh, kw, ns = config
    if k % (2 * bkh):
        raise ValueError(f"K={k} is not a multiple of the tile's {2 * bkh} columns")
    salign = _scale_align(scale_u8.stride(0))
    if salign < 4:
        raise ValueError(f"scale rows must be 4-byte aligned (K % 64 == 0), got row stride {scale_u8.stride(0)}")
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
    kern = nvfp4_swap_wgmma_async_kernel if kernel is None else kernel
    LAST_COMPILED[kern.__name__] = kern[grid](
        xp, packed, scale_u8, global_scale, b, out, m, n, k, xp.stride(0), packed.stride(0), scale_u8.stride(0),
        out.stride(0), ws, cnt, per, h, lb, stride_hm, r, BN=bn, BM=bm, BKH=bkh, KW=kw, NS=ns, PARTIAL=s > 1, NW=4,
        SALIGN=salign, HAS_BIAS=bias is not None, RP=rp, XP=True, num_warps=4, **pdl.launch_options(xp))
    return out


__all__ = ["DEFAULT_CONFIG", "nvfp4_linear_swap_async", "nvfp4_swap_wgmma_async_kernel",
           "nvfp4_swap_wgmma_async_naive_kernel"]
