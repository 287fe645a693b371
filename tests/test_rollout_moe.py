"""Rollout engine on tiny random mixture-of-experts models (Qwen3-MoE, Qwen2-MoE; CPU, fp32): greedy == HF
generate with NVFP4 attention + LoRA and NVFP4 or 16-bit experts, under both schedulers with refills; mixed
dense / MoE layers; sampled log-probs == a full forward; AQN sampling; CUDA graphs switched off for MoE."""

import pytest
import torch

from qerl.models import lora_parameters, quantize_model
from qerl.nn import LoraConfig
from qerl.nn.noisy_norm import NoisyNorms
from qerl.nn.quant_experts import QuantExperts
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import completions, full_forward_logprobs, hf_greedy, prompts_of

transformers = pytest.importorskip("transformers")
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

GREEDY = SamplingParams(temperature=0)
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, experts_implementation="eager")


def tiny_moe(kind: str = "qwen3_moe", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "qwen3_moe":  # q_norm/k_norm, head_dim != hidden / heads
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**COMMON, "head_dim": 32, **overrides}))
    else:  # q/k/v bias, a gated shared expert beside the routed ones
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**COMMON, "shared_expert_intermediate_size": 64, **overrides}))
    model = model.float().eval()
    with torch.no_grad():  # larger than the init so that routing and outputs depend on every part
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    return model


def quantized(model: torch.nn.Module, experts: bool = True, seed: int = 1) -> torch.nn.Module:
    """NVFP4 linears with a non-zero LoRA (B random, so the adapter matters); experts NVFP4 or left dense."""
    quantize_model(model, "nvfp4", lora=LoraConfig(r=4, alpha=8), experts=experts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.mark.parametrize("experts", [True, False], ids=["nvfp4-experts", "dense-experts"])
def test_greedy_matches_hf_generate_qwen3_moe_both_schedulers(experts):
    """Width 2 for 3 prompts of different lengths with forced ragged lengths: the continuous scheduler
    refills a row mid-decode; every completion equals HF's greedy one under both schedulers."""
    model = quantized(tiny_moe("qwen3_moe"), experts=experts)
    assert all(isinstance(layer.mlp.experts, QuantExperts) == experts for layer in model.model.layers)
    prompts = prompts_of([5, 11, 3], seed=3)
    lengths = [12, 4, 9]
    ref = [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)]
    for mode in ("static", "continuous"):
        engine = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2, scheduler=mode)
        assert engine.runner.moe_layers == [True, True] and not engine.cuda_graphs
        out = engine.generate(prompts, 12, GREEDY, force_lengths=lengths)
        assert completions(out) == ref, mode


def test_greedy_matches_hf_generate_qwen2_moe_shared_expert():
    model = quantized(tiny_moe("qwen2_moe"))
    prompts = prompts_of([4, 9, 6], seed=5)
    out = RolloutEngine(model, max_seq_len=64).generate(prompts, 12, GREEDY, ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 12)


def test_mixed_dense_and_moe_layers():
    """mlp_only_layers=[1]: layer 1 is a dense gate/up/down MLP (quantized, with LoRA, through the engine's
    own MLP path), layer 0 a sparse-MoE block."""
    model = quantized(tiny_moe("qwen3_moe", mlp_only_layers=[1]))
    engine = RolloutEngine(model, max_seq_len=64)
    assert engine.runner.moe_layers == [True, False]
    dense = model.model.layers[1].mlp
    assert engine.runner.lora.index.keys() >= {id(dense.gate_proj), id(dense.up_proj), id(dense.down_proj)}
    prompts = prompts_of([7, 3], seed=8)
    out = engine.generate(prompts, 10, GREEDY, ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 10)


def test_sampled_logprobs_match_full_forward():
    model = quantized(tiny_moe("qwen3_moe"))
    engine = RolloutEngine(model, max_seq_len=64)
    out = engine.generate(prompts_of([3, 10], seed=7), 12, SamplingParams(temperature=0.7), seed=0, ignore_eos=True)
    lp, ent = full_forward_logprobs(model, out, 0.7)
    torch.testing.assert_close(out.logprobs, lp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out.entropies, ent, atol=2e-4, rtol=1e-4)


def test_aqn_sampling_runs_and_restores_the_norms():
    model = quantized(tiny_moe("qwen3_moe"))
    engine = RolloutEngine(model, max_seq_len=64)
    norms = [layer.post_attention_layernorm.weight.clone() for layer in model.model.layers]
    prompts = prompts_of([4, 8, 6], seed=9)
    sp = SamplingParams(temperature=1.0)
    for per_forward in (False, True):
        out = engine.generate(prompts, 10, sp, seed=0, ignore_eos=True,
                              aqn=NoisyNorms(model, 0.05, per_forward=per_forward, seed=1))
        assert out.completion_mask.all()
        assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()
        assert torch.isfinite(out.entropies).all()
    for layer, w in zip(model.model.layers, norms):
        assert torch.equal(layer.post_attention_layernorm.weight, w)
    # the noise is applied (and feeds the MoE blocks through post_attention_layernorm): greedy changes
    clean = completions(engine.generate(prompts, 10, GREEDY, ignore_eos=True))
    noisy = completions(engine.generate(prompts, 10, GREEDY, ignore_eos=True, aqn=NoisyNorms(model, 2.0, seed=2)))
    assert noisy != clean


def test_cuda_graphs_are_switched_off_for_moe_with_a_warning():
    model = tiny_moe("qwen3_moe")
    with pytest.warns(UserWarning, match="MoE experts .* without CUDA graphs"):
        engine = RolloutEngine(model, max_seq_len=32, cuda_graphs=True)
    assert engine.cuda_graphs is False
    engine.warmup(2)  # a no-op without graphs
    assert engine.graphs == {}
