"""Gluon kernel: NVFP4 weight x bf16 activations at decode sizes, W as the A operand of mma.sync ("swap AB").

out[M, N] = x[M, K] @ W[N, K]^T is computed as out^T = W @ x^T, so the weight rows fill the MMA's 16-row
side and the few activation rows its 8-column side. What makes it fast on Hopper (no FP4 tensor cores):
  - the decoded bf16 weights never touch shared memory: raw packed bytes and scale bytes go global ->
    shared by cp.async (an NS-stage pipeline) and are read straight into the A-operand register layout
    (`DotOperandLayout(0, mma v2, k_width=KW)`, 16 consecutive bytes per thread = two scale groups), then
    decoded in registers -- plain `triton.language` cannot express that layout (its dot-operand hoisting
    stops at the scale multiply, so the decoded tile round-trips through shared memory);
  - even/odd split: byte j of a row holds k = 2j (low nibble) and 2j+1 (high nibble); the low nibbles form
    A_lo [BN, BKH], the high ones A_hi, and out^T += A_lo @ x_lo^T + A_hi @ x_hi^T;
  - decode by inline PTX, two nibbles 16 bits apart per step: t = q & 0x000F000F, (t * 0x1040) &
    0x81C081C0 = s<<15 | mag<<6 in each half (the E2M1 value * 2^-126 as bf16, see triton_fp4_decode),
    one mul.rn.bf16x2 by step * 2^126: ~2.1 instructions per weight, ~3.4-3.9 per weight for the whole
    loop at M <= 16 (SASS). The pairing permutes k inside each 4-byte group (SIGMA = [0, 2, 1, 3]); x is
    permuted the same way when split into x_lo / x_hi, so the product is unchanged;
  - the per-group scale is held once per register run: its layout is derived from the A layout and the
    broadcast to [BN, BKH] is checked to move no data (`convert_layout(..., assert_trivial=True)`);
  - a LoRA term h @ (scaling B)^T can ride along as one more MMA in the epilogue (`lora=`), which saves the
    rollout engine one addmm launch per linear;
  - split-K without a second launch: the program that arrives last at its output tile (an arrival counter
    per tile, reset by that program) sums the fp32 partials in a fixed order, so the result is
    deterministic; at decode sizes the reduce launch cost about as much as a small layer's matmul (H200:
    7B q/k/v and o 1.15-1.25x faster at M = 1-8 than with the reduce launch, in two runs).
Requirements (checked by `supported`): bf16 x, K % 128 == 0, scale rows 4-byte aligned, global_scale > 128
(step * 2^126 finite in bf16, as for the inline-PTX decode of the Triton kernels). One source for Triton
3.6 and newer (two API names differ, resolved below). Written with a helper session; GPU-tested only:
Gluon does not run under the Triton interpreter.
"""

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import pdl, triton_gate
from .triton_fp4_mm import _alloc

# API names that differ between Triton 3.6 and 3.9 (everything else used here is common to both)
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # 3.9: barrier, 3.6: thread_barrier
_async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
_commit = async_copy.commit_group
_wait = async_copy.wait_group


