"""experiments/w4a8_weights.py: NVFP4 with power-of-two block scales converts to e4m3 (per-channel scale) exactly,
the standard NVFP4 weight does not, and the summary is consistent; benchmarks/w4a8_quality.py's emulation."""

import torch
from bench_scripts import load_benchmark, load_experiment

from qerl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

w4a8 = load_experiment("w4a8_weights")


def test_power_of_two_block_scales_are_exact_in_e4m3_and_standard_ones_are_not():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.linspace(0.2, 3, 64)[:, None]
    p = w4a8.nvfp4_pow2(w)
    steps = (p.reshape(64, 16, 16).abs().amax(-1) / 6)  # each block's largest value is a code times its step
    assert torch.isfinite(p).all() and ((p - w).abs() <= w.abs().amax() / 2).all()
    mant, _ = torch.frexp(p[p != 0])
    assert torch.isin(mant.abs(), torch.tensor([0.5, 0.75])).all()  # at most 2 significant bits
    assert torch.equal(w4a8.to_e4m3(p, power_of_two=True), p)
    q = dequantize_nvfp4(**quantize_nvfp4(w))
    assert not torch.equal(w4a8.to_e4m3(q), q)  # 5 significant bits do not all fit e4m3
    assert steps.max() > 0


def test_the_summary_adds_up():
    g = torch.Generator().manual_seed(1)
    r = w4a8.measure({"a": torch.randn(32, 64, generator=g), "b": torch.randn(16, 128, generator=g)})
    assert r["layers"] == 2 and r["elements"] == 32 * 64 + 16 * 128
    assert r["pow2_cast"] == 0 and r["changed_pow2"] == 0 and r["changed_nvfp4"] > 0
    assert 0 < r["nvfp4"] < r["pow2"] < 0.1  # coarser scales cost accuracy
    assert r["nvfp4_e4m3"] > 0 and r["nvfp4_cast"] > 0


def test_the_w4a8_emulation_swaps_every_nvfp4_layer_and_restores_them():
    """benchmarks/w4a8_quality.py on a tiny model: with neither rounding the emulation is the W4A16 model (fp32
    products of the same weights), each rounding moves the logits, the layers come back afterwards."""
    from tiny import tiny_model

    from qerl.eval.fidelity import next_token_logprobs
    from qerl.models import quant_layers, quantize_model

    quality = load_benchmark("w4a8_quality")
    model = quantize_model(tiny_model("llama"), "nvfp4")
    ids = torch.randint(3, 150, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = next_token_logprobs(model, ids)
        layers = dict(quant_layers(model))
        with quality.w4a8(model, weights=False, activations=False):
            assert not quant_layers(model)
            torch.testing.assert_close(next_token_logprobs(model, ids), ref, rtol=0, atol=1e-5)
        for weights, activations in ((True, False), (False, True), (True, True)):
            with quality.w4a8(model, weights, activations):
                assert (next_token_logprobs(model, ids) - ref).abs().max() > 1e-5
        # per 1 x B block of a token: B = the whole row is per token; a smaller B is another rounding
        name, layer = next(iter(layers.items()))
        x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(3))
        per_token = quality._W4A8(layer, False, True)(x)
        assert torch.equal(quality._W4A8(layer, False, True, block=layer.in_features)(x), per_token)
        assert (quality._W4A8(layer, False, True, block=16)(x) - per_token).abs().max() > 1e-5
        with quality.w4a8(model, False, True):
            per_token = next_token_logprobs(model, ids)
        with quality.w4a8(model, False, True, block=16):
            assert (next_token_logprobs(model, ids) - per_token).abs().max() > 1e-5
        assert quant_layers(model) == layers
