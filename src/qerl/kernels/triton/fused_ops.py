"""Triton kernels for the small per-layer ops of a decode step.

  add_rms_norm      residual add + RMSNorm
  add_rms_norm_lora_a  the same, plus the LoRA "A" product of the linears the norm feeds (decode rows)
  rope_             rotate-half RoPE on one tensor, in place
  silu_mul          silu(gate) * up of the MLP (gate, up: column slices of one fused output)
  silu_mul_lora_a   the same, plus the LoRA "A" product of the down projection it feeds (decode rows)
  rope_store_decode RoPE on one decode token's q and k, plus the k/v cache writes at a device-side slot

At decode sizes a step is mostly launches: HF's RMSNorm is ~7 kernels (cast, square, mean, add, rsqrt,
multiply, weight multiply), the residual add one more, rotate-half RoPE ~5 per tensor, silu and the
multiply 2, the cache writes 2. These kernels do each group in one launch with the SAME roundings as the
eager torch code they replace (every bf16/fp16 intermediate that torch materialises is rounded here too),
so results differ only by the order of the fp32 sum inside the norm's mean. Outputs are allocated through
`fp4_mm._alloc`, so tests can fill them with NaN first. This module imports Triton: import it
lazily (see `fused_ops`).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import pdl
from ..workspace import alloc
from .fp4_codes import round_to


@triton.jit
def _rounded(v, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """float32 v rounded (nearest even) to DTYPE, returned as float32. On the GPU through inline PTX: the
    compiler folds a plain `v.to(bf16).to(fp32)` away (measured: it then fuses multiply and add into one
    FMA), which would skip the rounding torch does between the two."""
    if INTERP or DTYPE == tl.float32:
        return round_to(v, DTYPE, INTERP).to(tl.float32)
    if DTYPE == tl.bfloat16:
        asm: tl.constexpr = "{ .reg .b16 t, z; mov.b16 z, 0; cvt.rn.bf16.f32 t, $1; mov.b32 $0, {z, t}; }"
    else:
        asm: tl.constexpr = "{ .reg .b16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }"
    return tl.inline_asm_elementwise(asm, "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, res_ptr, out_ptr, D, stride_h, stride_d, stride_r, stride_o, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """One row: s = h + d (rounded, stored to res) and out = w * round(s * rsqrt(mean(s^2) + eps))."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    _norm_row(h_ptr, d_ptr, w_ptr, res_ptr, out_ptr, row, offs, mask, mask, D, stride_h, stride_d, stride_r,
              stride_o, eps, HAS_DELTA, INTERP)


@triton.jit
def _norm_row(h_ptr, d_ptr, w_ptr, res_ptr, out_ptr, row, offs, mask, store_mask, D, stride_h, stride_d, stride_r,
              stride_o, eps, HAS_DELTA: tl.constexpr, INTERP: tl.constexpr):
    """One row's s = h + d (rounded, stored to res) and out = w * round(s * rsqrt(mean(s^2) + eps)) (stored), both
    where store_mask holds; returns out in the output dtype."""
    dtype = out_ptr.dtype.element_ty
    x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x, dtype, INTERP)
        tl.store(res_ptr + row * stride_r + offs, x.to(dtype), mask=store_mask)
    var = tl.sum(x * x, axis=0) / D
    y = _rounded(x * tl.math.rsqrt(var + eps), dtype, INTERP)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = round_to(w * y, dtype, INTERP)
    tl.store(out_ptr + row * stride_o + offs, out, mask=store_mask)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """h, delta [..., D] (same dtype), weight [D] -> (h + delta, rms_norm(h + delta) * weight), both [..., D].

    delta None: (h, rms_norm(h) * weight). Rows are normalised independently; the output dtype is h's.
    """
    D = h.shape[-1]
    h2 = h.reshape(-1, D)
    rows = h2.shape[0]
    out = alloc(h2.shape, h2.device, h2.dtype)
    res = alloc(h2.shape, h2.device, h2.dtype) if delta is not None else h2
    d2 = delta.reshape(-1, D) if delta is not None else h2
    if h2.stride(-1) != 1 or d2.stride(-1) != 1:
        raise ValueError("add_rms_norm needs a unit stride along the normalised dimension")
    _add_rms_norm_kernel[(rows,)](
        h2, d2, weight, res, out, D, h2.stride(0), d2.stride(0), res.stride(0), out.stride(0), float(eps),
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(D), INTERP=h.device.type != "cuda",
        num_warps=4 if D <= 4096 else 8, **pdl.launch_options(h2))
    return res.view(h.shape), out.view(h.shape)


