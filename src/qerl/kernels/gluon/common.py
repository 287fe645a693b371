"""What the Gluon kernels share (`nvfp4`, its wgmma form `nvfp4_wgmma`, `bf16`).

API names that differ between Triton releases, the NVFP4 decode in registers (`_decode_stage`: inline-PTX nibble
decode, per-group scale step), the cp.async weight stage (`_issue_w`), the x tile split into the decode's k
order (`_load_x_split`), the LoRA epilogue (`_lora_tile`), the split-K store that the last program to arrive
finishes (`_store_out`), and the launch buffers. See `nvfp4` for the kernel they serve. GPU-tested only:
Gluon does not run under the Triton interpreter.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..workspace import alloc, counters

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


def _decode_ptx(scale_23: str) -> str:
    """The inline PTX of the nibble decode: input word $4 (four bytes), scale registers $5 (and scale_23 for
    outputs $1 and $3), outputs $0..$3 (bf16x2: lo nibbles of bytes 0/2, 1/3, then hi nibbles of bytes 0/2, 1/3).
    A nibble v lands at bits 6-8 (E2M1 exponent and mantissa into the bf16 exponent's low bits and mantissa) and
    15 (sign) of its half; the multiply by step * 2^126 rescales it. The multiply is an fma adding -0 (exact, the
    sign of a zero product kept): mul.bf16x2 needs sm_90, fma.bf16x2 sm_80; on sm_90 ptxas emits HMUL2 for both."""
    return f"""
        {{
        .reg .b32 t, u, q8, nz;
        mov.b32 nz, 0x80008000;
        shr.u32 q8, $4, 8;
        and.b32 t, $4, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $0, t, $5, nz;
        and.b32 u, q8, 0x000F000F;
        mul.lo.u32 u, u, 0x1040;
        and.b32 u, u, 0x81C081C0;
        fma.rn.bf16x2 $1, u, {scale_23}, nz;
        and.b32 t, $4, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $2, t, $5, nz;
        and.b32 u, q8, 0x00F000F0;
        mul.lo.u32 u, u, 0x104;
        and.b32 u, u, 0x81C081C0;
        fma.rn.bf16x2 $3, u, {scale_23}, nz;
        }}
        """


DECODE_PTX = gl.constexpr(_decode_ptx("$5"))  # one scale pair for the whole word (`_decode_asm`)
DECODE_PTX_PAIRS = gl.constexpr(_decode_ptx("$6"))  # a scale pair per output register (the input-gradient kernel)
# `_decode_asm`'s step operand registers: bf16 elements (two per 32-bit register) or `_step_pairs`' int32 words.
# Passed explicitly at every call: Triton 3.6 hands a jit function's plain-str default to it unwrapped.
STEP_BF16 = gl.constexpr("r,r")
STEP_WORDS = gl.constexpr("r,r,r,r")


@gluon.jit
def _decode_asm(q, stepb, PTX: gl.constexpr, STEP_REGS: gl.constexpr):
    """q: uint8 bytes (A layout), stepb: bf16 step*2^126 broadcast over each 8-byte group.
    Returns (lo, hi) bf16: lo[e] = value(low nibble of byte SIGMA(e)) * step, hi likewise (4-groups).
    PTX DECODE_PTX_PAIRS: stepb's elements 0, 1 scale outputs $0, $2 and elements 2, 3 outputs $1, $3 instead.
    STEP_REGS: STEP_BF16 for a bf16 stepb; STEP_WORDS for an int32 stepb (`_step_pairs`' (step, step) words,
    one per byte), so that $5 is byte 0's word."""
    return gl.inline_asm_elementwise(
        asm=PTX,
        constraints="=r,=r,=r,=r,r," + STEP_REGS,
        args=[q, stepb],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


STEP_PAIR_PTX = gl.constexpr("""
        {
        .reg .b32 f;
        .reg .b16 a, b;
        .reg .f32 fa, fb;
        cvt.rn.f16x2.e4m3x2 f, $2;
        mov.b32 {a, b}, f;
        cvt.f32.f16 fa, a;
        cvt.f32.f16 fb, b;
        mul.rn.f32 fa, fa, $3;
        mul.rn.f32 fb, fb, $3;
        cvt.rn.bf16x2.f32 $0, fa, fa;
        cvt.rn.bf16x2.f32 $1, fb, fb;
        }
        """)


@gluon.jit
def _step_pairs(s, c126):
    """uint8 E4M3 scale bytes -> int32 bit patterns of the bf16x2 (step, step), step * 2^126 = bf16(e4m3 * c126),
    c126 = 2^126 / global_scale: the operand `_decode_asm` (STEP_REGS STEP_WORDS) multiplies both halves of a
    decoded pair by.
    sm_89+ (one cvt converts two E4M3 bytes, exact: every finite E4M3 value is an fp16); two scales per call,
    ~3.5 instructions per scale against ~10 for `_step_bf16` + packing the pair. The same value as `_step_bf16`:
    e4m3 * c126 is rounded once in fp32, as (e4m3 * 2^-8 * c) * 2^67 is (scaling by 2^59 commutes with rounding
    in fp32's normal range), then once to bf16."""
    return gl.inline_asm_elementwise(
        asm=STEP_PAIR_PTX,
        constraints="=r,=r,h,r,r",
        args=[s, gl.full(s.shape, 0, gl.float32, s.type.layout) + c126],
        dtype=gl.int32,
        is_pure=True,
        pack=2,
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
def _decode_stage(wq_s, ws_s, c, L: gl.constexpr, LL: gl.constexpr, BN: gl.constexpr, BKH: gl.constexpr,
                  E4M3_CVT: gl.constexpr = True):
    """Raw bytes and scale bytes of one pipeline stage, read from shared memory straight into layout L (LL: the
    same as a linear layout) and decoded there: (lo, hi) bf16 [BN, BKH] in L. c = 2^67 / global_scale. The
    per-group scale is held once per register run; its broadcast to [BN, BKH] is checked to move no data.
    E4M3_CVT (sm_89+): the scales convert two at a time straight into the (step, step) words the decode
    multiplies by (`_step_pairs`); else one at a time by bit operations (`_step_bf16`)."""
    G: gl.constexpr = BKH // 8
    L3: gl.constexpr = _split_group_layout(LL, BN, BKH)
    S: gl.constexpr = gl.SliceLayout(2, L3)
    q = wq_s.load(L)
    if E4M3_CVT:
        st = _step_pairs(ws_s.load(S), c * 5.764607523034235e17)  # * 2^59: 2^126 / global_scale
        stw = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([BN, G, 8], 0, gl.int32, L3))[0], [BN, BKH])
        return _decode_asm(q, gl.convert_layout(stw, L, assert_trivial=True), DECODE_PTX, STEP_WORDS)
    st = _step_bf16(ws_s.load(S), c)
    stb = gl.reshape(gl.broadcast(gl.expand_dims(st, 2), gl.full([BN, G, 8], 0, gl.bfloat16, L3))[0], [BN, BKH])
    return _decode_asm(q, gl.convert_layout(stb, L, assert_trivial=True), DECODE_PTX, STEP_BF16)


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
def _store_out(acc, L: gl.constexpr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k,
               BN: gl.constexpr, BM: gl.constexpr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr):
    """acc [BN, BM] (layout L) = this program's out^T tile -> bf16 out [M, N] (+ bias), in one launch.

    PARTIAL (S = grid dim 2 > 1 splits): acc goes to the fp32 workspace ws [S, M, N]; then one thread takes a
    ticket from the tile's arrival counter. The program drawing the last ticket sums the S partials in the
    order s = 0 .. S-1 (the result does not depend on which program arrives last), adds the bias, rounds
    once, writes out and resets the counter for the next launch (stream order; CUDA-graph replays rely on
    it). Ordering: every thread's partial stores -> CTA barrier -> the acq_rel GPU-scope atomic (release:
    the whole CTA's stores, by cumulativity) -> [last program] ticket broadcast to its threads -> partial
    loads through L2 (.cg: no stale L1 line). Same protocol as `triton.lora_a`."""
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


def launch_buffers(device: torch.device, m: int, n: int, splits: int, tiles_nm: int):
    """(out bf16 [m, n], split-K workspace fp32 [splits, m, n], arrival counters int32 [tiles_nm]) for a swap-AB
    launch; with one split the last two are `out` (unused placeholders)."""
    if splits * m * n >= 2**31:
        raise ValueError(f"split-K workspace of {splits} x {m} x {n} elements exceeds int32 indexing")
    out = alloc((m, n), device, torch.bfloat16)
    if splits == 1:
        return out, out, out
    return out, alloc((splits, m, n), device, torch.float32), counters("gluon", device, tiles_nm)


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
