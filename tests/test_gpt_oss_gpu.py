"""gpt-oss on the GPU (tiny random configs): the rollout engine's decode (attention sinks and sliding windows
through SDPA with a float mask, MoE blocks eager) equals HF generate in fp32; the packed loss pass with sinks
equals the padded eager path on CUDA's SDPA backends; the grouped 4-bit experts kernel with gpt-oss's biases
and clamped SwiGLU is close to the reference loop; `qerl train` runs two steps on an MXFP4 checkpoint."""

import json

import pytest
import torch

from qerl.config import load_config
from qerl.models import lora_parameters, quantize_model
from qerl.nn import LoraConfig
from qerl.nn.quant_experts_gpt_oss import GptOssQuantExperts
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer
from qerl.rollout.engine import RolloutEngine

from test_gpt_oss import E, H, mxfp4_dir, tiny_gpt_oss  # noqa: F401  (mxfp4_dir: a fixture)
from test_rollout_engine import completions, hf_greedy, prompts_of
from test_rollout_moe import GREEDY, quantized
from test_train_e2e import _overrides

pytestmark = pytest.mark.gpu


def test_greedy_on_cuda_matches_hf_generate_fp32():
    model = quantized(tiny_gpt_oss()).cuda()
    prompts = prompts_of([5, 11, 3], seed=3)
    with pytest.warns(UserWarning, match="without CUDA graphs"):
        engine = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2)
    lengths = [12, 4, 9]
    out = engine.generate(prompts, 12, GREEDY, force_lengths=lengths)
    ref = [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)]
    assert completions(out) == ref


def test_packed_sinks_on_cuda_equal_the_padded_eager_path():
    from test_packing import SPLIT, assert_rel_close, logp_and_grads, make_batch, packed, padded

    model = quantize_model(tiny_gpt_oss(), "nvfp4", LoraConfig(r=4, alpha=8)).cuda()
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1)
    batch = [t.cuda() for t in make_batch(seed=8)]
    weights = torch.randn(batch[3].shape, device="cuda")
    ref, ref_g = logp_and_grads(model, lambda: padded(model, batch), weights)
    got, got_g = logp_and_grads(model, lambda: packed(model, batch, SPLIT), weights)
    assert_rel_close(got, ref, rel=1e-4, what="logp")
    for n in ref_g:
        assert_rel_close(got_g[n], ref_g[n], rel=1e-3, what=n)


def test_grouped_kernel_with_biases_matches_the_reference():
    torch.manual_seed(4)
    quant = GptOssQuantExperts.from_experts(tiny_gpt_oss().model.layers[0].mlp.experts, "mxfp4").cuda()
    quant.to(torch.bfloat16)
    quant.grouped_kernel = True
    index = torch.randint(0, E, (200, 2), device="cuda")
    weights = torch.rand(200, 2, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(200, H, device="cuda", dtype=torch.bfloat16) * 2
    assert quant._grouped_applies(hidden)
    with torch.no_grad():
        got, want = quant(hidden, index, weights).float(), quant.reference_forward(hidden, index, weights).float()
    assert torch.isfinite(got).all() and (got - want).norm() / want.norm() < 1e-2


def test_train_an_mxfp4_checkpoint_on_cuda(mxfp4_dir, tmp_path):  # noqa: F811
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 5) for b in range(1, 5)))
    cfg = load_config(None, _overrides(mxfp4_dir, data, tmp_path / "run", steps=2, **{"model.device": "cuda"}))
    Trainer(cfg).train()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([m["reward"], m["entropy"], m["loss"]])).all() for m in metrics)
