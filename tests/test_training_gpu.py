"""The training path on the GPU: LoRA gradients through Triton NVFP4/MXFP4 layers equal those of the
plain-torch reference path (QERL_DISABLE_TRITON=1), at SmolLM2-135M's shapes (K = 576, N = 192 for k/v),
for loss-pass sizes (dequantize + cuBLAS) and decode-like sizes (fused kernels)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from qerl.models import lora_parameters, quantize_model
from qerl.nn import LoraConfig
from qerl.rl.logprobs import completion_logprobs

pytestmark = pytest.mark.gpu

SMOL = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0)


def _policy(fmt: str):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOL), dtype=torch.bfloat16)
    quantize_model(model, fmt, LoraConfig(r=8, alpha=16))
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _grads(model, batch: int, prompt: int, completion: int):
    g = torch.Generator().manual_seed(batch * 1000 + completion)
    pids = torch.randint(1, 4096, (batch, prompt), generator=g).cuda()
    cids = torch.randint(1, 4096, (batch, completion), generator=g).cuda()
    pmask = torch.ones_like(pids, dtype=torch.bool)
    cmask = torch.ones_like(cids, dtype=torch.bool)
    params = lora_parameters(model)
    for p in params.values():
        p.grad = None
    model.train()
    logp = completion_logprobs(model, pids, pmask, cids, cmask)
    weights = torch.randn(logp.shape, generator=g).cuda()
    (logp * weights).sum().backward()
    return logp.detach(), {k: p.grad.detach().clone() for k, p in params.items()}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("batch,prompt,completion", [(16, 60, 128), (1, 5, 6)])
def test_lora_gradients_through_triton_equal_reference(fmt, batch, prompt, completion, monkeypatch):
    model = _policy(fmt)
    logp, grads = _grads(model, batch, prompt, completion)
    monkeypatch.setenv("QERL_DISABLE_TRITON", "1")
    ref_logp, ref_grads = _grads(model, batch, prompt, completion)
    assert torch.isfinite(logp).all()
    torch.testing.assert_close(logp, ref_logp, atol=0.05, rtol=0.02)
    worst = max(float((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm().clamp(min=1e-30)) for k in grads)
    assert worst < 0.03, worst
