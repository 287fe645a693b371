"""optim.gradient_checkpointing (qerl.rl.recompute): the plan's arithmetic, the saved-bytes probe on real tiny
models, and policy updates whose every mix of recomputed and plain layers gives the same loss, grad norm and LoRA
gradients (fp32 on the CPU: the recomputed forward is the same arithmetic, so they agree to rounding, rel 1e-5)."""

import pytest
import torch
from test_packing import T, _experience, assert_rel_close, make_batch
from tiny import tiny_model

from qerl.config import ConfigError, load_config
from qerl.models import lora_parameters, quantize_model
from qerl.models.policy import enable_gradient_checkpointing
from qerl.nn import LoraConfig
from qerl.rl.losses import LossSettings
from qerl.rl.packing import packed_logprobs, plan_micro_batches
from qerl.rl.recompute import (CAP, RecomputePlan, SavedBytes, budget_bytes, checkpointable_layers, plain_layers,
                               probe_saved_bytes, set_checkpointed)
from qerl.rl.update import UpdateSettings, policy_update

LAYERS = 3


def policy(arch="llama", fmt="nvfp4", checkpointable=True, **overrides):
    model = quantize_model(tiny_model(arch, num_hidden_layers=LAYERS, **overrides), fmt, LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    if checkpointable:
        enable_gradient_checkpointing(model)
    return model


def stream_forward(model):
    """forward(n): the packed loss pass's log-probs of one row of n tokens (4 prompt tokens)."""
    def forward(n):
        ids = (torch.arange(n) * 7 % 150 + 3)[None]
        prompt, completion = ids[:, :4], ids[:, 4:]
        ones = lambda t: torch.ones_like(t, dtype=torch.bool)  # noqa: E731
        mb = plan_micro_batches(prompt, ones(prompt), completion, ones(completion), n)[0]
        return packed_logprobs(model, mb, completion)
    return forward


@pytest.mark.parametrize("tokens,saved,budget,expected", [
    # base = tokens x (layers x checkpointed + plain) = 100 x (3 x 10 + 50) = 8000; each plain layer adds 4000
    (100, SavedBytes(50, 10), 8000, 0),
    (100, SavedBytes(50, 10), 11999, 0),
    (100, SavedBytes(50, 10), 12000, 1),
    (100, SavedBytes(50, 10), 20000, 3),
    (100, SavedBytes(50, 10), 10**12, 3),  # never more than the layers
    (100, SavedBytes(50, 10), -5, 0),  # a negative budget (less free than the margin): recompute everything
    (100, SavedBytes(10, 10), 0, 3),  # nothing to save by recomputing
    (0, SavedBytes(50, 10), 0, 3),  # no token to forward
])
def test_plain_layers_fill_the_budget(tokens, saved, budget, expected):
    assert plain_layers(LAYERS, tokens, saved, budget) == expected


GiB = 2**30


@pytest.mark.parametrize("free,reserved,allocated,expected", [
    (60 * GiB, 10 * GiB, 8 * GiB, 58 * GiB),  # the cap binds: 0.85 x 80 - 8 - 2 (margin)
    (10 * GiB, 10 * GiB, 8 * GiB, 10 * GiB),  # another process holds the card: free + cached - margin
    (0, 70 * GiB, 70 * GiB, -4 * GiB),  # over the cap already: negative, so every layer recomputes
])
def test_the_budget_is_the_smaller_of_the_cap_and_what_is_free(free, reserved, allocated, expected):
    assert budget_bytes(80 * GiB, free, reserved, allocated, CAP) == pytest.approx(expected, abs=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_probe_measures_what_a_layer_keeps_per_token(arch):
    """Checkpointed: the layer's fp32 input, hidden x 4 bytes. Plain: far more, and growing with the MLP's width by at
    least what its two projections' outputs take (gate and up, fp32). The flags are restored."""
    model = policy(arch)
    model.train()
    layers = checkpointable_layers(model)
    set_checkpointed(layers, 1)
    before = [m.gradient_checkpointing for m in layers]
    small = probe_saved_bytes(model, stream_forward(model))
    assert [m.gradient_checkpointing for m in layers] == before
    assert small.checkpointed == 64 * 4
    assert small.plain > 8 * small.checkpointed
    wide = policy(arch, intermediate_size=256)
    wide.train()
    larger = probe_saved_bytes(wide, stream_forward(wide))
    assert larger.plain - small.plain >= 2 * 128 * 4
    assert larger.checkpointed == small.checkpointed


@pytest.mark.parametrize("plain", [0, 1, LAYERS])
def test_any_mix_of_recomputed_layers_gives_the_same_update(plain):
    """KL to the reference, two updates (old log-probs pass), TIS; packed micro-batches cut across groups. The
    reference: no layer checkpointable at all."""
    exp = _experience(make_batch(seed=4))
    s = UpdateSettings(LossSettings("grpo", 0.2, 0.28, 0.05, T), num_updates=2, max_grad_norm=1e9,
                       max_tokens_per_micro_batch=20)
    results = []
    for checkpointable in (False, True):
        model = policy(checkpointable=checkpointable)
        if checkpointable:
            set_checkpointed(checkpointable_layers(model), plain)
        params = lora_parameters(model)
        opt = torch.optim.SGD(params.values(), lr=0.5)
        stats = policy_update(model, exp, opt, list(params.values()), s)
        results.append((stats, {k: v.grad.clone() for k, v in params.items()},
                        {k: v.detach().clone() for k, v in params.items()}))
    (ref, ref_g, ref_p), (got, got_g, got_p) = results
    for k in ("loss", "kl", "ratio_mean", "grad_norm"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-8), k
    for k in ref_g:
        assert ref_g[k].abs().max() > 0, k
        assert_rel_close(got_g[k], ref_g[k], what=k)
        assert_rel_close(got_p[k], ref_p[k], rel=1e-6, what=k)


@pytest.mark.parametrize("mode,recomputed", [(True, LAYERS), (False, 0), ("auto", LAYERS)])
def test_the_plan_sets_the_layers_and_reports_them(mode, recomputed):
    """On the CPU auto recomputes every layer (no device memory count); the update reports the plan."""
    exp = _experience(make_batch(seed=1))
    model = policy(checkpointable=mode is not False)
    plan = RecomputePlan(model, mode)
    assert not plan.adaptive
    params = lora_parameters(model)
    stats = policy_update(model, exp, torch.optim.SGD(params.values(), lr=0.1), list(params.values()),
                          UpdateSettings(LossSettings("grpo")), recompute=plan)
    assert stats["recomputed_layers"] == recomputed
    assert sum(m.gradient_checkpointing for m in checkpointable_layers(model)) == recomputed
    assert not plan.fall_back()  # nothing to fall back from


def test_the_plan_refuses_bad_modes_and_leaves_models_without_checkpointable_layers_alone():
    with pytest.raises(ValueError, match="one of"):
        RecomputePlan(policy(), "sometimes")
    exp = _experience(make_batch(seed=1))
    model = policy(checkpointable=False)
    plan = RecomputePlan(model, "auto")
    params = lora_parameters(model)
    stats = policy_update(model, exp, torch.optim.SGD(params.values(), lr=0.1), list(params.values()),
                          UpdateSettings(LossSettings("grpo")), recompute=plan)
    assert plan.recomputed is None and "recomputed_layers" not in stats and not plan.fall_back()


def test_the_config_takes_auto_true_and_false():
    assert load_config(None, []).optim.gradient_checkpointing == "auto"
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        got = load_config(None, [f"optim.gradient_checkpointing={text}"]).optim.gradient_checkpointing
        assert got == value and type(got) is type(value)
    for bad in ("sometimes", "1"):
        with pytest.raises(ConfigError, match="optim.gradient_checkpointing"):
            load_config(None, [f"optim.gradient_checkpointing={bad}"])


def test_resume_may_change_the_checkpointing_mode():
    """It changes time and memory, not the math: a future-only key."""
    from qerl.rl.checkpointing import FUTURE_ONLY_KEYS

    assert "optim.gradient_checkpointing" in FUTURE_ONLY_KEYS
