"""Model surgery: which layers become quantized, what stays 16-bit, what trains, and the memory it takes."""

import json

import pytest
import torch
from tiny import tiny_model

from qerl.formats import get_format
from qerl.models import dequantize_model, lora_parameters, memory_report, quant_layers, quantize_model, save_quantized
from qerl.models.surgery import shared_global_scales
from qerl.models.targets import find_targets
from qerl.nn import DEFAULT_TARGETS, LoraConfig, QuantLinear

# Stored bits per weight, scales included: NVFP4 4 + 8/16 (+ one fp32 per tensor), MXFP4 4 + 8/32,
# NF4 4 + 32/64 (fp32 absmax per 64, no double quantization).
BYTES_PER_WEIGHT = {"nvfp4": 4.5 / 8, "mxfp4": 4.25 / 8, "nf4": 4.5 / 8}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_memory_per_weight(fmt):
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt)
    report = memory_report(model)
    n_layers = 2 * len(DEFAULT_TARGETS)
    extra = 4 * n_layers if fmt == "nvfp4" else 0  # the fp32 global scale of each tensor
    assert report["quantized_bytes"] == report["quantized_params"] * BYTES_PER_WEIGHT[fmt] + extra
    assert report["lora_bytes"] == 0


def test_only_lora_trains_and_the_rest_stays_16_bit():
    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16), "nvfp4", LoraConfig(r=4, alpha=8))
    layers = quant_layers(model)
    assert len(layers) == 2 * len(DEFAULT_TARGETS)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and trainable
    assert all(p.dtype == torch.float32 for p in lora_parameters(model).values())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert not isinstance(model.lm_head, QuantLinear)
    for layer in layers.values():  # the packed tensors are the only copy of the base weight
        assert not any(t.shape == (layer.out_features, layer.in_features) for t in layer.buffers())
        assert all(not t.requires_grad for t in layer.buffers())


def test_lora_gradients_flow_and_base_gets_none():
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    ids = torch.randint(3, 150, (2, 11), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in lora_parameters(model).items():
        if "lora_B" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(t.grad is None for layer in quant_layers(model).values() for t in layer.buffers())


def test_fused_siblings_share_the_smallest_global_scale():
    model = tiny_model("llama")
    linears = find_targets(model, DEFAULT_TARGETS)
    own = {n: get_format("nvfp4").global_scale(lin.weight) for n, lin in linears.items()}
    shared = shared_global_scales(linears, "nvfp4")
    attn = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    assert shared[attn[0]] == shared[attn[1]] == shared[attn[2]] == min(own[a] for a in attn[:3])
    assert shared[attn[3]] == own[attn[3]]  # o_proj is not fused with anything
    mlp = [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert shared[mlp[0]] == shared[mlp[1]] == min(own[mlp[0]], own[mlp[1]])
    assert shared[mlp[2]] == own[mlp[2]]
    assert shared_global_scales(linears, "mxfp4") == {}


def test_target_subset_and_ignore_list(tmp_path):
    model = quantize_model(tiny_model("mistral", dtype=torch.bfloat16), "nvfp4", targets=["q_proj", "v_proj"])
    assert {n.rsplit(".", 1)[-1] for n in quant_layers(model)} == {"q_proj", "v_proj"}
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    save_quantized(model, None, tmp_path / "q")
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "lm_head" in ignore and "model.layers.0.self_attn.k_proj" in ignore
    assert "model.layers.0.self_attn.q_proj" not in ignore


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "bf16"])
def test_quantized_model_equals_its_dequantized_dense_twin(fmt):
    ids = torch.randint(3, 150, (2, 13), generator=torch.Generator().manual_seed(2))
    model = quantize_model(tiny_model("qwen3"), fmt, LoraConfig(r=4, alpha=8))  # B = 0: adapter is a no-op
    dense = dequantize_model(quantize_model(tiny_model("qwen3"), fmt))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_quantization_changes_logits_but_not_by_much():
    ids = torch.randint(3, 150, (2, 13), generator=torch.Generator().manual_seed(3))
    dense = tiny_model("llama")
    with torch.no_grad():
        ref = torch.log_softmax(dense(input_ids=ids).logits, -1)
        quant = torch.log_softmax(quantize_model(dense, "nvfp4")(input_ids=ids).logits, -1)
    kl = (ref.exp() * (ref - quant)).sum(-1).mean()
    assert 0 < kl < 0.05
