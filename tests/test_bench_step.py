"""The end-to-end step benchmark's pieces on CPU: layer-by-layer random model build, one full RL step
(rollout, reference, loss + backward, optimizer) with per-phase timings, the table with OOM rows."""

import argparse

import pytest
import torch
from transformers import Qwen2Config

from qerl.bench.step import StepRunner, build_random_policy, ceiling_table, parse_args, table
from qerl.nn import QuantLinear
from qerl.rl.distributed import DistContext

TINY = dict(vocab_size=1200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
            eos_token_id=1)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_random_policy_is_quantized_layer_by_layer_and_finite(fmt):
    model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 and all(m.weight_format == fmt for m in layers)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    logits = model(torch.randint(0, 1000, (2, 7))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_one_step_runs_every_phase_and_moves_the_adapter():
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    args = argparse.Namespace(prompt=5, completion=6, group=2, micro_batch=3, kl_beta=0.04)
    runner = StepRunner(model, args, DistContext(), sigma=1e-2)
    before = [p.detach().clone() for p in runner.params]
    t = runner.step(prompts=2, completion=6)
    assert {"rollout", "reference", "loss_backward", "optimizer", "step"} <= set(t)
    assert t["tokens"] == 2 * 2 * 6 and t["step"] >= t["rollout"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, runner.params))
    assert runner.engine.cache is None  # freed for the backward


def test_table_marks_oom_and_speedup_vs_bf16():
    _, args = parse_args(["--models", "7b", "--variants", "bf16,nvfp4", "--prompts", "2"])
    ok = dict(rollout=2.0, reference=0.5, loss_backward=1.0, optimizer=0.01, step=4.0, tokens=4096, peak_gb=30.0,
              weights_gb=15.0, world=1, model="7b", prompts=2)
    rows = [dict(ok, variant="bf16"), dict(ok, variant="nvfp4", step=2.0), dict(model="7b", variant="nf4", prompts=2,
                                                                              world=1, error="OOM")]
    text = table(rows, "cpu", args)
    assert "| 7b | nvfp4 | 2 x 8 |" in text and "2.00x" in text and "OOM" in text


def test_bad_variant_or_size_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--variants", "fp8"])
    with pytest.raises(ValueError, match="unknown model size"):
        parse_args(["--models", "9b"])


def test_gradient_check_in_one_process_is_exact_and_reports_a_noise_floor():
    """With one rank the 'distributed' gradient is the single-process one (error 0); the noise floor compares
    two micro-batch sizes of the same batch, which differ only by bf16 rounding."""
    from qerl.bench.step import check_distributed

    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    args = argparse.Namespace(prompt=5, completion=6, group=2, micro_batch=4, kl_beta=0.04)
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    err, floor = check_distributed(runner, prompts=4)
    assert err == 0.0
    assert 0.0 <= floor < 0.05


class _Recorded(StepRunner):
    """A real runner that also notes, in a list shared by the runners, which variant stepped."""

    def __init__(self, name, log, *a, **kw):
        super().__init__(*a, **kw)
        self.name, self.log = name, log

    def step(self, prompts, completion, others_bytes=0):
        self.log.append((self.name, completion))
        return super().step(prompts, completion, others_bytes)


def test_interleaved_rounds_alternate_the_order_and_report_each_order():
    """Two resident variants: one warm-up step each, then counterbalanced rounds A B, B A per repetition; each row
    carries the median per rotation, and the table gives the speedup vs bf16 in every order."""
    from qerl.bench.step import time_cells

    _, args = parse_args(["--models", "7b", "--variants", "bf16,nvfp4", "--prompts", "2", "--steps", "2",
                          "--completion", "6", "--warmup-completion", "3", "--prompt", "5", "--group", "2",
                          "--micro-batch", "2"])
    log, runners, cells = [], {}, {}
    for fmt in args.variants:
        model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
        runners[fmt] = _Recorded(fmt, log, model, args, DistContext(), sigma=0.0)
        cells[fmt] = dict(model="7b", variant=fmt, world=1, weights_gb={"bf16": 15.6, "nvfp4": 6.2}[fmt])
    rows = time_cells(runners, cells, 2, args, DistContext())
    assert log == [("bf16", 3), ("nvfp4", 3)] + [("bf16", 6), ("nvfp4", 6), ("nvfp4", 6), ("bf16", 6)] * 2
    for row in rows:
        assert row["orders"] == ["bf16,nvfp4", "nvfp4,bf16"] and row["steps_timed"] == 4
        assert len(row["step_by_order"]) == 2 and all(t > 0 for t in row["step_by_order"])
        assert [o for o, _ in row["step_samples"]] == [0, 1, 0, 1]
        assert row["step"] == sorted(t for _, t in row["step_samples"])[2]  # upper median of 4
    assert runners["nvfp4"].resident_bytes() > 0
    text = table(rows, "cpu", args)
    by_order = text.splitlines()[4].split("|")[10].strip()  # the nvfp4 row's "vs bf16 by order" cell
    assert by_order.count("x") == 2 and " / " in by_order
    assert "orders (rounds alternate between them): 1: bf16,nvfp4; 2: nvfp4,bf16" in text
    bound = ceiling_table(rows, "cpu", args)  # the 7b shapes' byte ratio on the tiny models' timings
    assert "this run (cpu," in bound and bound.count("| 7b |") == 1 and "**measured**" in bound
    assert ceiling_table([r for r in rows if r["variant"] == "bf16"], "cpu", args) == ""


def test_resident_bytes_count_optimizer_state_once_it_exists():
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    args = argparse.Namespace(prompt=5, completion=4, group=2, micro_batch=2, kl_beta=0.0)
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    before = runner.resident_bytes()
    runner.step(prompts=1, completion=4)
    lora_bytes = sum(p.numel() * p.element_size() for p in runner.params)
    assert runner.resident_bytes() >= before + 2 * lora_bytes  # AdamW's two moments per LoRA parameter


def test_order_and_steps_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--order", "random"])
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "bf16,bf16"])
