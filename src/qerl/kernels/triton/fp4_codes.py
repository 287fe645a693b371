"""Triton device helpers: FP4 E2M1 codes and their block scales -> 16-bit weight tiles in registers.

Only imported when a Triton kernel is launched (see `fp4.py`), so CPU users without Triton can
import qerl.

E2M1 -> float without a lookup table. A code is s|e1 e0|m (sign bit 3, 2-bit exponent with bias 1, 1
mantissa bit). Placing the 3 magnitude bits at the top of a 16-bit float's exponent/mantissa boundary
keeps E2M1's structure intact, so every one of the 16 codes decodes exactly:
  - bf16 (8-bit exponent, bias 127): bits = s<<15 | mag3<<6  ->  value * 2^-126   (the issue's trick)
  - fp16 (5-bit exponent, bias 15):  bits = s<<15 | mag3<<9  ->  value * 2^-14
E2M1 exponent e >= 1 gives 2^(e-1)(1 + m/2); the 16-bit float with that exponent field gives
2^(e-bias)(1 + m/2), a ratio of 2^(1-bias). E2M1 e = 0 is m * 0.5, and the 16-bit float with exponent
field 0 is the subnormal m * 0.5 * 2^(1-bias): the same ratio. The table of all 16 codes is checked in
tests/test_kernels_triton.py.
We use the fp16 form: its smallest code, 0.5 * 2^-14 = 2^-15, is a NORMAL float32 after the exact
f16->f32 conversion, so the following fp32 multiply by the block scale never sees a float32 subnormal
(no dependence on flush-to-zero modes), and the folded factor 2^14 cannot overflow fp32 the way
2^126 * scale does for scales above 4.

The E4M3 block scale is decoded the same way: fp16 bits = s<<15 | (byte & 0x7F)<<7 is value * 2^-8
for all finite E4M3 values, subnormals included (E4M3 bias 7 vs fp16 bias 15).
"""

import triton
import triton.language as tl

# fp16 trick factors folded into the per-block step (see module docstring).
E2M1_F16_UNSCALE = 16384.0  # 2^14
E4M3_F16_UNSCALE = 256.0  # 2^8


@triton.jit
def e2m1_pair_to_f32(p):
    """packed uint8 tile -> (low-nibble values, high-nibble values), float32 = e2m1 value * 2^-14."""
    b = p.to(tl.int32)
    lo = ((b << 12) & 0x8000) | ((b << 9) & 0x0E00)
    hi = ((b << 8) & 0x8000) | ((b << 5) & 0x0E00)
    lo = lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e4m3_to_f32(s):
    """uint8 E4M3 bytes -> float32 value * 2^-8 (exact for every finite E4M3 value)."""
    b = s.to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_times_2p14(s):
    """uint8 biased exponents e -> float32 2^(e - 127) * 2^14 = 2^(e - 113), exact for e in [0, 254].

    Built as the product of two normal powers of two so neither factor leaves float32's normal range.
    """
    t = s.to(tl.int32) - 113
    h = t // 2
    a = ((h + 127) << 23).to(tl.float32, bitcast=True)
    b = ((t - h + 127) << 23).to(tl.float32, bitcast=True)
    return a * b


