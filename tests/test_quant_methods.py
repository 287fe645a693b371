"""NVFP4 scale search (4over6) and GPTQ against plain float reference implementations of their own
algorithms, on small matrices with every FP4 code, zero, huge and outlier blocks."""

import warnings

import pytest
import torch

from qerl.formats.fp4 import decode_e2m1, round_to_e2m1
from qerl.formats.nvfp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from qerl.quant import check_method, quantize_group
from qerl.quant.gptq import HessianError, gptq_nvfp4, inverse_hessian_factor
from qerl.quant.nvfp4_scales import (SEARCH_STEPS, choose_block_scales, quantize_nvfp4_searched,
                                     round_e2m1_values)

E4M3_POSITIVE = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # ascending


def ref_nvfp4_error(block: torch.Tensor, scale: float, gs: float) -> float:
    """Squared error of one 16-block at one E4M3 scale, via the format's own code rounding (float64 sum)."""
    step = torch.tensor(scale, dtype=torch.float32) / torch.tensor(gs, dtype=torch.float32)
    codes = round_to_e2m1((block / step).clamp(-6, 6))
    return float(((block - decode_e2m1(codes) * step).double() ** 2).sum())


def ref_choose(w: torch.Tensor, gs: float, steps) -> torch.Tensor:
    """Brute force per block: E4M3 candidates by index in the sorted table of positive E4M3 values."""
    n, k = w.shape
    out = torch.empty(n, k // 16)
    for r in range(n):
        for b in range(k // 16):
            block = w[r, b * 16:(b + 1) * 16].float()
            amax = block.abs().max()
            rtn = torch.tensor(float(gs * amax / 6)).clamp(max=448).to(torch.float8_e4m3fn).float()
            rtn = rtn if rtn > 0 else torch.tensor(0.125)
            i0 = int((E4M3_POSITIVE == rtn).nonzero()[0])
            cands = [float(E4M3_POSITIVE[min(max(i0 + s, 0), 125)]) for s in steps]
            errs = [ref_nvfp4_error(block, c, gs) for c in cands]
            out[r, b] = cands[min(range(len(errs)), key=lambda j: (errs[j], j))]
    return out


def special_weight(seed: int, n: int = 6, k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :16] = decode_e2m1(torch.arange(16, dtype=torch.uint8)) * 0.01  # all 16 codes
    w[1, 16:32] = 0.0  # a zero block
    if n > 2:
        w[2, :16] *= 1e3  # a huge block
    if n > 3:
        w[3, 5] = 40.0  # one outlier
    if n > 4:
        w[4] = torch.distributions.StudentT(2.0).sample((k,))  # heavy tails
    return w


def test_fast_rounding_equals_the_format_rounding():
    x = torch.cat([torch.randn(20000) * 3, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 9.0])])
    x = torch.cat([x, -x, torch.nextafter(x, x + 1), torch.nextafter(x, x - 1)])
    assert torch.equal(round_e2m1_values(x), decode_e2m1(round_to_e2m1(x.clamp(-6, 6))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_search_matches_brute_force(seed):
    w = special_weight(seed)
    gs = nvfp4_global_scale(w)
    scales, err = choose_block_scales(w, gs, "mse")
    assert torch.equal(scales.float(), ref_choose(w, float(gs), SEARCH_STEPS))
    assert torch.isfinite(err).all()


def test_rtn_search_is_compressed_tensors_rtn_bit_for_bit():
    w = special_weight(3)
    ours = quantize_nvfp4_searched([w], "rtn")[0]
    theirs = quantize_nvfp4(w)
    for key in theirs:
        assert torch.equal(ours[key].view(torch.uint8) if ours[key].dtype == torch.float8_e4m3fn else ours[key],
                           theirs[key].view(torch.uint8) if theirs[key].dtype == torch.float8_e4m3fn else theirs[key])


@pytest.mark.parametrize("search", ["4over6", "mse"])
def test_searched_scales_never_lose_to_round_to_nearest_per_block(search):
    w = special_weight(4, n=32, k=128)
    gs = nvfp4_global_scale(w)
    _, err_rtn = choose_block_scales(w, gs, "rtn")
    _, err = choose_block_scales(w, gs, search)
    assert (err <= err_rtn).all() and err.sum() < err_rtn.sum()


def test_searched_group_shares_one_global_scale_and_dequantizes_finite():
    ws = [special_weight(5, n=8), special_weight(6, n=5) * 0.01]
    out = quantize_nvfp4_searched(ws, "mse")
    assert torch.equal(out[0]["weight_global_scale"], out[1]["weight_global_scale"])
    for w, t in zip(ws, out):
        assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (w.shape[0], w.shape[1] // 2)
        assert t["weight_scale"].dtype == torch.float8_e4m3fn
        assert t["weight_scale"].shape == (w.shape[0], w.shape[1] // 16)
        deq = dequantize_nvfp4(**t)
        assert torch.isfinite(deq).all()
        assert torch.equal(deq[1, 16:32], torch.zeros(16)) if w is ws[0] else True


def ref_gptq(w: torch.Tensor, h: torch.Tensor, gs: float, damp: float = 0.01) -> torch.Tensor:
    """Textbook GPTQ in float64: OBS updates with an explicitly downdated inverse Hessian, one column at a
    time, block scales chosen by brute force on the compensated block. Returns the dequantized W."""
    w = w.double().clone()
    h = h.double().clone()
    k = w.shape[1]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    q = torch.zeros_like(w)
    for j in range(k):
        if j % 16 == 0:
            block_scales = ref_choose(w[:, j:j + 16].float(), gs, SEARCH_STEPS)[:, 0]
            step = (block_scales / torch.tensor(gs, dtype=torch.float32)).double()
        qj = decode_e2m1(round_to_e2m1((w[:, j].float() / step.float()).clamp(-6, 6))).double() * step
        err = (w[:, j] - qj) / hinv[j, j]
        q[:, j] = qj
        w[:, j + 1:] -= err.unsqueeze(1) * hinv[j, j + 1:].unsqueeze(0)
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q


def calibration(k: int, n: int, seed: int, outlier: float = 20.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(n, k, generator=g) @ mix
    x[:, 3] *= outlier  # an outlier channel, as LLM activations have
    return x


def test_gptq_matches_textbook_reference():
    w = special_weight(7, n=8, k=48)
    x = calibration(48, 512, 7)
    h = x.t() @ x / x.shape[0]
    gs = nvfp4_global_scale(w)
    ours = dequantize_nvfp4(**gptq_nvfp4(w, h, gs)).double()
    ref = ref_gptq(w, h, float(gs))
    # same algorithm, different float order: nearly every element lands on the same grid point
    assert (ours == ref.float().double()).float().mean() > 0.97
    err = lambda q: float(((x.double() @ (w.double() - q).t()) ** 2).sum())
    assert err(ours) <= 1.05 * err(ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("outlier", [1.0, 20.0])
def test_gptq_and_search_reduce_layer_output_error_on_heavy_tailed_weights(seed, outlier):
    """The search minimises weight error, which is output error when input channels are alike; GPTQ
    minimises output error on the calibration inputs, outlier channels included."""
    torch.manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((64, 128)) * 0.02
    x = calibration(128, 1024, seed, outlier)
    h = x.t() @ x / x.shape[0]
    err = lambda t: float(((x @ (w - dequantize_nvfp4(**t)).t()) ** 2).sum())
    rtn = err(quantize_nvfp4(w))
    search = err(quantize_group("nvfp4", "4over6", [w])[0])
    gptq = err(quantize_group("nvfp4", "gptq", [w], h)[0])
    assert gptq < 0.8 * min(search, rtn)
    if outlier == 1.0:
        assert search < rtn


def test_gptq_handles_dead_and_rank_deficient_inputs():
    w = special_weight(8, n=5, k=32)
    x = torch.randn(8, 32)  # fewer rows than inputs: H is singular without damping
    x[:, 5] = 0.0  # an input never seen
    h = x.t() @ x / 8
    t = gptq_nvfp4(w, h, nvfp4_global_scale(w))
    assert torch.isfinite(dequantize_nvfp4(**t)).all()


def test_non_finite_hessian_raises_and_quantize_group_falls_back_with_a_warning():
    w = special_weight(9, n=5, k=32)
    h = torch.eye(32)
    h[2, 2] = float("nan")
    with pytest.raises(HessianError):
        inverse_hessian_factor(h)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = quantize_group("nvfp4", "gptq", [w], h, name="layer.q_proj")[0]
    assert any("falling back" in str(c.message) for c in caught)
    want = quantize_group("nvfp4", "4over6", [w])[0]
    assert torch.equal(out["weight_packed"], want["weight_packed"])


def test_gptq_rows_split_back_per_sibling():
    ws = [special_weight(10, n=6, k=32), special_weight(11, n=5, k=32)]
    x = calibration(32, 256, 10)
    out = quantize_group("nvfp4", "gptq", ws, x.t() @ x / 256)
    assert [t["weight_packed"].shape[0] for t in out] == [6, 5]
    assert torch.equal(out[0]["weight_global_scale"], out[1]["weight_global_scale"])


@pytest.mark.parametrize("method,fmt", [("gptq", "nf4"), ("4over6", "mxfp4"), ("awq", "bf16"), ("bogus", "nvfp4")])
def test_methods_refuse_formats_they_do_not_support(method, fmt):
    with pytest.raises(ValueError, match="rtn" if method == "bogus" else "works on"):
        check_method(method, fmt)


def test_gptq_without_a_hessian_is_an_error():
    with pytest.raises(ValueError, match="calibration"):
        quantize_group("nvfp4", "gptq", [special_weight(12, n=5, k=32)])
