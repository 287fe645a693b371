"""NVFP4 (formats/nvfp4.py) against compressed-tensors (bit-exact) and torchao (bit-exact where the
arithmetic is the same; documented, bounded differences elsewhere), plus edge cases and error bounds."""

import pytest
import torch

from qerl.formats.fp4 import unpack_fp4
from qerl.formats.nvfp4 import BLOCK, TENSOR_NAMES, dequantize_nvfp4, quantize_nvfp4

ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402

E4M3_TINY = 2.0**-6  # smallest normal float8_e4m3fn


def nasty_matrix(gen, n=64, k=256):
    """fp32 [n, k]: Gaussian rows spread over 1e-3..1e3 in magnitude, plus a zero block, a block of
    -0.0, an all-equal block, a negative all-equal block, a block of tiny values (subnormal e4m3
    scales) and exact ties of the E2M1 grid."""
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, n).unsqueeze(1)
    w[0, :16] = 0.0
    w[0, 16:32] = -0.0
    w[1, :16] = 0.7
    w[1, 16:32] = -3.0
    w[2, :16] = torch.randn(16, generator=gen) * 1e-8
    w[3, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)
    return w


def ct_compress(w):
    """compressed-tensors' own NVFP4A16 path: generate_gparam -> calculate_qparams -> compress."""
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    n, k = w.shape
    gs = ct_helpers.generate_gparam(w.amin(), w.amax())
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale, zp = ct_helpers.calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp}
    return NVFP4PackedCompressor.compress(state, scheme), scheme


def e2m1_error_bound(w, step):
    """Largest |w - dequant| allowed elementwise for block step [N, K/16] (float64 [N, K]): half the
    gap between the E2M1 neighbours of w/step, or the saturation error past 6, plus fp32 slack."""
    s = step.double().repeat_interleave(BLOCK, dim=1)
    x = w.double().abs() / s
    half_gap = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    return torch.maximum(half_gap * s, (x - 6).clamp(min=0) * s) * (1 + 2**-20) + 1e-45


def test_bit_exact_with_compressed_tensors_float32():
    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen)
    ours = quantize_nvfp4(w)
    ref, scheme = ct_compress(w)
    assert set(ours) == set(TENSOR_NAMES)
    assert ours["weight_packed"].dtype == torch.uint8 and ours["weight_packed"].shape == (64, 128)
    assert ours["weight_scale"].dtype == torch.float8_e4m3fn and ours["weight_scale"].shape == (64, 16)
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])
    assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(ours["weight_global_scale"], ref["weight_global_scale"])
    assert (ours["weight_scale"].float() < E4M3_TINY).any()  # the subnormal-scale path was exercised
    # dequantization: compressed-tensors' decompress (bf16 output) and its fp32 dequantize
    theirs = NVFP4PackedCompressor.decompress(ref, scheme)["weight"]
    assert torch.equal(dequantize_nvfp4(**ours, dtype=torch.bfloat16), theirs)
    codes = unpack_fp4_from_uint8(ref["weight_packed"], 64, 256, dtype=torch.float32)
    ref32 = ct_dequantize(codes, ref["weight_scale"].float(), args=scheme.weights,
                          global_scale=ref["weight_global_scale"], dtype=torch.float32)
    assert torch.equal(dequantize_nvfp4(**ours), ref32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_vs_compressed_tensors(dtype):
    """We quantize the exact fp32 upcast of a bf16/fp16 weight; that is bit-exact with compressed-tensors
    fed `w.float()`. Fed the half tensor itself, compressed-tensors computes 448*6/amax and amax/6 in
    the half dtype (generate_gparam and calculate_qparams keep the input dtype), so its global scale is
    that rounded to bf16/fp16 and its block scales can land one E4M3 step away. The bound asserted:
    global scales within one ulp of the half dtype (its eps, relative) and every block scale equal or
    one E4M3 code apart, where "one apart" includes the underflow edge: one side rounds to the smallest
    subnormal 2^-9, the other to 0, which both replace by 0.125. The stored format (and its
    dequantization) is the same."""
    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen).clamp(-6e4, 6e4).to(dtype)
    ours = quantize_nvfp4(w)
    exact, _ = ct_compress(w.float())
    for name in TENSOR_NAMES:
        assert torch.equal(ours[name].view(torch.uint8), exact[name].view(torch.uint8))
    half, _ = ct_compress(w)
    rel = torch.finfo(dtype).eps
    assert abs(half["weight_global_scale"].item() / ours["weight_global_scale"].item() - 1) <= rel

    # blocks whose exact scale is far below 0.125: there a stored 0.125 is the replacement of 0
    tiny = w.float().reshape(64, -1, BLOCK).abs().amax(-1) * ours["weight_global_scale"] / 6 < 0.01

    def raw_code(scale):  # E4M3 code before the 0 -> 0.125 replacement
        return torch.where(tiny & (scale.float() == 0.125), 0, scale.view(torch.uint8).int())

    assert (raw_code(ours["weight_scale"]) - raw_code(half["weight_scale"])).abs().max() <= 1


