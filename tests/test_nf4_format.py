"""NF4 (formats/nf4.py) against bitsandbytes' own quantize_4bit / dequantize_4bit (CPU build, bit-exact)
and a float64 nearest-value reference, plus edge cases and error bounds."""

import pytest
import torch

from qerl.formats.nf4 import BLOCK, NF4_CODE, TENSOR_NAMES, dequantize_nf4, quantize_nf4

CODE64 = torch.tensor(NF4_CODE, dtype=torch.float64)
MID32 = (torch.tensor(NF4_CODE[:-1]) + torch.tensor(NF4_CODE[1:])) / 2  # fp32 midpoints


def nasty_matrix(gen, n=96, k=200):
    """fp32 [n, k] (k not a multiple of 64: blocks span rows): Gaussian rows over 1e-3..1e3, a zero
    block, an all-equal block, a tiny block (absmax < bnb's 1e-38 floor), exact fp32 midpoints."""
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, n).unsqueeze(1)
    w.view(-1)[:64] = 0.0
    w.view(-1)[64:128] = -0.3
    w.view(-1)[128:192] = torch.randn(64, generator=gen) * 1e-39
    w.view(-1)[192:256] = torch.cat([MID32, -MID32, torch.ones(1), torch.zeros(33)])
    return w


@pytest.fixture(scope="module")
def bnbf():
    bnb = pytest.importorskip("bitsandbytes.functional")
    return bnb


def test_code_table_is_bitsandbytes(bnbf):
    assert torch.equal(bnbf.get_4bit_type("nf4", device="cpu"), torch.tensor(NF4_CODE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_exact_with_bitsandbytes(bnbf, dtype):
    gen = torch.Generator().manual_seed(torch.seed())
    w = nasty_matrix(gen)
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    w = w.to(dtype)
    ours = quantize_nf4(w)
    packed, state = bnbf.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4")
    assert set(ours) == set(TENSOR_NAMES)
    assert ours["weight_packed"].shape == (96, 100) and ours["weight_packed"].dtype == torch.uint8
    assert ours["weight_absmax"].shape == (96 * 200 // 64,) and ours["weight_absmax"].dtype == torch.float32
    assert torch.equal(ours["weight_packed"].reshape(-1, 1), packed)
    assert torch.equal(ours["weight_absmax"], state.absmax)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        ref = torch.ops.bitsandbytes.dequantize_4bit(packed, state.absmax, BLOCK, "nf4", list(w.shape), out)
        assert torch.equal(dequantize_nf4(**ours, dtype=out), ref)


def test_midpoint_ties_go_to_the_lower_code(bnbf):
    """A scaled value exactly on an fp32 midpoint goes to the lower code (bnb's bucketize right=False)."""
    w = torch.cat([MID32, -MID32, torch.ones(1), torch.zeros(33)]).reshape(2, 32)
    codes = torch.stack([quantize_nf4(w)["weight_packed"] >> 4, quantize_nf4(w)["weight_packed"] & 15], -1).reshape(-1)
    assert codes[:15].tolist() == list(range(15))
    lower = torch.bucketize(-MID32, MID32)  # midpoint i of the negated table is between codes 14-i, 15-i
    assert torch.equal(codes[15:30].long(), lower)
    packed, _ = bnbf.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4")
    assert torch.equal(quantize_nf4(w)["weight_packed"].reshape(-1, 1), packed)


def test_float64_nearest_reference():
    """Independent of bitsandbytes: codes are the nearest NF4 value (float64 argmin) to w * (1/absmax)
    everywhere except within 1e-6 of a midpoint, where fp32 rounding decides."""
    gen = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen)
    q = quantize_nf4(w)
    codes = torch.stack([q["weight_packed"] >> 4, q["weight_packed"] & 15], -1).reshape(-1, BLOCK).long()
    blocks = w.double().reshape(-1, BLOCK)
    absmax = blocks.abs().amax(-1, keepdim=True)
    assert torch.equal(q["weight_absmax"].double(), absmax.squeeze(-1))
    scaled = blocks / absmax
    dist = (scaled.unsqueeze(-1) - CODE64).abs()
    ref = dist.argmin(-1)
    sorted_d = dist.sort(-1).values
    clear = (sorted_d[..., 1] - sorted_d[..., 0]) > 1e-6
    assert torch.equal(codes[clear], ref[clear])
    assert clear.float().mean() > 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_error_bound(dtype):
    gen = torch.Generator().manual_seed(torch.seed())
    w = (torch.randn(32, 128, generator=gen) * torch.logspace(-2, 2, 32).unsqueeze(1)).to(dtype)
    q = quantize_nf4(w)
    absmax = q["weight_absmax"].double().repeat_interleave(BLOCK).reshape(32, 128)
    max_half_gap = (CODE64[1:] - CODE64[:-1]).max() / 2  # 0.152, between -1 and -0.696
    err = (dequantize_nf4(**q).double() - w.double()).abs()
    assert (err <= absmax * max_half_gap * (1 + 1e-6)).all()
    assert dequantize_nf4(**q, dtype=dtype).dtype == dtype
    g = torch.randn(256, 1024, generator=gen)
    rel = (dequantize_nf4(**quantize_nf4(g)) - g).norm() / g.norm()
    assert 0.06 < rel < 0.14  # Gaussian NF4 error is about 0.10


def test_edge_blocks():
    zero = quantize_nf4(torch.zeros(2, 64))
    assert (zero["weight_absmax"] == 0).all() and (zero["weight_packed"] == 0x77).all()  # code 7 is 0.0
    assert (dequantize_nf4(**zero) == 0).all()
    w = torch.full((4, 32), -0.3)
    w[2:] = 5.0
    assert torch.equal(dequantize_nf4(**quantize_nf4(w)), w)  # +-absmax is exactly +-1 * absmax
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(torch.seed()))
    w[3, 10] = 1e30
    q = quantize_nf4(w)
    d = dequantize_nf4(**q)
    assert torch.isfinite(d).all() and d[3, 10] == w[3, 10] and (d[3] != 0).sum() == 1
    assert torch.equal(d[:3], dequantize_nf4(**quantize_nf4(w[:3].reshape(3, 64))))
    assert dequantize_nf4(**quantize_nf4(torch.randn(1, 64))).shape == (1, 64)
    assert dequantize_nf4(**quantize_nf4(torch.randn(32, 2))).shape == (32, 2)  # blocks span 32 rows


@pytest.mark.parametrize("shape,match", [((3, 10), "multiple of the block size 64"), ((64, 3), "must be even"),
                                         ((128,), "2-D")])
def test_bad_shapes_refused(shape, match):
    with pytest.raises(ValueError, match=match):
        quantize_nf4(torch.randn(shape))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(value):
    w = torch.randn(2, 64)
    w[0, 1] = value
    with pytest.raises(ValueError, match="non-finite"):
        quantize_nf4(w)


def test_int_and_global_scale_refused():
    with pytest.raises(ValueError, match="float"):
        quantize_nf4(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="no global scale"):
        quantize_nf4(torch.randn(2, 64), torch.tensor([1.0]))
