"""Sibling linears stored back to back (`qerl.models.siblings`) and the engine's one-matmul-per-group path.

Real tiny Qwen2/Llama models quantized by `quantize_model` (siblings share a global scale), CPU fp32."""

import pytest
import torch

from qerl.models.convert import quantize_model
from qerl.models.siblings import fuse_sibling_storage, fused_tensors
from qerl.nn import LoraConfig, QuantLinear
from qerl.nn.quant_base import lora_disabled
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import prompts_of, quantize_tiny, tiny_model


def quantized(kind: str, fmt: str, seed: int = 0):
    model = quantize_model(tiny_model(kind, seed), fmt, LoraConfig(r=4, alpha=8))
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    return model


def qkv(model, layer=0):
    at = model.model.layers[layer].self_attn
    return at.q_proj, at.k_proj, at.v_proj


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "mxfp4"])
def test_fused_storage_keeps_every_module_and_is_one_weight(fmt):
    model = quantized("qwen2", fmt)
    mods = qkv(model)
    x = torch.randn(3, model.config.hidden_size)
    before = [m(x) for m in mods]
    dense_before = [m.dequantized_weight() for m in mods]
    sizes_before = {n: getattr(mods[0], n).shape for n in mods[0]._tensor_names}
    assert fused_tensors(mods) is None  # quantized one by one: separate storage

    assert fuse_sibling_storage(mods)
    for m, y in zip(mods, before):
        assert torch.equal(m(x), y)  # same values through the module's own forward
    assert {n: getattr(mods[0], n).shape for n in mods[0]._tensor_names} == sizes_before
    whole = fused_tensors(mods)
    assert whole is not None
    n_total = sum(m.out_features for m in mods)
    from qerl.formats import get_format

    dense = get_format(fmt).dequantize(**whole, dtype=torch.float32)
    assert dense.shape == (n_total, model.config.hidden_size)
    assert torch.equal(dense, torch.cat(dense_before))
    # no second copy: each per-row tensor of the group lives in one storage of exactly the group's size
    for name, t in whole.items():
        if t.shape[0] == n_total:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert fuse_sibling_storage(mods)  # idempotent


def test_fusion_refused_without_a_shared_global_scale_and_broken_by_a_copy():
    model = quantize_tiny(tiny_model("qwen2"), "nvfp4")  # QuantLinear.from_linear: one global scale each
    mods = qkv(model)
    ptrs = [m.weight_packed.data_ptr() for m in mods]
    assert not fuse_sibling_storage(mods)
    assert [m.weight_packed.data_ptr() for m in mods] == ptrs  # nothing moved
    assert not fuse_sibling_storage((mods[0], model.model.layers[0].self_attn.o_proj))  # different input size

    model = quantized("qwen2", "nvfp4")
    mods = qkv(model)
    assert fuse_sibling_storage(mods)
    mods[1].weight_packed = mods[1].weight_packed.clone()  # e.g. what .to() does: the layout is gone
    assert fused_tensors(mods) is None


def test_fused_model_saves_and_loads(tmp_path):
    from qerl.models import load_quantized, save_quantized

    model = quantized("qwen2", "nvfp4")
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        assert fuse_sibling_storage((at.q_proj, at.k_proj, at.v_proj))
        assert fuse_sibling_storage((mlp.gate_proj, mlp.up_proj))
    save_quantized(model, None, tmp_path / "ckpt")
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    ids = torch.randint(3, 96, (2, 7))
    with lora_disabled(model):
        ref = model(ids).logits
    assert torch.allclose(loaded(ids).logits.float(), ref.float(), atol=1e-4, rtol=1e-4)


def _generate(model, fuse, **kw):
    eng = RolloutEngine(model, max_seq_len=64, kv_block=16, fuse_siblings=fuse)
    out = eng.generate(prompts_of([5, 9, 3]), 12, SamplingParams(temperature=1.0), seed=3, **kw)
    # the fused path is taken for every q/k/v and gate/up group exactly when asked for
    assert len(eng.runner.lora.fused) == (2 * len(model.model.layers) if fuse else 0)
    return out


@pytest.mark.parametrize("kind,fmt", [("qwen2", "nvfp4"), ("llama", "bf16")])
def test_engine_with_fused_groups_samples_the_same(kind, fmt):
    """One base matmul + one block-diagonal LoRA product per group gives the tokens and log-probs of the
    per-module path (fp32, CPU: equal up to summation order)."""
    ref = _generate(quantized(kind, fmt), fuse=False)
    model = quantized(kind, fmt)
    out = _generate(model, fuse=True)
    assert fused_tensors(qkv(model)) is not None  # the engine did fuse
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert torch.allclose(out.logprobs, ref.logprobs, atol=1e-4)
    # one member's adapter off: its block of the fused LoRA product must be zero, the others unchanged
    model.model.layers[0].self_attn.k_proj.lora_enabled = False
    ref_model = quantized(kind, fmt)
    ref_model.model.layers[0].self_attn.k_proj.lora_enabled = False
    a, b = _generate(model, fuse=True), _generate(ref_model, fuse=False)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_fused_groups_on_gpu_match_separate_linears(fmt):
    """bf16 on CUDA through the real decode kernels (K = 256: the Gluon kernel for NVFP4, with the LoRA
    term in its epilogue) and CUDA graphs: the fused engine follows the per-module one."""
    from kernel_testing import require_cuda
    from transformers import AutoModelForCausalLM, Qwen2Config

    require_cuda()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    model = quantize_model(model, fmt, LoraConfig(r=16, alpha=32))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    model = model.cuda().to(torch.bfloat16)
    prompts = prompts_of([5, 9, 3, 7], vocab=128)
    greedy = SamplingParams(temperature=0.0)
    sep = RolloutEngine(model, max_seq_len=64, kv_block=16, fuse_siblings=False).generate(prompts, 6, greedy)
    eng = RolloutEngine(model, max_seq_len=64, kv_block=16, fuse_siblings=True)
    fused = eng.generate(prompts, 6, greedy)
    assert len(eng.runner.lora.fused) == 4
    assert torch.equal(fused.completion_ids[:, :3], sep.completion_ids[:, :3])
    lp_f, lp_s = fused.logprobs[:, :3], sep.logprobs[:, :3]
    assert not torch.isnan(lp_f).any() and (lp_f - lp_s).abs().max().item() < 0.05
