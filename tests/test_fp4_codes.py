"""FP4 E2M1 codes (formats/fp4.py): decode table, packing, round-to-nearest-even, saturation, -0."""

import pytest
import torch

from qerl.formats.fp4 import decode_e2m1, e2m1_values, pack_fp4, round_to_e2m1, unpack_fp4

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# tie -> the neighbour with the even mantissa bit (the even code)
TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def test_all_16_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values.tolist() == MAGS + [-m for m in MAGS]
    assert torch.signbit(values[8]) and values[8] == 0  # code 8 is -0
    # every value maps back to its own code, except -0.0 -> 0 (compressed-tensors: sign only for x < 0)
    assert torch.equal(round_to_e2m1(values), torch.where(codes == 8, 0, codes).to(torch.uint8))
    # every ordered pair of codes through pack/unpack, element 2i in the LOW nibble
    pairs = torch.cartesian_prod(codes, codes).reshape(1, -1)  # [1, 512]: (a0, b0, a1, b1, ...)
    packed = pack_fp4(pairs)
    assert packed.shape == (1, 256)
    assert torch.equal(packed & 0x0F, pairs[:, 0::2]) and torch.equal(packed >> 4, pairs[:, 1::2])
    assert torch.equal(unpack_fp4(packed), pairs)
    assert torch.equal(e2m1_values(), decode_e2m1(codes))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_round_to_even(sign):
    x = torch.tensor([sign * t for t in TIES], dtype=torch.float32)
    got = decode_e2m1(round_to_e2m1(x))
    assert got.tolist() == [sign * v for v in TIES.values()]
    # one ulp either side of each tie goes to the nearer neighbour
    lo, hi = torch.nextafter(x.abs(), torch.zeros_like(x)), torch.nextafter(x.abs(), torch.full_like(x, 9.0))
    below = [max(m for m in MAGS if m < t) for t in TIES]
    above = [min(m for m in MAGS if m > t) for t in TIES]
    assert decode_e2m1(round_to_e2m1(lo)).tolist() == below
    assert decode_e2m1(round_to_e2m1(hi)).tolist() == above


def test_nearest_on_dense_grid_matches_float64_argmin():
    x = torch.linspace(-7.0, 7.0, 28001, dtype=torch.float32)
    x = x[~torch.isin(x.abs(), torch.tensor(list(TIES)))]  # ties are tested above
    mags = torch.tensor(MAGS, dtype=torch.float64)
    nearest = mags[(x.double().abs().clamp(max=6).unsqueeze(-1) - mags).abs().argmin(-1)]
    assert torch.equal(decode_e2m1(round_to_e2m1(x)).double().abs(), nearest)


def test_saturation_and_signed_zero():
    x = torch.tensor([6.0, 6.5, 100.0, 1e30, -6.0, -7.0, -1e30, 0.0, -0.0, -0.1, 0.1, -0.25])
    codes = round_to_e2m1(x)
    # negative values that round to 0 keep the sign (code 8); an exact -0.0 gives code 0, as in compressed-tensors
    assert codes.tolist() == [7, 7, 7, 7, 15, 15, 15, 0, 0, 8, 0, 8]


def test_agrees_with_torchao_and_compressed_tensors_casts():
    """Our rounding vs torchao's `f32_to_f4_unpacked` (bit manipulation, RNE) and compressed-tensors'
    `FP4_E2M1_DATA.cast_to_fp4`, on every tie, its neighbours, and a dense grid in [-8, 8].

    Bit-exact with both everywhere except one documented input: an exact -0.0. compressed-tensors
    (torch.sign on CPU, `x < 0` in its Triton kernel) gives +0 -> code 0, and so do we; torchao copies
    the sign bit and gives code 8. Both decode to zero.
    """
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    quant_args = pytest.importorskip("compressed_tensors.quantization.quant_args")
    grid = torch.linspace(-8.0, 8.0, 64001, dtype=torch.float32)
    ties = torch.tensor(list(TIES) + [6.0, 0.5, 1.0], dtype=torch.float32)
    near = torch.cat([ties, torch.nextafter(ties, ties * 2), torch.nextafter(ties, torch.zeros_like(ties))])
    x = torch.cat([grid, near, -near, torch.tensor([0.0, -0.0])])
    ours = round_to_e2m1(x.clamp(-6, 6))
    ao = kernels.f32_to_f4_unpacked(x.clamp(-6, 6))
    neg_zero = (x == 0) & torch.signbit(x)
    assert neg_zero.sum() == 1 and ao[neg_zero].item() == 8 and ours[neg_zero].item() == 0
    assert torch.equal(ao[~neg_zero], ours[~neg_zero])
    ct = quant_args.FP4_E2M1_DATA.cast_to_fp4(x.clamp(-6, 6))
    assert torch.equal(ct, decode_e2m1(ours))
    assert torch.equal(torch.signbit(ct), torch.signbit(decode_e2m1(ours)))
