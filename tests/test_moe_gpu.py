"""Mixture-of-experts on the GPU: the rollout engine's eager MoE decode (NVFP4 experts dequantized per call on
CUDA) equals HF generate in fp32; in bf16 the grouped experts kernel lets the engine capture MoE decode steps in
CUDA graphs, whose tokens equal the same engine's eager decode; `qerl train` runs a tiny Qwen3-MoE / Qwen2-MoE
checkpoint on CUDA."""

import pytest
import torch

from qerl.config import load_config
from qerl.nn.quant_experts import QuantExperts
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer
from qerl.rollout.engine import RolloutEngine

from test_rollout_engine import completions, hf_greedy, prompts_of
from test_rollout_moe import GREEDY, quantized, tiny_moe
from test_train_e2e import _overrides, data_file  # noqa: F401  (a fixture)
from test_train_moe import moe_dir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_moe_greedy_on_cuda_matches_hf_generate_fp32(kind):
    model = quantized(tiny_moe(kind)).cuda()
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)
    prompts = prompts_of([5, 11, 3], seed=3)
    with pytest.warns(UserWarning, match="without CUDA graphs"):
        engine = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2)
    lengths = [12, 4, 9]
    out = engine.generate(prompts, 12, GREEDY, force_lengths=lengths)
    ref = [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)]
    assert completions(out) == ref


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "nvfp4"), ("qwen2_moe", "mxfp4")])
def test_moe_decode_in_cuda_graphs_equals_eager_bf16(kind, fmt):
    from qerl.models import quantize_model
    from qerl.nn import LoraConfig

    model = quantize_model(tiny_moe(kind), fmt, lora=LoraConfig(r=4, alpha=8), experts=True)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    prompts = prompts_of([5, 11, 3, 7, 2], seed=4)
    lengths = [12, 4, 9, 1, 7]
    graphs = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2)  # refills under the continuous one
    assert graphs.cuda_graphs and graphs.runner.moe_capturable
    eager = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2, cuda_graphs=False)
    got = completions(graphs.generate(prompts, 12, GREEDY, force_lengths=lengths))
    assert graphs.graphs, "no decode step was captured"
    assert got == completions(eager.generate(prompts, 12, GREEDY, force_lengths=lengths))


def test_train_a_moe_checkpoint_on_cuda(moe_dir, data_file, tmp_path):  # noqa: F811
    cfg = load_config(None, _overrides(moe_dir, data_file, tmp_path / "run", steps=2, **{"model.device": "cuda"}))
    Trainer(cfg).train()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([m["reward"], m["entropy"], m["loss"]])).all() for m in metrics)
