"""optim.fused_loss on CUDA (qerl.rl.fused_loss): the compiled decoder layers (inductor, Triton code generated for
the elementwise chains; the quantized products still the Triton / Gluon kernels, through the custom op) give the
eager update within bf16 rounding: the fused kernels round intermediate results differently (e.g. RMSNorm in one
pass), so the agreement is a bf16 tolerance, as between the recompute plans (tests/test_recompute_gpu.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from kernel_testing import require_cuda

from qerl.models import lora_parameters, quantize_model
from qerl.models.policy import enable_gradient_checkpointing
from qerl.nn import LoraConfig
from qerl.nn.noisy_norm import NoisyNorms
from qerl.rl.collect import Experience
from qerl.rl.losses import LossSettings
from qerl.rl.recompute import checkpointable_layers, set_checkpointed
from qerl.rl.update import UpdateSettings, policy_update

pytestmark = pytest.mark.gpu


def _policy(fmt: str):
    """A 2-layer Qwen2 of 1.5B-like widths' divisibility (K % 128 == 0: the Gluon / Triton NVFP4 paths), bf16."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().to(torch.bfloat16)
    model = quantize_model(model, fmt, LoraConfig(r=16, alpha=32))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(p.numel()))
    enable_gradient_checkpointing(model)
    set_checkpointed(checkpointable_layers(model), 1)  # layer 0 recomputes around its compiled forward
    return model.eval()


def _experience(groups=3, G=4, P=64, T=200, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    n = groups * G
    prompts = torch.randint(3, 1000, (groups, P), generator=g).repeat_interleave(G, 0)
    lengths = torch.randint(T // 4, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    tensors = (prompts, torch.ones_like(prompts, dtype=torch.bool), torch.randint(3, 1000, (n, T), generator=g), mask,
               -torch.rand(n, T, generator=g) * 3, torch.zeros(n, T), torch.zeros(n), torch.randn(n, generator=g),
               lengths, lengths == T)
    return Experience(*(t.cuda() for t in tensors))


def _update(model, exp, fused: bool, sigma: float):
    params = lora_parameters(model)
    for p in params.values():
        p.grad = None
    opt = torch.optim.SGD(params.values(), lr=0.0)  # lr 0: both calls start from the same adapter
    s = UpdateSettings(LossSettings("grpo", 0.2, 0.28, 0.05, exp.completion_ids.shape[1]),
                       max_tokens_per_micro_batch=700, fused_loss=fused)  # several micro-batches, other lengths
    with NoisyNorms(model, sigma, seed=0):
        stats = policy_update(model, exp, opt, list(params.values()), s)
    return stats, {k: p.grad.float().clone() for k, p in params.items()}


@pytest.mark.parametrize("fmt,sigma", [("bf16", 0.0), ("nvfp4", 1e-2)])
def test_the_fused_update_agrees_with_the_eager_one_on_cuda(fmt, sigma):
    require_cuda()
    model, exp = _policy(fmt), _experience()
    ref, ref_g = _update(model, exp, False, sigma)
    got, got_g = _update(model, exp, True, sigma)
    again, again_g = _update(model, _experience(seed=1), True, sigma)  # other lengths: runs (no recompile needed)
    assert all(torch.isfinite(g).all() for g in again_g.values())
    for k in ("loss", "kl", "ratio_mean"):
        assert got[k] == pytest.approx(ref[k], rel=2e-2, abs=1e-4), k
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2)
    for k in ref_g:
        assert ref_g[k].abs().max() > 0, k
        err = (got_g[k] - ref_g[k]).norm() / ref_g[k].norm().clamp(min=1e-30)
        assert err < 2e-2, f"{k}: relative error {err:.3g}"
