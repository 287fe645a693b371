"""The CUDA path of the rollout engine: graph-captured decode == eager decode == HF generate."""

import pytest
import torch

from qerl.nn.noisy_norm import NoisyNorms
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import completions, full_forward_logprobs, hf_greedy, prompts_of, quantize_tiny, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cuda_graph_greedy_matches_hf_generate_fp32(kind):
    model = tiny_model(kind).cuda()
    prompts = prompts_of([5, 9, 3, 12, 1], seed=1)
    engine = RolloutEngine(model, max_seq_len=96, kv_block=32)  # several kv buckets in 40 steps
    assert engine.cuda_graphs
    out = engine.generate(prompts, 40, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 40)
    assert len(engine.graphs) >= 2


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cuda_graph_equals_eager_bf16_quantized_lora(fmt):
    model = quantize_tiny(tiny_model("qwen3"), fmt=fmt).cuda().to(torch.bfloat16)
    prompts = prompts_of([7, 2, 11], seed=2)
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    graph = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 48, sp, seed=3, ignore_eos=True)
    eager = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=False).generate(
        prompts, 48, sp, seed=3, ignore_eos=True)
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    torch.testing.assert_close(graph.logprobs, eager.logprobs, atol=0, rtol=0)
    ref_lp, _ = full_forward_logprobs(model, graph, 0.8)  # bf16 model: loose
    assert (graph.logprobs - ref_lp).abs().mean() < 0.05


def test_graphs_follow_in_place_lora_and_aqn_updates():
    model = quantize_tiny(tiny_model("llama"), fmt="nvfp4").cuda().to(torch.bfloat16)  # Triton path
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([6, 8], seed=5)
    greedy = SamplingParams(temperature=0)
    a = engine.generate(prompts, 16, greedy, ignore_eos=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-20)
    b = engine.generate(prompts, 16, greedy, ignore_eos=True)
    assert completions(b) != completions(a)  # bf16: HF equality is checked in fp32 above
    c = engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=0, ignore_eos=True,
                        aqn=NoisyNorms(model, 0.1, seed=0))
    d = engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)
    assert not torch.equal(c.logprobs, d.logprobs)
    # switching batch buckets re-captures into a fresh graph pool, and back again
    one = engine.generate(prompts[:1], 16, greedy, ignore_eos=True)
    two = engine.generate(prompts, 16, greedy, ignore_eos=True)
    assert one.completion_mask.all() and completions(two) == completions(b)
