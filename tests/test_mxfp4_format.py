"""MXFP4 (formats/mxfp4.py) against compressed-tensors' `mxfp4-pack-quantized` (MXFP4A16) and torchao's
`to_mx` (ScaleCalculationMode.EVEN, the same scale rule), plus edge cases and error bounds."""

import pytest
import torch

from qerl.formats.fp4 import round_to_e2m1, unpack_fp4
from qerl.formats.mxfp4 import BLOCK, TENSOR_NAMES, dequantize_mxfp4, mx_scale_value, quantize_mxfp4

ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
ct_mx = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402


def nasty_matrix(gen, n=64, k=512):
    """fp32 [n, k]: Gaussian rows over 1e-3..1e3, a zero block, a -0.0 block, all-equal blocks, block
    maxima with mantissa exactly 1.75 and just below (the round-up edge of the scale rule), a block of
    fp32 subnormals and one of ~1e-38 (biased exponent 0, scale 2^-127)."""
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, n).unsqueeze(1)
    w[0, :32], w[0, 32:64] = 0.0, -0.0
    w[1, :32], w[1, 32:64] = 0.7, -3.0
    w[2, :32] = torch.randn(32, generator=gen) * 1e-40
    w[2, 32:64] = torch.randn(32, generator=gen) * 1e-38
    w[3, :32] = torch.rand(32, generator=gen) * 1.75
    w[3, 5] = 1.75
    w[3, 32:64] = torch.rand(32, generator=gen)
    w[3, 40] = torch.nextafter(torch.tensor(1.75), torch.tensor(0.0))
    return w


def ct_compress(w):
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale, zp = ct_helpers.calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    return ct_mx.MXFP4PackedCompressor.compress(state, scheme), scheme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_exact_with_compressed_tensors(dtype):
    """Bit-exact for fp32, bf16 and fp16 inputs: the scale rule is integer arithmetic on the amax bits
    and every division is by a power of two, so computing in the input dtype (compressed-tensors) or in
    fp32 (us) gives the same bits. One documented exception, fp16 inputs only: compressed-tensors turns
    the exponent into a float scale in fp16, where 2^(e-127) underflows to 0 for e < 103 (block amax
    below 2^-22, zero blocks included); it replaces that 0 by 1 and stores exponent 127 with all codes 0
    (such a block is below fp16's quantization noise anyway); we store the real exponent (0 for a zero
    block, as compressed-tensors does for fp32/bf16)."""
    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen)
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
        w[2, :64] = torch.randn(64, generator=gen) * 1e-3  # fp16 has no 1e-38; keep in-range, normal values
    w = w.to(dtype)
    ours = quantize_mxfp4(w)
    ref, scheme = ct_compress(w)
    assert set(ours) == set(TENSOR_NAMES)
    assert ours["weight_packed"].dtype == torch.uint8 and ours["weight_packed"].shape == (64, 256)
    assert ours["weight_scale"].dtype == torch.uint8 and ours["weight_scale"].shape == (64, 16)
    if dtype == torch.float16:
        under = ours["weight_scale"] < 103
        assert under[0, 0] and under[0, 1]  # the zero blocks
        assert (ref["weight_scale"][under] == 127).all()
        under_elems = under.repeat_interleave(BLOCK // 2, dim=1)
        assert ((ref["weight_packed"][under_elems] & 0x77) == 0).all()
        ref["weight_scale"] = torch.where(under, ours["weight_scale"], ref["weight_scale"])
        ref["weight_packed"] = torch.where(under_elems, ours["weight_packed"], ref["weight_packed"])
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])
    assert torch.equal(ours["weight_scale"], ref["weight_scale"])
    if dtype == torch.float32:
        assert (ours["weight_scale"] == 0).any()  # the exponent-0 (2^-127) path was exercised
    dec = ct_mx.MXFP4PackedCompressor.decompress(ref, scheme)["weight"]  # bf16, exact products
    assert torch.equal(dequantize_mxfp4(**ours, dtype=torch.bfloat16), dec)
    assert torch.equal(dequantize_mxfp4(**ours).to(torch.bfloat16), dec)


