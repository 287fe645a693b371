"""model.dense_weights: 16-bit copies of the 4-bit linear weights, made once and kept for a run."""

import pytest
import torch

from qerl.config import ConfigError, load_config
from qerl.kernels import dense_weight_bytes, dequantized_weights, quantized_linear
from qerl.kernels import dequant_cache
from qerl.nn import QuantLinear
from qerl.rl.trainer import Trainer

from test_train_e2e import _overrides, data_file  # noqa: F401  (fixture)


def _counting(monkeypatch) -> list:
    """Count dequantizations made by the scoped cache."""
    made = []
    real = dequant_cache.get_format

    def get_format(fmt):
        f = real(fmt)

        class Counted:
            def dequantize(self, **tensors):
                made.append(fmt)
                return f.dequantize(**tensors)
        return Counted()
    monkeypatch.setattr(dequant_cache, "get_format", get_format)
    return made


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "mxfp4"])
def test_a_store_keeps_each_copy_across_scopes_and_gives_the_exact_dequantization(fmt, monkeypatch):
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), fmt)
    x = torch.randn(5, 64)
    made = _counting(monkeypatch)
    store = {}
    with dequantized_weights(store=store):
        y1 = layer(x)
    with dequantized_weights(store=store):
        y2 = layer(x)
    assert made == [fmt] and len(store) == 1  # made once, reused by the second scope
    assert dense_weight_bytes(store) == 48 * 64 * 4
    ref = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), layer.bias)
    torch.testing.assert_close(y1, ref, rtol=0, atol=0)
    assert torch.equal(y1, y2)
    # without a store the CPU scope is per pass: a new copy each time, none kept
    with dequantized_weights():
        layer(x)
    with dequantized_weights():
        layer(x)
    assert made == [fmt] * 3


def test_a_store_entry_pins_its_weight_so_an_address_is_never_reused_by_another():
    torch.manual_seed(1)
    store = {}
    layer = QuantLinear.from_linear(torch.nn.Linear(32, 16), "nvfp4")
    packed = next(iter(layer.quantized_tensors().values()))
    with dequantized_weights(store=store):
        quantized_linear("nvfp4", torch.randn(2, 32), layer.quantized_tensors())
    ((pinned, _),) = store.values()
    assert pinned.data_ptr() == packed.data_ptr()  # the 4-bit tensor is held, so its memory stays this weight's


def test_nested_scopes_use_the_outer_one():
    torch.manual_seed(2)
    layer = QuantLinear.from_linear(torch.nn.Linear(32, 16), "nvfp4")
    outer = {}
    with dequantized_weights(store=outer):
        with dequantized_weights(store={}):  # e.g. the engine's scope inside a caller's
            layer(torch.randn(2, 32))
    assert len(outer) == 1


def test_config_choices(tiny_dir, data_file, tmp_path):  # noqa: F811  (the imported fixture)
    cfg = load_config(None, _overrides(tiny_dir, data_file, tmp_path / "a", **{"model.dense_weights": "all"}))
    assert cfg.model.dense_weights == "all"
    assert load_config(None, _overrides(tiny_dir, data_file, tmp_path / "b")).model.dense_weights == "off"
    with pytest.raises(ConfigError, match="model.dense_weights"):
        load_config(None, _overrides(tiny_dir, data_file, tmp_path / "c", **{"model.dense_weights": "yes"}))
    with pytest.raises(ConfigError, match="model.dense_weights only makes sense"):
        load_config(None, _overrides(tiny_dir, data_file, tmp_path / "d",
                                     **{"model.dense_weights": "update", "model.format": "bf16"}))


@pytest.mark.parametrize("mode", ["update", "all"])
def test_training_with_dense_weights_equals_training_without(tiny_dir, data_file, tmp_path, mode,  # noqa: F811
                                                              monkeypatch):
    """On the CPU both paths compute with the exact dequantization, so the runs agree step for step; the store
    is filled once (one copy per quantized weight or fused sibling group) and never remade."""
    def run(out, **extra):
        cfg = load_config(None, _overrides(tiny_dir, data_file, out, steps=3, **extra))
        trainer = Trainer(cfg)
        return trainer, [trainer.train_step() for _ in range(2)]

    _, plain = run(tmp_path / "off")
    made = _counting(monkeypatch)
    trainer, dense = run(tmp_path / mode, **{"model.dense_weights": mode})
    for a, b in zip(plain, dense):
        for key in ("reward", "loss", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert "dense_weights_gb" not in plain[0]
    store = trainer.dense_store
    assert dense[-1]["dense_weights_gb"] > 0
    linears = [m for m in trainer.model.modules() if isinstance(m, QuantLinear)]
    assert 0 < len(store) <= len(linears) * 2  # the loss pass per linear; the engine's fused groups add theirs
    kept = {k: w for k, (_, w) in store.items()}
    trainer.train_step()
    assert all(store[k][1] is w for k, w in kept.items())  # the same copies, not remade
    if mode == "update":
        assert trainer.engine.dense_weights is None  # rollouts keep their own path (on the CPU: per-call copies)
    else:
        assert trainer.engine.dense_weights is store
        assert len(made) == len(store)  # every copy made exactly once over three steps


def test_a_loss_pass_with_dense_copies_issues_no_more_ops_than_bf16():
    """At small sizes the update is launch-bound: the copies must not add host work over the bf16 policy's
    linears (experiments/loss_pass_ops.py)."""
    from bench_scripts import load_experiment

    ops = load_experiment("loss_pass_ops")
    bf16, dense = ops.count_ops("bf16", 2, 8), ops.count_ops("nvfp4+dense", 2, 8)
    assert 0 < sum(dense.values()) <= sum(bf16.values())
    with pytest.raises(SystemExit, match="unknown variant"):
        ops.count_ops("nvfp4+fast", 2, 8)