@gluon.constexpr_function
def _split_group_layout(al, BN, BKH):
    """A-operand linear layout over [BN, BKH] -> the same layout over [BN, BKH // 8, 8] (j = 8 g + i)."""
    al = gl._unwrap_if_constexpr(al) if hasattr(gl, "_unwrap_if_constexpr") else al

    def tr(b):
        return [b[0], b[1] // 8, b[1] % 8]

    return gl.DistributedLinearLayout(
        reg_bases=[tr(b) for b in al.reg_bases],
        lane_bases=[tr(b) for b in al.lane_bases],
        warp_bases=[tr(b) for b in al.warp_bases],
        block_bases=[tr(b) for b in al.block_bases],
        shape=[BN, BKH // 8, 8],
    )


@gluon.jit
def _decode_asm(q, stepb):
    """q: uint8 bytes (A layout), stepb: bf16 step*2^126 broadcast over each 8-byte group.
    Returns (lo, hi) bf16: lo[e] = value(low nibble of byte SIGMA(e)) * step, hi likewise (4-groups)."""
    return gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u, q8;
        shr.u32 q8, $4, 8;
        and.b32 t, $4, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $0, t, $5;
        and.b32 u, q8, 0x000F000F;
        mul.lo.u32 u, u, 0x1040;
        and.b32 u, u, 0x81C081C0;
        mul.rn.bf16x2 $1, u, $5;
        and.b32 t, $4, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $2, t, $5;
        and.b32 u, q8, 0x00F000F0;
        mul.lo.u32 u, u, 0x104;
        and.b32 u, u, 0x81C081C0;
        mul.rn.bf16x2 $3, u, $5;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[q, stepb],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _step_bf16(s, c):
    """uint8 E4M3 scale bytes -> bf16(e4m3 * c * 2^67); c = 2^67 / global_scale (so the result is step * 2^126).
    E4M3 -> fp16 bits s<<15 | (b & 0x7F)<<7 is value * 2^-8, exact for all finite E4M3 (subnormals too)."""
    b = s.to(gl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    f = h.to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
    return ((f * c) * 1.4757395258967641e20).to(gl.bfloat16)


@gluon.jit
def _load_x_split(x_ptr, M, stride_xm, pid_m, k0, BM: gl.constexpr, BKH: gl.constexpr, NW: gl.constexpr):
    """x[BM rows, k0 : k0 + 2 BKH] -> (x_lo, x_hi) [BM, BKH] registers in the k order of the decode (rows >= M
    read as zeros; K is a multiple of 2 BKH, so no column mask)."""
    BK: gl.constexpr = 2 * BKH
    TK: gl.constexpr = 32 if BK // 8 >= 32 else BK // 8
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [NW, 1], [1, 0])
    xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
    xk = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    xmask = gl.expand_dims(xm < M, 1) & gl.expand_dims(xk >= 0, 0)
    xt = gl.load(x_ptr + gl.expand_dims(xm * stride_xm, 1) + gl.expand_dims(xk, 0), mask=xmask, other=0.0)
    # real k = 8 g + 4 b1 + 2 b0 + h (byte j = 4 g + 2 b1 + b0); decoded element j' = 4 g + 2 b0 + b1
    x5 = gl.reshape(xt, [BM, BKH // 4, 2, 2, 2])
    x5 = gl.permute(x5, [0, 1, 3, 2, 4])  # [m, g, b0, b1, h]
    return gl.split(gl.reshape(x5, [BM, BKH, 2]))


@gluon.jit
def _stage_x(xl_s, xh_s, x_ptr, M, stride_xm, pid_m, k0, BM: gl.constexpr, BKH: gl.constexpr, NW: gl.constexpr):
    """x[BM rows, k0 : k0 + 2 BKH] -> x_lo [BM, BKH], x_hi shared tiles, in the k order of the decode."""
    xlo, xhi = _load_x_split(x_ptr, M, stride_xm, pid_m, k0, BM, BKH, NW)
    xl_s.store(xlo)
    xh_s.store(xhi)


@gluon.jit
def _issue_w(wq_s, ws_s, w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k0, valid,
             BN: gl.constexpr, BKH: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr):
    """cp.async of the raw bytes [BN, BKH] and scale bytes [BN, BKH/8] of columns [k0, k0 + 2 BKH) into one
    pipeline stage. Rows >= N are clamped to N - 1 (their outputs are never stored). valid (scalar) is False
    past the end of this program's K range (zero-fill, no memory access)."""
    G: gl.constexpr = BKH // 8
    TC: gl.constexpr = BKH // 16
    CP: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TC, TC], [NW, 1], [1, 0])
    SV: gl.constexpr = G if G <= SALIGN else SALIGN
    SP: gl.constexpr = gl.BlockedLayout([1, SV], [32, 1], [NW, 1], [1, 0])
    rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, CP)), N - 1)
    jj = gl.arange(0, BKH, layout=gl.SliceLayout(0, CP))
    wp = w_ptr + gl.expand_dims(rows * stride_w, 1) + gl.expand_dims(k0 // 2 + jj, 0)
    wm = gl.full([BN, BKH], 1, gl.int1, CP) & valid
    _async_load(wq_s, wp, mask=wm)
    srows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SP)), N - 1)
    gg = gl.arange(0, G, layout=gl.SliceLayout(0, SP))
    # SALIGN: a power of two dividing stride_s (the launcher's), so each row's scale run is SALIGN-aligned
    sp = s_ptr + gl.expand_dims(gl.multiple_of(srows * stride_s, SALIGN), 1) + gl.expand_dims(k0 // 16 + gg, 0)
    sm = gl.full([BN, G], 1, gl.int1, SP) & valid
    _async_load(ws_s, sp, mask=sm)


@gluon.jit
def _decode_stage(wq_s, ws_s, c, L: gl.constexpr, LL: gl.constexpr, BN: gl.constexpr, BKH: gl.constexpr):
    """Raw bytes and scale bytes of one pipeline stage, read from shared memory straight into layout L (LL: the
    same as a linear layout) and decoded there: (lo, hi) bf16 [BN, BKH] in L. The per-group scale is held
    once per register run; its broadcast to [BN, BKH] is checked to move no data."""
    G: gl.constexpr = BKH // 8
    L3: gl.constexpr = _split_group_layout(LL, BN, BKH)
    S: gl.constexpr = gl.SliceLayout(2, L3)
    q = wq_s.load(L)
    st = _step_bf16(ws_s.load(S), c)
    stb = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([BN, G, 8], 0, gl.bfloat16, L3))[0], [BN, BKH])
    return _decode_asm(q, gl.convert_layout(stb, L, assert_trivial=True))