def test_vs_torchao_power_of_two_global_scale_is_bit_exact():
    """torchao stores per_tensor_scale = amax/(448*6) (a multiplier, the reciprocal of ours) and computes
    block_amax/6/p and x * ((1/p)/s) where we compute gs*(block_amax/6) and x / (s/gs). With amax chosen
    so that gs is a power of two (here 64), every one of those is exact, and the two quantizers agree
    bit for bit: scales, codes and dequantized values (as long as no scale is below torchao's E4M3 clamp,
    see the next test)."""
    nvt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    gen = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(128, 512, generator=gen)
    w = w / w.abs().amax() * 42.0  # 448*6/42 = 64
    ours = quantize_nvfp4(w)
    assert ours["weight_global_scale"].item() == 64.0
    p = nvt.per_tensor_amax_to_scale(w.abs().amax())
    ref = nvt.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=p)
    assert (ours["weight_scale"].float() >= E4M3_TINY).all()
    assert torch.equal(ours["weight_scale"].view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(ours["weight_packed"], ref.qdata.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(**ours), ref.dequantize(torch.float32))


def test_vs_torchao_general_global_scale_differs_only_at_rounding_boundaries():
    """With a general amax, gs and p = 1/gs are each rounded, and s/gs vs (1/p)/s round differently, so
    torchao and we can disagree, but only (a) on an E4M3 block scale whose exact value gs*amax_b/6 lies
    within 2^-20 (relative) of the midpoint between the two E4M3 neighbours, the codes then one apart;
    (b) on an element code in a block with equal scales whose exact quotient w/step lies within 2^-20
    of an E2M1 rounding threshold, the codes then adjacent. Dequantized values from equal codes and
    scales differ by at most 2^-22 relative (one ulp from the two roundings of the step)."""
    nvt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    gen = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(256, 1024, generator=gen) * torch.rand(256, 1, generator=gen).add(0.5)
    ours = quantize_nvfp4(w)
    ref = nvt.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=nvt.per_tensor_amax_to_scale(w.abs().amax()))
    gs = ours["weight_global_scale"].double()
    s_ours, s_ref = ours["weight_scale"], ref.scale
    bad_s = s_ours.view(torch.uint8) != s_ref.view(torch.uint8)
    assert bad_s.float().mean() < 1e-3
    if bad_s.any():
        assert ((s_ours.view(torch.uint8)[bad_s].int() - s_ref.view(torch.uint8)[bad_s].int()).abs() == 1).all()
        exact = gs * w.double().reshape(256, -1, BLOCK).abs().amax(-1)[bad_s] / 6
        mid = (s_ours.double()[bad_s] + s_ref.double()[bad_s]) / 2
        assert ((exact - mid).abs() <= mid * 2**-20).all()
    same = ~bad_s.repeat_interleave(BLOCK, dim=1)
    c_ours, c_ref = unpack_fp4(ours["weight_packed"]), unpack_fp4(ref.qdata.view(torch.uint8))
    bad_c = (c_ours != c_ref) & same
    assert bad_c.float().mean() < 1e-4
    if bad_c.any():
        assert ((c_ours[bad_c].int() - c_ref[bad_c].int()).abs() == 1).all()
        step = (s_ours.double() / gs).repeat_interleave(BLOCK, dim=1)
        q = (w.double() / step).abs()[bad_c]
        t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
        assert ((q.unsqueeze(-1) - t).abs().amin(-1) <= q * 2**-20).all()
    ok = same & ~bad_c
    d_ours, d_ref = dequantize_nvfp4(**ours)[ok].double(), ref.dequantize(torch.float32)[ok].double()
    assert ((d_ours - d_ref).abs() <= d_ours.abs() * 2**-22).all()


