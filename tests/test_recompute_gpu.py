"""optim.gradient_checkpointing auto on CUDA (qerl.rl.recompute): the probe's bytes per token predict what the
backward really keeps, auto plans every layer plain when memory allows and every layer recomputed when it does not,
and the update is the same either way (bf16: same kernels, so within bf16 rounding of the reduction order)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from kernel_testing import require_cuda

from qerl.models import lora_parameters, quantize_model
from qerl.models.policy import enable_gradient_checkpointing
from qerl.nn import LoraConfig
from qerl.rl import recompute as recompute_module
from qerl.rl.collect import Experience
from qerl.rl.losses import LossSettings
from qerl.rl.recompute import RecomputePlan, checkpointable_layers, set_checkpointed
from qerl.rl.update import UpdateSettings, policy_update

pytestmark = pytest.mark.gpu
LAYERS = 4


def _policy(fmt: str):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=LAYERS,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().to(torch.bfloat16)
    model = quantize_model(model, fmt, LoraConfig(r=16, alpha=32))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(p.numel()))
    enable_gradient_checkpointing(model)
    return model.eval()


def _experience(groups=4, G=8, P=128, T=384, seed=0) -> Experience:
    """groups x G rows on CUDA, each group's prompt shared, completions of T/2..T tokens."""
    g = torch.Generator().manual_seed(seed)
    n = groups * G
    prompts = torch.randint(3, 1000, (groups, P), generator=g).repeat_interleave(G, 0)
    lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    tensors = (prompts, torch.ones_like(prompts, dtype=torch.bool), torch.randint(3, 1000, (n, T), generator=g), mask,
               -torch.rand(n, T, generator=g) * 3, torch.zeros(n, T), torch.zeros(n), torch.randn(n, generator=g),
               lengths, lengths == T)
    return Experience(*(t.cuda() for t in tensors))


def _update(model, exp, plan):
    params = lora_parameters(model)
    for p in params.values():
        p.grad = None
    opt = torch.optim.SGD(params.values(), lr=0.0)  # lr 0: every call starts from the same adapter
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stats = policy_update(model, exp, opt, list(params.values()),
                          UpdateSettings(LossSettings("grpo", kl_beta=0.0), max_tokens_per_micro_batch=1 << 20),
                          recompute=plan)
    peak = torch.cuda.max_memory_allocated() - before
    return stats, {k: p.grad.float().clone() for k, p in params.items()}, peak


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_auto_keeps_every_layer_plain_when_it_fits_and_the_update_is_the_same(fmt, monkeypatch):
    require_cuda()
    model, exp = _policy(fmt), _experience()
    ref, ref_g, ref_peak = _update(model, exp, RecomputePlan(model, True))
    auto = RecomputePlan(model, "auto")
    got, got_g, peak = _update(model, exp, auto)
    assert ref["recomputed_layers"] == LAYERS and got["recomputed_layers"] == 0
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-2, abs=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2)
    for k in ref_g:
        assert torch.isfinite(got_g[k]).all(), k
        err = (got_g[k] - ref_g[k]).norm() / ref_g[k].norm().clamp(min=1e-30)
        assert err < 2e-2, f"{k}: relative error {err:.3g}"
    # the probe's prediction of the extra bytes plain layers keep, against the allocator's peaks
    # one packed micro-batch: each group's prompt once + the completion tokens; checkpointed, every layer keeps its
    # input and one layer at a time is recomputed in full
    tokens = int(exp.completion_mask.sum()) + exp.prompt_ids.shape[0] // 8 * exp.prompt_ids.shape[1]
    s = auto.saved
    predicted = tokens * (LAYERS * s.plain - (LAYERS * s.checkpointed + s.plain))
    assert auto.saved.checkpointed == 1536 * 2
    assert 0.6 * predicted <= peak - ref_peak <= 1.4 * predicted, (peak - ref_peak, predicted)
    # no room (the cap below what is allocated): every layer recomputes
    monkeypatch.setattr(recompute_module, "CAP", 0.0)
    stats, _, _ = _update(model, exp, auto)
    assert stats["recomputed_layers"] == LAYERS


def test_running_out_of_memory_halves_the_plain_layers_for_good():
    """A fallback halves the plain layers of the failed plan and caps every later plan; with none plain there is
    nothing to fall back from."""
    require_cuda()
    model, exp = _policy("bf16"), _experience()
    plan = RecomputePlan(model, "auto")
    layers = checkpointable_layers(model)
    set_checkpointed(layers, LAYERS)
    plan.recomputed = 0
    assert plan.fall_back()
    assert plan.fallbacks == 1 and plan.max_plain == LAYERS // 2 and plan.recomputed == LAYERS - LAYERS // 2
    assert sum(m.gradient_checkpointing for m in layers) == LAYERS - LAYERS // 2
    stats, _, _ = _update(model, exp, plan)  # memory for all, the cap holds
    assert stats["recomputed_layers"] == LAYERS - LAYERS // 2
    set_checkpointed(layers, 0)
    plan.recomputed = LAYERS
    assert not plan.fall_back()