@triton.jit
def _add_rms_norm_lora_a_kernel(h_ptr, d_ptr, w_ptr, a_ptr, res_ptr, out_ptr, xa_ptr, D, R, stride_h, stride_d,
                                stride_r, stride_o, stride_a, stride_xa, eps, HAS_DELTA: tl.constexpr,
                                BLOCK: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr,
                                PDL: tl.constexpr = False):
    """Program (row, r block): the row's residual sum and norm as `_add_rms_norm_kernel` (stored by r block 0
    only), then xa[row, r] = sum_d out[d] * a[r, d] for the block's BR rows of a (fp32, one rounding)."""
    row = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    rr = pid_r * BR + tl.arange(0, BR)
    rmask = rr < R
    # a is static for a decode step: with PDL its load is issued before the wait for the previous kernel
    a = tl.load(a_ptr + rr[:, None] * stride_a + offs[None, :], mask=rmask[:, None] & mask[None, :], other=0.0)
    if PDL:  # launched early (`pdl`): every load of h / d and every store waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    keep = offs < tl.where(pid_r == 0, D, 0)  # the sum and the norm are stored by r block 0 only
    out = _norm_row(h_ptr, d_ptr, w_ptr, res_ptr, out_ptr, row, offs, mask, keep, D, stride_h, stride_d, stride_r,
                    stride_o, eps, HAS_DELTA, INTERP)
    xa = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)  # the product of the stored values
    tl.store(xa_ptr + row * stride_xa + rr, round_to(xa, out_ptr.dtype.element_ty, INTERP), mask=rmask)


NORM_LORA_A_ELEMS = 8192  # a-tile elements per program: BR rows of a x the padded D, in registers


