"""Gluon kernel: NVFP4 weight x bf16 activations, "swap AB" on Hopper wgmma with the A operand in registers.

The sm_90 form of the NVFP4 decode kernel, for the rows `route.wgmma_rows` gives it (`nvfp4.nvfp4_linear_swap`
launches it with wgmma=True). Drop-in variant of `nvfp4_swap_kernel` (same arguments, grid and semantics, the
LoRA epilogue included):
out^T[N, M] = W @ x^T with the decoded weight tile [BN, BKH] (BN = 64 or 128 rows per warpgroup) as the
register A operand of `warpgroup_mma` (wgmma.m64nBMk16) and x_lo^T / x_hi^T [BKH, BM] as the B operand from
an NVMMA-swizzled shared tile. Everything else is as in the mma.sync kernel: raw bytes/scale bytes by cp.async
(NS stages), even/odd nibble split with the SIGMA permutation, inline-PTX decode (2 nibbles per step),
per-group scale broadcast checked trivial.

Register layout. The wgmma A fragment (DotOperandLayout(0, NVMMA v3, k_width=2)) gives each thread, per row,
k pairs {2t, 2t+1} + 8 b + 16 c (t = lane % 4): only 2 consecutive k. To read 16 consecutive bytes per thread
from the raw stage (one ld.shared.v4) a bit-permutation PI of the byte index is used as the *logical* k: the
byte tile is loaded in layout P (= the A layout with k -> PI(k), its k registers first), decoded there, and
then relabelled by reshape/permute (no data movement) to the logical order of the A layout. The x tile is
permuted the same way before it is stored, so the product is unchanged (the sum over k is order-free).
PI maps the A layout's register k-bits (1, 8, 16, 32) -> byte bits (0, 1, 2, 3), its lane k-bits (2, 4) -> 4,
5 and a further register k-bit (64, BKH = 128) -> 6.

The wgmma is synchronous; several programs per SM (3 fit at 157 registers) overlap one program's decode with
another's MMA. An asynchronous form whose decode of tile i+1 runs under the MMA of tile i (the wait moved to the
top of the next step: otherwise ptxas hands the A registers to the decode and waits first) is slower at 64-256
rows: 185 registers and a third stage leave 2 programs per SM (commit b018af3, docs/benchmarks.md).
x reaches shared memory one of two ways: staged through registers every step (`_stage_x`: global load,
lo/hi split, PI permutation, store), or, XP=True, rewritten once per call by `permute_x_kernel` into that
order and copied by cp.async together with the weight bytes of each pipeline stage (`_issue_xp`; no global
loads into registers; `route.permute_x_rule` says when).
LoRA (RP > 0): the accumulator is moved to the mma.sync layout and the routed kernel's `_lora_tile` adds
h @ lb^T there (one layout conversion through shared memory in the epilogue). GPU-tested only.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# shared with the mma.sync kernel: API shims, decode, scale step, the cp.async stage
from .common import (_async_load, _barrier, _commit, _decode_stage, _issue_w, _load_x_split, _lora_tile,
                          _store_out, _wait)


@gluon.constexpr_function
def _pi_bits(al, BKH):
    """PI as a list: logical k bit b -> byte-index bit p[b], from the linear layout of the wgmma A operand
    over [BN, BKH]: A's register k-bits (in register order) -> byte bits 0..3, its lane k-bits -> 4, 5,
    further register k-bits -> 6, ..."""
    al = gl._unwrap_if_constexpr(al) if hasattr(gl, "_unwrap_if_constexpr") else al
    nb = BKH.bit_length() - 1
    regk = [b[1] for b in al.reg_bases if b[0] == 0 and b[1] != 0]
    lanek = [b[1] for b in al.lane_bases if b[0] == 0 and b[1] != 0]
    assert len(regk) >= 4 and len(lanek) == 2, (al.reg_bases, al.lane_bases)
    order = regk[:4] + lanek + regk[4:]
    assert sorted(order) == [1 << i for i in range(nb)], order
    return [order.index(1 << b) for b in range(nb)]


@gluon.constexpr_function
def _phys_layout(al, p, BN, BKH):
    """Layout P of the raw byte tile [BN, BKH] (byte index j = PI(k)): A's bases with k -> PI(k), the
    k register bases first (so registers 0..15 are 16 consecutive bytes)."""
    al = gl._unwrap_if_constexpr(al) if hasattr(gl, "_unwrap_if_constexpr") else al
    p = p.value if type(p).__name__ == "constexpr" else p  # 3.6 passes the list wrapped
    p = [v.value if type(v).__name__ == "constexpr" else v for v in p]

    def tr(b):
        return [b[0], sum(1 << p[i] for i in range(len(p)) if b[1] >> i & 1)]

    kr = [tr(b) for b in al.reg_bases if b[0] == 0 and b[1] != 0]
    kr.sort(key=lambda b: b[1])
    other = [tr(b) for b in al.reg_bases if not (b[0] == 0 and b[1] != 0)]
    return gl.DistributedLinearLayout(
        reg_bases=kr + other,
        lane_bases=[tr(b) for b in al.lane_bases],
        warp_bases=[tr(b) for b in al.warp_bases],
        block_bases=[tr(b) for b in al.block_bases],
        shape=[BN, BKH],
    )


@gluon.constexpr_function
def _perm_order(p):
    """permute order taking [R, 2, ..., 2] (byte-index bits, MSB first) to logical-k bits (MSB first)."""
    p = p.value if type(p).__name__ == "constexpr" else p  # 3.6 passes the list wrapped
    p = [v.value if type(v).__name__ == "constexpr" else v for v in p]
    nb = len(p)
    return [0] + [nb - p[nb - d] for d in range(1, nb + 1)]


@gluon.constexpr_function
def _bits_shape(R, BKH):
    return [R] + [2] * (BKH.bit_length() - 1)


@gluon.jit
def _to_logical(t, p: gl.constexpr, R: gl.constexpr, BKH: gl.constexpr):
    """[R, BKH] tensor indexed by byte j -> the same data indexed by logical k (j = PI(k)); a relabelling."""
    o: gl.constexpr = _perm_order(p)
    t = gl.reshape(t, _bits_shape(R, BKH))
    # explicit tuples: Triton 3.6's permute does not unwrap a constexpr list
    if BKH == 64:
        t = gl.permute(t, (o[0], o[1], o[2], o[3], o[4], o[5], o[6]))
    else:
        gl.static_assert(BKH == 128, "BKH must be 64 or 128")
        t = gl.permute(t, (o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]))
    return gl.reshape(t, [R, BKH])


@gluon.jit
def _x_logical(x_ptr, M, stride_xm, pid_m, k0, p: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr,
               NW: gl.constexpr):
    """x[BM rows, k0 : k0 + 2 BKH] -> (x_lo, x_hi) [BM, BKH] registers, in the logical k order of the A operand
    (rows >= M read as zeros)."""
    xlo, xhi = _load_x_split(x_ptr, M, stride_xm, pid_m, k0, BM, BKH, NW)
    return _to_logical(xlo, p, BM, BKH), _to_logical(xhi, p, BM, BKH)


@gluon.jit
def _stage_x(xl_s, xh_s, x_ptr, M, stride_xm, pid_m, k0, p: gl.constexpr,
             BM: gl.constexpr, BKH: gl.constexpr, NW: gl.constexpr):
    """x[BM rows, k0 : k0 + 2 BKH] -> x_lo [BM, BKH], x_hi shared tiles, in the logical k order of the A operand."""
    xlo, xhi = _x_logical(x_ptr, M, stride_xm, pid_m, k0, p, BM, BKH, NW)
    xl_s.store(xlo)
    xh_s.store(xhi)
    fence_async_shared()  # generic-proxy stores -> wgmma (async proxy) reads, after the next barrier


@gluon.jit
def _issue_xp(xl_s, xh_s, xp_ptr, M, stride_xm, pid_m, k0, valid, BM: gl.constexpr, BKH: gl.constexpr,
              NW: gl.constexpr):
    """cp.async of a pre-permuted x tile (`permute_x_kernel`'s xp: x_lo then x_hi per block of 2 BKH columns)
    into one pipeline stage. Rows >= M and valid (scalar) False: zero-fill, no memory access."""
    TK: gl.constexpr = BKH // 8
    CP: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [NW, 1], [1, 0])
    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, CP))
    cols = gl.arange(0, BKH, layout=gl.SliceLayout(0, CP))
    ptr = xp_ptr + gl.expand_dims(rows * stride_xm, 1) + gl.expand_dims(k0 + cols, 0)
    m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols >= 0, 0) & valid
    _async_load(xl_s, ptr, mask=m)
    _async_load(xh_s, ptr + BKH, mask=m)


@gluon.jit
def permute_x_kernel(x_ptr, xp_ptr, M, K, stride_xm, BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr,
                     NW: gl.constexpr, PDL: gl.constexpr = False):
    """xp [M, K] bf16 contiguous: per block of BK = 2 BKH columns, x_lo then x_hi in the logical k order of
    the wgmma A operand of `nvfp4_swap_wgmma_kernel` with the same BN, BM, BKH (what `_stage_x` would store
    in shared memory), so that kernel can copy x tiles as they are (XP=True). Grid (cdiv(M, BM), K / BK)."""
    BK: gl.constexpr = 2 * BKH
    if PDL:  # launched early (`pdl`): x is the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    p: gl.constexpr = _pi_bits(gl.to_linear_layout(A, [BN, BKH]), BKH)
    xlo, xhi = _x_logical(x_ptr, M, stride_xm, pid_m, pid_k * BK, p, BM, BKH, NW)
    TO: gl.constexpr = BKH // 8
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TO, TO], [NW, 1], [1, 0])
    xlo = gl.convert_layout(xlo, OL)
    xhi = gl.convert_layout(xhi, OL)
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, OL))
    ok = gl.arange(0, BKH, layout=gl.SliceLayout(0, OL))
    omask = gl.expand_dims(om < M, 1) & gl.expand_dims(ok >= 0, 0)
    optr = xp_ptr + gl.expand_dims(om * K, 1) + gl.expand_dims(pid_k * BK + ok, 0)
    gl.store(optr, xlo, mask=omask)
    gl.store(optr + BKH, xhi, mask=omask)


@gluon.jit
def _decode_tile(wq_s, ws_s, c, A: gl.constexpr, al: gl.constexpr, p: gl.constexpr, BN: gl.constexpr,
                 BKH: gl.constexpr):
    """Bytes + scales of one stage -> (lo, hi) bf16 [BN, BKH] in the wgmma A-operand layout (logical k)."""
    P: gl.constexpr = _phys_layout(al, p, BN, BKH)
    lo, hi = _decode_stage(wq_s, ws_s, c, P, P, BN, BKH)
    lo = gl.convert_layout(_to_logical(lo, p, BN, BKH), A)
    hi = gl.convert_layout(_to_logical(hi, p, BN, BKH), A)
    return lo, hi


@gluon.jit
def nvfp4_swap_wgmma_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s,
                            stride_om, ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R,
                            BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr,
                            NS: gl.constexpr, PARTIAL: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr,
                            HAS_BIAS: gl.constexpr, RP: gl.constexpr, XP: gl.constexpr, PDL: gl.constexpr = False):
    """Same grid, arguments and semantics as `nvfp4.nvfp4_swap_kernel` (KW is ignored: the wgmma A
    layout fixes the register run at 16 bytes). Needs NW == 4 (one warpgroup), BN % 64 == 0, BM in 8..256
    (multiple of 8), BKH in {64, 128}. XP: x_ptr is `permute_x_kernel`'s xp (row stride stride_xm) and its
    tiles ride the NS-stage cp.async pipeline with the weights; else x is staged through registers.
    The first NS - 1 weight stages are issued before x: with PDL (`pdl`) they are in flight before the wait
    for the previous kernel. With XP they join the first x copy's commit group (the groups complete in
    order, so stage s is complete once group s is)."""
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
    XB: gl.constexpr = NS if XP else 2  # x buffers: one per pipeline stage, or double buffered
    xls = gl.allocate_shared_memory(gl.bfloat16, [XB, BM, BKH], XS)  # x_lo (logical k)
    xhs = gl.allocate_shared_memory(gl.bfloat16, [XB, BM, BKH], XS)  # x_hi
    wqs = gl.allocate_shared_memory(gl.uint8, [NS, BN, BKH], WS)
    wss = gl.allocate_shared_memory(gl.uint8, [NS, BN, G], SS)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)
    k_lo = t_lo * BK
    for s in gl.static_range(NS - 1):
        _issue_w(wqs.index(s), wss.index(s), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + s * BK, s < n,
                 BN, BKH, NW, SALIGN)
        if not XP:
            _commit()
    if PDL:  # only static weight bytes were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    if XP:
        for s in gl.static_range(NS - 1):
            _issue_xp(xls.index(s), xhs.index(s), x_ptr, M, stride_xm, pid_m, k_lo + s * BK, s < n, BM, BKH, NW)
            _commit()
    else:
        _stage_x(xls.index(0), xhs.index(0), x_ptr, M, stride_xm, pid_m, k_lo, p, BM, BKH, NW)
    for i in range(n):
        _wait(NS - 2)
        if XP:
            fence_async_shared()  # this thread's cp.async writes (generic proxy) -> wgmma reads (async proxy)
        _barrier()  # stage i and x tile i visible; stage (i-1)%NS free; x buffer (i+1)%2 free (wgmma i-1 waited)
        j = i + NS - 1
        _issue_w(wqs.index(j % NS), wss.index(j % NS), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + j * BK,
                 j < n, BN, BKH, NW, SALIGN)
        if XP:
            _issue_xp(xls.index(j % NS), xhs.index(j % NS), x_ptr, M, stride_xm, pid_m, k_lo + j * BK, j < n, BM, BKH,
                      NW)
        _commit()
        lo, hi = _decode_tile(wqs.index(i % NS), wss.index(i % NS), c, A, al, p, BN, BKH)
        if XP:
            xb = i % NS
        else:
            xb = i % 2
        acc = warpgroup_mma(lo, xls.index(xb).permute((1, 0)), acc)
        acc = warpgroup_mma(hi, xhs.index(xb).permute((1, 0)), acc)
        if not XP and i + 1 < n:
            _stage_x(xls.index((i + 1) % 2), xhs.index((i + 1) % 2), x_ptr, M, stride_xm, pid_m,
                     k_lo + (i + 1) * BK, p, BM, BKH, NW)
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
