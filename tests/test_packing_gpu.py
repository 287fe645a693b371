"""The packed loss pass on CUDA against the padded one, at the sizes of a real GSM8K step (segments of hundreds
of tokens, head dim 128, several micro-batches): fp32 equal within rounding, bf16 gradients finite and close."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from kernel_testing import require_cuda

from qerl.models import lora_parameters, quantize_model
from qerl.models.policy import enable_gradient_checkpointing
from qerl.nn import LoraConfig
from qerl.rl.logprobs import completion_logprobs
from qerl.rl.packing import packed_logprobs, plan_micro_batches

pytestmark = pytest.mark.gpu


def _batch(groups=16, G=8, P=200, T=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    pid, pm, lens = [], [], []
    for _ in range(groups):
        lp = int(torch.randint(60, P, (1,), generator=g))
        prompt = torch.randint(3, 1000, (lp,), generator=g)
        for _ in range(G):
            pid.append(torch.cat([torch.zeros(P - lp, dtype=torch.long), prompt]))
            pm.append(torch.arange(P) >= P - lp)
            lens.append(int(torch.randint(1, T + 1, (1,), generator=g)))
    cid = torch.randint(3, 1000, (len(lens), T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor(lens)[:, None]
    return tuple(t.cuda() for t in (torch.stack(pid), torch.stack(pm), cid, mask))


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_pass_equals_padded_on_cuda(dtype, attention):
    require_cuda()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=1536, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().to(dtype)
    model = quantize_model(model, "bf16", LoraConfig(r=16, alpha=32))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.02)
    enable_gradient_checkpointing(model)
    model.train()
    batch = _batch()
    w = torch.randn(batch[2].shape, device="cuda") * batch[3]

    def run(fn):
        model.zero_grad(set_to_none=True)
        logp = fn()
        (logp * w).sum().backward()
        return logp.detach(), {n: p.grad.float() for n, p in lora_parameters(model).items()}

    ref_lp, ref_g = run(lambda: completion_logprobs(model, *batch))
    plan = plan_micro_batches(*batch, 8192, attention)
    assert len(plan) > 2
    lp, grads = run(lambda: torch.cat([packed_logprobs(model, mb, batch[2]) for mb in plan]))
    assert all(torch.isfinite(g).all() for g in grads.values()), "non-finite LoRA gradient"
    tol = 1e-3 if dtype == torch.float32 else 0.1
    assert (lp - ref_lp).abs().max() < (1e-3 if dtype == torch.float32 else 0.5)
    for name, g in grads.items():
        assert (g - ref_g[name]).norm() <= tol * ref_g[name].norm(), name