def test_overflowing_amax_documented_difference():
    """For a block amax >= 1.75 * 2^127 the rounded-up power of two is fp32 inf. compressed-tensors then
    divides the block by an inf scale (every code becomes +-0) and, casting floor(log2(inf)) to int32,
    stores exponent 127 (scale 1): the whole block decodes to zeros. torchao's EVEN mode stores 253 (the
    exponent field 255 minus 2), whose codes >= 4 decode to 2^128 = inf in fp32. We store 252, the
    largest exponent whose 6 * 2^125 is finite, so the block saturates at 2.55e38. Every other block is
    bit-identical to both."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(torch.seed()))
    w[0, 3] = 3.0e38
    ours = quantize_mxfp4(w)
    ref, _ = ct_compress(w)
    ao, _ = mx.to_mx(w, torch.float4_e2m1fn_x2, BLOCK, ScaleCalculationMode.EVEN)
    assert ao.view(torch.uint8)[0, 0].item() == 253
    assert torch.equal(ao.view(torch.uint8).flatten()[1:], ours["weight_scale"].flatten()[1:])
    assert ours["weight_scale"][0, 0].item() == 252 and ref["weight_scale"][0, 0].item() == 127
    assert ((ref["weight_packed"][0, :16] & 0x77) == 0).all()  # compressed-tensors: all codes +-0
    assert torch.equal(ours["weight_scale"].flatten()[1:], ref["weight_scale"].flatten()[1:])
    assert torch.equal(ours["weight_packed"][1], ref["weight_packed"][1])
    d = dequantize_mxfp4(**ours)
    assert torch.isfinite(d).all() and d[0, 3].item() == 6.0 * 2.0**125


def test_vs_torchao_even_mode():
    """torchao `to_mx(..., ScaleCalculationMode.EVEN)`: same scale rule, same division, same RNE cast:
    scales and codes are bit-exact, except in blocks whose biased exponent is 0 (block amax < 2^-124):
    torchao stores exponent 0 (2^-127) but divides by max(2^-127, 2^-126) = 2^-126 (its clamp to the
    smallest normal fp32, for Triton), so its codes there are those of w / 2^-126 (half ours), while its
    own `to_dtype` multiplies them back by 2^-127. We (and compressed-tensors) divide by 2^-127."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen)
    scale, data = mx.to_mx(w, torch.float4_e2m1fn_x2, BLOCK, ScaleCalculationMode.EVEN)
    ours = quantize_mxfp4(w)
    assert torch.equal(scale.view(torch.uint8), ours["weight_scale"])
    zero_exp = (ours["weight_scale"] == 0).repeat_interleave(BLOCK, dim=1)
    c_ours, c_ref = unpack_fp4(ours["weight_packed"]), unpack_fp4(data.view(torch.uint8))
    # exact -0.0 inputs: torchao keeps the sign (code 8), compressed-tensors and we give code 0
    neg_zero = (w == 0) & torch.signbit(w)
    assert torch.equal(c_ours[~zero_exp & ~neg_zero], c_ref[~zero_exp & ~neg_zero])
    assert (c_ref[neg_zero & ~zero_exp] == 8).all() and (c_ours[neg_zero] == 0).all()
    tiny = w[zero_exp].reshape(-1)
    expected = round_to_e2m1((tiny / 2.0**-126).clamp(-6, 6))
    expected[(tiny == 0) & torch.signbit(tiny)] = 8
    assert torch.equal(c_ref[zero_exp], expected)
    assert not torch.equal(c_ours[zero_exp], c_ref[zero_exp])  # the difference is real on this input
    ok = ~zero_exp
    ref_deq = mx.to_dtype(data, scale, torch.float4_e2m1fn_x2, BLOCK, torch.float32)
    assert torch.equal(dequantize_mxfp4(**ours)[ok], ref_deq[ok])