def add_rms_norm_lora_a(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        a: torch.Tensor):
    """`add_rms_norm`, plus xa = out @ a^T [..., R] in h's dtype (fp32 accumulation of the rounded `out`, one
    rounding), in one launch: h, delta [..., D]; weight [D]; a [R, D] contiguous, of h's dtype (the stacked
    LoRA A of the linears the norm feeds). Each (row, block of rows of a) program recomputes the row's norm,
    so it is meant for decode steps (few rows), where it saves the separate LoRA A launch."""
    D = h.shape[-1]
    h2 = h.reshape(-1, D)
    rows, R = h2.shape[0], a.shape[0]
    if a.shape[1] != D or a.dtype != h.dtype or not a.is_contiguous() or h2.stride(-1) != 1:
        raise ValueError(f"add_rms_norm_lora_a: a [R, {D}] contiguous of h's dtype and unit-stride rows needed, "
                         f"got a {tuple(a.shape)} {a.dtype}")
    out = alloc(h2.shape, h2.device, h2.dtype)
    res = alloc(h2.shape, h2.device, h2.dtype) if delta is not None else h2
    d2 = delta.reshape(-1, D) if delta is not None else h2
    if d2.stride(-1) != 1:
        raise ValueError("add_rms_norm_lora_a needs a unit stride along the normalised dimension")
    xa = alloc((rows, R), h2.device, h2.dtype)
    block = triton.next_power_of_2(D)
    br = max(1, min(triton.next_power_of_2(R), NORM_LORA_A_ELEMS // block))
    _add_rms_norm_lora_a_kernel[(rows, triton.cdiv(R, br))](
        h2, d2, weight, a, res, out, xa, D, R, h2.stride(0), d2.stride(0), res.stride(0), out.stride(0),
        a.stride(0), xa.stride(0), float(eps), HAS_DELTA=delta is not None, BLOCK=block, BR=br,
        INTERP=h.device.type != "cuda", num_warps=4 if block <= 2048 else 8, **pdl.launch_options(h2))
    return res.view(h.shape), out.view(h.shape), xa


@triton.jit
def _load_cos_sin(cos_ptr, sin_ptr, j, jmask, HALF: tl.constexpr):
    """The two halves of one position's cos and sin rows (offsets j < HALF), as float32."""
    c1 = tl.load(cos_ptr + j, mask=jmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + j, mask=jmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_halves(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Float32 halves of x (values of DTYPE) -> the halves of x*cos + rotate_half(x)*sin, in DTYPE."""
    # rotate_half(x) = cat(-x2, x1); torch rounds x*cos, rot*sin and their sum, each to x's dtype
    lo = round_to(_rounded(x1 * c1, DTYPE, INTERP) + _rounded(-x2 * s1, DTYPE, INTERP), DTYPE, INTERP)
    hi = round_to(_rounded(x2 * c2, DTYPE, INTERP) + _rounded(x1 * s2, DTYPE, INTERP), DTYPE, INTERP)
    return lo, hi


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, L, H, stride_xb, stride_xl, stride_xh, stride_cb, stride_cl,
                 HALF: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """In place, one (batch, position) per program, all heads: x = round(x*cos) + round(rot(x)*sin), rounded."""
    pid = tl.program_id(0)
    b = pid // L
    pos = pid % L
    dtype = x_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    jmask = j < HALF
    hmask = (heads < H) & jmask
    base = x_ptr + b * stride_xb + pos * stride_xl + heads * stride_xh
    x1 = tl.load(base + j, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=hmask, other=0.0).to(tl.float32)
    cbase = b * stride_cb + pos * stride_cl
    c1, c2, s1, s2 = _load_cos_sin(cos_ptr + cbase, sin_ptr + cbase, j, jmask, HALF)
    lo, hi = _rope_halves(x1, x2, c1, c2, s1, s2, dtype, INTERP)
    tl.store(base + j, lo, mask=hmask)
    tl.store(base + HALF + j, hi, mask=hmask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [B, L, heads, hd] (unit stride on hd); cos, sin [B, L, hd] in x's dtype. Returns x."""
    B, L, H, hd = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride() or hd % 2:
        raise ValueError("rope_ needs unit-stride head dims, an even head dim and cos/sin of one layout")
    _rope_kernel[(B * L,)](x, cos, sin, L, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
                           HALF=hd // 2, BLOCK_J=triton.next_power_of_2(hd // 2), BLOCK_H=triton.next_power_of_2(H),
                           INTERP=x.device.type != "cuda",
                           num_warps=4)
    return x


@triton.jit
def _exp_as_cuda(x, INTERP: tl.constexpr):
    """float32 exp as torch's CUDA kernels get it (`::exp` -> libdevice __nv_expf), not tl.exp (ex2.approx of
    x * log2(e), a few ulp off). The interpreter has no libdevice: there exp in float64 rounded to float32,
    which gives torch's CPU silu for every bf16 and fp16 input (numpy's float32 exp misses 3 fp16 values)."""
    if INTERP:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    return libdevice.exp(x)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block): out = round(round(g / (1 + exp(-g))) * u) on BLOCK columns of one row."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # prefill rows * row stride can pass 2^31
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in fp32 with an IEEE division (Triton's `/` is div.full, approximate),
    # rounded to the activation dtype; then the multiply, whose fp32 product of two 16-bit values is exact
    s = _rounded(tl.math.div_rn(g, 1.0 + _exp_as_cuda(-g, INTERP)), dtype, INTERP)
    tl.store(out_ptr + row * stride_o + offs, round_to(s * u, dtype, INTERP), mask=mask)


SILU_BLOCK = 1024
SILU_LORA_CHUNK = 128  # columns per step of the LoRA A product inside a SwiGLU program (an [R, 128] tile of A)
# columns per program of the SwiGLU launch that also makes the LoRA A product: A's [R, I] is read by the row's
# programs, so at 1-8 rows the launch needs more of them than the plain SwiGLU's I / SILU_BLOCK (19 a row at 7B)
SILU_LORA_BLOCK = 256


@triton.jit
def _silu_mul_lora_a_kernel(g_ptr, u_ptr, out_ptr, a_ptr, h_ptr, ha_ptr, cnt_ptr, I, R, stride_g, stride_u,
                            stride_o, s_ar, s_hb, BLOCK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                            NP: tl.constexpr, NC: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """`_silu_mul_kernel`'s program (row, block), CHUNK columns at a time, plus the block's share of
    out[row] @ A^T (A [R, I], the down projection's stacked LoRA A) on the stored values; the last of the row's
    programs to finish sums the shares (`sum_partials_last`) and writes h[row, :R] (the counter protocol of `lora_a`:
    stores, CTA barrier, one acq_rel atomic at GPU scope, .cg loads; the counter set back to 0)."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    r = tl.arange(0, BLOCK_R)
    p = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, BLOCK, CHUNK):
        offs = blk * BLOCK + c0 + tl.arange(0, CHUNK)
        mask = offs < I
        g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        s = _rounded(tl.math.div_rn(g, 1.0 + _exp_as_cuda(-g, INTERP)), dtype, INTERP)
        o = _rounded(s * u, dtype, INTERP)  # the stored value, in fp32
        tl.store(out_ptr + row * stride_o + offs, o.to(dtype), mask=mask)
        a = tl.load(a_ptr + r[:, None] * s_ar + offs[None, :], mask=(r < R)[:, None] & mask[None, :], other=0.0)
        p += tl.sum(a.to(tl.float32) * o[None, :], 1)
    nb = tl.num_programs(1)
    sum_partials_last(ha_ptr + row * nb * BLOCK_R, blk, nb, p, cnt_ptr + row, h_ptr + row * s_hb, R, BLOCK_R, NP, NC,
                      INTERP)


@triton.jit
def sum_partials_last(part_ptr, i, n, p, cnt, out_ptr, R, BLOCK_R: tl.constexpr, NP: tl.constexpr,
                      NC: tl.constexpr, INTERP: tl.constexpr):
    """One of n programs sharing an output row: store its fp32 partial p [BLOCK_R] as part i of part_ptr [n,
    BLOCK_R]; the last of the n to arrive at the counter cnt sums the n parts, writes out_ptr[:R] rounded once and
    sets cnt back to 0. The parts are loaded NC at a time as [NC, BLOCK_R] tiles (NP >= n, both powers of two from
    `partial_tiles`), not one by one, so the sum adds a few loads to the launch's tail, not n dependent ones; the
    order is fixed by (n, NP, NC): the same sum on every call. The counter protocol of `lora_a`: every thread's
    stores, a CTA barrier, one acq_rel atomic at GPU scope, .cg loads of the parts."""
    r = tl.arange(0, BLOCK_R)
    tl.store(part_ptr + i * BLOCK_R + r, p)
    tl.debug_barrier()  # every thread's partial stores happen before the (single-thread) release below
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n - 1:
        total = tl.zeros([BLOCK_R], tl.float32)
        for k0 in tl.static_range(0, NP, NC):
            k = k0 + tl.arange(0, NC)
            parts = tl.load(part_ptr + k[:, None] * BLOCK_R + r[None, :], mask=(k < n)[:, None], other=0.0,
                            cache_modifier=".cg")
            total += tl.sum(parts, 0)
        tl.store(out_ptr + r, round_to(total, out_ptr.dtype.element_ty, INTERP), mask=r < R)
        tl.store(cnt, 0)


PARTIAL_TILE_ELEMS = 2048  # fp32 elements of one [NC, BLOCK_R] load of `sum_partials_last` (16 a thread at 4 warps)


def partial_tiles(n: int, block_r: int) -> tuple[int, int]:
    """(NP, NC) for `sum_partials_last` over n parts of block_r elements: NP the power of two >= n, NC parts a load."""
    np_ = triton.next_power_of_2(max(1, n))
    return np_, max(1, min(np_, PARTIAL_TILE_ELEMS // block_r))


def _silu_lora_a_key(gate: torch.Tensor, a: torch.Tensor) -> tuple:
    I = gate.shape[-1]
    return (gate.numel() // I, triton.cdiv(I, SILU_LORA_BLOCK), max(16, triton.next_power_of_2(a.shape[0])))


def silu_lora_a_ready(gate: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether a `silu_mul_lora_a` call of this shape allocates nothing persistent (inside a CUDA-graph capture)."""
    from .. import workspace

    return workspace.has_persistent("silu_mul_lora_a", gate.device, _silu_lora_a_key(gate, a))


def silu_mul_lora_a(gate: torch.Tensor, up: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up [..., I] bf16/fp16 (unit stride along I), a [R, I] contiguous of their dtype -> (silu(gate) * up
    [..., I], bit-identical to `silu_mul`'s, and h = that @ a^T [M, R], M = the leading dims' product), in one
    launch; M at most `fused_ops.NORM_LORA_A_MAX_ROWS` (one arrival counter a row)."""
    from .. import workspace

    I = gate.shape[-1]
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)
    M, R = g2.shape[0], a.shape[0]
    out = alloc(gate.shape, gate.device, gate.dtype)
    h = alloc((M, R), gate.device, gate.dtype)
    _, nb, block_r = key = _silu_lora_a_key(gate, a)
    ha, cnt = workspace.persistent("silu_mul_lora_a", gate.device, key, lambda: (
        alloc((M, nb, block_r), gate.device, torch.float32), torch.zeros(M, dtype=torch.int32, device=gate.device)))
    interp = gate.device.type != "cuda"
    o2 = out.view(-1, I)
    n_parts, parts_a_load = partial_tiles(nb, block_r)
    _silu_mul_lora_a_kernel[(M, nb)](
        g2, u2, o2, a, h, ha, cnt, I, R, g2.stride(0), u2.stride(0), o2.stride(0), a.stride(0), h.stride(0),
        BLOCK=SILU_LORA_BLOCK, CHUNK=SILU_LORA_CHUNK, BLOCK_R=block_r, NP=n_parts, NC=parts_a_load, INTERP=interp,
        num_warps=4,
        **({} if interp else {"enable_reflect_ftz": False}), **pdl.launch_options(o2))
    return out, h


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] bf16/fp16, unit stride along I (rows may be strided) -> silu(gate) * up, a new
    contiguous [..., I] tensor of their dtype, bit-identical to torch's `F.silu(gate) * up`."""
    I = gate.shape[-1]
    if up.shape != gate.shape or up.dtype != gate.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul needs gate and up of one shape and dtype, with unit stride on the last dim")
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)  # views for column slices of one [..., 2I] output
    out = alloc(gate.shape, gate.device, gate.dtype)
    o2 = out.view(-1, I)
    if o2.numel():
        interp = gate.device.type != "cuda"
        _silu_mul_kernel[(o2.shape[0], triton.cdiv(I, SILU_BLOCK))](
            g2, u2, o2, I, g2.stride(0), u2.stride(0), o2.stride(0), BLOCK=SILU_BLOCK, INTERP=interp,
            num_warps=4, **({} if interp else {"enable_reflect_ftz": False}), **pdl.launch_options(o2))
    return out


@triton.jit
def _rope_head(src, dst, j, jmask, c1, c2, s1, s2, HALF: tl.constexpr, INTERP: tl.constexpr):
    """One head: the hd contiguous elements at src, rotated, to dst."""
    x1 = tl.load(src + j, mask=jmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    lo, hi = _rope_halves(x1, x2, c1, c2, s1, s2, dst.dtype.element_ty, INTERP)
    tl.store(dst + j, lo, mask=jmask)
    tl.store(dst + HALF + j, hi, mask=jmask)


@triton.jit
def _copy_head(src, dst, j, jmask, HALF: tl.constexpr):
    """One head: the hd contiguous elements at src, copied to dst."""
    tl.store(dst + j, tl.load(src + j, mask=jmask), mask=jmask)
    tl.store(dst + HALF + j, tl.load(src + HALF + j, mask=jmask), mask=jmask)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, stride_slot, H, max_len,
                       stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb,
                       stride_ob, stride_oh, stride_cacheb, stride_cacheh, stride_caches,
                       HALF: tl.constexpr, BLOCK_J: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, head): head < H rotates query head `head` of row b into qo; head = H + kv rotates key
    head kv into k cache slot slot_ptr[b * stride_slot] and copies value head kv into the v cache at the same
    slot (stride_slot 0: one slot for every row)."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK_J)
    jmask = j < HALF
    c1, c2, s1, s2 = _load_cos_sin(cos_ptr + b * stride_cb, sin_ptr + b * stride_cb, j, jmask, HALF)
    if head < H:
        _rope_head(q_ptr + b * stride_qb + head * stride_qh, qo_ptr + b * stride_ob + head * stride_oh,
                   j, jmask, c1, c2, s1, s2, HALF, INTERP)
    else:
        kv = head - H
        # read on the device, so that a captured CUDA graph writes wherever the replay's slot says
        slot = tl.load(slot_ptr + b * stride_slot)
        if (slot >= 0) & (slot < max_len):  # out of range: write nothing (a graph replay cannot raise)
            cache = b.to(tl.int64) * stride_cacheb + kv * stride_cacheh + slot * stride_caches
            _rope_head(k_ptr + b * stride_kb + kv * stride_kh, kc_ptr + cache, j, jmask, c1, c2, s1, s2, HALF, INTERP)
            _copy_head(v_ptr + b * stride_vb + kv * stride_vh, vc_ptr + cache, j, jmask, HALF)


def rope_store_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """One decode token, one launch. q [B, 1, H, hd], k, v [B, 1, KV, hd] (unit stride on hd, any other
    strides); cos, sin [B, 1, hd] (unit stride on hd, one layout); k_cache, v_cache [B, KV, max_len, hd]
    (unit stride on hd, one layout); slot: 0-d (or 1-element) int64 tensor on the device, or int64 [B] (a
    slot per row), read by the kernel. All floating tensors of one dtype (bf16/fp16).

    Returns rope(q) as a new contiguous [B, 1, H, hd] tensor; writes rope(k) into k_cache[:, :, slot] and v
    into v_cache[:, :, slot], other slots untouched. Rounding as `fused_ops.rope_reference`. A slot outside
    [0, max_len) writes nothing (index_copy_ would raise; a graph replay cannot).
    """
    B, L, H, hd = q.shape
    KV, max_len = k_cache.shape[1], k_cache.shape[2]
    if L != 1 or k.shape != (B, 1, KV, hd) or v.shape != k.shape or cos.shape != (B, 1, hd) or sin.shape != cos.shape \
            or k_cache.shape != (B, KV, max_len, hd) or v_cache.shape != k_cache.shape or hd % 2 \
            or slot.numel() not in (1, B):
        raise ValueError(f"rope_store_decode: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"cos {tuple(cos.shape)} caches {tuple(k_cache.shape)} {tuple(v_cache.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, k_cache)) or sin.stride() != cos.stride() \
            or v_cache.stride() != k_cache.stride():
        raise ValueError("rope_store_decode needs unit stride on hd, cos/sin of one layout, caches of one layout")
    if len({t.dtype for t in (q, k, v, cos, sin, k_cache, v_cache)}) != 1 or slot.dtype != torch.int64:
        raise ValueError("rope_store_decode needs q, k, v, cos, sin and the caches of one dtype, an int64 slot")
    out = alloc((B, 1, H, hd), q.device, q.dtype)
    _rope_store_kernel[(B, H + KV)](
        q, k, v, cos, sin, out, k_cache, v_cache, slot, 0 if slot.numel() == 1 else slot.stride(0), H, max_len,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), cos.stride(0),
        out.stride(0), out.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HALF=hd // 2, BLOCK_J=triton.next_power_of_2(hd // 2), INTERP=q.device.type != "cuda", num_warps=1,
        **pdl.launch_options(q))
    return out
