"""model.compute fp8 (W4A8): NVFP4 / MXFP4 weights decoded to e4m3 (`qerl.formats.fp8.as_fp8`), activations rounded
to e4m3 per token, fp32 products -- the CPU's emulation is the reference the FP8 tensor cores reproduce; the input
gradient stays the 16-bit one; a training run rolls out and trains through the same products."""

import pytest
import torch
import torch.nn.functional as F
from test_train_e2e import _overrides, data_file  # noqa: F401 (fixture)

from qerl.config import ConfigError, load_config
from qerl.formats import get_format
from qerl.formats.fp8 import as_fp8, quantize_rows_fp8
from qerl.kernels.route import current_policy, kernel_policy
from qerl.nn import LoraConfig, QuantLinear
from qerl.nn.quant_linear import set_routing_policy
from qerl.rl.run_log import read_metrics


def _layer(fmt):
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
    layer = QuantLinear.from_linear(linear, fmt, LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.1, generator=g)
    return layer, torch.randn(3, 7, 64, generator=g)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_w4a8_product_is_the_fp32_product_of_the_rounded_operands(fmt):
    layer, x = _layer(fmt)
    with torch.no_grad():
        w16 = layer(x)
        with kernel_policy(compute="fp8"):
            w8 = layer(x)
        q, s = quantize_rows_fp8(x.reshape(-1, 64))
        w = get_format("fp8").dequantize(**as_fp8(fmt, layer.quantized_tensors()))
        base = F.linear((q.float() * s).reshape(x.shape), w) + layer.bias
        lora = F.linear(F.linear(x, layer.lora_A.weight), layer.lora_B.weight) * layer.scaling
    torch.testing.assert_close(w8, base + lora, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(w8, w16, rtol=1e-4, atol=1e-5)  # the roundings are there
    if fmt == "mxfp4":  # E2M1 x E8M0 converts exactly: only the activations differ from W4A16's weights
        torch.testing.assert_close(w, layer.dequantized_weight(), rtol=0, atol=0)


def test_a_dequantization_scope_decodes_each_w4a8_weight_once():
    """Inside a scope (the CPU's rollouts and loss passes) the W4A8 weight is decoded once and reused, with the
    same result as decoding it per call."""
    from qerl.kernels.dequant_cache import dequantized_weights
    from qerl.kernels.fp8_matmul import w4a8_weight

    layer, x = _layer("nvfp4")
    with torch.no_grad(), kernel_policy(compute="fp8"):
        per_call = layer(x)
        store = {}
        with dequantized_weights(store=store):
            cached = [layer(x), layer(x)]
    (key, (_, dense)), = store.items()
    assert key[-1] == "w4a8_weight"
    torch.testing.assert_close(dense, w4a8_weight("nvfp4", layer.quantized_tensors(), torch.float32), rtol=0, atol=0)
    for y in cached:
        torch.testing.assert_close(y, per_call, rtol=0, atol=0)


def test_the_input_gradient_stays_16_bit_and_the_layer_keeps_its_routing():
    layer, x = _layer("nvfp4")
    x16, x8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(6))
    layer(x16).backward(grad)
    set_routing_policy(layer, current_policy().__class__(compute="fp8"))  # held by the layer, no scope needed
    y8 = layer(x8)
    y8.backward(grad)
    torch.testing.assert_close(x8.grad, x16.grad, rtol=1e-5, atol=1e-6)
    set_routing_policy(layer, None)
    with torch.no_grad():
        assert not torch.allclose(layer(x), y8.detach(), rtol=1e-4, atol=1e-5)


def test_the_config_takes_fp8_compute_for_4bit_weights_only():
    assert load_config(None, ["model.compute=fp8"]).model.compute == "fp8"
    for bad, match in ((["model.format=nf4"], "nvfp4 or mxfp4"), (["model.format=fp8"], "nvfp4 or mxfp4"),
                       (["model.dense_weights=update"], "dense_weights")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["model.compute=fp8", *bad])


def test_the_engine_samples_from_the_w4a8_policy_the_loss_pass_scores():
    """Under one routing the engine's log-probs of its samples equal the loss pass's (fp32, within rounding); an
    engine left on 16-bit products differs by far more (so the check can fail)."""
    from tiny import tiny_model

    from qerl.models import quantize_model
    from qerl.rl.logprobs import completion_logprobs
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    model = quantize_model(tiny_model("qwen2"), "nvfp4", LoraConfig(r=4, alpha=8))
    policy = current_policy().__class__(compute="fp8")
    set_routing_policy(model, policy)  # the loss pass
    prompts = torch.randint(3, 150, (4, 6), generator=torch.Generator().manual_seed(7))
    engine = RolloutEngine(model, max_seq_len=32)

    def gap(engine_policy):
        with kernel_policy(engine_policy):
            r = engine.generate(prompts, 10, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)
        with torch.no_grad():
            lp = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        return float((lp - r.logprobs).abs().max())

    assert gap(policy) < 1e-4
    assert gap(current_policy()) > 1e-3


def test_a_run_trains_with_fp8_compute(tiny_dir, data_file, tmp_path):  # noqa: F811
    from qerl.cli import main

    out = tmp_path / "run"
    assert main(["train", *_overrides(tiny_dir, data_file, out, **{"model.compute": "fp8", "steps": 1})]) == 0
    assert len(read_metrics(out / "metrics.jsonl")) == 1


def test_eval_scores_with_fp8_compute_and_refuses_other_formats(tiny_dir, data_file, capsys):  # noqa: F811
    import json

    from qerl.cli import main

    common = ["eval", str(tiny_dir), "--dataset", str(data_file), "--limit", "3", "--max-new-tokens", "4", "--greedy",
              "--suffix", "none", "--device", "cpu"]
    assert main([*common, "--format", "nvfp4", "--compute", "fp8"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n_problems"] == 3 and 0 <= summary["pass@1"] <= 1
    assert main([*common, "--format", "nf4", "--compute", "fp8"]) == 2
    assert "--compute fp8 multiplies nvfp4 or mxfp4" in capsys.readouterr().err


def test_the_trainers_engine_samples_with_fp8_compute_only_inside_its_routing(tiny_dir, data_file, tmp_path):  # noqa: F811
    """The engine's products read the routing scope, not the layers: `Trainer.kernel_routing` is that scope, and
    an evaluation through `trainer.engine` (the study's held-out scores) must run inside it to score the W4A8
    policy rather than the W4A16 one."""
    from qerl.rl.trainer import Trainer
    from qerl.rollout.sampling import SamplingParams

    cfg = load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run", **{"model.compute": "fp8"}))
    trainer = Trainer(cfg)
    prompts = [[1, 5, 9, 13], [2, 4, 6]]

    def logprobs():
        out = trainer.engine.generate(prompts, 6, SamplingParams(0.0), seed=0, ignore_eos=True)
        return out.logprobs

    outside = logprobs()
    with trainer.kernel_routing():
        assert current_policy().compute == "fp8"
        inside = logprobs()
    assert current_policy().compute == "bf16"
    assert torch.isfinite(inside).all() and not torch.equal(inside, outside)
