"""The fp8 weight format (qerl.formats.fp8) against torch's float8_e4m3fn: codes bit-exact with torch's cast of the
scaled rows, every finite e4m3 value, zero and huge rows, refusal of non-finite weights; the W8A8 reference product;
the config's checks. The checkpoint round trip and compressed-tensors' reading of it are in test_checkpoint.py,
the layer in test_quant_linear.py; the FP8 tensor-core path in test_fp8_gpu.py."""

import pytest
import torch

from qerl.config import ConfigError, load_config
from qerl.formats import get_format
from qerl.formats.fp8 import E4M3_MAX, quantize_rows_fp8
from qerl.kernels.fp8_matmul import fp8_linear, fp8_linear_reference

FP8 = get_format("fp8")


def all_finite_e4m3() -> torch.Tensor:
    """Every finite float8_e4m3fn value (254 of the 256 bit patterns; the two NaNs left out), as fp32."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)]


def test_every_finite_e4m3_value_round_trips_exactly():
    """A row holding every finite e4m3 value, ±448 included, has scale 1: its codes are the values themselves."""
    values = all_finite_e4m3()
    assert values.numel() == 254 and values.abs().max() == E4M3_MAX == 448
    t = FP8.quantize(values[None])
    assert t["weight_scale"].item() == 1.0
    assert torch.equal(t["weight"].float(), values[None])
    assert torch.equal(FP8.dequantize(**t), values[None])


@pytest.mark.parametrize("seed", [0, 1])
def test_codes_are_torchs_cast_of_the_scaled_rows(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 53, generator=g) * torch.logspace(-6, 6, 37)[:, None]  # odd shape, rows of every size
    w[3] = 0.0  # a zero row
    w[5, 7] = 3e37  # a huge row
    t = FP8.quantize(w)
    amax = w.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax * torch.tensor(1 / 448, dtype=torch.float32), torch.ones_like(amax))
    assert t["weight"].dtype == torch.float8_e4m3fn and t["weight_scale"].dtype == torch.float32
    assert torch.equal(t["weight_scale"], scale)
    assert torch.equal(t["weight"].view(torch.uint8), (w / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(t["weight"][3].float(), torch.zeros(53))
    back = FP8.dequantize(**t)
    assert torch.isfinite(back).all()
    # the row maximum comes back to within fp32 rounding; every value within half an e4m3 step (2^-4 relative
    # for normal values, plus the subnormal spacing 2^-9 scaled)
    row_max = back.abs().amax(1, keepdim=True)
    assert ((row_max - amax).abs() <= 2 * torch.finfo(torch.float32).eps * amax).all()
    assert ((back - w).abs() <= 2 ** -4 * w.abs() + 2 ** -9 * scale).all()


def test_non_finite_weights_are_refused():
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 8)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="non-finite"):
            FP8.quantize(w)


def test_activation_rows_quantize_like_weight_rows():
    x = torch.randn(9, 64) * 3
    q, s = quantize_rows_fp8(x)
    t = FP8.quantize(x)
    assert torch.equal(q.view(torch.uint8), t["weight"].view(torch.uint8)) and torch.equal(s, t["weight_scale"])


def test_the_w8a8_reference_is_the_float64_product_of_the_quantized_operands():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 5, 48, generator=g), torch.randn(32, 48, generator=g)
    t = FP8.quantize(w)
    q, s = quantize_rows_fp8(x.reshape(-1, 48))
    want = (q.double() * s.double()) @ (t["weight"].double() * t["weight_scale"].double()).t()
    got = fp8_linear_reference(x, **t)
    assert got.shape == (2, 5, 32) and torch.equal(got.reshape(-1, 32), want)
    # W8A8 stays near the full-precision product (the activations' e4m3 rounding is the extra error)
    exact = x.double() @ w.double().t()
    assert (got - exact).abs().max() <= 0.1 * exact.abs().max()
    # on the CPU the layer's product is the dequantized weight's (W8A16): the reference path
    assert torch.equal(fp8_linear(x, **t), torch.nn.functional.linear(x, FP8.dequantize(**t)))


def test_the_config_keeps_fp8_to_what_is_built():
    assert load_config(None, ["model.format=fp8"]).model.format == "fp8"
    with pytest.raises(ConfigError, match="quant_method gptq"):
        load_config(None, ["model.format=fp8", "model.quant_method=gptq"])
    with pytest.raises(ConfigError, match="quantize_embeddings needs a 4-bit"):
        load_config(None, ["model.format=fp8", "model.quantize_embeddings=true"])


def test_nvfp4_weights_become_fp8_tensors_within_half_an_e4m3_step():
    """What a W4A8 product multiplies (`nvfp4_as_fp8`): a valid fp8 tensor set, each value the NVFP4 value rounded
    once to e4m3 (within 2^-4 relative), zeros kept, and exact where code x block scale fits e4m3's 4 bits."""
    from qerl.formats.fp8 import nvfp4_as_fp8
    from qerl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    g = torch.Generator().manual_seed(4)
    # rows of every magnitude (the per-row shift absorbs them); within a row, blocks whose scales stay inside
    # e4m3's normal range (a block 2^-6 below the row's largest would fall into e4m3's subnormals)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    w[7, :16] = 0.0  # a zero block
    t = quantize_nvfp4(w)
    q = dequantize_nvfp4(**t)
    f = nvfp4_as_fp8(**t)
    assert f["weight"].dtype == torch.float8_e4m3fn and f["weight"].shape == (40, 96)
    assert f["weight_scale"].dtype == torch.float32 and f["weight_scale"].shape == (40, 1)
    e = FP8.dequantize(**f)
    assert torch.isfinite(e).all() and torch.equal(e[q == 0], q[q == 0])
    assert ((e - q).abs() <= 2 ** -4 * q.abs() * (1 + 1e-6)).all()
    changed = (e - q).abs() > 2 ** -20 * q.abs()
    assert 0 < changed.float().mean() < 0.5  # some values need the fifth bit, most do not
