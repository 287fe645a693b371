"""Tiny random mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with its shared expert) for fast CPU tests."""

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


def tiny_moe_config(arch: str, **overrides):
    kw = dict(vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{**kw, "head_dim": 16, **overrides})
    return Qwen2MoeConfig(**{**kw, "shared_expert_intermediate_size": 64, **overrides})


def tiny_moe(arch: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A random model whose routing is decisive (router std 0.5) and depends on the experts (std 0.2). Built in
    `dtype` (not cast after: that would also cast the rotary inv_freq, which a loaded model rebuilds in fp32)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and "shared" not in name:
                p.normal_(0, 0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    return model.eval()


@torch.no_grad()
def fill_dense_twin(reference, quantized):
    """Give `reference` (a dense copy of the model before quantization) the base `quantized` computes with: every
    QuantLinear's dequantized weight and every layer's dequantized experts; returns reference."""
    from qerl.models import quant_layers
    from qerl.models.experts import dequantize_experts_into

    for name, layer in quant_layers(quantized).items():
        reference.get_submodule(name).weight.copy_(layer.dequantized_weight(torch.float32))
    for layer_r, layer_q in zip(reference.model.layers, quantized.model.layers):
        dequantize_experts_into(layer_r.mlp.experts, layer_q.mlp.experts)
    return reference