@triton.jit
def round_to(v, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """float32 -> DTYPE, round to nearest even. The CPU interpreter's bf16 cast truncates (Triton 3.9),
    so there (INTERP) bf16 rounding is done on the bits first; the cast after it is then exact."""
    if INTERP and DTYPE == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(DTYPE)


@triton.jit
def fp4_load(w_ptr, s_ptr, row0, col0, R, C, stride_w, stride_s,
             BR: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr, MASK_C: tl.constexpr):
    """Raw bytes of rows [row0, row0+BR) x columns [col0, col0+BC) of W [R, C]: (packed [BR, BC/2], scales
    [BR, BC/GROUP]), uint8. w_ptr: packed [R, C/2] (row stride stride_w), element 2i in the low nibble of
    byte i; s_ptr: scales [R, C/GROUP] (row stride stride_s). Out-of-range rows/columns read as 0
    (C and col0 are multiples of GROUP, BC of GROUP). MASK_C=False when the caller knows every column is in
    range: a mask along the contiguous dimension with a run-time bound stops Triton from issuing 16-byte
    vector loads (it cannot prove the bound keeps 16-byte runs whole)."""
    HALF: tl.constexpr = BC // 2
    NG: tl.constexpr = BC // GROUP
    rows = row0 + tl.arange(0, BR)
    pcols = col0 // 2 + tl.arange(0, HALF)
    rmask = rows < R
    gcols = col0 // GROUP + tl.arange(0, NG)
    if MASK_C:
        p = tl.load(w_ptr + rows[:, None] * stride_w + pcols[None, :],
                    mask=rmask[:, None] & (pcols[None, :] < C // 2), other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_s + gcols[None, :],
                    mask=rmask[:, None] & (gcols[None, :] < C // GROUP), other=0)
    else:
        p = tl.load(w_ptr + rows[:, None] * stride_w + pcols[None, :],
                    mask=tl.broadcast_to(rmask[:, None], (BR, HALF)), other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_s + gcols[None, :],
                    mask=tl.broadcast_to(rmask[:, None], (BR, NG)), other=0)
    return p, s


@triton.jit
def fp4_decode(p, s, step_mul, BR: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr,
               OUT_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """(packed [BR, BC/2], scales [BR, BC/GROUP]) from `fp4_load` -> W tile [BR, BC] in OUT_DTYPE.

    Scales are E4M3 bits (NVFP4, GROUP 16, MX False) or E8M0 exponents (MXFP4, GROUP 32, MX True).
    step_mul: float32 scalar, 2^22 / global_scale for NVFP4 (unused for MXFP4).
    W = code * step is rounded once, from float32, to OUT_DTYPE, as the plain-torch dequantize does.
    """
    NG: tl.constexpr = BC // GROUP
    if MX:
        step = e8m0_times_2p14(s)
    else:
        step = e4m3_to_f32(s) * step_mul
    lo, hi = e2m1_pair_to_f32(p)
    # interleave: element 2i (low nibble) then 2i+1; join puts the pair in one thread's registers, so the
    # reshapes are free (checked in the TTGIR: the only layout conversion is on the small scale tile)
    w = tl.reshape(tl.join(lo, hi), (BR, NG, GROUP))
    w = w * step[:, :, None]
    return round_to(tl.reshape(w, (BR, BC)), OUT_DTYPE, INTERP)


@triton.jit
def _e2m1x8_to_bf16_asm(q, step2):
    """Inline PTX, 4 packed bytes (8 codes) per call: (low-nibble, high-nibble) bf16 values times step.

    The issue's bf16 trick: bits = s<<15 | mag3<<6 is the code value * 2^-126 (a bf16 subnormal for the
    small codes), and step2 (bf16, = step * 2^126) scales it back with one packed bf16x2 multiply per two
    elements, so decoding and scaling take ~3 instructions per element instead of ~12 (fp32 path). The multiply
    is written as an fma with -0 added (exact, and the sign of a zero product kept): mul.bf16x2 needs sm_90,
    fma.bf16x2 sm_80; on sm_90 ptxas emits the same HMUL2.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, a, b, x, y, z, nz;
        mov.b32 z, 0;
        mov.b32 nz, 0x80008000;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        prmt.b32 a, lo, z, 0x4140;
        shl.b32 x, a, 6;
        shl.b32 y, a, 12;
        and.b32 y, y, 0x80008000;
        lop3.b32 a, x, 0x01C001C0, y, 0xEA;
        fma.rn.bf16x2 $0, a, $5, nz;
        prmt.b32 b, lo, z, 0x4342;
        shl.b32 x, b, 6;
        shl.b32 y, b, 12;
        and.b32 y, y, 0x80008000;
        lop3.b32 b, x, 0x01C001C0, y, 0xEA;
        fma.rn.bf16x2 $1, b, $6, nz;
        prmt.b32 a, hi, z, 0x4140;
        shl.b32 x, a, 6;
        shl.b32 y, a, 12;
        and.b32 y, y, 0x80008000;
        lop3.b32 a, x, 0x01C001C0, y, 0xEA;
        fma.rn.bf16x2 $2, a, $5, nz;
        prmt.b32 b, hi, z, 0x4342;
        shl.b32 x, b, 6;
        shl.b32 y, b, 12;
        and.b32 y, y, 0x80008000;
        lop3.b32 b, x, 0x01C001C0, y, 0xEA;
        fma.rn.bf16x2 $3, b, $6, nz;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[q, step2],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def fp4_decode_bf16_asm(p, s, step_mul_2p63, BR: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr):
    """NVFP4 only, bf16 out, GPU only: `fp4_decode` through `_e2m1x8_to_bf16_asm`.

    step_mul_2p63 = 2^71 / global_scale (the E4M3 decode's 2^8, and half of 2^126); the caller guarantees
    step * 2^126 stays finite in bf16 (global_scale > 448 * 2^126 / bf16 max, see fp4).
    The step is rounded to bf16 before the multiply: one extra rounding (<= 2^-9 relative) on W.
    """
    NG: tl.constexpr = BC // GROUP
    HG: tl.constexpr = GROUP // 2
    step = (e4m3_to_f32(s) * step_mul_2p63) * 9.223372036854775808e18  # * 2^63
    step3 = tl.broadcast_to(step.to(tl.bfloat16)[:, :, None], (BR, NG, HG))
    lo, hi = _e2m1x8_to_bf16_asm(tl.reshape(p, (BR, NG, HG)), step3)
    return tl.reshape(tl.join(lo, hi), (BR, BC))
