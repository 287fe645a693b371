"""MXFP4 weights with compressed-tensors `mxfp4-pack-quantized` semantics (scheme preset MXFP4A16).

Same E2M1 codes and packing as NVFP4 (`fp4.py`), but blocks of 32 inputs and one E8M0 power-of-two
scale per block, stored as its biased exponent (uint8, bias 127); no global scale:
    e     = clamp(exponent(round_pow2(block_amax)) - 2, 0, 252)     (2 = floor(log2(6)))
    scale = 2^(e - 127)
    W    ~= e2m1(W / scale) * scale
round_pow2 is compressed-tensors' `round_to_power_2` (= torchao's ScaleCalculationMode.EVEN): add 1 to
the second mantissa bit of the fp32 amax and truncate the mantissa, i.e. round the amax UP to the next
power of two when its mantissa is >= 1.75 (else amax/scale would be >= 7 and saturate at 6), DOWN
otherwise. Everything is computed in float32 on the fp32 upcast of W; the divisions are by powers of
two, so they are exact and the codes are bit-exact with compressed-tensors and torchao (see the tests
for the two corner cases where those references disagree with each other).
"""

import torch

from .errors import check_weight
from .fp4 import E2M1_MAX, decode_e2m1, pack_fp4, round_to_e2m1, unpack_fp4

BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2  # floor(log2(E2M1_MAX)): the block amax maps to [4, 8) before saturation at 6
_E_MAX = 252  # largest exponent whose 6 * 2^(e-127) is a finite fp32 (reached only for amax >= 1.75*2^127)
TENSOR_NAMES = ("weight_packed", "weight_scale")


def mx_block_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """fp32 block amax (any shape, >= 0, finite) -> biased E8M0 exponent, uint8 of the same shape.

    Integer arithmetic on the fp32 bit pattern, as compressed-tensors and torchao do; 0 and tiny amaxes
    give 0. The one deliberate difference: an amax so large that the rounding reaches the fp32 exponent
    field 255 (amax >= 1.75 * 2^127) gives 252, so that 6 * 2^(252-127) stays a finite fp32 (torchao
    writes 253, whose codes >= 4 decode to inf; compressed-tensors writes 127 and zeroes the block).
    """
    bits = block_amax.float().contiguous().view(torch.int32)
    rounded = (bits + (1 << 21)) & 0x7F800000  # +1 on mantissa bit 21, keep only the exponent field
    field = rounded >> 23
    return (field - _E2M1_EMAX).clamp(0, _E_MAX).to(torch.uint8)


def mx_scale_value(exponent: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 2^(e - 127), built from bits (exact; e = 0 is the subnormal 2^-127)."""
    e = exponent.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def quantize_mxfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize W [N, K] (any float dtype, K % 32 == 0) round-to-nearest-even.

    Returns {"weight_packed": uint8 [N, K/2], "weight_scale": uint8 [N, K/32] (biased exponents)}.
    global_scale must be None: MXFP4 has none (the argument exists for the common quantize signature).
    """
    if global_scale is not None:
        raise ValueError("mxfp4: the format has no global scale; pass global_scale=None")
    check_weight(w, BLOCK, "mxfp4")
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    exponent = mx_block_exponent(blocks.abs().amax(dim=-1))  # [N, K/32]
    scaled = (blocks / mx_scale_value(exponent).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1(scaled).reshape(n, k)
    return {"weight_packed": pack_fp4(codes), "weight_scale": exponent}


def dequantize_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [N, K/2], scale uint8 exponents [N, K/32] -> W [N, K] in dtype.

    code value x power of two is exact in float32 (and in bf16); the final cast is the only rounding.
    """
    codes = unpack_fp4(weight_packed)
    n, k = codes.shape
    w = decode_e2m1(codes).reshape(n, k // BLOCK, BLOCK) * mx_scale_value(weight_scale).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)