@gluon.jit
def _mma_tile(acc, wq_s, ws_s, xl_s, xh_s, c, BN: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr,
              NW: gl.constexpr):
    """Bytes and scales from one pipeline stage (ld.shared straight into the A-operand layout), decode in
    registers, two mma.sync products against x_lo^T / x_hi^T."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    lo, hi = _decode_stage(wq_s, ws_s, c, A, gl.to_linear_layout(A, [BN, BKH]), BN, BKH)
    xlo = xl_s.permute((1, 0)).load(B)
    xhi = xh_s.permute((1, 0)).load(B)
    acc = mma_v2(lo, xlo, acc)
    acc = mma_v2(hi, xhi, acc)
    return acc


@gluon.jit
def _lora_tile(acc, h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m, on, BN: gl.constexpr, BM: gl.constexpr,
               RP: gl.constexpr, NW: gl.constexpr):
    """acc[BN, BM] += lb[rows, :R] @ h[cols, :R]^T, loaded from global memory straight into the MMA operand
    layouts (the LoRA B rows are the A operand, as the weights are); `on` False adds nothing (splits > 0)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, A))
    ra = gl.arange(0, RP, layout=gl.SliceLayout(0, A))
    amask = gl.expand_dims((rows < N) & on, 1) & gl.expand_dims(ra < R, 0)
    lb = gl.load(lb_ptr + gl.expand_dims(rows * R, 1) + gl.expand_dims(ra, 0), mask=amask, other=0.0)
    rb = gl.arange(0, RP, layout=gl.SliceLayout(1, B))
    cols = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, B))
    bmask = gl.expand_dims(rb < R, 1) & gl.expand_dims((cols < M) & on, 0)
    ht = gl.load(h_ptr + gl.expand_dims(rb, 1) + gl.expand_dims(cols * stride_hm, 0), mask=bmask, other=0.0)
    return mma_v2(lb, ht, acc)