def test_vs_torchao_floor_mode_is_one_exponent_lower_at_mantissa_1_75():
    """The OCP spec's FLOOR rule (torchao's default) takes floor(log2(amax)) - 2; the compressed-tensors /
    EVEN rule adds one exactly when the amax mantissa is >= 1.75 (so amax/scale < 7 never saturates by
    more than 1). Assert that relation exactly."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(torch.seed()))
    floor, _ = mx.to_mx(w, torch.float4_e2m1fn_x2, BLOCK, ScaleCalculationMode.FLOOR)
    amax = w.reshape(128, -1, BLOCK).abs().amax(-1)
    mant = amax / 2.0 ** torch.floor(torch.log2(amax))
    up = (mant >= 1.75).int()
    assert up.any() and (1 - up).any()
    assert torch.equal(quantize_mxfp4(w)["weight_scale"].int(), floor.view(torch.uint8).int() + up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_error_bound(dtype):
    gen = torch.Generator().manual_seed(torch.seed())
    w = (torch.randn(32, 256, generator=gen) * torch.logspace(-2, 2, 32).unsqueeze(1)).to(dtype)
    q = quantize_mxfp4(w)
    s = mx_scale_value(q["weight_scale"]).double().repeat_interleave(BLOCK, dim=1)
    x = w.double().abs() / s
    assert (x <= 8).all()  # the EVEN rule keeps amax/scale < 8 (saturation error < 2 steps)
    bound = torch.maximum(torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0)), x - 6) * s
    assert ((dequantize_mxfp4(**q).double() - w.double()).abs() <= bound).all()
    assert dequantize_mxfp4(**q, dtype=dtype).dtype == dtype
    g = torch.randn(256, 1024, generator=gen)
    rel = (dequantize_mxfp4(**quantize_mxfp4(g)) - g).norm() / g.norm()
    assert 0.08 < rel < 0.2  # Gaussian MXFP4 error is about 0.12 (power-of-two scales cost vs NVFP4)


def test_edge_blocks():
    zero = quantize_mxfp4(torch.zeros(2, 64))
    assert (zero["weight_scale"] == 0).all() and (zero["weight_packed"] == 0).all()
    assert (dequantize_mxfp4(**zero) == 0).all()
    for v in (-2.5, 0.7, 1e-20):  # all-equal blocks: the max sits at 4 (or 6) steps, exact if representable
        w = torch.full((3, 96), v)
        d = dequantize_mxfp4(**quantize_mxfp4(w))
        assert (d - w).abs().max() <= abs(v) * 0.25
    assert torch.equal(dequantize_mxfp4(**quantize_mxfp4(torch.full((1, 32), -3.0))), torch.full((1, 32), -3.0))
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(torch.seed()))
    w[1, 40] = 1e30
    d = dequantize_mxfp4(**quantize_mxfp4(w))
    assert torch.isfinite(d).all() and abs(d[1, 40].item() / 1e30 - 1) <= 0.25
    assert torch.equal(d[0], dequantize_mxfp4(**quantize_mxfp4(w[:1])) [0])  # other rows unaffected
    assert dequantize_mxfp4(**quantize_mxfp4(torch.randn(5, 32))).shape == (5, 32)


@pytest.mark.parametrize("bad", [torch.randn(4, 48), torch.randn(32), torch.ones(4, 32, dtype=torch.int64)])
def test_bad_shapes_and_dtypes_refused(bad):
    with pytest.raises(ValueError, match="mxfp4"):
        quantize_mxfp4(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(value):
    w = torch.randn(4, 32)
    w[2, 7] = value
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(w)


def test_global_scale_refused():
    with pytest.raises(ValueError, match="no global scale"):
        quantize_mxfp4(torch.randn(4, 32), torch.tensor([1.0]))
