"""model.dense_weights on CUDA: rollouts under CUDA graphs and the loss pass with kept 16-bit weight copies."""

import pytest
import torch

from qerl.formats import get_format
from qerl.kernels import dequantized_weights, quantized_linear
from qerl.kernels.dequant_cache import cached_dense_weight
from qerl.kernels.route import kernel_policy
from qerl.nn import QuantLinear
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import prompts_of, quantize_tiny, tiny_model
from test_training_gpu import _grads, _policy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_graph_rollouts_with_dense_copies(fmt):
    model = quantize_tiny(tiny_model("qwen3"), fmt=fmt).cuda().to(torch.bfloat16)
    prompts = prompts_of([7, 2, 11], seed=2)
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    store = {}
    dense = RolloutEngine(model, max_seq_len=96, kv_block=32, dense_weights=store)
    assert dense.cuda_graphs
    with kernel_policy(dense_min_m=1):  # the copies at every row count, decode steps included
        a = dense.generate(prompts, 48, sp, seed=3, ignore_eos=True)
    kept = {k: w for k, (_, w) in store.items()}
    assert kept and all(w.is_cuda and w.dtype == torch.bfloat16 for w in kept.values())
    with kernel_policy(dense_min_m=1):
        b = dense.generate(prompts, 48, sp, seed=3, ignore_eos=True)  # replayed graphs read the kept copies
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert all(store[k][1] is w for k, w in kept.items())
    plain = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 48, sp, seed=3, ignore_eos=True)
    if fmt == "nf4":  # the plain NF4 path is the same dequantize-then-matmul, once per call
        assert torch.equal(a.completion_ids, plain.completion_ids)
        torch.testing.assert_close(a.logprobs, plain.logprobs, atol=0, rtol=0)
    else:  # the NVFP4 kernel accumulates the same weights in another order (bf16 rounding, then paths part)
        greedy = SamplingParams(temperature=0)
        engine = RolloutEngine(model, max_seq_len=96, kv_block=32, dense_weights=store)
        with kernel_policy(dense_min_m=1):
            g1 = engine.generate(prompts, 4, greedy, ignore_eos=True)
        g2 = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 4, greedy, ignore_eos=True)
        torch.testing.assert_close(g1.logprobs[:, 0], g2.logprobs[:, 0], atol=0.05, rtol=0)  # the same first step


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_kept_copy_is_read_from_dense_min_m_rows_and_the_4bit_kernels_below(fmt):
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(256, 384), fmt).cuda()
    tensors = layer.quantized_tensors()
    x = torch.randn(24, 256, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ get_format(fmt).dequantize(**tensors, dtype=torch.float32).t()
    store = {}
    with dequantized_weights(store=store), kernel_policy(dense_min_m=16):
        few = quantized_linear(fmt, x[:15], tensors, layer.bias)
        assert not store  # 15 rows: the 4-bit kernels, no copy made
        many = quantized_linear(fmt, x, tensors, layer.bias)
        assert len(store) == 1  # from 16 rows the kept copy
    bias = layer.bias.float()
    assert torch.isfinite(few).all() and torch.isfinite(many).all()
    torch.testing.assert_close(few.float(), ref[:15] + bias, atol=0.05, rtol=0.02)
    torch.testing.assert_close(many.float(), ref + bias, atol=0.05, rtol=0.02)


def test_a_copy_is_never_made_inside_a_graph_capture():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 32), "nvfp4").cuda()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with dequantized_weights(store={}), pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            cached_dense_weight("nvfp4", layer.quantized_tensors(), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_loss_pass_gradients_with_dense_copies_equal_the_4bit_path(fmt):
    model = _policy(fmt)
    logp, grads = _grads(model, 4, 20, 33)
    store = {}
    with dequantized_weights(store=store):
        logp_d, grads_d = _grads(model, 4, 20, 33)
    assert store
    torch.testing.assert_close(logp_d, logp, atol=0.05, rtol=0.02)
    for k in grads:
        rel = (grads_d[k].float() - grads[k].float()).norm() / grads[k].float().norm().clamp(min=1e-12)
        assert rel < 0.05, (k, float(rel))  # bf16 rounding of two accumulation orders