@gluon.jit
def nvfp4_swap_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                      ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R,
                      BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr, NS: gl.constexpr,
                      PARTIAL: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr, HAS_BIAS: gl.constexpr,
                      RP: gl.constexpr, PDL: gl.constexpr = False):
    """Grid (cdiv(N, BN), cdiv(M, BM), S); K % (2 BKH) == 0; out bf16 [M, N] (row stride stride_om) = x @ W^T
    (+ bias [N] when HAS_BIAS). Program (., ., s) covers tiles [s T, min(K / BK, (s + 1) T)) of BK = 2 BKH
    columns, T = tiles_per_split; PARTIAL (S > 1): the splits meet in `_store_out` (fp32 workspace ws
    [S, M, N], arrival counters cnt [grid_n * grid_m] int32, zero on entry and left zero). NS-stage
    cp.async pipeline for the raw weight/scale bytes; x is staged through registers (split into lo/hi and
    permuted) into a double-buffered shared tile, one tile ahead.
    RP > 0: also add the LoRA term h[M, R] @ lb[N, R]^T (h row stride stride_hm, lb contiguous, both bf16;
    R <= RP, RP a power of two >= 16) as one more MMA in the epilogue of split 0.
    PDL: launched early (`pdl`); the first weight stages are in flight before the wait for x."""
    BK: gl.constexpr = 2 * BKH
    G: gl.constexpr = BKH // 8
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    XS: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    WS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    xls = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BKH], XS)  # x_lo, double buffered
    xhs = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BKH], XS)  # x_hi
    wqs = gl.allocate_shared_memory(gl.uint8, [NS, BN, BKH], WS)
    wss = gl.allocate_shared_memory(gl.uint8, [NS, BN, G], SS)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale (2^134 would overflow fp32)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)
    k_lo = t_lo * BK
    for s in gl.static_range(NS - 1):
        _issue_w(wqs.index(s), wss.index(s), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + s * BK, s < n,
                 BN, BKH, NW, SALIGN)
        _commit()
    if PDL:  # only static weight bytes were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    _stage_x(xls.index(0), xhs.index(0), x_ptr, M, stride_xm, pid_m, k_lo, BM, BKH, NW)
    for i in range(n):
        _wait(NS - 2)
        _barrier()  # stage i (all threads' copies) and x tile i visible; stage (i-1)%NS and x buffer (i+1)%2 free
        j = i + NS - 1
        _issue_w(wqs.index(j % NS), wss.index(j % NS), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + j * BK,
                 j < n, BN, BKH, NW, SALIGN)
        _commit()
        acc = _mma_tile(acc, wqs.index(i % NS), wss.index(i % NS), xls.index(i % 2), xhs.index(i % 2), c,
                        BN, BKH, KW, NW)
        if i + 1 < n:
            _stage_x(xls.index((i + 1) % 2), xhs.index((i + 1) % 2), x_ptr, M, stride_xm, pid_m,
                     k_lo + (i + 1) * BK, BM, BKH, NW)
    _wait(0)
    if RP > 0:
        acc = _lora_tile(acc, h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m, pid_k == 0, BN, BM, RP, NW)
    _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
               HAS_BIAS, NW)