def test_vs_torchao_tiny_block_scales_clamped_by_torchao():
    """Documented difference: torchao clamps every block scale to >= 2^-6 (the smallest normal E4M3)
    before the cast; compressed-tensors (and we) keep subnormal E4M3 scales (2^-9 .. 2^-6) and only
    replace an exact 0 by 0.125. Blocks whose scale is >= 2^-6 stay bit-identical; the others carry
    exactly 2^-6 in torchao."""
    nvt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    gen = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(16, 64, generator=gen).mul(42.0 / 4.5).clamp(-42, 42)
    w[0, 0] = 42.0  # gs = 64
    w[1, :16] *= 1e-5
    w[1, 0] = 4e-4  # block amax fixed: scale 64 * 4e-4 / 6 ~ 2^-8, a subnormal E4M3 whatever the draw
    w[2, :16] *= 1e-9  # scale rounds to 0 -> 0.125 here, 2^-6 in torchao
    w[3, :16] = 0.0
    ours = quantize_nvfp4(w)
    ref = nvt.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=nvt.per_tensor_amax_to_scale(w.abs().amax()))
    s_ours, s_ref = ours["weight_scale"].float(), ref.scale.float()
    normal = (s_ours >= E4M3_TINY) & (s_ours != 0.125)
    assert torch.equal(s_ours[normal], s_ref[normal])
    assert 0 < s_ours[1, 0] < E4M3_TINY and s_ours[2, 0] == 0.125 and s_ours[3, 0] == 0.125
    assert (s_ref[~normal] == E4M3_TINY).all()
    rows = torch.tensor([0, 4, 5, 6, 7])
    assert torch.equal(unpack_fp4(ours["weight_packed"])[rows], unpack_fp4(ref.qdata.view(torch.uint8))[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_error_bound(dtype):
    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen).clamp(-6e4, 6e4).to(dtype)
    q = quantize_nvfp4(w)
    step = q["weight_scale"].float() / q["weight_global_scale"]
    err = (dequantize_nvfp4(**q).double() - w.double()).abs()
    assert (err <= e2m1_error_bound(w, step)).all()
    assert dequantize_nvfp4(**q, dtype=dtype).dtype == dtype
    g = torch.randn(256, 1024, generator=gen)
    rel = (dequantize_nvfp4(**quantize_nvfp4(g)) - g).norm() / g.norm()
    assert 0.05 < rel < 0.15  # Gaussian NVFP4 error is about 0.09


def test_edge_blocks():
    zero = quantize_nvfp4(torch.zeros(4, 32))
    assert zero["weight_global_scale"].item() == 1.0 and (zero["weight_packed"] == 0).all()
    assert (zero["weight_scale"].float() == 0.125).all() and (dequantize_nvfp4(**zero) == 0).all()
    equal = torch.full((3, 48), -2.5)
    deq = dequantize_nvfp4(**quantize_nvfp4(equal))
    assert ((deq - equal).abs() <= 2.5 * 2**-22).all()  # code -6 times an fp32-rounded step
    # a 1e30 outlier: its block saturates the E4M3 scale at 448, every other block loses everything but
    # stays finite (codes 0), never NaN
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(torch.seed()))
    w[2, 5] = 1e30
    q = quantize_nvfp4(w)
    d = dequantize_nvfp4(**q)
    assert torch.isfinite(d).all() and d[2, 5].item() == pytest.approx(1e30, rel=1e-6)
    assert q["weight_scale"].float()[2, 0] == 448.0
    # odd shape that divides the block
    assert dequantize_nvfp4(**quantize_nvfp4(torch.randn(3, 16))).shape == (3, 16)


@pytest.mark.parametrize("bad", [torch.randn(4, 24), torch.randn(16), torch.randn(2, 4, 16),
                                 torch.ones(4, 16, dtype=torch.int32)])
def test_bad_shapes_and_dtypes_refused(bad):
    with pytest.raises(ValueError, match="nvfp4"):
        quantize_nvfp4(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(value):
    w = torch.randn(4, 32)
    w[1, 3] = value
    with pytest.raises(ValueError, match="non-finite"):
        quantize_nvfp4(w)


def test_shared_global_scale():
    gen = torch.Generator().manual_seed(torch.seed())
    a, b = torch.randn(8, 32, generator=gen), 3 * torch.randn(8, 32, generator=gen)
    shared = torch.minimum(quantize_nvfp4(a)["weight_global_scale"], quantize_nvfp4(b)["weight_global_scale"])
    qa = quantize_nvfp4(a, shared)
    assert torch.equal(qa["weight_global_scale"], shared)
    assert (qa["weight_scale"].float() <= 448).all()
    assert ((dequantize_nvfp4(**qa) - a).abs() <= e2m1_error_bound(a, qa["weight_scale"].float() / shared)).all()
    with pytest.raises(ValueError, match="global scale"):
        quantize_nvfp4(a, torch.tensor([0.0]))