@gluon.jit
def _store_out(acc, L: gl.constexpr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k,
               BN: gl.constexpr, BM: gl.constexpr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr):
    """acc [BN, BM] (layout L) = this program's out^T tile -> bf16 out [M, N] (+ bias), in one launch.

    PARTIAL (S = grid dim 2 > 1 splits): acc goes to the fp32 workspace ws [S, M, N]; then one thread takes a
    ticket from the tile's arrival counter. The program drawing the last ticket sums the S partials in the
    order s = 0 .. S-1 (the result does not depend on which program arrives last), adds the bias, rounds
    once, writes out and resets the counter for the next launch (stream order; CUDA-graph replays rely on
    it). Ordering: every thread's partial stores -> CTA barrier -> the acq_rel GPU-scope atomic (release:
    the whole CTA's stores, by cumulativity) -> [last program] ticket broadcast to its threads -> partial
    loads through L2 (.cg: no stale L1 line). Same protocol as `triton_lora_a`."""
    on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, L))
    omask = gl.expand_dims(on < N, 1) & gl.expand_dims(om < M, 0)
    if PARTIAL:
        S = gl.num_programs(2)
        gl.store(ws_ptr + pid_k * M * N + gl.expand_dims(on, 1) + gl.expand_dims(om * N, 0), acc, mask=omask)
        _barrier()
        cnt = cnt_ptr + pid_n * gl.num_programs(1) + pid_m
        ticket = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if ticket == S - 1:
            # the sum in a layout with 4 consecutive n per thread (16-byte loads, few address registers: the
            # MMA layout here would cost the whole kernel ~50 registers a thread)
            TN: gl.constexpr = 32 if BN >= 128 else BN // 4
            R: gl.constexpr = gl.BlockedLayout([4, 1], [TN, 32 // TN], [1, NW], [0, 1])
            rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, R))
            rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, R))
            rmask = gl.expand_dims(rn < N, 1) & gl.expand_dims(rm < M, 0)
            wofs = gl.expand_dims(rn, 1) + gl.expand_dims(rm * N, 0)  # (s, m, n) at s M N + m N + n
            # unrolled by CH: the CH loads of a round do not depend on the adds, so they are in flight
            # together (the tail is serial latency); the adds keep the order s = 0, 1, ... CH is capped at
            # ~32 registers a thread of loads: more raised the whole kernel's register count
            CH: gl.constexpr = max(1, min(8, 32 * 32 * NW // (BN * BM)))
            tot = gl.zeros([BN, BM], gl.float32, layout=R)
            for s0 in range(0, S, CH):
                for j in gl.static_range(CH):
                    tot += gl.load(ws_ptr + (s0 + j) * M * N + wofs, mask=rmask & (s0 + j < S), other=0.0,
                                   cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + gl.expand_dims(rn, 1) + gl.expand_dims(rm * stride_om, 0), tot.to(gl.bfloat16),
                     mask=rmask)
            gl.store(cnt, 0)
    else:
        if HAS_BIAS:
            acc += gl.expand_dims(gl.load(b_ptr + on, mask=on < N, other=0.0).to(gl.float32), 1)
        gl.store(out_ptr + gl.expand_dims(on, 1) + gl.expand_dims(om * stride_om, 0), acc.to(gl.bfloat16),
                 mask=omask)


_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, size) -> int32 zeros, kept for the process: CUDA graphs
# hold their addresses; launches of one size share them (each leaves them at 0; one stream at a time)


def _counters(device: torch.device, size: int) -> torch.Tensor:
    key = (device, size)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def launch_buffers(device: torch.device, m: int, n: int, splits: int, tiles_nm: int):
    """(out bf16 [m, n], split-K workspace fp32 [splits, m, n], arrival counters int32 [tiles_nm]) for a swap-AB
    launch; with one split the last two are `out` (unused placeholders)."""
    if splits * m * n >= 2**31:
        raise ValueError(f"split-K workspace of {splits} x {m} x {n} elements exceeds int32 indexing")
    out = _alloc((m, n), device, torch.bfloat16)
    if splits == 1:
        return out, out, out
    return out, _alloc((splits, m, n), device, torch.float32), _counters(device, tiles_nm)


def lora_operands(lora: tuple[torch.Tensor, torch.Tensor] | None, m: int, n: int, placeholder: torch.Tensor):
    """(h, lb, h row stride, R, RP) for the epilogue's LoRA term h [m, R] @ lb [n, R]^T (RP: R rounded up to a power
    of two >= 16, the MMA k step), or (placeholder, placeholder, 0, 0, 0) without one."""
    if lora is None:
        return placeholder, placeholder, 0, 0, 0
    h, lb = lora
    r = h.shape[1]
    if h.shape[0] != m or lb.shape != (n, r) or h.stride(1) != 1 or not lb.is_contiguous():
        raise ValueError(f"LoRA operands must be h [{m}, r] (unit column stride) and lb [{n}, r] contiguous")
    return h, lb, h.stride(0), r, max(16, triton.next_power_of_2(r))


X_PERMUTED: bool | None = None  # default of nvfp4_linear_swap's x_permuted; None: `triton_gate.permute_x_wins`

# (BN, BM, BKH, KW, NS): weight rows per program, activation rows (MMA n, >= 8), packed bytes per row per
# step (BK = 2 BKH columns), register run per thread, pipeline stages
SwapConfig = tuple[int, int, int, int, int]


def pick_config(m: int, n: int, k: int) -> tuple[SwapConfig, float]:
    """(tile, programs per SM) for an [m, k] x [n, k]^T product (k % 128 == 0). From the tile sweep of
    `qerl bench kernels --swap` on an H200 (docs/benchmarks.md): the tile that was fastest most often per
    row bucket over Qwen2.5-7B/32B/72B shapes; the split aims at ~2-3 programs per SM. Up to 8 rows 3 stages,
    not 4 (session 7, `benchmarks/experimental/sweep_small_m.py`: best or within 2% on the 7B shapes at M = 1
    and 8; in the 7B engine 2.82 -> 2.74 ms per step at batch 1, 3.05 -> 2.95 at batch 4, same at 8, in two
    alternating runs)."""
    if m <= 8:
        cfg, waves = (64, 8, 128, 16, 3), 3.0
    elif m <= 16:
        cfg, waves = (128, 16, 128, 16, 3), 3.0
    elif m <= 32:
        cfg, waves = (128, 32, 128, 16, 3), 2.0
    else:
        cfg, waves = (128, 64, 64, 16, 4), 3.0
    if k % (2 * cfg[2]):
        cfg = (*cfg[:2], 64, *cfg[3:])
    return cfg, waves


def pick_config_wgmma(m: int, n: int, k: int) -> tuple[SwapConfig, float]:
    """(tile, programs per SM) for the wgmma kernel (`gluon_nvfp4_wgmma`; routed for 9 <= m <= 64 on sm_90, 5-8
    rows for the largest weights and 65-128 / 65-256 rows, see `triton_gate.wgmma_wins`). From H200 sweeps
    (`benchmarks/experimental/wgmma_swap/sweep_tiles.py M`, docs/benchmarks.md) over BN x (BKH, NS) x programs per
    SM: one 64-row wgmma tile per warpgroup, 3 stages; BM (the wgmma N) the next of 8, 16, 32, 64; up to 16 rows 128
    packed bytes per step and ~4 programs per SM (best or within 4% on 6 of 7 Qwen2.5 shapes at M = 16), above that
    64 bytes and ~3. With x pre-permuted (`triton_gate.permute_x_wins`; sweep of session 6, docs/benchmarks.md): at
    17-32 rows 128 bytes per step for gate/up-like weights (N > 4 K: 1.05x on 7B, 1.16x on 32B gate_up), and at
    33-64 rows ~2 programs per SM (1.23x on 8192x8192, 1.24x on 72B down, 1.03x on 7B down, others within 1%)."""
    xp = triton_gate.permute_x_wins(n, k, m)
    if m > 64:  # 128 activation rows per tile, 2 stages (~3 programs per SM), x always pre-permuted (session 8,
        # `benchmarks/experimental/wgmma_swap/sweep_large_m.py`: best or within 2% at M = 128-256 on 7B gate_up
        # and down; BM 256 (one program per SM) 1.3x slower there)
        cfg, waves = (64, 128, 64, 16, 2), 2.0
    elif m <= 16:
        cfg, waves = (64, 8 if m <= 8 else 16, 128, 16, 3), 4.0
    elif m <= 32:
        cfg, waves = (64, 32, 128 if xp and n > 4 * k else 64, 16, 3), 3.0
    else:
        cfg, waves = (64, 64, 64, 16, 3), 2.0 if xp else 3.0
    if k % (2 * cfg[2]):
        cfg = (*cfg[:2], 64, *cfg[3:])
    return cfg, waves


def split_for(m: int, n: int, k: int, cfg: SwapConfig, sms: int, waves: float = 2.0) -> tuple[int, int]:
    """(number of K splits, K tiles per split): about `waves` programs per SM."""
    bn, bm, bkh = cfg[:3]
    tiles = k // (2 * bkh)
    grid_nm = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    s = max(1, min(tiles, math.ceil(waves * sms / grid_nm)))
    per = triton.cdiv(tiles, s)
    return triton.cdiv(tiles, per), per


def supported(x: torch.Tensor, packed: torch.Tensor, step_fits: bool) -> bool:
    """Whether this kernel takes x [M, K] @ W^T: bf16 CUDA x, K % 128 == 0, a global scale that keeps the
    bf16 step finite."""
    k = x.shape[-1]
    return x.is_cuda and x.dtype == torch.bfloat16 and k % 128 == 0 and packed.shape[1] * 2 == k and step_fits


def _scale_align(stride: int) -> int:
    a = 16
    while stride % a:
        a //= 2
    return a


def nvfp4_linear_swap(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                      bias: torch.Tensor | None, sms: int, config: SwapConfig | None = None,
                      split: int | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                      wgmma: bool = False, x_permuted: bool | None = None) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) -> x @ W^T + bias, [M, N] bf16. packed uint8 [N, K/2] contiguous,
    scale_u8 uint8 [N, K/16] (E4M3 bits) contiguous, global_scale fp32 [1], bias bf16 [N] or None.
    config: (BN, BM, BKH, KW, NS), None for `pick_config`'s; split: number of K splits (None: the pick's
    programs per SM, 2 with an explicit config). lora: (h [M, R] bf16 with unit column stride, lb [N, R]
    bf16 contiguous), adds h @ lb^T (a LoRA delta: h = x @ A^T, lb = scaling * B) in the same launch.
    wgmma: the Hopper-only wgmma variant (`gluon_nvfp4_wgmma`; sm_90, BN a multiple of 64) instead of mma.sync;
    x_permuted (wgmma only; None: `X_PERMUTED`, whose None asks `triton_gate.permute_x_wins`): x is first
    rewritten in the operand order by one small launch, then copied into the pipeline by cp.async instead
    of staged through registers every step."""
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    cfg, waves = (config, 2.0) if config is not None else (pick_config_wgmma if wgmma else pick_config)(m, n, k)
    bn, bm, bkh, kw, ns = cfg
    if k % (2 * bkh):
        raise ValueError(f"K={k} is not a multiple of the tile's {2 * bkh} columns")
    salign = _scale_align(scale_u8.stride(0))
    if salign < 4:
        raise ValueError(f"scale rows must be 4-byte aligned (K % 64 == 0), got row stride {scale_u8.stride(0)}")
    tiles = k // (2 * bkh)
    if split is None:
        s, per = split_for(m, n, k, cfg, sms, waves)
    else:
        per = triton.cdiv(tiles, max(1, min(split, tiles)))
        s = triton.cdiv(tiles, per)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), s)
    out, ws, cnt = launch_buffers(x.device, m, n, s, grid[0] * grid[1])
    b = bias if bias is not None else out
    h, lb, stride_hm, r, rp = lora_operands(lora, m, n, out)
    kernel, extra = nvfp4_swap_kernel, {}
    if wgmma:
        from .gluon_nvfp4_wgmma import nvfp4_swap_wgmma_kernel, permute_x_kernel

        xperm = X_PERMUTED if x_permuted is None else x_permuted
        if xperm is None:
            xperm = triton_gate.permute_x_wins(n, k, m)
        kernel, extra = nvfp4_swap_wgmma_kernel, {"XP": xperm}
        if xperm:
            xp = _alloc((m, k), x.device, torch.bfloat16)
            permute_x_kernel[(triton.cdiv(m, bm), k // (2 * bkh))](x, xp, m, k, x.stride(0), BN=bn, BM=bm, BKH=bkh,
                                                                    NW=4, num_warps=4, **pdl.launch_options(x))
            x = xp
    kernel[grid](x, packed, scale_u8, global_scale, b, out, m, n, k, x.stride(0), packed.stride(0),
                 scale_u8.stride(0), out.stride(0), ws, cnt, per, h, lb, stride_hm, r,
                 BN=bn, BM=bm, BKH=bkh, KW=kw, NS=ns, PARTIAL=s > 1, NW=4, SALIGN=salign,
                 HAS_BIAS=bias is not None, RP=rp, num_warps=4, **extra, **pdl.launch_options(x))
    return out
